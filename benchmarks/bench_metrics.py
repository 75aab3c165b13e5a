"""Core metrics vs the `isoscore` package (2.0.1) on the same in-memory float32 activations.

    python benchmarks/bench_metrics.py [--quick]

Rows (ratio = alternative seconds / geomscope seconds, so > 1 means geomscope is faster):
- IsoScore from points: ``geomscope.metrics.isoscore(X)`` (float64, blocked dsyrk, PR formula) vs
  ``IsoScore.IsoScore(X)`` (torch.cov in the input dtype + SVD).
- Streaming: ``Moments().update(X)`` with ALL statistics (mean, scatter, unit sums, |x| stats) +
  ``isoscore_from_cov`` vs the same package call.
- IsoScore* with a given C0 (zeta = 0.2) vs ``IsoScore.IsoScore_star(X, C0, 0.2)``.
- "of bound": the scatter's bound (``_common.stream_bound``: the n d^2 product at the float32
  GEMM rate, or reading and converting X if slower); the note gives the float64 product's.
- Peak memory: each side once in a fresh spawned process that first imports numpy, torch, the
  package and geomscope and builds X (float32); reported = the largest RSS sampled every 1 ms
  during the call minus the RSS just before it, i.e. the extra memory the computation needed
  beyond X and the imports (a sampler can miss spikes shorter than ~1 ms).
Timings alternate the two sides (``_common.alternate``), medians of several repeats, 1 warm-up.
Accuracy: |difference| of each side to a float64 transcription of the published algorithm.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    bench_args,
    f64_bound_note,
    of_bound,
    peak_rss_mb,
    print_rows,
    run_isolated,
    stream_bound,
)

D = 768


def make_data(n: int, d: int = D, seed: int = 0) -> np.ndarray:
    """Anisotropic float32 activations with a common offset and one rogue dimension
    (no float64 temporaries)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x *= rng.uniform(0.2, 2.0, d).astype(np.float32)
    x[:, 7] *= 20.0
    x += rng.standard_normal(d).astype(np.float32)
    return x


def _reference_c0(d: int = D) -> np.ndarray:
    y = make_data(4000, d, seed=1).astype(np.float64)
    return np.cov(y.T)


def _geomscope_isoscore(x):
    from geomscope.metrics import isoscore

    return isoscore(x)


def _geomscope_moments(x):
    from geomscope.metrics import Moments, isoscore_from_cov

    return isoscore_from_cov(Moments().update(x).covariance())


def _package_isoscore(x):
    from IsoScore import IsoScore as isp

    return float(isp.IsoScore(x))


SIDES = {
    "geomscope.isoscore": _geomscope_isoscore,
    "geomscope.Moments+isoscore": _geomscope_moments,
    "isoscore package": _package_isoscore,
}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(side: str, n: int) -> dict:
    """In a fresh process: import everything, build X, then measure the extra RSS of one call.

    A thread samples the current RSS every millisecond during the call; extra = max sample minus the
    RSS just before the call (ru_maxrss alone would be dominated by the import-time high-water mark).
    """
    import torch  # noqa: F401  (both sides pay the import before the baseline)
    from IsoScore import IsoScore  # noqa: F401

    import geomscope.metrics  # noqa: F401

    x = make_data(n)
    SIDES[side](x[:64])  # warm lazy imports (scipy.linalg, torch kernels) before the baseline
    before = _rss_mb()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    value = SIDES[side](x)
    done.set()
    th.join()
    return {"extra_mb": max(peak[0], _rss_mb()) - before, "value": value, "ru_maxrss_mb": peak_rss_mb()}


def run(quick: bool = False) -> list[dict]:
    from IsoScore import IsoScore as isp

    from geomscope.metrics import Moments, isoscore, isoscore_from_cov, isoscore_published, isoscore_star

    n = 5_000 if quick else 50_000
    repeats = 3 if quick else 5
    x = make_data(n)
    c0 = _reference_c0()
    ref = isoscore_published(x)
    size = f"{n:,}x{D} float32"
    rows = []
    bound = stream_bound(n, D, 4)

    def f64(t: dict) -> str:
        return "; " + f64_bound_note(n, D, t["g"])

    t = alternate({"g": lambda: isoscore(x), "p": lambda: isp.IsoScore(x)}, repeats=repeats)
    err_g, err_p = abs(isoscore(x) - ref), abs(float(isp.IsoScore(x)) - ref)
    rows.append(
        {
            "benchmark": f"IsoScore, {size}, in memory",
            "geomscope": t["g"],
            "alternative": t["p"],
            "ratio": t["p"] / t["g"],
            "target": ">= 1",
            "of bound": of_bound(bound, t["g"]),
            "note": f"median s of {repeats}; |err| vs float64 published: geomscope {err_g:.1e}, "
            f"package {err_p:.1e}" + f64(t),
        }
    )

    t = alternate({"g": lambda: _geomscope_moments(x), "p": lambda: isp.IsoScore(x)}, repeats=repeats)
    rows.append(
        {
            "benchmark": f"Moments.update (all stats) + IsoScore, {size}",
            "geomscope": t["g"],
            "alternative": t["p"],
            "ratio": t["p"] / t["g"],
            "target": ">= 1",
            "of bound": of_bound(bound, t["g"]),
            "note": "geomscope also accumulates mean, unit sums, |x| stats; mergeable; streams in "
            f"{Moments().block_rows}-row blocks" + f64(t),
        }
    )
    assert abs(isoscore_from_cov(Moments().update(x).covariance()) - ref) < 1e-10

    t = alternate(
        {"g": lambda: isoscore_star(x, 0.2, c0), "p": lambda: isp.IsoScore_star(x, c0, 0.2)}, repeats=repeats
    )
    err = abs(isoscore_star(x, 0.2, c0) - float(isp.IsoScore_star(x, c0, 0.2)))
    rows.append(
        {
            "benchmark": f"IsoScore* (zeta=0.2, given C0), {size}",
            "geomscope": t["g"],
            "alternative": t["p"],
            "ratio": t["p"] / t["g"],
            "target": ">= 1",
            "of bound": of_bound(bound, t["g"]),
            "note": f"|geomscope - package| = {err:.1e} (package computes in float32)" + f64(t),
        }
    )

    mem = {side: run_isolated(memory_child, side, n)["result"] for side in SIDES}
    for side in ("geomscope.isoscore", "geomscope.Moments+isoscore"):
        g, p = mem[side]["extra_mb"], mem["isoscore package"]["extra_mb"]
        rows.append(
            {
                "benchmark": f"extra peak RSS (MiB), {side}, {size}",
                "geomscope": g,
                "alternative": p,
                "ratio": p / max(g, 1e-9),
                "target": ">= 1",
                "note": f"X itself is {x.nbytes / 2**20:.0f} MiB; one spawned process per side; "
                "max RSS sampled during the call minus RSS before",
            }
        )
    return rows


if __name__ == "__main__":
    print_rows(run(quick=bench_args(__doc__).quick), "metrics: IsoScore vs the isoscore package")
