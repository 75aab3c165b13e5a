"""Partition-function isotropy I(W) of an embedding matrix (Arora et al. 2016; Mu & Viswanath 2018).

W is (V, D): one row per vocabulary item. For a unit direction c, Z(c) = sum_w exp(c^T w).
I(W) = min_c Z(c) / max_c Z(c) over c in the eigenvectors of W^T W, both signs of each (Z(c) !=
Z(-c)), so 2D directions. log Z is computed with logsumexp (plain exp overflows for large-norm
W), so ``log_z_min`` and ``log_z_max`` are accurate at any norm; I = exp(log Z_min - log Z_max) is
in [0, 1] and underflows to 0.0 once the two differ by more than about 745 (W * 1000 of a typical
embedding already does): compare the log values there. 1 means perfectly isotropic.
``centred=True`` subtracts the mean row first (and takes the eigenvectors of the centred W^T W);
identical rows (zero variance by the library's rule, validate.variance_is_zero) then have no
centred partition function: DataError, as for every other metric of constant data.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.metrics.validate import (
    ZERO_VARIANCE_MESSAGE,
    NonfiniteRows,
    as_rows,
    binary_exponent,
    count_nonfinite_rows,
    variance_is_zero,
)


def partition_log_z(W, centred: bool = False, block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(log Z over the 2D directions [+v_1..+v_D, -v_1..-v_D], eigenvectors V (D, D) as columns)."""
    a = as_rows(W, "W")
    v_rows, d = a.shape
    if v_rows < 2 or d < 2:
        raise DataError(f"W is {v_rows}x{d}; at least 2 rows (vocabulary items) and 2 dimensions are needed")
    bad = count_nonfinite_rows(a)
    if bad:
        raise NonfiniteRows(bad, v_rows, "W")
    from scipy.special import logsumexp

    w = np.asarray(a, dtype=np.float64)
    if centred:
        mean = w.mean(axis=0)
        w = w - mean
        # identical rows leave only the rounding of their mean (0.5 - mean(0.5s) is 0, 0.1 - mean(0.1s)
        # is not): the same zero-variance rule as the other metrics, so both refuse alike
        if variance_is_zero(float(np.einsum("ij,ij->", w, w)) / (v_rows - 1), mean, d):
            raise DataError(ZERO_VARIANCE_MESSAGE.format(name="W", what="the centred partition isotropy"))
    if not np.any(w):
        raise DataError("W is all zeros; the partition function is constant (Z = V in every direction)")
    # the eigenvectors do not depend on W's scale, but W^T W squares it (overflow beyond ~1e154,
    # lost digits below ~1e-154): form it of W times a power of two, which is exact
    scaled = np.ldexp(w, -binary_exponent(w))
    _, vecs = np.linalg.eigh(scaled.T @ scaled)
    pos, neg = np.empty(d), np.empty(d)
    for j in range(0, d, block):
        p = w @ vecs[:, j : j + block]
        pos[j : j + block] = logsumexp(p, axis=0)
        neg[j : j + block] = logsumexp(-p, axis=0)
    log_z = np.concatenate([pos, neg])
    if not np.isfinite(log_z).all():  # projections beyond float64 (entries near 1e308)
        raise DataError("W's projections c^T w overflow float64; rescale W")
    return log_z, vecs


def partition_isotropy(W, centred: bool = False) -> dict:
    """I(W) = min Z / max Z; returns {I, log_z_min, log_z_max, n_directions, centred}. I may underflow
    to 0.0 for large-norm W (module docstring); the log values do not."""
    log_z, _ = partition_log_z(W, centred)
    lo, hi = float(log_z.min()), float(log_z.max())
    return {
        "I": float(np.exp(lo - hi)),
        "log_z_min": lo,
        "log_z_max": hi,
        "n_directions": int(log_z.size),
        "centred": bool(centred),
    }
