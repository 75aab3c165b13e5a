"""A run's manifest (store/manifest.py) read as written and refused as damaged: one that disagrees
with itself (shards listed twice, documents claimed twice, a shard missing from a complete run,
totals), layer names and widths no writer gives. Each is one `error:` line or an InputError naming
what is wrong -- never a number computed from rows counted twice; a manifest that names paths
outside the run or is structurally broken is one line for score, inspect and extract alike, and
--overwrite starts such a run over. And what the manifest says: the identity differences a resume
names, one line per shard entry in its text."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error, edit_manifest, quiet_extract
from test_store_integrity import two_shard_run

from geomscope.errors import InputError
from geomscope.score import ScoreOptions, score

OPTS = ScoreOptions(metrics=("isoscore", "avgcos"))


@pytest.fixture
def run(tmp_path):
    return two_shard_run(tmp_path / "run")


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
    """score refuses each of these as inspect --verify does: a shard listed twice (it would be
    counted twice: 8,818 rows of 7,299, the IsoScore off in the third digit), a shard dropped from a
    complete run (a complete report of the rest)."""
    edit_manifest(run, edit)
    with pytest.raises(InputError, match="manifest disagrees with itself"):
        score(run, OPTS)
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, needle, exit_code=2)
    assert not (tmp_path / "r.json").exists()
    code, _o, err = cli(["inspect", run, "--verify"])
    assert code != 0 and needle in err + _o


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
    edit_manifest(run, lambda m: m["identity"]["model"].update(hidden_size=width))
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "manifest.json is damaged", needle, exit_code=2)


@pytest.mark.parametrize("name", ["\x00", "\ud800", "x\x1b[2Jy", "a/b", ""])
def test_a_layer_name_geomscope_never_writes_is_refused(cli, run, tmp_path, name):
    """A NUL made h5py raise RuntimeError, a lone surrogate UnicodeEncodeError (tracebacks); an
    escape sequence reached the terminal; a "/" names a path inside the shard."""
    edit_manifest(run, lambda m: m["identity"]["layers"][0].update(name=name))
    code, out, err = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "manifest.json is damaged", "not a name geomscope writes")
    assert "\x1b" not in err


# ------------------------------------------------------------------ identity and manifest text


def test_identity_differences_name_the_entry():
    from geomscope.store import identity_differences

    old = {
        "layers": [{"name": "layer_00", "index": 0}, {"name": "layer_06", "index": 6}],
        "x": {"y": "a" * 200},
    }
    new = {"layers": [{"name": "layer_00", "index": 0}], "x": {"y": "b"}}
    d = identity_differences(old, new)
    assert d[0] == "layers.count: 2 in the run, 1 now"
    assert "layers.1.index: 6 in the run, '<absent>' now" in d
    assert any(x.startswith("x.y: 'aaa") and "... in the run, 'b' now" in x and len(x) < 120 for x in d)
    assert identity_differences(old, old) == []


def test_manifest_text_round_trips_one_line_per_shard(tmp_path):
    from geomscope.store.manifest import dumps_manifest

    m = {
        "format": "geomscope-run",
        "identity": {"a": [1, {"b": None}], "c": "é"},
        "shards": [],
        "totals": {},
        "complete": False,
    }
    assert json.loads(dumps_manifest(m)) == m
    m["shards"] = [{"index": i, "file": f"shard-{i:05d}.h5", "stats": {"x": {"y": i}}} for i in range(3)]
    text = dumps_manifest(m)
    assert json.loads(text) == m
    assert sum(1 for line in text.splitlines() if '"index":' in line) == 3  # one line per shard entry


# ------------------------------------------------------------------ a manifest edited by hand


def test_a_manifest_naming_paths_outside_the_run_is_refused(cli, tiny_bert, twelve_docs, tmp_path):
    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    victim = tmp_path / "victim.h5"
    victim.write_text("keep")
    m = json.loads((run / "manifest.json").read_text())
    m["shards"][0]["file"] = "../victim.h5"
    (run / "manifest.json").write_text(json.dumps(m))
    for args in (["score", run, "--quiet"], ["inspect", run]):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, "is not a shard name geomscope writes", exit_code=2)
    code, out, err = quiet_extract(
        cli, tiny_bert, twelve_docs, run
    )  # resume would trust the entries: refused
    assert_one_line_error(code, out, err, "is not a shard name geomscope writes", exit_code=2)
    code, _, err = quiet_extract(
        cli, tiny_bert, twelve_docs, run, "--overwrite"
    )  # starts over, deleting by no listed name
    assert code == 0, err
    assert victim.read_text() == "keep"


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m.pop("identity"), "no identity object"),
        (lambda m: m.__setitem__("shards", {"a": 1}), "shards is not a list"),
        (lambda m: m["shards"][0].__setitem__("rows", "many"), "shards[0].rows"),
        (lambda m: m.__setitem__("format_version", "1"), "format_version"),
        (lambda m: m["identity"].__setitem__("layers", "all"), "identity.layers"),
    ],
)
def test_structurally_broken_manifest_is_one_line_everywhere(
    cli, tiny_bert, twelve_docs, tmp_path, edit, needle
):
    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))
    for args in (
        ["score", run, "--quiet"],
        ["inspect", run],
        ["extract", tiny_bert, twelve_docs, "--out", run, "--quiet"],
    ):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, needle, exit_code=2)
    code, _, err = quiet_extract(
        cli, tiny_bert, twelve_docs, run, "--overwrite"
    )  # ours, though damaged: --overwrite starts over
    assert code == 0, err
    assert json.loads((run / "manifest.json").read_text())["complete"] is True
