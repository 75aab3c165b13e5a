"""The checks between a run's files and what is read from them (store/integrity.py, the reads of
store/reader.py and store/chunks.py) against crafted and damaged shards: `score` and
`inspect --verify` give one `error:` line naming the shard, promptly, without reading files outside
the run, following a link, waiting on a FIFO, or allocating from shapes the manifest did not
announce. Most cases rewrite the manifest's size and checksums to match the altered shard (a
manifest that lies), so the structure checks themselves, not the checksum, must catch them. A shard
whose rows belong to documents outside its entry is refused; a shard replaced while it is read is
refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error, edit_manifest

from geomscope.errors import DataError
from geomscope.score import ScoreOptions, score
from geomscope.store import RunWriter, describe_run
from geomscope.store.checksum import digests

D, ROWS = 16, 300
OPTS = ScoreOptions(metrics=("isoscore", "avgcos"))


def two_shard_run(dest: Path) -> Path:
    """Two shards of ROWS float16 rows x D, one layer, written by the store."""
    ident = {"model": {"name": "synthetic", "hidden_size": D}, "layers": [{"name": "layer_00", "index": 0}]}
    rng = np.random.default_rng(0)
    with RunWriter(dest, ident) as w:
        for s in range(2):
            sw = w.shard_writer(
                s,
                layer_names=["layer_00"],
                dim=D,
                store_dtype="float16",
                expected_rows=ROWS,
                doc_start=10 * s,
                doc_stop=10 * s + 10,
            )
            sw.append(
                {"layer_00": rng.normal(size=(ROWS, D)).astype(np.float32)},
                token_id=np.arange(ROWS),
                doc_id=s * 10 + np.arange(ROWS) // 30,
                position=np.arange(ROWS) % 30,
                is_special=np.arange(ROWS) % 30 == 0,
            )
            w.add_shard(sw.close())
        w.finalize({"docs": 20})
    return dest


def _shard(run: Path) -> Path:
    return run / json.loads((run / "manifest.json").read_text())["shards"][1]["file"]


def match_manifest_to_shard(run: Path) -> None:
    """The manifest's entry of shard 1 rewritten to match the file as it now is."""
    m = json.loads((run / "manifest.json").read_text())
    entry = m["shards"][1]
    path = run / entry["file"]
    entry["bytes"] = path.stat().st_size
    for algo, hexd in digests(path).items():
        entry[algo] = hexd
    (run / "manifest.json").write_text(json.dumps(m))


def _rewrite(run: Path, edit) -> None:
    """Shard 1 rebuilt with ``edit(f, data)`` applied: ``data`` holds its datasets' arrays, ``f`` the
    new file with its attributes; ``edit`` writes the datasets."""
    path = _shard(run)
    with h5py.File(path, "r") as old:
        attrs = dict(old.attrs)
        data = {k: old[k][()] for k in ("token_id", "doc_id", "position", "is_special")}
        data["layers/layer_00"] = old["layers/layer_00"][()]
        data["nonfinite/layer_00"] = old["nonfinite/layer_00"][()] if "nonfinite/layer_00" in old else None
    path.unlink()
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        f.create_group("layers")
        f.create_group("nonfinite")
        edit(f, data)
    match_manifest_to_shard(run)


def _plain(f, data, skip=()):
    for k, v in data.items():
        if k not in skip and v is not None:
            f.create_dataset(k, data=v)


def _fails(cli, run, *needles, out_dir=None):
    out = (out_dir or run.parent) / "report"
    code, o, e = cli(["score", run, "--out", out, "--quiet"])
    line = assert_one_line_error(code, o, e, *needles)
    assert not out.with_suffix(".json").exists()
    code, o, e = cli(["inspect", run, "--verify"])
    assert code != 0 and "Traceback" not in e, e
    return line


@pytest.fixture
def run(tmp_path):
    return two_shard_run(tmp_path / "run")


def test_the_untouched_run_scores(cli, run, tmp_path):
    code, _o, e = cli(["score", run, "--out", tmp_path / "ok", "--quiet"])
    assert code == 0, e
    assert cli(["inspect", run, "--verify"])[0] == 0


def test_data_kept_outside_the_shard_is_refused(cli, run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.bin"
    np.random.default_rng(1).normal(size=(ROWS, D)).astype(np.float16).tofile(secret)

    def external(f, data):
        _plain(f, data, skip=("layers/layer_00",))
        f.create_dataset(
            "layers/layer_00", shape=(ROWS, D), dtype=np.float16, external=[(str(secret), 0, ROWS * D * 2)]
        )

    _rewrite(run, external)
    assert "outside the shard" in _fails(cli, run, "shard-00001")


def test_links_to_other_files_are_refused(cli, run, tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as g:
        g["x"] = np.zeros((ROWS, D), np.float16)

    def linked(f, data):
        _plain(f, data, skip=("layers/layer_00",))
        f["layers/layer_00"] = h5py.ExternalLink(str(other), "x")

    _rewrite(run, linked)
    assert "link to another file" in _fails(cli, run)


def test_a_symlinked_shard_is_refused(cli, run, tmp_path):
    shard = _shard(run)
    copy = tmp_path / "elsewhere.h5"
    shard.rename(copy)
    shard.symlink_to(copy)
    assert "symbolic link" in _fails(cli, run)


def test_a_fifo_named_like_a_shard_does_not_hang(run, tmp_path):
    shard = _shard(run)
    shard.unlink()
    os.mkfifo(shard)
    m = json.loads((run / "manifest.json").read_text())
    m["shards"][1]["bytes"] = 0
    (run / "manifest.json").write_text(json.dumps(m))
    for args in (
        ["score", str(run), "--out", str(tmp_path / "r"), "--quiet"],
        ["inspect", str(run), "--verify"],
    ):
        p = subprocess.run(
            [sys.executable, "-m", "geomscope", *args], capture_output=True, text=True, timeout=120
        )
        assert p.returncode != 0 and "Traceback" not in p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and "shard-00001" in last
        assert args[0] == "inspect" or "not a regular file" in last


@pytest.mark.parametrize(
    "case, needle",
    [
        ("huge_rows", "manifest entry says 300"),
        ("huge_width", "wide"),
        ("one_dimensional_layer", "(rows, D) float array"),
        ("short_doc_id", "doc_id has 100 rows"),
        ("text_doc_id", "doc_id is not a column of integers"),
        ("short_flags", "non-finite flags"),
        ("layer_is_a_group", "not a dataset"),
    ],
)
def test_shapes_no_writer_makes_are_refused_before_anything_is_allocated(cli, run, case, needle):
    def edit(f, data):
        if case == "huge_rows":  # 2^40 rows declared, none written: a loop over fill values, or TiBs
            for k, v in data.items():
                if v is not None:
                    shape = (2**40, *v.shape[1:])
                    f.create_dataset(k, shape=shape, dtype=v.dtype, chunks=(1024, *v.shape[1:]))
        elif case == "huge_width":
            _plain(f, data, skip=("layers/layer_00",))
            f.create_dataset("layers/layer_00", shape=(ROWS, 2**27), dtype=np.float16, chunks=(1, 2**16))
        elif case == "one_dimensional_layer":
            _plain(f, data, skip=("layers/layer_00",))
            f["layers/layer_00"] = data["layers/layer_00"].ravel()[:ROWS]
        elif case == "short_doc_id":
            _plain(f, data, skip=("doc_id",))
            f["doc_id"] = data["doc_id"][:100]
        elif case == "text_doc_id":
            _plain(f, data, skip=("doc_id",))
            f["doc_id"] = data["doc_id"].astype("S8")
        elif case == "short_flags":
            _plain(f, data, skip=("nonfinite/layer_00",))
            f["nonfinite/layer_00"] = np.zeros(100, bool)
        else:
            _plain(f, data, skip=("layers/layer_00",))
            f["layers"].create_group("layer_00")

    _rewrite(run, edit)
    assert needle in _fails(cli, run, "shard-00001")


def test_a_changed_byte_is_said_as_damage_not_as_what_it_reads_as(cli, run):
    """A bit flipped in the activations (an Inf where a number was; the manifest untouched): the
    checksum speaks first, not the statistics' "rows contain NaN or Inf"."""
    shard = _shard(run)
    with h5py.File(shard, "r") as f:
        ds = f["layers/layer_00"]
        offset = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[offset : offset + 2] = np.array([np.inf], np.float16).tobytes()
    shard.write_bytes(bytes(raw))
    line = _fails(cli, run, "checksum differs")
    assert "NaN" not in line


def test_a_chunk_of_the_wrong_size_is_damage_not_a_read_of_unfilled_memory():
    """HDF5 stores every chunk of an unfiltered dataset whole; a chunk index giving another size
    (a patched file) would make h5py return memory it never filled for the rest of the chunk."""
    from types import SimpleNamespace

    from geomscope.store.chunks import chunk_spans

    def info(coord):
        return SimpleNamespace(byte_offset=4096, filter_mask=0, size=100 if coord[0] == 8 else 8 * D * 2)

    ds = SimpleNamespace(chunks=(8, D), shape=(ROWS, D), dtype=np.dtype(np.float16))
    ds.id = SimpleNamespace(get_chunk_info_by_coord=info)
    assert chunk_spans(ds, 0, 8) == [(4096, 8 * D * 2)]
    with pytest.raises(ValueError, match="holds 100 bytes"):
        chunk_spans(ds, 0, 16)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_unflagged_nan_rows_name_the_shard_and_the_layer(cli, run, workers):
    """A NaN that the shard's non-finite flags do not mark (the file changed after extract, its manifest
    rewritten to match): the error names the shard and the layer and says to redo the shard, in the
    scorer's own threads and in worker processes alike, not the statistics' "rows of X"."""

    def nan_unflagged(f, data):
        data["layers/layer_00"][[7, 250]] = np.nan
        data["nonfinite/layer_00"] = np.zeros(ROWS, bool)
        _plain(f, data)

    _rewrite(run, nan_unflagged)
    out = run.parent / "report"
    code, o, e = cli(
        ["score", run, "--metrics", "isoscore,avgcos", "--workers", workers, "--out", out, "--quiet"]
    )
    line = assert_one_line_error(code, o, e, "shard-00001", "layer_00", "2 of 300 rows", "rerun")
    assert "rows of X" not in line and not out.with_suffix(".json").exists()


def test_verify_refuses_the_unflagged_nan_rows_that_score_refuses(cli, run):
    """inspect --verify holds a shard to what score does (integrity.check_shard, the rows streamed):
    it passed a shard whose unflagged NaN rows stop score."""

    def nan_unflagged(f, data):
        data["layers/layer_00"][[7, 250]] = np.nan
        data["nonfinite/layer_00"] = np.zeros(ROWS, bool)
        _plain(f, data)

    _rewrite(run, nan_unflagged)
    code, out, err = cli(["inspect", run, "--verify"])
    assert_one_line_error(code, None, err, "shard-00001.h5")
    bad = describe_run(run, verify=True)["verify"]["bad"]
    assert [b["file"] for b in bad] == ["shard-00001.h5"]
    assert "2 of 300 rows of layer layer_00 hold NaN or Inf" in bad[0]["error"]


def test_a_shard_without_its_non_finite_flags_scores_as_verify_passes_it(cli, run):
    """A shard with no ``nonfinite`` group is read as one whose layers have no flags (the rows found
    from the values): score read it as corrupt while inspect --verify passed it."""
    clean = score(run, OPTS)["layers"]
    with h5py.File(_shard(run), "r+") as f:
        del f["nonfinite"]
    match_manifest_to_shard(run)
    assert cli(["inspect", run, "--verify"])[0] == 0
    assert score(run, OPTS)["layers"] == clean


def test_unflagged_nan_rows_named_whichever_block_of_a_stream_holds_them():
    """The scorer's threads merge blocks after later ones were queued: the error names the shard and
    layer of the block that holds the rows, not of the last one queued."""
    import tempfile

    from geomscope.score.accumulate import PassSpec, run_tasks
    from geomscope.store.blocks import Task

    with tempfile.TemporaryDirectory() as tmp:
        run = two_shard_run(Path(tmp) / "run")

        def nan_unflagged(f, data):
            data["layers/layer_00"][ROWS - 1] = np.inf  # in its last block
            data["nonfinite/layer_00"] = np.zeros(ROWS, bool)
            _plain(f, data)

        _rewrite(run, nan_unflagged)
        m = json.loads((run / "manifest.json").read_text())["shards"]
        tasks = [
            Task("shard", str(run / e["file"]), i, rows=e["rows"], nbytes=e["bytes"], dim=D)
            for i, e in enumerate(m)
        ]
        clean = tasks[0]
        # the damaged shard first, then clean ones whose blocks are queued before its last is merged
        for threads in (1, 2):
            spec = PassSpec("moments", ["layer_00"], n_groups=2, block_rows=64, threads=threads)
            with pytest.raises(Exception) as err:
                run_tasks([tasks[1], clean, clean], spec)
            assert "shard-00001" in str(err.value) and "layer layer_00" in str(err.value), str(err.value)
            assert f"1 of {ROWS % 64} rows" in str(err.value)


@pytest.mark.parametrize("when", ["after_its_checksum_began", "between_passes", "mtime_touched"])
def test_a_shard_replaced_while_it_is_scored_is_refused(run, tmp_path, monkeypatch, when):
    """Shard 1 replaced by another well-formed shard of the same size (shard 0's bytes; the manifest's
    size check passes) while `score` runs: after its checksum began on the file as planned, or between
    the moment pass and the unit-vector pass; or changed in place (its modification time). Reading
    on would mix two files' rows under one checksum; every open is held to the file as planned."""
    from geomscope.score import ScoreOptions, score
    from geomscope.store import integrity

    shard, other = _shard(run), run / "shard-00000.h5"
    assert shard.stat().st_size == other.stat().st_size
    real = integrity.check_shard_file
    checks = []

    def replace_shard_1():
        if when == "mtime_touched":
            st = shard.stat()
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        else:
            spare = tmp_path / "spare.h5"
            spare.write_bytes(other.read_bytes())
            os.replace(spare, shard)

    def check(task, *, checksum):
        if task.index == 1:
            checks.append(checksum)
            if when != "after_its_checksum_began" and len(checks) == 2:
                replace_shard_1()
        checked = real(task, checksum=checksum)
        if task.index == 1 and when == "after_its_checksum_began" and len(checks) == 1:
            replace_shard_1()
        return checked

    monkeypatch.setattr(integrity, "check_shard_file", check)
    opts = ScoreOptions(metrics=("isoscore", "avgcos"), verify=True, workers=1)
    with pytest.raises(DataError, match=r"shard-00001\.h5 was replaced or changed while geomscope read it"):
        score(str(run), opts)
    assert len(checks) >= (1 if when == "after_its_checksum_began" else 2)


def test_a_run_left_alone_scores_with_every_open_checked(run, tmp_path):
    """The same checks pass on a run nobody touches, in processes too (the identity travels in the
    task), and the numbers are those of an unchecked read."""
    from geomscope.score import ScoreOptions, score

    a = score(str(run), ScoreOptions(metrics=("isoscore", "avgcos"), verify=True, workers=1))
    b = score(str(run), ScoreOptions(metrics=("isoscore", "avgcos"), verify=True, workers=2))
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        for key in ("isoscore", "avgcos", "avgcos_centred", "avgcos_standardised"):
            assert la[key] == pytest.approx(lb[key], rel=1e-12, abs=1e-15), key


def test_rows_of_documents_outside_the_shards_entry_are_refused(run):
    """The entry's document range is what keeps each document in one shard: rows of another
    document (stored by a crafted shard whose entry still names its own range) are refused."""
    edit_manifest(run, lambda m: m["shards"][1].update(doc_start=15, doc_stop=20))  # it stores 10..19
    with pytest.raises(DataError, match="documents 10..19, outside its range 15..19"):
        score(run, OPTS)


def test_shards_written_without_document_ranges_still_score(tmp_path):
    """A shard written through the library without a planned range records 0..0, no range: such
    runs (document ids restarting in each shard included) score without a range check; a run that
    records ranges is held to them."""
    from geomscope.store import RunWriter

    ident = {"model": {"name": "t", "hidden_size": 4}, "layers": [{"name": "layer_00", "index": 0}]}
    rng = np.random.default_rng(0)
    with RunWriter(tmp_path / "r", ident) as w:
        for s in range(2):
            sw = w.shard_writer(s, layer_names=["layer_00"], dim=4, store_dtype="float32")
            sw.append(
                {"layer_00": rng.normal(size=(6, 4)).astype(np.float32)},
                token_id=np.arange(6),
                doc_id=np.array([0, 0, 1, 1, 2, 2]),  # restarting at 0 in each shard
                position=np.arange(6) % 2,
                is_special=np.zeros(6, bool),
            )
            info = sw.close()
            assert info.documents is None
            w.add_shard(info)
        w.finalize({"docs": 6})
    assert score(tmp_path / "r", OPTS)["layers"][0]["n_rows"] == 12


def test_a_manifest_that_is_a_fifo_does_not_hang(run, tmp_path):
    """open() of a FIFO waits for a writer: score (and a directory of runs) hung until killed."""
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    code = (
        "import sys\nfrom geomscope.score import score, ScoreOptions\n"
        "try:\n    score(sys.argv[1], ScoreOptions(metrics=('isoscore',)))\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60)
    assert "not a regular file" in out.stdout, out.stdout + out.stderr


def test_a_shard_that_is_a_directory_is_refused(cli, run, tmp_path):
    """os.open of a directory succeeds; wrapping it in a file raised IsADirectoryError (a traceback)."""
    shard = run / "shard-00001.h5"
    shard.unlink()
    shard.mkdir()
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "shard-00001.h5", "not a regular file")


def test_layers_that_are_not_a_group_are_refused(run):
    _edit_shard = run / "shard-00001.h5"
    with h5py.File(_edit_shard, "a") as f:
        del f["layers"]
        f.create_dataset("layers", data=np.zeros(3))
    match_manifest_to_shard(run)
    with pytest.raises(DataError, match="shard-00001.h5 is corrupt.*layers are not a group"):
        score(run, OPTS)


def test_a_file_url_to_a_run_holding_a_link_is_refused(run, tmp_path):
    """The path refused a shard that is a symbolic link; the same run as file:// read through it."""
    shard = run / "shard-00001.h5"
    outside = tmp_path / "outside.h5"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    with pytest.raises(DataError, match="symbolic link"):
        score(f"file://{run}", OPTS)


def _index_edited(field: str, row: int, value: int):
    """A _rewrite edit that sets ``field`` of shard 1's row ``row`` to ``value``."""

    def edit(f, data):
        data[field][row] = value
        _plain(f, data)

    return edit


def _refused_everywhere(cli, run, tmp_path, *needles):
    """score, export and inspect --verify each refuse the run in one line naming shard 1 and
    ``needles``; nothing is written."""
    _fails(cli, run, "shard-00001.h5", *needles, out_dir=tmp_path)
    code, o, e = cli(["export", run, "--to", "npy", "--out", tmp_path / "exported", "--quiet"])
    assert_one_line_error(code, o, e, "shard-00001.h5", *needles)
    assert not (tmp_path / "exported").exists()
    bad = describe_run(run, verify=True)["verify"]["bad"]
    assert [b["file"] for b in bad] == ["shard-00001.h5"] and all(n in bad[0]["error"] for n in needles)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("position", -1, "position -1"),
        ("position", 1 << 24, f"position {1 << 24}"),
        ("token_id", -5, "token id -5"),
    ],
)
def test_positions_and_token_ids_no_writer_makes_are_refused(cli, run, tmp_path, field, value, needle):
    """A row's position keys its sample hash (doc_id << 24 | position): a negative one, or one of 2^24
    or more, is another document's key; a token id is never negative. A crafted shard whose manifest
    matches it scored such rows without a word."""
    _rewrite(run, _index_edited(field, 40, value))
    _refused_everywhere(cli, run, tmp_path, needle)


def test_positions_beyond_the_runs_max_length_are_refused(cli, run, tmp_path):
    """A run truncated to max_length tokens stores positions below it."""
    edit_manifest(run, lambda m: m["identity"].update(max_length=30, truncation=True))
    assert score(run, OPTS)["layers"][0]["n_rows"] == 2 * ROWS  # positions 0..29: every one kept
    _rewrite(run, _index_edited("position", 3, 30))
    _refused_everywhere(cli, run, tmp_path, "position 30", "max_length 30")


def test_token_ids_outside_the_models_vocabulary_are_refused(cli, run, tmp_path):
    """The manifest records the tokenizer's vocabulary size: a token id at or beyond it is no token
    of the model."""
    edit_manifest(run, lambda m: m.update(vocab_size=ROWS))  # the shards hold ids 0..ROWS - 1
    assert score(run, OPTS)["layers"][0]["n_rows"] == 2 * ROWS
    _rewrite(run, _index_edited("token_id", 3, ROWS))
    _refused_everywhere(cli, run, tmp_path, f"token id {ROWS}", f"vocabulary of {ROWS}")


def test_a_vocabulary_size_no_writer_makes_is_refused(run):
    for bad in (0, -3, "many", 2.5, True):
        edit_manifest(run, lambda m, bad=bad: m.update(vocab_size=bad))
        with pytest.raises(Exception, match="vocab_size"):
            score(run, OPTS)


def test_flags_on_finite_rows_are_refused_not_dropped(cli, run, tmp_path):
    """The store flags exactly the rows that hold NaN or Inf; readers drop the flagged rows. A flag
    on a finite row dropped it from every score without a word."""

    def flag_finite(f, data):
        data["nonfinite/layer_00"][[3, 200]] = True
        _plain(f, data)

    _rewrite(run, flag_finite)
    _refused_everywhere(cli, run, tmp_path, "layer_00", "mark 2 of 300 rows", "no NaN or Inf")


def test_export_refuses_unflagged_nan_rows_as_score_does(cli, run, tmp_path):
    """export copied rows holding NaN that the flags do not mark; score refuses them."""

    def nan_unflagged(f, data):
        data["layers/layer_00"][[7, 250]] = np.nan
        data["nonfinite/layer_00"] = np.zeros(ROWS, bool)
        _plain(f, data)

    _rewrite(run, nan_unflagged)
    for to in ("npy", "arrow"):
        code, o, e = cli(["export", run, "--to", to, "--out", tmp_path / to, "--quiet"])
        assert_one_line_error(code, o, e, "shard-00001.h5", "2 of 300 rows of layer layer_00", "NaN")
        assert not (tmp_path / to).exists()
