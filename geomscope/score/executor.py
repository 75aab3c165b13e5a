"""Run tasks in this process or a process pool; merge their partial accumulators in task order.

In this process (``--workers 1``) every task accumulates into one set of accumulators. With a pool,
each task returns its partial accumulators, merged in task order as they become available
(out-of-order results wait in a small buffer; at most twice the pool's processes are in flight), so
memory does not grow with the number of shards and the numbers do not depend on timing; they equal
one worker's to float64 rounding (a different but exact merge order).

Worker processes are forked where that is safe (resources.worker_start_method: Linux, torch not
loaded, no HDF5 file open in this process), else spawned: a spawned worker starts a fresh
interpreter and imports numpy, h5py and geomscope again (``--workers 2`` on the 200k-row run: 1.87 s
spawned, 1.41 s forked). The pool forks its workers once, at the first task of the first pass, when
this process runs no threads of geomscope's (the thread pools of metrics/moments.py are per process
id, so a child never uses its parent's). BLAS runs on ONE thread in every worker process (and
``score`` limits this process too; a forked worker inherits BLAS already loaded, so the initializer
limits it with threadpoolctl). The pool has ``--workers`` processes, but never more than the first
pass has tasks (shards), and ``--workers`` is at most resources.MAX_WORKERS:
parallelism comes from ``--workers`` -- processes over shards, threads over layers -- and, inside a
task, from threads that each run single-threaded BLAS on their own blocks (``PassSpec.threads``:
usable cores / workers; see metrics/moments.py). The products are small (blocks of a few thousand
rows x D x D, D x D eigensolves), and multi-threaded OpenBLAS on them was 4x (dsyrk) to 100x
(eigvalsh of 384 x 384) slower than one thread on a busy 2-core machine (its threads spin-wait for
each other); independent blocks in separate threads never wait for each other.

``--scheduler`` (local:N, tcp://HOST:PORT, FILE.json) runs the same tasks on a Dask cluster instead
(dask_executor.py): fixed runs of consecutive tasks merged on the workers, then in order on the
client, so the numbers equal one worker's to float64 rounding. :func:`make_executor` picks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from geomscope.errors import GeomscopeError
from geomscope.score.accumulate import PassSpec, merge_parts, run_task, run_tasks
from geomscope.score.resources import check_workers, init_worker, worker_start_method
from geomscope.store.blocks import Task


class Executor:
    """``Executor(workers)``; ``run(tasks, spec, advance)`` -> merged dict layer -> LayerPart."""

    def __init__(self, workers: int = 1):
        self.workers = check_workers(int(workers))
        self._pool: ProcessPoolExecutor | None = None
        self.start_method: str | None = None  # how the pool's processes started (worker_start_method)
        self.processes = 0  # how many the pool started: --workers, at most one per task
        self.in_flight = 0 if self.workers <= 1 else 2 * self.workers  # results held besides the accumulator

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _get_pool(self) -> ProcessPoolExecutor:
        """The pool of :attr:`processes` (``run`` sets them at the first pass; else --workers)."""
        if self._pool is None:
            import multiprocessing as mp

            self.start_method = worker_start_method()
            self.processes = self.processes or self.workers
            self._pool = ProcessPoolExecutor(
                self.processes, mp_context=mp.get_context(self.start_method), initializer=init_worker
            )
        return self._pool

    def run(self, tasks: list[Task], spec: PassSpec, advance: Callable[[int], None] | None = None) -> dict:
        if self.workers <= 1 or len(tasks) <= 1:
            return run_tasks(tasks, spec, advance)
        if self._pool is None:
            # at most one process per task of the first pass: a forked pool starts every process at
            # once, and one without a task is only forked to hold memory and wait (--workers 30 on
            # 5 shards started 31). The pool serves the later passes too (forking again after
            # threads have run is not safe); the passes over a source have the same tasks.
            self.processes = min(self.workers, len(tasks))
        pool = self._get_pool()
        window = 2 * self.processes
        acc = {}
        pending: dict = {}
        done_out_of_order: dict[int, dict] = {}
        nxt_submit = nxt_merge = 0
        try:
            while nxt_merge < len(tasks):
                while nxt_submit < len(tasks) and len(pending) + len(done_out_of_order) < window:
                    fut = pool.submit(run_task, tasks[nxt_submit], spec)
                    pending[fut] = nxt_submit
                    nxt_submit += 1
                finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in finished:
                    i = pending.pop(fut)
                    done_out_of_order[i] = _result(fut, self.processes)
                    if advance:
                        advance(tasks[i].rows)
                while nxt_merge in done_out_of_order:
                    acc = merge_parts([acc, done_out_of_order.pop(nxt_merge)])
                    nxt_merge += 1
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        return acc


def _result(fut, processes: int):
    """A pool task's partial accumulators; a worker process that ended abruptly (the kernel's
    out-of-memory killer, a signal) breaks the pool, and that is one line, not the pool's
    traceback."""
    try:
        return fut.result()
    except BrokenProcessPool:
        raise GeomscopeError(
            f"a worker process of the {processes} scoring the shards ended abruptly (killed: out of "
            "memory, or by a signal); nothing was written: score again with fewer --workers or a "
            "lower --memory-mb"
        ) from None


def make_executor(workers: int = 1, scheduler: str | None = None):
    """A Dask executor for ``--scheduler``, else a local one for ``--workers``."""
    if scheduler:
        from geomscope.score.dask_executor import DaskExecutor

        return DaskExecutor(scheduler)
    return Executor(workers)
