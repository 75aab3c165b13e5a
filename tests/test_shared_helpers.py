"""The one-home helpers: atomic writes, device choice, versions, the progress display."""

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


@pytest.mark.parametrize("spec", ["cpu", "auto", "CPU", None])
def test_resolve_device_cpu(spec):
    from geomscope.devices import resolve_device

    assert resolve_device(spec).type == "cpu"


@pytest.mark.parametrize(
    "spec,match",
    [
        ("cuda:1", "no CUDA device"),
        ("cuda", "no CUDA device"),
        ("tpu", "not a device|not supported"),
        ("gpu0", "not a device"),
    ],
)
def test_resolve_device_refuses_what_is_not_here(spec, match):
    import torch

    from geomscope.devices import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this check is about a machine without CUDA")
    with pytest.raises(InputError, match=match):
        resolve_device(spec)


def test_package_versions():
    from geomscope import __version__
    from geomscope.provenance import package_versions

    v = package_versions()
    assert v["geomscope"] == __version__ and set(v) == {"geomscope", "torch", "transformers"}


def test_progress_disabled_is_silent(capsys):
    from geomscope.progress import Progress

    with Progress(enabled=False) as bar:
        t = bar.add("x", 10, unit="docs", rate_unit="tok")
        t.advance(3, work=30)
        t.skip(2)
        t.info("i")
        t.describe("d")
        t.complete()
        bar.print("line")
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_enabled_counts(capsys):
    from geomscope.progress import Progress

    with Progress(enabled=True) as bar:
        t = bar.add("x", 10, unit="docs", rate_unit="tok")
        t.skip(4)
        t.advance(3, work=30)
        task = bar._p.tasks[0]
        assert task.completed == 7 and task.fields["rate"].endswith("tok/s")
        t.complete()
        assert task.completed == 10


def test_choices_match_the_library_registries():
    from geomscope import choices
    from geomscope.metrics.outliers import OUTLIER_RULES
    from geomscope.plot.figures import KINDS

    assert tuple(OUTLIER_RULES) == choices.OUTLIER_RULES
    assert set(choices.PLOT_KINDS) == {"auto", *KINDS}


@pytest.mark.parametrize(
    ("exc", "limit", "expected"),
    [
        (ValueError("bad header\nTraceback detail"), None, "bad header"),
        (ValueError("  \n padded line\nmore"), None, "padded line"),
        (ValueError("x" * 300), 160, "x" * 160),
        (OSError(), None, "OSError"),
        (RuntimeError("   "), 10, "RuntimeError"),
    ],
)
def test_first_line_quotes_one_line_of_an_exception(exc, limit, expected):
    from geomscope.errors import first_line

    assert first_line(exc, limit) == expected


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
