"""All-but-the-top and whitening: a layer's rows post-processed, measured exactly from its covariance
where the covariance suffices and with one more pass over the rows where it does not.

All-but-the-top (Mu & Viswanath, *All-but-the-Top: Simple and Effective Postprocessing for Word
Representations*, ICLR 2018) with k directions maps a row to

    x -> P_k (x - mu),    P_k = I - U_k U_k^T

(mu the mean, U_k the top-k eigenvectors of the covariance C). The processed rows' covariance is
P_k C P_k = sum_{i > k} lambda_i u_i u_i^T: its spectrum is lambda_{k+1..D} and k zeros, so IsoScore
and IsoScore* of the processed rows are exact functions of C (no pass over the rows).

Whitening (ZCA) maps x -> W (x - mu), W = U_r Lambda_r^{-1/2} U_r^T over the r eigenvalues above the
rank tolerance lambda_1 * D * eps (below it an eigenvalue of the accumulated C cannot be told from
0). The whitened covariance is U_r U_r^T: IsoScore (r - 1)/(D - 1), 1 at full rank. The cosine of
two whitened rows is the same for PCA whitening (Lambda_r^{-1/2} U_r^T (x - mu), r coordinates),
which is what the second pass computes.

A shrinkage target given as a covariance C0 is processed as the rows are (P_k C0 P_k, W C0 W^T): it
stands for reference data in the same coordinates; "trace" and "identity" are taken of the processed
covariance itself.

The average cosine of processed rows is not a function of C: each row is normalised after the
transformation. :class:`RemovedTopUnitSums` and :class:`WhitenedUnitSums` sum the unit vectors of
the processed rows for R (shift, basis) pairs at once -- the delete-one-group jackknife replicates
and the full data, each with its own mean and eigenvectors -- from a few matrix products per block:
with y = x - m (m the last, full-data shift), e_r = shift_r - m and y_r = y - e_r,

    ||P_k y_r||^2 = ||y_r||^2 - ||U_k^T y_r||^2,    sum_i P_k y_r,i / ||P_k y_r,i|| = P_k t_rk,
    t_rk = sum_i y_r,i / ||P_k y_r,i|| = Y^T inv_rk - e_r sum_i inv_rk,i

so every k shares one product Y U (the top kmax columns) and one Y^T inv. Row i enters replicate r
unless its group is r (r < R - 1; the last replicate takes every row); a row whose processed squared
norm is within rounding of 0 (<= 64 eps times the squared norms it is the difference of) has no
direction and is counted in ``n_zero_norm``, as :class:`~geomscope.metrics.moments.UnitSum` counts an
exact 0.
"""

from __future__ import annotations

import copy

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.metrics.isotropy import isoscore_from_cov, isoscore_star_from_cov
from geomscope.metrics.validate import as_covariance, as_rows

BLOCK_ROWS = 1024  # rows per block: the block and its products over every replicate stay small
_ROUND = 64 * np.finfo(np.float64).eps


# ---------------------------------------------------------------------------------------- maps
def eigh_descending(C) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues descending, eigenvectors as columns in that order) of the covariance ``C``;
    rounding's small negative eigenvalues are set to 0."""
    c = as_covariance(C)
    lam, vec = np.linalg.eigh((c + c.T) / 2.0)
    lam, vec = lam[::-1], vec[:, ::-1]
    return np.where(lam < 0, 0.0, lam), vec


def whitening_rank(lam: np.ndarray) -> int:
    """The eigenvalues above lambda_1 * D * eps: the rank the whitening divides by."""
    if lam.size == 0 or not lam[0] > 0:
        return 0
    return int(np.count_nonzero(lam > lam[0] * lam.size * np.finfo(np.float64).eps))


def whitening_map(lam: np.ndarray, vec: np.ndarray) -> np.ndarray:
    """Lambda_r^{-1/2} U_r^T as its transpose (D, r): the PCA whitening of ``(lam, vec)``
    (:func:`eigh_descending`), rows times it give the whitened coordinates."""
    r = whitening_rank(lam)
    return vec[:, :r] / np.sqrt(lam[:r])


def check_ks(ks, dim: int) -> tuple[int, ...]:
    """The directions removed, as sorted distinct ints in [1, D - 1]; InputError otherwise."""
    out = sorted({int(k) for k in ks})
    if not out or out[0] < 1:
        raise InputError(f"all-but-the-top removes k >= 1 directions; got {list(ks)}")
    if out[-1] >= dim:
        raise InputError(
            f"all-but-the-top k = {out[-1]} leaves nothing of D = {dim} dimensions; give k below {dim}"
        )
    return tuple(out)


# ------------------------------------------------------------------------- covariance metrics
def removed_top_covariance(lam: np.ndarray, vec: np.ndarray, k: int) -> np.ndarray:
    """P_k C P_k = sum_{i > k} lambda_i u_i u_i^T: the covariance after removing the top k."""
    v = vec[:, k:]
    return (v * lam[k:]) @ v.T


def _scores(lam: np.ndarray, zeta: float, target, processed_cov, transform) -> tuple[float, float]:
    """(IsoScore, IsoScore*) of processed rows whose covariance has eigenvalues ``lam``. A named
    target ("trace", "identity") is taken of the processed covariance, whose scores depend on its
    eigenvalues only (computed from diag(lam): exact, and 1 for a full-rank whitening); a covariance
    C0 is transformed as the rows are (``transform``) and shrinks ``processed_cov()`` itself."""
    diag = np.diag(lam)
    iso = isoscore_from_cov(diag)
    if isinstance(target, str):
        return iso, isoscore_star_from_cov(diag, zeta, target)
    return iso, isoscore_star_from_cov(processed_cov(), zeta, transform(as_covariance(target, "C0")))


def removed_top_isoscores(C, ks, zeta: float, target="trace") -> dict[int, tuple[float, float]]:
    """{k: (IsoScore, IsoScore*)} of the rows after removing the mean and the top-k principal
    directions, from their covariance P_k C P_k (eigenvalues lambda_{k+1..D} and k zeros);
    DataError when nothing is left (k >= the rank, :func:`whitening_rank`)."""
    lam, vec = eigh_descending(C)
    rank = whitening_rank(lam)
    out = {}
    for k in ks:
        if k >= rank:  # what is left is rounding
            raise DataError(
                f"removing the top {k} directions leaves no variance (the covariance has rank {rank})"
            )
        rest = np.concatenate([lam[k:], np.zeros(min(k, lam.size))])
        p = np.eye(vec.shape[0]) - vec[:, :k] @ vec[:, :k].T
        out[k] = _scores(
            rest, zeta, target, lambda k=k: removed_top_covariance(lam, vec, k), lambda c0, p=p: p @ c0 @ p
        )
    return out


def whitened_isoscores(C, zeta: float, target="trace") -> tuple[float, float, int]:
    """(IsoScore, IsoScore*, rank r) of the ZCA-whitened rows, from C: their covariance is
    U_r U_r^T (r eigenvalues 1, the rest 0), so IsoScore is (r - 1)/(D - 1); a covariance C0 target
    is whitened as the rows are."""
    lam, vec = eigh_descending(C)
    r = whitening_rank(lam)
    if r < 1:
        raise DataError("the covariance is zero: there is nothing to whiten")
    ur = vec[:, :r]
    w = (ur / np.sqrt(lam[:r])) @ ur.T  # ZCA: U_r Lambda_r^{-1/2} U_r^T
    ones = np.r_[np.ones(r), np.zeros(lam.size - r)]
    iso, star = _scores(ones, zeta, target, lambda: ur @ ur.T, lambda c0: w @ c0 @ w.T)
    return iso, star, r


# --------------------------------------------------------------------- reference transforms
def removed_top_rows(X, k: int) -> np.ndarray:
    """The rows of X (N, D) after all-but-the-top with k directions, in float64 (a reference)."""
    a = np.asarray(as_rows(X), np.float64)
    y = a - a.mean(axis=0)
    _, vec = eigh_descending(np.cov(a.T, ddof=1))
    u = vec[:, :k]
    return y - (y @ u) @ u.T


def whitened_rows(X) -> np.ndarray:
    """The rows of X (N, D) PCA-whitened with their own covariance (r coordinates; a reference)."""
    a = np.asarray(as_rows(X), np.float64)
    lam, vec = eigh_descending(np.cov(a.T, ddof=1))
    return (a - a.mean(axis=0)) @ whitening_map(lam, vec)


# ---------------------------------------------------------------------------- second pass
def _kept(sq: np.ndarray, floor: np.ndarray, gb: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Rows with a direction (squared norm above the rounding ``floor``) that replicate columns take
    (a replicate leaves its own group's rows out; ``group`` -1: the full data, none)."""
    return (sq > floor) & (gb[:, None] != group)


class _ReplicateSums:
    """What both second-pass sums share: R shifts expanded around the last one, replicate groups,
    counts, merging."""

    def _init_shifts(self, shifts) -> None:
        self.shifts = np.asarray(shifts, dtype=np.float64)
        if self.shifts.ndim != 2 or self.shifts.shape[0] < 1:
            raise InputError("shifts must be an (R, D) array with R >= 1")
        self.ref = self.shifts[-1].copy()
        self.e = self.shifts - self.ref
        r = self.shifts.shape[0]
        self.group = np.r_[np.arange(r - 1), -1]

    @property
    def replicates(self) -> int:
        return self.shifts.shape[0]

    @property
    def dim(self) -> int:
        return self.shifts.shape[1]

    def fresh(self):
        """The same shifts and bases with no rows (shares their arrays)."""
        out = copy.copy(self)
        out.sums = [np.zeros_like(s) for s in self.sums]
        out.n = np.zeros_like(self.n)
        out.n_zero_norm = np.zeros_like(self.n_zero_norm)
        return out

    def merge(self, other):
        for a, b in zip(self.sums, other.sums, strict=True):
            a += b
        self.n += other.n
        self.n_zero_norm += other.n_zero_norm
        return self

    def update(self, x, groups):
        """Add rows ``x`` of jackknife ``groups`` (labels >= 0; replicate r < R - 1 leaves out the
        rows labelled r), block by block."""
        a = as_rows(x)
        g = np.asarray(groups)
        if a.shape[1] != self.dim:
            raise DataError(f"rows have {a.shape[1]} columns but these sums hold dim {self.dim}")
        if g.shape != (a.shape[0],):
            raise ValueError("groups must give each row a jackknife group label")
        for i in range(0, a.shape[0], BLOCK_ROWS):
            self._block(np.asarray(a[i : i + BLOCK_ROWS], np.float64) - self.ref, g[i : i + BLOCK_ROWS])
        return self

    def _count(self, keep: np.ndarray, gb: np.ndarray, colgroup: np.ndarray) -> None:
        """Rows entered and rows without a direction, per column (``colgroup``: the group each
        column leaves out)."""
        n_in = gb.size - np.count_nonzero(gb[:, None] == colgroup, axis=0)
        self.n += n_in
        self.n_zero_norm += n_in - np.count_nonzero(keep, axis=0)

    def _n_unit(self, col: int) -> int:
        return int(self.n[col] - self.n_zero_norm[col])


class RemovedTopUnitSums(_ReplicateSums):
    """Sums of the unit vectors of P_k (x - shift_r) for every replicate r and every k of ``ks``.

    ``RemovedTopUnitSums(shifts (R, D), bases (R, D, kmax), ks)``: replicate r's mean and its top
    eigenvectors (descending), kmax >= max(ks). ``update(x, groups)``, ``merge``, ``fresh``;
    :meth:`avgcos` (r, k) gives the average cosine of the processed rows.
    """

    def __init__(self, shifts, bases, ks):
        self._init_shifts(shifts)
        self.bases = np.asarray(bases, dtype=np.float64)
        self.ks = tuple(int(k) for k in ks)
        r, d = self.shifts.shape
        if self.bases.shape[:2] != (r, d) or self.bases.shape[2] < max(self.ks):
            raise InputError(f"bases must be (R, D, kmax >= {max(self.ks)}); got {self.bases.shape}")
        kmax = max(self.ks)
        self.bases = self.bases[:, :, :kmax]
        self._u_all = self.bases.transpose(1, 0, 2).reshape(d, r * kmax)  # (D, R kmax)
        self._eu = np.einsum("rd,rdk->rk", self.e, self.bases)  # e_r^T U_r
        self._ee = np.einsum("rd,rd->r", self.e, self.e)
        self._colgroup = np.repeat(self.group, len(self.ks))  # column (r, k) leaves out group r
        self._e_cols = np.repeat(self.e.T, len(self.ks), axis=1)  # (D, R K): e_r per column
        self.sums = [np.zeros((d, r * len(self.ks)))]  # column r K + j: t_r,ks[j]
        self.n = np.zeros(r * len(self.ks), np.int64)
        self.n_zero_norm = np.zeros(r * len(self.ks), np.int64)

    def _block(self, y: np.ndarray, gb: np.ndarray) -> None:
        r, kmax, nk = self.replicates, self.bases.shape[2], len(self.ks)
        m = len(y)
        yy = np.einsum("ij,ij->i", y, y)
        full = yy[:, None] - 2.0 * (y @ self.e.T) + self._ee  # ||y_r||^2, (m, R)
        proj = (y @ self._u_all).reshape(m, r, kmax) - self._eu  # U_r^T y_r
        removed = np.cumsum(proj * proj, axis=2)[:, :, np.asarray(self.ks) - 1]  # ||U_k^T y_r||^2
        sq = (full[:, :, None] - removed).reshape(m, r * nk)
        floor = np.repeat(_ROUND * (yy[:, None] + self._ee), nk, axis=1)
        keep = _kept(sq, floor, gb, self._colgroup)
        inv = np.zeros(keep.shape)
        np.divide(1.0, np.sqrt(sq, where=keep, out=np.ones(keep.shape)), out=inv, where=keep)
        self.sums[0] += y.T @ inv - self._e_cols * inv.sum(axis=0)
        self._count(keep, gb, self._colgroup)

    def unit_sum(self, r: int, k: int) -> np.ndarray:
        """Sum of the unit vectors of replicate r's rows after removing its top k directions: P_k t_rk."""
        j = self.ks.index(k)
        t = self.sums[0][:, r * len(self.ks) + j]
        u = self.bases[r, :, :k]
        return t - u @ (u.T @ t)

    def avgcos(self, r: int, k: int) -> float:
        from geomscope.metrics.cosine import avgcos_from_sum

        return avgcos_from_sum(self.unit_sum(r, k), self.n_unit(r, k))

    def n_unit(self, r: int, k: int) -> int:
        """Rows of replicate r with a direction after removing the top k."""
        return self._n_unit(r * len(self.ks) + self.ks.index(k))


class WhitenedUnitSums(_ReplicateSums):
    """Sums of the unit vectors of the whitened rows (x - shift_r) A_r for every replicate r.

    ``WhitenedUnitSums(shifts (R, D), maps [A_r (D, r_r)])``: replicate r's mean and PCA whitening
    map (:func:`whitening_map`). :meth:`avgcos` (r) gives the average cosine of the whitened rows.
    """

    def __init__(self, shifts, maps):
        self._init_shifts(shifts)
        self.maps = [np.asarray(a, dtype=np.float64) for a in maps]
        if len(self.maps) != self.replicates or any(
            a.ndim != 2 or a.shape[0] != self.dim or a.shape[1] < 1 for a in self.maps
        ):
            raise InputError("maps must hold one (D, r) whitening map, r >= 1, per shift")
        self._cols = np.cumsum([0] + [a.shape[1] for a in self.maps])
        self._a_all = np.hstack(self.maps)  # (D, sum r)
        self._ea = np.concatenate([e @ a for e, a in zip(self.e, self.maps, strict=True)])
        self._ea2 = np.array([float(v @ v) for v in np.split(self._ea, self._cols[1:-1])])
        self.sums = [np.zeros(a.shape[1]) for a in self.maps]
        self.n = np.zeros(self.replicates, np.int64)
        self.n_zero_norm = np.zeros(self.replicates, np.int64)

    def _block(self, y: np.ndarray, gb: np.ndarray) -> None:
        ya = y @ self._a_all  # (m, sum r)
        z = ya - self._ea
        z2 = z * z
        ya2 = ya * ya
        starts = self._cols[:-1]
        sq = np.add.reduceat(z2, starts, axis=1)
        scale = np.add.reduceat(ya2, starts, axis=1) + self._ea2
        keep = _kept(sq, _ROUND * scale, gb, self.group)
        inv = np.zeros(keep.shape)
        np.divide(1.0, np.sqrt(sq, where=keep, out=np.ones(keep.shape)), out=inv, where=keep)
        for r in range(self.replicates):
            self.sums[r] += z[:, self._cols[r] : self._cols[r + 1]].T @ inv[:, r]
        self._count(keep, gb, self.group)

    def n_unit(self, r: int) -> int:
        """Rows of replicate r with a direction after whitening."""
        return self._n_unit(r)

    def avgcos(self, r: int) -> float:
        from geomscope.metrics.cosine import avgcos_from_sum

        return avgcos_from_sum(self.sums[r], self.n_unit(r))
