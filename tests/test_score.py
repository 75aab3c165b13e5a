"""geomscope.score (library): every number against a direct numpy computation on the concatenated rows.

Synthetic runs are written with the store's RunWriter/ShardWriter (known rows, doc ids, special
flags); the references below never touch geomscope.score.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from geomscope.errors import DataError, GeomscopeError, InputError
from geomscope.metrics import isoscore_published
from geomscope.metrics.twonn import twonn
from geomscope.score import ScoreOptions, score
from geomscope.store import Run, RunWriter
from geomscope.store.sample import STREAM_ID_SAMPLE, STREAM_MAX_ROWS, row_hash, run_keys

LAYERS = ("layer_00", "layer_01", "layer_02")
D = 16
TOL = 1e-8


# ------------------------------------------------------------------------------ synthetic runs
def make_run(
    run_dir,
    n_shards=3,
    rows=400,
    dim=D,
    layers=LAYERS,
    dtype="float32",
    seed=0,
    nan_rows=None,
    finalize=True,
    doc_len=20,
    dup_rows=0,
    model_name="toy",
):
    """Write a run; return {"X": {layer: (N, D) float64 of the stored values}, "doc", "special", "keys"}.

    Layer i: normal rows scaled per dimension (dimension 3 of layer_01 x6: a variance outlier), offset i.
    ``nan_rows``: {layer: [global row numbers]} set to NaN. ``dup_rows``: that many rows of every shard
    repeat row 0 of the shard (exact duplicates for TwoNN).
    """
    rng = np.random.default_rng(seed)
    ident = {
        "model": {"name": model_name, "hidden_size": dim, "revision": "step7"},
        "layers": [{"name": n, "index": i} for i, n in enumerate(layers)],
    }
    X = {n: [] for n in layers}
    docs, special, keys = [], [], []
    doc = 0
    g0 = 0
    with RunWriter(run_dir, ident) as w:
        for s in range(n_shards):
            sw = w.shard_writer(s, layer_names=list(layers), dim=dim, store_dtype=dtype)
            lay = {}
            for i, n in enumerate(layers):
                scale = np.linspace(0.3, 2.0, dim)
                if i == 1:
                    scale[3] = 12.0
                a = rng.normal(size=(rows, dim)) * scale + i + 0.5 * rng.normal(size=dim)
                if dup_rows:
                    a[1 : 1 + dup_rows] = a[0]
                for r in (nan_rows or {}).get(n, []):
                    if g0 <= r < g0 + rows:
                        a[r - g0, r % dim] = np.nan
                lay[n] = a.astype(np.float32)
            d = doc + np.arange(rows) // doc_len
            pos = np.arange(rows) % doc_len
            sp = pos == 0
            for a0 in range(0, rows, 150):  # uneven appends
                b0 = min(rows, a0 + 150)
                sw.append(
                    {n: lay[n][a0:b0] for n in layers},
                    token_id=np.arange(a0, b0),
                    doc_id=d[a0:b0],
                    position=pos[a0:b0],
                    is_special=sp[a0:b0],
                )
            w.add_shard(sw.close())
            for n in layers:
                X[n].append(lay[n].astype(dtype).astype(np.float64))
            docs.append(d)
            special.append(sp)
            keys.append(run_keys(d, pos))
            doc = int(d.max()) + 1
            g0 += rows
        if finalize:
            w.finalize({"docs": doc})
    return {
        "X": {n: np.concatenate(v) for n, v in X.items()},
        "doc": np.concatenate(docs),
        "special": np.concatenate(special),
        "keys": np.concatenate(keys),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("score") / "run"
    data = make_run(d)
    return d, data


# ------------------------------------------------------------------------------ references
def ref_cov(X):
    return np.cov(X.T, ddof=1)


def ref_iso(C):
    d = C.shape[0]
    return (np.trace(C) ** 2 / np.sum(C * C) - 1) / (d - 1)


def ref_star(C, zeta, C0=None):
    d = C.shape[0]
    C0 = np.eye(d) * np.trace(C) / d if C0 is None else C0
    return ref_iso((1 - zeta) * C + zeta * C0)


def ref_avgcos(X, variant):
    if variant == "centred":
        X = X - X.mean(0)
    elif variant == "standardised":
        X = (X - X.mean(0)) / X.std(0, ddof=1)
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    G = U @ U.T
    n = len(X)
    return (G.sum() - np.trace(G)) / (n * (n - 1))


def ref_spectrum(C):
    lam = np.sort(np.linalg.eigvalsh(C))[::-1]
    lam = np.clip(lam, 0, None)
    p = lam / lam.sum()
    pp = p[p > 0]
    return {
        "eigenvalues": lam,
        "pr": lam.sum() ** 2 / (lam**2).sum(),
        "erank": np.exp(-(pp * np.log(pp)).sum()),
        "top1_share": p[:1].sum(),
        "top5_share": p[:5].sum(),
        "top10_share": p[:10].sum(),
    }


def ref_all(X, zeta=0.2):
    C = ref_cov(X)
    out = {
        "isoscore": ref_iso(C),
        "isoscore_star": ref_star(C, zeta),
        "avgcos": ref_avgcos(X, "plain"),
        "avgcos_centred": ref_avgcos(X, "centred"),
        "avgcos_standardised": ref_avgcos(X, "standardised"),
    }
    sp = ref_spectrum(C)
    out.update({k: sp[k] for k in ("pr", "erank", "top1_share", "top5_share", "top10_share")})
    return out


from geomscope.schema import SCALAR_METRICS  # noqa: E402

#: the moment-based scalar metrics (every schema scalar except the nearest-neighbour TwoNN)
SCALARS = tuple(m.name for m in SCALAR_METRICS if m.group != "twonn")
MOMENTS_ONLY = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers")


def _close(a, b, tol=TOL):
    assert a == pytest.approx(b, rel=tol, abs=tol)


# ------------------------------------------------------------------------------ tests
def test_matches_numpy_every_moment_metric(run):
    d, data = run
    rep = score(d, ScoreOptions(metrics=MOMENTS_ONLY))
    assert [e["layer"] for e in rep["layers"]] == list(LAYERS)
    for e in rep["layers"]:
        X = data["X"][e["layer"]]
        assert e["n_rows"] == len(X) == 1200
        ref = ref_all(X)
        for k in SCALARS:
            _close(e[k], ref[k])
        # the published algorithm (SVD) from the metrics library, as a second reference
        _close(e["isoscore"], isoscore_published(X))
        np.testing.assert_allclose(
            e["eigenvalues"], ref_spectrum(ref_cov(X))["eigenvalues"], rtol=1e-8, atol=1e-10
        )
        var = X.var(0, ddof=1)
        want = [int(i) for i in np.argsort(-var) if var[i] >= 5 * var.mean()]
        assert e["outliers"] == want
        np.testing.assert_allclose(e["outlier_statistic"], var, rtol=1e-10)
    assert rep["layers"][1]["outliers"] == [3]
    assert rep["layers"][1]["outlier_support"] == [1.0]


def test_jackknife_se_matches_direct_jackknife(run):
    d, data = run
    rep = score(d, ScoreOptions(metrics=MOMENTS_ONLY, jackknife_groups=10))
    groups = data["doc"] % 10
    for e in rep["layers"]:
        X = data["X"][e["layer"]]
        reps = {k: [] for k in SCALARS}
        for r in range(10):
            ref = ref_all(X[groups != r])
            for k in SCALARS:
                reps[k].append(ref[k])
        for k in SCALARS:
            a = np.array(reps[k])
            se = np.sqrt(9 / 10 * ((a - a.mean()) ** 2).sum())
            _close(e["se"][k], se, 1e-6)
            assert e["se"][k] > 0
    assert "jackknife over 10 document groups" in rep["params"]["uncertainty"]["moments"]


@pytest.mark.parametrize("standardise", [False, True])
def test_multi_unit_sum_equals_one_unitsum_per_replicate(standardise):
    from geomscope.metrics import UnitSum
    from geomscope.score.multiunit import MultiUnitSum

    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 6)) * [1, 2, 0.5, 3, 1, 1] + 5.0
    X[:, 4] = 7.0  # a constant dimension (scale 0: it adds exactly 0, as inf does)
    g = rng.integers(0, 4, 500)
    R = 5
    shifts = X.mean(0) + rng.normal(scale=0.05, size=(R, 6))
    scales = X.std(0, ddof=1) * rng.uniform(0.9, 1.1, size=(R, 6)) if standardise else None
    X[10] = shifts[2]  # a row equal to replicate 2's shift: zero norm there
    if standardise:
        scales[:, 4] = 0.0
    mus = MultiUnitSum(shifts, scales)
    for a in range(0, 500, 130):  # several updates, merged
        mus.merge(MultiUnitSum(shifts, scales).update(X[a : a + 130], g[a : a + 130]))
    for r in range(R):
        rows = X[g != r] if r < R - 1 else X
        u = UnitSum(shifts[r], None if scales is None else scales[r]).update(rows)
        np.testing.assert_allclose(mus.sum_unit[r], u.sum_unit, rtol=1e-10, atol=1e-10)
        assert mus.n[r] == u.n and mus.n_zero_norm[r] == u.n_zero_norm
    assert mus.n_zero_norm[2] == (1 if g[10] != 2 else 0)


def test_workers_two_equals_one(run):
    d, _ = run
    opts = dict(
        metrics=("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers", "twonn"),
        id_sample=300,
        max_rows=900,
    )
    a = score(d, ScoreOptions(workers=1, **opts))
    b = score(d, ScoreOptions(workers=2, **opts))
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        for k in (*SCALARS, "twonn"):
            _close(ea[k], eb[k], 1e-12)
            _close(ea["se"][k], eb["se"][k], 1e-9)
        assert ea["n_rows"] == eb["n_rows"] == 900
        assert ea["outliers"] == eb["outliers"]
    assert b["params"]["workers"] == 2


def test_max_rows_is_a_seeded_bottom_k_sample(run):
    d, data = run
    a = score(
        d, ScoreOptions(metrics=("isoscore", "avgcos"), avgcos_variants=("plain",), max_rows=500, seed=3)
    )
    b = score(
        d,
        ScoreOptions(
            metrics=("isoscore", "avgcos"), avgcos_variants=("plain",), max_rows=500, seed=3, block_rows=64
        ),
    )
    c = score(
        d, ScoreOptions(metrics=("isoscore", "avgcos"), avgcos_variants=("plain",), max_rows=500, seed=4)
    )
    h = row_hash(data["keys"], 3, STREAM_MAX_ROWS)
    pick = np.sort(np.argsort(h)[:500])
    for ea, eb, ec in zip(a["layers"], b["layers"], c["layers"], strict=True):
        X = data["X"][ea["layer"]][pick]
        assert ea["n_rows"] == 500 and ea["dropped"]["not_sampled"] == 700
        _close(ea["isoscore"], ref_iso(ref_cov(X)))
        _close(ea["avgcos"], ref_avgcos(X, "plain"))
        _close(ea["isoscore"], eb["isoscore"], 1e-12)  # same rows, whatever the block size
        assert ea["isoscore"] != ec["isoscore"]  # another seed, another sample
    assert a["params"]["max_rows"] == 500 and a["params"]["seed"] == 3


def test_nonfinite_rows_dropped_and_counted(tmp_path):
    data = make_run(tmp_path / "r", nan_rows={"layer_01": [5, 17, 401, 1100]})
    rep = score(tmp_path / "r", ScoreOptions(metrics=("isoscore", "avgcos"), jackknife_groups=0))
    e0, e1 = rep["layers"][0], rep["layers"][1]
    assert e0["n_rows"] == 1200 and e0["dropped"]["nonfinite"] == 0
    assert e1["n_rows"] == 1196 and e1["dropped"]["nonfinite"] == 4
    assert "nonfinite_rows_dropped" in e1["flags"]
    X = data["X"]["layer_01"]
    X = X[np.isfinite(X).all(1)]
    ref = ref_all(X)
    for k in ("isoscore", "avgcos", "avgcos_centred", "avgcos_standardised"):
        _close(e1[k], ref[k])
    assert set(e1["se"]) == {"isoscore", "avgcos", "avgcos_centred", "avgcos_standardised"}
    assert not any(e1["se"].values()) and "jackknife off" in e1["notes"]["se"]


def test_exclude_special(run):
    d, data = run
    rep = score(d, ScoreOptions(metrics=("isoscore", "avgcos"), exclude_special=True))
    keep = ~data["special"]
    for e in rep["layers"]:
        X = data["X"][e["layer"]][keep]
        assert e["n_rows"] == keep.sum() and e["dropped"]["special"] == (~keep).sum()
        ref = ref_all(X)
        for k in ("isoscore", "avgcos", "avgcos_centred", "avgcos_standardised"):
            _close(e[k], ref[k])
    assert rep["params"]["exclude_special"] is True


def test_float16_store(tmp_path):
    data = make_run(tmp_path / "r", dtype="float16", n_shards=2)
    rep = score(tmp_path / "r", ScoreOptions(metrics=MOMENTS_ONLY))
    for e in rep["layers"]:
        ref = ref_all(data["X"][e["layer"]])
        for k in SCALARS:
            _close(e[k], ref[k])


def test_twonn_on_seeded_sample_with_duplicates(tmp_path):
    data = make_run(tmp_path / "r", dup_rows=30, n_shards=2)
    opts = ScoreOptions(metrics=("twonn",), id_sample=600, seed=1)
    rep = score(tmp_path / "r", opts)
    h = row_hash(data["keys"], 1, STREAM_ID_SAMPLE)
    order = np.argsort(h)[:600]  # the sample, sorted by hash
    for e in rep["layers"]:
        S = data["X"][e["layer"]][order].astype(np.float32)
        ref = twonn(S, discard_fraction=0.1, estimator="linear", dedup=True)
        _close(e["twonn"], ref.dimension, 1e-9)
        assert e["twonn_duplicates_removed"] == ref.n_duplicates_removed > 0
        assert e["twonn_n_used"] == ref.n_used
        assert e["se"]["twonn"] > 0
        assert rep["params"]["duplicates_removed"][e["layer"]] == ref.n_duplicates_removed
    assert "decimation" in rep["params"]["uncertainty"]["twonn"]
    assert "moments" not in rep["params"]["uncertainty"]


def test_more_id_estimators(run):
    from geomscope.metrics.intrinsic import estimate_id
    from geomscope.schema import LAYER_KEYS

    d, data = run
    rep = score(
        d, ScoreOptions(metrics=("mle",), id_estimator=("lpca",), id_sample=200, seed=2, layers=("1",))
    )
    assert rep["params"]["id_estimator"] == "mle,lpca" and "twonn" not in rep["params"]["metrics"]
    order = np.argsort(row_hash(data["keys"], 2, STREAM_ID_SAMPLE))[:200]
    for e in rep["layers"]:
        assert tuple(e) == (*LAYER_KEYS, "id_mle", "id_lpca")
        S = data["X"][e["layer"]][order].astype(np.float32)
        _close(e["id_mle"], estimate_id(S, "mle").dimension, 1e-9)
        _close(e["id_lpca"], estimate_id(S, "lpca").dimension, 1e-9)
        assert e["twonn"] is None and e["se"]["id_mle"] > 0
    assert "decimation" in rep["params"]["uncertainty"]["id_mle"]


def test_shrinkage_targets(tmp_path, run):
    d, data = run
    z = 0.35
    C1 = ref_cov(data["X"]["layer_01"])
    rep = score(d, ScoreOptions(metrics=("isoscore_star",), zeta=z, shrinkage_target="layer:layer_01"))
    assert rep["params"]["target"] == "layer:layer_01"
    for e in rep["layers"]:
        _close(e["isoscore_star"], ref_star(ref_cov(data["X"][e["layer"]]), z, C1))
    rep = score(d, ScoreOptions(metrics=("isoscore_star",), zeta=z, shrinkage_target="identity"))
    for e in rep["layers"]:
        _close(e["isoscore_star"], ref_star(ref_cov(data["X"][e["layer"]]), z, np.eye(D)))
    c0 = np.diag(np.linspace(1, 3, D))
    np.save(tmp_path / "c0.npy", c0)
    rep = score(
        d, ScoreOptions(metrics=("isoscore_star",), zeta=z, shrinkage_target=str(tmp_path / "c0.npy"))
    )
    assert rep["params"]["target"] == f"file:{tmp_path / 'c0.npy'}"
    for e in rep["layers"]:
        _close(e["isoscore_star"], ref_star(ref_cov(data["X"][e["layer"]]), z, c0))
    other = make_run(tmp_path / "other", seed=5, n_shards=1)
    rep = score(d, ScoreOptions(metrics=("isoscore_star",), zeta=z, shrinkage_target=str(tmp_path / "other")))
    assert rep["params"]["target"].startswith("run:")
    for e in rep["layers"]:
        C0 = ref_cov(other["X"][e["layer"]])
        _close(e["isoscore_star"], ref_star(ref_cov(data["X"][e["layer"]]), z, C0))


def test_layers_subset_and_memory_batches(run):
    d, data = run
    msgs = []
    full = score(d, ScoreOptions(metrics=("isoscore", "avgcos", "spectrum"), layers=("-1", "layer_00")))
    assert [e["layer"] for e in full["layers"]] == ["layer_00", "layer_02"]  # depth order
    tiny = score(
        d,
        ScoreOptions(
            metrics=("isoscore", "avgcos", "spectrum"),
            layers=("-1", "layer_00"),
            memory_mb=0.03,
            jackknife_groups=10,
        ),
        log=msgs.append,
    )
    assert full["params"]["layer_batch_size"] >= 2 and tiny["params"]["layer_batch_size"] == 1
    assert any("one layer at a time" in m for m in msgs)
    for a, b in zip(full["layers"], tiny["layers"], strict=True):
        for k in ("isoscore", "avgcos", "avgcos_centred", "pr", "erank", "top5_share"):
            _close(a[k], b[k], 1e-12)
            _close(a["se"][k], b["se"][k], 1e-9)


def test_streams_in_bounded_blocks(run, monkeypatch):
    from geomscope.score import accumulate

    d, _ = run
    seen = []
    orig = accumulate.update_groups

    def spy(accs, x, groups, **kw):  # the rows that reach the jackknife groups' accumulators
        seen.append(len(x))
        return orig(accs, x, groups, **kw)

    monkeypatch.setattr(accumulate, "update_groups", spy)
    score(d, ScoreOptions(metrics=("isoscore",), block_rows=64))
    assert seen and max(seen) <= 64


def test_streamed_tasks_equal_one_task_at_a_time(run, tmp_path):
    """The local executor reads the next shard while computing this one (run_tasks): the same blocks in
    the same order as run_task per task, so bitwise the same accumulators; a corrupt shard still stops
    it with its name, after the blocks read before it."""
    from geomscope.score.accumulate import PassSpec, run_task, run_tasks
    from geomscope.score.sources import open_source

    d, _ = run
    tasks = open_source(d).tasks
    assert len(tasks) >= 3
    spec = PassSpec("moments", list(LAYERS), n_groups=4, threads=2, checksum=True)
    seen = []
    streamed = run_tasks(tasks, spec, progress=seen.append)
    one_by_one: dict = {}
    for t in tasks:
        run_task(t, spec, into=one_by_one)
    assert sum(seen) == sum(t.rows for t in tasks)  # every block reported once
    for name in LAYERS:
        for a, b in zip(streamed[name].groups, one_by_one[name].groups, strict=True):
            assert a.n == b.n and np.array_equal(a.M2, b.M2) and np.array_equal(a.mean, b.mean)
            assert np.array_equal(a.sum_unit, b.sum_unit) and np.array_equal(a.abs_max, b.abs_max)
        assert streamed[name].counts == one_by_one[name].counts
    m = one_by_one[LAYERS[0]].groups[0].mean
    unit = {n: {"avgcos_centred": (np.tile(m, (5, 1)), None)} for n in LAYERS}
    uspec = PassSpec("unit", list(LAYERS), n_groups=4, threads=2, unit=unit)
    ua, ub = run_tasks(tasks, uspec), {}
    for t in tasks:
        run_task(t, uspec, into=ub)
    for name in LAYERS:
        assert np.array_equal(
            ua[name].unit["avgcos_centred"].sum_unit, ub[name].unit["avgcos_centred"].sum_unit
        )

    bad = tmp_path / "r"
    make_run(bad, n_shards=3)
    shard = bad / "shard-00001.h5"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    rows = []
    with pytest.raises(DataError, match="shard-00001.h5.*checksum"):
        run_tasks(open_source(bad).tasks, spec, progress=rows.append)
    assert sum(rows) == 2 * 400  # shards 0 and 1 were read (the checksum is due after shard 1's blocks)


def test_partial_run(tmp_path):
    make_run(tmp_path / "r", n_shards=2, finalize=False)
    with pytest.raises(InputError, match="incomplete run.*--partial"):
        score(tmp_path / "r", ScoreOptions(metrics=("isoscore",)))
    rep = score(tmp_path / "r", ScoreOptions(metrics=("isoscore",), partial=True), log=lambda m: None)
    assert (
        rep["run"]["partial"] is True
        and rep["run"]["complete"] is False
        and rep["layers"][0]["n_rows"] == 800
    )


def test_corrupt_shard_is_named(tmp_path):
    make_run(tmp_path / "r", n_shards=2)
    p = tmp_path / "r" / "shard-00001.h5"
    raw = bytearray(p.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])  # same size, different bytes
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="shard-00001.h5"):
        score(tmp_path / "r", ScoreOptions(metrics=("isoscore",)))
    with pytest.raises(DataError, match="shard-00001.h5.*checksum"):  # raised in a worker process
        score(tmp_path / "r", ScoreOptions(metrics=("isoscore",), workers=2))
    p.write_bytes(bytes(raw[: len(raw) // 3]))  # truncated
    with pytest.raises(DataError, match="shard-00001.h5.*(corrupt|truncated)"):
        score(tmp_path / "r", ScoreOptions(metrics=("isoscore",), verify=False))


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(metrics=("isoscore", "nope")), "--metrics must be a comma list of metric names"),
        (dict(zeta=1.5), "zeta"),
        (dict(zeta="abc"), "zeta"),
        (dict(layers=("layer_09",)), "not in this run"),
        (dict(outlier_rule="weird"), "outlier-rule"),
        (dict(shrinkage_target="layer:nope"), "not in this run"),
        (dict(shrinkage_target="bogus"), "shrinkage-target"),
        (dict(max_rows=1), "max-rows"),
    ],
)
def test_bad_options(run, opts, match):
    d, _ = run
    with pytest.raises(GeomscopeError, match=match):
        score(d, ScoreOptions(**opts))


def test_too_few_rows(tmp_path):
    make_run(tmp_path / "r", n_shards=1, rows=20, doc_len=1)  # every row is a special token
    with pytest.raises(DataError, match="0 usable row.*at least 2"):
        score(tmp_path / "r", ScoreOptions(metrics=("isoscore",), exclude_special=True))
    np.save(tmp_path / "one.npy", np.ones((1, 5)))
    with pytest.raises(DataError, match="at least 2 rows"):
        score(tmp_path / "one.npy")


def test_arrays_npy_and_h5(tmp_path):
    import h5py

    rng = np.random.default_rng(1)
    X = (rng.normal(size=(3000, 12)) * np.linspace(0.5, 2, 12)).astype(np.float32)
    np.save(tmp_path / "x.npy", X)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.create_dataset("emb/vectors", data=X)
        f.create_dataset("labels", data=np.arange(3000))
    Xd = X.astype(np.float64)
    ref = ref_all(Xd)
    for path, ds in (
        (tmp_path / "x.npy", None),
        (tmp_path / "x.h5", None),
        (tmp_path / "x.h5", "emb/vectors"),
    ):
        rep = score(path, ScoreOptions(metrics=MOMENTS_ONLY, dataset=ds, block_rows=700))
        (e,) = rep["layers"]
        assert rep["source"]["kind"] == "array" and rep["model"] is None and rep["run"] is None
        assert e["n_rows"] == 3000
        for k in SCALARS:
            _close(e[k], ref[k])
    assert "contiguous row blocks" in rep["params"]["uncertainty"]["moments"]
    # jackknife over contiguous blocks, directly
    g = np.arange(3000) * 10 // 3000
    reps = [ref_iso(ref_cov(Xd[g != r])) for r in range(10)]
    _close(
        rep["layers"][0]["se"]["isoscore"], np.sqrt(0.9 * ((np.array(reps) - np.mean(reps)) ** 2).sum()), 1e-6
    )


def test_array_bad_shapes_and_nan(tmp_path):
    np.save(tmp_path / "one.npy", np.zeros(10))
    np.save(tmp_path / "three.npy", np.zeros((4, 5, 6)))
    with pytest.raises(InputError, match="2-D"):
        score(tmp_path / "one.npy")
    with pytest.raises(InputError, match=r"shape \(4, 5, 6\)"):
        score(tmp_path / "three.npy")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 8))
    X[[3, 50]] = np.nan
    np.save(tmp_path / "nan.npy", X)
    rep = score(tmp_path / "nan.npy", ScoreOptions(metrics=("isoscore",)))
    assert rep["layers"][0]["n_rows"] == 198 and rep["layers"][0]["dropped"]["nonfinite"] == 2
    _close(rep["layers"][0]["isoscore"], ref_iso(ref_cov(np.delete(X, [3, 50], 0))))
    msgs = []
    np.save(tmp_path / "wide.npy", rng.normal(size=(10, 40)))
    rep = score(tmp_path / "wide.npy", ScoreOptions(metrics=("isoscore",)), log=msgs.append)
    assert "maybe_transposed" in rep["layers"][0]["flags"] and "rank_limited" in rep["layers"][0]["flags"]
    assert any("transposed" in m for m in msgs)


def test_not_a_source(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InputError, match="not a geomscope run"):
        score(tmp_path / "empty")
    with pytest.raises(InputError, match="not a format score reads"):
        score(tmp_path / "notes.txt")
    with pytest.raises(InputError, match="does not exist"):
        score(tmp_path / "missing")


def test_report_is_json_serialisable_with_stable_keys(run):
    from geomscope.report import to_json
    from geomscope.schema import LAYER_KEYS, REPORT_KEYS

    d, _ = run
    rep = score(d, ScoreOptions(metrics=("isoscore", "twonn"), id_sample=200))
    back = json.loads(to_json(rep))
    assert tuple(back) == REPORT_KEYS
    for e in back["layers"]:
        assert tuple(e) == LAYER_KEYS
        assert e["avgcos"] is None and "not requested" in e["notes"]["avgcos"]
    assert set(back["params"]) == {
        "metrics",
        "zeta",
        "target",
        "avgcos_variants",
        "outlier_rule",
        "outlier_threshold",
        "id_estimator",
        "twonn_fit",
        "discard_fraction",
        "id_sample",
        "seed",
        "exclude_special",
        "max_rows",
        "layers",
        "duplicates_removed",
        "uncertainty",
        "jackknife_groups",
        "product_dtype",
        "workers",
        "scheduler",
        "layer_batch_size",
        "rows_total",
    }
    assert back["model"] == {"name": "toy", "revision": "step7", "commit": None, "hidden_size": D}


def _write_split(run_dir, X, docs, cuts):
    ident = {
        "model": {"name": "toy", "hidden_size": X.shape[1]},
        "layers": [{"name": "layer_00", "index": 0}],
    }
    with RunWriter(run_dir, ident) as w:
        for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            sw = w.shard_writer(s, layer_names=["layer_00"], dim=X.shape[1], store_dtype="float32")
            sw.append(
                {"layer_00": X[a:b]},
                token_id=np.arange(a, b),
                doc_id=docs[a:b],
                position=np.zeros(b - a),
                is_special=np.zeros(b - a, bool),
            )
            w.add_shard(sw.close())
        w.finalize({"docs": int(docs.max()) + 1})


def test_report_does_not_depend_on_how_rows_are_sharded(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    rng = np.random.default_rng(7)
    X = (rng.normal(size=(300, 5)) * [1, 2, 3, 0.5, 1] + 10).astype(np.float32)
    docs = np.arange(300) // 7
    np.save(tmp_path / "x.npy", X)
    ref = score(tmp_path / "x.npy", ScoreOptions(metrics=MOMENTS_ONLY, jackknife_groups=0))["layers"][0]
    counter = iter(range(10**6))

    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    # shards hold whole documents, as extract writes them (a shard's entry claims its documents, and
    # a run whose shards claim the same document is refused)
    @given(st.lists(st.integers(1, 42), min_size=0, max_size=6, unique=True), st.integers(16, 200))
    def check(inner, block):
        cuts = [0, *sorted(7 * k for k in inner), 300]
        d = tmp_path / f"r{next(counter)}"
        _write_split(d, X, docs, cuts)
        e = score(d, ScoreOptions(metrics=MOMENTS_ONLY, jackknife_groups=0, block_rows=block))["layers"][0]
        for k in SCALARS:
            _close(e[k], ref[k], 1e-10)
        assert e["outliers"] == ref["outliers"]

    check()


def test_same_inputs_same_report(run):
    d, _ = run
    opts = ScoreOptions(
        metrics=("isoscore", "avgcos", "twonn"), id_sample=200, max_rows=700, seed=5, layers=("0",)
    )
    a, b = score(d, opts), score(d, opts)
    a.pop("created"), b.pop("created")
    assert a == b


def test_one_document_has_no_jackknife_se(tmp_path):
    make_run(tmp_path / "r", n_shards=1, rows=100, doc_len=100)  # all rows in document 0: one group
    e = score(tmp_path / "r", ScoreOptions(metrics=("isoscore", "avgcos")))["layers"][0]
    assert e["isoscore"] is not None and e["se"]["isoscore"] is None and e["se"]["avgcos_centred"] is None
    assert "1 jackknife group" in e["notes"]["se"]


def test_shard_without_nonfinite_flags_is_checked_here(tmp_path):
    import h5py

    data = make_run(tmp_path / "r", n_shards=1, rows=200, nan_rows={"layer_00": [3, 70]})
    p = tmp_path / "r" / "shard-00000.h5"
    size = p.stat().st_size
    with h5py.File(p, "a") as f:
        del f["nonfinite"]["layer_00"]  # a layer without its flags
    assert p.stat().st_size == size  # HDF5 does not shrink: only the checksum changes
    e = score(tmp_path / "r", ScoreOptions(metrics=("isoscore",), verify=False))["layers"][0]
    assert e["dropped"]["nonfinite"] == 2 and e["n_rows"] == 198
    X = data["X"]["layer_00"]
    _close(e["isoscore"], ref_iso(ref_cov(X[np.isfinite(X).all(1)])))


def test_outlier_rules_against_direct(tmp_path):
    from geomscope.metrics import outliers_magnitude, outliers_quantile, outliers_zscore

    data = make_run(tmp_path / "r", n_shards=2, rows=300)
    # magnitude: |x| >= 6 in 10 % of the tokens of dimension 5 in layers 0 and 1 (2 of 3 layers)
    X = {n: data["X"][n].copy() for n in LAYERS}
    rep = score(
        tmp_path / "r",
        ScoreOptions(
            metrics=("outliers",), outlier_rule="zscore", outlier_stat="mean_abs", outlier_threshold=2.0
        ),
    )
    for e in rep["layers"]:
        stat = np.abs(X[e["layer"]]).mean(0)
        ref = outliers_zscore(stat, z=2.0, stat_name="mean_abs")
        assert e["outliers"] == ref.dims
        np.testing.assert_allclose(e["outlier_statistic"], stat, rtol=1e-12)
    rep = score(
        tmp_path / "r",
        ScoreOptions(
            metrics=("outliers",), outlier_rule="quantile", outlier_threshold=0.9, id_sample=250, seed=4
        ),
    )
    order = np.argsort(row_hash(data["keys"], 4, STREAM_ID_SAMPLE))[:250]
    for e in rep["layers"]:
        ref = outliers_quantile(X[e["layer"]][order], q=0.9)
        assert e["outliers"] == ref.dims and e["outlier_support"] == []
        np.testing.assert_allclose(e["outlier_statistic"], ref.statistic, rtol=1e-12)

    big = make_run(tmp_path / "m", n_shards=2, rows=300, seed=3)
    rng = np.random.default_rng(0)
    rows = rng.choice(600, 60, replace=False)
    # rewrite the run with dimension 5 boosted in layers 0 and 1
    Xb = {n: big["X"][n].copy() for n in LAYERS}
    for n in ("layer_00", "layer_01"):
        Xb[n][rows, 5] = 9.0
    ident = {
        "model": {"name": "toy", "hidden_size": D},
        "layers": [{"name": n, "index": i} for i, n in enumerate(LAYERS)],
    }
    with RunWriter(tmp_path / "m2", ident) as w:
        sw = w.shard_writer(0, layer_names=list(LAYERS), dim=D, store_dtype="float32")
        sw.append(
            {n: Xb[n] for n in LAYERS},
            token_id=np.arange(600),
            doc_id=np.arange(600) // 20,
            position=np.arange(600) % 20,
            is_special=np.zeros(600, bool),
        )
        w.add_shard(sw.close())
        w.finalize({"docs": 30})
    rep = score(tmp_path / "m2", ScoreOptions(metrics=("outliers",), outlier_rule="magnitude"))
    frac = np.stack([(np.abs(Xb[n]) >= 6).mean(0) for n in LAYERS])
    ref = outliers_magnitude(frac)
    assert 5 in ref.dims
    for e, f in zip(rep["layers"], frac, strict=True):
        assert e["outliers"] == ref.dims
        np.testing.assert_allclose(e["outlier_statistic"], f, rtol=1e-12)
        assert len(e["outlier_support"]) == len(ref.dims)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(zeta="0.2"), "--zeta must be a number"),
        (dict(zeta=1.5), r"--zeta must be a number in \[0, 1\]"),
        (dict(discard_fraction=1.0), r"--discard-fraction must be a number in \[0, 1\)"),
        (dict(workers=0), "--workers must be a positive whole number"),
        (dict(seed=1.5), "--seed must be a whole number"),
        (dict(jackknife_groups=1), "0 \\(off\\) or >= 2"),
        (dict(memory_mb=0), r"--memory-mb must be in \(0, 2\^40\] MiB"),
        (dict(twonn_fit="cubic"), "--twonn-fit must be one of"),
        (dict(outlier_rule="mad"), "--outlier-rule must be one of"),
        (dict(outlier_stat="max"), "--outlier-stat"),
        (dict(max_rows=1), "--max-rows must be a whole number >= 2"),
        (dict(metrics=("nope",)), "--metrics must be a comma list of metric names"),
    ],
)
def test_score_options_reject_library_callers_bad_values(kw, match):
    with pytest.raises(InputError, match=match):
        ScoreOptions(**kw).validate()


def test_score_options_all_means_the_core_metrics_and_the_diagnostics():
    from geomscope.score import CORE_METRICS
    from geomscope.score.options import DIAGNOSTIC_FAMILIES

    o = ScoreOptions(metrics=("all",)).validate()
    assert o.metrics == (*CORE_METRICS, *DIAGNOSTIC_FAMILIES) and o.zeta == 0.2 and isinstance(o.zeta, float)
    assert ScoreOptions().validate().metrics == CORE_METRICS
    assert ScoreOptions(metrics=("all", "mle")).validate().extra_id == ("mle",)


def test_samples_do_not_depend_on_sharding(tmp_path):
    """The same texts cut into shards of 3 or of 50 documents: the seeded --max-rows and TwoNN
    samples are the same rows (keys are (document, position)), so the reports agree -- to float
    rounding, since the stored values themselves differ at ~1e-6 with the batch composition, while a
    different sample would move TwoNN by ~1e-2."""
    from helpers_models import SAMPLE_TEXTS, make_tiny_run

    texts = SAMPLE_TEXTS * 3
    small = make_tiny_run(tmp_path, "bert", texts, name="small", shard_docs=3, store_dtype="float32")
    big = make_tiny_run(tmp_path, "bert", texts, name="big", shard_docs=50, store_dtype="float32")
    assert len(Run(small).shards) > len(Run(big).shards) == 1
    opts = ScoreOptions(
        metrics=("isoscore", "avgcos", "twonn"), id_sample=40, max_rows=120, jackknife_groups=4
    )
    a, b = score(small, opts), score(big, opts)
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        assert ea["n_rows"] == eb["n_rows"] == 120 and ea["twonn_n_used"] == eb["twonn_n_used"]
        for k in ("isoscore", "avgcos", "twonn"):
            assert eb[k] == pytest.approx(ea[k], rel=1e-5), k
            assert eb["se"][k] == pytest.approx(ea["se"][k], rel=1e-4), k


def test_a_constant_dimension_adds_nothing_to_the_scored_cosines(tmp_path):
    """The scorer's centred and standardised cosines (and their jackknife replicates) treat a
    constant dimension as 0: with a column of 0.1s the standardised cosine read 0.2037 where the
    truth, the same rows without it, is -0.0003."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3000, 5)) * [1, 2, 0.5, 3, 1] + 2.0
    np.save(tmp_path / "with.npy", np.column_stack([x, np.full(3000, 0.1)]))
    np.save(tmp_path / "without.npy", x)
    opts = ScoreOptions(metrics=("avgcos",), block_rows=700)
    (a,) = score(tmp_path / "with.npy", opts)["layers"]
    (b,) = score(tmp_path / "without.npy", opts)["layers"]
    for key in ("avgcos_centred", "avgcos_standardised"):
        _close(a[key], ref_avgcos(x, key.split("_")[1]), 1e-9)
        _close(a[key], b[key], 1e-9)
        _close(a["se"][key], b["se"][key], 1e-6)


def test_identical_rows_have_no_scored_centred_cosine(tmp_path):
    """Rows all equal to 0.1s: every covariance metric is null, and so are the centred cosines
    (they read 1.0 with an SE of 0, the rounding residue of the mean)."""
    np.save(tmp_path / "same.npy", np.full((3000, 6), 0.1))
    (e,) = score(tmp_path / "same.npy", ScoreOptions(metrics=("isoscore", "avgcos")))["layers"]
    assert e["isoscore"] is None and e["avgcos_centred"] is None and e["avgcos_standardised"] is None
    assert "0 row(s) with non-zero norm" in e["notes"]["avgcos_centred"]
    assert e["avgcos"] == pytest.approx(1.0)


def test_exclude_special_on_an_array_without_special_flags_says_so(tmp_path):
    """An .npy has no special-token column: --exclude-special can exclude nothing, and the report and
    the log say so instead of recording exclude_special: true as if it had acted."""
    p = tmp_path / "x.npy"
    np.save(p, np.random.default_rng(0).standard_normal((200, 6)))
    said = []
    rep = score(p, ScoreOptions(metrics=("isoscore",), exclude_special=True), log=said.append)
    assert "no special-token column" in rep["notes"]["exclude_special"]
    assert any("excluded no row" in m for m in said)
    assert rep["layers"][0]["dropped"]["special"] == 0
    plain = score(p, ScoreOptions(metrics=("isoscore",)))
    assert "exclude_special" not in plain["notes"]
    assert rep["layers"][0]["isoscore"] == plain["layers"][0]["isoscore"]
