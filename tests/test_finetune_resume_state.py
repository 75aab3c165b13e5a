"""What ``finetune --resume`` reads back from a checkpoint is checked before it trains: the counters
of ``state.json`` (whole, in order, within ``--epochs``, one epoch's steps each), every field of the
trainer state (optimizer slots against the model's parameters, its hyperparameters against the
options, the LR schedule's counters, the generator states), and the checkpoint itself (a real
directory of regular files, never a link). A crafted checkpoint -- safetensors and JSON, no pickle --
is refused in one line with nothing in the run changed."""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager

import pytest
import torch
from conftest import assert_one_line_error, files_of
from helpers_train import finetune_args, tiny_finetune_data
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_finetune_data(tmp_path_factory.mktemp("resume-state"), 16, 8)


@pytest.fixture(scope="module")
def finished(data, cli_module):
    """A finished one-epoch run (16 rows, batch 8: two steps), copied by each test."""
    out = data["dir"] / "run"
    code, _, err = cli_module(finetune_args(data, out))
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def scheduled(data, cli_module):
    """A finished one-epoch run with a linear LR schedule (its state is in trainer.json)."""
    out = data["dir"] / "sched"
    code, _, err = cli_module(finetune_args(data, out, "--scheduler", "linear"))
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def cli_module():
    """The ``cli`` fixture's runner for module-scoped set-up (no capture needed there)."""
    from geomscope.cli import main

    def run(args):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 1), "", ""
        return 0, "", ""

    return run


def _copy(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _edit_json(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _edit_tensors(path, edit):
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _refused(cli, data, out, *needles, extra=("--epochs", "2")):
    before = files_of(out)
    code, o, err = cli(finetune_args(data, out, "--resume", *extra))
    line = assert_one_line_error(code, o, err, *needles, exit_code=2)
    assert files_of(out) == before
    return line


# ------------------------------------------------------------------------------ state.json counters
STATE_EDITS = {
    "negative epochs": (lambda s: s.update(epochs_done=-3), "epochs_done"),
    "no epoch done": (lambda s: s.update(epochs_done=0, global_step=0), "epochs_done"),
    "epochs as a flag": (lambda s: s.update(epochs_done=True), "epochs_done"),
    "negative step": (lambda s: s.update(global_step=-1), "global_step"),
    "fewer steps than epochs": (lambda s: s.update(epochs_done=2, global_step=1), "global_step"),
    "steps of other data": (lambda s: s.update(global_step=5), "5 steps"),
    "more epochs than asked": (lambda s: s.update(epochs_done=3, global_step=6), "--epochs 2"),
}


@pytest.mark.parametrize("edit, needle", STATE_EDITS.values(), ids=list(STATE_EDITS))
def test_state_counters_are_checked_before_training(cli, data, finished, tmp_path, edit, needle):
    out = _copy(finished, tmp_path)
    _edit_json(out / "checkpoint" / "state.json", edit)
    _refused(cli, data, out, needle, str(out / "checkpoint"))


LABEL_EDITS = {
    "negative class id": lambda s: s["label2id"].update(negative=-1),
    "class id past the classes": lambda s: s["label2id"].update(positive=2),
    "one class id twice": lambda s: s["label2id"].update(positive=0),
    "class id as a flag": lambda s: s["label2id"].update(positive=True),
    "class id as text": lambda s: s["label2id"].update(positive="1"),
}


@pytest.mark.parametrize("edit", LABEL_EDITS.values(), ids=list(LABEL_EDITS))
def test_the_label_map_is_checked_before_training(cli, data, finished, tmp_path, edit):
    out = _copy(finished, tmp_path)
    _edit_json(out / "checkpoint" / "state.json", edit)
    _refused(cli, data, out, "label2id", str(out / "checkpoint"))


@pytest.mark.parametrize("value", [1.5, "x", [1], None], ids=["number", "text", "list", "null"])
@pytest.mark.parametrize("key", ["train_data", "eval_data"])
def test_a_data_identity_of_another_form_is_refused_as_other_data(cli, data, finished, tmp_path, key, value):
    out = _copy(finished, tmp_path)
    _edit_json(out / "checkpoint" / "state.json", lambda s: s["fingerprint"].update({key: value}))
    _refused(cli, data, out, "was trained on other contents of")


# ------------------------------------------------------------------------------ trainer state
def _shape(t):
    t["opt.0.exp_avg"] = torch.zeros(3)


def _nan(t):
    t["opt.1.exp_avg"] = torch.full_like(t["opt.1.exp_avg"], float("nan"))


def _negative_square(t):
    t["opt.2.exp_avg_sq"] = -torch.ones_like(t["opt.2.exp_avg_sq"])


def _short_rng(t):
    t["rng.0.torch"] = t["rng.0.torch"][:100]


def _step_ahead(t):
    t["opt.0.step"] = torch.tensor(50.0)


TENSOR_EDITS = {
    "slot shape": (_shape, "opt.0.exp_avg"),
    "non-finite slot": (_nan, "opt.1.exp_avg"),
    "negative square": (_negative_square, "opt.2.exp_avg_sq"),
    "torch generator": (_short_rng, "rng.0.torch"),
    "step past the run": (_step_ahead, "step"),
}


@pytest.mark.parametrize("edit, needle", TENSOR_EDITS.values(), ids=list(TENSOR_EDITS))
def test_crafted_trainer_tensors_are_one_line(cli, data, finished, tmp_path, edit, needle):
    out = _copy(finished, tmp_path)
    _edit_tensors(out / "checkpoint" / "trainer.safetensors", edit)
    _refused(cli, data, out, "trainer state", needle)


def _group(key, value):
    return lambda t: t["optimizer"]["param_groups"][0].update({key: value})


def _slot(pid, name, value):
    return lambda t: t["optimizer"]["state"][str(pid)].update({name: value})


JSON_EDITS = {
    "lr as text": (_group("lr", "fast"), "lr"),
    "other lr": (_group("lr", 5.0), "lr"),
    "betas": (_group("betas", [0.9]), "betas"),
    "capturable": (_group("capturable", True), "capturable"),
    "params of another model": (_group("params", [0, 1]), "params"),
    "unknown parameter": (lambda t: t["optimizer"]["state"].update({"999": {}}), "999"),
    "step as text": (_slot(0, "step", {"value": "x"}), "step"),
    "missing tensor": (_slot(0, "exp_avg", {"tensor": "nowhere"}), "nowhere"),
    "missing slot": (lambda t: t["optimizer"]["state"]["0"].pop("exp_avg_sq"), "exp_avg_sq"),
    "numpy keys": (lambda t: t["rng"][0]["numpy"][1].__setitem__(0, -1), "numpy"),
    "python state": (lambda t: t["rng"][0]["python"].__setitem__(1, [1, 2]), "python"),
    "cuda states": (lambda t: t["rng"][0].update(cuda="two"), "cuda"),
    "no rng": (lambda t: t.pop("rng"), "rng"),
    "scaler": (lambda t: t.update(scaler={"scale": -1.0}), "scaler"),
}


@pytest.mark.parametrize("edit, needle", JSON_EDITS.values(), ids=list(JSON_EDITS))
def test_crafted_trainer_json_is_one_line(cli, data, finished, tmp_path, edit, needle):
    out = _copy(finished, tmp_path)
    _edit_json(out / "checkpoint" / "trainer.json", edit)
    _refused(cli, data, out, "trainer state", needle)


SCHEDULE_EDITS = {
    "schedule ahead": (lambda t: t["scheduler"].update(last_epoch=7), "last_epoch"),
    "schedule's base": (lambda t: t["scheduler"].update(base_lrs=[1.0]), "base_lrs"),
    "schedule as text": (lambda t: t["scheduler"].update(_step_count="3"), "_step_count"),
}


@pytest.mark.parametrize("edit, needle", SCHEDULE_EDITS.values(), ids=list(SCHEDULE_EDITS))
def test_crafted_schedule_is_one_line(cli, data, scheduled, tmp_path, edit, needle):
    out = _copy(scheduled, tmp_path)
    _edit_json(out / "checkpoint" / "trainer.json", edit)
    _refused(cli, data, out, "trainer state", needle, extra=("--scheduler", "linear"))


def test_a_clean_checkpoint_still_resumes(cli, data, finished, scheduled, tmp_path):
    out = _copy(finished, tmp_path / "a")
    code, _, err = cli(finetune_args(data, out, "--resume", "--epochs", "2"))
    assert code == 0, err
    assert [json.loads(ln)["epoch"] for ln in (out / "eval.jsonl").read_text().splitlines()] == [1, 2]
    out = _copy(scheduled, tmp_path / "b")  # one epoch done of one: the export is redone
    code, _, err = cli(finetune_args(data, out, "--resume", "--scheduler", "linear"))
    assert code == 0, err


# ------------------------------------------------------------------------------ linked checkpoint
def test_a_linked_checkpoint_is_refused_before_training(cli, data, finished, tmp_path):
    out = _copy(finished, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (out / "checkpoint").rename(elsewhere)
    (out / "checkpoint").symlink_to(elsewhere, target_is_directory=True)
    line = _refused(cli, data, out, "is a link", str(elsewhere))
    assert "checkpoint" in line
    assert not (out / "checkpoint.old").exists() and (elsewhere / "state.json").is_file()


@contextmanager
def _no_hang(seconds: int = 60):
    """Fail (rather than wait forever) when what runs inside blocks, e.g. on opening a FIFO."""

    def hung(signum, frame):
        raise AssertionError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", ["state.json", "trainer.json", "trainer.safetensors"])
def test_a_checkpoint_file_that_is_a_link_or_fifo_is_refused(cli, data, finished, tmp_path, name):
    out = _copy(finished, tmp_path)
    (out / "checkpoint" / name).unlink()
    (out / "checkpoint" / name).symlink_to("/dev/zero")
    with _no_hang():
        _refused(cli, data, out, name, "not a regular file")
    (out / "checkpoint" / name).unlink()
    os.mkfifo(out / "checkpoint" / name)
    with _no_hang():
        _refused(cli, data, out, name, "not a regular file")
