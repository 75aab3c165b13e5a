"""Input conversion and validation shared by the metric modules (numpy only; torch duck-typed)."""

from __future__ import annotations

import math
import operator

import numpy as np

from geomscope.errors import DataError

# Relative size below which a total variance is indistinguishable from float64 rounding of the
# offset: std / max|mean| < 1e3 * eps (about 2e-13) counts as zero variance.
_ZERO_VAR_REL = 1e3 * np.finfo(np.float64).eps


def is_torch(x) -> bool:
    """True for a torch.Tensor, without importing torch."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def to_numpy(x) -> np.ndarray:
    """A numpy view/copy of ``x``: torch tensors are detached and moved to the CPU; float16 and
    bfloat16 tensors become float32 (numpy has no bfloat16). Other dtypes are kept."""
    if is_torch(x):
        t = x.detach()
        if t.dtype.is_floating_point and t.element_size() < 4:
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(x)


def whole_number(value) -> int | None:
    """``value`` as an int where it is a whole number (an int, a NumPy integer, anything with
    ``__index__``), else None: a bool, a float (50.0 too) and a string are not counts."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return int(operator.index(value))
    except TypeError:
        return None


def as_rows(x, name: str = "X") -> np.ndarray:
    """``x`` as a 2-D numeric numpy array of rows (N, D); raise DataError otherwise."""
    a = to_numpy(x)
    if a.ndim != 2:
        raise DataError(f"{name} must be a 2-D array of rows (N, D); got shape {a.shape}")
    if a.dtype.kind not in "fiub":
        raise DataError(f"{name} must be numeric; got dtype {a.dtype}")
    if a.dtype.kind != "f":
        a = a.astype(np.float64)
    return a


def count_nonfinite_rows(a: np.ndarray) -> int:
    """Rows of ``a`` holding a NaN or an Inf.

    A NaN or an Inf anywhere makes the float64 sum of all values NaN or infinite, so a finite sum
    proves there are none: one fast reduction (~20x faster than ``np.isfinite`` over every value,
    which only runs when the sum is not finite -- a bad value, or a float64 sum that overflowed).
    """
    if a.size == 0 or a.dtype.kind != "f":
        return 0
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum, or inf - inf: no warning
        if np.isfinite(a.sum(dtype=np.float64)):
            return 0
    return int(a.shape[0] - np.count_nonzero(np.isfinite(a).all(axis=1)))


class NonfiniteRows(DataError):
    """``bad`` of the ``n`` rows of ``name`` hold a NaN or an Inf. A caller that knows where the rows
    came from (the scorer: a shard and a layer) catches it to say so, with ``bad`` and ``n``."""

    def __init__(self, bad: int, n: int, name: str = "X"):
        super().__init__(
            f"{bad} of {n} rows of {name} contain NaN or Inf; drop or flag those rows before computing "
            "statistics"
        )
        self.bad, self.n = int(bad), int(n)


def check_points(a: np.ndarray, name: str = "X", finite: bool = True) -> None:
    """N >= 2, D >= 2 and (if ``finite``) every value finite, else DataError (one line)."""
    n, d = a.shape
    if n < 2:
        raise DataError(f"{name} has {n} row(s); at least 2 points are needed")
    if d < 2:
        raise DataError(
            f"{name} has {d} column(s); at least 2 dimensions are needed (rows are points: shape (N, D))"
        )
    if finite:
        bad = count_nonfinite_rows(a)
        if bad:
            raise NonfiniteRows(bad, n, name)


def as_square(c, name: str = "C") -> np.ndarray:
    """``c`` as a finite float64 (D, D) matrix with D >= 2, else DataError."""
    a = to_numpy(c)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise DataError(f"{name} must be a square (D, D) matrix; got shape {a.shape}")
    if a.shape[0] < 2:
        raise DataError(f"{name} is {a.shape[0]}x{a.shape[0]}; at least 2 dimensions are needed")
    if a.dtype.kind not in "fiub":
        raise DataError(f"{name} must be numeric; got dtype {a.dtype}")
    a = np.asarray(a, dtype=np.float64)
    if not np.isfinite(a).all():
        raise DataError(f"{name} contains NaN or Inf; check the data it was computed from")
    return a


# A covariance computed in float32 (torch.cov of float32 rows) is symmetric, and its eigenvalues
# non-negative, only to float32 rounding: about 1e-7 of its largest entry or eigenvalue, and well
# under 1e-6 over thousands of dimensions. Anything beyond COVARIANCE_ROUNDING of the largest is no
# rounding: the matrix is not a covariance.
COVARIANCE_ROUNDING = 1e-6
# eigenvalues are compared with the largest one: below -PSD_ROUNDING of it is no rounding either
# (looser than the entries' bound: an eigenvalue collects the rounding of a whole row)
PSD_ROUNDING = 1e-4


def as_covariance(c, name: str = "C") -> np.ndarray:
    """``c`` as a float64 (D, D) covariance, checked as far as O(D^2) work allows: square, finite,
    symmetric and with a non-negative diagonal to rounding (COVARIANCE_ROUNDING of its largest
    entry), else DataError. Positive semi-definiteness needs the eigenvalues: :func:`check_psd`
    where they are computed; a matrix whose participation ratio falls below 1 is refused by the
    IsoScore functions, which cannot happen for a covariance."""
    given = c.dtype if is_torch(c) else np.asarray(c).dtype
    a = as_square(c, name)
    top = float(np.abs(a).max())
    # a matrix handed over in float16 or bfloat16 carries that type's rounding (~1e-3), not float32's
    eps = float(_torch_or_numpy_eps(given))
    tol = max(COVARIANCE_ROUNDING, 8 * eps) * top
    if float(np.abs(a - a.T).max()) > tol:
        raise DataError(f"{name} is not symmetric, so it is not a covariance; check how it was computed")
    low = float(np.diagonal(a).min())
    if low < -tol:
        raise DataError(
            f"{name} has a negative variance on its diagonal ({low:.3g}), so it is not a covariance; "
            "check how it was computed"
        )
    return a


def _torch_or_numpy_eps(dtype) -> float:
    """The rounding unit of a numpy or torch floating dtype (0 for integers)."""
    if hasattr(dtype, "is_floating_point"):  # a torch dtype
        import torch

        return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return float(np.finfo(dtype).eps) if np.dtype(dtype).kind == "f" else 0.0


def check_psd(eigenvalues: np.ndarray, name: str = "C") -> None:
    """DataError unless ``eigenvalues`` (of a symmetric matrix) are those of a covariance: none below
    -PSD_ROUNDING of the largest (smaller negatives are rounding) and not all 0."""
    lam = np.asarray(eigenvalues, dtype=np.float64)
    top, low = float(lam.max()), float(lam.min())
    if not top > 0 or low < -PSD_ROUNDING * top:
        raise DataError(
            f"{name} is not a covariance: its eigenvalues run from {low:.3g} to {top:.3g}, and a "
            "covariance's are >= 0 and not all 0; check how it was computed"
        )


def binary_exponent(a) -> int:
    """e with max |a| in [2^(e-1), 2^e) (0 for all zeros or none): dividing by 2^e is exact and brings
    the values to at most 1 in size, so their squares and sums of squares neither overflow nor fall
    among float64's subnormals (the one scaling rule of every scale-free quantity here)."""
    a = np.asarray(a, dtype=np.float64)
    return math.frexp(float(np.abs(a).max()) if a.size else 0.0)[1]


def participation_terms(c: np.ndarray) -> tuple[float, float]:
    """(t, f) with t^2 / f = tr(C)^2 / ||C||_F^2, the participation ratio of C (float64, square).

    The ratio does not change with C's scale, but ||C||_F^2 squares it: entries beyond 2^+-400
    would make it overflow, or fall among float64's subnormals and lose their digits (rows at
    1e-80 did). There C is first scaled by a power of two, which is exact, so t and f are then the
    trace and squared norm of that scaled copy; elsewhere they are C's own, to the bit."""
    exponent = binary_exponent(c)
    if abs(exponent) > 400:
        c = np.ldexp(c, -exponent)
    return float(np.trace(c)), float(np.vdot(c, c))


def cosine_shift_scale(mean, variance, variant: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(shift, scale) of the rows of a centred or standardised cosine, (x - shift) / scale.

    shift is the mean; scale is None (centred) or the standard deviation (standardised). A
    dimension whose standard deviation is within _ZERO_VAR_REL of its mean's size (0 included) is
    constant: what is left of it after the shift is rounding of its mean (0.1 is the mean of 0.1s
    only to rounding), which dividing by a standard deviation of the same rounding would blow up to
    +-1 in every row, and which, where every dimension is constant (identical rows), would leave
    every row the same residue (cosine 1). Its scale is inf: it adds exactly 0, the value it has
    after centring (the centred variant then gets a scale of ones and infs)."""
    mean = np.asarray(mean, dtype=np.float64).ravel().copy()
    std = np.sqrt(np.maximum(np.asarray(variance, dtype=np.float64).ravel(), 0.0))
    constant = std <= _ZERO_VAR_REL * np.abs(mean)
    if variant == "centred":
        if not constant.any():
            return mean, None
        std = np.ones_like(std)
    return mean, np.where(constant, np.inf, std)


def variance_is_zero(total_variance: float, mean: np.ndarray | None, dim: int) -> bool:
    """True when the total variance is 0 or, given the mean, below float64 rounding of the offset."""
    if not total_variance > 0:
        return True
    if mean is None:
        return False
    scale = float(np.max(np.abs(mean))) if mean.size else 0.0
    return np.sqrt(total_variance / dim) <= _ZERO_VAR_REL * scale


OVERFLOW_MESSAGE = "the covariance of {name} overflows float64; rescale the data"

ZERO_VARIANCE_MESSAGE = (
    "{name} has zero total variance (all rows identical, or a spread under 2e-13 of the mean's size, "
    "which float64 cannot tell from rounding: subtract the mean row first if the rows differ); "
    "{what} is undefined for it -- check the layer or the row selection"
)
