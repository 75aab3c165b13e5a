"""Every path that takes a MODEL resolves it the same way (model.names.resolve_model): the bundled
alias, a local directory, a glob of one checkpoint, a hub name; `finetune --dry-run` checks what a run
checks before it trains; a hub name that does not resolve (or no network) is one line at once.

The first test runs `make study`'s command, read from the Makefile, at tiny size."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error
from helpers_models import bundled_minilm_dir

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SENTIMENT = ROOT / "sample_data" / "sentiment"
#: a hub name no repository has: the hub (or the missing network) refuses it
HUB_TYPO = "geomscope-tests/no-such-model-3f9c2a"


def _head(src: Path, dest: Path, rows: int) -> Path:
    """The header and the first ``rows`` rows of a sample CSV (a tiny copy of the study's data)."""
    lines = src.read_text(encoding="utf-8").splitlines()
    dest.write_text("\n".join(lines[: rows + 1]) + "\n", encoding="utf-8")
    return dest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The sample sentiment data cut to 8 training and 4 eval rows (both labels in each)."""
    d = tmp_path_factory.mktemp("tiny")
    return {
        "train": _head(SENTIMENT / "train.csv", d / "train.csv", 8),
        "eval": _head(SENTIMENT / "dev.csv", d / "dev.csv", 4),
    }


def _tiny_finetune(model, tiny, out, *extra) -> list:
    return [
        "finetune", model, "--train", tiny["train"], "--eval", tiny["eval"], "--text-field", "sentence",
        "--label-field", "label", "--epochs", "1", "--lr", "1e-4", "--max-length", "16",
        "--device", "cpu", "--quiet", "--out", out, *extra,
    ]  # fmt: skip


def _study_commands() -> list[list[str]]:
    """The `make study` recipe: its command lines, continuation lines joined, make's quoting undone."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^study:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "the Makefile lost its study target"
    joined = recipe.group(1).replace("\\\n", " ")
    return [shlex.split(line.strip()) for line in joined.splitlines() if line.strip()]


def _at_tiny_size(argv: list[str], tiny, out: Path) -> list[str]:
    """`make study`'s finetune with every flag kept (its grid of lambdas and seeds too), except: the
    tiny data, 1 epoch and short inputs."""
    swap = {"--train": str(tiny["train"]), "--eval": str(tiny["eval"]), "--epochs": "1"}
    args, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in swap:
            args += [a, swap[a]]
            i += 2
            continue
        args.append(str(out) if a == "$(STUDY)" else a)
        i += 1
    return [*args, "--max-length", "16", "--device", "cpu", "--quiet"]


# ---------------------------------------------------------------------------------- make study
def test_make_study_runs_at_tiny_size(cli, tiny, tmp_path):
    """`make study` stopped with 'Repo id must use alphanumeric chars' at its grid's model check."""
    finetune, compare = _study_commands()
    assert finetune[:3] == ["$(BIN)/geomscope", "finetune", "bundled:minilm"], finetune
    assert compare == ["$(BIN)/geomscope", "compare", "$(STUDY)"], compare
    assert any(a.startswith("--lambda=") and "," in a for a in finetune), finetune  # a grid
    out = tmp_path / "study"
    argv = _at_tiny_size(finetune[1:], tiny, out)
    code, stdout, err = cli([*argv, "--dry-run"])
    assert code == 0, err
    n = len(stdout.split())
    assert n >= 4 and not out.exists()
    code, stdout, err = cli([*argv, "--json"])
    assert code == 0, err
    runs = json.loads(stdout)["runs"]
    assert [r["status"] for r in runs] == ["done"] * n
    for r in runs:
        run = json.loads((Path(r["dir"]) / "run.json").read_text())["config"]
        assert run["model"] == str(bundled_minilm_dir().resolve())
    code, stdout, err = cli([compare[1], str(out), "--json", "--bootstrap", "200"])
    assert code == 0, err
    assert len(json.loads(stdout)["runs"]) == n


# ---------------------------------------------------------------------------------- entry points
def test_extract_takes_bundled_minilm_and_a_glob_of_one_checkpoint(cli, tmp_path):
    """extract resolves bundled:minilm, and a glob that matches one checkpoint, not 'does not exist'."""
    text = tmp_path / "t.txt"
    text.write_text("A lovely hotel in a perfect spot.\nI can't believe I paid to see this.\n")
    common = ["--layers", "-1", "--device", "cpu", "--quiet"]
    code, _, err = cli(["extract", "bundled:minilm", text, "--out", tmp_path / "a", *common])
    assert code == 0, err
    one = bundled_minilm_dir().parent / "mode?"  # matches the package's model/ directory only
    code, _, err = cli(["extract", str(one), text, "--out", tmp_path / "b", *common])
    assert code == 0, err
    from geomscope.model.fingerprint import WEIGHTS_KEY

    ids = [json.loads((tmp_path / r / "manifest.json").read_text())["identity"]["model"] for r in "ab"]
    assert ids[0]["name"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert ids[1]["name"] == str(bundled_minilm_dir().resolve())
    assert ids[0][WEIGHTS_KEY] == ids[1][WEIGHTS_KEY]
    many = bundled_minilm_dir().parent / "*"
    code, out, err = cli(["extract", str(many), text, "--out", tmp_path / "c", *common])
    if len([p for p in many.parent.glob("*") if p.is_dir()]) > 1:
        assert_one_line_error(code, out, err, "--revisions", exit_code=2)


def test_finetune_one_run_of_bundled_minilm_and_of_a_glob(cli, tiny, tmp_path):
    """A single run resolves the alias, and a glob that matches one checkpoint, not 'does not exist'."""
    code, _, err = cli(_tiny_finetune("bundled:minilm", tiny, tmp_path / "run1", "--reg", "none"))
    assert code == 0, err
    run = json.loads((tmp_path / "run1" / "run.json").read_text())["config"]
    assert run["model"] == str(bundled_minilm_dir().resolve())
    code, _, err = cli(_tiny_finetune(str(tmp_path / "run?"), tiny, tmp_path / "again", "--reg", "none"))
    assert code == 0, err
    run = json.loads((tmp_path / "again" / "run.json").read_text())["config"]
    assert run["model"] == str((tmp_path / "run1").resolve())


def test_sweep_checks_bundled_minilm_as_a_run_loads_it(tiny, tmp_path, monkeypatch):
    """The library's run_sweep: its check of the shared inputs did not resolve the alias."""
    import geomscope.train
    from geomscope.study.sweep import grid, run_sweep
    from geomscope.train import FinetuneConfig

    seen = []
    monkeypatch.setattr(geomscope.train, "finetune", lambda cfg, **kw: seen.append(cfg) or {})
    base = FinetuneConfig(
        model="bundled:minilm", train=str(tiny["train"]), eval=str(tiny["eval"]),
        out=str(tmp_path / "sw"), text_field="sentence", label_field="label", device="cpu",
    )  # fmt: skip
    results = run_sweep(base, grid(["istar"], [-1.0, 0.0], [0]))
    assert [r["status"] for r in results] == ["done", "done"]
    assert [c.model for c in seen] == ["bundled:minilm"] * 2


def test_dry_run_checks_what_a_run_checks_before_it_trains(cli, tiny, tmp_path):
    """--dry-run printed the grid without checking the model, the data or --out."""
    out = tmp_path / "g"
    grid = ["--lambda=-1,0", "--seed", "0"]
    code, stdout, err = cli(_tiny_finetune("bundled:minilm", tiny, out, *grid, "--dry-run"))
    assert code == 0, err
    assert stdout.split() == [str(out / "istar_lambda-1_seed0"), str(out / "istar_lambda0_seed0")]
    assert not out.exists()  # nothing written
    bad_eval = tmp_path / "bad_dev.csv"
    bad_eval.write_text("sentence,label\nNot what I hoped.,neutral\n")

    def minilm(*extra, out=out):
        return _tiny_finetune("bundled:minilm", tiny, out, *extra, "--dry-run")

    missing = tmp_path / "no.csv"
    cases = [
        (_tiny_finetune("bundled:nothing", tiny, out, *grid, "--dry-run"), "bundled:nothing"),
        (_tiny_finetune(str(tmp_path / "none*"), tiny, out, *grid, "--dry-run"), "matches no directory"),
        (minilm(*grid, "--eval", bad_eval), "neutral"),
        (minilm(*grid, "--train", missing), "no.csv"),
        (minilm("--train", missing), "no.csv"),
        (minilm("--layers", "40"), "40"),
        (minilm(*grid, out=tmp_path), "not a geomscope sweep"),
        (minilm(out=tmp_path), "geomscope did not write"),
    ]
    for argv, needle in cases:
        code, stdout, err = cli(argv)
        assert_one_line_error(code, stdout, err, needle)
    assert not out.exists()


def test_revisions_of_bundled_minilm_checkpoints_and_of_a_hub_typo(cli, tmp_path):
    """--revisions resolves each checkpoint directory as one MODEL; a hub revision that does not
    resolve fails at once (it retried for ~26 s per revision)."""
    import shutil

    text = tmp_path / "t.txt"
    text.write_text("A lovely hotel in a perfect spot.\n")
    for step in ("step5", "step10"):
        shutil.copytree(bundled_minilm_dir(), tmp_path / "ck" / step)
    glob_of_two = str(tmp_path / "ck" / "*")
    code, stdout, err = cli(
        ["extract", "bundled:minilm", text, "--revisions", glob_of_two, "--out", tmp_path / "r"]
        + ["--layers", "-1", "--device", "cpu", "--quiet", "--json"]
    )
    assert code == 0, err
    assert [r["status"] for r in json.loads(stdout)["runs"]] == ["done", "done"]
    _hub_typo_fails_at_once(
        ["extract", HUB_TYPO, str(text), "--revisions", "step1,step2", "--out", str(tmp_path / "h")], tmp_path
    )


# ---------------------------------------------------------------------------------- hub typo
def _hub_typo_fails_at_once(argv: list[str], tmp_path: Path) -> str:
    """Run the CLI with the hub on (HF_HUB_OFFLINE unset) and an empty hub cache: one error line
    naming HF_HUB_OFFLINE=1 and a local directory, and no retries."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_CACHE=str(tmp_path / "empty_hub_cache"), HF_HOME=str(tmp_path / "hf_home"))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "geomscope", *argv], env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert "Retrying" not in proc.stderr and "thrown while requesting" not in proc.stderr, proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(line) == 1, proc.stderr
    assert "HF_HUB_OFFLINE=1" in line[0] and "local model directory" in line[0], line[0]
    # no retries is what the "Retrying" check above asserts; the bound only catches a hang (the
    # start of a Python process importing torch takes seconds on a loaded 2-core machine)
    assert elapsed < 90, (elapsed, proc.stderr)
    return line[0]


@pytest.mark.parametrize("command", ["extract", "finetune", "finetune grid", "finetune grid --dry-run"])
def test_a_hub_name_that_does_not_resolve_is_one_line_at_once(tiny, tmp_path, command):
    """Six 'Retrying in 1s...8s' lines over ~26 s came before the error."""
    if command == "extract":
        text = tmp_path / "t.txt"
        text.write_text("hello\n")
        argv = ["extract", HUB_TYPO, str(text), "--out", str(tmp_path / "o")]
    else:
        argv = [str(a) for a in _tiny_finetune(HUB_TYPO, tiny, tmp_path / "o")]
        argv += ["--lambda=-1,0"] if "grid" in command else []
        argv += ["--dry-run"] if "dry-run" in command else []
    _hub_typo_fails_at_once(argv, tmp_path)
    assert not (tmp_path / "o").exists()


def test_hub_check_says_each_failure_in_one_line(monkeypatch, tmp_path):
    """What the hub answers is said in words; a name checked once is not asked again."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    from geomscope.errors import InputError
    from geomscope.model import hub, names

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    calls = []

    def answer(exc):
        def head(url, **kw):
            calls.append((url, kw.get("timeout"), kw.get("retry_on_errors")))
            if exc is not None:
                raise exc

        monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", head)

    response = type("R", (), {"status_code": 404, "headers": {}, "request": None})()
    for exc, needle in [
        (errors.RepositoryNotFoundError("404", response=response), "unknown model"),
        (errors.RevisionNotFoundError("404", response=response), "no revision 'v9'"),
        (errors.RemoteEntryNotFoundError("404", response=response), "no config.json"),
        (OSError("Name or service not known"), "cannot reach the Hugging Face hub"),
    ]:
        answer(exc)
        with pytest.raises(InputError) as e:
            names.resolve_model("org/name", "v9")
        msg = str(e.value)
        assert needle in msg and "HF_HUB_OFFLINE=1" in msg and "local model directory" in msg, msg
    assert all(t <= 5 and retry is False for _, t, retry in calls) and "org/name" in calls[0][0]
    answer(None)
    calls.clear()
    monkeypatch.setattr(hub, "_HUB_CHECKED", set())
    for _ in range(2):
        assert names.resolve_model("org/name")[1]["source"] == "hub"
    assert len(calls) == 1
    assert names.resolve_model("org/other", reach_hub=False)[0] == "org/other" and len(calls) == 1


def test_a_cached_model_without_network_loads_from_the_cache(monkeypatch, tmp_path, capsys):
    """With the hub unreachable, a model the cache holds loads from the cache at once, not after every
    optional file transformers asks for is retried five times (~150 s for all-MiniLM-L6-v2)."""
    import huggingface_hub
    from helpers_models import hf_cache_with
    from huggingface_hub import constants

    from geomscope.errors import InputError
    from geomscope.model import hub, names

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_HUB_CHECKED", set())
    hf_cache_with(bundled_minilm_dir(), tmp_path / "hub", "org/cached", weights=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    def unreachable(url, **kw):
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    with pytest.raises(InputError, match="cannot reach"):
        names.resolve_model("org/uncached")
    said = []
    assert names.resolve_model("org/cached", log=said.append)[1]["source"] == "hub"
    assert constants.HF_HUB_OFFLINE is True and hub.offline_mode()
    assert len(said) == 1 and said[0].startswith("note: the Hugging Face hub cannot be reached")
    assert capsys.readouterr().err == ""  # the note goes to the caller's log, not to stderr
