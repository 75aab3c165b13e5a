"""Exact two-nearest-neighbour search and TwoNN against brute force, scikit-dimension and truths."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import cdist

from geomscope.errors import DataError, InputError
from geomscope.metrics.intrinsic import TwoNN
from geomscope.metrics.neighbors import default_block_size, two_nearest
from geomscope.metrics.twonn import dedup_rows, fit_mu, twonn, twonn_error


def brute(X):
    """Reference: full float64 distance matrix (scipy), self excluded, ties by smaller index."""
    a = np.asarray(X, dtype=np.float64)
    D = cdist(a, a)
    np.fill_diagonal(D, np.inf)
    o = np.argsort(D, axis=1, kind="stable")[:, :2]
    rows = np.arange(len(a))
    return D[rows, o[:, 0]], D[rows, o[:, 1]], o[:, 0], o[:, 1]


def assert_same_neighbours(X, got, check_index=True):
    r1, r2, i1, i2 = got[:4]
    b1, b2, j1, j2 = brute(X)
    np.testing.assert_allclose(r1, b1, rtol=1e-12, atol=0)
    np.testing.assert_allclose(r2, b2, rtol=1e-12, atol=0)
    if check_index:
        np.testing.assert_array_equal(i1, j1)
        np.testing.assert_array_equal(i2, j2)


def embed(Y, D, rng):
    Q, _ = np.linalg.qr(rng.normal(size=(D, Y.shape[1])))
    return Y @ Q.T


def sphere(n, d, rng):
    """Uniform on the unit d-sphere S^d in R^(d+1)."""
    g = rng.normal(size=(n, d + 1))
    return g / np.linalg.norm(g, axis=1, keepdims=True)


# ---------------------------------------------------------------- two_nearest


@pytest.mark.parametrize("block_size", [1, 7, 64, None])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_two_nearest_equals_brute_force(block_size, dtype):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(203, 17)).astype(dtype)
    assert_same_neighbours(X, two_nearest(X, block_size=block_size))


def test_two_nearest_with_exact_duplicates_gives_exact_zero():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 24)).astype(np.float32)
    X[200:260] = X[:60]  # duplicated pairs
    X[260:270] = X[0]  # and a bigger group of copies of row 0
    r1, r2, i1, i2 = two_nearest(X, block_size=50)
    b1, b2, _, _ = brute(X)
    np.testing.assert_allclose(r1, b1, rtol=1e-12, atol=0)
    np.testing.assert_allclose(r2, b2, rtol=1e-12, atol=0)
    assert np.all(r1[:60] == 0.0) and np.all(r1[200:270] == 0.0)
    assert np.all(r1[60:200] > 0)
    assert np.all(X[i1[:60]] == X[:60])  # the neighbour at distance 0 is a copy


def test_two_nearest_float32_trap_near_duplicates_far_from_the_mean():
    # A tight cluster far from the data mean (like MiniLM [CLS] vectors): in float32 the GEMM form
    # |a|^2 + |b|^2 - 2ab cannot rank its members; the certified refinement must still be exact.
    rng = np.random.default_rng(2)
    D = 48
    far = 300.0 * rng.normal(size=D)
    cluster = far + 1e-2 * rng.normal(size=(150, D))
    rest = rng.normal(size=(250, D)) - far
    X = np.concatenate([cluster, rest]).astype(np.float32)
    got = two_nearest(X, block_size=64, return_info=True)
    assert got[4]["n_flagged"] > 0  # the float64 rescreen path ran
    assert_same_neighbours(X, got)
    # the float32 candidate search alone is measurably wrong here
    fast = two_nearest(X, block_size=64, refine=False)
    b1, b2, _, _ = brute(X)
    assert np.max(np.abs(fast[1][:150] / b2[:150] - 1)) > 1e-3


@pytest.fixture
def folds(monkeypatch):
    """The number of pairs in each fold into the rescreen's running best two, as they happen."""
    import geomscope.metrics.neighbors as nb

    sizes = []
    fold = nb._RunningBestTwo.fold

    def spy(self, pos, cols, dist):
        sizes.append(len(pos))
        return fold(self, pos, cols, dist)

    monkeypatch.setattr(nb._RunningBestTwo, "fold", spy)
    return sizes


def test_rescreen_stays_exact_when_a_small_budget_splits_it(folds):
    # Every member of a tight cluster far from the mean needs the float64 rescreen. With the default
    # budget all their float64 copies fit at once and each pair among them is computed once (the
    # upper triangle, read by row and by column); with a budget of a few KiB the rows come a group
    # at a time against every column, a tile at a time, and the kept pairs are folded into the
    # rows' best two as they outgrow their share: the result must not move.

    rng = np.random.default_rng(12)
    D = 48
    far = 300.0 * rng.normal(size=D)
    cluster = far + 1e-2 * rng.normal(size=(150, D))
    X = np.concatenate([cluster, rng.normal(size=(250, D)) - far]).astype(np.float32)
    roomy = two_nearest(X, block_size=64, return_info=True)
    roomy_folds = len(folds)
    folds.clear()
    budget = 32 * D * 8  # 8 rows per float64 chunk, 16 per group, 64 columns per chunk
    tight = two_nearest(X, block_size=64, memory_budget=budget, return_info=True)
    assert tight[4]["n_flagged"] >= 150 and roomy[4]["n_flagged"] >= 150
    assert len(folds) > 10 * roomy_folds  # many blocks, each folded on its own
    assert_same_neighbours(X, tight)
    for a, b in zip(tight[:4], roomy[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    assert tight[4]["n_rescreen_pairs"] == roomy[4]["n_rescreen_pairs"]
    # the float32 candidates of a cluster it cannot rank are typical members, whose r2 let 9,301
    # pairs through here; the bound the float64 values prove lets each row's two nearest through
    assert roomy[4]["n_rescreen_pairs"] <= 3 * roomy[4]["n_flagged"]


def test_rescreen_of_copies_far_from_the_mean_slices_its_pairs_and_stays_exact():
    # groups of exact copies in a tight cluster far from the mean, kept (no dedup): nearly every
    # pair of a group survives both screens, more than a tiny budget's pairs per block
    rng = np.random.default_rng(13)
    D = 32
    far = 300.0 * rng.normal(size=D)
    base = far + 1e-2 * rng.normal(size=(12, D))
    X = np.concatenate([np.repeat(base, 20, axis=0), rng.normal(size=(200, D)) - far]).astype(np.float32)
    got = two_nearest(X, block_size=64, memory_budget=32 * D * 8, return_info=True)
    assert got[4]["n_flagged"] >= 240
    assert_same_neighbours(X, got)
    assert np.all(got[0][:240] == 0.0) and np.all(got[1][:240] == 0.0)


def clusters_far_from_the_mean(rng, sizes, d, rest):
    """Tight clusters (sigma 1e-2..1e-4) hundreds of units from the mean, plus ``rest`` ordinary
    rows, shuffled: the float32 search cannot rank the clusters' members."""
    parts = [
        rng.normal(size=d) * rng.choice([30.0, 300.0])
        + rng.choice([1e-2, 1e-3, 1e-4]) * rng.normal(size=(s, d))
        for s in sizes
    ]
    X = np.concatenate(parts + [rng.normal(size=(rest, d))])
    return X[rng.permutation(len(X))]


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(2, 120), min_size=1, max_size=4),
    st.sampled_from([8, 32]),
    st.integers(0, 150),
    st.sampled_from([2**12, 2**16, None]),
    st.booleans(),
)
def test_rescreen_is_exact_on_clusters_at_any_budget(seed, sizes, d, rest, budget, float32):
    # several tight clusters far from the mean, ordinary rows, sometimes exact copies; budgets from
    # a few KiB (groups of rows against every column, kept pairs flushed often) to the default (the
    # flagged rows' pairs once each): always the float64 brute force, indices and ties included
    rng = np.random.default_rng(seed)
    X = clusters_far_from_the_mean(rng, sizes, d, rest)
    if seed % 3 == 0:
        X = np.concatenate([X, X[rng.integers(0, len(X), size=len(X) // 4)]])
    X = X.astype(np.float32 if float32 else np.float64)
    if len(X) < 3:
        return
    got = two_nearest(X, block_size=64, memory_budget=budget, prune=False, return_info=True)
    assert_same_neighbours(X, got)


def test_rescreen_screen_decides_the_work_not_the_result(monkeypatch):
    # The float32 screen stops early (every column kept) when the columns it could still exclude
    # cannot repay the rows it has left: stopping always, or never, gives the same answer, and the
    # full screen keeps far fewer columns on data where most rows are far from every flagged one.
    import geomscope.metrics.neighbors as nb

    rng = np.random.default_rng(21)
    X = clusters_far_from_the_mean(rng, [300, 200], 32, 900).astype(np.float32)
    kept = []
    screen = nb._screened_columns

    def spy(*args):
        kept.append(int(screen(*args).shape[0]))
        return screen(*args)

    monkeypatch.setattr(nb, "_screened_columns", spy)
    results = {}
    for cost in (0.0, math.inf):
        monkeypatch.setattr(nb, "_FLOAT64_PAIR_COST", cost)
        results[cost] = two_nearest(X, block_size=128, return_info=True, prune=False)
    assert results[0.0][4]["n_flagged"] >= 500
    assert kept[0] == len(X) and kept[1] < 600  # all columns, then the two clusters' own
    assert_same_neighbours(X, results[math.inf])
    for a, b in zip(results[0.0][:4], results[math.inf][:4], strict=True):
        np.testing.assert_array_equal(a, b)


def test_rescreen_of_a_tile_of_copies_folds_a_bounded_share_at_a_time(folds):
    # 300 exact copies far from the mean: every pair among them survives the float64 pass (89,700
    # of them), and they are recomputed and folded max(4096, budget / 1024) at a time, never all
    # at once; the answer is the brute force's, ties to the smaller index

    rng = np.random.default_rng(23)
    X = np.concatenate([np.repeat(300.0 * rng.normal(size=(1, 8)), 300, axis=0), rng.normal(size=(40, 8))])
    got = two_nearest(X.astype(np.float32), memory_budget=2**16, return_info=True, prune=False)
    assert got[4]["n_rescreen_pairs"] >= 300 * 299 and max(folds) <= 4096
    assert_same_neighbours(X.astype(np.float32), got)


def test_identical_rows_break_ties_by_the_smaller_index():
    # every float32 value is 0 after the shift, so the float32 error bound is 0 and a row whose r2
    # equals its bound must still be rescreened: the two nearest are the two smallest other indices
    for X in (
        np.full((6, 3), 5.0),
        (1e8 + 1e-3 * np.random.default_rng(24).normal(size=(7, 4))).astype(np.float32),
    ):
        got = two_nearest(X, return_info=True)
        assert_same_neighbours(X, got)
        assert np.all(got[0] == 0) and list(got[2][:2]) == [1, 0] and list(got[3][:2]) == [2, 2]


@pytest.mark.parametrize("seed", range(6))
def test_rescreen_below_float64s_normal_range(seed):
    # rows at 1e-158..1e-161 beside rows at +-1: scaled for the large rows, the small rows' squared
    # distances are subnormal in float64, where an operation's error is absolute, not relative;
    # the bounds cover it (without that, seeds 0, 1 and 4 give a wrong r2 or "lost its two nearest"). d = 1:
    # the exact distances are |x_i - x_j|, a reference without squares
    rng = np.random.default_rng(seed)
    X = np.concatenate([[[1.0], [-1.0]], rng.normal(size=(30, 1)) * [1e-160, 1e-161, 1e-158][seed % 3]])
    D = np.abs(X - X.T)
    np.fill_diagonal(D, np.inf)
    order = np.argsort(D, axis=1, kind="stable")[:, :2]
    rows = np.arange(len(X))
    for prune in (False, True):
        r1, r2, i1, i2 = two_nearest(X, prune=prune, block_size=16)
        np.testing.assert_array_equal(i1, order[:, 0])
        np.testing.assert_array_equal(i2, order[:, 1])
        np.testing.assert_allclose(r1, D[rows, order[:, 0]], rtol=1e-12, atol=0)
        np.testing.assert_allclose(r2, D[rows, order[:, 1]], rtol=1e-12, atol=0)


def test_rescreen_products_use_every_thread(monkeypatch):
    # the bandwidth-bound exact recompute runs on half the threads; the rescreen's float64 GEMMs
    # (all of the work when every row is flagged) must not inherit that
    import geomscope.metrics.neighbors as nb

    seen = []
    tile = nb._Float64Pass.tile

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return tile(self, *args, **kwargs)

    monkeypatch.setattr(nb._Float64Pass, "tile", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        X = clusters_far_from_the_mean(np.random.default_rng(22), [200], 16, 50).astype(np.float32)
        assert_same_neighbours(X, two_nearest(X, block_size=64))
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {2}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_running_best_two_folds_to_the_one_shot_best_two(seed, pieces):
    # folding a pair list in any number of pieces gives what the whole list gives at once, ties to
    # the smaller index included (distances drawn from a few values so that ties are common)
    from geomscope.metrics.neighbors import _best_two, _RunningBestTwo

    rng = np.random.default_rng(seed)
    m, n = 7, 30
    pos = np.concatenate([np.repeat(np.arange(m), 2), rng.integers(0, m, 40)])
    cols = np.concatenate([np.tile([0, 1], m), rng.integers(0, n, 40)])  # >= 2 columns per row
    keys = np.unique(np.stack([pos, cols], 1), axis=0)  # each pair once, as the rescreen gives them
    keys = keys[rng.permutation(len(keys))]
    pos, cols = keys[:, 0], keys[:, 1]
    dist = rng.choice([0.0, 0.5, 1.0, 1.5], size=len(pos))
    best = _RunningBestTwo(m, n)
    for part in np.array_split(np.arange(len(pos)), pieces):
        if len(part):
            best.fold(pos[part], cols[part], dist[part])
    rows, d1, j1, d2, j2 = _best_two(pos, cols, dist)
    np.testing.assert_array_equal(rows, np.arange(m))
    np.testing.assert_array_equal(best.dist, np.stack([d1, d2], 1))
    np.testing.assert_array_equal(best.idx, np.stack([j1, j2], 1))


def test_two_nearest_near_duplicates_at_large_common_offset():
    rng = np.random.default_rng(3)
    X = 1e4 + rng.normal(size=(250, 32))
    X[:80] = X[80:160] + 1e-7 * rng.normal(size=(80, 32))  # near-duplicates, float64 input
    assert_same_neighbours(X, two_nearest(X, block_size=32))
    X32 = (1e3 + rng.normal(size=(250, 32))).astype(np.float32)
    X32[:80] = X32[80:160] + np.float32(1e-3) * rng.normal(size=(80, 32)).astype(np.float32)
    assert_same_neighbours(X32, two_nearest(X32, block_size=32))


def test_two_nearest_float16_torch_and_tiny_inputs():
    rng = np.random.default_rng(4)
    X16 = rng.normal(size=(120, 8)).astype(np.float16)
    assert_same_neighbours(X16.astype(np.float32), two_nearest(X16), check_index=False)
    T = torch.from_numpy(rng.normal(size=(90, 6)))
    assert_same_neighbours(T.numpy(), two_nearest(T))
    X3 = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 1.0]])  # N = 3: everyone's neighbours are the others
    r1, r2, i1, i2 = two_nearest(X3)
    np.testing.assert_allclose(r1, [1.0, 3.0, 1.0], rtol=1e-15)
    np.testing.assert_allclose(r2, [3.0, np.sqrt(10.0), np.sqrt(10.0)], rtol=1e-15)
    assert list(i1) == [2, 0, 0] and list(i2) == [1, 2, 1]
    assert X3[1, 0] == 3.0  # the caller's array is not modified
    # tiny / huge magnitudes: no under/overflow of the squares
    for s in (1e-200, 1e200):
        r1, _, _, _ = two_nearest(X3 * s)
        np.testing.assert_allclose(r1 / s, [1.0, 3.0, 1.0], rtol=1e-12)


def test_two_nearest_device_path():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(150, 10)).astype(np.float32)
    assert_same_neighbours(X, two_nearest(X, device="cpu", block_size=40))
    if torch.cuda.is_available():
        assert_same_neighbours(X, two_nearest(X, device="cuda", block_size=40))
    else:
        with pytest.raises(InputError, match="no CUDA device is available"):
            two_nearest(X, device="cuda")


def test_two_nearest_bad_input_and_block_size_rule():
    with pytest.raises(DataError, match="at least 3"):
        two_nearest(np.zeros((2, 4)))
    X = np.ones((10, 3))
    X[4, 1] = np.nan
    with pytest.raises(DataError, match="NaN or Inf"):
        two_nearest(X)
    with pytest.raises(DataError, match="2-D"):
        two_nearest(np.ones(5))
    assert default_block_size(100) == 100 and default_block_size(10**7) == 64
    b = default_block_size(50_000)
    assert 64 <= b <= 4096 and b * 50_000 * 4 <= 256 * 2**20
    assert default_block_size(20_000) == 1250 and default_block_size(2000) == 1024


# ---------------------------------------------------------------- dedup


def test_dedup_rows_exact_count_order_zero_sign_and_nan():
    rng = np.random.default_rng(6)
    base = rng.normal(size=(50, 5))
    dup = np.concatenate([base, base[[3, 3, 7]], base[:10]])
    perm = rng.permutation(len(dup))
    X = dup[perm]
    U, removed, idx = dedup_rows(X)
    assert removed == 13 and U.shape == (50, 5)
    np.testing.assert_array_equal(U, X[idx])
    assert np.all(np.diff(idx) > 0)
    # first occurrences kept
    seen = {}
    for i, row in enumerate(map(bytes, X)):
        seen.setdefault(row, i)
    assert sorted(seen.values()) == list(idx)
    Z = np.array([[0.0, 1.0], [-0.0, 1.0], [np.nan, 2.0], [np.nan, 2.0], [1e-300, 1.0]])
    _, removed, idx = dedup_rows(Z)
    assert removed == 2 and list(idx) == [0, 2, 4]
    # float32 rows that differ only below float32 precision are distinct after float64 input ...
    W = np.array([[1.0, 2.0], [1.0 + 1e-12, 2.0], [1.0, 2.0]])
    assert dedup_rows(W)[1] == 1
    # ... and float16 storage is compared exactly in float32
    assert dedup_rows(W.astype(np.float16))[1] == 2


# ---------------------------------------------------------------- TwoNN vs scikit-dimension


@pytest.mark.parametrize("estimator,discard", [("linear", 0.1), ("linear", 0.3), ("mle", 0.1), ("mle", 0.0)])
def test_twonn_matches_scikit_dimension_on_duplicate_free_data(estimator, discard):
    import skdim

    rng = np.random.default_rng(7)
    X = embed(rng.normal(size=(1500, 8)), 40, rng) + 5.0
    ours = twonn(X, discard_fraction=discard, estimator=estimator)
    ref = skdim.id.TwoNN(discard_fraction=discard, method=estimator).fit(X).dimension_
    assert ours.n_duplicates_removed == 0 and ours.n_used == 1500
    assert abs(ours.dimension / ref - 1) < 1e-6  # brief asks 2 %; exact neighbours agree far closer


def test_fit_mu_definitions():
    rng = np.random.default_rng(8)
    mu = 1.0 + rng.pareto(6.0, size=1000)
    n = mu.size
    x = np.log(np.sort(mu))
    d_mle, k = fit_mu(mu, 0.0, "mle")
    assert k == n and d_mle == pytest.approx((n - 1) / x.sum(), rel=1e-12)
    d_lin, k = fit_mu(mu, 0.1, "linear")
    k_ref = int(n * 0.9)
    y = -np.log(1 - np.arange(1, k_ref + 1) / n)
    slope = np.linalg.lstsq(x[:k_ref, None], y, rcond=None)[0][0]
    assert k == k_ref and d_lin == pytest.approx(slope, rel=1e-12)
    assert d_mle == pytest.approx(6.0, rel=0.1) and d_lin == pytest.approx(6.0, rel=0.1)


def test_twonn_not_fooled_by_duplicates_where_scikit_dimension_is():
    import skdim

    rng = np.random.default_rng(9)
    n, dup = 2000, 400  # 20 % duplicated rows, 10-d subspace of R^64
    X = embed(rng.normal(size=(n, 10)), 64, rng)
    X[n - dup :] = X[:dup]
    X = X[rng.permutation(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = skdim.id.TwoNN().fit(X).dimension_
    res = twonn(X)
    assert res.n_duplicates_removed == dup and res.n_used == n - dup and res.n_points == n
    assert abs(res.dimension - 10) < 1.0
    assert abs(ref - 10) > 5  # scikit-dimension 0.5.0 reads ~0.1 here
    with pytest.raises(DataError, match="dedup=True"):
        twonn(X, dedup=False)


@pytest.mark.parametrize("d", [2, 5, 10])
def test_twonn_recovers_dimension_of_uniform_sphere(d):
    rng = np.random.default_rng(10 + d)
    X = embed(sphere(4000, d, rng), 3 * d + 10, rng) + rng.normal(size=3 * d + 10)
    for est in ("linear", "mle"):
        assert twonn(X, estimator=est).dimension == pytest.approx(d, rel=0.10)


def test_twonn_recovers_dimension_of_flat_manifolds():
    rng = np.random.default_rng(20)
    for d in (2, 5):  # uniform in a d-ball, linearly embedded
        g = rng.normal(size=(4000, d))
        ball = g / np.linalg.norm(g, axis=1, keepdims=True) * rng.uniform(size=(4000, 1)) ** (1 / d)
        assert twonn(embed(ball, 30, rng)).dimension == pytest.approx(d, rel=0.10)
    t = rng.uniform(1.5 * np.pi, 4.5 * np.pi, 4000)  # swiss roll, a 2-manifold in R^3
    roll = np.stack([t * np.cos(t), 20 * rng.uniform(size=4000), t * np.sin(t)], 1)
    assert twonn(roll).dimension == pytest.approx(2, rel=0.10)


# ---------------------------------------------------------------- invariances (hypothesis)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(30, 160),
    d=st.integers(2, 12),
    shift=st.floats(-50, 50),
    log2_scale=st.integers(-20, 20),
    scale=st.floats(0.01, 100),
)
def test_twonn_invariances(seed, n, d, shift, log2_scale, scale):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    ref = twonn(X, estimator="mle").dimension
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    assert twonn(X @ Q, estimator="mle").dimension == pytest.approx(ref, rel=1e-7)
    assert twonn(X + shift * rng.normal(size=d), estimator="mle").dimension == pytest.approx(ref, rel=1e-7)
    assert twonn(X * 2.0**log2_scale, estimator="mle").dimension == ref  # exact in binary
    assert twonn(X * scale, estimator="mle").dimension == pytest.approx(ref, rel=1e-9)
    assert twonn(X[rng.permutation(n)], estimator="mle").dimension == ref
    lin = twonn(X).dimension
    assert twonn(X[rng.permutation(n)]).dimension == lin


# ---------------------------------------------------------------- errors, bad input, API


def test_twonn_error_methods():
    rng = np.random.default_rng(11)
    X = embed(sphere(3000, 4, rng), 20, rng)
    est, se, method = twonn_error(X, estimator="mle", discard_fraction=0.0, seed=1)
    assert est == twonn(X, estimator="mle", discard_fraction=0.0).dimension
    assert 0.6 < se / (est / np.sqrt(3000)) < 1.6  # Pareto MLE: SE ~ d / sqrt(N)
    assert "bootstrap" in method and "seed=1" in method and "mle" in method
    assert twonn_error(X, estimator="mle", discard_fraction=0.0, seed=1) == (est, se, method)
    est2, se2, method2 = twonn_error(X, method="decimation", n_splits=4, seed=2)
    assert est2 == twonn(X).dimension and 0 < se2 < 0.5 and "decimation" in method2
    with pytest.raises(InputError, match="bootstrap"):
        twonn_error(X, method="jackknife")


def test_twonn_bad_input_is_a_data_error():
    rng = np.random.default_rng(12)
    X = rng.normal(size=(200, 16))
    with pytest.raises(DataError, match="looks transposed"):
        twonn(X.T, expect_dim=16)
    with pytest.raises(DataError, match="D=32"):
        twonn(X, expect_dim=32)
    with pytest.raises(DataError, match="fewer rows"):
        twonn(X[:10], allow_wide=False)
    with pytest.raises(DataError, match="D >= 2"):
        twonn(X[:, :1])
    with pytest.raises(DataError, match="2 distinct"):
        twonn(np.repeat(X[:2], 5, axis=0))
    bad = X.copy()
    bad[3, 3] = np.inf
    with pytest.raises(DataError, match="NaN or Inf"):
        twonn(bad)
    with pytest.raises(InputError, match="discard_fraction"):
        twonn(X, discard_fraction=1.0)
    with pytest.raises(InputError, match="mle"):
        twonn(X, discard_fraction=0.0)  # linear fit needs F_i < 1
    with pytest.raises(InputError, match="unknown TwoNN estimator"):
        twonn(X, estimator="ols")


def test_twonn_result_and_sklearn_style_class():
    rng = np.random.default_rng(13)
    X = embed(rng.normal(size=(600, 6)), 24, rng)
    X = np.concatenate([X, X[:25]])
    res = twonn(X, max_points=500, seed=3)
    assert res.subsampled_from == 625 and res.n_points == 625 and res.n_used + res.n_duplicates_removed == 500
    assert res.f_convention == "F_i = i/N" and res.n_fit == int(res.n_used * 0.9)
    assert res.as_dict() == twonn(X, max_points=500, seed=3).as_dict()  # seeded
    rec = res.as_dict()
    assert rec["estimator"] == "linear" and rec["discard_fraction"] == 0.1 and "mu" not in rec
    m = TwoNN(estimator="mle")
    assert m.fit(X) is m
    assert m.n_duplicates_removed_ == 25 and m.dimension_ == twonn(X, estimator="mle").dimension
    assert m.result_.n_used == 600
