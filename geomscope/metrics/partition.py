"""Partition-function isotropy I(W) of an embedding matrix (Arora et al. 2016; Mu & Viswanath 2018).

W is (V, D): one row per vocabulary item. For a unit direction c, Z(c) = sum_w exp(c^T w).
I(W) = min_c Z(c) / max_c Z(c) over c in the eigenvectors of W^T W, both signs of each (Z(c) !=
Z(-c)), so 2D directions. log Z is computed with logsumexp (plain exp overflows for large-norm
W) and I = exp(log Z_min - log Z_max) in (0, 1]; 1 means perfectly isotropic. ``centred=True``
subtracts the mean row first (and takes the eigenvectors of the centred W^T W).
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.metrics._validate import NonfiniteRows, as_rows, count_nonfinite_rows


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
        w = w - w.mean(axis=0)
    if not np.any(w):
        raise DataError("W is all zeros (after centring); the partition function is constant")
    _, vecs = np.linalg.eigh(w.T @ w)
    pos, neg = np.empty(d), np.empty(d)
    for j in range(0, d, block):
        p = w @ vecs[:, j : j + block]
        pos[j : j + block] = logsumexp(p, axis=0)
        neg[j : j + block] = logsumexp(-p, axis=0)
    return np.concatenate([pos, neg]), vecs


def partition_isotropy(W, centred: bool = False) -> dict:
    """I(W) = min Z / max Z; returns {I, log_z_min, log_z_max, n_directions, centred}."""
    log_z, _ = partition_log_z(W, centred)
    lo, hi = float(log_z.min()), float(log_z.max())
    return {
        "I": float(np.exp(lo - hi)),
        "log_z_min": lo,
        "log_z_max": hi,
        "n_directions": int(log_z.size),
        "centred": bool(centred),
    }
