"""The run format: shard writer/reader round trip, atomic publish, resume, identity, corruption."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import one_line_message

from geomscope.errors import DataError, InputError
from geomscope.store import Run, RunWriter, iter_shard, read_shard_index, verify_shard

IDENT = {
    "model": {"name": "toy", "hidden_size": 8},
    "layers": [{"name": "layer_00", "index": 0}, {"name": "layer_01", "index": 1}],
}


def _write(run_dir, n_shards=2, rows=(1000, 37), dtype="float16", ident=IDENT):
    rng = np.random.default_rng(0)
    data = {}
    with RunWriter(run_dir, ident) as w:
        for i in range(n_shards):
            sw = w.shard_writer(i, layer_names=["layer_00", "layer_01"], dim=8, store_dtype=dtype)
            r = rows[i]
            a = rng.normal(size=(r, 8)).astype(np.float32)
            b = rng.normal(size=(r, 8)).astype(np.float32)
            b[5, 3] = np.nan
            for s in range(0, r, 300):  # several appends of uneven size
                e = min(r, s + 300)
                sw.append(
                    {"layer_00": a[s:e], "layer_01": b[s:e]},
                    token_id=np.arange(s, e),
                    doc_id=np.full(e - s, i),
                    position=np.arange(e - s),
                    is_special=np.zeros(e - s, bool),
                )
            w.add_shard(sw.close())
            data[i] = (a, b)
        w.finalize({"docs": n_shards})
    return data


def test_round_trip(tmp_path):
    data = _write(tmp_path / "run")
    run = Run(tmp_path / "run")
    assert run.complete and run.total_rows == 1037 and run.layer_names == ["layer_00", "layer_01"]
    for info in run.shards:
        verify_shard(run.shard_path(info), info)
        chunks = list(iter_shard(run.shard_path(info), chunk_rows=128))
        a = np.concatenate([c.layers["layer_00"] for c in chunks])
        np.testing.assert_array_equal(a, data[info.index][0].astype(np.float16))
        nf = np.concatenate([c.nonfinite["layer_01"] for c in chunks])
        assert nf.sum() == 1 and nf[5]
        assert info.nonfinite_rows == 1
        idx = read_shard_index(run.shard_path(info))
        np.testing.assert_array_equal(idx["token_id"], np.arange(info.rows))
    assert not list((tmp_path / "run").glob(".*.tmp"))


def test_resume_keeps_shards_and_refuses_other_identity(tmp_path):
    _write(tmp_path / "run", n_shards=1, rows=(10,))
    with RunWriter(tmp_path / "run", IDENT) as w:
        assert set(w.finished) == {0}
        assert not w.manifest["complete"]
    other = json.loads(json.dumps(IDENT))
    other["model"]["name"] = "other"
    with pytest.raises(InputError, match="different options.*model.name"):
        RunWriter(tmp_path / "run", other)
    with RunWriter(tmp_path / "run", other, overwrite=True) as w:
        assert w.finished == {}
        assert not (tmp_path / "run" / "shard-00000.h5").exists()


def test_lock_refuses_second_writer(tmp_path):
    with RunWriter(tmp_path / "run", IDENT):
        with pytest.raises(InputError, match="another geomscope process"):
            RunWriter(tmp_path / "run", IDENT)


def test_unfinished_shard_is_dropped(tmp_path):
    with RunWriter(tmp_path / "run", IDENT) as w:
        sw = w.shard_writer(0, layer_names=["layer_00"], dim=8, store_dtype="float32")
        sw.append({"layer_00": np.ones((3, 8))}, [1, 2, 3], [0, 0, 0], [0, 1, 2], [False] * 3)
        # simulated crash: no close()
    assert [p.name for p in (tmp_path / "run").glob(".shard-00000.h5.*.tmp")] == [sw.tmp_path.name]
    with RunWriter(tmp_path / "run", IDENT) as w:
        assert w.finished == {}
    assert not list((tmp_path / "run").glob(".shard-*.tmp"))


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "precious.txt").write_text("keep me")
    with pytest.raises(InputError, match="not empty"):
        RunWriter(tmp_path / "d", IDENT, overwrite=True)
    assert (tmp_path / "d" / "precious.txt").read_text() == "keep me"


def test_corrupt_and_missing(tmp_path):
    _write(tmp_path / "run")
    run = Run(tmp_path / "run")
    info = run.shards[0]
    p = run.shard_path(info)
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 3])
    with pytest.raises(DataError, match="shard-00000.h5"):
        verify_shard(p, info)
    with pytest.raises(DataError, match="corrupt or truncated"):
        list(iter_shard(p))
    with pytest.raises(InputError, match="not a geomscope run"):
        Run(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        Run(tmp_path / "nope")


def test_resolve_layers(tmp_path):
    _write(tmp_path / "run", n_shards=1, rows=(6,))
    run = Run(tmp_path / "run")
    # the run's order, each layer once (a layer named twice is not exported twice)
    assert run.resolve_layers(["1", "-2", "layer_01"]) == ["layer_00", "layer_01"]
    assert run.resolve_layers(["0-1"]) == run.resolve_layers("blocks,0") == ["layer_00", "layer_01"]
    with pytest.raises(InputError, match="not in this run"):
        run.resolve_layers(["7"])


# ------------------------------------------------------------------------------ the shard log
def _shard(w, i, rows=20):
    sw = w.shard_writer(i, layer_names=["layer_00", "layer_01"], dim=8, store_dtype="float16")
    x = np.full((rows, 8), float(i), np.float32)
    sw.append(
        {"layer_00": x, "layer_01": x},
        token_id=np.arange(rows),
        doc_id=np.full(rows, i),
        position=np.arange(rows),
        is_special=np.zeros(rows, bool),
    )
    return sw.close()


def _manifest_indices(run_dir) -> list[int]:
    return [s["index"] for s in json.loads((run_dir / "manifest.json").read_text())["shards"]]


def _killed(w) -> None:
    """What SIGKILL leaves: nothing saved, the lock gone with the process."""
    w.log.close()
    os.close(w._lock_fd)
    w._lock_fd = None


def test_a_shard_is_recorded_in_the_log_without_rewriting_the_manifest(tmp_path, monkeypatch):
    from geomscope.store import manifest as mf

    monkeypatch.setattr(mf, "REWRITE_RATIO", float("inf"))  # never due: only the log records shards
    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    for i in range(4):
        w.add_shard(_shard(w, i))
    log = run / mf.part_name(0)
    assert _manifest_indices(run) == []
    assert len(log.read_text().splitlines()) == 1 + 4  # the header, then a line per shard
    assert [s.index for s in Run(run).shards] == [0, 1, 2, 3]  # a reader folds the log in
    w.release()  # a run that stopped: the manifest catches up
    assert _manifest_indices(run) == [0, 1, 2, 3]
    with RunWriter(run, IDENT) as w:  # resumed: the log is folded in and removed
        assert set(w.finished) == {0, 1, 2, 3} and not log.exists()
        w.add_shard(_shard(w, 4))
        w.finalize({})
    assert _manifest_indices(run) == [0, 1, 2, 3, 4] and not log.exists()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".geomscope")) == [".geomscope.lock"]


def test_after_a_kill_resume_keeps_every_logged_shard_and_skips_a_torn_line(tmp_path, monkeypatch):
    from geomscope.store import manifest as mf

    monkeypatch.setattr(mf, "REWRITE_RATIO", float("inf"))
    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    for i in range(3):
        w.add_shard(_shard(w, i))
    sw = _shard(w, 3)
    with open(run / mf.part_name(0), "a") as f:  # killed while recording shard 3: half a line
        f.write(json.dumps(sw.to_dict())[:40])
    _killed(w)
    assert _manifest_indices(run) == []
    assert [s.index for s in Run(run).shards] == [0, 1, 2]
    w = RunWriter(run, IDENT)
    assert set(w.finished) == {0, 1, 2}  # shard 3's file is redone, its torn line ignored
    w.add_shard(_shard(w, 3))
    _killed(w)
    # the log the resumed run started after the fold: every shard is there, shard 3's line whole
    with RunWriter(run, IDENT) as w:
        assert set(w.finished) == {0, 1, 2, 3}


def test_a_log_appended_after_a_torn_line_starts_on_a_new_line(tmp_path):
    from geomscope.store.manifest import ShardLog, read_parts

    log = ShardLog(tmp_path / ".geomscope-rank-00001.jsonl", IDENT)
    entry = {"index": 0, "file": "shard-00000.h5", "rows": 1, "docs": 1, "doc_start": 0}
    entry.update(doc_stop=1, nonfinite_rows=0, bytes=10, sha256="0" * 64)
    log.append(entry)
    log.close()
    with open(log.path, "a") as f:
        f.write('{"index": 1, "fi')  # torn
    log.append({**entry, "index": 2, "file": "shard-00002.h5"})
    log.close()
    got, files = read_parts(tmp_path, IDENT)
    assert [e["index"] for e in got] == [0, 2] and files == [log.path]
    assert read_parts(tmp_path, {"model": {"name": "another"}, "layers": []})[0] == []


def test_part_files_of_before_the_log_are_still_folded(tmp_path):
    from geomscope.store.manifest import identity_digest

    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    info = _shard(w, 1)
    old = run / ".geomscope-rank-00001.json"  # one JSON document, as geomscope wrote it before
    old.write_text(json.dumps({"identity_sha256": identity_digest(IDENT), "shards": [info.to_dict()]}))
    _killed(w)
    with RunWriter(run, IDENT) as w:
        assert set(w.finished) == {1} and not old.exists()


def test_the_manifest_is_rewritten_when_due(tmp_path, monkeypatch):
    # with a rewrite that costs nothing every shard is due at once; with REWRITE_RATIO = inf, none
    from geomscope.store import manifest as mf

    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    monkeypatch.setattr(mf, "REWRITE_RATIO", 0.0)
    w.add_shard(_shard(w, 0))
    assert _manifest_indices(run) == [0]
    monkeypatch.setattr(mf, "REWRITE_RATIO", float("inf"))
    w.add_shard(_shard(w, 1))
    assert _manifest_indices(run) == [0]
    w.update(planned_shards=2)  # any other save brings it up to date
    assert _manifest_indices(run) == [0, 1]
    w.release()


def test_overwrite_removes_the_shards_only_a_log_records(tmp_path, monkeypatch):
    from geomscope.store import manifest as mf

    monkeypatch.setattr(mf, "REWRITE_RATIO", float("inf"))
    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    w.add_shard(_shard(w, 0))
    _killed(w)
    assert _manifest_indices(run) == [] and (run / "shard-00000.h5").exists()
    other = json.loads(json.dumps(IDENT))
    other["model"]["name"] = "other"
    with RunWriter(run, other, overwrite=True) as w:
        assert w.finished == {}
    assert not (run / "shard-00000.h5").exists() and not (run / mf.part_name(0)).exists()


def test_a_reader_folds_in_every_process_log(tmp_path):
    from geomscope.store.manifest import RankWriter

    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    w.add_shard(_shard(w, 0))
    w.update(planned_shards=4)
    r1 = RankWriter(run, 1)
    r1.add_shard(_shard(r1, 1))
    r1.add_shard(_shard(r1, 3))
    assert _manifest_indices(run) == [0]
    assert [s.index for s in Run(run).shards] == [0, 1, 3]
    r1.release()
    w.fold_parts()
    assert _manifest_indices(run) == [0, 1, 3] and not list(run.glob(".geomscope-rank-*"))
    w.release()


def test_a_link_at_a_log_name_is_replaced_and_a_directory_there_refused(tmp_path):
    from geomscope.store.manifest import part_name

    run = tmp_path / "run"
    w = RunWriter(run, IDENT)
    w.add_shard(_shard(w, 0))
    w.release()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    (run / part_name(0)).unlink()  # the manifest has shard 0 (release saved it): a link in its place
    (run / part_name(0)).symlink_to(outside)
    with RunWriter(run, IDENT) as w:  # the link is removed, never written through
        w.add_shard(_shard(w, 1))
        assert not (run / part_name(0)).is_symlink()
    assert outside.read_text() == "keep\n"
    (run / part_name(2)).mkdir()
    with pytest.raises(InputError, match="not a file geomscope wrote"):
        RunWriter(run, IDENT, overwrite=True)
    assert (run / "shard-00000.h5").exists() and (run / "shard-00001.h5").exists()  # nothing removed


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "to-be-written"])
def test_a_directory_at_a_shard_name_is_refused_before_any_work(tmp_path, listed):
    """A folder where a shard goes (a listed shard's, or one still to be written): a resume would redo
    the shard and fail as it put it in place (IsADirectoryError, a traceback, the shard's work lost).
    It is refused when the run is opened, and left as it is."""
    run = tmp_path / "run"
    with RunWriter(run, IDENT) as w:
        w.add_shard(_shard(w, 0))
        w.add_shard(_shard(w, 1))
    folder = run / ("shard-00001.h5" if listed else "shard-00002.h5")
    if listed:
        folder.unlink()
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(InputError, match="is a directory, not a file geomscope wrote") as e:
            RunWriter(run, IDENT, overwrite=overwrite)
        assert str(folder) in one_line_message(e)
    assert (folder / "notes.txt").read_text() == "mine" and (run / "shard-00000.h5").is_file()
    folder.rename(tmp_path / "moved")
    RunWriter(run, IDENT).release()  # the refusal released the lock: moved away, the run resumes


def test_a_log_removed_under_a_writer_stops_it(tmp_path):
    from geomscope.store.manifest import ShardLog

    log = ShardLog(tmp_path / ".geomscope-rank-00001.jsonl", IDENT)
    entry = {"index": 0, "file": "shard-00000.h5", "rows": 1, "docs": 1, "doc_start": 0}
    entry.update(doc_stop=1, nonfinite_rows=0, bytes=10, sha256="0" * 64)
    log.append(entry)
    log.path.unlink()  # a run that took the directory over folded and removed it
    with pytest.raises(InputError, match="another geomscope run took it over"):
        log.append({**entry, "index": 1, "file": "shard-00001.h5"})
    log.close()
