"""Moments / UnitSum: agreement with direct numpy, exact merging, precision, bad input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomscope.errors import DataError, InputError
from geomscope.metrics import Moments, UnitSum


def _data(n=300, d=12, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.uniform(0.1, 4.0, d)
    x[:, min(3, d - 1)] *= 8.0  # an outlier-ish dimension (|x| >= 6 often)
    return x + offset


def _direct_extras(x, thr=6.0):
    norms = np.linalg.norm(x, axis=1)
    nz = norms > 0
    u = x[nz] / norms[nz, None]
    a = np.abs(x)
    return dict(
        sum_unit=u.sum(0),
        sum_unit_sq=(u**2).sum(0),
        n_zero_norm=int((~nz).sum()),
        abs_sum=a.sum(0),
        abs_max=a.max(0),
        count_abs_ge=(a >= thr).sum(0),
        sum_sq_norm=float((norms**2).sum()),
    )


def _assert_matches(m, x, rtol=1e-10):
    assert m.n == len(x) and m.dim == x.shape[1]
    np.testing.assert_allclose(m.mean, x.mean(0), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(m.covariance(), np.cov(x.T), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(m.covariance(ddof=0), np.cov(x.T, ddof=0), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(m.variance(), x.var(0, ddof=1), rtol=rtol)
    ref = _direct_extras(x, m.abs_threshold)
    for k, v in ref.items():
        np.testing.assert_allclose(getattr(m, k), v, rtol=rtol, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(m.mean_abs(), np.abs(x).mean(0), rtol=rtol)
    np.testing.assert_allclose(m.frac_abs_ge(), (np.abs(x) >= m.abs_threshold).mean(0), rtol=rtol)


@pytest.mark.parametrize("block_rows", [1, 7, 64, 4096])
def test_matches_numpy_one_update(block_rows):
    x = _data()
    x[5] = 0.0  # a zero-norm row
    m = Moments(abs_threshold=6.0, block_rows=block_rows).update(x)
    _assert_matches(m, x)
    assert m.n_zero_norm == 1 and m.n_unit() == len(x) - 1


def test_many_updates_and_symmetric_m2():
    x = _data(n=513, d=9, seed=1)
    m = Moments(9, block_rows=50)
    for i in range(0, len(x), 37):
        m.update(x[i : i + 37])
    _assert_matches(m, x)
    np.testing.assert_array_equal(m.M2, m.M2.T)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_input_dtypes_are_converted_exactly(dtype):
    x = _data(n=200, d=6, seed=2).astype(dtype)
    m = Moments().update(x)
    _assert_matches(m, x.astype(np.float64))


@pytest.mark.parametrize("tdtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_torch_input(tdtype):
    t = torch.tensor(_data(n=150, d=5, seed=3)).to(tdtype).requires_grad_(tdtype != torch.float64)
    m = Moments().update(t)
    _assert_matches(m, t.detach().double().numpy())


def test_large_common_offset_loses_nothing():
    x = _data(n=4000, d=8, seed=4, offset=1e4)
    exact = np.cov((x - 1e4).T)  # subtracting the (exactly representable) offset first
    m = Moments(block_rows=512).update(x)
    err = np.max(np.abs(m.covariance() - exact)) / np.max(np.abs(exact))
    assert err < 1e-12
    # the naive one-pass formula (sum xx^T - n mean mean^T) loses ~8 digits here: the test can fail
    naive = (x.T @ x - len(x) * np.outer(x.mean(0), x.mean(0))) / (len(x) - 1)
    assert np.max(np.abs(naive - exact)) / np.max(np.abs(exact)) > 1e3 * err


def test_merge_is_exact_and_tree_order_free():
    x = _data(n=1000, d=10, seed=5)
    parts = [Moments().update(x[i : i + 130]) for i in range(0, 1000, 130)]
    tree = parts[0]
    for p in parts[1:]:
        tree.merge(p)
    _assert_matches(tree, x)
    pair = Moments().merge(Moments().update(x[:1])).merge(Moments().update(x[1:]))
    _assert_matches(pair, x)


def test_merge_with_empty_and_pickle_roundtrip():
    x = _data(n=100, d=4, seed=6)
    m = Moments().update(x)
    m.merge(Moments(4))
    m2 = pickle.loads(pickle.dumps(m))
    _assert_matches(m2, x)
    e = Moments().merge(m2)
    _assert_matches(e, x)


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 120), max_size=6), block=st.integers(1, 40), seed=st.integers(0, 99))
def test_any_chunking_equals_one_pass(cuts, block, seed):
    x = _data(n=120, d=5, seed=seed)
    edges = [0, *sorted(cuts), 120]
    m = Moments(block_rows=block)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        m.update(x[a:b])
    ref = Moments().update(x)
    np.testing.assert_allclose(m.covariance(), ref.covariance(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(m.sum_unit, ref.sum_unit, rtol=1e-10, atol=1e-12)


def test_extras_false_keeps_only_core():
    x = _data(n=90, d=7, seed=7)
    m = Moments(extras=False).update(x)
    np.testing.assert_allclose(m.covariance(), np.cov(x.T), rtol=1e-10)
    assert m.sum_unit is None
    with pytest.raises(InputError):
        m.mean_abs()
    with pytest.raises(InputError):
        Moments().update(x).merge(m)


def test_nonfinite_rows_raise_and_leave_state_unchanged():
    x = _data(n=50, d=4, seed=8)
    m = Moments(block_rows=8).update(x)
    bad = _data(n=40, d=4, seed=9)
    bad[[3, 30]] = np.nan
    bad[35, 1] = np.inf
    with pytest.raises(DataError, match="3 of 40 rows") as e:
        m.update(bad)
    assert "drop or flag" in str(e.value) and "\n" not in str(e.value)
    _assert_matches(m, x)


def test_bad_shapes_and_too_few_rows():
    m = Moments(4)
    with pytest.raises(DataError, match="2-D"):
        m.update(np.zeros(4))
    with pytest.raises(DataError, match="columns"):
        m.update(np.zeros((3, 5)))
    m.update(np.ones((1, 4)))
    with pytest.raises(DataError, match="at least 2"):
        m.covariance()
    with pytest.raises(DataError, match="2-D|numeric"):
        Moments().update(np.array([["a", "b"]]))
    with pytest.raises(DataError):
        Moments(3).merge(Moments().update(np.ones((2, 4))))


def test_zero_variance_detected_despite_rounding():
    x = np.full((1001, 6), 0.1)  # mean of 0.1s is not exactly 0.1 in float64
    m = Moments().update(x)
    with pytest.raises(DataError, match="zero total variance"):
        m.check_variance()
    Moments().update(_data(n=10, d=3)).check_variance()  # fine


def test_unitsum_centred_and_standardised():
    x = _data(n=400, d=6, seed=10, offset=3.0)
    x[:, 2] = 5.0  # constant column: zero std
    m = Moments().update(x)
    sd = np.sqrt(m.variance())
    u = UnitSum(m.mean, sd)
    for i in range(0, 400, 99):
        u.update(x[i : i + 99])
    z = (x - x.mean(0)) / np.where(x.std(0, ddof=1) > 1e-12, x.std(0, ddof=1), 1.0)
    ref = _direct_extras(z)
    np.testing.assert_allclose(u.sum_unit, ref["sum_unit"], rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(u.sum_unit_sq, ref["sum_unit_sq"], rtol=1e-8, atol=1e-9)
    c = UnitSum(m.mean).update(x[:200]).merge(UnitSum(m.mean).update(x[200:]))
    np.testing.assert_allclose(c.sum_unit, _direct_extras(x - x.mean(0))["sum_unit"], rtol=1e-8, atol=1e-9)
    assert c.n == 400 and c.n_unit() == 400


def test_unitsum_zero_rows_and_bad_input():
    x = np.array([[1.0, 2.0], [1.0, 2.0], [3.0, 0.0]])
    u = UnitSum(np.array([1.0, 2.0])).update(x)
    assert u.n_zero_norm == 2 and u.n_unit() == 1
    np.testing.assert_allclose(u.sum_unit, [1.0, -1.0] / np.sqrt(2))
    with pytest.raises(InputError):
        u.merge(UnitSum(np.zeros(2)))
    with pytest.raises(DataError, match="NaN"):
        u.update(np.array([[np.nan, 1.0]]))
    with pytest.raises(InputError):
        UnitSum(np.zeros(2), np.array([1.0, -1.0]))
