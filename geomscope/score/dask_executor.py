"""``score --scheduler``: the per-shard tasks of every pass as Dask distributed tasks.

``--scheduler`` takes ``local:N`` (a ``distributed.LocalCluster`` of N single-threaded worker
processes on this machine, started for the score call and closed after it; no dashboard, localhost
only), ``tcp://HOST:PORT`` (a running Dask scheduler; workers must import the same geomscope and read
the run's files at the same paths) or ``FILE.json`` (a Dask scheduler file, ``dask scheduler
--scheduler-file FILE.json``). ``pip install 'geomscope[dask]'`` installs Dask.

A Dask task carries only :class:`~geomscope.store.blocks.Task` objects (paths, sizes, checksums) and the
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

``local:N`` starts the scheduler and a client, then asks for its N workers. The N workers are
forked from this process where that is safe (Dask's ``distributed.worker.multiprocessing-method`` =
``fork`` while they start) instead of spawned: a spawned worker starts a fresh interpreter and imports
Dask and geomscope again (its first task comes about 0.7 s after the cluster is asked for), a forked
one has them already. Safe means what it means for ``--workers`` (resources.worker_start_method: Linux,
torch not loaded, no HDF5 file open), so a library caller that has torch loaded, a notebook that
extracted first, gets spawned workers. Forked workers are all awaited (the forks must be over before
a pass starts, when this process runs no threads of geomscope's); of spawned ones the first, and tasks
start on it while the others join. The chunking uses N, not the workers up at that moment. A worker
the Nanny restarts later (one that died) is spawned. A forked worker inherits numpy's BLAS already
loaded, so Dask's ``OMP_NUM_THREADS=1`` for new processes cannot limit it: the task function does
(below).

What a local cluster costs beside the pool of ``--workers N``: about as much (0.98-0.99x the pool's
speed on the benchmark's 200k x 384 run, moment suite, 2 cores, with the same CPU seconds), where
Dask's defaults cost 12-17 % more. What keeps it there: LOCAL_CLUSTER_CONFIG (below); results
gathered straight from the workers; the client made before the workers, and the workers awaited by
reading the in-process scheduler's table (a faster start); numpy.random imported before the fork.

BLAS runs on one thread in every worker: the Nanny of ``local:N`` starts spawned workers with
OMP/MKL/OPENBLAS_NUM_THREADS=1 (Dask's default ``distributed.nanny.pre-spawn-environ``), and the
task function itself limits the BLAS/OpenMP pools of its thread to one (threadpoolctl) the first
time it runs there, so forked workers and those of an external cluster are limited too.

A worker that dies mid-task (killed, out of memory) loses its tasks; the scheduler runs them again
on another worker (Dask's ``distributed.scheduler.allowed-failures``, 3 by default), and the report
is the same. An exception raised by a task (a damaged shard) is raised here, with its own type.

Joining a running cluster (``tcp://`` or a scheduler file) waits at most CONNECT_TIMEOUT_S for the
scheduler, then at most CONNECT_TIMEOUT_S for its first worker. Dask's own connect does not bound
its handshake (it waits for the peer's first message without a timeout, so a port where another
service listens, an HTTP server or a silent listener, keeps a client waiting for good), so the address is
probed first (:func:`probe_scheduler`: connect, Dask's handshake and one ``identity`` call, all
within the timeout, on a connection the probe opens and closes); only a peer that answers as a Dask
scheduler is handed to ``distributed.Client``. Every way it can fail (nothing listening, a service
that is not Dask, a Dask worker's address, an address scheme this machine cannot use, TLS without
its settings) is one ``InputError`` line naming the address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

from geomscope.errors import InputError, first_line
from geomscope.fileio import read_json
from geomscope.score.accumulate import PassSpec, merge_parts, run_task
from geomscope.score.resources import (
    CONNECT_TIMEOUT_S,
    check_workers,
    init_worker,
    worker_start_method,
)
from geomscope.store.blocks import Task

INSTALL_HINT = "pip install 'geomscope[dask]'"
#: the most bytes of a scheduler file read: Dask writes its scheduler's identity there (address, id,
#: services, no workers yet), a few hundred bytes
SCHEDULER_FILE_MAX_BYTES = 2**20
#: the longest scheduler address taken from a scheduler file: a host name has at most 253 characters,
#: and the address is quoted in one-line messages
SCHEDULER_ADDRESS_MAX_CHARS = 1000
#: seconds, beside CONNECT_TIMEOUT_S, the probe's thread has to end after its deadline (its event
#: loop closes its connection and waits for a name lookup still under way) before it is left behind
PROBE_GRACE_S = 2
SCHEDULER_FORMS = "local:N, tcp://HOST:PORT or a Dask scheduler file FILE.json"
CHUNKS_PER_THREAD = 2
# Dask settings for the local:N cluster geomscope starts (an external scheduler keeps its own). What they
# switch off serves a dashboard local:N never starts, and costs CPU on the cores the tasks need (about
# a tenth of a score call's CPU seconds on the benchmark's 200k x 384 run on 2 cores).
# Each is read when a scheduler, Nanny or worker is made.
LOCAL_CLUSTER_CONFIG = {
    "distributed.worker.profile.enabled": False,  # a thread sampling every server's stacks every 10 ms
    "distributed.admin.system-monitor.interval": "10s",  # psutil readings twice a second per server
    "distributed.admin.tick.interval": "1s",  # event-loop latency probe, 50 times a second per server
    # where chunks wait on the scheduler (Dask queues a group of more tasks than twice the threads of
    # the workers up: spawned workers, the first one up alone), a worker is given one only when its
    # thread is free; once all are up, a pass's two chunks per thread are placed at once, balanced by
    # their equal sizes, so work stealing's 100 ms rebalancing is off
    "distributed.scheduler.worker-saturation": 1.0,
    "distributed.scheduler.work-stealing": False,
}

_limited = threading.local()
# dask.config.set restores on exit what it saw on entry, without a lock: two local:N starts
# overlapping in threads (A in, B in, A out, B out) would leave A's settings on for the process
_LOCAL_START = threading.Lock()


def parse_scheduler(value) -> str:
    """The normalised ``--scheduler`` value; InputError (one line) for a malformed one or a missing
    scheduler file. Does not import Dask or connect."""
    s = str(value).strip()
    low = s.lower()
    if low.startswith("local:"):
        n = s[len("local:") :].strip()
        if not n.isdigit() or int(n) < 1:
            raise InputError(f"--scheduler local:N needs a whole number of workers N >= 1; got {s!r}")
        check_workers(int(n))  # the bound --workers has: a typo forks
        return f"local:{int(n)}"
    if low.startswith("tcp://"):
        host, sep, port = s[len("tcp://") :].rpartition(":")
        if not sep or not host.isprintable() or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"--scheduler {s!r} is not tcp://HOST:PORT (a Dask scheduler's address)")
        return "tcp://" + s[len("tcp://") :]
    if low.endswith(".json"):
        if not os.path.lexists(s):
            raise InputError(
                f"--scheduler file {s} does not exist; give the file a Dask scheduler wrote "
                "(dask scheduler --scheduler-file FILE.json)"
            )
        scheduler_file_address(s)
        return s
    raise InputError(f"--scheduler must be {SCHEDULER_FORMS}; got {s!r}")


def scheduler_file_address(path: str) -> str:
    """The scheduler's address in a Dask scheduler file (a JSON object whose ``address`` is
    ``scheme://...``, as Dask writes it), read once, through fileio's JSON reader (a regular file,
    at most SCHEDULER_FILE_MAX_BYTES). Dask itself would poll a malformed file until its timeout and
    then say only that it timed out; here it is one InputError at once."""
    try:
        info = read_json(path, max_bytes=SCHEDULER_FILE_MAX_BYTES)
    except (OSError, ValueError) as e:
        info, why = None, first_line(e)
    else:
        why = "no scheduler address in it"
    address = info.get("address") if isinstance(info, dict) else None
    if isinstance(address, str) and len(address) > SCHEDULER_ADDRESS_MAX_CHARS:
        address, why = None, f"an address longer than {SCHEDULER_ADDRESS_MAX_CHARS} characters"
    if not isinstance(address, str) or "://" not in address or not address.isprintable():
        raise InputError(
            f"--scheduler file {path} is not a Dask scheduler file ({why}); give the file "
            "`dask scheduler --scheduler-file FILE.json` wrote"
        )
    return address


class SchedulerProbeError(InputError):
    """No usable Dask scheduler at the address given (one line that names the address)."""


async def _connect_and_identify(address: str, deadline: float, progress: dict) -> dict:
    """What the server at ``address`` says it is: a connection through Dask's comm layer (retried
    until ``deadline`` while it is refused or unreachable, as Dask retries), Dask's handshake, one
    ``identity`` call; the connection is closed after it, and in every case. ``progress["connected"]``
    is set once a connection is open. The caller bounds the time (the handshake and the call do not
    end by themselves where the peer never answers)."""
    from distributed.comm.addressing import parse_address
    from distributed.comm.core import FatalCommClosedError
    from distributed.comm.registry import get_backend
    from distributed.security import Security

    scheme, loc = parse_address(address)
    connector = get_backend(scheme).get_connector()
    args = Security().get_connection_args("client")  # TLS as Dask's config sets it for a Client
    pause = 0.05
    while True:
        try:
            comm = await connector.connect(loc, deserialize=True, **args)
            break
        except FatalCommClosedError:
            raise
        except OSError:
            if time.monotonic() + pause >= deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
    progress["connected"] = True
    try:  # Dask's handshake, as distributed.comm.core.connect makes it, then one call
        local_info = comm.handshake_info()
        await comm.write(local_info)
        remote_info = await comm.read()
        comm.remote_info = {**remote_info, "address": comm.peer_address}
        comm.local_info = {**local_info, "address": comm.local_address}
        comm.handshake_options = comm.handshake_configuration(comm.local_info, comm.remote_info)
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def _identify_in_time(address: str, timeout: float, progress: dict) -> dict:
    """:func:`_connect_and_identify` on an event loop of its own, in a thread of its own (the caller
    may run an event loop: a notebook, a Dask client), over by ``timeout`` s: TimeoutError after it.
    The thread is left behind (a daemon) if its loop has not closed PROBE_GRACE_S later."""
    outcome: dict = {}

    async def bounded():
        deadline = time.monotonic() + timeout
        return await asyncio.wait_for(_connect_and_identify(address, deadline, progress), timeout)

    def target():
        try:
            outcome["identity"] = asyncio.run(bounded())
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name="geomscope-scheduler-probe", daemon=True)
    thread.start()
    thread.join(timeout + PROBE_GRACE_S)
    if "identity" in outcome:
        return outcome["identity"]
    raise outcome.get("error") or TimeoutError(f"no answer within {timeout} s")


def probe_scheduler(address: str, where: str, timeout: float | None = None) -> dict:
    """The identity of the Dask scheduler at ``address`` (``where``: how the user gave it, the address
    included, for the message), asked within ``timeout`` s (CONNECT_TIMEOUT_S): SchedulerProbeError,
    one line naming the address and what to do, where nothing accepts a connection, a service that
    is not Dask answers (or never does), a Dask worker answers, or the address cannot be used from
    here (a scheme Dask does not know or lacks the package of, ``inproc://`` of another process,
    ``tls://`` without Dask's TLS settings)."""
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    progress: dict = {}
    try:
        identity = _identify_in_time(address, timeout, progress)
    except Exception as e:
        raise SchedulerProbeError(_probe_failure(where, timeout, e, progress)) from None
    kind = identity.get("type") if isinstance(identity, dict) else None
    if kind != "Scheduler":
        what = f"a Dask {kind}" if isinstance(kind, str) and kind.isidentifier() else "a Dask server"
        raise SchedulerProbeError(
            f"--scheduler {where}: that address is {what}, not a scheduler; give the scheduler's address"
        )
    return identity


def _probe_failure(where: str, timeout: float, e: Exception, progress: dict) -> str:
    """The one-line message for a probe that raised ``e``: what Dask's comm layer wraps (a
    CommClosedError around the socket's error) is quoted by its cause."""
    why = first_line(e.__cause__ if isinstance(e.__cause__, OSError) else e, 200)
    timed_out = isinstance(e, (TimeoutError, asyncio.TimeoutError))
    if not progress.get("connected"):
        if timed_out or isinstance(e, OSError):  # refused, no such host, no route
            return (
                f"--scheduler {where}: no Dask scheduler accepted a connection within {timeout} s "
                f"({why}); start one (dask scheduler) or give the address of a running one"
            )
        # ValueError, TypeError, ImportError: a scheme Dask does not know, cannot use, or lacks settings for
        return (
            f"--scheduler {where}: cannot connect there ({why}); give a scheduler address this "
            "machine can use: tcp://HOST:PORT, or tls://HOST:PORT with Dask's TLS settings"
        )
    said = f"within {timeout} s" if timed_out else f"({why})"
    return (
        f"--scheduler {where}: a connection was accepted but no Dask scheduler answered {said}; "
        "check that the address is a running Dask scheduler's, not another service's"
    )


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
        init_worker()  # env vars + threadpool_limits(1) for this thread's pools (kept, not a context)
        _limited.done = True
    acc: dict = {}
    for t in tasks:
        run_task(t, spec, into=acc)
    return acc


class DaskExecutor:
    """``DaskExecutor(scheduler)``: connects (or starts ``local:N``) at once; ``run`` as Executor's."""

    def __init__(self, scheduler: str):
        distributed = require_distributed()
        self.scheduler = parse_scheduler(scheduler)
        self._cluster = None
        self.start_method: str | None = None  # local:N: how its worker processes start
        self.client = None
        try:
            if self.scheduler.startswith("local:"):
                self.client = self._start_local(distributed, int(self.scheduler[len("local:") :]))
            else:
                self.client = self._join(distributed)
        except InputError:
            self.close()
            raise
        except (OSError, TimeoutError) as e:
            self.close()
            raise InputError(
                f"--scheduler {self.scheduler}: no Dask scheduler with workers answered within "
                f"{CONNECT_TIMEOUT_S} s ({first_line(e)})"
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

    def _join(self, distributed):
        """A client of the running scheduler that ``tcp://`` or the scheduler file names, made once
        the address has answered as a Dask scheduler (:func:`probe_scheduler`), returned once the
        scheduler has a worker: each within CONNECT_TIMEOUT_S."""
        s = self.scheduler
        address = s if s.startswith("tcp://") else scheduler_file_address(s)
        where = s if address == s else f"{s} (address {address})"
        probe_scheduler(address, where)
        client = distributed.Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        try:
            client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError):
            client.close()
            raise InputError(
                f"--scheduler {where}: the Dask scheduler has no worker after {CONNECT_TIMEOUT_S} s; "
                f"start workers for it (dask worker {address})"
            ) from None
        except BaseException:
            client.close()
            raise
        return client

    def _start_local(self, distributed, n: int):
        """``local:N``: the scheduler and a client first, then the N workers. Waits for all N when
        they are forked (the forks must be over before a pass starts), for one when spawned."""
        import dask

        self.start_method = worker_start_method()
        if self.start_method == "fork":
            # Dask's worker initializer reseeds numpy's global generator, importing numpy.random in
            # every worker (25-30 ms each): imported once here, the forked workers have it
            import numpy.random  # noqa: F401
        # read when each Server (scheduler, Nanny, worker) is made, and when a Nanny starts its worker
        # process: held until the N workers are up, so a worker restarted later is spawned
        config = {**LOCAL_CLUSTER_CONFIG, "distributed.worker.multiprocessing-method": self.start_method}
        # (the settings are the process's while the block runs: a Dask server another thread makes
        # meanwhile gets them too; the block lasts ~0.1 s when forking, ~0.7 s when spawning)
        with _LOCAL_START, dask.config.set(config):
            self._cluster = distributed.LocalCluster(
                n_workers=0,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                worker_dashboard_address=None,
                # no dashboard; the scheduler's bare HTTP endpoint on a free localhost port, not 8787
                scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
                silence_logs=logging.CRITICAL,  # its failures come back as errors (start, tasks)
            )
            # the client before the workers: made with workers to come, it waits for every Nanny's
            # start, which Dask learns by polling its worker's start-up queue every 50 ms. Results
            # straight from the workers (localhost): by default a client gathers them through the
            # scheduler, which here shares this process's event loop: every 12 MB result would cross a
            # socket twice and reach the merge 50-300 ms after its chunk ends
            client = distributed.Client(self._cluster, set_as_default=False, direct_to_workers=True)
            try:
                self._cluster.scale(n)
                self._wait_for_local_workers(n if self.start_method == "fork" else 1)
            except BaseException:
                client.close()
                raise
        return client

    def _wait_for_local_workers(self, n: int) -> None:
        """Until ``n`` workers have registered with the cluster's scheduler (it runs in this process:
        its worker table is read directly, every 2 ms, where ``Client.wait_for_workers`` asks every
        100 ms). At least one within CONNECT_TIMEOUT_S, else TimeoutError; the rest join later. A
        worker process that failed to start is an InputError at once, with its cause, not a wait."""
        from distributed.core import Status

        workers = self._cluster.scheduler.workers
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while len(workers) < n and time.monotonic() < deadline:
            # (the cluster lists its Nannies once every one has started or failed)
            failed = [w for w in list(self._cluster.workers.values()) if w.status == Status.failed]
            if failed:
                cause = getattr(failed[0], "_Server__startup_exc", None)  # what Dask's Server keeps
                raise InputError(
                    f"--scheduler {self.scheduler}: {len(failed)} of its worker processes failed to start"
                    f" ({first_line(cause) if cause is not None else 'no cause given'}); "
                    "fix that cause, or score with --workers N instead"
                )
            time.sleep(0.002)
        if not workers:
            raise TimeoutError(f"no worker of {self.scheduler} started")

    def __enter__(self) -> DaskExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        client, cluster = self.client, self._cluster
        self.client = self._cluster = None
        try:
            if client is not None:
                client.close()
        finally:  # (a second Ctrl-C in the client's close still closes the cluster)
            if cluster is not None:
                cluster.close()

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
                if isinstance(part, BaseException):  # as_completed hands a cancelled future's error
                    raise InputError(
                        f"--scheduler {self.scheduler}: a task was cancelled before it ended "
                        f"({first_line(part, 300)}); the pass cannot finish without it: rerun when "
                        "the cluster is up again"
                    )
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
            if client.status not in ("closing", "closed"):  # (a lost scheduler closes the client)
                for fut in list(index):
                    fut.cancel()
            raise
        return acc
