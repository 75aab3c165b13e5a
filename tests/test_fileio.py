"""Writing and hashing files (geomscope/fileio.py): atomic writes that never write through a link and
leave no temporary behind, and the digest of an input file or folder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from geomscope.errors import InputError
from geomscope.fileio import (
    TEMP_PREFIX,
    files_digest,
    replace_dir,
    restore_aside,
    write_json_atomic,
    write_text_atomic,
)


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("old")
    write_json_atomic(p, {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]


def test_atomic_write_never_writes_through_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").symlink_to(outside)
    write_text_atomic(run / "report.json", "new")
    assert outside.read_text() == "precious"  # the link itself was replaced, not its target
    assert not (run / "report.json").is_symlink() and (run / "report.json").read_text() == "new"


def test_atomic_write_failure_removes_its_temp(tmp_path, monkeypatch):
    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "x.txt", "data")
    assert not any(f.name.startswith(TEMP_PREFIX) for f in tmp_path.iterdir())


def test_input_digest_of_a_file_and_of_a_folder(tmp_path):
    import hashlib

    from geomscope.fileio import input_digest
    from geomscope.train.config import data_identity

    f = tmp_path / "train.jsonl"
    f.write_bytes(b'{"sentence": "a"}\n')
    assert input_digest(f, "train.jsonl") == (hashlib.sha256(f.read_bytes()).hexdigest(), 18)
    ds = tmp_path / "ds"
    (ds / "sub").mkdir(parents=True)
    (ds / "b.arrow").write_bytes(b"BB")
    (ds / "sub" / "a.json").write_bytes(b"{}")
    want = hashlib.sha256(b"b.arrow\0BB" + b"sub/a.json\0{}").hexdigest()
    assert input_digest(ds, "ds", directory=True) == (want, 4)
    # finetune's fingerprint records its data files as extract records its inputs
    assert data_identity(str(ds)) == {"sha256": want, "bytes": 4}
    assert data_identity(str(f))["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()


def test_input_digest_names_an_input_it_cannot_read(tmp_path):
    from geomscope.fileio import input_digest

    with pytest.raises(
        InputError, match=r"^input gone\.txt cannot be read \(No such file or directory\); check"
    ):
        input_digest(tmp_path / "gone.txt", "gone.txt")


def test_files_digest_follows_its_definition(tmp_path):
    """Names, sizes and contents in name order: whole, head and tail of a long file, or nested."""
    import hashlib

    rng = np.random.default_rng(0)
    blobs = {"b.bin": rng.bytes(5000), "a.json": b'{"x": 1}', "c.bin": rng.bytes(300)}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    paths = [tmp_path / n for n in blobs]
    n = 1000

    def reference(part, nested=False):
        h = hashlib.sha256()
        for name in sorted(blobs):
            data = blobs[name]
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(hashlib.sha256(data).digest() if nested else part(data))
        return h.hexdigest()

    assert files_digest(paths, "sha256") == reference(lambda d: d)
    head_tail = reference(lambda d: d if len(d) <= 2 * n else d[:n] + d[-n:])
    assert files_digest(paths, "sha256", head_tail=n) == head_tail != reference(lambda d: d)
    assert files_digest(paths, "sha256", nested=True) == reference(None, nested=True)
    assert files_digest([], "sha256") is None


def test_restore_aside_puts_back_what_a_cut_off_replace_dir_left(tmp_path):
    """A crash between replace_dir's renames leaves the old directory aside and nothing at its name:
    restore_aside puts it back; with something at the name, or a link aside, it changes nothing."""
    final, aside = tmp_path / "ckpt", tmp_path / "ckpt.old"
    aside.mkdir()
    (aside / "state.json").write_text("old")
    assert restore_aside(final, aside) and (final / "state.json").read_text() == "old"
    assert not aside.exists() and not restore_aside(final, aside)
    new = tmp_path / "new"
    new.mkdir()
    replace_dir(new, final, aside=aside)  # whole: nothing left aside
    aside.mkdir()
    assert not restore_aside(final, aside) and aside.is_dir()  # something stands at the name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    aside.rmdir()
    aside.symlink_to(elsewhere, target_is_directory=True)
    remove = tmp_path / "gone"
    final.rename(remove)
    assert not restore_aside(final, aside) and not final.exists() and aside.is_symlink()
