"""GPU benchmarks: extraction against a plain forward, TwoNN at 200,000 x 4096, the I-STAR step.

    python benchmarks/bench_gpu.py [--quick] [--only limits,extract,twonn,finetune] [--device cuda]
                                   [--repeats N] [--json rows.json]
                                   [--batch-tokens N] [--shard-docs N] [--no-common]

Not part of ``make bench`` (which runs on the CPU): run it where a CUDA GPU is. ``--device cpu
--quick`` runs every code path at small sizes on the CPU (a smoke run of the script itself).

- **limits**: this GPU's own ceilings, measured in the same run -- float32 (full precision, no TF32),
  TF32, bf16 and float64 matrix products (8192^2 x 8192, best of 5, CUDA events), a device-to-device
  copy (bytes read + written), device-to-host bandwidth into pinned memory, and the disk the shards
  go to (1 GiB written and fsynced). Every row's "of bound" uses them.
- **extract**: ``extract()`` on the GPU against a plain forward over the very same length-sorted,
  padded batches (pre-built, moved to the GPU batch by batch, nothing kept; synchronised at the
  end), alternated chunk by chunk (each after an untimed ``os.sync()`` and the removal of the run
  before, so that none waits on the disk for another's writes), median of ``repeats``. Models: the
  bundled all-MiniLM-L6-v2 (real weights, float32) and a BERT-large-shaped encoder (24 blocks x
  1024, random weights, bf16: the speed of a forward does not depend on the weights' values).
  Each stores every layer, then one layer; every layer is also compared with the common loop
  (benchmarks/bench_extract.py's, with the real tokens gathered on the GPU). The bound of a run
  is max(the plain forward's time, bytes stored / the disk's write rate): storing every layer of a
  fast forward is a disk-bound job. ``--batch-tokens`` (default 32,768 on a GPU) and
  ``--shard-docs`` (default 1,000: extract's) set both contenders' batches (a batch never crosses
  a shard); ``--no-common`` leaves out the common loop, whose batches they do not change.
- **twonn**: ``twonn(X, device="cuda")`` on 200,000 x 4096 float32 points (a random 20-d Gaussian
  subspace + isotropic noise, no duplicates), the default (pruning where a sample says it pays) and
  pruning forced, against blocked ``torch.cdist`` + ``topk(2)`` on the same GPU (float32, 4 GiB
  blocks: what a user would write; not exact for near-duplicates), from the same rows in host
  memory (its upload timed too; the note gives its time from rows already on the GPU).
  scikit-dimension (CPU, a full sort of every distance row) and fastwonn (a 200,000^2 float32
  matrix: 160 GB) cannot run at this size. The bound is the float32 product of half the distance
  matrix (N^2 D flops) at the measured full-precision float32 rate.
- **finetune**: benchmarks/bench_finetune.py on the GPU (I-STAR, I-STAR in fp32, CosReg and LoRA
  steps against the plain Hugging Face / peft step), with fp32 and bf16 mixed precision.
"""

from __future__ import annotations

import json
import math
import os
import shutil
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

from _common import STANDARD_HEADERS, machine_info, markdown_table, median  # noqa: E402

AREAS = ["limits", "extract", "twonn", "finetune"]
LIMITS: dict = {}


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_seconds(fn, dev, repeats: int = 5) -> float:
    """Best wall time of ``fn()`` (synchronised), after one warm-up call."""
    fn()
    _sync(dev)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def gpu_limits(dev, work: Path, quick: bool = False) -> dict:
    """The device's matrix-product rates, copy bandwidths and the disk's write rate (see module doc)."""
    import torch

    if LIMITS:
        return LIMITS
    n = 1024 if quick else 8192
    g = torch.Generator(device=dev).manual_seed(0)
    allow = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dt, tf32 in (
            ("f32_tflops", torch.float32, False),
            ("tf32_tflops", torch.float32, True),
            ("bf16_tflops", torch.bfloat16, False),
            ("f64_tflops", torch.float64, False),
        ):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            m = n // 2 if dt == torch.float64 else n
            a = torch.randn(m, m, device=dev, generator=g, dtype=torch.float32).to(dt)
            b = torch.randn(m, m, device=dev, generator=g, dtype=torch.float32).to(dt)
            LIMITS[name] = 2 * m**3 / _best_seconds(lambda a=a, b=b: a @ b, dev) / 1e12
            del a, b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    nbytes = (64 if quick else 1024) * 2**20
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    LIMITS["d2d_gbs"] = 2 * nbytes / _best_seconds(lambda: dst.copy_(src), dev) / 1e9
    host = torch.empty(src.shape, pin_memory=dev.type == "cuda")
    LIMITS["d2h_pinned_gbs"] = nbytes / _best_seconds(lambda: host.copy_(src), dev) / 1e9
    block = os.urandom(16 * 2**20)
    path = work / "disk-probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    LIMITS["disk_write_gbs"] = nbytes / (time.perf_counter() - t0) / 1e9
    path.unlink()
    if dev.type == "cuda":
        LIMITS["gpu"] = torch.cuda.get_device_name(dev)
    return LIMITS


# ---------------------------------------------------------------- extract


def bert_large_shaped(work: Path) -> Path:
    """A BERT-large-shaped encoder with random weights, saved with the bundled MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    from geomscope.model.names import bundled_minilm_dir

    tok_dir = bundled_minilm_dir()
    out = work / "bert-large-shaped"
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    BertModel(cfg).to(torch.bfloat16).save_pretrained(out)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / name, out / name)
    return out


def extract_rows(
    dev, work: Path, quick: bool, repeats: int, batch_tokens=None, shard_docs: int = 1000, common: bool = True
) -> list[dict]:
    from geomscope.model.load import load_model

    if batch_tokens is None:  # a GPU wants larger batches than extract's default
        batch_tokens = 8192 if dev.type == "cpu" else 32768
    models = [("MiniLM-L6 (bundled weights)", "bundled:minilm", "float32", 40 if quick else 5000)]
    if not quick or dev.type == "cuda":
        big = str(bert_large_shaped(work))
        models.append(("BERT-large shape (random weights)", big, "bfloat16", 40 if quick else 1000))
    rows = []
    for label, name, dtype, chunk_docs in models:
        lm = load_model(name, device=str(dev), dtype=dtype)
        rows += _extract_model_rows(
            dev, work, lm, f"{label}, {dtype}", chunk_docs, (batch_tokens, shard_docs), repeats, quick, common
        )
        del lm
        if dev.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    return rows


def _extract_model_rows(
    dev, work, lm, label, chunk_docs, batching, repeats, quick, common_loop
) -> list[dict]:
    """extract() of every layer and of the last one against the plain forward, alternated per chunk."""
    import torch
    from bench_extract import ceiling_batches, make_corpus

    from geomscope.extract.run import extract

    limits = gpu_limits(dev, work, quick)
    n_layers = lm.model.config.num_hidden_layers
    chunks = [make_corpus(chunk_docs, work / f"corpus-{i}.txt", seed=i) for i in range(2)]
    batch_tokens, shard_docs = batching
    prebuilt = [ceiling_batches(lm, c, shard_docs=shard_docs, batch_tokens=batch_tokens) for c in chunks]

    def plain(batches):
        with torch.inference_mode():
            for ids, mask in batches:
                lm.model(
                    input_ids=ids.to(dev, non_blocking=True), attention_mask=mask.to(dev, non_blocking=True)
                )
        _sync(dev)

    def common(corpus):
        """What most scripts do (bench_extract.run_common), on the GPU: input order, batches of 32
        padded, output_hidden_states, the real tokens gathered on the GPU, one HDF5 write per batch."""
        import h5py

        texts = [t for t in corpus.read_text().splitlines() if t.strip()]
        with h5py.File(work / "common.h5", "w") as f, torch.inference_mode():
            for i in range(0, len(texts), 32):
                enc = lm.tokenizer(
                    texts[i : i + 32], padding=True, truncation=True, max_length=512, return_tensors="pt"
                ).to(dev)
                hs = torch.stack(lm.model(**enc, output_hidden_states=True).hidden_states)
                rows = hs[:, enc["attention_mask"].bool()].to(torch.float16).cpu().numpy()
                f.create_dataset(f"batch_{i // 32:06d}", data=rows)

    def ours(corpus, layers):
        s = extract(
            lm, [corpus], work / "run", layers=layers, batch_tokens=batch_tokens, shard_docs=shard_docs
        )
        return s["rows"], s["bytes"]

    def settle():
        """Untimed, before each contender: the last run's files removed and every dirty page
        written, so no contender's fsyncs wait on the disk for what the one before left (the
        common loop leaves its file unsynced)."""
        shutil.rmtree(work / "run", ignore_errors=True)
        (work / "common.h5").unlink(missing_ok=True)
        os.sync()

    warm = make_corpus(16, work / "warm.txt", seed=99)
    ours(warm, "all")
    common(warm)
    plain(ceiling_batches(lm, warm, shard_docs=shard_docs, batch_tokens=batch_tokens)[0])
    spent: dict[str, list[float]] = {
        "all": [],
        "one": [],
        "plain": [],
        **({"common": []} if common_loop else {}),
    }
    stored = {"all": 0, "one": 0}
    n_tok = 0
    for _ in range(repeats):
        t = dict.fromkeys(spent, 0.0)
        n_tok, stored = 0, dict.fromkeys(stored, 0)
        for corpus, (batches, tokens) in zip(chunks, prebuilt, strict=True):
            n_tok += tokens
            for k in spent:
                settle()
                t0 = time.perf_counter()
                if k == "plain":
                    plain(batches)
                elif k == "common":
                    common(corpus)
                else:
                    rows_k, bytes_k = ours(corpus, "all" if k == "all" else str(n_layers))
                    stored[k] += bytes_k
                    assert rows_k == tokens, (rows_k, tokens)
                t[k] += time.perf_counter() - t0
        for k in spent:
            spent[k].append(t[k])
    med = {k: median(v) for k, v in spent.items()}
    rows = []
    each = "; seconds per repeat: " + ", ".join(
        f"{k} " + "/".join(f"{t:.2f}" for t in v) for k, v in spent.items()
    )
    for k in ("all", "one"):
        bound = max(med["plain"], stored[k] / (limits["disk_write_gbs"] * 1e9))
        what = f"all {n_layers + 1} layers" if k == "all" else f"one layer ({n_layers})"
        rows.append(
            {
                "benchmark": f"extract on {dev.type}, {label}, {what}: tokens/s vs a plain forward",
                "geomscope": round(n_tok / med[k]),
                "alternative": round(n_tok / med["plain"]),
                "ratio": round(med["plain"] / med[k], 3),
                "target": ">= 0.95" if k == "one" else "-",
                "of bound": round(bound / med[k], 3),
                "note": f"{len(chunks) * chunk_docs} sentences, {n_tok:,} tokens, {stored[k] / 1e9:.2f} GB "
                f"stored (float16) per repeat; bound = max(plain forward {med['plain']:.2f} s, bytes / disk "
                f"{limits['disk_write_gbs']:.2f} GB/s); median of {repeats}; --batch-tokens {batch_tokens} "
                f"--shard-docs {shard_docs}" + each,
            }
        )
    if not common_loop:
        return rows
    rows.append(
        {
            "benchmark": f"extract on {dev.type}, {label}, all {n_layers + 1} layers: vs the common loop",
            "geomscope": round(n_tok / med["all"]),
            "alternative": round(n_tok / med["common"]),
            "ratio": round(med["common"] / med["all"], 3),
            "target": "> 1",
            "of bound": None,
            "note": "the common loop: input order, batches of 32 padded, output_hidden_states, real tokens "
            "gathered and cast on the GPU, one HDF5 dataset per batch (no checks, no resume)",
        }
    )
    return rows


# ---------------------------------------------------------------- twonn


def make_points(n: int, d: int, dev, intrinsic: int = 20, noise: float = 0.1):
    """float32 (n, d) points on ``dev``: a random ``intrinsic``-d Gaussian subspace + isotropic noise."""
    import torch

    g = torch.Generator(device=dev).manual_seed(0)
    z = torch.randn(n, intrinsic, device=dev, generator=g)
    basis = torch.randn(intrinsic, d, device=dev, generator=g) / math.sqrt(intrinsic)
    return z @ basis + noise * torch.randn(n, d, device=dev, generator=g)


def cdist_topk_twonn(xt, budget: int) -> float:
    """The blocked torch.cdist + topk(2) a user would write, on xt's device (not exact for ties)."""
    import torch

    from geomscope.metrics.twonn import fit_mu

    n = xt.shape[0]
    block = max(64, min(n, budget // (4 * n)))
    r1 = torch.empty(n, dtype=torch.float32, device=xt.device)
    r2 = torch.empty(n, dtype=torch.float32, device=xt.device)
    for s in range(0, n, block):
        e = min(s + block, n)
        dist = torch.cdist(xt[s:e], xt)
        dist[torch.arange(e - s, device=xt.device), torch.arange(s, e, device=xt.device)] = math.inf
        v = dist.topk(2, dim=1, largest=False).values
        r1[s:e], r2[s:e] = v[:, 0], v[:, 1]
        del dist
    return fit_mu((r2 / r1).double().cpu().numpy())[0]


def twonn_rows(dev, work: Path, quick: bool, repeats: int) -> list[dict]:
    import torch

    from geomscope.metrics.twonn import twonn

    n, d = (4000, 256) if quick else (200_000, 4096)
    limits = gpu_limits(dev, work, quick)
    xt = make_points(n, d, dev)
    x = xt.cpu().numpy()  # what a user hands twonn: rows in host memory
    timings: dict[str, list[float]] = {"default": [], "pruned": [], "cdist": [], "cdist_host": []}
    dims: dict[str, float] = {}
    info: dict = {}

    def run(k, x, xt):
        if k == "default":
            res = twonn(x, device=str(dev))
            info.update(res.neighbor_info)
            return res.dimension
        if k == "pruned":
            return twonn(x, device=str(dev), prune=True).dimension
        if k == "cdist_host":  # from the same host rows geomscope gets: the upload included
            return cdist_topk_twonn(torch.from_numpy(x).to(dev), 4 * 2**30)
        return cdist_topk_twonn(xt, 4 * 2**30)

    warm = n // 10  # every contender's kernels loaded and tuned on a tenth of the rows, untimed
    for k in timings:
        run(k, x[:warm], xt[:warm])
    for _ in range(repeats):
        for k in timings:
            _sync(dev)
            t0 = time.perf_counter()
            dims[k] = run(k, x, xt)
            _sync(dev)
            timings[k].append(time.perf_counter() - t0)
    med = {k: median(v) for k, v in timings.items()}
    bound = n * n * d / (limits["f32_tflops"] * 1e12)
    note = (
        f"{n:,} x {d} float32, a 20-d subspace + noise 0.1, rows handed over in host memory (duplicate "
        f"check, upload and fit included); d = {dims['default']:.4f} (pruned {dims['pruned']:.4f}, cdist "
        f"{dims['cdist']:.4f}); bound: N^2 D flops at {limits['f32_tflops']:.1f} TFLOP/s (float32, no "
        f"TF32) = {bound:.2f} s; median of {repeats}"
    )

    def row(k, what, target, note):  # seconds: geomscope's contender k against cdist from host rows
        return {
            "benchmark": f"TwoNN on {dev.type}, {n:,} x {d}: {what} vs blocked cdist + topk",
            "geomscope": round(med[k], 3),
            "alternative": round(med["cdist_host"], 3),
            "ratio": round(med["cdist_host"] / med[k], 3),
            "target": target,
            "of bound": round(bound / med[k], 3),
            "note": note,
        }

    rows = [
        row(
            "default",
            "geomscope (default)",
            "> 1",
            note + f"; the alternative from the same host rows (upload included; {med['cdist']:.2f} s "
            "from rows already on the GPU); search " + json.dumps(info, default=str)[:300],
        ),
        row(
            "pruned", "pruning forced", "-", "exact either way; on a GPU the automatic choice is brute force"
        ),
    ]
    return rows


# ---------------------------------------------------------------- finetune


def finetune_rows(dev, work: Path, quick: bool, repeats: int) -> list[dict]:
    """bench_finetune's rows (its own repeats: 7 of 3 steps, 3 of 1 with --quick)."""
    import bench_finetune

    rows = []
    for precision in ("fp32", "bf16"):
        for r in bench_finetune.run(quick=quick, threads=None, device=str(dev), precision=precision):
            rows.append(r)
    return rows


def main(argv=None) -> int:
    import argparse
    import traceback

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--only", default="", help="comma list of areas: " + ",".join(AREAS))
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3; 1 with --quick)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows, limits and machine here")
    ap.add_argument("--batch-tokens", type=int, default=None, help="extract: padded tokens a batch (32768)")
    ap.add_argument("--shard-docs", type=int, default=1000, help="extract: documents a shard (1000)")
    ap.add_argument("--no-common", action="store_true", help="extract: leave out the common loop")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --device cpu --quick for a smoke run", file=sys.stderr)
        return 2
    areas = [a.strip() for a in args.only.split(",") if a.strip()] or AREAS
    repeats = args.repeats or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    rows: list[dict] = []
    failed = []
    try:
        for area in areas:
            t0 = time.perf_counter()
            try:
                if area == "limits":
                    gpu_limits(dev, work, args.quick)
                elif area == "extract":
                    rows += extract_rows(
                        dev, work, args.quick, repeats, args.batch_tokens, args.shard_docs, not args.no_common
                    )
                else:
                    rows += {"twonn": twonn_rows, "finetune": finetune_rows}[area](
                        dev, work, args.quick, repeats
                    )
            except Exception:
                traceback.print_exc()
                failed.append(area)
            print(f"[{area}] {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            if args.json:  # after every area: a later one that runs out of time loses nothing
                args.json.write_text(
                    json.dumps(
                        {"machine": machine_info(), "limits": LIMITS, "rows": rows, "failed": failed},
                        indent=1,
                    )
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown_table(rows, STANDARD_HEADERS))
    print(
        "\nlimits: "
        + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in LIMITS.items()})
    )
    print("machine: " + json.dumps(machine_info()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
