"""Writing and hashing files (geomscope/fileio.py): atomic writes that never write through a link and
leave no temporary behind, and the digest of an input file or folder."""

from __future__ import annotations

import json
import os

import pytest

from geomscope.errors import InputError
from geomscope.fileio import TEMP_PREFIX, write_json_atomic, write_text_atomic


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
