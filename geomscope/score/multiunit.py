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

:func:`update_all` updates several sums with the same reference shift together: the centred and
the standardised variants (both expand around the full mean) share one converted, shifted block y,
and their replicates are the columns of one problem: y is swept by three skinny products (y^2 @ w,
y @ e, y^T @ inv) for both instead of for each. Blocks of 1024 rows keep y and y^2 in cache (4096:
about 25 % slower). Sharing the block halves the time of the pass over the rows that these sums take.
The columns' layout (:func:`batches_of`) is built once per call, not per block, and serves the
fresh copies a threaded pass fills; the full-data replicate of each sum (e = 0) has no linear
column; rows left out of a replicate get an infinite squared norm (1/sqrt(inf) = 0), so the inverse
norms are two plain ufuncs instead of two masked ones. Those three spare update_all about an eighth
of its time; what is left is the three products, at the core's float64 rate, and the
float16 -> float64 conversion.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

BLOCK_ROWS = 1024  # rows per block: the shifted block and its square stay in cache (4096: ~25 % slower)
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
            s[~(s > 0)] = np.inf  # a constant dimension (cosine_shift_scale) adds exactly 0
            self.inv_scale = 1.0 / s  # (R, D)
            self.w = self.inv_scale**2
        self.sum_unit = np.zeros((r, d))
        self.n = np.zeros(r, dtype=np.int64)
        self.n_zero_norm = np.zeros(r, dtype=np.int64)
        # the linear term's coefficients: e_r (unscaled) or e_r * w_r
        self.lin = self.e if self.w is None else self.e * self.w
        self._c = np.einsum("rd,rd->r", self.e, self.lin)

    @property
    def replicates(self) -> int:
        return self.shifts.shape[0]

    def update(self, x, groups, work: np.ndarray | None = None) -> MultiUnitSum:
        """Add rows ``x`` of jackknife ``groups`` (labels >= 0: replicate r < R - 1 leaves out the rows
        labelled r; a label >= R - 1 leaves out none); ``work``: optional scratch space from
        :func:`new_work` (a fresh block-sized array per block costs as much in page faults as its use)."""
        update_all([self], x, groups, work)
        return self

    def fresh(self) -> MultiUnitSum:
        """A MultiUnitSum of the same shifts and scales with no rows (shares their derived arrays)."""
        out = copy.copy(self)
        out.sum_unit = np.zeros_like(self.sum_unit)
        out.n = np.zeros_like(self.n)
        out.n_zero_norm = np.zeros_like(self.n_zero_norm)
        return out

    def merge(self, other: MultiUnitSum) -> MultiUnitSum:
        self.sum_unit += other.sum_unit
        self.n += other.n
        self.n_zero_norm += other.n_zero_norm
        return self

    def n_unit(self, r: int) -> int:
        return int(self.n[r] - self.n_zero_norm[r])


def new_work(rows: int, dim: int) -> np.ndarray:
    """Scratch space for :func:`update_all` of blocks of up to ``rows`` rows: the shifted rows and
    their squares."""
    return np.empty((2, min(rows, BLOCK_ROWS), dim))


@dataclass(frozen=True)
class _Batch:
    """The sums of one reference shift, laid out as the K columns of one (rows, K) problem: every
    replicate of every sum is a column. Built by :func:`batches_of` from the sums' shifts and
    scales, which fresh copies share: once per call of :func:`update_all`, or once by a caller that
    fills fresh copies block by block (accumulate._update_units)."""

    index: list[int]  # the positions of these sums in update_all's list
    ref: np.ndarray  # (D,) the shared reference shift
    weights: np.ndarray | None  # (D, Q) for y^2 @: a column of ones for unscaled sums, then w_r
    qcol: np.ndarray  # (K,) the column of y^2 @ weights holding each replicate's ||y||_w^2
    lin: np.ndarray  # (D, L) -2 e_r (w_r) of the replicates whose e_r is not 0
    lincol: np.ndarray  # (L,) the replicate column of each of lin's columns
    const: np.ndarray  # (K,) ||e_r||_w^2
    group: np.ndarray  # (K,) the jackknife group each replicate leaves out (-1: none)


def batches_of(sums: list[MultiUnitSum]) -> list[_Batch]:
    """The sums grouped by reference shift (the centred and the standardised cosine share the full
    mean), each group as one :class:`_Batch`."""
    groups: list[list[int]] = []
    for i, s in enumerate(sums):
        for g in groups:
            if np.array_equal(sums[g[0]].ref, s.ref):
                g.append(i)
                break
        else:
            groups.append([i])
    out = []
    for index in groups:
        part = [sums[i] for i in index]
        d = part[0].ref.size
        scaled = [s for s in part if s.w is not None]
        plain = len(scaled) < len(part)
        weights = (
            np.vstack(([np.ones(d)] if plain else []) + [s.w for s in scaled]).T.copy() if scaled else None
        )
        qcol, group, nxt = [], [], int(plain)
        for s in part:
            r = s.replicates
            qcol.append(np.zeros(r, int) if s.w is None else np.arange(nxt, nxt + r))
            nxt += 0 if s.w is None else r
            group.append(np.r_[np.arange(r - 1), -1])
        lin = np.vstack([s.lin for s in part])  # (K, D)
        # e = 0: the last replicate of each sum (the full mean), and a replicate of an empty group
        nonzero = np.flatnonzero(lin.any(axis=1))
        out.append(
            _Batch(
                index=index,
                ref=part[0].ref,
                weights=weights,
                qcol=np.concatenate(qcol),
                lin=(-2.0 * lin[nonzero]).T.copy(),  # x -2 is exact: the same products, negated and doubled
                lincol=nonzero,
                const=np.concatenate([s._c for s in part]),
                group=np.concatenate(group),
            )
        )
    return out


def update_all(sums: list[MultiUnitSum], x, groups, work: np.ndarray | None = None, batches=None) -> None:
    """``s.update(x, groups)`` for every MultiUnitSum ``s`` of ``sums``, block by block.

    Sums with the same reference shift (the centred and the standardised cosine: both expand around
    the full mean) share one shifted float64 block y and each of its matrix products (their columns
    side by side), so two variants cost about one pass over y instead of two. ``batches``: this
    layout from :func:`batches_of` of sums with the same shifts and scales (a caller that updates
    fresh copies block by block builds it once).
    """
    x = np.asarray(x)
    g = np.asarray(groups)
    if not sums or x.shape[0] == 0:
        return
    if g.shape != (x.shape[0],) or not g.min() >= 0:
        raise ValueError("groups must give each row a jackknife group label >= 0")
    if batches is None:
        batches = batches_of(sums)
    elif sorted(j for b in batches for j in b.index) != list(range(len(sums))) or any(
        b.group.size != sum(sums[j].replicates for j in b.index) for b in batches
    ):
        raise ValueError("batches were laid out for other sums")
    if work is None or work.shape[1] < min(BLOCK_ROWS, x.shape[0]):
        work = new_work(x.shape[0], x.shape[1])
    for i in range(0, x.shape[0], BLOCK_ROWS):  # the same blocks whatever the scratch: the same numbers
        for b in batches:
            _block([sums[j] for j in b.index], b, x[i : i + BLOCK_ROWS], g[i : i + BLOCK_ROWS], work)


def _block(sums: list[MultiUnitSum], b: _Batch, xb: np.ndarray, gb: np.ndarray, work: np.ndarray) -> None:
    """One block of rows into the sums of one batch ``b``: the squared norms of every replicate, the
    rows' inverse norms, and the sums of the unit vectors, each for all K columns at once."""
    m = xb.shape[0]
    y = work[0, :m]
    np.copyto(y, xb)  # convert once, then shift in place: faster than a converting subtract
    y -= b.ref
    if b.weights is not None:  # weighted squared norms of y (the ones column: the unscaled sums)
        q = np.square(y, out=work[1, :m]) @ b.weights
    else:
        q = np.einsum("ij,ij->i", y, y)[:, None]
    sq = q[:, b.qcol]  # (m, K): ||y||_w^2 + ||e||_w^2, then - 2 y.(e w)
    sq += b.const
    # rounding of the expansion is ~eps * (||y||_w^2 + ||e||_w^2): below that the row IS the shift
    floor = sq * _ROUND
    if b.lincol.size:
        sq[:, b.lincol] += y @ b.lin
    keep = sq > floor  # (NaN: not kept)
    keep &= gb[:, None] != b.group  # a replicate leaves its own group's rows out
    np.copyto(sq, np.inf, where=~keep)  # 1 / sqrt(inf) = 0: the rows left out add nothing
    inv = np.sqrt(sq, out=sq)
    np.divide(1.0, inv, out=inv)
    # rows of each group (by comparison: labels of any dtype or range); [-1]: the full data leaves none out
    left_out = np.array([np.count_nonzero(gb == r) for r in range(int(b.group.max()) + 1)] + [0], np.int64)
    n_in = m - left_out[b.group]
    kept = np.count_nonzero(keep)
    n_zero = np.zeros_like(n_in) if kept == n_in.sum() else n_in - np.count_nonzero(keep, axis=0)
    t = y.T @ inv  # (D, K)
    inv_sum = inv.sum(axis=0)
    col = 0
    for s in sums:
        cols = slice(col, col + s.replicates)
        part = t[:, cols] - s.e.T * inv_sum[cols]
        if s.inv_scale is not None:
            part *= s.inv_scale.T
        s.sum_unit += part.T
        s.n += n_in[cols]
        s.n_zero_norm += n_zero[cols]
        col += s.replicates
