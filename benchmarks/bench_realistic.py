"""Realistic models: extraction of one and of every layer against the forward pass, whole processes.

    python benchmarks/bench_realistic.py [--device cuda] [--quick] [--only extract,istar]
        [--models pythia-1.4b,llama-1b] [--tokens N] [--batch-tokens N] [--shard-docs N]
        [--sample N] [--repeats N] [--json rows.json] [--markdown table.md]

Not part of ``make bench``: run it where a CUDA GPU is (a few minutes per model at the default
2,000,000 tokens on an H100: six processes, each starting and loading the model, and a 1.4B
forward of about 15 s by cost_model.py). ``--device cpu --quick`` runs every contender at tiny shapes on the
CPU (``--in-process``: each in this process rather than a fresh one, which saves the imports;
tests/test_benchmarks_realistic.py runs it in CI).

**Models**, built from their configs with random weights in bfloat16 (the speed of a forward does
not depend on the values) and the bundled MiniLM's WordPiece tokenizer (its ids fit either
vocabulary; ``model_max_length`` raised to 2,048):

- ``pythia-1.4b``: GPT-NeoX, 24 blocks x 2048, 16 heads, MLP 8192, rotary on a quarter of each
  head, parallel residual (Pythia-1.4B's shape);
- ``llama-1b``: Llama, 16 blocks x 2048, 32 query and 8 key/value heads, MLP 8192, tied embeddings
  of 128,256 (Llama-3.2-1B's shape).

``--quick`` shrinks both to 2 blocks x 64.

**Text**: documents of 128 to 1,024 tokens (uniform; ``--quick``: 16 to 64), words drawn from the
tokenizer's whole-word vocabulary, one word one token, ``--tokens`` in all (default 2,000,000;
``--quick`` 3,000).

**Contenders**, each a fresh process (``python -c`` of this file's ``child``), timed from start to
exit and, inside, over its own loop; ``--repeats`` runs each that many times, alternating
contenders, medians:

- ``plain``: the model's forward over the very batches extract runs (the same tokenization,
  length order and cuts, built before the clock starts), nothing kept; synchronised at the end.
- ``common``: what most scripts do: documents in input order, batches of 32 padded to the
  longest, ``output_hidden_states=True``, the last block's real tokens gathered on the device, cast
  to float16 and copied to the host, one HDF5 dataset per batch.
- ``extract one``: ``geomscope extract --layers L`` (L = the last block).
- ``extract sample``: ``geomscope extract --layers all --keep sample:5000``, float64 products.
- ``extract sample split``: the same with ``--products split``.
- ``score``: ``geomscope score`` of the float64 sample run.

Each row gives the contender's tokens per second over its own loop (extract: the summary's
seconds, which include the tokenizer and the store's last fsync), its ratio to the plain forward's,
its whole-process seconds and their ratio, the process's peak GPU memory
(``torch.cuda.max_memory_allocated``) and peak resident host memory, and the bytes it left on
disk. Targets: one layer >= 0.95 of the forward's tokens/s; every layer with ``--keep sample``
within 1.1x of its time (>= 0.91).

**istar**: a training step of the ``llama-1b`` shape with its LM head, next-token loss, bf16 mixed
precision, rows of 1,024 tokens (``--quick``: 32) packed from the same text: Hugging Face's plain
step (``model(..., labels=ids).loss.backward(); AdamW.step()``) against geomscope's
``train_step`` (the ``finetune --task causal-lm`` step) with I-STAR over every block (float64 and
float32 covariance; C0: the batch's trace-matched identity), CosReg on the last block and no
penalty, alternating; medians of seconds per step. Target: I-STAR <= 1.05x the plain step.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

AREAS = ("extract", "istar")
SHAPES = {
    "pythia-1.4b": (
        "gpt_neox",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "intermediate_size": 8192,
            "vocab_size": 50304,
            "rotary_pct": 0.25,
            "use_parallel_residual": True,
        },
    ),
    "llama-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
        },
    ),
}
QUICK_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 30522}
MAX_POSITIONS = 2048
TABLE_HEADERS = [
    "model",
    "contender",
    "tokens",
    "tokens/s",
    "vs plain",
    "target",
    "process s",
    "vs plain process",
    "GPU peak GiB",
    "host peak GiB",
    "on disk GB",
]


# ---------------------------------------------------------------- inputs


def build_model(name: str, work: Path, quick: bool, device: str, head: bool = False) -> Path:
    """``name``'s shape (SHAPES; QUICK_SHAPE with ``quick``) with random bf16 weights, saved with the
    bundled MiniLM's tokenizer under ``work``; the directory (built once)."""
    import torch
    import transformers

    from geomscope.model.names import bundled_minilm_dir

    kind, shape = SHAPES[name]
    out = work / (name + ("-lm" if head else ""))
    if (out / "config.json").exists():
        return out
    shape = {**shape, **QUICK_SHAPE} if quick else dict(shape)
    if quick:
        shape["num_attention_heads"] = 4
        shape.pop("num_key_value_heads", None)
    config_cls = {"gpt_neox": transformers.GPTNeoXConfig, "llama": transformers.LlamaConfig}[kind]
    cfg = config_cls(max_position_embeddings=MAX_POSITIONS, **shape)
    model_cls = {
        ("gpt_neox", False): transformers.GPTNeoXModel,
        ("gpt_neox", True): transformers.GPTNeoXForCausalLM,
        ("llama", False): transformers.LlamaModel,
        ("llama", True): transformers.LlamaForCausalLM,
    }[kind, head]
    torch.manual_seed(0)
    with torch.device(device):  # a GPU draws 1.4B random weights in a second, a CPU in a minute
        model = model_cls(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    tok = bundled_minilm_dir()
    for f in ("vocab.txt", "tokenizer.json", "special_tokens_map.json"):
        shutil.copy(tok / f, out / f)
    tcfg = json.loads((tok / "tokenizer_config.json").read_text())
    tcfg["model_max_length"] = MAX_POSITIONS
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    del model
    return out


def make_documents(path: Path, tokens: int, lo: int, hi: int, seed: int = 0) -> Path:
    """Documents of ``lo``..``hi`` tokens (with [CLS] and [SEP]), one per line, ``tokens`` in all:
    whole words of the tokenizer's vocabulary, so one word is one token."""
    from geomscope.model.names import bundled_minilm_dir

    vocab = (bundled_minilm_dir() / "vocab.txt").read_text().splitlines()
    words = [w for w in vocab if w.isalpha() and w.isascii() and w.islower() and len(w) >= 3]
    rng = random.Random(seed)
    lines, total = [], 0
    while total < tokens:
        n = rng.randint(lo, hi)
        lines.append(" ".join(rng.choices(words, k=n - 2)))
        total += n
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- children (one process each)


def _peaks(device: str) -> dict:
    import torch

    gpu = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return {"gpu_peak_gib": gpu, "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def child_plain(spec: dict) -> dict:
    """The forward over extract's own batches (bench_extract.ceiling_batches), nothing kept."""
    import torch
    from bench_extract import ceiling_batches

    from geomscope.model.load import load_model

    dev = spec["device"]
    lm = load_model(spec["model"], device=dev, dtype="bfloat16")
    batches, tokens = ceiling_batches(
        lm, Path(spec["corpus"]), shard_docs=spec["shard_docs"], batch_tokens=spec["batch_tokens"]
    )
    if dev.startswith("cuda"):  # page-locked, as extract uploads them: the copies do not wait
        batches = [(ids.pin_memory(), mask.pin_memory()) for ids, mask in batches]
    with torch.inference_mode():  # one untimed batch: kernels chosen and loaded
        ids, mask = batches[0]
        lm.model(input_ids=ids.to(dev), attention_mask=mask.to(dev))
    _sync(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            lm.model(input_ids=ids.to(dev, non_blocking=True), attention_mask=mask.to(dev, non_blocking=True))
    _sync(dev)
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, **_peaks(dev)}


def child_common(spec: dict) -> dict:
    """The usual script (module docstring), the last block to host, one HDF5 dataset per batch."""
    import h5py
    import torch
    from transformers import AutoModel, AutoTokenizer

    dev = spec["device"]
    model = AutoModel.from_pretrained(spec["model"], dtype=torch.bfloat16).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    texts = [t for t in Path(spec["corpus"]).read_text().splitlines() if t.strip()]
    layer = model.config.num_hidden_layers
    t0 = time.perf_counter()
    tokens = 0
    with h5py.File(spec["out"], "w") as f, torch.inference_mode():
        for i in range(0, len(texts), 32):
            enc = tok(texts[i : i + 32], padding=True, truncation=True, return_tensors="pt").to(dev)
            hs = model(**enc, output_hidden_states=True).hidden_states[layer]
            rows = hs[enc["attention_mask"].bool()].to(torch.float16).cpu().numpy()
            f.create_dataset(f"batch_{i // 32:06d}", data=rows)
            tokens += len(rows)
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, **_peaks(spec["device"])}


def child_cli(spec: dict) -> dict:
    """``geomscope ARGV --json`` in this process: its summary, and its time when it gives one."""
    import contextlib
    import io

    from geomscope.cli import main

    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        try:
            main(spec["argv"])
            code = 0
        except SystemExit as e:  # main() always ends with sys.exit
            code = e.code
    wall = time.perf_counter() - t0
    if code:
        raise RuntimeError(f"geomscope {' '.join(spec['argv'])} exited {code}")
    out = buf.getvalue().strip().splitlines()
    summary = json.loads(out[-1]) if out and out[-1].startswith("{") else {}
    seconds = summary.get("seconds", wall)
    return {"seconds": seconds, "tokens": summary.get("rows"), **_peaks(spec["device"])}


CHILDREN = {"plain": child_plain, "common": child_common, "cli": child_cli}


def child(spec_json: str) -> None:
    """Entry point of a contender's process: run ``spec["kind"]``, write its result to ``spec["result"]``."""
    spec = json.loads(spec_json)
    Path(spec["result"]).write_text(json.dumps(CHILDREN[spec["kind"]](spec)))


def run_child(spec: dict, work: Path, in_process: bool = False) -> dict:
    """``spec`` in a fresh process (``in_process``: in this one, a smoke run's shortcut): its result,
    with the process's wall time."""
    if in_process:
        t0 = time.perf_counter()
        out = CHILDREN[spec["kind"]](spec)
        return {**out, "process_seconds": time.perf_counter() - t0}
    result = work / "child-result.json"
    result.unlink(missing_ok=True)
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_realistic as b; b.child(sys.argv[1])"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps({**spec, "result": str(result)})],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['kind']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(result.read_text()), "process_seconds": wall}


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ---------------------------------------------------------------- extract rows


def contenders(model: Path, corpus: Path, work: Path, args, layer: int) -> dict[str, dict]:
    """Each contender's spec and the path whose bytes it leaves on disk."""
    dev = args.device
    common = ["--dtype", "bfloat16", "--device", dev, "--batch-tokens", str(args.batch_tokens)]
    common += ["--shard-docs", str(args.shard_docs), "--json", "--quiet", "--overwrite"]
    sample = ["--layers", "all", "--keep", f"sample:{args.sample}"]

    def extract(out, *extra):
        return {
            "kind": "cli",
            "argv": ["extract", str(model), str(corpus), "--out", str(work / out)] + common + list(extra),
            "device": dev,
            "_out": work / out,
        }

    base = {"model": str(model), "corpus": str(corpus), "device": dev}
    return {
        "plain": {**base, "kind": "plain", "shard_docs": args.shard_docs, "batch_tokens": args.batch_tokens},
        "common": {**base, "kind": "common", "out": str(work / "common.h5"), "_out": work / "common.h5"},
        "extract one": extract("run-one", "--layers", str(layer)),
        "extract sample": extract("run-sample", *sample),
        "extract sample split": extract("run-split", *sample, "--products", "split"),
        "score": {
            "kind": "cli",
            "argv": ["score", str(work / "run-sample"), "--out", str(work / "report"), "--quiet"],
            "device": dev,
            "_out": work / "report",
        },
    }


TARGETS = {"extract one": ">= 0.95", "extract sample": ">= 0.91", "extract sample split": ">= 0.91"}


def extract_rows(name: str, args, work: Path) -> list[dict]:
    model = build_model(name, work, args.quick, args.device)
    lo, hi = (16, 64) if args.quick else (128, 1024)
    corpus = make_documents(work / "docs.txt", args.tokens, lo, hi)
    layer = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    specs = contenders(model, corpus, work, args, layer)
    runs: dict[str, list[dict]] = {k: [] for k in specs}
    for _ in range(args.repeats):
        for k, spec in specs.items():  # alternating; score reads the sample run just written
            os.sync()
            res = run_child({key: v for key, v in spec.items() if key != "_out"}, work, args.in_process)
            res["bytes"] = disk_bytes(spec["_out"]) if "_out" in spec else 0
            runs[k].append(res)
            print(
                f"[{name}] {k}: {res['seconds']:.2f} s, process {res['process_seconds']:.1f} s",
                file=sys.stderr,
            )
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("seconds", "process_seconds")}
        for k, v in runs.items()
    }
    plain = med["plain"]
    tokens = runs["plain"][0]["tokens"]
    rows = []
    for k, v in runs.items():
        last = v[-1]
        rows.append(
            {
                "model": name + (" (quick)" if args.quick else ""),
                "contender": k,
                "tokens": tokens,
                "measured tokens": last["tokens"],
                "tokens/s": tokens / med[k]["seconds"],
                "vs plain": plain["seconds"] / med[k]["seconds"],
                "target": TARGETS.get(k, "-"),
                "process s": med[k]["process_seconds"],
                "vs plain process": plain["process_seconds"] / med[k]["process_seconds"],
                "GPU peak GiB": last["gpu_peak_gib"],
                "host peak GiB": last["host_peak_gib"],
                "on disk GB": last["bytes"] / 1e9,
                "seconds": [r["seconds"] for r in v],
            }
        )
    return rows


# ---------------------------------------------------------------- the I-STAR step


def istar_rows(args, work: Path) -> list[dict]:
    """The step of a 1B decoder with its LM head, geomscope's against Hugging Face's (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from geomscope.train import engine
    from geomscope.train.regularizers import CosReg, IStar
    from geomscope.train.step import train_step

    path = build_model("llama-1b", work, args.quick, args.device, head=True)
    seq, n_rows = (32, 2) if args.quick else (1024, 8)
    lo, hi = (16, 64) if args.quick else (128, 1024)
    corpus = make_documents(work / "lm-docs.txt", 4 * seq * n_rows, lo, hi, seed=1)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [t for line in corpus.read_text().splitlines() for t in tok(line)["input_ids"]]
    batches = []
    for b in range(3 if args.quick else 4):
        block = torch.tensor(ids[b * seq * n_rows : (b + 1) * seq * n_rows]).reshape(n_rows, seq)
        batches.append(
            {"input_ids": block, "attention_mask": torch.ones_like(block), "labels": block.clone()}
        )
    eng = engine.start(args.device, "bf16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(eng.d.device)
    model, opt, _ = eng.prepare(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-6))
    blocks = list(range(1, model.config.num_hidden_layers + 1))
    regs = {
        "I-STAR, every block, float64 covariance": IStar(blocks, 0.2, None),
        "I-STAR, every block, float32 covariance": IStar(blocks, 0.2, None, dtype=torch.float32),
        "CosReg, last block": CosReg(-1),
        "no penalty (geomscope's step)": None,
    }
    predicted = n_rows * (seq - 1)

    def plain():
        model.train()
        for b in batches:
            b = {k: v.to(eng.d.device) for k, v in b.items()}
            with eng.autocast():
                loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(args.device)

    def ours(reg):
        def f():
            for b in batches:
                train_step(model, b, predicted, reg, 0.0 if reg is None else 1.0, opt, eng)
            _sync(args.device)

        return f

    fns = {"plain": plain, **{k: ours(r) for k, r in regs.items()}}
    for f in fns.values():
        f()  # warm-up: kernels, optimizer state
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max(args.repeats, 3)):
        for k in regs:  # the plain step before each contender
            for name in ("plain", k):
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t0) / len(batches))
    med = {k: statistics.median(v) for k, v in times.items()}
    shape = "llama-1b" + (" (quick)" if args.quick else "")
    return [
        {
            "benchmark": f"finetune --task causal-lm step, {shape}, bf16, {n_rows} x {seq} tokens: {k} "
            "vs the plain Hugging Face step",
            "geomscope": med[k],
            "alternative": med["plain"],
            "ratio": med[k] / med["plain"],
            "target": "<= 1.05" if k.startswith("I-STAR") else "-",
            "of bound": med["plain"] / med[k],
            "note": f"s/step, median of {len(times[k])} x {len(batches)} steps on {args.device}",
        }
        for k in regs
    ]


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    import argparse

    from _common import STANDARD_HEADERS, machine_info, markdown_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and text: a smoke run")
    ap.add_argument("--only", default="", help="comma list of: " + ",".join(AREAS))
    ap.add_argument("--models", default=",".join(SHAPES), help="comma list of: " + ",".join(SHAPES))
    ap.add_argument("--tokens", type=int, default=None, help="tokens of text (2,000,000; --quick 3,000)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="extract's (32,768; --quick 512)")
    ap.add_argument("--shard-docs", type=int, default=None, help="extract's (1,000; --quick 40)")
    ap.add_argument("--sample", type=int, default=5000, help="--keep sample:N (5,000)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each contender, alternating (1)")
    ap.add_argument("--in-process", action="store_true", help="contenders in this process (a smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows, machine and failures here")
    ap.add_argument("--markdown", type=Path, default=None, help="write the tables here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device here; run with --device cpu --quick for a smoke run", file=sys.stderr
            )
            return 2
    args.tokens = args.tokens or (3000 if args.quick else 2_000_000)
    args.batch_tokens = args.batch_tokens or (512 if args.quick else 32768)
    args.shard_docs = args.shard_docs or (40 if args.quick else 1000)
    if args.quick:
        args.sample = min(args.sample, 200)
    areas = [a for a in args.only.split(",") if a] or list(AREAS)
    rows, step_rows, failed = [], [], []
    work = Path(tempfile.mkdtemp(prefix="bench-realistic-"))
    try:
        for area in areas:
            names = [m for m in args.models.split(",") if m] if area == "extract" else ["llama-1b"]
            for name in names:
                try:
                    if area == "extract":
                        rows += extract_rows(name, args, work / name)
                    else:
                        step_rows += istar_rows(args, work / "istar")
                except Exception as e:  # a lease's run keeps what it measured
                    failed.append(f"{area} {name}: {type(e).__name__}: {e}"[:2000])
                    print(failed[-1], file=sys.stderr)
                if args.json:
                    args.json.write_text(
                        json.dumps(
                            {"machine": machine_info(), "rows": rows, "istar": step_rows, "failed": failed}
                        )
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = markdown_table(rows, TABLE_HEADERS) + "\n\n" + markdown_table(step_rows, STANDARD_HEADERS)
    text += "\n\nmachine: " + json.dumps(machine_info())
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
