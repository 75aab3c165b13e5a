"""Average cosine similarity (Ethayarajh 2019), exact in O(N*D), and per-dimension contributions.

For rows x_1..x_N (N, D) with unit vectors x_hat = x/||x||, the mean cosine over all N(N-1)
ordered pairs of distinct rows is

    avgcos = (||sum_i x_hat_i||^2 - N) / (N (N - 1))

because ||sum x_hat||^2 = N + sum_{i != j} cos(x_i, x_j). Variants, always labelled:
``plain`` (raw rows), ``centred`` (subtract the mean row first), ``standardised`` (subtract the
mean and divide each dimension by its standard deviation, ddof=1; Timkey & van Schijndel 2021).
A constant dimension (its spread within float64's rounding of its mean) is 0 after centring in
both: exactly 0, not the rounding residue the subtraction leaves (``validate.cosine_shift_scale``).

Zero-norm rows: the cosine with a zero vector is undefined, so rows whose (transformed) norm is
exactly 0 are excluded and N counts the remaining rows; the number excluded is reported by the
accumulators (``n_zero_norm``). Fewer than 2 remaining rows raises DataError.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.metrics.moments import UnitSum
from geomscope.metrics.validate import (
    NonfiniteRows,
    as_rows,
    cosine_shift_scale,
    count_nonfinite_rows,
    is_torch,
)

COSINE_VARIANTS = ("plain", "centred", "standardised")


def _check_n(n: int) -> int:
    n = int(n)
    if n < 2:
        raise DataError(f"{n} row(s) with non-zero norm; the average cosine needs at least 2")
    return n


def avgcos_from_sum(sum_unit, n: int) -> float:
    """(||sum_unit||^2 - n) / (n (n - 1)) for the sum of n unit vectors (non-zero rows only)."""
    n = _check_n(n)
    s = np.asarray(sum_unit, dtype=np.float64)
    if not np.isfinite(s).all():
        raise DataError("sum of unit vectors contains NaN or Inf")
    return float((np.dot(s, s) - n) / (n * (n - 1.0)))


def _shift_scale(a: np.ndarray, variant: str):
    if variant not in COSINE_VARIANTS:
        raise InputError(f"unknown cosine variant {variant!r}; use one of {', '.join(COSINE_VARIANTS)}")
    d = a.shape[1]
    if variant == "plain":
        return np.zeros(d), None
    mean = a.mean(axis=0, dtype=np.float64)
    return cosine_shift_scale(mean, np.var(a, axis=0, ddof=1, dtype=np.float64), variant)


def _points(X) -> np.ndarray:
    a = as_rows(X)
    if a.shape[0] < 2:
        raise DataError(f"X has {a.shape[0]} row(s); the average cosine needs at least 2")
    bad = count_nonfinite_rows(a)
    if bad:
        raise NonfiniteRows(bad, a.shape[0])
    return a


def unit_sum(X, variant: str = "plain") -> UnitSum:
    """The UnitSum accumulator of X (N, D) for ``variant`` (sum_unit, sum_unit_sq, n, n_zero_norm)."""
    a = _points(X)
    shift, scale = _shift_scale(a, variant)
    return UnitSum(shift, scale).update(a)


def avgcos(X, variant: str = "plain") -> float:
    """Exact mean cosine over all distinct pairs of rows of X (N, D), O(N*D). See module docstring."""
    u = unit_sum(X, variant)
    return avgcos_from_sum(u.sum_unit, u.n_unit())


def avgcos_pairs(X, variant: str = "plain") -> float:
    """O(N^2) reference: the mean of cos(x_i, x_j) over i != j (zero-norm rows excluded)."""
    a = np.asarray(_points(X), dtype=np.float64)
    shift, scale = _shift_scale(a, variant)
    z = a - shift
    if scale is not None:
        z = z / scale  # inf: a constant dimension, 0
    norms = np.linalg.norm(z, axis=1)
    z = z[norms > 0] / norms[norms > 0, None]
    n = _check_n(z.shape[0])
    g = z @ z.T
    return float((g.sum() - np.trace(g)) / (n * (n - 1.0)))


def cosine_contributions(sum_unit, n: int, sum_unit_sq=None) -> np.ndarray:
    """Per-dimension share of the average cosine (Timkey & van Schijndel 2021), shape (D,).

    With ``sum_unit_sq`` (sum of x_hat_d^2, from Moments/UnitSum): exact over distinct pairs,
    CC_d = (S_d^2 - Q_d) / (n (n - 1)), and sum_d CC_d equals avgcos exactly. Without it: over all
    n^2 ordered pairs including i = j (pairs drawn with replacement), CC_d = S_d^2 / n^2, which sums
    to avgcos + (1 - avgcos)/n.
    """
    n = _check_n(n)
    s = np.asarray(sum_unit, dtype=np.float64)
    if sum_unit_sq is None:
        return s * s / (float(n) * n)
    q = np.asarray(sum_unit_sq, dtype=np.float64)
    if q.shape != s.shape:
        raise InputError(f"sum_unit_sq has shape {q.shape} but sum_unit has {s.shape}")
    return (s * s - q) / (n * (n - 1.0))


def rogue_shares(sum_unit, n: int, sum_unit_sq) -> tuple[np.ndarray, float]:
    """(each dimension's share of the average cosine, the average cosine) (Timkey & van Schijndel
    2021): share_d = CC_d / avgcos with CC_d the exact per-dimension contribution over distinct pairs
    (:func:`cosine_contributions`), E[u_d v_d] / E[cos] for unit rows u, v; the shares sum to 1.
    DataError where the average cosine is exactly 0 (no share is defined)."""
    cc = cosine_contributions(sum_unit, n, sum_unit_sq)
    total = float(cc.sum())
    if total == 0.0 or not np.isfinite(total):
        raise DataError("the average cosine is 0: no dimension has a share of it")
    return cc / total, total


def cosreg_penalty_torch(X):
    """CosReg penalty (Gao et al. 2019) R = (||sum_i x_hat_i||^2 - N) / N^2 of a batch X (N, D).

    Differentiable; computed in at least float32. A zero row has x_hat = 0 and contributes nothing
    (its self-term is removed too, so R is then the sum of cosines of the non-zero pairs / N^2).
    """
    if not is_torch(X) or X.ndim != 2:
        raise InputError("cosreg_penalty_torch expects a 2-D torch tensor (N, D)")
    import torch

    x = X if X.dtype == torch.float64 else X.float()
    n = x.shape[0]
    norms = x.norm(dim=1, keepdim=True)
    u = x / norms.clamp_min(torch.finfo(x.dtype).tiny)
    s = u.sum(dim=0)
    return (s @ s - (u * u).sum()) / (n * n)
