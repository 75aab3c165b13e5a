"""``score --scheduler``: the per-shard tasks of every pass as Dask distributed tasks.

``--scheduler`` takes ``local:N`` (a ``distributed.LocalCluster`` of N single-threaded worker
processes on this machine, started for the score call and closed after it; no dashboard, localhost
only), ``tcp://HOST:PORT`` (a running Dask scheduler; workers must import the same geomscope and read
the run's files at the same paths) or ``FILE.json`` (a Dask scheduler file, ``dask scheduler
--scheduler-file FILE.json``). ``pip install 'geomscope[dask]'`` installs Dask.

A task carries only the :class:`~geomscope.score.sources.Task` (paths, sizes, checksums) and the
:class:`~geomscope.score.accumulate.PassSpec`; the worker opens the files (h5py objects are never
pickled) and returns its partial accumulators. Results are merged ON THE CLIENT IN TASK ORDER, as
``--workers N`` merges them: at most ``2 x (worker threads)`` tasks are submitted and not yet merged
(results that come back early wait in a buffer, keyed by task index), so memory does not grow with
the number of shards, and the merge order -- and so the report, bit for bit -- does not depend on
timing or on which worker ran what; it equals ``--workers N``'s and equals ``--workers 1``'s to float64
rounding. The seeded TwoNN / quantile samples depend only on row keys, so they are identical.

BLAS runs on one thread in every worker: the Nanny of ``local:N`` starts workers with
OMP/MKL/OPENBLAS_NUM_THREADS=1 (Dask's default ``distributed.nanny.pre-spawn-environ``), and the
task function itself limits the BLAS/OpenMP pools of its thread to one (threadpoolctl) the first
time it runs there, so workers of an external cluster are limited too.

A worker that dies mid-task (killed, out of memory) loses its tasks; the scheduler runs them again
on another worker (Dask's ``distributed.scheduler.allowed-failures``, 3 by default), and the report
is the same. An exception raised by a task (a damaged shard) is raised here, with its own type.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from geomscope.errors import InputError
from geomscope.score.accumulate import PassSpec, merge_parts, run_task
from geomscope.score.sources import Task

INSTALL_HINT = "pip install 'geomscope[dask]'"
CONNECT_TIMEOUT_S = 10
SCHEDULER_FORMS = "local:N, tcp://HOST:PORT or a Dask scheduler file FILE.json"

_limited = threading.local()


def parse_scheduler(value) -> str:
    """The normalised ``--scheduler`` value; InputError (one line) for a malformed one or a missing
    scheduler file. Does not import Dask or connect."""
    s = str(value).strip()
    low = s.lower()
    if low.startswith("local:"):
        n = s[len("local:") :].strip()
        if not n.isdigit() or int(n) < 1:
            raise InputError(f"--scheduler local:N needs a whole number of workers N >= 1; got {s!r}")
        return f"local:{int(n)}"
    if low.startswith("tcp://"):
        host, sep, port = s[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"--scheduler {s!r} is not tcp://HOST:PORT (a Dask scheduler's address)")
        return "tcp://" + s[len("tcp://") :]
    if low.endswith(".json"):
        if not Path(s).is_file():
            raise InputError(
                f"--scheduler file {s} does not exist; give the file a Dask scheduler wrote "
                "(dask scheduler --scheduler-file FILE.json)"
            )
        return s
    raise InputError(f"--scheduler must be {SCHEDULER_FORMS}; got {s!r}")


def require_distributed():
    """``distributed``, or InputError naming the extra that installs it."""
    try:
        import distributed
    except ImportError:
        raise InputError(
            f"--scheduler needs Dask distributed, which is not installed: {INSTALL_HINT}"
        ) from None
    return distributed


def dask_run_task(task: Task, spec: PassSpec) -> dict:
    """What a Dask worker runs: one task's partial accumulators, BLAS on one thread."""
    if not getattr(_limited, "done", False):
        from geomscope.score.executor import _init_worker

        _init_worker()  # env vars + threadpool_limits(1) for this thread's pools (kept, not a context)
        _limited.done = True
    return run_task(task, spec)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class DaskExecutor:
    """``DaskExecutor(scheduler)``: connects (or starts ``local:N``) at once; ``run`` as Executor's."""

    def __init__(self, scheduler: str):
        distributed = require_distributed()
        self.scheduler = parse_scheduler(scheduler)
        self._cluster = None
        self.client = None
        try:
            self.client = self._connect(distributed)
            self.client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        except InputError:
            self.close()
            raise
        except (OSError, TimeoutError) as e:
            self.close()
            raise InputError(
                f"--scheduler {self.scheduler}: no Dask scheduler with workers answered within "
                f"{CONNECT_TIMEOUT_S} s ({_first_line(e)})"
            ) from None
        except BaseException:
            self.close()
            raise
        threads = sum(self.client.nthreads().values())
        self.window = 2 * max(1, threads)
        self.in_flight = self.window  # task results held besides the accumulator (engine's memory plan)

    def _connect(self, distributed):
        s = self.scheduler
        if s.startswith("local:"):
            self._cluster = distributed.LocalCluster(
                n_workers=int(s[len("local:") :]),
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                worker_dashboard_address=None,
                # no dashboard; the scheduler's bare HTTP endpoint on a free localhost port, not 8787
                scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
                silence_logs=logging.ERROR,
            )
            return distributed.Client(self._cluster, set_as_default=False)
        if s.startswith("tcp://"):
            return distributed.Client(s, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        return distributed.Client(scheduler_file=s, timeout=CONNECT_TIMEOUT_S, set_as_default=False)

    def __enter__(self) -> DaskExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def run(self, tasks: list[Task], spec: PassSpec, advance: Callable[[int], None] | None = None) -> dict:
        from distributed import as_completed

        client, token = self.client, uuid.uuid4().hex[:12]
        index: dict = {}  # future -> task index
        done: dict[int, dict] = {}  # results back before their turn to be merged
        acc: dict = {}
        ac = as_completed(loop=client.loop, with_results=True)
        nxt_submit = nxt_merge = 0

        def submit_more():
            nonlocal nxt_submit
            while nxt_submit < len(tasks) and len(index) + len(done) < self.window:
                fut = client.submit(
                    dask_run_task,
                    tasks[nxt_submit],
                    spec,
                    key=f"geomscope-{spec.kind}-{token}-{nxt_submit}",
                    pure=False,
                )
                index[fut] = nxt_submit
                ac.add(fut)
                nxt_submit += 1

        try:
            submit_more()
            while nxt_merge < len(tasks):
                fut, part = next(ac)
                i = index.pop(fut)
                fut.release()
                done[i] = part
                if advance:
                    advance(tasks[i].rows)
                while (
                    nxt_merge in done
                ):  # by task index, never by arrival: the report cannot depend on timing
                    acc = merge_parts([acc, done.pop(nxt_merge)])
                    nxt_merge += 1
                submit_more()
        except BaseException:
            ac.clear()
            for fut in list(index):
                fut.cancel()
            raise
        return acc
