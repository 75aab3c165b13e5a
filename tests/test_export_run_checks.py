"""``geomscope export`` reads a run as ``score`` does, and fails cleanly.

A run whose manifest disagrees with itself, a shard altered at the same size or holding another
shard's documents are refused (score refuses them alike); a full disk is one ``error:`` line with
nothing left behind; a layer exported alone keeps its index in the model.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers_models import make_tiny_run

from geomscope.errors import DataError, InputError
from geomscope.export import export_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("guards"), "bert", shard_docs=3, store_dtype="float32")


def _copy(run: Path, tmp_path: Path, name: str = "run") -> Path:
    dest = tmp_path / name
    shutil.copytree(run, dest)
    return dest


def _edit_manifest(run: Path, edit) -> None:
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m, indent=2))


def _nothing_left(parent: Path, keep=("run",)) -> None:
    assert sorted(p.name for p in parent.iterdir() if p.name not in keep) == []


def test_a_shard_listed_twice_is_refused(run, tmp_path, cli):
    from conftest import assert_one_line_error

    r = _copy(run, tmp_path)

    def twice(m):
        last = dict(m["shards"][-1])
        shutil.copy(r / last["file"], r / "shard-09999.h5")
        m["shards"].append(dict(last, index=9999, file="shard-09999.h5"))

    _edit_manifest(r, twice)
    for to in ("npy", "arrow"):
        code, out, err = cli(["export", r, "--to", to, "--out", tmp_path / "e", "-q"])
        assert_one_line_error(code, out, err, "is damaged", "disagrees with itself", exit_code=2)
    _nothing_left(tmp_path)


def _flip_a_value(shard: Path) -> None:
    """One byte of a layer's stored values changed: the same size, a valid file, another number."""
    import h5py

    with h5py.File(shard, "r") as f:
        ds = f["layers"][sorted(f["layers"])[0]]
        at = ds.id.get_offset() if ds.chunks is None else ds.id.get_chunk_info(0).byte_offset
    data = bytearray(shard.read_bytes())
    data[at + 2] ^= 0x40
    shard.write_bytes(bytes(data))


def test_a_shard_changed_at_the_same_size_is_refused(run, tmp_path, cli):
    from conftest import assert_one_line_error

    r = _copy(run, tmp_path)
    _flip_a_value(r / "shard-00001.h5")
    for to in ("npy", "arrow"):
        code, out, err = cli(["export", r, "--to", to, "--out", tmp_path / "e", "-q"])
        assert_one_line_error(code, out, err, "shard-00001.h5", "checksum differs", exit_code=3)
        _nothing_left(tmp_path)
    # as score --no-verify: the size is still checked, the checksum not
    code, out, err = cli(["export", r, "--to", "npy", "--out", tmp_path / "e", "-q", "--no-verify"])
    assert code == 0, err
    score = ["score", r, "--metrics", "isoscore", "--out", tmp_path / "s", "-q"]
    code, out, err = cli(score)
    assert_one_line_error(code, out, err, "shard-00001.h5", "checksum differs", exit_code=3)
    code, out, err = cli([*score, "--no-verify"])
    assert code == 0, err


def test_a_shard_holding_other_documents_is_refused(run, tmp_path):
    """Shard 1 replaced by a copy of shard 0 with its manifest entry's size, checksum and counts to
    match: only its rows' documents (0..2, its entry assigns it 3..5) tell; score refuses it."""
    r = _copy(run, tmp_path)
    shutil.copy(r / "shard-00000.h5", r / "shard-00001.h5")

    def same_as_first(m):
        a, b = m["shards"][0], m["shards"][1]
        for k in ("rows", "bytes", "sha256", "xxh3_128", "tokens", "nonfinite_rows"):
            if k in a:
                b[k] = a[k]
        m["totals"]["rows"] = sum(s["tokens"] for s in m["shards"])
        m["totals"].pop("rows_stored", None)

    _edit_manifest(r, same_as_first)
    with pytest.raises(DataError, match="outside its range"):
        export_run(r, tmp_path / "e", to="npy")
    _nothing_left(tmp_path)


def test_a_full_disk_is_one_line_and_leaves_nothing(run, tmp_path, monkeypatch):
    """The .npy files are written, not memory-mapped (a sparse map meets a full disk as SIGBUS, with no
    error line and the temporary directory left behind). Here every write into the export fails with
    ENOSPC once a few KB are written."""
    real_write = os.write
    written = {"n": 0}

    def full_disk(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(tmp_path)):
            written["n"] += len(data)
            if written["n"] > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell the export's files")
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(InputError, match="No space left on device"):
        export_run(run, tmp_path / "e", to="npy")
    assert written["n"] > 4096
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_on_a_small_tmpfs(run, tmp_path):
    """The same on a real full filesystem: a 40 KB tmpfs in a user and mount namespace (skipped where
    one cannot be made)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=40k none {mnt} || exit 77; "
        f"{sys.executable} -m geomscope export {run} --to npy --out {mnt}/e -q; "
        f"echo rc=$?; ls -A {mnt}"
    )
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    if r.returncode == 77 or "rc=" not in r.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    rc_line, *left = r.stdout.split()
    assert rc_line == "rc=2", (r.stdout, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], r.stderr
    assert left == [], left  # no temporary directory, no half-written export


def test_a_layer_exported_alone_keeps_its_index(run, tmp_path):
    """``export -l 2`` then score reported layer_02 at index 0 (its column position): plots put it
    first and ``plot --layers 0`` picked it."""
    from geomscope.score import ScoreOptions, score

    summary = export_run(run, tmp_path / "e", to="arrow", layers=["2"])
    assert summary["layer_indices"] == {"layer_02": 2}
    rep = score(tmp_path / "e", ScoreOptions(metrics=("isoscore",), jackknife_groups=0))
    assert [(e["layer"], e["index"]) for e in rep["layers"]] == [("layer_02", 2)]
    both = export_run(run, tmp_path / "e2", to="arrow", layers=["0", "2"])
    rep = score(tmp_path / "e2", ScoreOptions(metrics=("isoscore",), jackknife_groups=0))
    assert [(e["layer"], e["index"]) for e in rep["layers"]] == [("layer_00", 0), ("layer_02", 2)]
    assert both["layer_indices"] == {"layer_00": 0, "layer_02": 2}
    npy = export_run(run, tmp_path / "e3", to="npy", layers=["2"])
    assert json.loads((tmp_path / "e3" / "geomscope-export.json").read_text())["layer_indices"] == {
        "layer_02": 2
    }
    assert npy["layer_indices"] == {"layer_02": 2}


def test_columns_without_a_recorded_index_keep_their_positions(tmp_path):
    pa = pytest.importorskip("pyarrow")
    from geomscope.score import ScoreOptions, score

    x = np.random.default_rng(0).standard_normal((60, 4))
    col = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4)
    with pa.ipc.new_stream(str(tmp_path / "x.arrow"), pa.schema([("b", col.type), ("a", col.type)])) as w:
        w.write_batch(pa.record_batch([col, col], names=["b", "a"]))
    rep = score(tmp_path / "x.arrow", ScoreOptions(metrics=("isoscore",), jackknife_groups=0))
    assert [(e["layer"], e["index"]) for e in rep["layers"]] == [("b", 0), ("a", 1)]
