"""``score --scheduler``: the per-shard tasks of every pass as Dask distributed tasks.

``--scheduler`` takes ``local:N`` (a ``distributed.LocalCluster`` of N single-threaded worker
processes on this machine, started for the score call and closed after it; no dashboard, localhost
only), ``tcp://HOST:PORT`` (a running Dask scheduler; workers must import the same geomscope and read
the run's files at the same paths) or ``FILE.json`` (a Dask scheduler file, ``dask scheduler
--scheduler-file FILE.json``). ``pip install 'geomscope[dask]'`` installs Dask.

A Dask task carries only :class:`~geomscope.score.sources.Task` objects (paths, sizes, checksums) and the
:class:`~geomscope.score.accumulate.PassSpec`; the worker opens the files (h5py objects are never
pickled). Each Dask task is a CHUNK of consecutive tasks, indices ``[k c, (k + 1) c)`` with ``c =
ceil(tasks / (2 x threads))`` (``threads``: N for ``local:N``, an external cluster's worker threads
when connected), which the worker accumulates in order into one set of partial accumulators (as
``--workers 1`` does) and returns: about two chunks per thread keep the load balanced while half as
many or fewer results (per layer G jackknife groups of D x D float64: ~12 MB for D = 384, G = 10)
travel back. They travel as pickle-5 out-of-band buffers (no copy of the arrays into the pickle).
Chunk results are merged ON THE CLIENT IN CHUNK ORDER: at most ``2 x threads`` chunks are submitted
and not yet merged (results that come back early wait in a buffer, keyed by chunk index), so memory
does not grow with the number of shards (a worker holds one chunk's accumulators, as it held one
task's), and the merge tree -- and so the report, bit for bit -- depends only on the number of tasks
and of threads, never on timing or on which worker ran what; it equals ``--workers 1``'s to float64
rounding (not ``--workers N``'s bit for bit: a different, equally exact merge tree). The seeded
TwoNN / quantile samples depend only on row keys, so they are identical.

``local:N`` starts the scheduler, then asks for its N workers without waiting for all of them: tasks
start as soon as one worker is up, the others join as they come. The chunking uses N, not the workers
up at that moment. The N workers are forked from this process where that is safe (Dask's
``distributed.worker.multiprocessing-method`` = ``fork`` while they start; all N are then awaited,
about 0.1 s) instead of spawned: a spawned worker starts a fresh interpreter and imports Dask and
geomscope again (first task 0.69 s after the cluster was asked for, close 0.14 s), a forked one has
them already (0.13 s, close 0.02 s). Safe means what it means for ``--workers``
(executor.worker_start_method: Linux, torch not loaded, no HDF5 file open), so a library caller that
has torch loaded, a notebook that extracted first, gets spawned workers. The fork happens before any
pass, when this process runs no threads of geomscope's; a worker the Nanny restarts later (one that
died) is spawned. A forked worker inherits numpy's BLAS already loaded, so Dask's
``OMP_NUM_THREADS=1`` for new processes cannot limit it: the task function does (below).

BLAS runs on one thread in every worker: the Nanny of ``local:N`` starts spawned workers with
OMP/MKL/OPENBLAS_NUM_THREADS=1 (Dask's default ``distributed.nanny.pre-spawn-environ``), and the
task function itself limits the BLAS/OpenMP pools of its thread to one (threadpoolctl) the first
time it runs there, so forked workers and those of an external cluster are limited too.

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
from geomscope.score.executor import worker_start_method
from geomscope.score.sources import Task

INSTALL_HINT = "pip install 'geomscope[dask]'"
CONNECT_TIMEOUT_S = 10
SCHEDULER_FORMS = "local:N, tcp://HOST:PORT or a Dask scheduler file FILE.json"
CHUNKS_PER_THREAD = 2

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


def dask_run_chunk(tasks: list[Task], spec: PassSpec) -> dict:
    """What a Dask worker runs: consecutive tasks accumulated in order into ONE set of partial
    accumulators (as ``--workers 1`` accumulates), BLAS on one thread."""
    if not getattr(_limited, "done", False):
        from geomscope.score.executor import _init_worker

        _init_worker()  # env vars + threadpool_limits(1) for this thread's pools (kept, not a context)
        _limited.done = True
    acc: dict = {}
    for t in tasks:
        run_task(t, spec, into=acc)
    return acc


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class DaskExecutor:
    """``DaskExecutor(scheduler)``: connects (or starts ``local:N``) at once; ``run`` as Executor's."""

    def __init__(self, scheduler: str):
        distributed = require_distributed()
        self.scheduler = parse_scheduler(scheduler)
        self._cluster = None
        self.start_method: str | None = None  # local:N: how its worker processes start
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
        if self.scheduler.startswith("local:"):
            self.threads = int(self.scheduler[len("local:") :])  # all of them, even if not all up yet
        else:
            self.threads = max(1, sum(self.client.nthreads().values()))
        self.window = 2 * self.threads
        self.in_flight = self.window  # task results held besides the accumulator (engine's memory plan)

    def _connect(self, distributed):
        s = self.scheduler
        if s.startswith("local:"):
            import dask

            n = int(s[len("local:") :])
            self.start_method = worker_start_method()
            # read when a Nanny starts a worker process (in Dask's own thread): held until the N
            # workers are up, so a worker restarted later is spawned
            with dask.config.set({"distributed.worker.multiprocessing-method": self.start_method}):
                # the scheduler first, then the N workers without waiting for them: tasks start on
                # the first worker up (DaskExecutor waits for one), the others join as they come
                self._cluster = distributed.LocalCluster(
                    n_workers=0,
                    threads_per_worker=1,
                    processes=True,
                    host="127.0.0.1",
                    dashboard_address=None,
                    worker_dashboard_address=None,
                    # no dashboard; the scheduler's bare HTTP endpoint on a free localhost port, not 8787
                    scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
                    silence_logs=logging.ERROR,
                )
                self._cluster.scale(n)
                client = distributed.Client(self._cluster, set_as_default=False)
                if self.start_method == "fork":  # forked workers are up within ~0.1 s
                    try:
                        client.wait_for_workers(n, timeout=CONNECT_TIMEOUT_S)
                    except TimeoutError:  # slow ones join later (spawned); one up is enough, as ever
                        pass
                    except BaseException:
                        client.close()
                        raise
            return client
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

    def chunk_size(self, n_tasks: int) -> int:
        """Tasks per Dask task: consecutive task indices ``[k c, (k + 1) c)`` run in one worker call.
        Depends only on the number of tasks and of worker threads (``local:N``: N; an external
        cluster: its threads when connected), never on timing: about two chunks per thread, so load
        stays balanced while half as few (or fewer) results travel back."""
        return max(1, -(-n_tasks // (CHUNKS_PER_THREAD * self.threads)))

    def run(self, tasks: list[Task], spec: PassSpec, advance: Callable[[int], None] | None = None) -> dict:
        from distributed import as_completed

        client, token = self.client, uuid.uuid4().hex[:12]
        c = self.chunk_size(len(tasks))
        chunks = [tasks[k : k + c] for k in range(0, len(tasks), c)]
        index: dict = {}  # future -> chunk index
        done: dict[int, dict] = {}  # results back before their turn to be merged
        acc: dict = {}
        ac = as_completed(loop=client.loop, with_results=True)
        nxt_submit = nxt_merge = 0

        def submit_more():
            nonlocal nxt_submit
            while nxt_submit < len(chunks) and len(index) + len(done) < self.window:
                fut = client.submit(
                    dask_run_chunk,
                    chunks[nxt_submit],
                    spec,
                    key=f"geomscope-{spec.kind}-{token}-{nxt_submit}",
                    pure=False,
                )
                index[fut] = nxt_submit
                ac.add(fut)
                nxt_submit += 1

        try:
            submit_more()
            while nxt_merge < len(chunks):
                fut, part = next(ac)
                i = index.pop(fut)
                fut.release()
                done[i] = part
                if advance:
                    advance(sum(t.rows for t in chunks[i]))
                while (
                    nxt_merge in done
                ):  # by chunk index, never by arrival: the report cannot depend on timing
                    acc = merge_parts([acc, done.pop(nxt_merge)])
                    nxt_merge += 1
                submit_more()
        except BaseException:
            ac.clear()
            for fut in list(index):
                fut.cancel()
            raise
        return acc
