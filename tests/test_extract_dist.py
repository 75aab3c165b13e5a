"""``extract`` as several processes (torchrun, or RANK/WORLD_SIZE set by hand), on the CPU with gloo:
the same shards and report as one process, resume after a SIGKILL with another number of
processes, every process failing together, and no process waiting for a dead peer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers_models import SAMPLE_TEXTS, bundled_minilm_dir, make_tiny_model, poison_token

from geomscope.score import ScoreOptions, score
from geomscope.store import Run, iter_shard

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(n: int, args: list, **env) -> subprocess.Popen:
    cmd = [str(TORCHRUN), "--nproc-per-node", str(n), "--master-port", str(_free_port()), "-m", "geomscope"]
    return subprocess.Popen(
        [*cmd, *map(str, args)], env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _by_hand(world: int, ranks, args: list, **env) -> list[subprocess.Popen]:
    """Processes with RANK/WORLD_SIZE set by hand (no torchrun agent to kill the others)."""
    port = _free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "geomscope", *map(str, args)],
            env=_env(
                RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                **env,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ranks
    ]


def _one(args: list) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "geomscope", *map(str, args)], env=_env(), capture_output=True, text=True
    )


def _rows(run_dir) -> dict:
    """layer -> rows sorted by (doc_id, position), and the sorted keys."""
    run = Run(run_dir)
    out, keys = {}, None
    for name in run.layer_names:
        parts, k = [], []
        for s in run.shards:
            for ch in iter_shard(run.shard_path(s), [name]):
                parts.append(ch.layers[name])
                k.append(np.stack([ch.doc_id, ch.position], axis=1))
        k = np.concatenate(k)
        order = np.lexsort((k[:, 1], k[:, 0]))
        out[name], keys = np.concatenate(parts)[order], k[order]
    return {"layers": out, "keys": keys}


def _same_run(a, b) -> None:
    ra, rb = _rows(a), _rows(b)
    assert np.array_equal(ra["keys"], rb["keys"])
    assert len(np.unique(ra["keys"], axis=0)) == len(ra["keys"])  # every (doc, position) once
    for name in ra["layers"]:
        np.testing.assert_array_equal(ra["layers"][name], rb["layers"][name])
    opts = ScoreOptions(metrics=("isoscore", "isoscore_star", "avgcos", "spectrum", "twonn"), id_sample=200)
    sa, sb = score(a, opts), score(b, opts)
    for ea, eb in zip(sa["layers"], sb["layers"], strict=True):
        for k, v in ea.items():
            if isinstance(v, float):
                assert eb[k] == pytest.approx(v, rel=1e-12, abs=1e-15), (ea["layer"], k)
        assert ea["se"] == pytest.approx(eb["se"], rel=1e-12)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    txt = d / "t.txt"
    txt.write_text("\n".join(SAMPLE_TEXTS * 5) + "\n")
    return {"dir": d, "text": txt, "gpt2": make_tiny_model("gpt2", d)}


def logged_shards(part: Path) -> int:
    """Shards a process's shard log records (a header line, then one line per shard)."""
    return max(0, part.read_text().count("\n") - 1) if part.exists() else 0


@pytest.mark.slow
def test_two_processes_write_what_one_writes(data, tmp_path):
    """Tiny GPT-2 and the bundled MiniLM: the same shards (bitwise), rows and report; one manifest."""
    minilm = bundled_minilm_dir()
    sentences = Path(__file__).resolve().parents[1] / "sample_data" / "sentences.txt"
    for model, inp, extra in (
        (data["gpt2"], data["text"], ["--shard-docs", "7"]),
        (minilm, sentences, ["--max-docs", "60", "--shard-docs", "9"]),
    ):
        one, two = tmp_path / f"{Path(model).name}-1", tmp_path / f"{Path(model).name}-2"
        assert _one(["extract", model, inp, "--out", one, "-q", *extra]).returncode == 0
        p = _torchrun(2, ["extract", model, inp, "--out", two, "-q", "--json", *extra])
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        summary = json.loads(out.strip().splitlines()[-1])  # one summary (process 0's), not two
        assert len([ln for ln in out.splitlines() if ln.startswith("{")]) == 1
        assert summary["processes"] == 2 and summary["complete"]
        m1 = json.loads((one / "manifest.json").read_text())
        m2 = json.loads((two / "manifest.json").read_text())
        assert [s["sha256"] for s in m1["shards"]] == [s["sha256"] for s in m2["shards"]]
        assert m1["identity"] == m2["identity"] and m1["totals"] == m2["totals"]
        assert not list(two.glob(".geomscope-rank-*"))  # the parts were folded in
        _same_run(one, two)
        v = subprocess.run(
            [sys.executable, "-m", "geomscope", "inspect", two, "--verify", "--json"],
            env=_env(),
            capture_output=True,
            text=True,
        )
        doc = json.loads(v.stdout)["verify"]["documents"]
        assert v.returncode == 0 and doc["each_document_once"] and doc["docs"] == m1["totals"]["docs"]


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "geomscope" in " ".join(child.cmdline()):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow
def test_sigkill_one_rank_then_one_process_finishes_the_run(tmp_path):
    """Process 1 is killed after its first shard; torchrun stops the other; rerunning the same
    command as ONE process keeps every finished shard of both and writes only the rest."""
    minilm = bundled_minilm_dir()
    sentences = Path(__file__).resolve().parents[1] / "sample_data" / "sentences.txt"
    args = ["--max-docs", "200", "--shard-docs", "10", "-q"]
    clean, run = tmp_path / "clean", tmp_path / "run"
    assert _one(["extract", minilm, sentences, "--out", clean, *args]).returncode == 0
    p = _torchrun(2, ["extract", minilm, sentences, "--out", run, *args])
    part = run / ".geomscope-rank-00001.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if logged_shards(part) >= 1:
            break
        time.sleep(0.05)
    pid = _rank_pid(p, 1)
    assert pid is not None and p.poll() is None, "the run ended before process 1 could be killed"
    os.kill(pid, signal.SIGKILL)
    p.communicate(timeout=120)
    assert p.returncode != 0
    kept_by_1 = logged_shards(part)
    again = _one(["extract", minilm, sentences, "--out", run, *args, "--json"])
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["shards_resumed"] >= kept_by_1 >= 1
    assert summary["shards_written"] == summary["shards"] - summary["shards_resumed"]
    assert not part.exists()
    _same_run(clean, run)


@pytest.mark.slow
def test_a_failure_in_one_process_stops_every_process(data, tmp_path):
    """A NaN in a document of process 1's shard: every process exits 3 with the same one line."""
    model = tmp_path / "poisoned"
    shutil.copytree(data["gpt2"], model)
    poison_token(model)
    texts = [*SAMPLE_TEXTS, "the poison is here", *SAMPLE_TEXTS]
    inp = tmp_path / "t.txt"
    inp.write_text("\n".join(texts) + "\n")  # shard 1 (process 1) holds document 12
    procs = _by_hand(
        2, (0, 1), ["extract", model, inp, "--out", tmp_path / "run", "--shard-docs", "12", "-q"]
    )
    results = [pr.communicate(timeout=120) for pr in procs]
    for pr, (_out, err) in zip(procs, results, strict=True):
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert pr.returncode == 3, err
        assert lines[-1].startswith("error:") and "NaN/Inf" in lines[-1] and "Traceback" not in err


def test_a_missing_peer_is_an_error_not_a_hang(data, tmp_path):
    """Only process 0 of 2 starts: it gives up after GEOMSCOPE_DIST_TIMEOUT with one line."""
    t0 = time.time()
    (pr,) = _by_hand(
        2,
        (0,),
        ["extract", data["gpt2"], data["text"], "--out", tmp_path / "run", "-q"],
        GEOMSCOPE_DIST_TIMEOUT="4",
    )
    _out, err = pr.communicate(timeout=120)
    assert pr.returncode != 0
    last = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
    assert last.startswith("error:") and "did not meet" in last, err
    assert time.time() - t0 < 90


@pytest.mark.slow
def test_a_peer_that_dies_mid_run_does_not_hang_the_other(tmp_path):
    """Without torchrun's agent, process 1 is killed after its first shard: process 0 finishes its
    own shards, then fails at the next meeting point (connection lost, or the timeout)."""
    minilm = bundled_minilm_dir()
    sentences = Path(__file__).resolve().parents[1] / "sample_data" / "sentences.txt"
    run = tmp_path / "run"
    procs = _by_hand(
        2,
        (0, 1),
        ["extract", minilm, sentences, "--out", run, "--max-docs", "120", "--shard-docs", "10", "-q"],
        GEOMSCOPE_DIST_TIMEOUT="20",
    )
    part = run / ".geomscope-rank-00001.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and procs[1].poll() is None:
        if logged_shards(part) >= 1:
            break
        time.sleep(0.05)
    procs[1].kill()
    _out, err = procs[0].communicate(timeout=180)
    procs[1].communicate()
    assert procs[0].returncode != 0
    last = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
    assert last.startswith("error:") and "Traceback" not in err, err


def test_options_that_need_one_process(data, tmp_path, cli, monkeypatch):
    from conftest import assert_one_line_error

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, out, err = cli(
        ["extract", data["gpt2"], data["text"], "--out", tmp_path / "r", "--max-tokens", "50"]
    )
    assert "--max-tokens" in assert_one_line_error(code, out, err, exit_code=2)
    assert not (tmp_path / "r").exists()


ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.mark.skipif(not ACCELERATE.exists(), reason="accelerate is not installed")
def test_accelerate_launch(data, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (CPU processes here) writes the shards a
    single process writes."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["extract", data["gpt2"], data["text"], "--shard-docs", "7", "-q"]
    assert _one([*args, "--out", one]).returncode == 0
    cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    p = subprocess.run(
        [*cmd, "-m", "geomscope", *map(str, args), "--out", str(two)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m2["last_invocation"]["processes"] == 2
    assert [s["sha256"] for s in m1["shards"]] == [s["sha256"] for s in m2["shards"]]


def test_device_map_places_the_model_and_stores_the_same_rows(data, tmp_path):
    """accelerate's big-model loading (all on the CPU here): the same shards as --device cpu."""
    from geomscope.extract.run import extract

    a = extract(str(data["gpt2"]), [str(data["text"])], tmp_path / "a", shard_docs=7, device="cpu")
    b = extract(
        str(data["gpt2"]),
        [str(data["text"])],
        tmp_path / "b",
        shard_docs=7,
        device_map="sequential",
        max_memory="cpu=2GiB",
    )
    assert a["rows"] == b["rows"]
    m1, m2 = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("a", "b"))
    assert [s["sha256"] for s in m1["shards"]] == [s["sha256"] for s in m2["shards"]]
    assert m2["last_invocation"]["device_map"] == "sequential" and m1["identity"] == m2["identity"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--device-map", "sequential", "--max-memory", "cpu=10KB"], "does not fit in the --max-memory"),
        (["--max-memory", "cpu=1GiB"], "--max-memory applies with --device-map"),
        (["--device-map", "auto", "--device", "cpu"], "drop --device"),
        (["--device-map", "everywhere"], "--device-map must be one of auto, balanced"),
        (["--device-map", "auto", "--max-memory", "cpu"], "DEVICE=SIZE"),
    ],
)
def test_device_map_refusals(data, tmp_path, cli, args, needle):
    from conftest import assert_one_line_error

    code, out, err = cli(["extract", data["gpt2"], data["text"], "--out", tmp_path / "r", "-q", *args])
    assert needle in assert_one_line_error(code, out, err, exit_code=2)
    assert not (tmp_path / "r" / "manifest.json").exists()


def test_world_from_the_launchers_environment(monkeypatch):
    """torchrun/accelerate's variables first; SLURM's (srun with several tasks) copied to them; a
    SLURM allocation of one task, or none, is one process; srun without a rendezvous address is refused."""
    from geomscope.distributed import world_from_env
    from geomscope.errors import InputError

    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.setenv(k, "x")  # recorded, so that what world_from_env writes is undone too
        monkeypatch.delenv(k)
    assert world_from_env() == (0, 1, 0)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert world_from_env() == (0, 1, 0)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(InputError, match="MASTER_ADDR"):
        world_from_env()
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert world_from_env() == (5, 8, 1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's own variables win
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert world_from_env() == (1, 2, 1)


def test_a_process_reading_other_inputs_is_refused(data, tmp_path):
    """Only process 0's identity met the manifest: a process on a node with another copy of the
    corpus (here: its own working directory's in.txt) mixed its rows into the run. Every process
    now proves it would extract the same rows, and all exit with one line."""
    port = _free_port()
    procs = []
    for r in (0, 1):
        cwd = tmp_path / f"node{r}"
        cwd.mkdir()
        (cwd / "in.txt").write_text("\n".join(SAMPLE_TEXTS[r:] + SAMPLE_TEXTS[:r]) + "\n")
        env = _env(
            RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "geomscope", "extract", str(data["gpt2"]), "in.txt", "--out"]
                + [str(tmp_path / "run"), "-q"],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for pr in procs:
        _out, err = pr.communicate(timeout=180)
        last = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
        assert pr.returncode == 2, err
        assert last.startswith("error:") and "process 1 would extract other rows" in last, err
        assert "inputs.0.sha256" in last and "Traceback" not in err
    assert not list((tmp_path / "run").glob("shard-*.h5"))
