"""``score --workers N``: its worker processes are forked where that is safe (Linux, torch not
loaded, no HDF5 file open: resources.worker_start_method), else spawned; forked or spawned, the
report is the same, bit for bit (the same tasks, merged in the same order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers_models import make_tiny_run

from geomscope.score import ScoreOptions, score
from geomscope.score.executor import Executor

OPTS = dict(id_sample=60, jackknife_groups=4)

# run in a fresh interpreter (no torch): which start method the pool used, and whether its workers
# have a mark this process set after start-up (a forked child does, a spawned one cannot)
FRESH_SCORE = textwrap.dedent(
    """
    import json, sys
    import marker_probe
    from geomscope.score import ScoreOptions, score
    from geomscope.score.executor import Executor

    sys._geomscope_parent_marker = True
    seen = {}
    get_pool = Executor._get_pool

    def spy(self):
        pool = get_pool(self)
        if not seen:
            seen["method"] = self.start_method
            seen["marked"] = sorted(pool.submit(marker_probe.marked).result() for _ in range(4))
        return pool

    Executor._get_pool = spy
    rep = score(sys.argv[1], ScoreOptions(workers=2, id_sample=60, jackknife_groups=4))
    print(json.dumps({"seen": seen, "report": rep}))
    """
)


@pytest.fixture(scope="module")
def run6(tmp_path_factory):
    d = tmp_path_factory.mktemp("procs")
    return make_tiny_run(d, "bert", name="run6", shard_docs=2, store_dtype="float32")


def assert_identical(a: dict, b: dict) -> None:
    assert len(a["layers"]) == len(b["layers"])
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        for k in ("isoscore", "isoscore_star", "avgcos", "twonn", "n_rows", "outliers", "se"):
            assert ea[k] == eb[k], (ea["layer"], k)
        np.testing.assert_array_equal(ea["eigenvalues"], eb["eigenvalues"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_forked_workers_give_the_spawned_workers_report(run6, tmp_path):
    assert "torch" in sys.modules  # this process (the tiny models): its pool spawns
    spawned = score(run6, ScoreOptions(workers=2, **OPTS))
    (tmp_path / "marker_probe.py").write_text(
        "import sys\n\ndef marked():\n    return getattr(sys, '_geomscope_parent_marker', False)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_SCORE, str(run6)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seen"] == {"method": "fork", "marked": [True] * 4}
    assert_identical(spawned, out["report"])


def test_spawned_while_torch_is_loaded():
    assert "torch" in sys.modules
    with Executor(2) as ex:
        ex._get_pool()
        assert ex.start_method == "spawn"


def test_start_method_falls_back_to_spawn_where_fork_is_unsafe(monkeypatch, tmp_path):
    import h5py

    from geomscope.score.resources import worker_start_method

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert worker_start_method() == "fork"
    with h5py.File(tmp_path / "open.h5", "w"):
        assert worker_start_method() == "spawn"  # HDF5 shares file handles within a process
    assert worker_start_method() == "fork"
    monkeypatch.setitem(sys.modules, "torch", sys)  # loaded (any module object)
    assert worker_start_method() == "spawn"
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert worker_start_method() == "spawn"


def test_a_worker_process_killed_mid_score_is_one_line(run6, tmp_path, monkeypatch):
    """A worker that the kernel's out-of-memory killer (here: SIGKILL from within the task) ends
    breaks the pool: one line, not the pool's BrokenProcessPool traceback."""
    import importlib

    import geomscope.score.executor as executor
    from geomscope.errors import GeomscopeError

    (tmp_path / "killed_task.py").write_text(
        "import os, signal\n\ndef run_task(*args, **kwargs):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # (a spawned worker gets this process's sys.path)
    monkeypatch.setattr(executor, "run_task", importlib.import_module("killed_task").run_task)
    with pytest.raises(GeomscopeError, match="ended abruptly") as err:
        score(run6, ScoreOptions(workers=2, **OPTS))
    msg = str(err.value)
    assert "\n" not in msg and "--workers" in msg
