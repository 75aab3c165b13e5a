"""The pruned search's one-scan pass: the guessed margin decides only the cost, never the result.

Each band of rows is scanned once against a guess (min_j S_ij + margin); rows the guess does not
cover are redone on their full row. Whatever the margin -- none, negative, zero, huge -- and
however ties, duplicates and near-duplicates fall across bands, the result must be the float64
brute force's (r1, r2 and indices, ties by the smaller index).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_metrics_neighbors_pruning import low_rank
from test_metrics_twonn import assert_same_neighbours as assert_exact

from geomscope.metrics import neighbors as nb
from geomscope.metrics.neighbors import two_nearest


def pruned(X, **kw):
    got = two_nearest(X, prune=True, return_info=True, **kw)
    assert got[4]["pruned"]
    return got


def fixed_margin(monkeypatch, margin):
    """Replace the learnt guess by a fixed margin (after the first, dense band)."""

    def learn(self, gaps):
        self.margin = margin

    monkeypatch.setattr(nb._PrunedPass, "learn", learn)


def test_learnt_guess_scans_most_rows_once_and_stays_exact():
    rng = np.random.default_rng(10)
    X = low_rank(2400, 64, 6, 0.05, rng)
    got = pruned(X, block_size=64)
    assert_exact(X, got)
    n_dense = got[4]["prune_dense_rows"]
    # the first band (N / 8 rows here), done densely, teaches the guess; about one row in ten is
    # redone after it
    assert 2400 // 8 < n_dense < 2400 // 8 + 0.3 * (2400 - 2400 // 8)


@pytest.mark.parametrize("margin", [-1.0, 0.0, 1e-3, 1e30])
def test_any_margin_gives_the_brute_force_answer(monkeypatch, margin):
    # negative or zero: P has fewer than two entries for (almost) every row, which is redone in
    # full; 1e-3: P a few entries per row; huge: every pair is within the guess, more than P may
    # hold per row (``_GUESS_MAX_ENTRIES``), so every row is redone in full
    fixed_margin(monkeypatch, margin)
    rng = np.random.default_rng(11)
    X = low_rank(700, 40, 5, 0.05, rng)
    got = pruned(X, block_size=32)
    assert_exact(X, got)
    if margin >= 1e30:  # every row has more entries within its guess than P may hold
        assert got[4]["prune_dense_rows"] == 700
    if margin <= 0.0:
        assert got[4]["prune_dense_rows"] > 600


@pytest.mark.parametrize("margin", [None, 0.0, 1e30])
def test_ties_and_duplicate_groups_spread_over_bands(monkeypatch, margin):
    if margin is not None:
        fixed_margin(monkeypatch, margin)
    rng = np.random.default_rng(12)
    # integer grid points (many exactly equal distances) plus copies of some of them placed far
    # apart in index order, so a row and its copies sit in different bands
    g = np.stack(np.meshgrid(*[np.arange(7.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
    X = np.zeros((g.shape[0], 24), dtype=np.float32)
    X[:, :3] = g
    X = X[rng.permutation(len(X))]
    X = np.concatenate([X, X[[5, 5, 5, 40, 41]], X[::50]])  # a group of 4 copies, pairs, ...
    X = X[rng.permutation(len(X))]
    got = pruned(X, block_size=16)
    assert_exact(X, got)
    assert np.count_nonzero(got[0] == 0.0) >= 4 + 2 * 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_near_duplicates_far_from_the_mean_with_the_guess(monkeypatch, dtype):
    # a tight cluster far from the mean: the lower bounds' float32 slack dominates its distances,
    # so the cluster's thresholds exceed any guess learnt on the other rows
    rng = np.random.default_rng(13)
    D = 32
    far = 300.0 * rng.normal(size=D)
    cluster = far + 1e-3 * rng.normal(size=(120, D))
    rest = low_rank(900, D, 4, 0.1, rng, np.float64) - far
    X = np.concatenate([rest[:450], cluster, rest[450:]]).astype(dtype)
    X[700] = X[460]  # and an exact duplicate inside the cluster
    assert_exact(X, pruned(X, block_size=32))


def test_a_wide_guess_fills_p_below_its_cap(monkeypatch):
    # with the cap lifted, a guess that takes every pair into P: the thresholds alone filter it
    monkeypatch.setattr(nb, "_GUESS_MAX_ENTRIES", 10**9)
    fixed_margin(monkeypatch, 1e30)
    rng = np.random.default_rng(15)
    X = low_rank(500, 32, 4, 0.05, rng)
    got = pruned(X, block_size=32)
    assert_exact(X, got)
    assert got[4]["prune_dense_rows"] == 500 // 8  # only the first band


def test_exact_pairs_are_computed_once_per_unordered_pair():
    # mutual neighbours: row i's candidate pair (i, j) is reused for j's survivors; the reuse must
    # not change any distance (sqrt(sum((x_j - x_i)^2)) is symmetric in floating point)
    rng = np.random.default_rng(14)
    X = low_rank(600, 48, 5, 0.05, rng, np.float64)
    X = np.concatenate([X, X[:300] + 1e-9 * rng.normal(size=(300, 48))])  # mutual pairs
    assert_exact(X, pruned(X, block_size=32))


def test_strip_threads_prefer_the_faster_option_and_restore_the_setting():
    import torch

    total = torch.get_num_threads()
    st = nb._StripThreads(torch.device("cpu"))
    if total < 2:
        assert st.pick() is None
        return
    assert st.pick() == total  # untried options first
    st.mean[total] = 1.0
    assert st.pick() == 1
    st.mean[1] = 3.0  # one thread slower: all threads, the other tried once after 8, 16, ... strips
    picks = [st.pick() for _ in range(8 + 1 + 16 + 1)]
    assert picks == [total] * 8 + [1] + [total] * 16 + [1]
    st.mean[1] = 0.5  # now one thread is faster
    assert st.pick() == 1
    with st.using(1, rows=10):
        assert torch.get_num_threads() == 1
    assert st.mean[1] < 0.5  # the running mean moved towards the (short) measured time
    with st.using(None):
        assert torch.get_num_threads() == 1  # kept until restored: changing it can cost a re-init
    st.restore()
    assert torch.get_num_threads() == total
