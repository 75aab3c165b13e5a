"""score --metrics local (Cai et al. 2021): k-means checked as a Lloyd fixed point that finds planted
clusters, the silhouette against scipy's distances, and each cluster's IsoScore and average cosines
against numpy on the clusters' rows (the sample rebuilt from the hashes), weighted by size, with
the jackknife directly, on a synthetic run and the bundled MiniLM."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_runs import jackknife_se, minilm_run, run_rows
from scipy.spatial.distance import pdist, squareform
from test_score import make_run, ref_avgcos, ref_cov, ref_iso

from geomscope.errors import DataError, InputError
from geomscope.metrics.local import choose_k, kmeans, silhouette
from geomscope.metrics.twonn import twonn
from geomscope.score import ScoreOptions, score
from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash, run_keys


def blobs(seed=0, n=90, d=6):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, d)) * 10
    truth = np.repeat(np.arange(3), n // 3)
    return centres[truth] + rng.normal(size=(n, d)), truth


def test_kmeans_finds_planted_clusters_at_a_fixed_point():
    x, truth = blobs()
    labels, centres = kmeans(x, 3, seed=1)
    # the same partition as the truth, up to the names of the clusters
    assert len({(a, b) for a, b in zip(labels, truth, strict=True)}) == 3
    d = ((x[:, None, :] - centres[None]) ** 2).sum(axis=2)
    np.testing.assert_array_equal(labels, d.argmin(axis=1))  # every row at its nearest centre
    for c in range(3):
        np.testing.assert_allclose(centres[c], x[labels == c].mean(axis=0), atol=1e-12)
    again, _ = kmeans(x, 3, seed=1)
    np.testing.assert_array_equal(labels, again)
    assert choose_k(x, range(2, 7), seed=0)[0] == 3


def test_silhouette_against_scipy_distances():
    x, _ = blobs(seed=2, n=60)
    labels = np.arange(60) % 4
    labels[0] = 3
    d = squareform(pdist(x))
    s = []
    for i in range(60):
        own = labels == labels[i]
        if own.sum() == 1:
            s.append(0.0)
            continue
        a = d[i, own].sum() / (own.sum() - 1)
        b = min(d[i, labels == c].mean() for c in set(labels.tolist()) - {labels[i]})
        s.append((b - a) / max(a, b))
    assert silhouette(x, labels) == pytest.approx(np.mean(s), abs=1e-12)


def reference(x, labels, k, discard=0.1):
    """The size-weighted mean of each cluster's IsoScore, average cosines (as is, centred) and TwoNN."""
    out = {}
    for key, fn in (
        ("local_isoscore", lambda c: ref_iso(ref_cov(c))),
        ("local_avgcos", lambda c: ref_avgcos(c, "plain")),
        ("local_avgcos_centred", lambda c: ref_avgcos(c, "centred")),
        ("local_twonn", lambda c: twonn(c, discard_fraction=discard).dimension),
    ):
        pairs = []
        for j in range(k):
            rows = x[labels == j]
            try:
                pairs.append((len(rows), fn(rows)))
            except DataError:  # (undefined in this cluster: it does not count)
                continue
        out[key] = sum(n * v for n, v in pairs) / sum(n for n, _ in pairs)
    return out


def check(e, x, groups, k, seed=0):
    labels, _ = kmeans(x, k, seed)
    want = reference(x, labels, k)
    reps = [reference(x[groups != r], labels[groups != r], k) for r in sorted(set(groups.tolist()))]
    for key, v in want.items():
        assert e[key] == pytest.approx(v, rel=1e-8), key
        assert e["se"][key] == pytest.approx(jackknife_se([r[key] for r in reps]), rel=1e-6), key
    assert [c["n"] for c in e["local"]["clusters"]] == [int((labels == j).sum()) for j in range(k)]


def test_synthetic_run(tmp_path):
    data = make_run(tmp_path / "run", n_shards=2, rows=150)
    rep = score(tmp_path / "run", ScoreOptions(metrics="local", clusters=2, jackknife_groups=3))
    order = np.argsort(row_hash(data["keys"], 0, STREAM_ID_SAMPLE), kind="stable")
    for e in rep["layers"]:
        check(e, data["X"][e["layer"]][order], data["doc"][order] % 3, 2)
        assert e["local"]["k"] == 2 and e["local"]["silhouette"] is None


def test_bundled_minilm(tmp_path):
    run = minilm_run(tmp_path, sentences=25, layers="3")
    rep = score(run, ScoreOptions(metrics="local", clusters=3, jackknife_groups=3, id_sample=600))
    x, meta = run_rows(run, "layer_03")
    order = np.argsort(row_hash(run_keys(meta["doc_id"], meta["position"]), 0, STREAM_ID_SAMPLE))[:600]
    check(rep["layers"][0], x[order], meta["doc_id"][order] % 3, 3)
    auto = score(run, ScoreOptions(metrics="local", id_sample=600))["layers"][0]["local"]
    best = max(auto["silhouette"], key=lambda k: auto["silhouette"][k])
    assert auto["k"] == int(best) and auto["k"] in range(2, 9)
    with pytest.raises(InputError, match="--clusters"):
        ScoreOptions(clusters=1).validate()
