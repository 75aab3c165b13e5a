"""Conformance of every registered intrinsic-dimension estimator (geomscope.metrics.intrinsic); bad
subsampling arguments and parameters are one-line InputErrors, whole numbers of any integer type are
taken."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import one_line_message

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
    for Y, match in [
        (bad, "NaN or Inf"),
        (X[:, :1], "D >= 2"),
        (X[:2], "at least 3"),
        (np.repeat(X[:2], 4, axis=0), "distinct"),
        (X[0], "2-D"),
    ]:
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
    with pytest.raises(InputError, match="bad parameter for twonn"):
        estimate_id(X, "twonn", k=3)


# ---------------------------------------------------------------- the scikit-learn estimator contract
def _registered():
    return [ID_ESTIMATORS[n]() for n in sorted(ID_ESTIMATORS)]


@pytest.mark.parametrize("est", _registered(), ids=sorted(ID_ESTIMATORS))
def test_estimators_clone_and_round_trip_params(est):
    from sklearn.base import BaseEstimator, clone

    assert isinstance(est, BaseEstimator)
    params = est.get_params()
    twin = clone(est)
    assert twin is not est and twin.get_params() == params
    est.set_params(seed=7, dedup=False)
    assert est.get_params()["seed"] == 7 and est.get_params()["dedup"] is False
    assert clone(est).get_params() == est.get_params()
    # fitted attributes appear only after fit, and a clone is unfitted
    assert not hasattr(twin, "dimension_")
    twin.fit(subspace_sample())
    assert hasattr(twin, "dimension_") and not hasattr(clone(twin), "dimension_")


def _not_applicable():
    """scikit-learn's generic checks that cannot apply to an intrinsic-dimension estimator, with why."""
    why_small = "needs at least 3 distinct points; the check fits on fewer"
    return {
        "check_fit2d_1sample": why_small,
        "check_fit2d_1feature": "D >= 2 is required: one dimension has no geometry to measure",
        "check_fit1d": "points are the rows of a 2-D array by contract (a 1-D array is refused)",
        "check_estimators_nan_inf": "refuses NaN/Inf with geomscope's one-line DataError, not ValueError",
        "check_estimators_empty_data_messages": "refuses empty data with geomscope's DataError, "
        "not ValueError",
        "check_n_features_in": "an intrinsic-dimension estimate does not record n_features_in_",
        "check_n_features_in_after_fitting": "an intrinsic-dimension estimate does not record n_features_in_",
        "check_complex_data": "refuses complex data with geomscope's InputError, not ValueError",
        "check_dtype_object": "refuses object arrays with geomscope's InputError",
        "check_estimator_sparse_array": "dense arrays only",
        "check_estimator_sparse_matrix": "dense arrays only",
        "check_estimator_sparse_tag": "dense arrays only",
    }


def test_twonn_passes_scikit_learns_estimator_checks():
    """The checks that apply to an unsupervised, fit-only estimator pass; the rest are listed with
    the reason they do not apply (scikit-learn's own `expected_failed_checks` mechanism)."""
    from sklearn.utils.estimator_checks import check_estimator

    from geomscope.metrics.intrinsic import TwoNN

    results = check_estimator(TwoNN(), expected_failed_checks=_not_applicable(), on_fail=None)
    failed = [r for r in results if r["status"] == "failed"]
    passed = [r["check_name"] for r in results if r["status"] == "passed"]
    assert not failed, [(r["check_name"], str(r["exception"])[:200]) for r in failed]
    # the contract checks that matter here really ran
    for name in (
        "check_no_attributes_set_in_init",
        "check_get_params_invariance",
        "check_set_params",
        "check_parameters_default_constructible",
        "check_do_not_raise_errors_in_init_or_set_params",
    ):
        assert name in passed, name


@pytest.mark.parametrize("name", ["mle", "lpca", "corrint", "tle", "twonn"])
def test_duplicates_without_dedup_are_refused(name):
    # scikit-dimension reads them as data: its MLE gives 0.0 on 50 distinct rows repeated 4x
    X = np.random.default_rng(0).standard_normal((200, 4))
    Xd = np.vstack([X[:50]] * 4)
    with pytest.raises(DataError, match="dedup=True") as e:
        estimate_id(Xd, name, dedup=False)
    assert "\n" not in str(e.value)
    # without duplicates dedup=False is the plain estimator on the rows (scikit-dimension's own)
    r = estimate_id(X, name, dedup=False)
    assert r.n_duplicates_removed == 0 and r.n_used == 200
    if name != "twonn":
        import inspect

        import skdim

        from geomscope.metrics.intrinsic import SKDIM_ESTIMATORS

        cls = getattr(skdim.id, SKDIM_ESTIMATORS[name])
        kw = {"random_state": 0} if "random_state" in inspect.signature(cls.__init__).parameters else {}
        with warnings.catch_warnings():  # scikit-dimension's own RuntimeWarnings, as estimate_id hides them
            warnings.simplefilter("ignore")
            want = cls(**kw).fit(X).dimension_
        assert r.dimension == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------ bad subsampling and parameters


_X = np.random.default_rng(0).standard_normal((200, 4))


@pytest.mark.parametrize("name", ["twonn", "mle"])
@pytest.mark.parametrize(
    "params,match",
    [
        ({"max_points": 50.5}, "max_points"),  # numpy TypeError
        ({"max_points": "50"}, "max_points"),  # TypeError from "'>' not supported"
        ({"max_points": 2}, "max_points"),
        ({"max_points": 50, "seed": -1}, "seed"),  # numpy ValueError
        ({"seed": -1}, "seed"),  # reached the estimator without subsampling
        ({"seed": 1.5}, "seed"),
    ],
)
def test_estimate_id_refuses_bad_subsampling_arguments(name, params, match):
    with pytest.raises(InputError, match=match) as e:
        estimate_id(_X, name, **params)
    one_line_message(e)


def test_estimate_id_subsampling_arguments_that_are_whole_numbers():
    a = estimate_id(_X, "mle", max_points=np.int64(50), seed=np.int32(3))
    b = estimate_id(_X, "mle", max_points=50, seed=3)
    assert a.dimension == b.dimension and a.n_used == 50


def test_a_parameter_of_the_wrong_type_is_an_input_error():
    # tle's epsilon="x" escaped as numpy's UFuncTypeError
    with pytest.raises(InputError, match="bad parameter for tle") as e:
        estimate_id(_X, "tle", epsilon="x")
    one_line_message(e)
    assert not isinstance(e.value, DataError)
