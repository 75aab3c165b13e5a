"""Shared helpers for the benchmark scripts: timing, medians, memory, machine, markdown.

Every benchmark runs geomscope and the alternative a user has on the same data in one process
(or one script), alternating, several repeats, and reports medians and ratios.  Nothing here is
used by the test suite: speed is never asserted in tests.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def bench_args(doc: str | None, argv=None, *, only: tuple[str, ...] = (), json_out: bool = False):
    """The command line of a benchmark script: ``--quick`` (small sizes), ``--only AREA`` where the
    script offers ``only`` areas, ``--json`` (the rows as JSON after the table) where ``json_out``.
    ``--help`` prints the script's docstring; an unknown argument is an error, not a full run."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    if only:
        ap.add_argument("--only", choices=only, default=None, help="run one area")
    if json_out:
        ap.add_argument("--json", action="store_true", help="print the rows as JSON after the table")
    return ap.parse_args(argv)


def timeit(fn: Callable[[], object], repeats: int = 3, warmup: int = 0) -> list[float]:
    """Wall-clock seconds of ``fn()`` for each of ``repeats`` calls (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def alternate(fns: dict[str, Callable[[], object]], repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """Time several functions alternately (a, b, a, b, ...) and return the median seconds of each.

    Alternating spreads machine noise (other processes, thermal state) evenly over the contenders.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def median(xs) -> float:
    return float(statistics.median(xs))


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux ru_maxrss is KiB)."""
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / (1024 * 1024)


def _child(target, args, kwargs, q):
    t0 = time.perf_counter()
    result = target(*args, **kwargs)
    q.put({"result": result, "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()})


def run_isolated(target: Callable, *args, **kwargs) -> dict:
    """Run ``target(*args, **kwargs)`` in a fresh spawned process; return its result, seconds and
    peak RSS (MiB).  ``target`` must be importable (a module-level function) and its result picklable.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(target, args, kwargs, q))
    p.start()
    out = q.get()
    p.join()
    return out


def run_command_rss(cmd: list[str], env: dict | None = None) -> dict:
    """Run a command; return seconds and the child's peak RSS in MiB (via /usr/bin/time if present)."""
    t0 = time.perf_counter()
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr[-2000:]}")
    return {
        "seconds": time.perf_counter() - t0,
        "peak_rss_mb": max(before, after) / 1024,
        "stdout": proc.stdout,
    }


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    info["blas"] = blas_info()
    return info


_LIMITS: dict = {}
_LIMIT_SOURCES: dict = {}
#: the variable that pins OpenBLAS (numpy's BLAS) to one kernel set instead of the one it detects
BLAS_PIN = "OPENBLAS_CORETYPE"


def blas_info() -> dict:
    """numpy's BLAS in this process: library, version, kernel set (threadpoolctl's "architecture")
    and threads, with ``OPENBLAS_CORETYPE`` where the environment sets it."""
    info: dict = {}
    try:
        import numpy  # noqa: F401 - loads the BLAS that threadpoolctl reports
        from threadpoolctl import threadpool_info

        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                info = {k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
                break
    except ImportError:
        pass
    if os.environ.get(BLAS_PIN):
        info[BLAS_PIN] = os.environ[BLAS_PIN]
    return info


@contextlib.contextmanager
def own_blas_kernels():
    """Processes started inside run OpenBLAS on the kernels it detects for this CPU:
    ``OPENBLAS_CORETYPE`` is removed from the environment meanwhile (OpenBLAS reads it once, when it
    loads, so this process's numpy keeps the kernels it has)."""
    pinned = os.environ.pop(BLAS_PIN, None)
    try:
        yield pinned
    finally:
        if pinned is not None:
            os.environ[BLAS_PIN] = pinned


def gemm_rates(n: int, library: str = "numpy") -> dict:
    """float32 and float64 GEMM rates (GFLOP/s) of square n x n products with ``library``'s
    multi-threaded BLAS (numpy's OpenBLAS or torch's), best of 3 after a warm-up."""
    import numpy as np

    rates = {}
    for name, dt in (("gemm_f32_gflops", np.float32), ("gemm_f64_gflops", np.float64)):
        a = np.random.default_rng(0).standard_normal((n, n)).astype(dt)
        if library == "torch":
            import torch

            a = torch.from_numpy(a)
        a @ a  # warm-up (threads, pages)
        best = min(timeit(lambda a=a: a @ a, repeats=3))
        rates[name] = 2 * n**3 / best / 1e9
    return rates


def machine_limits(quick: bool = False) -> dict:
    """This machine's own limits, measured in this run (once per process): the float32 and float64
    GEMM rates (GFLOP/s) and the memory bandwidth of a large copy (GB/s counting read + write, best
    of 3). Each benchmark row states the fraction of the bound it reaches (``of bound``: the
    hardware's minimum time / measured).

    A GEMM rate is the best of numpy's BLAS in this process, torch's, and -- where the environment
    pins OpenBLAS's kernels with ``OPENBLAS_CORETYPE`` -- numpy's in a fresh process on the kernels
    OpenBLAS picks for this CPU by itself: the limit is the hardware's, not one library's setting
    (this machine's environment pins OpenBLAS to its AVX2 kernels on a CPU with AVX-512, which
    halves numpy's float32 rate). :func:`limit_sources` says which one gave each rate."""
    if _LIMITS:
        return _LIMITS
    import numpy as np

    n = 1024 if quick else 2048
    measured = {"numpy": gemm_rates(n)}
    try:
        measured["torch"] = gemm_rates(n, "torch")
    except ImportError:
        pass
    if os.environ.get(BLAS_PIN):
        with own_blas_kernels():
            measured["numpy, OpenBLAS's own kernels"] = run_isolated(gemm_rates, n)["result"]
    for key in ("gemm_f32_gflops", "gemm_f64_gflops"):
        best = max(measured, key=lambda src: measured[src][key])
        _LIMITS[key] = measured[best][key]
        _LIMIT_SOURCES[key] = {src: round(r[key], 1) for src, r in measured.items()} | {"best": best}
    src = np.ones(64 * 2**20 // 8 * (1 if quick else 4))  # 64 / 256 MiB
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(timeit(lambda: np.copyto(dst, src), repeats=3))
    _LIMITS["bandwidth_gbs"] = 2 * src.nbytes / best / 1e9
    return _LIMITS


def limit_sources() -> dict:
    """Each GEMM rate of :func:`machine_limits` by library and kernels, and which one was the best."""
    return dict(_LIMIT_SOURCES)


def stream_bound_f64(n: int, d: int) -> float:
    """The bound of :func:`stream_bound` with the float64 product that the 1e-10 accuracy needs
    (the product dominates)."""
    return n * d * d / (machine_limits()["gemm_f64_gflops"] * 1e9)


def f64_bound_note(n: int, d: int, seconds: float) -> str:
    """The note's "of the float64 bound x.xx": the fraction of :func:`stream_bound_f64` reached."""
    return f"of the float64 bound {of_bound(stream_bound_f64(n, d), seconds):.2f}"


def stream_bound(n: int, d: int, itemsize: int) -> float:
    """Seconds the hardware needs at least to score n x d rows in one pass (from disk or memory):
    max(reading the stored values and converting them (bytes in + float32 out over the memory
    bandwidth), the scatter update (a symmetric rank-n product, n d^2 flops, at the float32 GEMM
    rate, all cores)). The bound keeps float32 products although geomscope multiplies in float64
    (float32 products of the centred blocks carry ~1e-8 relative error; its results must match
    float64 to 1e-10), so geomscope can reach about gemm_f64 / gemm_f32 of it (0.4 here)."""
    lim = machine_limits()
    read = n * d * (itemsize + 4) / (lim["bandwidth_gbs"] * 1e9)
    syrk = n * d * d / (lim["gemm_f32_gflops"] * 1e9)
    return max(read, syrk)


def of_bound(bound_seconds: float | None, seconds: float | None) -> float | None:
    """The fraction of the hardware bound a measured time reaches (1 = at the limit)."""
    if not bound_seconds or not seconds:
        return None
    return bound_seconds / seconds


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0 or 1e-3 <= abs(x) < 1e6:
            return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:,.{max(0, digits - 1)}f}".rstrip("0").rstrip(".")
        return f"{x:.{digits}e}"
    return str(x)


def markdown_table(rows: list[dict], headers: list[str] | None = None) -> str:
    """Render rows (dicts) as a GitHub markdown table; ``headers`` picks and orders the columns."""
    if not rows:
        return "(no rows)"
    headers = headers or list(rows[0].keys())
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(h)) for h in headers) + " |")
    return "\n".join(lines)


STANDARD_HEADERS = ["benchmark", "geomscope", "alternative", "ratio", "target", "of bound", "note"]


def print_rows(rows: list[dict], title: str | None = None) -> None:
    if title:
        print(f"\n### {title}\n")
    print(markdown_table(rows, STANDARD_HEADERS))
    print()
    print("machine: " + json.dumps(machine_info()))
    print("limits: " + json.dumps({k: round(v, 1) for k, v in machine_limits().items()}))
    print("limit sources: " + json.dumps(limit_sources()) + "; numpy's BLAS: " + json.dumps(blas_info()))
