"""``geomscope export`` (geomscope/export.py): a run's rows written as .npy files or an Arrow dataset,
equal to the stored rows, and scored from the Arrow dataset as the run scores; never over a
directory that holds anything, never through a link, never from an unfinished run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import make_tiny_run

from geomscope.score import ScoreOptions, score


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("export"), "bert", shard_docs=3, store_dtype="float32")


@pytest.mark.parametrize("to", ["npy", "arrow"])
def test_export_round_trips_the_rows(run, tmp_path, cli, to):
    from geomscope.store import Run, iter_shard

    code, out, err = cli(["export", run, "--to", to, "--out", tmp_path / "e", "-q", "--json"])
    assert code == 0, err
    summary = json.loads(out)
    r = Run(run)
    want = {n: [] for n in ("doc_id", "position", "token_id", "special", *r.layer_names)}
    for s in sorted(r.shards, key=lambda s: s.index):
        for ch in iter_shard(r.shard_path(s), r.layer_names):
            want["doc_id"].append(ch.doc_id)
            want["position"].append(ch.position)
            want["token_id"].append(ch.token_id)
            want["special"].append(ch.is_special)
            for n in r.layer_names:
                want[n].append(ch.layers[n])
    want = {k: np.concatenate(v) for k, v in want.items()}
    assert summary["rows"] == len(want["doc_id"]) and summary["layers"] == r.layer_names
    if to == "npy":
        got = {k: np.load(tmp_path / "e" / f"{k}.npy", allow_pickle=False) for k in want}
    else:
        datasets = pytest.importorskip("datasets")
        ds = datasets.load_from_disk(str(tmp_path / "e")).with_format("numpy")
        got = {k: np.asarray(ds[k]) for k in want}
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_scoring_an_arrow_export_equals_scoring_the_run(run, tmp_path):
    from geomscope.export import export_run

    export_run(run, tmp_path / "e", to="arrow")
    opts = dict(metrics=("isoscore", "isoscore_star", "avgcos", "spectrum"), jackknife_groups=3)
    a = score(run, ScoreOptions(**opts, exclude_special=True))
    b = score(tmp_path / "e", ScoreOptions(**opts, exclude_special=True))
    assert "document groups" in b["params"]["uncertainty"]["moments"]
    assert [e["layer"] for e in a["layers"]] == [e["layer"] for e in b["layers"]]
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        assert ea["n_rows"] == eb["n_rows"] and ea["dropped"] == eb["dropped"]
        for k in ("isoscore", "isoscore_star", "avgcos", "pr"):
            assert eb[k] == pytest.approx(ea[k], rel=1e-12, abs=1e-14), k
            assert eb["se"][k] == pytest.approx(ea["se"][k], rel=1e-9, abs=1e-14), k


def test_export_never_overwrites_and_needs_a_finished_run(run, tmp_path, cli):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, out, err = cli(["export", run, "--to", "npy", "--out", tmp_path / "full", "-q"])
    assert_one_line_error(code, out, err, "not an empty directory", exit_code=2)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temporaries left
    (tmp_path / "empty").mkdir()
    code, out, err = cli(["export", run, "--to", "npy", "--out", tmp_path / "empty", "-q", "-l", "0"])
    assert code == 0, err
    assert (tmp_path / "empty" / "layer_00.npy").exists() or any((tmp_path / "empty").glob("*.npy"))
    code, out, err = cli(["export", tmp_path / "full", "--to", "npy", "--out", tmp_path / "x", "-q"])
    assert_one_line_error(code, out, err, exit_code=2)


def test_export_refuses_a_link_as_out(run, tmp_path, cli):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    code, out, err = cli(["export", run, "--to", "npy", "--out", tmp_path / "link", "-q"])
    assert_one_line_error(code, out, err, "is a link (to", str(tmp_path / "real"), exit_code=2)
    assert list((tmp_path / "real").iterdir()) == []
