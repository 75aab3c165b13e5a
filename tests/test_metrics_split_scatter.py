"""The split-precision scatter (``extract --products split``): float16 parts exact, every entry
within the stated worst-case bound, and on activation-like rows within 1e-7 (Frobenius norm) of a
float64 reference computed here from the same rows (numpy, centred on the float64 mean). On the CPU
the float32 sums are the CPU's own (round to nearest), which the GPU's tensor cores may not match:
tests/test_gpu.py checks the same bound on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_models import activation_rows

from geomscope.metrics import Moments
from geomscope.metrics.moments_torch import TorchMoments, device_moments
from geomscope.metrics.split_scatter import SPLIT_ROWS, split_parts, split_products, split_scatter

U32 = 2.0**-24  # float32's unit roundoff (round to nearest)


def reference_scatter(x: torch.Tensor) -> np.ndarray:
    """sum (x - mean)(x - mean)^T of the float16 rows in float64 (numpy)."""
    a = x.double().numpy()
    c = a - a.mean(0)
    return c.T @ c


def full(upper: torch.Tensor) -> np.ndarray:
    u = np.triu(upper.numpy())
    return u + np.triu(u, 1).T


def shifted(x: torch.Tensor) -> np.ndarray:
    """y = x - s with the documented shift rule, written here from the docstring: s = the mean
    rounded to a multiple of q = 2^max(floor(log2 sd) - 10, -24)."""
    a = x.double().numpy()
    mean, sd = a.mean(0), a.std(0)
    with np.errstate(divide="ignore"):
        q = 2.0 ** np.maximum(np.floor(np.log2(sd)) - 10, -24)
    return a - np.round(mean / q) * q


@pytest.fixture(scope="module")
def rows():
    return activation_rows(6144, 96)


def test_parts_are_exact_or_within_their_bound(rows):
    y = torch.from_numpy(shifted(rows))
    hi, lo, scale = split_parts(y)
    assert hi.dtype == lo.dtype == torch.float16
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    r = (y * scale - hi.double() - lo.double()).abs()
    assert (r <= 2.0**-21 * (y * scale).abs()).all()
    # y has at most 22 significant bits within ~2048 sd of the shift, unless |x| < 2^-11 |s|
    a = rows.double().numpy()
    s = torch.from_numpy(a) - y
    exact = (y.abs() < 1000 * torch.from_numpy(a.std(0))) & (rows.double().abs() >= 2.0**-11 * s.abs())
    assert (r[exact] == 0).all() and (lo != 0).any() and exact.float().mean() > 0.999
    # a column beyond float16's range from its shift is halved, exactly
    wide = torch.tensor([[-70000.0], [60000.0], [3 * 2.0**-24]], dtype=torch.float64)  # y = x - s
    hi, lo, scale = split_parts(wide)
    assert scale.item() == 0.5 and torch.isfinite(hi).all()
    assert ((wide * 0.5 - hi.double() - lo.double()).abs() <= 2.0**-21 * wide.abs() * 0.5 + 2.0**-25).all()


def test_every_entry_within_the_worst_case_bound(rows):
    """|error| <= (gamma_(b-1) (1 + 2^-9) + 2^-20 (1 + 2^-22)) sum |y_i||y_j| off the diagonal,
    float64's rounding on it (the docstring's bound, for a short block so it is not vacuous)."""
    b = 16
    xb = rows.double()
    got = full(split_scatter(xb, xb.mean(0), rows=b))
    ref = reference_scatter(rows)
    y = np.abs(shifted(rows))
    a = y.T @ y
    gamma = (b - 1) * U32 / (1 - (b - 1) * U32)
    bound = (gamma * (1 + 2.0**-9) + 2.0**-20 * (1 + 2.0**-22) + 1e-13) * a
    assert (np.abs(got - ref) <= bound).all()
    np.testing.assert_allclose(np.diag(got), np.diag(ref), rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_activation_like_rows_within_1e7_of_float64(seed):
    """The covariance within 1e-7 relative (Frobenius norm) of a float64 reference on the same rows,
    the diagonal to float64's rounding, every entry within 1e-6 of sqrt(C_ii C_jj): float32 sums
    of a correlated pair drift with its covariance, and their rounding errors add up as the
    diagonal's would (the docstring's worst case is far above both)."""
    x = activation_rows(8192, 128, seed)
    xb = x.double()
    got = full(split_scatter(xb, xb.mean(0), rows=SPLIT_ROWS))
    ref = reference_scatter(x)
    err = got - ref
    assert np.linalg.norm(err) <= 1e-7 * np.linalg.norm(ref)
    d = np.sqrt(np.diag(ref))
    assert (np.abs(err) <= 1e-6 * np.outer(d, d)).all()
    np.testing.assert_allclose(np.diag(got), np.diag(ref), rtol=1e-12)


def test_products_of_parts_sum_in_float32_blocks():
    """The four part products: with one-row blocks there is no float32 sum at all, so the result
    is the float64 sum of exact products (float16 x float16 is exact in float32)."""
    g = torch.Generator().manual_seed(3)
    hi = torch.randn(40, 24, generator=g).half()
    lo = (torch.randn(40, 24, generator=g) * 1e-3).half()
    got = full(split_products(hi, lo, rows=1))
    z = (hi.double() + lo.double()).numpy()
    np.testing.assert_allclose(got, z.T @ z, rtol=1e-14, atol=0)
    blocked = full(split_products(hi, lo, rows=7, blocked=True))
    np.testing.assert_allclose(blocked, z.T @ z, rtol=1e-5)


def test_torch_moments_split_against_float64_moments():
    """Several updates (one of a single row) through the device accumulator with split products:
    the scatter within 1e-7 of numpy's float64 Moments, every other statistic the float64 path's."""
    x = activation_rows(5000, 64, 2)
    split = TorchMoments(64, torch.device("cpu"), 6.0, products="split")
    exact = TorchMoments(64, torch.device("cpu"), 6.0)
    for lo, hi in ((0, 1), (1, 2600), (2600, 5000)):
        split.update(x[lo:hi])
        exact.update(x[lo:hi])
    got, same = split.to_moments(), exact.to_moments()
    ref = Moments(64, 6.0).update(x.numpy())
    assert got.n == ref.n
    assert np.linalg.norm(got.M2 - ref.M2) <= 1e-7 * np.linalg.norm(ref.M2)
    np.testing.assert_allclose(np.diag(got.M2), np.diag(ref.M2), rtol=1e-12)
    for key in ("mean", "sum_unit", "sum_unit_sq", "abs_sum", "abs_max"):
        np.testing.assert_array_equal(getattr(got, key), getattr(same, key))
    np.testing.assert_array_equal(got.count_abs_ge, ref.count_abs_ge)
    assert got.sum_sq_norm == same.sum_sq_norm


def test_split_takes_float16_rows_only():
    tm = device_moments(8, torch.device("cpu"), 6.0, products="split")
    assert isinstance(tm, TorchMoments) and tm.products == "split"
    with pytest.raises(ValueError, match="float16"):
        tm.update(torch.ones(3, 8))
    with pytest.raises(ValueError, match="products"):
        TorchMoments(8, torch.device("cpu"), products="bf16")
