"""Crafted and damaged run directories beyond one shard's structure: a manifest that disagrees with
itself (shards listed twice, documents claimed twice, a shard missing from a complete run, totals,
a removed --keep), a shard whose rows belong to documents outside its entry, the stored
accumulators of a --keep sample run, a manifest that is a FIFO, a shard that is a directory, odd
layer names and widths, and a file:// URL to a run holding a link. Each is one `error:` line or a
DataError/InputError naming what is wrong -- never a number computed from rows counted twice or
from a sample taken for the whole."""

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
from conftest import assert_one_line_error
from test_hostile_shards import _lie, _run

from geomscope.errors import DataError, InputError
from geomscope.score import ScoreOptions, score
from geomscope.store.checksum import digests

OPTS = ScoreOptions(metrics=("isoscore", "avgcos"))


def _edit_manifest(run: Path, edit) -> None:
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))


@pytest.fixture
def run(tmp_path):
    return _run(tmp_path / "run")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m["shards"].append(dict(m["shards"][0])), "listed more than once"),
        (
            lambda m: m["shards"].append({**m["shards"][0], "index": 5}),
            "shard 5 is recorded as file shard-00000",
        ),
        (lambda m: m["shards"][1].update(doc_start=5), "both claim documents 5..9"),
        (lambda m: m["shards"].pop(0), "marked complete but shard(s) [0] are missing"),
        (lambda m: m["totals"].update(rows=1), "totals.rows is 1"),
        (lambda m: m["shards"][1].update(index=7), "shard 7 is recorded as file shard-00001.h5"),
    ],
)
def test_a_manifest_that_disagrees_with_itself_is_refused(cli, run, tmp_path, edit, needle):
    """Each of these was scored: a shard listed twice was counted twice (8,818 rows of 7,299; the
    IsoScore moved in the third digit), a shard dropped from a complete run gave a complete report
    of the rest. inspect --verify found them; score now refuses them the same way."""
    _edit_manifest(run, edit)
    with pytest.raises(InputError, match="manifest disagrees with itself"):
        score(run, OPTS)
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, needle, exit_code=2)
    assert not (tmp_path / "r.json").exists()
    code, _o, err = cli(["inspect", run, "--verify"])
    assert code != 0 and needle in err + _o


def test_rows_of_documents_outside_the_shards_entry_are_refused(run):
    """The entry's document range is what keeps each document in one shard: rows of another
    document (stored by a crafted shard whose entry still names its own range) are refused."""
    _edit_manifest(run, lambda m: m["shards"][1].update(doc_start=15, doc_stop=20))  # it stores 10..19
    with pytest.raises(DataError, match="documents 10..19, outside its range 15..19"):
        score(run, OPTS)


def test_shards_written_without_document_ranges_still_score(tmp_path):
    """A shard written through the library without a planned range records 0..0, no range: such
    runs (document ids restarting in each shard included) score as they did before ranges were
    checked; a run that records ranges is held to them."""
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


@pytest.mark.parametrize(
    ("width", "needle"),
    [
        ([16], "hidden_size is [16]"),
        ("16", "hidden_size is '16'"),
        (True, "hidden_size is True"),
        (0, "is 0"),
    ],
)
def test_a_width_that_is_no_positive_integer_is_refused(cli, run, tmp_path, width, needle):
    """A list or a string gave a TypeError/ValueError traceback; 0 switched the width check off; a
    string or True blamed the shards ('layer_00 is 16 wide, the run's layers 16')."""
    _edit_manifest(run, lambda m: m["identity"]["model"].update(hidden_size=width))
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "manifest.json is damaged", needle, exit_code=2)


@pytest.mark.parametrize("name", ["\x00", "\ud800", "x\x1b[2Jy", "a/b", ""])
def test_a_layer_name_geomscope_never_writes_is_refused(cli, run, tmp_path, name):
    """A NUL made h5py raise RuntimeError, a lone surrogate UnicodeEncodeError (tracebacks); an
    escape sequence reached the terminal; a "/" names a path inside the shard."""
    _edit_manifest(run, lambda m: m["identity"]["layers"][0].update(name=name))
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "manifest.json is damaged", "not a name geomscope writes")
    assert "\x1b" not in err


def test_layers_that_are_not_a_group_are_refused(run):
    _edit_shard = run / "shard-00001.h5"
    with h5py.File(_edit_shard, "a") as f:
        del f["layers"]
        f.create_dataset("layers", data=np.zeros(3))
    _lie(run)
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


# ------------------------------------------------------------ --keep sample runs' accumulators
@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    from geomscope.extract import extract
    from geomscope.model.names import bundled_minilm_dir

    assert bundled_minilm_dir().exists()
    root = tmp_path_factory.mktemp("kept")
    src = root / "in.txt"
    src.write_text("\n".join(f"Sentence number {i} is about a cat and a dog." for i in range(40)) + "\n")
    extract("bundled:minilm", [src], root / "run", keep="sample:30", shard_docs=20, layers="0,6")
    return root / "run"


def _damage_accumulator(run: Path, edit) -> None:
    """Shard 1's regular accumulator of layer_00 edited, the manifest made to match the file."""
    entry = json.loads((run / "manifest.json").read_text())["shards"][1]
    path = run / entry["file"]
    with h5py.File(path, "a") as f:
        edit(f, f["accumulators/layer_00/regular"])
    m = json.loads((run / "manifest.json").read_text())
    m["shards"][1]["bytes"] = path.stat().st_size
    m["shards"][1].update(digests(path))
    (run / "manifest.json").write_text(json.dumps(m))


def _set_attr(key, value):
    def edit(f, g):
        g.attrs[key] = value

    return edit


def _set_file_attr(key, value):
    def edit(f, g):
        f.attrs[key] = value

    return edit


def _replace(key, value):
    def edit(f, g):
        del g[key]
        g.create_dataset(key, data=value)

    return edit


def _nan_in(key):
    def edit(f, g):
        a = g[key][()]
        a[0] = np.nan
        g[key][...] = a

    return edit


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_set_attr("n", 10**15), "has n = 1000000000000000"),
        (_set_attr("n", -100), "has n = -100"),
        (_set_attr("n", "7"), "has n = 7"),
        (_set_file_attr("tokens", 5), "measured 5 rows"),
        (_nan_in("m2_upper"), "NaN or Inf in m2_upper"),
        (_replace("mean", np.zeros(3_000_000)), "mean of shape (3000000,)"),
        (_replace("mean", np.array([b"x"] * 384)), "mean of shape"),
        (_set_attr("abs_threshold", np.nan), "abs_threshold = nan"),
        (_set_file_attr("keep", "all"), "keeps every row"),
    ],
)
def test_stored_accumulators_are_checked_before_they_are_trusted(kept, tmp_path, edit, needle):
    """A crafted --keep sample shard (its checksums made to match) was scored on its word: n of 10^15
    gave 10^15 rows and NaN/Inf 'dropped' counts below zero, a NaN emptied the IsoScore, a 3-million
    value mean tried a 65 TiB allocation, a tokens attribute of 5 said -1,423 rows dropped."""
    run = tmp_path / "run"
    shutil.copytree(kept, run)
    _damage_accumulator(run, edit)
    with pytest.raises(DataError, match="is corrupt") as e:
        score(run, ScoreOptions(metrics=("isoscore", "avgcos")))
    assert needle in str(e.value) and "shard-00001.h5" in str(e.value)


def test_a_sample_run_whose_keep_was_removed_is_refused(kept, tmp_path):
    """Without identity.keep the samples were scored as whole layers: IsoScore 0.211 for 0.270."""
    run = tmp_path / "run"
    shutil.copytree(kept, run)
    _edit_manifest(run, lambda m: m["identity"].pop("keep"))
    with pytest.raises(InputError, match="records no --keep sample"):
        score(run, OPTS)


def test_the_untouched_sample_run_still_scores(kept):
    e = score(kept, OPTS)["layers"][0]
    assert e["isoscore"] is not None and e["n_rows"] > 0
