"""Sums of unit vectors of (x - shift_r) / scale_r for R (shift, scale) pairs at once.

An adapter for the jackknife of the centred / standardised average cosine: replicate r of G
(every jackknife group but r) needs the unit vectors of its rows shifted by ITS mean m_r (and
divided by its standard deviation s_r). Running one :class:`geomscope.metrics.UnitSum` per
replicate costs G full passes over the rows in Python-level loops; here all R = G + 1 replicates
(the last one: all rows, the full-data shift/scale) are done with a few matrix products per block.

With the reference shift m = shift_{R-1}, y = x - m and e_r = shift_r - m (small),

    z_r = (y - e_r) / s_r,     ||z_r||^2 = (y*y) @ w_r - 2 y @ (e_r * w_r) + sum(e_r^2 w_r),  w_r = 1/s_r^2
    sum_i z_r,i / ||z_r,i|| = (Y^T @ inv_r - e_r * sum_i inv_r,i) / s_r,     inv_r,i = 1/||z_r,i||

(``scale=None``: s_r = 1). Row i enters replicate r unless ``group_i == r`` (r < R - 1); the last
replicate takes every row. A row whose transformed squared norm is within rounding of 0 (<= 64 eps
(||y||_w^2 + ||e_r||_w^2): x equal to the shift) is excluded and counted in ``n_zero_norm``, as
UnitSum does for an exact 0. Constant dimensions (scale 0) are divided
by 1, as in UnitSum. The expansion is around the full mean, so no cancellation beyond float64
rounding of ||y||^2 occurs; tests compare it with per-replicate UnitSums and with numpy.
"""

from __future__ import annotations

import numpy as np

BLOCK_ROWS = 4096
_ROUND = 64 * np.finfo(np.float64).eps


class MultiUnitSum:
    """``MultiUnitSum(shifts (R, D), scales (R, D) | None)``; ``update(x, groups)``; ``merge(other)``.

    Attributes: ``sum_unit`` (R, D), ``n`` (R,) rows entered, ``n_zero_norm`` (R,) rows excluded
    for zero norm; ``n_unit(r)`` = n[r] - n_zero_norm[r].
    """

    def __init__(self, shifts, scales=None):
        self.shifts = np.asarray(shifts, dtype=np.float64)
        r, d = self.shifts.shape
        self.ref = self.shifts[-1].copy()
        self.e = self.shifts - self.ref  # (R, D)
        if scales is None:
            self.w = None
            self.inv_scale = None
        else:
            s = np.asarray(scales, dtype=np.float64).copy()
            s[~(s > 0)] = 1.0
            self.inv_scale = 1.0 / s  # (R, D)
            self.w = self.inv_scale**2
        self.sum_unit = np.zeros((r, d))
        self.n = np.zeros(r, dtype=np.int64)
        self.n_zero_norm = np.zeros(r, dtype=np.int64)
        if self.w is None:
            self._c = np.einsum("rd,rd->r", self.e, self.e)
        else:
            self._ew = self.e * self.w
            self._c = np.einsum("rd,rd->r", self.e, self._ew)

    @property
    def replicates(self) -> int:
        return self.shifts.shape[0]

    def update(self, x, groups, work: np.ndarray | None = None) -> MultiUnitSum:
        """Add rows ``x`` of jackknife ``groups``; ``work``: optional float64 scratch space of
        (BLOCK_ROWS, D) (a fresh block-sized array per block costs as much in page faults as its use)."""
        x = np.asarray(x)
        g = np.asarray(groups)
        if work is None and x.shape[0] > 0:
            work = np.empty((min(BLOCK_ROWS, x.shape[0]), x.shape[1]))
        for i in range(0, x.shape[0], BLOCK_ROWS):
            self._block(x[i : i + BLOCK_ROWS], g[i : i + BLOCK_ROWS], work)
        return self

    def _block(self, xb: np.ndarray, gb: np.ndarray, work: np.ndarray) -> None:
        R = self.replicates
        y = np.subtract(xb, self.ref, out=work[: xb.shape[0]])  # (m, D), float64
        if self.w is None:
            a = np.einsum("ij,ij->i", y, y)[:, None]
        else:
            a = (y * y) @ self.w.T
        sq = a - 2.0 * (y @ (self.e if self.w is None else self._ew).T) + self._c  # (m, R)
        member = np.ones_like(sq, dtype=bool)
        if R > 1:
            member[:, :-1] = gb[:, None] != np.arange(R - 1)[None, :]
        # rounding of the expansion is ~eps * (a + c): below that the row IS the shift (zero norm)
        pos = member & (sq > _ROUND * (a + self._c))
        inv = np.zeros_like(sq)
        np.divide(1.0, np.sqrt(sq, where=pos, out=np.zeros_like(sq)), out=inv, where=pos)
        s = y.T @ inv  # (D, R)
        s -= self.e.T * inv.sum(axis=0)
        if self.inv_scale is not None:
            s *= self.inv_scale.T
        self.sum_unit += s.T
        self.n += member.sum(axis=0)
        self.n_zero_norm += (member & ~pos).sum(axis=0)

    def merge(self, other: MultiUnitSum) -> MultiUnitSum:
        self.sum_unit += other.sum_unit
        self.n += other.n
        self.n_zero_norm += other.n_zero_norm
        return self

    def n_unit(self, r: int) -> int:
        return int(self.n[r] - self.n_zero_norm[r])
