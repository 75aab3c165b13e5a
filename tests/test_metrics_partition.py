"""Partition isotropy I(W): brute force where exp does not overflow, no overflow for large norms."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.errors import DataError
from geomscope.metrics import partition_isotropy, partition_log_z


def _brute(w, centred=False):
    w = np.asarray(w, dtype=np.float64)
    if centred:
        w = w - w.mean(0)
    _, vecs = np.linalg.eigh(w.T @ w)
    z = [np.exp(w @ (s * vecs[:, j])).sum() for s in (1, -1) for j in range(w.shape[1])]
    return min(z) / max(z), np.log(z)


@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("v,d,seed", [(50, 4, 0), (200, 16, 1), (30, 40, 2)])
def test_matches_brute_force(v, d, seed, centred):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((v, d)) * 0.5 + 0.3
    i_ref, logz_ref = _brute(w, centred)
    r = partition_isotropy(w, centred)
    assert r["I"] == pytest.approx(i_ref, rel=1e-10)
    assert r["n_directions"] == 2 * d and r["centred"] is centred
    log_z, _ = partition_log_z(w, centred, block=3)  # odd block size exercises the blocking
    np.testing.assert_allclose(np.sort(log_z), np.sort(logz_ref), rtol=1e-12)
    assert r["log_z_min"] == pytest.approx(logz_ref.min()) and r["log_z_max"] == pytest.approx(logz_ref.max())


def test_symmetric_vocabulary_is_sign_balanced():
    w = np.random.default_rng(3).standard_normal((40, 5))
    w = np.vstack([w, -w])  # Z(c) = Z(-c) for every c; centring changes nothing
    log_z, _ = partition_log_z(w)
    np.testing.assert_allclose(log_z[:5], log_z[5:], rtol=1e-12)
    assert partition_isotropy(w)["I"] == pytest.approx(partition_isotropy(w, centred=True)["I"])


def test_common_offset_lowers_raw_isotropy_but_not_centred():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((500, 8)) * 0.3
    shifted = w + 2.0 * rng.standard_normal(8)
    assert partition_isotropy(shifted)["I"] < 0.01 * partition_isotropy(w)["I"]
    assert partition_isotropy(shifted, centred=True)["I"] == pytest.approx(
        partition_isotropy(w, centred=True)["I"], rel=1e-9
    )


def test_large_norm_does_not_overflow():
    w = np.random.default_rng(5).standard_normal((100, 6)) * 1e3
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.exp(w).sum())  # plain exp would overflow here
    r = partition_isotropy(w)
    assert np.isfinite(r["log_z_max"]) and r["log_z_max"] > 700
    assert 0.0 <= r["I"] <= 1.0


def test_bad_input():
    with pytest.raises(DataError, match="at least 2"):
        partition_isotropy(np.ones((1, 4)))
    with pytest.raises(DataError, match="zero total variance"):
        partition_isotropy(np.ones((5, 3)), centred=True)
    with pytest.raises(DataError, match="all zeros"):
        partition_isotropy(np.zeros((5, 3)))
    w = np.ones((5, 3))
    w[0, 0] = np.nan
    with pytest.raises(DataError, match="1 of 5 rows"):
        partition_isotropy(w)


@pytest.mark.parametrize("value", [0.5, 0.1, 1e-3, 123.456])
def test_centred_identical_rows_are_refused_whatever_their_value(value):
    # 0.5s centre to exact zeros (refused), 0.1s to a rounding residue that read I = 1.0: the library's
    # zero-variance rule (std under 2e-13 of the mean) refuses both, as IsoScore does
    w = np.full((7, 3), value)
    with pytest.raises(DataError, match="zero total variance"):
        partition_isotropy(w, centred=True)
    # the raw partition function of identical rows is defined: Z(c) = V exp(c . w)
    i_ref, _ = _brute(w)
    assert partition_isotropy(w)["I"] == pytest.approx(i_ref, rel=1e-10)


@pytest.mark.parametrize("scale", [1e155, 1e200, 1e-170])
def test_any_finite_scale(scale):
    # W^T W overflowed at 1e155 (LinAlgError); the eigenvectors do not depend on W's scale, so
    # log Z at scale a is logsumexp(a W v) with v from W itself
    from scipy.special import logsumexp

    rng = np.random.default_rng(0)
    w = rng.standard_normal((500, 16)) * np.geomspace(2, 0.2, 16) + 0.3
    _, vecs = np.linalg.eigh(w.T @ w)
    p = (w * scale) @ vecs
    want = np.concatenate([logsumexp(p, axis=0), logsumexp(-p, axis=0)])
    log_z, _ = partition_log_z(w * scale)
    np.testing.assert_allclose(np.sort(log_z), np.sort(want), rtol=1e-10)
    r = partition_isotropy(w * scale)
    assert r["log_z_max"] == pytest.approx(want.max(), rel=1e-10)
    assert r["I"] == pytest.approx(np.exp(want.min() - want.max()), rel=1e-8, abs=0.0)
