"""score --metrics similarity: linear CKA (Kornblith et al. 2019, in its feature-space form) and RSA
(Spearman between correlation-distance matrices: scipy's pdist and spearmanr) between every pair of
layers, on the seeded sample rebuilt here from the run's keys, on a synthetic run and on the
bundled MiniLM; the jackknife directly; a --keep sample run; the heat map and the HTML page."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_runs import jackknife_se, minilm_run, run_rows
from scipy.spatial.distance import pdist
from scipy.stats import spearmanr
from test_score import make_run

from geomscope.errors import DataError, InputError
from geomscope.metrics.similarity import cka_matrices, rsa_matrices
from geomscope.report import load_report, save_report
from geomscope.score import ScoreOptions, score
from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash, run_keys


def cka_reference(x, y):
    """||Y_c^T X_c||_F^2 / (||X_c^T X_c||_F ||Y_c^T Y_c||_F), columns centred (Kornblith et al., eq. 5)."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(yc.T @ xc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))


def rsa_reference(x, y):
    """Spearman's rho between the correlation distances of the rows, ties within 1e-12 (the rounding
    docs/metrics.md states)."""
    return spearmanr(np.round(pdist(x, "correlation"), 12), np.round(pdist(y, "correlation"), 12)).statistic


def matrices(samples, reference):
    n = len(samples)
    return np.array([[reference(samples[i], samples[j]) for j in range(n)] for i in range(n)])


def test_matrices_and_replicates_on_random_data():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(60, 5))
    samples = [base @ rng.normal(size=(5, d)) + 0.3 * rng.normal(size=(60, d)) for d in (4, 7, 3)]
    samples[2] = np.round(samples[2])  # ties in its dissimilarities
    groups = np.arange(60) % 3
    cka = cka_matrices(samples, groups, [0, 2])
    rsa = rsa_matrices(samples, groups, [0, 2])
    np.testing.assert_allclose(cka[0], matrices(samples, cka_reference), atol=1e-12)
    np.testing.assert_allclose(rsa[0], matrices(samples, rsa_reference), atol=1e-12)
    for got_cka, got_rsa, r in zip(cka[1:], rsa[1:], (0, 2), strict=True):
        part = [s[groups != r] for s in samples]
        np.testing.assert_allclose(got_cka, matrices(part, cka_reference), atol=1e-12)
        np.testing.assert_allclose(got_rsa, matrices(part, rsa_reference), atol=1e-12)
    with pytest.raises(DataError, match="same rows"):
        cka_matrices([samples[0], samples[1][:10]], groups, [])
    with pytest.raises(DataError, match="at least 4"):
        rsa_matrices([s[:3] for s in samples], groups[:3], [])


def _sample(data, layer_names, n, seed=0):
    """The first n rows by hash(doc_id, position; seed) of every layer, and their document groups."""
    order = np.argsort(row_hash(data["keys"], seed, STREAM_ID_SAMPLE), kind="stable")[:n]
    return [data["X"][name][order] for name in layer_names], data["doc"][order]


def _check(rep, samples, groups, n_groups, tol=1e-9):
    sec = rep["similarity"]
    cka = matrices(samples, cka_reference)
    rsa = matrices(samples, rsa_reference)
    np.testing.assert_allclose(sec["cka"], cka, atol=tol)
    np.testing.assert_allclose(sec["rsa"], rsa, atol=tol)
    live = sorted(set((groups % n_groups).tolist()))
    reps = [[s[groups % n_groups != r] for s in samples] for r in live]
    for i, j in ((0, 1), (1, 2)):
        want = jackknife_se([cka_reference(p[i], p[j]) for p in reps])
        assert sec["cka_se"][i][j] == pytest.approx(want, rel=1e-6, abs=1e-12)
        want = jackknife_se([rsa_reference(p[i], p[j]) for p in reps])
        assert sec["rsa_se"][i][j] == pytest.approx(want, rel=1e-6, abs=1e-12)
    for i, e in enumerate(rep["layers"]):
        if i == 0:
            assert e["cka_prev"] is None and "no layer before" in e["notes"]["cka_prev"]
        else:
            assert e["cka_prev"] == sec["cka"][i - 1][i] and e["se"]["rsa_prev"] == sec["rsa_se"][i - 1][i]
            assert "cka_prev" not in e["notes"]


def test_synthetic_run(tmp_path):
    data = make_run(tmp_path / "run", n_shards=2, rows=150)
    rep = score(tmp_path / "run", ScoreOptions(metrics="similarity", similarity_rows=120, jackknife_groups=4))
    names = [e["layer"] for e in rep["layers"]]
    samples, docs = _sample(data, names, 120)
    _check(rep, samples, docs, 4)
    assert rep["similarity"]["rows"] == 120 and list(rep)[-3:] == ["similarity", "notes", "command"]
    assert "similarity" in rep["params"]["uncertainty"]
    save_report(rep, tmp_path / "r")
    assert load_report(tmp_path / "r.json")["similarity"] == rep["similarity"]
    bad = json.loads((tmp_path / "r.json").read_text())
    bad["similarity"]["cka"] = [[1.0]]
    (tmp_path / "r.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match="similarity.cka is not a 3 x 3"):
        load_report(tmp_path / "r.json")


def test_reports_without_it_have_no_section(tmp_path):
    make_run(tmp_path / "run", n_shards=1, rows=60)
    rep = score(tmp_path / "run", ScoreOptions(metrics="isoscore"))
    assert "similarity" not in rep and "cka_prev" not in rep["layers"][0]
    one = score(tmp_path / "run", ScoreOptions(metrics="similarity", layers="1"))
    assert one["similarity"] is None and "one layer" in one["notes"]["similarity"]
    assert one["layers"][0]["cka_prev"] is None


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm_similarity")
    full = minilm_run(root, sentences=30, layers="0,3,6")
    (root / "kept").mkdir()
    return full, minilm_run(root / "kept", sentences=30, layers="0,3,6", keep="sample:40")


def test_bundled_minilm(minilm):
    full, _ = minilm
    rep = score(full, ScoreOptions(metrics="similarity", similarity_rows=250, jackknife_groups=4))
    names = [e["layer"] for e in rep["layers"]]
    rows = {n: run_rows(full, n) for n in names}
    meta = rows[names[0]][1]
    keys = run_keys(meta["doc_id"], meta["position"])
    order = np.argsort(row_hash(keys, 0, STREAM_ID_SAMPLE), kind="stable")[:250]
    _check(rep, [rows[n][0][order] for n in names], meta["doc_id"][order], 4, tol=1e-8)
    sec = rep["similarity"]
    assert sec["cka"][0][1] > sec["cka"][0][2]  # neighbouring layers are the more similar


def test_keep_sample_run_gives_the_same_section(minilm):
    full, kept = minilm
    opts = ScoreOptions(metrics="similarity", id_sample=40, similarity_rows=40, jackknife_groups=2)
    assert score(kept, opts)["similarity"] == score(full, opts)["similarity"]


def test_figure_and_page(minilm, tmp_path, cli):
    full, _ = minilm
    rep = score(full, ScoreOptions(metrics="similarity,isoscore", similarity_rows=100))
    save_report(rep, tmp_path / "r")
    code, out, err = cli(
        ["plot", str(tmp_path / "r.json"), "--kind", "similarity", "--out", str(tmp_path / "s.png")]
    )
    assert code == 0 and (tmp_path / "s.png").stat().st_size > 10_000, err
    code, out, err = cli(["report", str(tmp_path / "r.json"), "--html", str(tmp_path / "p.html")])
    page = (tmp_path / "p.html").read_text()
    assert code == 0 and "fig-similarity" in page and "CKA-1" in page, err
    plain = score(full, ScoreOptions(metrics="isoscore"))
    save_report(plain, tmp_path / "plain")
    code, out, err = cli(
        ["plot", str(tmp_path / "plain.json"), "--kind", "similarity", "--out", str(tmp_path / "x.png")]
    )
    assert code != 0 and "--metrics including similarity" in err
