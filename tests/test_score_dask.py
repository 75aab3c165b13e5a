"""``score --scheduler``: the shard tasks on a real Dask LocalCluster (worker processes) give the
``--workers 1`` report; chunks of consecutive tasks are merged by chunk index, so every Dask run with
the same number of worker threads is bit-identical to every other; a worker killed mid-score changes
nothing; bad values and a missing Dask are one-line errors."""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import pytest

pytest.importorskip("distributed")

from conftest import assert_one_line_error, one_line_message  # noqa: E402
from distributed.diagnostics.plugin import SchedulerPlugin  # noqa: E402
from helpers_models import make_tiny_run  # noqa: E402

from geomscope.errors import InputError  # noqa: E402
from geomscope.score import ScoreOptions, score  # noqa: E402

SCALARS = (
    "isoscore",
    "isoscore_star",
    "avgcos",
    "avgcos_centred",
    "avgcos_standardised",
    "pr",
    "erank",
    "top1_share",
    "top5_share",
    "top10_share",
)
OPTS = dict(id_sample=60, jackknife_groups=4)


def _cluster(n: int = 2):
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=n,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"},
        silence_logs=50,
    )


@pytest.fixture(scope="module")
def run6(tmp_path_factory):
    """A tiny BERT's run cut into 6 shards (2 documents each)."""
    d = tmp_path_factory.mktemp("dask")
    run = make_tiny_run(d, "bert", name="run6", shard_docs=2, store_dtype="float32")
    assert len(json.loads((run / "manifest.json").read_text())["shards"]) >= 6
    return run


@pytest.fixture(scope="module")
def clean(run6):
    return score(run6, ScoreOptions(**OPTS))


@pytest.fixture(scope="module")
def local2(run6):
    return score(run6, ScoreOptions(scheduler="local:2", **OPTS))


@pytest.fixture(scope="module")
def cluster():
    c = _cluster()
    yield c
    c.close()


def _rel_close(a, b, rtol=1e-12, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300), (what, a, b)


def assert_same_report(a: dict, b: dict, exact: bool = False) -> None:
    """Every layer's metrics and SEs to 1e-12 (relative; ``exact``: bit for bit); eigenvalues too;
    outliers, TwoNN (its seeded sample) and row counts identical."""
    assert len(a["layers"]) == len(b["layers"])
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        name = ea["layer"]
        assert ea["n_rows"] == eb["n_rows"] and ea["dropped"] == eb["dropped"]
        assert ea["outliers"] == eb["outliers"], name
        assert ea["twonn"] == eb["twonn"] and ea["se"]["twonn"] == eb["se"]["twonn"], name
        assert ea["twonn_n_used"] == eb["twonn_n_used"]
        assert set(ea["se"]) == set(eb["se"])
        for k in SCALARS:
            if exact:
                assert ea[k] == eb[k] and ea["se"].get(k) == eb["se"].get(k), (name, k)
            _rel_close(ea[k], eb[k], what=(name, k))
            _rel_close(ea["se"].get(k), eb["se"].get(k), what=(name, "se", k))
        ev_a, ev_b = np.asarray(ea["eigenvalues"]), np.asarray(eb["eigenvalues"])
        if exact:
            np.testing.assert_array_equal(ev_a, ev_b)
        np.testing.assert_allclose(ev_a, ev_b, rtol=1e-12, atol=1e-12 * ev_a.max())


def test_local_cluster_equals_one_worker(clean, local2):
    assert_same_report(clean, local2)
    assert any(e["twonn"] is not None for e in local2["layers"])
    assert local2["params"]["scheduler"] == "local:2" and clean["params"]["scheduler"] is None
    assert local2["params"]["workers"] == 1


def test_tcp_address_and_scheduler_file(run6, local2, cluster, tmp_path):
    by_tcp = score(run6, ScoreOptions(scheduler=cluster.scheduler_address, **OPTS))
    f = tmp_path / "scheduler.json"
    ident = cluster.scheduler.identity()  # the keys of a scheduler file that a client reads
    f.write_text(json.dumps({k: ident[k] for k in ("type", "id", "address")}))
    by_file = score(run6, ScoreOptions(scheduler=str(f), **OPTS))
    # merged by chunk index, never by arrival: any 2-thread cluster, any timing, the same bits
    assert_same_report(local2, by_tcp, exact=True)
    assert_same_report(local2, by_file, exact=True)
    assert by_tcp["params"]["scheduler"] == cluster.scheduler_address
    assert by_file["params"]["scheduler"] == str(f)
    from distributed import Client

    with Client(cluster, set_as_default=False) as c:  # the external cluster is left running
        assert len(c.nthreads()) == 2


class _KillFirstWorker(SchedulerPlugin):
    """Scheduler plugin (the LocalCluster's scheduler runs in this process): SIGKILL the worker the
    first geomscope task is assigned to, at that moment -- the task cannot finish there."""

    name = "kill-first-geomscope-worker"

    def __init__(self, scheduler, pids: dict):
        self.scheduler, self.pids, self.killed = scheduler, pids, None

    def transition(self, key, start, finish, *args, **kwargs):
        if self.killed is None and finish == "processing" and str(key).startswith("geomscope-"):
            addr = self.scheduler.tasks[key].processing_on.address
            self.killed = (key, addr)
            os.kill(self.pids[addr], signal.SIGKILL)


def test_killed_worker_tasks_rerun_same_report(run6, clean, local2):
    from distributed import Client

    c = _cluster()
    try:
        with Client(c, set_as_default=False) as client:
            pids = client.run(os.getpid)
            plugin = _KillFirstWorker(c.scheduler, pids)
            c.scheduler.add_plugin(plugin)
            rep = score(run6, ScoreOptions(scheduler=c.scheduler_address, **OPTS))
            assert plugin.killed is not None and plugin.killed[1] in pids
            client.wait_for_workers(2, timeout=60)  # the nanny restarts the killed worker
            assert pids[plugin.killed[1]] not in client.run(os.getpid).values()
    finally:
        c.close()
    assert_same_report(local2, rep, exact=True)
    assert_same_report(clean, rep)


def test_scheduler_option_values():
    assert ScoreOptions(scheduler=" local:3 ").validate().scheduler == "local:3"
    assert ScoreOptions(scheduler="tcp://10.0.0.1:8786").validate().scheduler == "tcp://10.0.0.1:8786"
    for bad, needle in (
        ("local:0", "N >= 1"),
        ("local:x", "N >= 1"),
        ("foo", "must be local:N, tcp://HOST:PORT"),
        ("tcp://nohost", "tcp://HOST:PORT"),
        ("/no/such/scheduler.json", "does not exist"),
    ):
        with pytest.raises(InputError, match=needle):
            ScoreOptions(scheduler=bad).validate()
    with pytest.raises(InputError, match="drop --workers"):
        ScoreOptions(scheduler="local:2", workers=2).validate()


@pytest.mark.parametrize("content", ["{bad", '{"address": 5}', "[1]", '{"id": "x"}'])
def test_a_malformed_scheduler_file_is_refused_at_once(tmp_path, content):
    """Dask would poll such a file until its timeout and then say only that it timed out."""
    f = tmp_path / "scheduler.json"
    f.write_text(content)
    with pytest.raises(InputError, match="is not a Dask scheduler file"):
        ScoreOptions(scheduler=str(f)).validate()


@pytest.mark.parametrize("kind", ["fifo", "large", "long address", "address with a newline"])
def test_a_scheduler_file_read_within_bounds(tmp_path, kind):
    """The scheduler file is read once, as fileio reads JSON: a named pipe is refused without waiting
    for a writer, a file over SCHEDULER_FILE_MAX_BYTES without reading it, an address that could not
    be quoted on one line as it is."""
    from geomscope.score import dask_executor as de

    f = tmp_path / "scheduler.json"
    if kind == "fifo":
        os.mkfifo(f)
        needle = "a named pipe"
    elif kind == "large":
        f.write_text(
            json.dumps({"address": "tcp://127.0.0.1:8786", "pad": "x" * de.SCHEDULER_FILE_MAX_BYTES})
        )
        needle = "larger than"
    elif kind == "long address":
        f.write_text(json.dumps({"address": "tcp://" + "h" * de.SCHEDULER_ADDRESS_MAX_CHARS + ":8786"}))
        needle = "longer than"
    else:
        f.write_text(json.dumps({"address": "tcp://127.0.0.1:8786\nerror: forged"}))
        needle = "is not a Dask scheduler file"
    with pytest.raises(InputError, match=needle) as err:
        ScoreOptions(scheduler=str(f)).validate()
    assert "\n" not in str(err.value)


def test_cli_errors(cli, run6, tmp_path, monkeypatch):
    import geomscope.score.dask_executor as dx

    out = tmp_path / "rep"
    for args, needle in (
        (["--scheduler", "local:0"], "local:N needs a whole number"),
        (["--scheduler", "foo"], "--scheduler must be local:N"),
        (["--scheduler", str(tmp_path / "missing.json")], "does not exist"),
        (["--scheduler", "local:2", "--workers", "2"], "drop --workers"),
    ):
        code, o, e = cli(["score", run6, "--out", out, "--quiet", *args])
        assert_one_line_error(code, o, e, needle)
    monkeypatch.setattr(dx, "CONNECT_TIMEOUT_S", 1)
    code, o, e = cli(["score", run6, "--out", out, "--quiet", "--scheduler", "tcp://127.0.0.1:9"])
    assert_one_line_error(code, o, e, "tcp://127.0.0.1:9", "no Dask scheduler")
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` fails
    code, o, e = cli(["score", run6, "--out", out, "--quiet", "--scheduler", "local:2"])
    assert_one_line_error(code, o, e, "pip install 'geomscope[dask]'")
    assert not out.with_suffix(".json").exists()


# ---------------------------------------------------------------- how local:N starts its workers
FORKED_SCORE = """
import json, sys
import geomscope.score.dask_executor as de
from geomscope.score import ScoreOptions, score

sys._geomscope_parent_marker = True  # a forked worker has it, a spawned one does not
seen = {}
run = de.DaskExecutor.run

def spy(self, tasks, spec, advance=None):
    if not seen:
        seen["method"] = self.start_method
        seen["forked"] = sorted(
            self.client.run(lambda: getattr(sys, "_geomscope_parent_marker", False)).values()
        )
    return run(self, tasks, spec, advance)

de.DaskExecutor.run = spy
rep = score(sys.argv[1], ScoreOptions(scheduler="local:2", id_sample=60, jackknife_groups=4))
print(json.dumps({"seen": seen, "report": rep}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local:N forks its workers on Linux only")
def test_local_workers_forked_when_safe_give_the_same_report(run6, local2):
    """A fresh process (no torch, no HDF5 file open): the workers are forked, have this process's
    modules, and the report is bit for bit the spawned workers' (same chunks, same merge order)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", FORKED_SCORE, str(run6)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seen"] == {"method": "fork", "forked": [True, True]}
    assert_same_report(local2, out["report"], exact=True)


def test_spawned_when_torch_is_loaded(run6, local2):
    """This test process has torch loaded (the tiny models): local:N spawns, restored afterwards."""
    import dask

    from geomscope.score.dask_executor import DaskExecutor

    assert "torch" in sys.modules
    before = dask.config.get("distributed.worker.multiprocessing-method")
    with DaskExecutor("local:1") as ex:
        assert ex.start_method == "spawn"
        assert ex.client.run(lambda: getattr(sys, "_geomscope_parent_marker", False)) == {
            w: False for w in ex.client.nthreads()
        }
    assert dask.config.get("distributed.worker.multiprocessing-method") == before


def test_local_cluster_settings_applied_and_restored():
    """local:N's own Dask settings (no profiling thread, queueing on the scheduler instead of work
    stealing, results straight from the workers) reach its scheduler and workers, and are not left
    behind in this process's Dask config."""
    import dask

    from geomscope.score.dask_executor import LOCAL_CLUSTER_CONFIG, DaskExecutor

    before = {k: dask.config.get(k) for k in LOCAL_CLUSTER_CONFIG}
    with DaskExecutor("local:2") as ex:
        scheduler = ex._cluster.scheduler
        assert scheduler.WORKER_SATURATION == 1.0 and "stealing" not in scheduler.extensions
        assert ex.client.direct_to_workers is True
        profiling = ex.client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
        assert profiling and set(profiling.values()) == {False}
        assert ex.client.submit(sum, [1, 2], pure=False).result() == 3
    assert {k: dask.config.get(k) for k in LOCAL_CLUSTER_CONFIG} == before


def test_overlapping_local_starts_in_threads_leave_no_settings_behind(monkeypatch):
    """dask.config.set restores what it saw on entry: two local:N starts overlapping in threads (A in,
    B in, A out, B out) would leave A's settings on for the process. The starts take turns."""
    import threading
    import time

    import dask
    import distributed

    from geomscope.score import dask_executor as de

    keys = [*de.LOCAL_CLUSTER_CONFIG, "distributed.worker.multiprocessing-method"]
    before = {k: dask.config.get(k) for k in keys}
    real = distributed.LocalCluster
    hold = {"A": 0.05, "B": 0.6}  # B enters after A and stays longer: A leaves first

    def slow_cluster(*args, **kwargs):
        time.sleep(hold[threading.current_thread().name])
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "LocalCluster", slow_cluster)
    errors = []

    def start():
        try:
            with de.DaskExecutor("local:1") as ex:
                assert ex.client.submit(sum, [1, 2], pure=False).result() == 3
        except BaseException as e:  # reported below
            errors.append(e)

    a = threading.Thread(target=start, name="A")
    b = threading.Thread(target=start, name="B")
    a.start()
    time.sleep(0.02)
    b.start()
    a.join()
    b.join()
    assert not errors
    assert {k: dask.config.get(k) for k in keys} == before


PRELOAD_FAILS = "raise RuntimeError('this preload cannot start')\n"


def test_a_worker_that_cannot_start_is_one_error_at_once(tmp_path, monkeypatch, capfd):
    """A worker process that fails to start (here: a Dask preload that raises) is an InputError with
    its cause as soon as it fails -- not a 10 s wait and Dask's tracebacks -- and nothing is left."""
    import time

    import dask

    from geomscope.score import dask_executor as de

    pre = tmp_path / "badpre.py"
    pre.write_text(PRELOAD_FAILS)
    before = {k: dask.config.get(k) for k in de.LOCAL_CLUSTER_CONFIG}
    t0 = time.monotonic()
    with dask.config.set({"distributed.worker.preload": [str(pre)]}):
        with pytest.raises(InputError) as err:
            de.DaskExecutor("local:2")
    assert time.monotonic() - t0 < de.CONNECT_TIMEOUT_S - 2
    msg = str(err.value)
    assert "\n" not in msg and "failed to start" in msg and "--workers N" in msg
    assert {k: dask.config.get(k) for k in de.LOCAL_CLUSTER_CONFIG} == before
    assert "Traceback" not in capfd.readouterr().err


def test_a_scheduler_lost_during_a_pass_is_one_line(run6, monkeypatch):
    """A scheduler that goes away while a pass runs: Dask cancels the pass's futures once its client
    has tried to reconnect for its timeout, and as_completed hands each cancelled future's error as
    its result, which is never merged as a partial result (that would be an AttributeError)."""
    from distributed import LocalCluster

    import geomscope.score.dask_executor as de

    monkeypatch.setattr(de, "CONNECT_TIMEOUT_S", 1)  # the client's reconnect time, too
    c = LocalCluster(
        n_workers=1,
        processes=False,
        protocol="tcp",
        host="127.0.0.1",
        dashboard_address=None,
        silence_logs=50,
    )
    address = c.scheduler_address
    real_run = de.DaskExecutor.run

    def lose_the_scheduler_first(self, tasks, spec, advance=None):
        c.close()
        return real_run(self, tasks, spec, advance)

    monkeypatch.setattr(de.DaskExecutor, "run", lose_the_scheduler_first)
    with pytest.raises(InputError, match="cancelled before it ended") as err:
        score(run6, ScoreOptions(scheduler=address, **OPTS))
    assert address in one_line_message(err)


# ---------------------------------------------------------------- joining a cluster: every wait bounded
JOIN_CASES = """
import json, os, sys, time
import geomscope.score.dask_executor as dx
from geomscope.cli import main

dx.CONNECT_TIMEOUT_S = 1
run, out, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for name, value in cases.items():
    saved = os.dup(2)
    with open(os.path.join(out, name + ".err"), "w") as f:
        os.dup2(f.fileno(), 2)  # Dask's loggers write to the file descriptor, not to a captured stream
        t0 = time.monotonic()
        try:
            report = os.path.join(out, "report-" + name)
            main(["score", run, "--out", report, "--quiet", "--scheduler", value])
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # not the CLI's contract: recorded, and the next case runs
            code = "raised " + type(e).__name__
        sys.stderr.flush()
        os.dup2(saved, 2)
    with open(os.path.join(out, name + ".result"), "w") as f:
        json.dump({"code": code, "seconds": time.monotonic() - t0}, f)
"""


def _silent_listener():
    """A port that accepts connections (the kernel's backlog) and never says a word."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s, f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _junk_peer():
    """A port whose every connection gets bytes that are no Dask message."""
    import socket
    import threading

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)

    def serve():
        while True:
            try:
                conn, _ = s.accept()
                conn.sendall(b"\xff" * 64 + b"not dask\r\n" * 50)
                conn.close()
            except OSError:  # the socket closed at the end of the test
                return

    threading.Thread(target=serve, daemon=True).start()
    return s, f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _http_server():
    """An HTTP server, as on the port of a stale scheduler file."""
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"tcp://127.0.0.1:{srv.server_address[1]}"


def _closed_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def join_failures(run6, cluster, tmp_path_factory):
    """``score --scheduler`` against addresses where no usable Dask scheduler answers, one after the
    other in a fresh process (CONNECT_TIMEOUT_S = 1 s) killed after 60 s: {case: (exit code, seconds,
    stderr, the address)}, exit code None for a case that had not ended by then."""
    import subprocess

    from distributed import LocalCluster

    d = tmp_path_factory.mktemp("join")
    silent, silent_addr = _silent_listener()
    junk, junk_addr = _junk_peer()
    http, http_addr = _http_server()
    empty = LocalCluster(
        n_workers=0,
        processes=False,
        protocol="tcp",
        host="127.0.0.1",
        dashboard_address=None,
        silence_logs=50,
    )
    addresses = {
        "silent": silent_addr,
        "http": http_addr,
        "junk": junk_addr,
        "refused": _closed_port(),
        "worker": next(iter(cluster.scheduler.workers)),
        "no_workers": empty.scheduler_address,
        "http_file": http_addr,
        "inproc_file": "inproc://10.0.0.1/123/1",
        "tls_file": "tls://127.0.0.1:9",
        "ucx_file": "ucx://127.0.0.1:9",
        "file_file": "file:///tmp/scheduler",
    }
    cases = {}
    for name, address in addresses.items():
        if name.endswith("_file"):
            f = d / f"scheduler-{name}.json"
            f.write_text(json.dumps({"type": "Scheduler", "id": "x", "address": address}))
            cases[name] = str(f)
        else:
            cases[name] = address
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        subprocess.run(
            [sys.executable, "-c", JOIN_CASES, str(run6), str(d), json.dumps(cases)],
            capture_output=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": root},
        )
    except subprocess.TimeoutExpired:
        pass  # the cases without a result hung
    finally:
        silent.close()
        junk.close()
        http.shutdown()
        http.server_close()
        empty.close()
    results = {}
    for k, address in addresses.items():
        done = d / f"{k}.result"
        r = json.loads(done.read_text()) if done.exists() else {"code": None, "seconds": None}
        err = d / f"{k}.err"
        results[k] = (r["code"], r["seconds"], err.read_text() if err.exists() else "", address)
    return results


@pytest.mark.parametrize(
    "case, needle",
    [
        ("silent", "no Dask scheduler answered within 1 s"),
        ("http", "not another service's"),
        ("junk", "no Dask scheduler answered"),
        ("refused", "no Dask scheduler accepted a connection within 1 s"),
        ("worker", "is a Dask Worker, not a scheduler"),
        ("no_workers", "has no worker after 1 s"),
        ("http_file", "not another service's"),
        ("inproc_file", "cannot connect there"),
        ("tls_file", "TLS settings"),
        ("ucx_file", "cannot connect there"),
        ("file_file", "unknown address scheme 'file'"),
    ],
)
def test_joining_a_cluster_ends_in_one_line_within_the_timeout(join_failures, case, needle):
    """A silent listener or an HTTP server would keep Dask's client waiting for minutes (its handshake has
    no timeout), a peer sending junk, another scheme or a worker's address would give tracebacks: each
    is one error line naming the address, well within the timeout (1 s here) plus the process's start."""
    code, seconds, err, address = join_failures[case]
    assert code is not None, f"{case}: not over when the process was killed after 60 s"
    assert_one_line_error(code, None, err, address, needle, exit_code=2)
    assert seconds < 20, (case, seconds)


def test_the_scheduler_option_states_its_connection_timeout(cli):
    """--scheduler's declared help (and so `score --help` and the CLI reference) says how long joining
    a running cluster waits, in the option's own words as the README says it."""
    import dataclasses

    from geomscope.score.dask_executor import CONNECT_TIMEOUT_S

    declared = {f.name: f.metadata["option"].help for f in dataclasses.fields(ScoreOptions) if f.metadata}
    assert f"at most {CONNECT_TIMEOUT_S} s for the scheduler" in declared["scheduler"]
    code, out, _ = cli(["score", "--help"])
    assert code == 0 and f"at most {CONNECT_TIMEOUT_S} s for the scheduler" in " ".join(out.split())
