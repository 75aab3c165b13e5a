"""What this machine gives a score, and how score's worker processes start on it.

``usable_cores`` are shared among the worker processes, as threads over blocks. ``physical_memory``
bounds what a pass may hold (engine.py refuses accumulators larger than the machine; formats.py
reads compressed members whole only up to a quarter of it). ``--workers`` is at most
:data:`MAX_WORKERS`; joining a Dask cluster waits at most :data:`CONNECT_TIMEOUT_S`. Worker
processes are forked where that is safe (:func:`worker_start_method`), else spawned, and every
worker -- a pool's process or a Dask worker's thread -- runs BLAS on one thread
(:func:`init_worker`): the products are small, and multi-threaded BLAS on them only spins.
"""

from __future__ import annotations

import contextlib
import os

from geomscope.errors import InputError


def physical_memory() -> int | None:
    """This machine's memory in bytes, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


#: seconds a running Dask scheduler (``tcp://``, a scheduler file) has to accept a connection and
#: answer (dask_executor.probe_scheduler), and then again to have a worker; ``local:N``'s time for
#: its first worker. A scheduler on the network answers in milliseconds; 10 s leaves room for one
#: being started beside the score call, and a wrong address is said within it. ``--scheduler``'s
#: help states it.
CONNECT_TIMEOUT_S = 10

#: the most --workers (its declared bound, score/options.py) and --scheduler local:N workers
#: (:func:`check_workers`): a typo's 100000 would fork until the machine gives out; beyond the
#: cores, more processes only share them
MAX_WORKERS = 1024


def check_workers(workers: int) -> int:
    """``workers`` if at most :data:`MAX_WORKERS`; InputError (one line) otherwise."""
    if workers > MAX_WORKERS:
        raise InputError(
            f"--workers must be at most {MAX_WORKERS}; got {workers} (this machine has "
            f"{os.cpu_count() or 1} cores: more workers than cores pay only where reading waits on storage)"
        )
    return workers


def init_worker() -> None:
    """What every worker sets first: the default SIGTERM (where it can) and BLAS/OpenMP on one
    thread, by environment for pools not loaded yet and by threadpoolctl for those already loaded."""
    import signal
    import threading

    # a forked worker inherits the CLI's SIGTERM-as-Ctrl-C; the pool stops its workers with SIGTERM
    # (a Dask worker runs this in one of its threads, where no handler can be set, nor was inherited)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn (scikit-dimension)
        pass


def worker_start_method() -> str:
    """How score starts worker processes now: ``fork`` on Linux while neither torch is loaded (its
    OpenMP pool does not survive a fork, and torch reads ``.pt``/``.safetensors`` inputs in the
    workers) nor an HDF5 file open in this process (HDF5 shares one handle per file within a
    process); else ``spawn`` -- always on macOS, whose system frameworks do not survive a fork."""
    import sys

    if not sys.platform.startswith("linux") or "torch" in sys.modules:
        return "spawn"
    h5py = sys.modules.get("h5py")
    if h5py is not None and h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) > 0:
        return "spawn"
    return "fork"


def one_blas_thread():
    """A context in which BLAS/OpenMP pools use one thread (no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return threadpool_limits(1)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
