"""Conformance of every registered intrinsic-dimension estimator (geomscope.metrics.intrinsic)."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.errors import DataError, InputError
from geomscope.metrics.intrinsic import ID_ESTIMATORS, IDResult, estimate_id


def subspace_sample(n=500, d=5, D=20, seed=0):
    """Gaussian points in a random d-dimensional linear subspace of R^D, offset from the origin."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(D, d)))
    return rng.normal(size=(n, d)) @ Q.T + 3.0


def test_registry_holds_twonn_and_scikit_dimension_estimators():
    assert {"twonn", "mle", "lpca", "danco", "mada", "corrint", "tle"} <= set(ID_ESTIMATORS)


@pytest.mark.parametrize("name", sorted(ID_ESTIMATORS))
def test_estimator_conformance(name):
    X = subspace_sample()
    X_dup = np.concatenate([X, X[:40]])
    est = ID_ESTIMATORS[name]()
    assert est.fit(X_dup) is est
    res = est.result_
    assert isinstance(res, IDResult) and res.estimator == name
    assert res.dimension == est.dimension_ and abs(res.dimension - 5) <= 1.0  # roughly 5
    assert res.n_points == 540 and res.n_duplicates_removed == 40 and res.n_used == 500
    assert est.n_duplicates_removed_ == 40
    assert isinstance(res.params, dict) and res.as_dict()["estimator"] == name
    # duplicates change nothing: the estimate is the one on the distinct points
    assert estimate_id(X, name).dimension == pytest.approx(res.dimension, rel=1e-9)
    # bad input: one-line DataError, never a silent number
    bad = X.copy()
    bad[7, 2] = np.nan
    for Y, match in [(bad, "NaN or Inf"), (X[:, :1], "D >= 2"), (X[:2], "at least 3"),
                     (np.repeat(X[:2], 4, axis=0), "distinct"), (X[0], "2-D")]:
        with pytest.raises(DataError, match=match) as info:
            estimate_id(Y, name)
        assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="transposed"):
        estimate_id(X.T, name, expect_dim=20)


def test_estimate_id_params_and_unknown_names():
    X = subspace_sample(seed=1)
    r = estimate_id(X, "twonn", estimator="mle", discard_fraction=0.0)
    assert r.params["estimator"] == "mle" and r.params["f_convention"] == "F_i = i/N"
    assert estimate_id(X, "mle", K=10).params["K"] == 10
    sub = estimate_id(X, "twonn", max_points=300, seed=4)
    assert sub.n_used == 300 and sub.n_points == 500
    with pytest.raises(InputError, match="unknown intrinsic-dimension estimator"):
        estimate_id(X, "fractal")
    with pytest.raises(InputError, match="bad parameter for mle"):
        estimate_id(X, "mle", neighbours=3)
    with pytest.raises(InputError, match="unknown twonn parameter"):
        estimate_id(X, "twonn", k=3)
