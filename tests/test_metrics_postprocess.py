"""geomscope.metrics.postprocess: all-but-the-top and whitening against transforms written here from
the papers (Mu & Viswanath 2018: subtract the mean, remove the projections on the top principal
components of an SVD; ZCA whitening from the SVD), IsoScore from the published algorithm and the
average cosine over all pairs."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.errors import DataError, InputError
from geomscope.metrics import isoscore_published
from geomscope.metrics.postprocess import (
    RemovedTopUnitSums,
    WhitenedUnitSums,
    check_ks,
    eigh_descending,
    removed_top_isoscores,
    whitened_isoscores,
    whitening_map,
)


def _rows(n=300, d=9, seed=0, offset=3.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * np.linspace(0.4, 3.0, d) + offset
    x[:, 2] += 4.0 * rng.normal(size=n)  # one dominant direction
    return x


def abtt_reference(x, k):
    """Mu & Viswanath's postprocessing: x~ = x - mean; u_1..u_k = top right singular vectors of the
    centred rows; x' = x~ - sum_i (u_i^T x~) u_i."""
    y = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(y, full_matrices=False)
    u = vt[:k].T
    return y - y @ u @ u.T


def zca_reference(x):
    """ZCA whitening from the SVD of the centred rows: C^{-1/2} (x - mean), C = V S^2 V^T / (n - 1),
    over the directions whose variance exceeds the largest times D eps (the rank the docs define)."""
    y = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(y, full_matrices=False)
    keep = s**2 > s[0] ** 2 * x.shape[1] * np.finfo(np.float64).eps
    v, s = vt[keep].T, s[keep]
    return y @ v @ np.diag(np.sqrt(len(x) - 1) / s) @ v.T


def pairs_avgcos(z):
    norms = np.linalg.norm(z, axis=1)
    u = z[norms > 1e-12] / norms[norms > 1e-12, None]
    n = len(u)
    g = u @ u.T
    return (g.sum() - np.trace(g)) / (n * (n - 1))


def star_reference(z, zeta, c0=None):
    c = np.cov(z.T, ddof=1)
    d = c.shape[0]
    c0 = np.eye(d) * np.trace(c) / d if c0 is None else c0
    return iso_of_cov((1 - zeta) * c + zeta * c0)


def iso_of_cov(c):
    """Rudman et al.'s IsoScore of a covariance: normalise its eigenvalues to norm sqrt(D), defect,
    dimensions used k, (k - 1)/(D - 1) (the published steps, from the eigenvalues)."""
    lam = np.linalg.svd(c, compute_uv=False)
    d = float(c.shape[0])
    hat = lam * np.sqrt(d) / np.linalg.norm(lam)
    defect = np.linalg.norm(hat - 1.0) / np.sqrt(2.0 * (d - np.sqrt(d)))
    k = (d - defect**2 * (d - np.sqrt(d))) ** 2 / d
    return (k - 1.0) / (d - 1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_removed_top_isoscores_match_the_processed_rows(seed):
    x = _rows(seed=seed)
    c = np.cov(x.T, ddof=1)
    got = removed_top_isoscores(c, (1, 3, 8), 0.2)
    for k, (iso, star) in got.items():
        z = abtt_reference(x, k)
        assert iso == pytest.approx(isoscore_published(z), abs=1e-10)
        assert star == pytest.approx(star_reference(z, 0.2), abs=1e-10)


def test_removed_top_with_a_covariance_target_processes_the_target():
    x = _rows()
    c0 = np.cov(_rows(seed=5, offset=0).T)
    k = 2
    iso, star = removed_top_isoscores(np.cov(x.T), (k,), 0.3, c0)[k]
    _, _, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    p = np.eye(x.shape[1]) - vt[:k].T @ vt[:k]
    assert star == pytest.approx(star_reference(abtt_reference(x, k), 0.3, p @ c0 @ p), abs=1e-10)


def test_whitened_isoscores():
    x = _rows()
    iso, star, r = whitened_isoscores(np.cov(x.T), 0.2)
    z = zca_reference(x)
    assert r == x.shape[1] and iso == 1.0 and star == 1.0
    assert isoscore_published(z) == pytest.approx(1.0, abs=1e-10)
    # rank-limited: N = 5 rows in D = 9 whiten into 4 directions, IsoScore (4 - 1)/(9 - 1)
    few = x[:5]
    iso, star, r = whitened_isoscores(np.cov(few.T), 0.2)
    assert r == 4 and iso == pytest.approx(3 / 8, abs=1e-12)
    assert iso == pytest.approx(isoscore_published(zca_reference(few)), abs=1e-9)
    assert star == pytest.approx(star_reference(zca_reference(few), 0.2), abs=1e-9)
    c0 = np.cov(_rows(seed=3).T)
    w = zca_reference(x)  # the target is whitened as the rows are
    lam, vec = eigh_descending(np.cov(x.T))
    wmat = vec @ np.diag(lam**-0.5) @ vec.T
    assert whitened_isoscores(np.cov(x.T), 0.4, c0)[1] == pytest.approx(
        star_reference(w, 0.4, wmat @ c0 @ wmat.T), abs=1e-10
    )


def _replicates(x, groups, n_groups):
    subsets = [groups != r for r in range(n_groups)] + [np.ones(len(x), bool)]
    shifts, bases, maps = [], [], []
    for s in subsets:
        lam, vec = eigh_descending(np.cov(x[s].T))
        shifts.append(x[s].mean(0))
        bases.append(vec[:, :4])
        maps.append(whitening_map(lam, vec))
    return subsets, shifts, bases, maps


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_second_pass_sums_match_every_replicate(dtype):
    x = _rows(n=700).astype(dtype)
    groups = np.arange(700) % 4
    subsets, shifts, bases, maps = _replicates(x.astype(np.float64), groups, 4)
    abtt = RemovedTopUnitSums(shifts, bases, (1, 4))
    white = WhitenedUnitSums(shifts, maps)
    half = abtt.fresh().update(x[:333], groups[:333])
    abtt.update(x[333:], groups[333:]).merge(half)
    white.update(x, groups)
    x64 = x.astype(np.float64)
    for r, s in enumerate(subsets):
        for k in (1, 4):
            assert abtt.avgcos(r, k) == pytest.approx(pairs_avgcos(abtt_reference(x64[s], k)), abs=1e-12)
            assert abtt.n_unit(r, k) == s.sum()
        assert white.avgcos(r) == pytest.approx(pairs_avgcos(zca_reference(x64[s])), abs=1e-12)


def test_rows_without_a_direction_are_left_out():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 5))
    m = rng.normal(size=5)
    x[:7] = m + x[:7, :1] * np.array([1.0, 0, 0, 0, 0])  # the shift plus a multiple of e_1
    x[7:9] = m  # exactly the shift
    groups = np.zeros(50, int)
    top = np.zeros((1, 5, 1))
    top[0, 0, 0] = 1.0
    sums = RemovedTopUnitSums([m], top, (1,)).update(x, groups)
    assert sums.n_unit(0, 1) == 50 - 9
    lam, vec = eigh_descending(np.cov(x.T))
    white = WhitenedUnitSums([m], [whitening_map(lam, vec)]).update(x, groups)
    assert white.n_unit(0) == 50 - 2


def test_bad_input():
    with pytest.raises(InputError, match="below 5"):
        check_ks((1, 5), 5)
    with pytest.raises(InputError, match="k >= 1"):
        check_ks((0,), 5)
    assert check_ks((3, 1, 3), 5) == (1, 3)
    x = _rows(n=4, d=6)  # rank 3: removing 3 leaves nothing
    with pytest.raises(DataError, match="leaves no variance"):
        removed_top_isoscores(np.cov(x.T), (3,), 0.2)
    with pytest.raises(DataError, match="nothing to whiten"):
        whitened_isoscores(np.zeros((3, 3)), 0.2)
