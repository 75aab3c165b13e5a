"""A cost model of extraction: seconds per token from a model's shape, what is kept, and a device's
measured rates; checked against the GPU rows measured, and projected to a corpus.

    python benchmarks/cost_model.py [--fit] [--json FILE]

Without ``--fit`` it prints three tables from the coefficients below: the terms of the model, the
recorded GPU rows against the model's prediction, and the projection of every layer of
Pythia-6.9B over 10^9 tokens on 8 H100s (docs/explanation/performance.md). ``--fit`` first
measures this CPU's coefficients (GEMM rates, bandwidth, the accumulators' rows/s, extract's host
work with the forward stubbed) and uses those.

**The model**, per token, for a batch of documents of mean padded length T:

- forward: F = 2 P + a L T D flops (P: parameters outside the embeddings; a = 2 for causal
  attention, whose QK^T and AV read T/2 earlier positions on average, 4 for bidirectional), at
  the model dtype's matrix rate R times the forward's efficiency eta_fwd: t_fwd = F / (R eta_fwd).
  eta_fwd is fitted on each device's own plain-forward rows.
- extract's host work (padding, uploads, the gather's launch, handing rows to the store thread,
  appends and checksums): h(k) = h0 + h1 * 2 D k seconds per token for k layers stored (float16),
  fitted on the CPU with the forward stubbed. On a GPU the main thread's share (``HOST_SHARE``; the
  store thread runs beside it on another core) adds to the forward's time, because transformers'
  SDPA mask reads a value back from the GPU before each forward (performance.md): the host cannot
  work ahead.
- accumulators (``--keep sample``), per kept layer: float64 products c(D) 2 D^2 flops at the float64
  rate (c(D) = (n + 1) / 2n for n column blocks of 256: the triangle) times eta_gemm, plus
  ``PASSES64`` passes of 8 D bytes over memory (the float64 copy, centring, squares, unit vectors,
  |x| statistics) at the memory bandwidth; split products: c(2D) 2 (2D)^2 flops at the float16 rate
  times eta_gemm, plus the float32 block results folded into float64 (33 D^2 bytes per
  SPLIT_ROWS rows) and the same float64 passes, with ``SPLIT_PASSES`` more for the shift and parts.
- storing: 2 D k bytes per token at the disk's write rate (on a thread of its own: a bound).

Extraction's time is the larger of (forward + accumulators + the host's serial share) and the
disk's; a plain forward's is t_fwd.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SYRK_BLOCK = 256
SPLIT_ROWS = 2048
PASSES64 = 20  # float64 passes over a kept layer's rows per update (fitted: Moments.update, CPU)
SPLIT_PASSES = 6  # the shift's float64 copy, the parts' float32 and float16 casts
HOST_SHARE = 0.5  # the main thread's part of extract's host work, the store thread on another core


@dataclass(frozen=True)
class Device:
    """A device's measured rates: matrix products in TFLOP/s, memory and copies in GB/s."""

    name: str
    bf16: float
    f32: float
    f64: float
    memory: float
    disk: float
    eta_fwd: dict  # dtype -> the forward's fraction of the dtype's rate (fitted on plain rows)
    eta_gemm: float = 0.8  # the accumulators' products against the square GEMM rate
    host: tuple = (1.80e-6, 1.675e-12)  # h0 (s per token), h1 (s per stored byte)
    host_share: float = HOST_SHARE


@dataclass(frozen=True)
class Shape:
    """A model: P parameters outside the embeddings, L blocks of width D, causal or not."""

    name: str
    params: float
    layers: int
    hidden: int
    causal: bool
    dtype: str = "bf16"


#: the Zen 5 CPU of performance.md (float32 and float64 rates: OpenBLAS's own kernels; memory: a
#: copy); its host coefficients come from the forward-stubbed rows there (all 7 MiniLM layers
#: 92,478 tokens/s, one layer 323,783: h(7) = 10.81 us, h(1) = 3.09 us per token)
ZEN5 = Device(
    "2-core AMD EPYC Zen 5",
    bf16=0.0,
    f32=0.4815,
    f64=0.1952,
    memory=40.5,
    disk=1.0,
    eta_fwd={"f32": 0.80},
    host_share=1.0,
)
#: performance.md's H200 and H100 limits (the means of the ranges measured)
H200 = Device(
    "NVIDIA H200",
    bf16=764.0,
    f32=51.1,
    f64=60.6,
    memory=4000.0,
    disk=1.5,
    eta_fwd={"f32": 0.80, "bf16": 0.18},
)
H100 = Device(
    "NVIDIA H100 80GB HBM3",
    bf16=764.0,
    f32=51.1,
    f64=62.3,
    memory=2960.0,
    disk=1.4,
    eta_fwd={"f32": 0.80, "bf16": 0.18},
)
#: the forward of a model a thousand times MiniLM's size is bound by the GPU, not by its host: the
#: rows above fit eta_fwd on host-bound forwards, so the projection takes an H100's typical
#: efficiency for a 7B forward at long sequences instead (an input, stated in the docs)
H100_LARGE = replace(H100, eta_fwd={"bf16": 0.50})

MINILM = Shape("MiniLM-L6", params=21.3e6, layers=6, hidden=384, causal=False, dtype="f32")
BERT_LARGE = Shape("BERT-large shape", params=302e6, layers=24, hidden=1024, causal=False)
PYTHIA_1_4B = Shape("Pythia-1.4B shape", params=1.21e9, layers=24, hidden=2048, causal=True)
LLAMA_1B = Shape("Llama-1B shape", params=0.97e9, layers=16, hidden=2048, causal=True)
PYTHIA_6_9B = Shape("Pythia-6.9B", params=6.44e9, layers=32, hidden=4096, causal=True)


def triangle(d: int) -> float:
    """The fraction of a d x d product the blocked triangular product computes."""
    n = max(1, -(-d // SYRK_BLOCK))
    return (n + 1) / (2 * n)


def forward_seconds(shape: Shape, dev: Device, T: float) -> float:
    flops = 2 * shape.params + (2 if shape.causal else 4) * shape.layers * T * shape.hidden
    rate = {"bf16": dev.bf16, "f32": dev.f32}[shape.dtype] * 1e12
    return flops / (rate * dev.eta_fwd[shape.dtype])


def host_seconds(shape: Shape, dev: Device, stored_layers: int) -> float:
    h0, h1 = dev.host
    return h0 + h1 * 2 * shape.hidden * stored_layers


def accumulator_seconds(shape: Shape, dev: Device, layers: int, products: str) -> float:
    d = shape.hidden
    memory = PASSES64 * 8 * d / (dev.memory * 1e9)
    if products == "float64":
        return layers * (triangle(d) * 2 * d * d / (dev.f64 * 1e12 * dev.eta_gemm) + memory)
    rate16 = (dev.bf16 or dev.f32) * 1e12 * dev.eta_gemm  # the CPU emulates in float32
    products_s = triangle(2 * d) * 2 * (2 * d) ** 2 / rate16
    fold = 33 * d * d / SPLIT_ROWS / (dev.memory * 1e9)
    own = SPLIT_PASSES * 8 * d / (dev.memory * 1e9)
    return layers * (products_s + fold + memory + own)


def extract_seconds(shape: Shape, dev: Device, T: float, kept: int, keep: str, products: str = "float64"):
    """Seconds per token of extract, and its terms: ``kept`` hidden states, ``keep`` all or sample."""
    fwd = forward_seconds(shape, dev, T)
    if keep == "all":
        acc, stored = 0.0, kept
    else:
        acc, stored = accumulator_seconds(shape, dev, kept, products), 0  # a sample: ~nothing per token
    host = host_seconds(shape, dev, stored) * dev.host_share
    disk = 2 * shape.hidden * stored / (dev.disk * 1e9)
    total = max(fwd + acc + host, disk)
    return total, {"forward": fwd, "accumulators": acc, "host": host, "disk": disk}


# ---------------------------------------------------------------- the rows measured

#: performance.md's GPU extraction rows: (device, shape, T, layers kept, keep, measured tokens/s of
#: extract, of the plain forward)
GPU_ROWS = [
    (H200, MINILM, 38.7, 1, "all", 383_705, 994_618),
    (H200, MINILM, 38.7, 7, "all", 178_397, 994_618),
    (H200, BERT_LARGE, 38.8, 1, "all", 150_827, 383_233),
    (H200, BERT_LARGE, 38.8, 25, "all", 11_267, 383_233),
    (H100, MINILM, 38.7, 1, "all", 154_162, 900_411),
    (H100, BERT_LARGE, 38.8, 1, "all", 40_064, 303_729),
]
#: the CPU rows the coefficients are fitted on (performance.md, Zen 5): MiniLM's plain forward at
#: 3,822 tokens/s fits eta_fwd; extract of all 7 layers at 3,732 checks the sum
CPU_ROWS = [(ZEN5, MINILM, 38.7, 7, "all", 3_732, 3_822)]


def check_rows() -> list[dict]:
    out = []
    for dev, shape, T, kept, keep, measured, plain in CPU_ROWS + GPU_ROWS:
        dev = replace(dev, eta_fwd=fitted_eta(dev, shape, T, plain))
        t, terms = extract_seconds(shape, dev, T, kept, keep)
        out.append(
            {
                "device": dev.name,
                "model": shape.name,
                "kept": f"{kept} layer(s), keep {keep}",
                "measured tok/s": measured,
                "model tok/s": round(1 / t),
                "model / measured": round(1 / t / measured, 2),
                "bound by": max(
                    ("device + host", terms["forward"] + terms["accumulators"] + terms["host"]),
                    ("disk", terms["disk"]),
                    key=lambda kv: kv[1],
                )[0],
            }
        )
    return out


def fitted_eta(dev: Device, shape: Shape, T: float, plain_tps: float) -> dict:
    """The forward's efficiency on this device that makes the model's plain forward the one measured."""
    unit = replace(dev, eta_fwd={shape.dtype: 1.0})
    return {**dev.eta_fwd, shape.dtype: forward_seconds(shape, unit, T) * plain_tps}


# ---------------------------------------------------------------- the projection


def projection(tokens: float = 1e9, gpus: int = 8, T: float = 576.0) -> list[dict]:
    """Every hidden state of Pythia-6.9B (33) over ``tokens`` on ``gpus`` H100s of one machine
    (torchrun: each process its own shards, no communication; the machine's one disk shared by
    them), documents of 128-1,024 tokens (mean 576)."""
    shape, dev = PYTHIA_6_9B, replace(H100_LARGE, disk=H100_LARGE.disk / gpus)
    kept = shape.layers + 1
    fwd = forward_seconds(shape, dev, T)
    cases = [
        ("plain forward", fwd, {"forward": fwd, "accumulators": 0.0, "host": 0.0, "disk": 0.0}),
        ("extract one layer", *extract_seconds(shape, dev, T, 1, "all")),
        ("extract --keep sample, float64 products", *extract_seconds(shape, dev, T, kept, "sample")),
        ("extract --keep sample --products split", *extract_seconds(shape, dev, T, kept, "sample", "split")),
        ("extract every layer, --keep all (33 x 8 KB a token)", *extract_seconds(shape, dev, T, kept, "all")),
    ]
    rows = []
    for what, t, terms in cases:
        rows.append(
            {
                "what": what,
                "hours": round(tokens / gpus * t / 3600, 2),
                "x forward": round(t / fwd, 2),
                **{f"{k} us/token": round(v * 1e6, 3) for k, v in terms.items()},
            }
        )
    return rows


# ---------------------------------------------------------------- fitting on this CPU


def fit_cpu(quick: bool = False) -> Device:
    """This CPU's coefficients: GEMM rates and bandwidth (_common.machine_limits), the float64
    passes and GEMM efficiency from Moments.update's rows/s at two widths, and the host terms from
    extract with the forward stubbed (one layer and all of MiniLM's 7)."""
    import time

    import numpy as np
    from _common import machine_limits

    lim = machine_limits(quick)
    f64, f32, mem = lim["gemm_f64_gflops"] / 1e3, lim["gemm_f32_gflops"] / 1e3, lim["bandwidth_gbs"]
    from geomscope.metrics.moments import Moments

    rows, per_row = 4096 if quick else 16384, {}
    for d in (256, 1024):
        x = np.random.default_rng(0).standard_normal((rows, d)).astype(np.float16)
        Moments(d).update(x)  # warm-up
        t0 = time.perf_counter()
        Moments(d).update(x)
        per_row[d] = (time.perf_counter() - t0) / rows
    # per_row(d) = d^2 / (f64 eta) + PASSES64 * 8 d / mem: two widths, two unknowns (syrk: d^2 flops)
    a = np.array([[d * d / (f64 * 1e12), 8 * d / (mem * 1e9)] for d in per_row])
    inv_eta, passes = np.linalg.solve(a, np.array(list(per_row.values())))
    host = _stubbed_host(quick)
    return Device(
        "this CPU",
        bf16=0.0,
        f32=f32,
        f64=f64,
        memory=mem,
        disk=1.0,
        eta_fwd={"f32": 0.8},
        eta_gemm=float(1 / inv_eta),
        host=host,
        host_share=1.0,
    ), {"float64 passes": float(passes), "per row s": per_row}


def _stubbed_host(quick: bool) -> tuple[float, float]:
    """(h0, h1) from extract of MiniLM with the forward stubbed: one layer and all 7."""
    import shutil
    import tempfile
    import time

    from bench_extract import forward_stubbed, make_corpus

    from geomscope.extract.run import extract
    from geomscope.model.load import load_model

    lm = load_model("bundled:minilm", device="cpu")
    work = Path(tempfile.mkdtemp(prefix="cost-model-"))
    corpus = make_corpus(400 if quick else 4000, work / "c.txt")
    per_token = {}
    try:
        with forward_stubbed(lm):
            for layers, k in (("6", 1), ("all", 7)):
                t0 = time.perf_counter()
                s = extract(lm, [corpus], work / f"run{k}", layers=layers, overwrite=True)
                per_token[k] = (time.perf_counter() - t0) / s["rows"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    h1 = (per_token[7] - per_token[1]) / (6 * 2 * lm.hidden_size)
    return per_token[1] - h1 * 2 * lm.hidden_size, h1


def main(argv=None) -> int:
    from _common import markdown_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="measure this CPU's coefficients first")
    ap.add_argument("--quick", action="store_true", help="smaller fitting sizes")
    ap.add_argument("--json", type=Path, default=None, help="also write the tables here")
    args = ap.parse_args(argv)
    out = {"check": check_rows(), "projection": projection()}
    if args.fit:
        dev, extra = fit_cpu(args.quick)
        out["fit"] = {**asdict(dev), **extra}
    for key, rows in out.items():
        if isinstance(rows, list):
            print(f"\n### {key}\n\n" + markdown_table(rows))
    if "fit" in out:
        print("\nfit: " + json.dumps(out["fit"], default=str))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
