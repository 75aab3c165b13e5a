"""Spectrum summaries against numpy on known spectra; clipping; bad input."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.errors import DataError
from geomscope.metrics import effective_rank, eigenvalues, isoscore_from_cov, participation_ratio, spectrum


def _cov_with(lam, seed=0):
    d = len(lam)
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return (q * np.asarray(lam, dtype=float)) @ q.T


def test_known_spectrum():
    lam = np.array([8.0, 4.0, 2.0, 1.0, 1.0, 0.0])
    s = spectrum(_cov_with(lam), top_k=(1, 2, 5, 10))
    np.testing.assert_allclose(s["eigenvalues"], lam, atol=1e-12)
    np.testing.assert_allclose(s["explained"], lam / 16.0, atol=1e-13)
    assert s["pr"] == pytest.approx(16.0**2 / (64 + 16 + 4 + 1 + 1))
    p = lam[lam > 0] / 16.0
    assert s["erank"] == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-9)
    assert s["top_k_share"] == pytest.approx({1: 0.5, 2: 0.75, 5: 1.0, 10: 1.0})
    assert "top-10 share is over all 6 dimensions" in s["note"]
    assert s["erank_of"] == "covariance eigenvalues"


@pytest.mark.parametrize("k,d", [(1, 4), (3, 7), (5, 5)])
def test_equal_eigenvalues(k, d):
    c = _cov_with([2.5] * k + [0.0] * (d - k), seed=k)
    assert participation_ratio(c) == pytest.approx(k)
    assert effective_rank(c) == pytest.approx(k, rel=1e-6)  # tiny negative rounding clipped to 0
    assert isoscore_from_cov(c) == pytest.approx((participation_ratio(c) - 1) / (d - 1))


def test_against_numpy_on_data():
    x = np.random.default_rng(1).standard_normal((500, 20)) * np.geomspace(5, 0.1, 20)
    c = np.cov(x.T)
    s = spectrum(c)
    ref = np.sort(np.linalg.eigvals(c).real)[::-1]
    np.testing.assert_allclose(s["eigenvalues"], ref, rtol=1e-9)
    assert s["top_k_share"][5] == pytest.approx(ref[:5].sum() / ref.sum())
    assert 1 <= s["erank"] <= 20 and 1 <= s["pr"] <= s["erank"] + 1e-9  # PR <= erank (Renyi-2 <= Shannon)


def test_negative_eigenvalues_are_clipped_and_reported():
    c = np.diag([3.0, 1.0, -1e-14])
    lam, info = eigenvalues(c)
    assert lam[-1] == 0.0 and info["n_clipped"] == 1 and info["min_raw"] == pytest.approx(-1e-14)
    assert "1 negative eigenvalue" in spectrum(c)["note"]


def test_bad_input():
    with pytest.raises(DataError, match="zero total variance"):
        spectrum(np.zeros((3, 3)))
    with pytest.raises(DataError, match="square"):
        participation_ratio(np.ones((2, 3)))
    with pytest.raises(DataError, match="NaN"):
        effective_rank(np.array([[1.0, np.nan], [np.nan, 1.0]]))
    with pytest.raises(DataError, match="k >= 1"):
        spectrum(np.eye(3), top_k=(0,))
