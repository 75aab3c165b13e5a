"""``finetune --overwrite`` removes only what the previous run recorded in its marker (never every
folder of a fixed list -- ``checkpoints/``, ``wandb/`` ... -- whoever made it); an --out that holds
files geomscope did not write is refused, with or without --overwrite."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import assert_one_line_error, files_of
from helpers_train import (
    finetune_args,
    finetune_cosreg,
    make_checkpoint,
    synthetic_rows,
    tiny_finetune_data,
    words_of,
    write_csv,
)

from geomscope.errors import InputError
from geomscope.train import checkpoint as ck

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_finetune_data(tmp_path_factory.mktemp("ow"))


def _run(cli, data, out, *extra):
    return cli(finetune_args(data, out, *extra))


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_keeps_folders_it_did_not_write(cli, data, tmp_path):
    out = tmp_path / "ow"
    assert _run(cli, data, out)[0] == 0
    (out / "checkpoints" / "my_ckpt").mkdir(parents=True)
    (out / "checkpoints" / "my_ckpt" / "weights.bin").write_text("x")
    (out / "wandb").mkdir()
    (out / "wandb" / "run.txt").write_text("y")
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    assert (out / "checkpoints" / "my_ckpt" / "weights.bin").read_text() == "x"
    assert (out / "wandb" / "run.txt").read_text() == "y"
    # snapshots land beside the user's folder, are recorded, and go with the next --overwrite
    code, _, err = _run(cli, data, out, "--overwrite", "--save-every", "1")
    assert code == 0, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["my_ckpt", "step0", "step1", "step2"]
    assert "checkpoints/step1" in ck.read_marker(out)["files"]
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["my_ckpt"]
    assert (out / "wandb" / "run.txt").read_text() == "y" and (out / "model.safetensors").is_file()


def test_a_folder_of_ours_made_for_snapshots_goes_when_empty(cli, data, tmp_path):
    out = tmp_path / "snap"
    assert _run(cli, data, out, "--save-every", "2")[0] == 0
    assert ck.SNAPSHOTS in ck.read_marker(out)["dirs"]
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    assert not (out / ck.SNAPSHOTS).exists()


def test_an_unrecorded_entry_in_the_way_is_refused_before_anything_is_removed(cli, data, tmp_path):
    out = tmp_path / "way"
    assert _run(cli, data, out)[0] == 0
    (out / "checkpoints" / "step0").mkdir(parents=True)  # a user's folder where --save-every writes
    (out / "checkpoints" / "step0" / "mine.txt").write_text("mine")
    before = _tree(out)
    code, o, err = _run(cli, data, out, "--overwrite", "--save-every", "1")
    assert_one_line_error(code, o, err, "checkpoints/step0", "not recorded", exit_code=2)
    assert _tree(out) == before
    # the run that does not write there goes ahead and leaves it
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    assert (out / "checkpoints" / "step0" / "mine.txt").read_text() == "mine"


def test_an_older_marker_removes_only_what_it_proves_and_nothing_outside(cli, data, tmp_path):
    """A marker of another version lists the exported files only: the run's logs and
    working directories (fixed names) go, folders a user could have made stay, and the exported files,
    which it cannot prove geomscope wrote, are refused in the way until moved out; a crafted name
    that leaves the directory is never followed."""
    out = tmp_path / "old"
    assert _run(cli, data, out)[0] == 0
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    exported = [n for n in ck.read_marker(out)["files"] if (out / n).is_file() and n not in ck.RUN_FILES]
    (out / ck.FINETUNE_MARKER).write_text(
        json.dumps({"format": "geomscope-finetune", "files": [*exported, "../outside.txt"]})
    )
    for d in ("checkpoints/step0", "tensorboard", "adapter"):
        (out / d).mkdir(parents=True)
        (out / d / "f.txt").write_text(d)
    (out / "notes.txt").write_text("n")
    # the exported files it lists carry no digest: claims only, neither removed nor replaced
    before = _tree(out)
    code, o, err = _run(cli, data, out, "--overwrite")
    assert_one_line_error(code, o, err, "no recorded sha256", exit_code=2)
    assert _tree(out) == before
    for name in exported:
        (out / name).unlink()
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    for d in ("checkpoints/step0", "tensorboard", "adapter"):
        assert (out / d / "f.txt").read_text() == d
    assert (out / "notes.txt").read_text() == "n" and outside.read_text() == "keep"
    assert ck.read_marker(out)["version"] == ck.FINETUNE_MARKER_VERSION
    # the folders a run under such a marker cannot be proven to have made are refused where the new run writes
    code, o, err = _run(cli, data, out, "--overwrite", "--save-every", "1")
    assert_one_line_error(code, o, err, "checkpoints/step0", exit_code=2)


class _Saves:
    """A stand-in for a model or tokenizer: ``save_pretrained`` writes the named files (a
    ``.safetensors`` one whole: every one written is held to the size its header declares)."""

    def __init__(self, *names):
        self.names = names

    def save_pretrained(self, where, **kw):
        import numpy as np
        from safetensors.numpy import save_file

        for n in self.names:
            if n.endswith(".safetensors"):
                save_file({"w": np.zeros((2, 3), np.float32)}, str(where / n))
            else:
                (where / n).write_text("new " + n)


def test_export_never_replaces_a_file_the_marker_does_not_record(tmp_path):
    out = tmp_path / "exp"
    out.mkdir()
    (out / ck.FINETUNE_MARKER).write_text(
        json.dumps({"format": "geomscope-finetune", "version": 2, "files": []})
    )
    (out / "config.json").write_text("the user's")  # appeared while the run trained
    with pytest.raises(InputError, match="config.json is not recorded"):
        ck.export_model(out, _Saves("config.json", "model.safetensors"), _Saves("vocab.txt"), {})
    assert (out / "config.json").read_text() == "the user's"
    assert not (out / "model.safetensors").exists() and not (out / ".export.tmp").exists()
    (out / "config.json").unlink()
    ck.export_model(out, _Saves("config.json", "model.safetensors"), _Saves("vocab.txt"), {})
    assert {"config.json", "model.safetensors", "vocab.txt"} <= set(ck.read_marker(out)["files"])


def test_finetune_refuses_an_out_it_did_not_write(cli, tmp_path):
    model = make_checkpoint(tmp_path / "m", words_of([]))
    train = write_csv(tmp_path / "train.csv", synthetic_rows(16, 0))
    before = files_of(model)
    for flags in ([], ["--overwrite"]):
        code, out, err = cli(["finetune", model, "--train", train, "--eval", train, "--out", model, *flags])
        assert_one_line_error(code, out, err, "holds files geomscope did not write", exit_code=2)
    assert files_of(model) == before


def test_finetune_overwrite_replaces_only_its_own_output(cli, tmp_path):
    out = tmp_path / "ft"
    code, _, err = finetune_cosreg(cli, tmp_path, out)
    assert code == 0, err
    (out / "my-notes.txt").write_text("keep")
    code, o, err = finetune_cosreg(cli, tmp_path, out)
    assert_one_line_error(code, o, err, "already holds a finetune run", exit_code=2)
    code, _, err = finetune_cosreg(cli, tmp_path, out, "--overwrite")
    assert code == 0, err
    assert (out / "my-notes.txt").read_text() == "keep" and (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------ a marker is a claim
def _claim(out, *rels, digests=None):
    """Add ``rels`` to ``out``'s marker as a crafted one would (and, optionally, digests)."""
    p = out / ck.FINETUNE_MARKER
    m = json.loads(p.read_text())
    m["files"] = [*m["files"], *rels]
    m["sha256"] = {**m.get("sha256", {}), **(digests or {})}
    p.write_text(json.dumps(m))


def test_a_crafted_marker_deletes_nothing_of_a_users(cli, data, tmp_path):
    """A marker is a claim, not proof: --overwrite and --resume remove what geomscope can recognise as
    its own (its fixed names, content whose recorded sha256 matches), never a user's file it lists."""
    out = tmp_path / "claimed"
    assert _run(cli, data, out)[0] == 0
    mine = {"thesis.tex": "mine", ".draft.tmp": "draft", "notes/.x.tmp": "x", "checkpoints/step3/n.txt": "n"}
    for rel, text in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    _claim(out, *mine, "notes", "checkpoints/step3")
    code, _, err = _run(cli, data, out, "--resume", "--epochs", "2")  # removes its stale temporaries
    assert code == 0, err
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    for rel, text in mine.items():
        assert (out / rel).read_text() == text, rel
    # a digest claimed for a user's file proves nothing: it does not match, and the run is refused
    _claim(out, "thesis.tex", digests={"thesis.tex": "0" * 64})
    before = _tree(out)
    code, o, err = _run(cli, data, out, "--overwrite")
    assert_one_line_error(code, o, err, str(out / "thesis.tex"), "not what geomscope wrote", exit_code=2)
    assert _tree(out) == before
    for rel, text in mine.items():
        assert (out / rel).read_text() == text, rel
    assert (out / "model.safetensors").is_file() and len((out / "eval.jsonl").read_text().splitlines()) == 1


def test_overwrite_removes_its_export_by_digest_and_refuses_an_edited_one(cli, data, tmp_path):
    out = tmp_path / "edited"
    assert _run(cli, data, out, "--save-every", "1")[0] == 0
    digests = ck.read_marker(out)["sha256"]
    assert {"config.json", "model.safetensors", "checkpoints/step1/config.json"} <= set(digests)
    (out / "config.json").write_text('{"edited": true}')  # the user changed the exported config
    before = _tree(out)
    code, o, err = _run(cli, data, out, "--overwrite")
    assert_one_line_error(code, o, err, str(out / "config.json"), "not what geomscope wrote", exit_code=2)
    assert _tree(out) == before
    (out / "config.json").unlink()
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    assert not (out / "checkpoints").exists()  # every snapshot file matched its digest: all removed


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_overwrite_removes_the_tracker_and_adapter_files_it_wrote_and_no_other(cli, data, tmp_path):
    out = tmp_path / "tb"
    assert _run(cli, data, out, "--report-to", "tensorboard", "--lora", "2")[0] == 0
    digests = ck.read_marker(out)["sha256"]
    assert any(k.startswith("tensorboard/events.out.tfevents.") for k in digests)
    assert "adapter/adapter_model.safetensors" in digests
    (out / "tensorboard" / "mine.txt").write_text("m")
    code, _, err = _run(cli, data, out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["mine.txt"]
    assert not (out / "adapter").exists()
