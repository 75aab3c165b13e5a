"""What a rerun of ``finetune`` may continue, and what it is told: data changed in place is refused on
--resume; a seed the generators cannot take is one line; an interrupted run is continued by what the
interrupt message says; and the eval geometry never counts padding, so with --include-padding it does
not depend on --batch-size. A resume never unpickles the trainer state and never writes through a link
planted in the run; damaged trainer state or log is one line."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from conftest import Planted, assert_one_line_error
from helpers_train import finetune_args, finetune_cosreg, synthetic_rows, tiny_finetune_data, write_csv

import geomscope.train.loop as loop
from geomscope.errors import InputError
from geomscope.train import FinetuneConfig
from geomscope.train.config import validate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_finetune_data(tmp_path_factory.mktemp("guards"), 16, 12)


def _args(data, out, *extra, train=None):
    return finetune_args(data, out, *extra, train=train)


# ------------------------------------------------------------------------------ changed data
def test_resume_refuses_training_data_changed_in_place(cli, data, tmp_path):
    train = shutil.copy(data["train"], tmp_path / "train.csv")
    out = tmp_path / "run"
    assert cli(_args(data, out, train=train))[0] == 0
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["fingerprint"]["train_data"]["bytes"] == (tmp_path / "train.csv").stat().st_size
    write_csv(tmp_path / "train.csv", synthetic_rows(16, 7))  # same path, same labels, other rows
    before = (out / "checkpoint" / "state.json").read_bytes()
    code, o, err = cli(_args(data, out, "--resume", "--epochs", "2", train=train))
    assert_one_line_error(code, o, err, "other contents of", "train.csv", exit_code=2)
    assert (out / "checkpoint" / "state.json").read_bytes() == before


def test_a_checkpoint_without_data_hashes_still_resumes(cli, data, tmp_path):
    """A checkpoint whose state records no data hashes is compared on the data paths."""
    out = tmp_path / "old"
    assert cli(_args(data, out))[0] == 0
    p = out / "checkpoint" / "state.json"
    st = json.loads(p.read_text())
    for k in ("train_data", "eval_data"):
        del st["fingerprint"][k]
    p.write_text(json.dumps(st))
    code, _, err = cli(_args(data, out, "--resume", "--epochs", "2"))
    assert code == 0, err


# ------------------------------------------------------------------------------------ seed
@pytest.mark.parametrize("seed", ["100000000000000000000000", "4294967296"])
def test_a_seed_too_large_is_one_line(cli, data, tmp_path, seed):
    code, o, err = cli(_args(data, tmp_path / "s", "--seed", seed))
    assert_one_line_error(code, o, err, "--seed must be a whole number from 0 to 4294967295", exit_code=2)
    code, o, err = cli(_args(data, tmp_path / "g", "--seed", f"0,{seed}", "--dry-run"))
    assert_one_line_error(code, o, err, "--seed", exit_code=2)
    assert not (tmp_path / "s").exists() and not (tmp_path / "g").exists()


def test_the_largest_seed_is_accepted():
    cfg = FinetuneConfig(model="m", train="t", eval="e", out="o", seed=2**32 - 1)
    validate(cfg)
    with pytest.raises(InputError, match="--seed"):
        validate(FinetuneConfig(model="m", train="t", eval="e", out="o", seed=-1))


# ----------------------------------------------------------------------------- interrupted
def _interrupt_at_step(monkeypatch, n):
    real = loop.train_step
    calls = {"n": 0}

    def step(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(loop, "train_step", step)


def test_a_run_interrupted_in_its_first_epoch_is_rerun_as_the_message_says(cli, data, tmp_path, monkeypatch):
    out = tmp_path / "cut"
    with monkeypatch.context() as mp:
        _interrupt_at_step(mp, 2)
        code, o, err = cli(_args(data, out))
    line = assert_one_line_error(code, o, err, "rerun the same command", exit_code=130)
    assert "before the first epoch" in line and not (out / "checkpoint").exists()
    (out / ".checkpoint.tmp").mkdir()  # what a cut during the first checkpoint's writing leaves
    code, _, err = cli(_args(data, out))  # the same command
    assert code == 0, err
    assert "starting it again" in err and not (out / ".checkpoint.tmp").exists()
    assert len(json.loads((out / "summary.json").read_text())["evals"]) == 1
    # --resume of such a run starts it again too
    with monkeypatch.context() as mp:
        _interrupt_at_step(mp, 1)
        shutil.rmtree(out)
        cli(_args(data, out))
    code, _, err = cli(_args(data, out, "--resume"))
    assert code == 0, err
    assert "starting it again" in err


def test_a_run_interrupted_after_an_epoch_says_the_resume_command(cli, data, tmp_path, monkeypatch):
    out = tmp_path / "cut2"
    with monkeypatch.context() as mp:
        _interrupt_at_step(mp, 3)  # 16 rows, batch 8: step 3 is in epoch 2
        code, o, err = cli(_args(data, out, "--epochs", "2", "--overwrite"))
    line = assert_one_line_error(code, o, err, "--resume", exit_code=130)
    assert "--overwrite" not in line and "--epochs 2" in line
    code, _, err = cli(_args(data, out, "--epochs", "2", "--resume"))  # what it says to run
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["resumed"]
    # a crash between the renames that replace the checkpoint: the previous one is put back
    (out / "summary.json").unlink()
    (out / "checkpoint").rename(out / "checkpoint.old")
    code, _, err = cli(_args(data, out, "--epochs", "3", "--resume"))
    assert code == 0, err
    assert [e["epoch"] for e in json.loads((out / "summary.json").read_text())["evals"]] == [1, 2, 3]


# ----------------------------------------------------------------------- eval geometry, padding
def test_eval_geometry_with_include_padding_does_not_depend_on_batch_size(data, tmp_path):
    """--include-padding is a training option; the eval IsoScore*, IsoScore and avg cosine (which
    compare relates to accuracy) are over the real tokens whatever the batch size. The learning rate
    is too small to move any weight, so the three runs evaluate the same model."""
    train = write_csv(tmp_path / "t.csv", synthetic_rows(12, 0))
    evals = {}
    for bs in (1, 4, 12):
        cfg = FinetuneConfig(
            model=str(data["model"]),
            train=str(train),
            eval=str(data["eval"]),  # 12 sentences of 5 to 10 words: batches carry padding
            out=str(tmp_path / f"b{bs}"),
            epochs=1,
            lr=1e-30,
            batch_size=bs,
            device="cpu",
            reg="none",
            include_padding=True,
        )
        evals[bs] = loop.finetune(cfg)["final"]
    for bs in (4, 12):
        for k in ("isoscore_star", "isoscore", "avgcos", "avgcos_last_layer", "eval_tokens"):
            assert evals[bs][k] == pytest.approx(evals[1][k], rel=1e-5, abs=1e-7), (bs, k)


# ------------------------------------------------------------------ damaged and planted resume state


def test_resume_never_unpickles_trainer_state(cli, tmp_path):
    out = tmp_path / "ft"
    assert finetune_cosreg(cli, tmp_path, out)[0] == 0
    marker = tmp_path / "PWNED"
    with open(out / "checkpoint" / "trainer.pt", "wb") as f:
        pickle.dump(Planted(marker), f)
    code, o, err = finetune_cosreg(cli, tmp_path, out, "--resume", "--epochs", "2")
    assert_one_line_error(code, o, err, "trainer.pt, a pickle", exit_code=2)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "state-json", "missing"])
def test_resume_with_damaged_trainer_state_is_one_line(cli, tmp_path, damage):
    out = tmp_path / "ft"
    assert finetune_cosreg(cli, tmp_path, out)[0] == 0
    ck = out / "checkpoint"
    if damage == "truncate":
        data = (ck / "trainer.safetensors").read_bytes()
        (ck / "trainer.safetensors").write_bytes(data[: len(data) // 3])
    elif damage == "state-json":
        (ck / "state.json").write_text("{not json")
    else:
        (ck / "trainer.json").unlink()
    code, o, err = finetune_cosreg(cli, tmp_path, out, "--resume", "--epochs", "2")
    assert_one_line_error(
        code, o, err, "damaged" if damage != "missing" else "missing or damaged", exit_code=2
    )


def test_resume_with_a_damaged_log_or_planted_links(cli, tmp_path):
    out = tmp_path / "ft"
    assert finetune_cosreg(cli, tmp_path, out)[0] == 0
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (out / ".checkpoint.tmp").symlink_to(outside, target_is_directory=True)
    (out / ".export.tmp").symlink_to(outside, target_is_directory=True)
    code, _, err = finetune_cosreg(cli, tmp_path, out, "--resume", "--epochs", "2")
    assert code == 0, err
    assert (outside / "keep.txt").read_text() == "keep" and sorted(p.name for p in outside.iterdir()) == [
        "keep.txt"
    ]
    with open(out / "steps.jsonl", "a") as f:
        f.write("{half a line\n")
    code, o, err = finetune_cosreg(cli, tmp_path, out, "--resume", "--epochs", "3")
    assert_one_line_error(code, o, err, "steps.jsonl line", "is not JSON", exit_code=2)


# ------------------------------------------------------------------------------------ a full disk
def _disk_full_at_second_checkpoint(monkeypatch, error):
    import safetensors.torch

    real, calls = safetensors.torch.save_file, {"n": 0}

    def save_file(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        return real(*a, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def _safetensors_disk_full():
    from safetensors import SafetensorError

    return SafetensorError(
        "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
        'message: "No space left on device" })'
    )


def _short_write_at_second_call(monkeypatch, module, name: str) -> None:
    """``module.name`` (a safetensors writer) cuts its second file short and returns without an error,
    as a write to a full device can."""
    real, calls = getattr(module, name), {"n": 0}

    def save_file(tensors, filename, *a, **kw):
        real(tensors, filename, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 2:
            with open(filename, "r+b") as f:
                f.truncate(f.seek(0, 2) - 100)

    monkeypatch.setattr(module, name, save_file)


@pytest.mark.parametrize("writer", ["trainer state", "model weights"])
def test_weights_written_short_without_an_error_keep_the_last_checkpoint(
    cli, data, tmp_path, monkeypatch, writer
):
    """safetensors' writer to a full device may return without an error and leave a file cut short:
    the checkpoint would be renamed into place with weights that cannot be loaded. Every
    .safetensors file written is held to the size its header declares before it takes the place of
    the previous checkpoint."""
    import safetensors.torch
    import transformers.modeling_utils

    out = tmp_path / "short"
    module, name = (
        (safetensors.torch, "save_file")
        if writer == "trainer state"
        else (transformers.modeling_utils, "safe_save_file")
    )
    with monkeypatch.context() as mp:
        _short_write_at_second_call(mp, module, name)
        code, o, err = cli(_args(data, out, "--epochs", "2"))
    assert_one_line_error(code, o, err, ".safetensors", "cut short", "--resume", exit_code=1)
    assert json.loads((out / "checkpoint" / "state.json").read_text())["epochs_done"] == 1
    assert not (out / ".checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    code, _, err = cli(_args(data, out, "--epochs", "2", "--resume"))  # what it says to run
    assert code == 0, err


@pytest.mark.parametrize(
    "make_error", [_safetensors_disk_full, lambda: OSError(28, "No space left on device")]
)
def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint(
    cli, data, tmp_path, monkeypatch, make_error
):
    out = tmp_path / "full"
    with monkeypatch.context() as mp:
        _disk_full_at_second_checkpoint(mp, make_error())
        code, o, err = cli(_args(data, out, "--epochs", "2"))
    line = assert_one_line_error(code, o, err, "no space left on device", "--resume", exit_code=1)
    assert "--epochs 2" in line and "--overwrite" not in line
    assert json.loads((out / "checkpoint" / "state.json").read_text())["epochs_done"] == 1
    assert not (out / ".checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    code, _, err = cli(_args(data, out, "--epochs", "2", "--resume"))  # what it says to run
    assert code == 0, err
    assert [json.loads(ln)["epoch"] for ln in (out / "eval.jsonl").read_text().splitlines()] == [1, 2]
