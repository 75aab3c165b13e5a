"""TwoNN intrinsic dimension: geomscope vs scikit-dimension 0.5.0 and vs blocked torch.cdist + topk.

    python benchmarks/bench_twonn.py [--quick]

Data: float32 (N, 768) points = a random 20-d Gaussian subspace + isotropic noise (sigma 0.1), no
duplicates, seed 0. Contenders, each computing the linear TwoNN (discard 0.1, F_i = i/N):

- geomscope: ``geomscope.metrics.twonn(X)`` -- duplicate check, exact two-NN search (symmetric
  float32 GEMM strips + certified float64 refinement), fit. torch with its default threads.
- skdim: ``skdim.id.TwoNN().fit(X)`` (sklearn ``pairwise_distances_chunked`` + a full sort of
  every distance row). Skipped at N = 50,000, where it would take many minutes (O(N^2 log N));
  the note gives an extrapolation from the 20,000 timing instead.
- cdist+topk: the fastest plain alternative from installed libraries: row blocks of
  ``torch.cdist(X[block], X)`` (float32, matrix-product mode), self masked, ``topk(2)``, same fit;
  its blocks use the same 256 MiB budget. Not exact for near-duplicates (no refinement).

Timings alternate the contenders on the same array (``_common.alternate``), 1 warm-up (none at
N >= 20,000), medians of ``repeats``; ratio = alternative seconds / geomscope seconds (> 1:
geomscope is faster). Each note ends with the 1-minute load average when the row finished: on a
shared machine the multi-threaded ops stall while other processes hold the cores.

What bounds the ratio vs skdim on a CPU: skdim computes the full N x N matrix in float64 (sklearn
upcasts float32 chunks) and sorts every row; geomscope computes half of it in float32. With
float64 GEMM at half the float32 rate (AVX2), the arithmetic ratio is about 4x, plus skdim's sort
and copies: roughly 5x at best. A 15x target needs a GPU (``device="cuda"``) or an approximate search.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import alternate, machine_limits, of_bound, print_rows  # noqa: E402

D = 768
BUDGET = 256 * 2**20


def make_data(n: int, d: int = D, intrinsic: int = 20, noise: float = 0.1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, intrinsic), dtype=np.float32)
    basis = rng.standard_normal((intrinsic, d), dtype=np.float32) / np.float32(math.sqrt(intrinsic))
    x = z @ basis
    x += np.float32(noise) * rng.standard_normal((n, d), dtype=np.float32)
    return x


def geomscope_twonn(x) -> float:
    from geomscope.metrics.twonn import twonn

    return twonn(x).dimension


def skdim_twonn(x) -> float:
    import skdim

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(skdim.id.TwoNN().fit(x).dimension_)


def cdist_topk_twonn(x) -> float:
    import torch

    from geomscope.metrics.twonn import fit_mu

    xt = torch.from_numpy(x)
    n = xt.shape[0]
    block = max(64, min(n, BUDGET // (4 * n)))
    r1 = torch.empty(n, dtype=torch.float32)
    r2 = torch.empty(n, dtype=torch.float32)
    for s in range(0, n, block):
        e = min(s + block, n)
        dist = torch.cdist(xt[s:e], xt)
        dist[torch.arange(e - s), torch.arange(s, e)] = math.inf
        v = dist.topk(2, dim=1, largest=False).values
        r1[s:e], r2[s:e] = v[:, 0], v[:, 1]
    return fit_mu((r2 / r1).double().numpy())[0]


def run(quick: bool = False) -> list[dict]:
    sizes = [3000, 6000] if quick else [5000, 10000, 20000, 50000]
    repeats = 2 if quick else 3
    skdim_max = 20000
    rows = []
    skdim_20k = None
    for n in sizes:
        x = make_data(n)
        fns = {"geomscope": lambda x=x: geomscope_twonn(x), "cdist": lambda x=x: cdist_topk_twonn(x)}
        if n <= skdim_max:
            fns["skdim"] = lambda x=x: skdim_twonn(x)
        # values once (outside timing), then timings alternating
        ours = geomscope_twonn(x)
        alt = cdist_topk_twonn(x)
        sk = skdim_twonn(x) if "skdim" in fns else None
        t = alternate(fns, repeats=repeats, warmup=0 if n >= 20000 else 1)
        tag = f"TwoNN N={n:,} x {D} float32"
        load = f"; load {os.getloadavg()[0]:.1f}"
        # the bound: the float32 GEMM of half the distance matrix, N^2 D flops (of 2 N^2 D for all pairs)
        bound = n * n * D / (machine_limits(quick)["gemm_f32_gflops"] * 1e9)
        frac = of_bound(bound, t["geomscope"])
        if sk is not None:
            if n == 20000:
                skdim_20k = t["skdim"]
            rows.append(
                {
                    "benchmark": f"{tag} vs skdim 0.5.0",
                    "geomscope": t["geomscope"],
                    "alternative": t["skdim"],
                    "ratio": t["skdim"] / t["geomscope"],
                    "target": ">= 15x at 20,000" if n == 20000 else "-",
                    "of bound": frac,
                    "note": f"seconds (median of {repeats}); d = {ours:.4f} vs {sk:.4f} "
                    f"(rel. diff {abs(ours / sk - 1):.1e}, target < 1e-2){load}",
                }
            )
        else:
            extra = ""
            if skdim_20k is not None:
                est = skdim_20k * (n / 20000) ** 2 * math.log(n) / math.log(20000)
                extra = f"; skdim skipped (~{est / 60:.0f} min extrapolated as N^2 log N from 20,000)"
            rows.append(
                {
                    "benchmark": f"{tag} vs skdim 0.5.0",
                    "geomscope": t["geomscope"],
                    "alternative": None,
                    "ratio": None,
                    "target": "-",
                    "of bound": frac,
                    "note": f"geomscope d = {ours:.4f}{extra}{load}",
                }
            )
        rows.append(
            {
                "benchmark": f"{tag} vs cdist+topk blocks",
                "geomscope": t["geomscope"],
                "alternative": t["cdist"],
                "ratio": t["cdist"] / t["geomscope"],
                "target": "> 1",
                "of bound": frac,
                "note": f"seconds (median of {repeats}); d = {ours:.4f} vs {alt:.4f} "
                f"(float32 distances){load}",
            }
        )
    return rows


if __name__ == "__main__":
    print_rows(run(quick="--quick" in sys.argv), "TwoNN intrinsic dimension")
