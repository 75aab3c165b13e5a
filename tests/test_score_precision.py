"""Precision of the streaming scorer: float64 results from float16/float32/float64 rows streamed in
blocks and threads, against an extended-precision reference (np.longdouble two-pass covariance of
the stored values) at 1e-10 relative, with and without a 1e4 common offset, and against the
published IsoScore algorithm (float64) and the `isoscore` package (to its float32 constants).

The scorer's block products are float64 by default. ``product_dtype="float32"`` (score
--product-dtype float32) multiplies each block, centred in float64, in float32: its results are
checked here at 1e-6 relative against the same reference (with a 1e4 offset too), measured at ~1e-8,
and shown to differ from the float64 products (the option is not ignored).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IsoScore import IsoScore as isp

import geomscope.score.resources as resources
from geomscope.errors import InputError
from geomscope.metrics import (
    Moments,
    avgcos_from_sum,
    isoscore_from_cov,
    isoscore_published,
    isoscore_star_from_cov,
)
from geomscope.metrics.moments import update_groups
from geomscope.score import ScoreOptions, score
from geomscope.store import RunWriter

REL = 1e-10
D = 24


def _rows(n, d, seed, offset):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.uniform(0.2, 3.0, d)
    x[:, 5] *= 15.0  # a dominant (rogue) dimension
    return x + offset + rng.standard_normal(d)


def _reference(x):
    """Mean and covariance (ddof=1) of the float64 values ``x``, two-pass in np.longdouble."""
    xl = x.astype(np.longdouble)
    mean = xl.mean(axis=0)
    y = xl - mean
    return mean.astype(np.float64), (y.T @ y / (len(x) - 1)).astype(np.float64)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def _write_run(path, x, dtype, shards=3):
    """A one-layer run of the rows ``x`` stored as ``dtype``; returns the stored values as float64."""
    ident = {
        "model": {"name": "toy", "hidden_size": x.shape[1]},
        "layers": [{"name": "layer_00", "index": 0}],
    }
    parts = np.array_split(x, shards)
    doc = 0
    with RunWriter(path, ident) as w:
        for s, part in enumerate(parts):
            n = len(part)
            sw = w.shard_writer(s, layer_names=["layer_00"], dim=x.shape[1], store_dtype=dtype)
            docs = doc + np.arange(n) // 40
            sw.append(
                {"layer_00": part.astype(dtype)},
                token_id=np.arange(n),
                doc_id=docs,
                position=np.arange(n) % 40,
                is_special=np.zeros(n, bool),
            )
            w.add_shard(sw.close())
            doc = int(docs[-1]) + 1
        w.finalize({"docs": doc})
    return x.astype(dtype).astype(np.float64)


def _score(path, threads, metrics=("isoscore", "isoscore_star", "spectrum"), **kw):
    """Score with the block statistics in ``threads`` threads (what the engine derives from the cores)."""
    saved = resources.usable_cores
    resources.usable_cores = lambda: threads
    try:
        opts = ScoreOptions(metrics=metrics, **kw)
        return score(path, opts)["layers"][0]
    finally:
        resources.usable_cores = saved


# ---------------------------------------------------------------------------- Moments itself
#: (dtype, offset) of the rows: float16 only without the offset (its spacing is 8 at 1e4, so the
#: offset rows would be constant)
DTYPE_OFFSETS = [("float16", 0.0), ("float32", 0.0), ("float32", 1e4), ("float64", 0.0), ("float64", 1e4)]


@pytest.mark.parametrize(("dtype", "offset"), DTYPE_OFFSETS)
@pytest.mark.parametrize("threads", [1, 3])
def test_grouped_blocks_match_longdouble_reference(dtype, offset, threads):
    x = _rows(20_000, D, 0, offset).astype(dtype).astype(np.float64)
    groups = (np.arange(len(x)) // 40) % 7
    accs = [Moments(block_rows=1000) for _ in range(7)]
    update_groups(accs, x.astype(dtype), groups, threads=threads)
    full = Moments()
    for a in accs:
        full.merge(a)
    mean, cov = _reference(x)
    assert full.n == len(x)
    assert _rel(full.mean, mean) < REL
    assert _rel(full.covariance(), cov) < REL
    assert isoscore_from_cov(full.covariance()) == pytest.approx(isoscore_from_cov(cov), rel=REL)
    for g in (0, 6):  # each group holds exactly its rows
        gm, gc = _reference(x[groups == g])
        assert accs[g].n == int((groups == g).sum())
        assert _rel(accs[g].mean, gm) < REL and _rel(accs[g].covariance(), gc) < REL


def test_threads_do_not_change_a_bit():
    x = _rows(9_000, D, 1, 3.0).astype(np.float32)
    groups = np.arange(len(x)) % 4
    out = []
    for threads in (1, 2, 4):
        accs = [Moments(block_rows=500) for _ in range(4)]
        update_groups(accs, x, groups, threads=threads)
        single = Moments(block_rows=700).update(x, threads=threads)
        out.append([a.M2.copy() for a in accs] + [a.sum_unit.copy() for a in accs] + [single.M2, single.mean])
    for other in out[1:]:
        for a, b in zip(out[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_update_groups_equals_one_update_per_group():
    x = _rows(5_000, D, 2, -7.0)
    groups = np.random.default_rng(3).integers(0, 5, len(x))
    accs = [Moments(block_rows=333) for _ in range(5)]
    update_groups(accs, x, groups, threads=2)
    for g, acc in enumerate(accs):
        ref = Moments(block_rows=333).update(x[groups == g])
        np.testing.assert_allclose(acc.M2, ref.M2, rtol=1e-12, atol=1e-9)
        for k in ("mean", "sum_unit", "sum_unit_sq", "abs_sum", "abs_max", "count_abs_ge"):
            np.testing.assert_allclose(getattr(acc, k), getattr(ref, k), rtol=1e-12, atol=1e-12, err_msg=k)


# ---------------------------------------------------------------------------- float32 products
REL32 = 1e-6  # float32 products: measured ~1e-8 (the isoscore package's float32: ~1e-6)


@pytest.mark.parametrize(("dtype", "offset"), DTYPE_OFFSETS)
def test_float32_products_within_1e6_of_the_reference(dtype, offset):
    x = _rows(20_000, D, 8, offset).astype(dtype).astype(np.float64)
    groups = (np.arange(len(x)) // 40) % 5
    accs = [Moments(block_rows=1500, product_dtype="float32") for _ in range(5)]
    update_groups(accs, x.astype(dtype), groups, threads=2)
    full = Moments(product_dtype="float32")
    for acc in accs:
        full.merge(acc)
    exact = Moments().update(x.astype(dtype))
    mean, cov = _reference(x)
    err = _rel(full.covariance(), cov)
    assert 0 < err < REL32  # not the float64 path, and within 1e-6 (an offset costs nothing)
    assert _rel(exact.covariance(), cov) < REL
    assert isoscore_from_cov(full.covariance()) == pytest.approx(isoscore_from_cov(cov), rel=REL32)
    # only the product changes: counts, mean and the extras are the float64 path's, bit for bit
    assert full.n == exact.n and np.array_equal(full.abs_max, exact.abs_max)
    assert _rel(full.mean, mean) < REL and _rel(full.sum_unit, exact.sum_unit) < 1e-13


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 3000),
    d=st.integers(1, 40),
    offset=st.floats(-1e4, 1e4),
    scale=st.sampled_from([1e-30, 1e-21, 1e-6, 1.0, 1e3, 1e18, 1e30]),
    block_rows=st.integers(1, 5000),
    seed=st.integers(0, 2**16),
)
def test_float32_products_any_shape_offset_and_scale(n, d, offset, scale, block_rows, seed):
    """Normwise within 1e-5 of the float64 covariance for any shape, block size, offset and scale
    that float32 rows can hold: each block is centred in float64 before it is rounded (and scaled by
    a power of two where its values lie far from 1), and the blocks' sums are float64."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.1, 3.0, d) + offset) * scale
    fast = Moments(block_rows=block_rows, product_dtype="float32").update(x.astype(np.float32))
    _, cov = _reference(x.astype(np.float32).astype(np.float64))
    assert _rel(fast.covariance(), cov) < 1e-5


@pytest.mark.parametrize("scale", [1e-150, 1e-45, 1e45, 1e150])  # (float64 holds their squares)
def test_float32_products_of_float64_rows_outside_float32s_range(scale):
    """float64 rows far outside float32's range (1.2e-38 .. 3.4e38): scaled by a power of two before
    rounding, so the products neither underflow nor overflow; no warning, the same 1e-6."""
    x = _rows(6_000, D, 11, 0.0) * scale
    with np.errstate(over="raise", invalid="raise"):  # (the extras' float64 squares may underflow)
        fast = Moments(block_rows=1000, extras=False, product_dtype="float32").update(x)
    _, cov = _reference(x)
    unit = scale * scale  # compared at unit scale: the norms of 1e-300 entries would underflow
    assert 0 < _rel(fast.covariance() / unit, cov / unit) < REL32


def test_float32_products_threads_identical_and_merge_with_float64():
    x = _rows(9_000, D, 9, 2.0).astype(np.float32)
    one, two = (Moments(block_rows=700, product_dtype="float32").update(x, threads=t) for t in (1, 2))
    np.testing.assert_array_equal(one.M2, two.M2)
    half = len(x) // 2  # accumulators of either kind merge: the result is within the worse one's error
    mixed = Moments(product_dtype="float32").update(x[:half]).merge(Moments().update(x[half:]))
    _, cov = _reference(x.astype(np.float64))
    assert _rel(mixed.covariance(), cov) < REL32
    with pytest.raises(InputError, match="product_dtype must be one of float64, float32"):
        Moments(product_dtype="float16")


def test_scorer_with_float32_products(tmp_path):
    stored = _write_run(tmp_path / "run", _rows(12_000, D, 10, 1e4), "float32")
    _, cov = _reference(stored)
    lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
    runs = [_score(tmp_path / "run", t, block_rows=1500, product_dtype="float32") for t in (1, 2)]
    exact = _score(tmp_path / "run", 2, block_rows=1500)
    for e in runs:
        assert e["isoscore"] == pytest.approx(isoscore_from_cov(cov), rel=REL32)
        assert e["isoscore_star"] == pytest.approx(isoscore_star_from_cov(cov, 0.2, "trace"), rel=REL32)
        assert e["top1_share"] == pytest.approx(lam[0] / lam.sum(), rel=REL32)
        assert e["se"]["isoscore"] == pytest.approx(exact["se"]["isoscore"], rel=1e-3)
    assert runs[0]["isoscore"] == runs[1]["isoscore"] != exact["isoscore"]
    report = score(tmp_path / "run", ScoreOptions(metrics=("isoscore",), product_dtype="float32"))
    assert report["params"]["product_dtype"] == "float32"
    with pytest.raises(InputError, match="--product-dtype must be one of float64, float32"):
        ScoreOptions(product_dtype="bfloat16").validate()


# ---------------------------------------------------------------------------- the scorer
@pytest.mark.parametrize(
    ("dtype", "offset"), [("float16", 0.0), ("float16", 30.0), ("float32", 0.0), ("float32", 1e4)]
)
def test_streamed_run_matches_reference(tmp_path, dtype, offset):
    stored = _write_run(tmp_path / "run", _rows(12_000, D, 4, offset), dtype)
    _, cov = _reference(stored)
    for threads in (1, 2):
        e = _score(tmp_path / "run", threads, block_rows=1500)
        assert e["n_rows"] == len(stored)
        assert e["isoscore"] == pytest.approx(isoscore_from_cov(cov), rel=REL)
        assert e["isoscore_star"] == pytest.approx(isoscore_star_from_cov(cov, 0.2, "trace"), rel=REL)
        assert e["pr"] == pytest.approx(np.trace(cov) ** 2 / np.sum(cov * cov), rel=REL)
        lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
        assert e["top1_share"] == pytest.approx(lam[0] / lam.sum(), rel=REL)


def test_streamed_array_with_offset_matches_reference_and_package(tmp_path):
    x = _rows(15_000, D, 5, 1e4)
    np.save(tmp_path / "x.npy", x)
    _, cov = _reference(x)
    one, two = _score(tmp_path / "x.npy", 1), _score(tmp_path / "x.npy", 2)
    for k in ("isoscore", "isoscore_star", "pr", "erank"):
        assert one[k] == two[k], k  # threads change no number
        assert one["se"][k] == two["se"][k], k
    assert one["isoscore"] == pytest.approx(isoscore_from_cov(cov), rel=REL)
    assert one["isoscore_star"] == pytest.approx(isoscore_star_from_cov(cov, 0.2, "trace"), rel=REL)
    # the published algorithm (float64, through an SVD) at 1e-10; the package itself only to its own
    # precision: it evaluates sqrt(D) of an integer tensor, in float32
    assert one["isoscore"] == pytest.approx(isoscore_published(x), rel=REL)
    assert one["isoscore"] == pytest.approx(float(isp.IsoScore(x)), abs=1e-6)


def test_package_identity_target_on_float16_run(tmp_path):
    stored = _write_run(tmp_path / "run", _rows(8_000, D, 6, 0.0), "float16")
    e = _score(tmp_path / "run", 2, shrinkage_target="identity")
    c0 = np.eye(D)
    assert e["isoscore"] == pytest.approx(isoscore_published(stored), rel=REL)
    assert e["isoscore_star"] == pytest.approx(isoscore_published(stored, C0=c0, zeta=0.2), rel=REL)
    assert e["isoscore"] == pytest.approx(float(isp.IsoScore(stored)), abs=1e-6)
    assert e["isoscore_star"] == pytest.approx(float(isp.IsoScore_star(stored, c0, 0.2)), abs=1e-6)


def test_moment_suite_two_passes_threads_identical(tmp_path):
    """Both passes (moments; unit-vector sums of the centred / standardised rows of every jackknife
    replicate) in threads give the same numbers as one thread, and the centred and standardised
    cosines of rows with a 1e4 offset match a direct float64 computation."""
    stored = _write_run(tmp_path / "run", _rows(10_000, D, 7, 1e4), "float32", shards=2)
    suite = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers")
    one, two = _score(tmp_path / "run", 1, suite), _score(tmp_path / "run", 2, suite)
    keys = ("isoscore", "isoscore_star", "avgcos", "avgcos_centred", "avgcos_standardised", "pr", "erank")
    for k in keys:
        assert one[k] is not None and one[k] == two[k], k
        assert one["se"][k] == two["se"][k], k
    y = stored - stored.mean(axis=0)
    u = y / np.linalg.norm(y, axis=1, keepdims=True)
    assert one["avgcos_centred"] == pytest.approx(avgcos_from_sum(u.sum(axis=0), len(u)), rel=1e-9, abs=1e-12)
    z = y / stored.std(axis=0, ddof=1)  # the standardised variant, computed in the same pass
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    assert one["avgcos_standardised"] == pytest.approx(
        avgcos_from_sum(u.sum(axis=0), len(u)), rel=1e-9, abs=1e-12
    )


def test_read_ahead_keeps_order_errors_and_closes_early():
    from geomscope.score.accumulate import _read_ahead

    closed = []

    def source(fail_at=None):
        try:
            for i in range(6):
                if i == fail_at:
                    raise ValueError(f"bad block {i}")
                yield i
        finally:
            closed.append(True)

    assert list(_read_ahead(source())) == list(range(6))
    got = []
    with pytest.raises(ValueError, match="bad block 3"):
        for i in _read_ahead(source(fail_at=3)):
            got.append(i)
    assert got == [0, 1, 2]
    it = _read_ahead(source())
    assert next(it) == 0
    it.close()  # leaving early stops the reader, which closes the source
    assert closed == [True, True, True]
