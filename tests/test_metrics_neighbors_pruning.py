"""Exact candidate pruning in the two-nearest-neighbour search: same answer as brute force.

The pruned search (lower bounds from the top principal directions + the residual norm) must give
exactly the float64 brute-force r1, r2 and indices (ties by the smaller index), whatever the data;
the automatic choice must use it on fast-decaying spectra and keep brute force on isotropic data.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import cdist
from test_metrics_twonn import assert_same_neighbours as assert_exact
from test_metrics_twonn import brute

from geomscope.metrics import neighbors as nb
from geomscope.metrics.neighbors import two_nearest
from geomscope.metrics.twonn import twonn


def low_rank(n, d, intrinsic, noise, rng, dtype=np.float32):
    """A random ``intrinsic``-dim Gaussian subspace of R^d plus isotropic noise: a decaying spectrum."""
    z = rng.standard_normal((n, intrinsic))
    basis = rng.standard_normal((intrinsic, d)) / np.sqrt(intrinsic)
    return (z @ basis + noise * rng.standard_normal((n, d))).astype(dtype)


def pruned(X, **kw):
    got = two_nearest(X, prune=True, return_info=True, **kw)
    assert got[4]["pruned"] and got[4]["n_exact_pairs"] >= X.shape[0]
    return got


def test_pruned_equals_brute_force_on_a_decaying_spectrum():
    rng = np.random.default_rng(0)
    X = low_rank(1500, 96, 6, 0.05, rng)
    got = pruned(X, block_size=256)
    assert_exact(X, got)
    # the point of pruning: only a small fraction of the pairs is computed exactly
    assert got[4]["pair_fraction"] < 0.05
    assert_exact(X, two_nearest(X, prune=False))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pruned_with_exact_and_near_duplicates(dtype):
    rng = np.random.default_rng(1)
    X = low_rank(900, 64, 5, 0.02, rng, dtype)
    X[600:660] = X[:60]  # exact duplicate pairs: r1 = 0
    X[660:670] = X[100]  # a group of copies
    X[670:730] = X[200:260] + dtype(1e-6) * rng.standard_normal((60, 64)).astype(dtype)  # near-duplicates
    got = pruned(X, block_size=128)
    assert_exact(X, got)
    assert np.all(got[0][:60] == 0.0) and np.all(got[0][660:670] == 0.0)


def test_pruned_with_ties_on_a_grid():
    # integer grid points, zero-padded to 40 columns: many exactly equal distances; the tie-break
    # (smaller index first) must match the brute-force reference
    g = np.stack(np.meshgrid(*[np.arange(6.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
    X = np.zeros((g.shape[0], 40), dtype=np.float32)
    X[:, :3] = g
    X = X[np.random.default_rng(2).permutation(len(X))]
    assert_exact(X, pruned(X, block_size=50))


def test_pruned_float32_trap_cluster_far_from_the_mean():
    # a tight cluster far from the mean (the MiniLM [CLS] pattern): the float32 lower bounds carry
    # errors far above the cluster's distances; the thresholds must absorb them
    rng = np.random.default_rng(3)
    D = 48
    far = 300.0 * rng.normal(size=D)
    cluster = far + 1e-2 * rng.normal(size=(150, D))
    rest = low_rank(350, D, 4, 0.1, rng, np.float64) - far
    X = np.concatenate([cluster, rest]).astype(np.float32)
    assert_exact(X, pruned(X, block_size=64))


def test_pruned_on_isotropic_data_and_extreme_scales():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((400, 32))  # nothing to prune: still exact
    assert_exact(X, pruned(X, block_size=100))
    Y = low_rank(300, 24, 3, 0.01, rng, np.float64)
    b1, b2, j1, j2 = brute(Y)  # scipy's own squares would under/overflow at these scales
    for s in (1e-200, 1e200):  # the float32 copy is rescaled by a power of two
        r1, r2, i1, i2, _ = pruned(Y * s, block_size=64)
        np.testing.assert_allclose(r1 / s, b1, rtol=1e-12)
        np.testing.assert_allclose(r2 / s, b2, rtol=1e-12)
        np.testing.assert_array_equal(i1, j1)
        np.testing.assert_array_equal(i2, j2)
    Z = 1e4 + low_rank(300, 24, 3, 0.01, rng, np.float64)  # large common offset, float64 input
    assert_exact(Z, pruned(Z, block_size=64))


def test_lower_bound_never_exceeds_the_distance_plus_its_slack():
    # the certificate's inequality, checked directly: V <= (1 + delta) |x - y|^2 + c (|a_x|^2 + |a_y|^2)
    rng = np.random.default_rng(5)
    X = np.concatenate([low_rank(300, 64, 5, 0.05, rng, np.float64), 50 + 1e-3 * rng.normal(size=(100, 64))])
    x32 = torch.from_numpy(X.astype(np.float32))
    W = nb._principal_directions(x32, 8)
    np.testing.assert_allclose(W.T @ W, np.eye(8), atol=1e-13)
    a32, na = nb._lower_bound_rows(x32, W, 128)
    delta, c = nb._lower_bound_slack(W, 64)
    n32 = na.float()
    V = torch.addmm(n32[None, :], a32, a32.T, alpha=-2.0).add_(n32[:, None]).double().numpy()
    x = x32.double().numpy()
    d2 = cdist(x, x) ** 2
    slack = c * (na.numpy()[:, None] + na.numpy()[None, :])
    assert np.all(V <= (1 + delta) * d2 + slack)
    # and the bound is informative: on the low-rank rows it is close to the distance
    lo = V[:300, :300][~np.eye(300, dtype=bool)] / d2[:300, :300][~np.eye(300, dtype=bool)]
    assert np.median(lo) > 0.8


def test_automatic_choice_prunes_decaying_spectra_and_keeps_brute_force_on_isotropic_data():
    rng = np.random.default_rng(6)
    n = nb.PRUNE_MIN_ROWS + 100
    X = low_rank(n, 384, 8, 0.05, rng)
    got = two_nearest(X, return_info=True)
    assert got[4]["pruned"] and got[4]["pair_fraction"] < 0.01
    assert_exact(X, got)
    Y = rng.standard_normal((n, 384)).astype(np.float32)
    got = two_nearest(Y, return_info=True)
    assert not got[4]["pruned"] and got[4]["prune_speedup_estimate"] < 1.0
    small = two_nearest(X[:1000], return_info=True)  # brute force is cheap there: no estimate
    assert not small[4]["pruned"] and "prune_speedup_estimate" not in small[4]


def test_twonn_same_result_with_and_without_pruning():
    rng = np.random.default_rng(7)
    X = low_rank(1200, 80, 6, 0.05, rng)
    a, b = twonn(X, prune=True), twonn(X, prune=False)
    assert a.neighbor_info["pruned"] and not b.neighbor_info["pruned"]
    np.testing.assert_array_equal(a.mu, b.mu)
    assert a.dimension == b.dimension


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 120),
    d=st.integers(2, 24),
    intrinsic=st.integers(1, 4),
    noise=st.sampled_from([0.0, 1e-6, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
    block=st.integers(1, 64),
)
def test_pruned_equals_brute_force_property(n, d, intrinsic, noise, seed, block):
    rng = np.random.default_rng(seed)
    X = low_rank(n, d, min(intrinsic, d), noise, rng, np.float64)
    if noise == 0.0 and n > 10:
        X[n // 2] = X[0]  # an exact duplicate among exactly low-rank points
    assert_exact(X, pruned(X, block_size=block))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pruned_on_cuda_equals_brute_force():
    rng = np.random.default_rng(8)
    X = low_rank(800, 64, 5, 0.05, rng)
    assert_exact(X, pruned(X, device="cuda", block_size=128))
