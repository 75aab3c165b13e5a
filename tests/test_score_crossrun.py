"""score DIR --metrics similarity: each layer's linear CKA and RSA between runs (revisions), against
the references of test_score_similarity on the sample rebuilt from the runs' keys; similarity.json,
its figure, and what is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_runs import jackknife_se, minilm_run, run_rows
from test_score import make_run
from test_score_similarity import cka_reference, matrices, rsa_reference

from geomscope.errors import InputError
from geomscope.score import ScoreOptions
from geomscope.score.crossrun import revision_similarity
from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash, run_keys


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("revisions")
    data = [make_run(root / f"step{i}", n_shards=2, rows=120, seed=i) for i in (1, 2, 3)]
    return root, data


def test_each_layer_across_runs(runs):
    root, data = runs
    paths = [root / f"step{i}" for i in (1, 2, 3)]
    res = revision_similarity(paths, ScoreOptions(similarity_rows=100, jackknife_groups=3))
    order = np.argsort(row_hash(data[0]["keys"], 0, STREAM_ID_SAMPLE), kind="stable")[:100]
    groups = data[0]["doc"][order] % 3
    assert res["names"] == ["step1", "step2", "step3"] and res["revisions"] == ["step7"] * 3
    for layer, sec in res["layers"].items():
        samples = [d["X"][layer][order] for d in data]
        np.testing.assert_allclose(sec["cka"], matrices(samples, cka_reference), atol=1e-9)
        np.testing.assert_allclose(sec["rsa"], matrices(samples, rsa_reference), atol=1e-9)
        parts = [[s[groups != r] for s in samples] for r in range(3)]
        want = jackknife_se([cka_reference(p[0], p[2]) for p in parts])
        assert sec["cka_se"][0][2] == pytest.approx(want, rel=1e-6)
        assert sec["rows"] == 100 and sec["groups"] == 3


def test_cli_writes_similarity_json_and_its_figure(runs, cli, tmp_path):
    root, _ = runs
    code, out, err = cli(
        ["score", str(root), "-m", "similarity,isoscore", "--similarity-rows", "50", "-q", "--json"]
    )
    assert code == 0, err
    summary = json.loads(out)
    sim = json.loads((root / "similarity.json").read_text())
    assert summary["similarity"] == str(root / "similarity.json") and sim["format"] == "geomscope-similarity"
    assert set(sim["layers"]) == {"layer_00", "layer_01", "layer_02"}
    code, out, err = cli(["plot", str(root / "similarity.json"), "--out", str(tmp_path / "s.png")])
    assert code == 0 and (tmp_path / "s.png").stat().st_size > 5000, err
    code, out, err = cli(
        ["plot", str(root / "similarity.json"), "--kind", "layers", "--out", str(tmp_path / "x.png")]
    )
    assert_one_line_error(code, out, err, "--kind similarity only")
    bad = tmp_path / "bad.json"
    sim["layers"]["layer_00"]["cka"] = [[1.0]]
    bad.write_text(json.dumps(sim))
    code, out, err = cli(["plot", str(bad), "--out", str(tmp_path / "y.png")])
    assert_one_line_error(code, out, err, "damaged similarity.json")
    # a file of the user's at similarity.json is refused before anything is scored
    (root / "similarity.json").write_text("mine")
    code, out, err = cli(["score", str(root), "-m", "similarity", "-q"])
    assert_one_line_error(code, out, err, "similarity.json")
    assert (root / "similarity.json").read_text() == "mine"
    (root / "similarity.json").unlink()


def test_bundled_minilm_in_two_store_dtypes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = minilm_run(tmp_path / "a", sentences=20, layers="1,4")
    b = minilm_run(tmp_path / "b", sentences=20, layers="1,4", store_dtype="float32")
    res = revision_similarity([a, b], ScoreOptions(similarity_rows=200, jackknife_groups=2))
    for layer, sec in res["layers"].items():
        xa, meta = run_rows(a, layer)
        xb, _ = run_rows(b, layer)
        order = np.argsort(row_hash(run_keys(meta["doc_id"], meta["position"]), 0, STREAM_ID_SAMPLE))[:200]
        want = cka_reference(xa[order], xb[order])
        assert sec["cka"][0][1] == pytest.approx(want, abs=1e-10) and want > 0.9999
        assert sec["rsa"][0][1] == pytest.approx(rsa_reference(xa[order], xb[order]), abs=1e-10)


def test_runs_of_other_text_or_a_kept_sample_too_small(runs, tmp_path):
    root, _ = runs
    make_run(tmp_path / "other", n_shards=1, rows=40, doc_len=7)  # other (document, position) keys
    res = revision_similarity([root / "step1", tmp_path / "other"], ScoreOptions(similarity_rows=50))
    assert res["layers"]["layer_00"]["rows"] < 50  # only the keys both runs hold
    with pytest.raises(InputError, match="layer"):
        revision_similarity([root / "step1", root / "step2"], ScoreOptions(layers="9"))
