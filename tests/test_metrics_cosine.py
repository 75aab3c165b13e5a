"""Average cosine: O(N*D) formula equals the O(N^2) pair mean for all variants; contributions;
streaming (Moments/UnitSum) equals in-memory; CosReg penalty; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomscope.errors import DataError, InputError
from geomscope.metrics import (
    COSINE_VARIANTS,
    Moments,
    UnitSum,
    avgcos,
    avgcos_from_sum,
    avgcos_pairs,
    cosine_contributions,
    cosreg_penalty_torch,
    unit_sum,
)


def _cone(n, d, seed, offset=2.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.uniform(0.2, 3.0, d) + offset * rng.standard_normal(d)
    return x


def _brute(x, variant):
    """Independent double loop over ordered pairs."""
    z = np.asarray(x, dtype=np.float64)
    if variant != "plain":
        z = z - z.mean(0)
    if variant == "standardised":
        sd = z.std(0, ddof=1)
        z = z / np.where(sd > 0, sd, 1.0)
    z = [r for r in z if np.linalg.norm(r) > 0]
    tot, cnt = 0.0, 0
    for i, a in enumerate(z):
        for j, b in enumerate(z):
            if i != j:
                tot += a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
                cnt += 1
    return tot / cnt


def _gram_mean(x, variant):
    """The same reference as :func:`_brute` (its centring, scaling and zero-norm rule), with the
    pairs summed through the Gram matrix of the unit rows instead of a Python double loop."""
    z = np.asarray(x, dtype=np.float64)
    if variant != "plain":
        z = z - z.mean(0)
    if variant == "standardised":
        sd = z.std(0, ddof=1)
        z = z / np.where(sd > 0, sd, 1.0)
    norms = np.linalg.norm(z, axis=1)
    u = z[norms > 0] / norms[norms > 0, None]
    n = len(u)
    g = u @ u.T
    return (g.sum() - np.trace(g)) / (n * (n - 1))


@pytest.mark.parametrize("variant", COSINE_VARIANTS)
@pytest.mark.parametrize("n,d,seed", [(2, 3, 0), (25, 4, 1), (40, 60, 2), (9, 2, 3)])
def test_formula_equals_pairs(variant, n, d, seed):
    x = _cone(n, d, seed)
    ref = _brute(x, variant)
    assert avgcos(x, variant) == pytest.approx(ref, abs=1e-12)
    assert avgcos_pairs(x, variant) == pytest.approx(ref, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 30),
    d=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    variant=st.sampled_from(COSINE_VARIANTS),
    scale=st.floats(1e-3, 1e3),
)
def test_formula_property(n, d, seed, variant, scale):
    x = _cone(n, d, seed) * scale
    assert avgcos(x, variant) == pytest.approx(avgcos_pairs(x, variant), abs=1e-10)
    assert -1 / (n - 1) - 1e-12 <= avgcos(x, variant) <= 1 + 1e-12


def test_known_values_and_zero_rows():
    assert avgcos(np.array([[1.0, 0.0], [2.0, 0.0], [5.0, 0.0]])) == pytest.approx(1.0)
    assert avgcos(np.array([[1.0, 0.0], [-3.0, 0.0]])) == pytest.approx(-1.0)
    assert avgcos(np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])) == pytest.approx(0.0)  # zero row excluded
    assert avgcos(np.array([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])) == pytest.approx(1.0)
    u = unit_sum(np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    assert u.n_zero_norm == 1 and u.n_unit() == 2
    # a narrow cone: plain cosine high, centred near zero
    x = _cone(2000, 16, 4, offset=20.0)
    assert avgcos(x) > 0.9 and abs(avgcos(x, "centred")) < 1e-3


@pytest.mark.parametrize("variant", COSINE_VARIANTS)
def test_streaming_equals_in_memory(variant):
    x = _cone(600, 12, 5)
    m = Moments(block_rows=64)
    for i in range(0, 600, 100):
        m.update(x[i : i + 100])
    if variant == "plain":
        s, n = m.sum_unit, m.n_unit()
    else:
        scale = np.sqrt(m.variance()) if variant == "standardised" else None
        u = UnitSum(m.mean, scale)
        for i in range(0, 600, 250):
            u.update(x[i : i + 250])
        s, n = u.sum_unit, u.n_unit()
    assert avgcos_from_sum(s, n) == pytest.approx(avgcos(x, variant), abs=1e-12)


def test_contributions_sum_to_avgcos_and_find_the_rogue_dimension():
    x = _cone(300, 10, 6, offset=0.0)
    x[:, 7] += 30.0  # one dimension carries the common offset
    u = unit_sum(x)
    exact = cosine_contributions(u.sum_unit, u.n_unit(), u.sum_unit_sq)
    assert exact.sum() == pytest.approx(avgcos(x), abs=1e-12)
    assert int(np.argmax(exact)) == 7 and exact[7] / exact.sum() > 0.9
    # brute-force per-dimension mean over distinct pairs
    z = x / np.linalg.norm(x, axis=1, keepdims=True)
    n = len(z)
    brute = ((z.sum(0) ** 2) - (z**2).sum(0)) / (n * (n - 1))
    np.testing.assert_allclose(exact, brute, rtol=1e-10, atol=1e-14)
    approx = cosine_contributions(u.sum_unit, u.n_unit())
    a = avgcos(x)
    assert approx.sum() == pytest.approx(a + (1 - a) / n, abs=1e-12)


def test_cosreg_penalty_torch():
    x = _cone(50, 8, 7)
    t = torch.tensor(x, requires_grad=True)
    r = cosreg_penalty_torch(t)
    n = len(x)
    assert r.item() == pytest.approx(avgcos(x) * (n - 1) / n, abs=1e-12)
    r.backward()
    assert torch.isfinite(t.grad).all()
    half = cosreg_penalty_torch(torch.tensor(x, dtype=torch.float16))
    assert half.dtype == torch.float32 and half.item() == pytest.approx(r.item(), abs=1e-3)
    z = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    assert cosreg_penalty_torch(z).item() == pytest.approx(2 / 9)
    with pytest.raises(InputError):
        cosreg_penalty_torch(x)


def test_bad_input():
    with pytest.raises(DataError, match="at least 2"):
        avgcos(np.ones((1, 3)))
    with pytest.raises(DataError, match="non-zero norm"):
        avgcos(np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]))
    with pytest.raises(DataError, match="non-zero norm"):
        avgcos(np.ones((5, 3)), "centred")  # every centred row is 0
    x = _cone(10, 3, 8)
    x[4, 0] = np.inf
    with pytest.raises(DataError, match="1 of 10 rows"):
        avgcos(x)
    with pytest.raises(InputError, match="variant"):
        avgcos(_cone(10, 3, 8), "whitened")
    with pytest.raises(DataError):
        avgcos_from_sum(np.zeros(3), 1)


@pytest.mark.parametrize("value", [0.1, 1 / 3, 7.0, 1e4 + 0.1, -2.7e-3])
def test_a_constant_dimension_adds_nothing_to_the_centred_and_standardised_cosine(value):
    """A constant column is 0 after centring. Its mean is its value only to rounding (0.1 is not a
    float64 sum of 0.1s / N exactly), and the residue, divided by a standard deviation of the same
    rounding (1e-17), would come out near +-1 in every row: 0.317 where the truth is -0.0009. The
    cosine with the column must equal the cosine without it."""
    x = _cone(1000, 4, 0)
    with_const = np.column_stack([x, np.full(1000, value)])
    for variant in ("centred", "standardised"):
        want = avgcos_pairs(x, variant)
        assert avgcos(with_const, variant) == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert avgcos_pairs(with_const, variant) == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert avgcos(with_const, variant) == pytest.approx(_gram_mean(x, variant), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("value", [0.1, 7.0])
def test_identical_rows_have_no_centred_cosine(value):
    """Identical rows centre to 0 (no direction, so no cosine); the rounding residue of a mean of
    0.1s makes every centred row the same tiny vector (cosine 1.0 if taken as a direction), and 7.0
    (exact) none: both are refused the same way."""
    x = np.full((3000, 4), value)
    for variant in ("centred", "standardised"):
        with pytest.raises(DataError, match="0 row"):
            avgcos(x, variant)
    assert avgcos(x, "plain") == pytest.approx(1.0)


def test_unit_sum_drops_a_dimension_of_infinite_or_zero_scale():
    """scale inf (cosine_shift_scale's constant dimension) or 0: the dimension adds exactly 0."""
    x = _cone(200, 5, 3)
    shift = x.mean(0)
    scale = x.std(0, ddof=1)
    for marker in (np.inf, 0.0):
        s = scale.copy()
        s[2] = marker
        u = UnitSum(shift, s).update(x)
        v = UnitSum(np.delete(shift, 2), np.delete(scale, 2)).update(np.delete(x, 2, axis=1))
        assert u.sum_unit[2] == 0.0 and u.sum_unit_sq[2] == 0.0
        np.testing.assert_allclose(np.delete(u.sum_unit, 2), v.sum_unit, rtol=1e-12)
    with pytest.raises(InputError, match="non-negative"):
        UnitSum(shift, np.r_[scale[:4], np.nan])
