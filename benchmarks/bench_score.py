"""`geomscope score` (streaming from disk) vs the `isoscore` package on the same rows held in memory.

    python benchmarks/bench_score.py [--quick]

Data (written once to $GEOMSCOPE_BENCH_DIR, default /tmp/geomscope_bench_score, and reused):
- a run of 200,000 token rows x 384 (float16, one layer, 8 shards, 50-token documents) written with
  the store (``RunWriter``/``ShardWriter``), anisotropic with a common offset and a rogue dimension;
- a 50,000 x 768 float32 ``.npy`` array of the same kind.

Rows (throughput in rows/s; ratio = geomscope rows/s / alternative rows/s, > 1 means geomscope is faster):
- IsoScore: ``score(path, metrics=isoscore)`` -- reads the shards, float64 blocked moments, 10-group
  jackknife SE, checksum of every shard -- vs ``IsoScore.IsoScore(X)`` on the rows ALREADY in memory
  as float32 (reading them is not timed for the package).
- IsoScore, ``--product-dtype float32``: the same with float32 block products (opt-in; the note gives
  its relative difference to the float64 products and the package's).
- Moment suite: isoscore, isoscore_star, avgcos (plain, centred, standardised: a second pass),
  spectrum, outliers, all with jackknife SE, vs the package's IsoScore + IsoScore_star (the
  subset it can compute) on the in-memory rows.
- IsoScore on OpenBLAS's own kernels (only where the environment sets ``OPENBLAS_CORETYPE``): the
  first row again in a fresh process without that variable, both sides, so numpy's OpenBLAS runs the
  kernels it detects for this CPU (this machine's environment pins its AVX2 ones on an AVX-512 CPU;
  geomscope keeps whatever the environment sets). The package multiplies with torch (MKL), which
  the variable does not touch.
- Peak RSS (full run only): each side once in a fresh spawned process that imports numpy, torch, the
  package and geomscope first; geomscope scores the file, the package side loads the rows (as a user
  must) and scores them. Reported: the peak RSS over the baseline after the imports, sampled every
  ms (ru_maxrss is useless here: a spawned child inherits its parent's high-water mark).
- Workers (full run only): ``score(--workers 2)`` vs ``--workers 1`` on the run, IsoScore alone and
  the moment suite (ratio = speed-up; the machine's free cores bound it).
- Dask (needs ``geomscope[dask]``): ``score(--scheduler local:2)`` vs ``--workers 2`` on the run, the
  moment suite (ratio = workers-2 time / Dask time; the issue's target: Dask overhead <= 10 %, ratio >=
  0.91). Both include their start-up (process pool / LocalCluster of 2 worker processes). Only this
  comparison: ``python benchmarks/bench_score.py [--quick] --only dask``.
  The workers and Dask rows are timed in one fresh spawned process that has not imported torch, as
  the CLI's ``score`` has not when it starts its workers: there they are forked (executor.py
  ``worker_start_method``); this benchmark's own process has torch loaded, which would make them
  spawned. The row's note names the start method used.
Threads: the package runs torch with its default threads (all cores); geomscope runs BLAS
single-threaded and computes the float64 block statistics of a task in (usable cores / workers)
threads, reading the next block meanwhile, so ``--workers 1`` uses every core too (see
geomscope/score/executor.py and geomscope/metrics/moments.py). On a machine shared with other
jobs both sides lose cores: report the load average beside the numbers.
Timings alternate the sides (``_common.alternate``), medians of several repeats after a warm-up. The
throughput rows' notes add each side's CPU seconds for one run (all threads) and the load average:
with other jobs on the cores the package's torch threads wait for each other (one run measured 5 s
instead of 0.6 s at load 3), so the wall ratio flatters geomscope there; the CPU ratio does not.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    BLAS_PIN,
    alternate,
    bench_args,
    blas_info,
    f64_bound_note,
    of_bound,
    own_blas_kernels,
    peak_rss_mb,
    print_rows,
    run_isolated,
    stream_bound,
)

BENCH_DIR = Path(os.environ.get("GEOMSCOPE_BENCH_DIR", "/tmp/geomscope_bench_score"))
MOMENT_SUITE = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers")


def _rows(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x *= rng.uniform(0.2, 2.0, d).astype(np.float32)
    x[:, 7] *= 20.0
    x += rng.standard_normal(d).astype(np.float32)
    return x


def make_run(rows: int, dim: int = 384, shards: int = 8) -> Path:
    """The synthetic float16 run (cached by size)."""
    from geomscope.store import Run, RunWriter

    d = BENCH_DIR / f"run_{rows}x{dim}"
    try:
        run = Run(d)
        if run.complete and run.total_rows == rows and all(s.xxh3_128 for s in run.shards):
            return d  # (a run written before the shards' xxh3_128 would be checked by its sha256)
    except Exception:  # not there yet / damaged: rebuild
        pass
    ident = {"model": {"name": "synthetic", "hidden_size": dim}, "layers": [{"name": "layer_00", "index": 0}]}
    per = rows // shards
    with RunWriter(d, ident, overwrite=True) as w:
        doc = 0
        for s in range(shards):
            n = per if s < shards - 1 else rows - per * (shards - 1)
            x = _rows(n, dim, seed=s)
            sw = w.shard_writer(s, layer_names=["layer_00"], dim=dim, store_dtype="float16", expected_rows=n)
            docs = doc + np.arange(n) // 50
            sw.append(
                {"layer_00": x},
                token_id=np.arange(n),
                doc_id=docs,
                position=np.arange(n) % 50,
                is_special=np.arange(n) % 50 == 0,
            )
            w.add_shard(sw.close())
            doc = int(docs[-1]) + 1
        w.finalize({"docs": doc})
    return d


def make_array(rows: int, dim: int = 768) -> Path:
    p = BENCH_DIR / f"array_{rows}x{dim}.npy"
    if not p.exists():
        BENCH_DIR.mkdir(parents=True, exist_ok=True)
        np.save(p, _rows(rows, dim, seed=99))
    return p


def load_rows(path: Path) -> np.ndarray:
    """All rows of a run's layer_00 (or an array) in memory as float32 -- what the package needs."""
    if path.suffix == ".npy":
        return np.load(path).astype(np.float32, copy=False)
    from geomscope.store import Run, iter_shard

    run = Run(path)
    return np.concatenate(
        [c.layers["layer_00"].astype(np.float32) for s in run.shards for c in iter_shard(run.shard_path(s))]
    )


def _score(
    path: Path, metrics, workers: int = 1, scheduler: str | None = None, product_dtype: str = "float64"
) -> dict:
    from geomscope.score import ScoreOptions, score

    opts = ScoreOptions(
        metrics=tuple(metrics), workers=workers, scheduler=scheduler, product_dtype=product_dtype
    )
    return score(path, opts)


def _package(x: np.ndarray, star: bool = False) -> float:
    from IsoScore import IsoScore as isp

    v = float(isp.IsoScore(x))
    if star:
        isp.IsoScore_star(x, np.eye(x.shape[1], dtype=np.float32), 0.2)
    return v


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(side: str, path: str) -> dict:
    """Fresh process: import everything, then run one side; peak RSS and peak over the baseline."""
    import torch  # noqa: F401
    from IsoScore import IsoScore  # noqa: F401

    import geomscope.report  # noqa: F401
    import geomscope.score  # noqa: F401

    before = _rss_now_mb()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_now_mb())
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    if side == "geomscope":
        value = _score(Path(path), ("isoscore",))["layers"][0]["isoscore"]
    else:
        value = _package(load_rows(Path(path)))
    done.set()
    th.join()
    return {"extra_mb": max(peak[0], _rss_now_mb()) - before, "peak_rss_mb": peak_rss_mb(), "value": value}


def _cpu_seconds(fn) -> float:
    """CPU seconds (user + system, all threads of this process) of one call of ``fn``: unlike the wall
    time, it does not depend on how many cores other jobs leave free (a multi-threaded side whose
    threads wait for a busy core loses wall time, not CPU time)."""
    import resource

    def now() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0 = now()
    fn()
    return now() - c0


def _cpu_note(g, p) -> str:
    cg, cp = _cpu_seconds(g), _cpu_seconds(p)
    return f"; CPU s per run {cg:.2f} vs {cp:.2f} ({cp / cg:.2f}x); load {os.getloadavg()[0]:.2f}"


def _timed_row(benchmark: str, g, p, *, n: int, bound: float, target: str, repeats: int, note) -> dict:
    """One throughput row: geomscope ``g`` and the package ``p`` timed alternately (medians), rows/s,
    the ratio, the fraction of ``bound``; ``note(t)`` (t: the median seconds) starts the note, each
    side's CPU seconds end it."""
    t = alternate({"g": g, "p": p}, repeats=repeats)
    return {
        "benchmark": benchmark,
        "geomscope": n / t["g"],
        "alternative": n / t["p"],
        "ratio": t["p"] / t["g"],
        "target": target,
        "of bound": of_bound(bound, t["g"]),
        "note": note(t) + _cpu_note(g, p),
    }


def _throughput_rows(label: str, path: Path, n: int, x: np.ndarray, repeats: int) -> list[dict]:
    d = x.shape[1]
    bound = stream_bound(n, d, 2 if "float16" in label else 4)
    same = {"n": n, "bound": bound, "repeats": repeats}

    def f64_bound(t) -> str:
        return f64_bound_note(n, d, t["g"])

    exact = lambda: _score(path, ("isoscore",))  # noqa: E731
    fast = lambda: _score(path, ("isoscore",), product_dtype="float32")  # noqa: E731
    g_val = exact()["layers"][0]["isoscore"]
    f_val = fast()["layers"][0]["isoscore"]
    err = abs(g_val - _package(x))
    return [
        _timed_row(
            f"IsoScore, {label}",
            exact,
            lambda: _package(x),
            target=">= 1.5",
            note=lambda t: (
                f"rows/s, median of {repeats}; geomscope streams from disk (+ jackknife SE, "
                f"checksums), package on float32 rows in memory; |difference| {err:.1e}; {f64_bound(t)}"
            ),
            **same,
        ),
        _timed_row(
            f"IsoScore, --product-dtype float32 (opt-in), {label}",
            fast,
            lambda: _package(x),
            target=">= 1.5",
            note=lambda t: (
                "as above with float32 block products: relative difference to the float64 "
                f"products {abs(f_val - g_val) / abs(g_val):.1e}, the package's {err / abs(g_val):.1e}"
            ),
            **same,
        ),
        _timed_row(
            f"moment suite, {label}",
            lambda: _score(path, MOMENT_SUITE),
            lambda: _package(x, star=True),
            target=">= 1",
            note=lambda t: (
                "rows/s; geomscope: isoscore, isoscore*, avgcos x3 (2nd pass), spectrum, "
                f"outliers, all with jackknife SE; package: IsoScore + IsoScore* only; {f64_bound(t)}"
            ),
            **same,
        ),
    ]


def own_kernel_times(run_dir: str, repeats: int) -> dict:
    """(In a fresh process whose OpenBLAS runs the kernels it picks for this CPU: see
    ``own_kernel_row``.) Median seconds of the streaming IsoScore and of the package on the rows in
    memory, alternating, and this process's BLAS."""
    path = Path(run_dir)
    x = load_rows(path)
    t = alternate({"g": lambda: _score(path, ("isoscore",)), "p": lambda: _package(x)}, repeats=repeats)
    return {"times": t, "blas": blas_info()}


def own_kernel_row(run_dir: Path, n: int, repeats: int) -> list[dict]:
    """Where the environment pins OpenBLAS's kernels (``OPENBLAS_CORETYPE``): the streaming IsoScore
    row again in a fresh process without the pin, so OpenBLAS runs the kernels it detects for this
    CPU. geomscope keeps the environment it is given; this row says what the pin costs it (the
    package multiplies with torch's MKL, which the variable does not touch)."""
    if not os.environ.get(BLAS_PIN):
        return []  # the rows above already run on OpenBLAS's own kernels
    with own_blas_kernels() as pinned:
        got = run_isolated(own_kernel_times, str(run_dir), repeats)["result"]
    t, arch = got["times"], got["blas"].get("architecture")
    return [
        {
            "benchmark": f"IsoScore, run {n:,}x384 float16, numpy's OpenBLAS on its own kernels ({arch})",
            "geomscope": n / t["g"],
            "alternative": n / t["p"],
            "ratio": t["p"] / t["g"],
            "target": ">= 1.5",
            "of bound": of_bound(stream_bound(n, 384, 2), t["g"]),
            "note": f"rows/s; the first row in a fresh process without {BLAS_PIN}={pinned} (this "
            f"environment's pin, kept everywhere else); {f64_bound_note(n, 384, t['g'])}; "
            f"median of {repeats}",
        }
    ]


def process_times(run_dir: str, repeats: int, workers: bool, dask: bool) -> dict:
    """(In a fresh spawned process, torch not loaded -- as in the CLI's ``score`` -- so worker
    processes start as they do for a user.) Median seconds of ``--workers 1`` vs ``2`` (IsoScore, the
    moment suite) and of ``--workers 2`` vs Dask ``local:2`` (the moment suite), alternating."""
    from geomscope.score.resources import worker_start_method

    path = Path(run_dir)
    out: dict = {"start_method": worker_start_method(), "torch_loaded": "torch" in sys.modules}
    if workers:
        for what, metrics in (("IsoScore", ("isoscore",)), ("moment suite", MOMENT_SUITE)):
            out[what] = alternate(
                {"w1": lambda m=metrics: _score(path, m, 1), "w2": lambda m=metrics: _score(path, m, 2)},
                repeats=repeats,
            )
    if dask:
        a = _score(path, MOMENT_SUITE, 2)["layers"][0]
        b = _score(path, MOMENT_SUITE, scheduler="local:2")["layers"][0]
        keys = ("isoscore", "isoscore_star", "avgcos_centred", "pr")
        out["dask_diff"] = max(abs(a[k] - b[k]) for k in keys)
        out["dask"] = alternate(
            {
                "w2": lambda: _score(path, MOMENT_SUITE, 2),
                "dask": lambda: _score(path, MOMENT_SUITE, scheduler="local:2"),
            },
            repeats=repeats,
        )
    return out


def process_rows(run_dir: Path, n_run: int, repeats: int, workers: bool = True) -> list[dict]:
    """The ``--workers 1 -> 2`` rows (``workers``) and the Dask ``local:2`` vs ``--workers 2`` row."""
    import importlib.util

    dask = importlib.util.find_spec("distributed") is not None
    got = run_isolated(process_times, str(run_dir), repeats, workers, dask)["result"]
    started = (
        f"worker processes {'forked' if got['start_method'] == 'fork' else 'spawned'} "
        f"(a fresh process{', torch loaded' if got['torch_loaded'] else ' without torch'}, as the CLI)"
    )
    rows = []
    for what in ("IsoScore", "moment suite") if workers else ():
        t = got[what]
        rows.append(
            {
                "benchmark": f"workers 1 -> 2, {what}, run {n_run:,}x384",
                "geomscope": n_run / t["w2"],
                "alternative": n_run / t["w1"],
                "ratio": t["w1"] / t["w2"],
                "target": "report",
                "note": f"rows/s with --workers 2 (geomscope column) vs 1 (alternative column), pool start "
                f"included; {started}; {os.cpu_count()} CPUs on this machine, shared",
            }
        )
    if dask:
        t = got["dask"]
        rows.append(
            {
                "benchmark": f"Dask local:2 vs --workers 2, moment suite, run {n_run:,}x384",
                "geomscope": n_run / t["dask"],
                "alternative": n_run / t["w2"],
                "ratio": t["w2"] / t["dask"],
                "target": ">= 0.91",
                "note": f"rows/s with --scheduler local:2 (geomscope column) vs --workers 2 (alternative); "
                f"Dask overhead {t['dask'] / t['w2'] - 1:+.1%} ({t['dask']:.2f} s vs {t['w2']:.2f} s, median "
                f"of {repeats}, each with its start-up); |difference| {got['dask_diff']:.1e}; {started}; "
                f"{os.cpu_count()} CPUs, shared",
            }
        )
    return rows


def run(quick: bool = False, only: str | None = None) -> list[dict]:
    n_run, n_arr = (20_000, 5_000) if quick else (200_000, 50_000)
    repeats = 1 if quick else 5
    if only == "dask":
        return process_rows(make_run(n_run), n_run, repeats, workers=False)
    run_dir, arr = make_run(n_run), make_array(n_arr)
    rows = []
    x_run = load_rows(run_dir)
    rows += _throughput_rows(f"run {n_run:,}x384 float16 (8 shards)", run_dir, n_run, x_run, repeats)
    del x_run
    rows += own_kernel_row(run_dir, n_run, repeats)
    x_arr = load_rows(arr)
    rows += _throughput_rows(f"array {n_arr:,}x768 float32 .npy", arr, n_arr, x_arr, repeats)
    del x_arr
    if not quick:  # a fresh process per side: too slow for the quick smoke run
        for label, path in ((f"run {n_run:,}x384 float16", run_dir), (f"array {n_arr:,}x768 float32", arr)):
            g = run_isolated(memory_child, "geomscope", str(path))["result"]
            p = run_isolated(memory_child, "package", str(path))["result"]
            rows.append(
                {
                    "benchmark": f"peak RSS over the post-import baseline (MiB), IsoScore, {label}",
                    "geomscope": g["extra_mb"],
                    "alternative": p["extra_mb"],
                    "ratio": p["extra_mb"] / max(g["extra_mb"], 1e-9),
                    "target": ">= 1",
                    "note": "one spawned process per side, RSS sampled every ms minus the RSS after imports; "
                    "the package side loads the rows as float32 (as it must)",
                }
            )
    return rows + process_rows(run_dir, n_run, repeats, workers=not quick)


if __name__ == "__main__":
    args = bench_args(__doc__, only=("dask",), json_out=True)
    out = run(quick=args.quick, only=args.only)
    print_rows(out, "score: streaming scorer vs the isoscore package")
    if args.json:
        print(json.dumps(out, indent=1))
