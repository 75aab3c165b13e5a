"""score --metrics contextuality (Ethayarajh 2019): self-similarity, intra-sentence similarity and
maximum explainable variance with their anisotropy baselines, against the paper's definitions
computed here pair by pair and by SVD on the draws rebuilt from the documented hashes, on a
synthetic run and on the bundled MiniLM; the jackknife directly; sources that cannot give them."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_runs import jackknife_se, minilm_run, run_rows
from test_score import make_run

from geomscope.metrics.contextuality import DocSums, TypeSample
from geomscope.score import ScoreOptions, score
from geomscope.store.sample import (
    STREAM_CONTEXT_DOCS,
    STREAM_CONTEXT_POOL,
    STREAM_CONTEXT_ROWS,
    STREAM_CONTEXT_TYPES,
    row_hash,
    run_keys,
)

KEYS = ("selfsim", "selfsim_adj", "intrasim", "intrasim_adj", "mev", "mev_adj")


def cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def selfsim(x):
    n = len(x)
    return np.mean([cos(x[i], x[j]) for i in range(n) for j in range(n) if i != j])


def mev(x):
    s = np.linalg.svd(x, compute_uv=False)
    return s[0] ** 2 / (s**2).sum()


def intrasim(y):
    mean = y.mean(axis=0)
    return np.mean([cos(v, mean) for v in y])


def avgcos_pairs(x):
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    g = u @ u.T
    return (g.sum() - np.trace(g)) / (len(u) * (len(u) - 1))


def draws(meta, o):
    """The rows each documented draw picks: types, their occurrences, sentences, the baseline's pool."""
    tokens, special = meta["token_id"], meta["is_special"].astype(bool)
    keys = run_keys(meta["doc_id"], meta["position"])
    counts = np.bincount(tokens)
    as_special = np.bincount(tokens[special], minlength=counts.size)
    eligible = np.flatnonzero((counts >= o["min"]) & (as_special == 0))
    order = np.argsort(row_hash(eligible.astype(np.uint64), 0, STREAM_CONTEXT_TYPES), kind="stable")
    types = np.sort(eligible[order][: o["types"]])
    ordinary = np.flatnonzero(~special)
    occ = {}
    for t in types:
        rows = ordinary[tokens[ordinary] == t]
        rows = rows[np.argsort(row_hash(keys[rows], 0, STREAM_CONTEXT_ROWS))][: o["occ"]]
        occ[int(t)] = rows
    docs = np.unique(meta["doc_id"][ordinary])
    docs = docs[np.argsort(row_hash(docs.astype(np.uint64), 0, STREAM_CONTEXT_DOCS))][: o["docs"]]
    pool = ordinary[np.argsort(row_hash(keys[ordinary], 0, STREAM_CONTEXT_POOL))][: 64 * o["occ"]]
    return occ, docs, pool, ordinary


def reference(x, meta, occ, docs, pool, ordinary, size, skip=None):
    group = meta["doc_id"] % 3
    out = lambda rows: rows if skip is None else rows[group[rows] != skip]  # noqa: E731
    types = {t: out(r) for t, r in occ.items()}
    types = {t: r for t, r in types.items() if len(r) >= 2}
    s = np.mean([selfsim(x[r]) for r in types.values()])
    m = np.mean([mev(x[r]) for r in types.values()])
    keep_docs = [d for d in docs if skip is None or d % 3 != skip]
    intra = np.mean([intrasim(x[ordinary[meta["doc_id"][ordinary] == d]]) for d in keep_docs])
    base = avgcos_pairs(x[out(ordinary)])
    p = out(pool)
    base_mev = np.mean([mev(x[p[i : i + size]]) for i in range(0, len(p) - size + 1, size)])
    return {
        "selfsim": s,
        "selfsim_adj": s - base,
        "intrasim": intra,
        "intrasim_adj": intra - base,
        "mev": m,
        "mev_adj": m - base_mev,
    }


def check(rep, run, o, layers):
    for e in rep["layers"]:
        if e["layer"] not in layers:
            continue
        x, meta = run_rows(run, e["layer"])
        occ, docs, pool, ordinary = draws(meta, o)
        want = reference(x, meta, occ, docs, pool, ordinary, o["occ"])
        reps = [reference(x, meta, occ, docs, pool, ordinary, o["occ"], skip=r) for r in range(3)]
        for k in KEYS:
            assert e[k] == pytest.approx(want[k], rel=1e-8, abs=1e-12), (e["layer"], k)
            assert e["se"][k] == pytest.approx(jackknife_se([r[k] for r in reps]), rel=1e-6), (e["layer"], k)
        assert e["contextuality"]["types"] == len(occ) and e["contextuality"]["sentences"] == len(docs)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm_context")
    full = minilm_run(root, sentences=30, layers="0,6")
    (root / "kept").mkdir()
    return full, minilm_run(root / "kept", sentences=30, layers="0", keep="sample:10")


def test_bundled_minilm_against_the_definitions(minilm):
    full, _ = minilm
    o = {"min": 4, "types": 12, "occ": 6, "docs": 20}
    opts = ScoreOptions(
        metrics="contextuality",
        context_min=o["min"],
        context_types=o["types"],
        context_occurrences=o["occ"],
        context_docs=o["docs"],
        jackknife_groups=3,
    )
    rep = score(full, opts)
    check(rep, full, o, ("layer_00", "layer_06"))
    p = rep["params"]["contextuality"]
    assert p["types"] == 12 and p["eligible_types"] > 12
    first, last = rep["layers"]
    assert last["selfsim"] < first["selfsim"]  # the upper layer is the more contextual (Ethayarajh)
    bins = first["contextuality"]["by_frequency"]
    assert sum(b["types"] for b in bins) == 12 and len(bins) == 4


def test_synthetic_run(tmp_path):
    make_run(tmp_path / "run", n_shards=2, rows=120, doc_len=12)  # token ids repeat across shards
    o = {"min": 2, "types": 30, "occ": 4, "docs": 8}
    opts = ScoreOptions(
        metrics="contextuality",
        context_min=2,
        context_types=30,
        context_occurrences=4,
        context_docs=8,
        jackknife_groups=3,
    )
    rep = score(tmp_path / "run", opts)
    check(rep, tmp_path / "run", o, ("layer_00", "layer_01", "layer_02"))


def test_accumulators_merge_in_any_order():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5))
    tokens = rng.integers(0, 6, 300)
    hashes = rng.permutation(300).astype(np.uint64)
    docs = np.arange(300) // 7
    groups = docs % 3
    one = TypeSample([1, 2, 3], 4).add(tokens, hashes, x, groups)
    parts = [
        TypeSample([1, 2, 3], 4).add(
            tokens[i : i + 50], hashes[i : i + 50], x[i : i + 50], groups[i : i + 50]
        )
        for i in range(0, 300, 50)
    ]
    merged = parts[4]
    for p in (parts[0], parts[5], parts[2], parts[1], parts[3]):
        merged.merge(p)
    a, b = one.occurrences(), merged.occurrences()
    assert a.keys() == b.keys() == {1, 2, 3}
    for t in a:
        np.testing.assert_array_equal(a[t][0], b[t][0])
        want = np.sort(hashes[tokens == t])[:4]
        np.testing.assert_array_equal(np.sort(hashes[np.isin(hashes, want)]), want)
    d1 = DocSums(5, 5).add(docs, row_hash(docs.astype(np.uint64), 0, 5), x, groups)
    d2 = DocSums(5, 5).add(docs[150:], row_hash(docs[150:].astype(np.uint64), 0, 5), x[150:], groups[150:])
    d2.merge(
        DocSums(5, 5).add(docs[:150], row_hash(docs[:150].astype(np.uint64), 0, 5), x[:150], groups[:150])
    )
    for (da, ga, na, sa, ua), (db, gb, nb, sb, ub) in zip(d1.documents(), d2.documents(), strict=True):
        assert (da, ga, na) == (db, gb, nb) and np.allclose(sa, sb) and np.allclose(ua, ub)
        assert na == (docs == da).sum()


def test_sources_without_rows_or_ids(minilm, tmp_path):
    _, kept = minilm
    e = score(kept, ScoreOptions(metrics="contextuality", id_sample=10))["layers"][0]
    assert e["selfsim"] is None and "--keep all" in e["notes"]["selfsim"]
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(40, 3)))
    a = score(tmp_path / "x.npy", ScoreOptions(metrics="contextuality"))["layers"][0]
    assert a["mev"] is None and "no token ids" in a["notes"]["mev"]
