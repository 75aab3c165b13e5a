"""Benchmark: `geomscope extract` on the bundled all-MiniLM-L6-v2 (all 7 hidden states, float16 store).

Contenders, alternated on the same sentences (sample_data/sentences.txt repeated and shuffled), model
loaded once outside the timings:

- geomscope: ``extract()`` end to end -- scan + hash of the input, tokenization, length-bucketed
  batches, forward, real-token gather, float16 cast, NaN check, chunk-aligned HDF5 appends, fsync,
  sha256 of every shard, atomic manifest updates;
- ceiling: a plain forward pass (``model(input_ids, attention_mask)``) over the very same
  length-sorted padded batches, pre-built, nothing stored;
- keep: ``extract(keep="sample:2000")``, the per-shard accumulators and sample of a corpus-scale run;
- common loop: what most scripts do -- input order, fixed batch of 32 padded to the longest,
  ``output_hidden_states=True``, every layer to numpy, real tokens written as one HDF5 dataset per batch.
- forward stubbed: ``extract()`` with the model's forward replaced by a stand-in that returns
  hidden states of the right shapes at once (:func:`forward_stubbed`), every layer and one, against
  the plain forward: the host's own work, the rate a GPU whose forward is faster waits on.

Throughput is real (non-padding) tokens per second.  Peak RSS of ``extract`` is measured in fresh
processes at 1x and 10x the text, three pairs each, median ratio: the same sentences ten times over
(the same batches again: what geomscope itself adds), and ten times as many different sentences
(larger batches turn up, and the forward's own peak grows with them: :func:`rss_rows`).
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _common import bench_args, median, print_rows  # noqa: E402

SENTENCES = ROOT / "sample_data" / "sentences.txt"
BATCH_TOKENS = 8192
COMMON_BATCH = 32
KEEP_SAMPLE = 2000


def make_corpus(n: int, path: Path, seed: int = 0) -> Path:
    lines = [x for x in SENTENCES.read_text().splitlines() if x.strip()]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        block = list(lines)
        rng.shuffle(block)
        out.extend(block)
    path.write_text("\n".join(out[:n]) + "\n")
    return path


def ceiling_batches(lm, path: Path, shard_docs: int = 1000, batch_tokens: int = BATCH_TOKENS):
    """The padded tensors extract() would run, built ahead of time (same tokenization, order and cuts)."""
    import torch

    from geomscope.extract.batching import length_order, pad_right, plan_batches, tokenize

    texts = [t for t in path.read_text().splitlines() if t.strip()]
    pad = lm.tokenizer.pad_token_id or 0
    out, tokens = [], 0
    for s in range(0, len(texts), shard_docs):
        docs = tokenize(lm.tokenizer, list(enumerate(texts[s : s + shard_docs], s)), lm.max_length)
        for b in plan_batches(length_order(docs), batch_tokens):
            ids, mask = pad_right(b, pad)
            out.append((torch.from_numpy(ids), torch.from_numpy(mask)))
            tokens += int(mask.sum())
    return out, tokens


def run_ceiling(lm, batches) -> None:
    import torch

    with torch.inference_mode():
        for ids, mask in batches:
            lm.model(input_ids=ids, attention_mask=mask)


def run_common(lm, path: Path, h5_path: Path) -> int:
    """The usual script: input order, fixed batch size, all hidden states to numpy, one write per batch."""
    import h5py
    import numpy as np
    import torch

    texts = [t for t in path.read_text().splitlines() if t.strip()]
    tokens = 0
    with h5py.File(h5_path, "w") as f, torch.no_grad():
        for i in range(0, len(texts), COMMON_BATCH):
            enc = lm.tokenizer(
                texts[i : i + COMMON_BATCH],
                padding=True,
                truncation=True,
                max_length=512,
                return_tensors="pt",
            )
            out = lm.model(**enc, output_hidden_states=True)
            hs = np.stack([h.numpy() for h in out.hidden_states])  # (L, B, T, D)
            mask = enc["attention_mask"].numpy().astype(bool)
            f.create_dataset(f"batch_{i // COMMON_BATCH:06d}", data=hs[:, mask].astype(np.float16))
            tokens += int(mask.sum())
    return tokens


def run_geomscope(lm, path: Path, out: Path, layers: str = "all", **kw) -> dict:
    from geomscope.extract.run import extract

    return extract(lm, [path], out, layers=layers, batch_tokens=BATCH_TOKENS, **kw)


@contextmanager
def forward_stubbed(lm):
    """``lm.hidden_states`` replaced by a stand-in that returns hidden states of the right shapes at
    once (views of one random buffer): extraction with an infinitely fast forward, which leaves the
    host's own work -- what a fast GPU waits on."""
    import torch

    buffer = torch.empty(0)

    def stand_in(input_ids, attention_mask, wanted):
        nonlocal buffer
        b, t = input_ids.shape
        size = b * t * lm.hidden_size
        if buffer.numel() < size or buffer.device != input_ids.device:  # where the model's would be
            buffer = torch.randn(size, device=input_ids.device)
        h = buffer[:size].view(b, t, lm.hidden_size)
        return [h] * (lm.n_hidden_states if wanted is None else len(wanted))

    lm.hidden_states = stand_in
    try:
        yield
    finally:
        del lm.hidden_states  # the class's own method again


def host_rows(lm, chunks, work: Path, repeats: int, forward_tps: float) -> list[dict]:
    """Extraction with the forward stubbed (:func:`forward_stubbed`), every layer and one, against
    the plain forward's tokens/s on this CPU."""
    rows = []
    for layers, what in (("all", "all 7 layers"), ("6", "one layer (6)")):
        times, n_tok = [], 0
        with forward_stubbed(lm):
            for _ in range(repeats):
                spent, n_tok = 0.0, 0
                for c in chunks:
                    shutil.rmtree(work / "stub", ignore_errors=True)
                    t0 = time.perf_counter()
                    n_tok += run_geomscope(lm, c, work / "stub", layers=layers)["rows"]
                    spent += time.perf_counter() - t0
                times.append(spent)
        tps = n_tok / median(times)
        rows.append(
            {
                "benchmark": f"extract with the forward stubbed (the host's own work), {what}, tokens/s",
                "geomscope": round(tps),
                "alternative": round(forward_tps),
                "ratio": round(tps / forward_tps, 2),
                "target": "-",
                "note": "alternative = the plain forward on this CPU; the stand-in returns views of one "
                "buffer, leaving tokenizing, planning, padding, the float16 cast and gather (a GPU "
                "does these two itself), the appends and the checksums: a GPU whose forward runs "
                f"faster than this waits on this host (an H100 runs MiniLM at ~900,000); median of {repeats}",
            }
        )
    return rows


def _vm_hwm_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_corpus(n_docs: int, work: Path, base_docs: int, repeat: bool) -> Path:
    """The text of a peak-RSS run: the ``base_docs``-sentence corpus ``n_docs // base_docs`` times over
    (``repeat``: the same shards, so the same batch shapes, again and again), or ``n_docs`` sentences
    shuffled afresh (other shards: the larger text holds larger batches)."""
    if not repeat:
        return make_corpus(n_docs, work / f"rss-{n_docs}.txt")
    once = make_corpus(base_docs, work / f"rss-{base_docs}.txt").read_text()
    path = work / f"rss-{n_docs}-repeated.txt"
    path.write_text(once * (n_docs // base_docs))
    return path


def isolated_extract(n_docs: int, workdir: str, shard_docs: int = 1000, base_docs: int = 0) -> dict:
    """In a fresh process: load MiniLM, reset the peak-RSS mark, extract ``n_docs`` sentences (with
    ``base_docs``, that many sentences over and over: :func:`rss_corpus`).

    Returns the peak RSS of the extraction phase (Linux VmHWM after ``clear_refs``; the parent also
    gets the whole process's peak, model loading included).
    """
    work = Path(workdir)
    src = rss_corpus(n_docs, work, base_docs, repeat=bool(base_docs))
    from geomscope.extract.run import extract
    from geomscope.model.load import load_model

    lm = load_model("bundled:minilm", device="cpu")
    loaded = _vm_hwm_mb()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    out = work / f"rss-run-{n_docs}-{base_docs}"
    s = extract(lm, [src], out, batch_tokens=BATCH_TOKENS, shard_docs=shard_docs)
    shutil.rmtree(out, ignore_errors=True)
    return {"rows": s["rows"], "extract_peak_mb": _vm_hwm_mb(), "after_load_peak_mb": loaded}


def isolated_plain(n_docs: int, workdir: str, shard_docs: int = 1000) -> dict:
    """In a fresh process: load MiniLM, reset the peak-RSS mark, run only the forward passes over the
    batches extract() would run (nothing kept or stored): the allocator's share of the memory profile."""
    import torch

    work = Path(workdir)
    src = make_corpus(n_docs, work / f"plain-{n_docs}.txt")
    from geomscope.model.load import load_model

    lm = load_model("bundled:minilm", device="cpu")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    batches, tokens = ceiling_batches(lm, src, shard_docs)
    with torch.inference_mode():
        for ids, mask in batches:
            lm.model(input_ids=ids, attention_mask=mask)
    return {"rows": tokens, "extract_peak_mb": _vm_hwm_mb()}


def _median_pair(target, docs: int, work: Path, shard: int, repeats: int, base_docs: int = 0):
    """``repeats`` fresh-process pairs of ``target`` at 1x and 10x ``docs`` sentences, alternating (the
    peak of one process varies by a few % with where the heap's blocks land); returns the pair of
    median 10x / 1x ratio and every ratio."""
    from _common import run_isolated

    pairs = [
        {k: run_isolated(target, k * docs, str(work), shard, base_docs) for k in (1, 10)}
        for _ in range(repeats)
    ]
    ratios = [
        p[10]["result"]["extract_peak_mb"] / max(p[1]["result"]["extract_peak_mb"] or 0, 1e-9) for p in pairs
    ]
    return pairs[sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]], ratios


def _largest_attention(lm, path: Path, shard: int) -> int:
    """max over the batches of batch size x padded length^2: what a forward's attention scores hold."""
    batches, _ = ceiling_batches(lm, path, shard)
    return max(ids.shape[0] * ids.shape[1] ** 2 for ids, _ in batches)


def rss_rows(lm, work: Path, docs: int, shard: int, repeats: int) -> list[dict]:
    """Peak RSS of extract at 10x the text over 1x, in fresh processes (VmHWM reset after the model
    loads).  Two kinds of 10x text: the same ``docs`` sentences ten times over -- the same batches
    again, so any growth is geomscope's -- and ``10 * docs`` sentences shuffled afresh, whose largest
    batches are larger than the 1x text's, so that the forward alone grows (the plain-forward rows)."""
    same, same_ratios = _median_pair(isolated_extract, docs, work, shard, repeats, base_docs=docs)
    fresh, fresh_ratios = _median_pair(isolated_extract, docs, work, shard, repeats)
    plain = {k: run_isolated_plain(k * docs, work, shard) for k in (1, 10)}
    mb = {
        (name, k): pair[k]["result"]["extract_peak_mb"]
        for name, pair in (("same", same), ("fresh", fresh), ("plain", plain))
        for k in (1, 10)
    }
    if not all(mb.values()):  # no VmHWM: not Linux
        return []
    attention = {
        k: _largest_attention(lm, rss_corpus(k * docs, work, docs, repeat=False), shard) for k in (1, 10)
    }
    rows_of = {k: fresh[k]["result"]["rows"] for k in (1, 10)}

    def row(benchmark, a, b, target, note):
        return {
            "benchmark": benchmark,
            "geomscope": round(mb[a]),
            "alternative": round(mb[b]),
            "ratio": round(mb[a] / mb[b], 3),
            "target": target,
            "note": note,
        }

    common = f"fresh processes, VmHWM reset after model load; --shard-docs {shard}"
    return [
        row(
            f"extract peak RSS MiB, the same {docs} sentences 10 times over vs once",
            ("same", 10),
            ("same", 1),
            "<= 1.1",
            f"{common}; the same batches again: growth here is geomscope's; median of {repeats} pairs "
            f"(ratios {', '.join(f'{r:.3f}' for r in same_ratios)})",
        ),
        row(
            f"extract peak RSS MiB, {10 * docs} vs {docs} different sentences",
            ("fresh", 10),
            ("fresh", 1),
            "-",
            f"{common}; median of {repeats} pairs (ratios {', '.join(f'{r:.3f}' for r in fresh_ratios)}); "
            f"rows {rows_of[1]:,} vs {rows_of[10]:,}; the largest batch's attention (batch x length^2) is "
            f"{attention[10] / attention[1]:.2f}x the 1x text's, so the forward's own peak grows",
        ),
        row(
            f"plain forward loop peak RSS MiB, {10 * docs} vs {docs} different sentences (reference)",
            ("plain", 10),
            ("plain", 1),
            "-",
            "same batches, forward only, nothing kept: the larger batches' growth plus the CPU "
            "allocator's (glibc heap fragmentation under varying tensor sizes)",
        ),
        row(
            f"extract vs plain forward loop, peak RSS MiB at {10 * docs} different sentences",
            ("fresh", 10),
            ("plain", 10),
            "<= 1.1",
            "what storing every layer adds on top of the forward itself",
        ),
        {
            "benchmark": f"process peak RSS MiB incl. model load, the same {docs} sentences 10x vs once",
            "geomscope": round(same[10]["peak_rss_mb"]),
            "alternative": round(same[1]["peak_rss_mb"]),
            "ratio": round(same[10]["peak_rss_mb"] / same[1]["peak_rss_mb"], 3),
            "target": "<= 1.1",
            "note": "ru_maxrss of the whole extract child process",
        },
    ]


def run_isolated_plain(n_docs: int, work: Path, shard: int) -> dict:
    from _common import run_isolated

    return run_isolated(isolated_plain, n_docs, str(work), shard)


def run(quick: bool = False, rss: bool = True) -> list[dict]:
    """The benchmark rows; ``rss=False`` skips the peak-RSS rows (fourteen fresh processes, minutes)."""
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from geomscope.model.load import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: multi-threaded kernels would measure barrier stalls
    n_chunks = 2 if quick else 4
    chunk_docs = 60 if quick else 500
    repeats = 1 if quick else 3
    rss_docs, rss_shard, rss_repeats = 500, 250, 3
    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    rows: list[dict] = []
    try:
        lm = load_model("bundled:minilm", device="cpu")
        chunks = [make_corpus(chunk_docs, work / f"corpus-{i}.txt", seed=i) for i in range(n_chunks)]
        prebuilt = [ceiling_batches(lm, c) for c in chunks]
        warm = make_corpus(32, work / "warm.txt", seed=99)
        run_geomscope(lm, warm, work / "warm-run")
        run_ceiling(lm, ceiling_batches(lm, warm)[0])
        run_common(lm, warm, work / "warm.h5")
        contenders = ["geomscope", "ceiling", "common", "keep"] + ([] if quick else ["layer6"])
        totals = {k: [] for k in contenders}
        tokens = {k: 0 for k in contenders}
        disk = {"geomscope": 0, "keep": 0}
        for _ in range(repeats):
            spent = dict.fromkeys(contenders, 0.0)
            for k in contenders:
                tokens[k] = 0
            disk = dict.fromkeys(disk, 0)
            # alternate contenders chunk by chunk, so that load from other processes hits all of them alike
            for c, (batches, n_tok) in zip(chunks, prebuilt, strict=True):
                for k in contenders:
                    for d in ("run", "run6", "runk"):
                        shutil.rmtree(work / d, ignore_errors=True)
                    t0 = time.perf_counter()
                    if k == "geomscope":
                        s = run_geomscope(lm, c, work / "run")
                        tokens[k] += s["rows"]
                        disk[k] += s["bytes"]
                    elif k == "keep":
                        s = run_geomscope(lm, c, work / "runk", keep=f"sample:{KEEP_SAMPLE}")
                        tokens[k] += s["rows"]
                        disk[k] += s["bytes"]
                    elif k == "layer6":
                        tokens[k] += run_geomscope(lm, c, work / "run6", layers="6")["rows"]
                    elif k == "ceiling":
                        run_ceiling(lm, batches)
                        tokens[k] += n_tok
                    else:
                        tokens[k] += run_common(lm, c, work / "common.h5")
                    spent[k] += time.perf_counter() - t0
            for k in contenders:
                totals[k].append(spent[k])
        assert len(set(tokens.values())) == 1, tokens
        n_tok = tokens["geomscope"]
        tps = {k: n_tok / median(v) for k, v in totals.items()}
        n_docs = n_chunks * chunk_docs
        rows.append(
            {
                "benchmark": f"extract MiniLM, {n_docs} sentences ({n_tok:,} tokens), tokens/s",
                "geomscope": round(tps["geomscope"]),
                "alternative": round(tps["ceiling"]),
                "ratio": round(tps["geomscope"] / tps["ceiling"], 3),
                "target": ">= 0.95",
                "note": "alternative = plain forward over the same length-sorted batches (ceiling); all 7 "
                f"layers stored float16; 1 torch thread; median of {repeats}",
            }
        )
        rows.append(
            {
                "benchmark": "extract vs the common loop, tokens/s",
                "geomscope": round(tps["geomscope"]),
                "alternative": round(tps["common"]),
                "ratio": round(tps["geomscope"] / tps["common"], 3),
                "target": "> 1",
                "note": f"input order, batch {COMMON_BATCH} padded, output_hidden_states, "
                "all layers to numpy, one HDF5 write per batch",
            }
        )
        rows.append(
            {
                "benchmark": f"extract --keep sample:{KEEP_SAMPLE} vs --keep all, tokens/s",
                "geomscope": round(tps["keep"]),
                "alternative": round(tps["geomscope"]),
                "ratio": round(tps["keep"] / tps["geomscope"], 3),
                "target": "-",
                "note": f"float64 accumulators of 7 layers x 2 (ordinary, special tokens) measured on the "
                f"device; against the plain forward: {tps['keep'] / tps['ceiling']:.3f}",
            }
        )
        rows.append(
            {
                "benchmark": f"extract --keep sample:{KEEP_SAMPLE} vs --keep all, bytes on disk",
                "geomscope": disk["keep"],
                "alternative": disk["geomscope"],
                "ratio": round(disk["keep"] / disk["geomscope"], 3),
                "target": "-",
                "note": f"{n_chunks} runs of {chunk_docs} sentences, one shard each: the accumulators are "
                "a fixed cost per shard and layer, the rows grow with the text",
            }
        )
        if "layer6" in tps:
            rows.append(
                {
                    "benchmark": "extract one layer (6) vs all 7 layers, tokens/s",
                    "geomscope": round(tps["layer6"]),
                    "alternative": round(tps["geomscope"]),
                    "ratio": round(tps["layer6"] / tps["geomscope"], 3),
                    "target": ">= 1",
                    "note": "output_hidden_states=[6]: the other states are never kept",
                }
            )
        rows += host_rows(lm, chunks, work, repeats, tps["ceiling"])
        if rss and not quick:  # fourteen fresh processes take several minutes here: full mode only
            rows += rss_rows(lm, work, rss_docs, rss_shard, rss_repeats)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    quick = bench_args(__doc__).quick
    rows = run(quick=quick)
    print_rows(rows, title="extract" + (" (quick)" if quick else ""))
