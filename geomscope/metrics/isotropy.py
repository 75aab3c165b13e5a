"""IsoScore and IsoScore* (float64), from points or from a covariance, in numpy and torch.

Definitions (docs/metrics.md). X is (N, D): N rows (points, token vectors), D columns; C its sample
covariance (ddof=1). The published IsoScore (Rudman et al. 2022) normalises the eigenvalues of C
to norm sqrt(D), takes the isotropy defect and maps it to a count of "dimensions used" k; that
algebra reduces exactly to the participation ratio

    k = PR = tr(C)^2 / ||C||_F^2,      IsoScore = (PR - 1) / (D - 1)  in [0, 1]

so no eigendecomposition is needed and the score is differentiable wherever C != 0 (the numpy
functions clip to [0, 1] against rounding; the torch ones do not clip, to keep gradients).
(``isoscore_published`` keeps the published steps as a reference.) C must be a covariance
(symmetric positive semi-definite).

IsoScore* (Rudman & Eickhoff 2024) is IsoScore of the shrunk covariance

    C_zeta = (1 - zeta) * C + zeta * C0,    zeta in [0, 1]  (zeta = 0: IsoScore, 1: C0 alone)

with shrinkage target C0: "identity" (the isoscore package's C0 = I; not scale-invariant),
"trace" (tr(C)/D * I, a trace-matched identity: scale-invariant; the default) or a given (D, D)
covariance (the official code uses that of up to 250,000 token vectors).

Rank limit: rank(C) <= N - 1, so when N <= D (``rank_limited``) IsoScore is at most
(N - 2)/(D - 1) (``isoscore_cap``). Bad input (N < 2, D < 2, NaN/Inf, zero total variance) raises
DataError with a one-line reason; a bad zeta/target raises InputError.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.metrics.moments import Moments
from geomscope.metrics.validate import (
    ZERO_VARIANCE_MESSAGE,
    as_covariance,
    as_rows,
    check_points,
    is_torch,
    participation_terms,
    variance_is_zero,
)

SHRINKAGE_TARGETS = ("trace", "identity")


def rank_limited(n: int, d: int) -> bool:
    """True when N <= D: rank(C) <= N - 1 < D caps IsoScore below 1 (warn when reporting)."""
    return int(n) <= int(d)


def isoscore_cap(n: int, d: int) -> float:
    """Largest IsoScore that N points can reach in D dimensions: (min(N - 1, D) - 1) / (D - 1)."""
    return (min(int(n) - 1, int(d)) - 1) / (int(d) - 1)


def check_zeta(zeta) -> float:
    """``zeta`` as a float in [0, 1] (the weight on the shrinkage target); InputError otherwise."""
    z = float(zeta)
    if not 0.0 <= z <= 1.0:
        raise InputError(f"zeta must be in [0, 1] (weight on the shrinkage target); got {zeta}")
    return z


def _score(tr: float, fro2: float, d: int, name: str = "C") -> float:
    """(PR - 1)/(D - 1), PR = tr^2 / fro2 (:func:`participation_terms`), clipped to [0, 1] against
    rounding. PR is in [1, D] for a covariance (PSD); PR <= D holds for any symmetric matrix, but a
    PR below 1 beyond rounding proves a negative eigenvalue: refused, not clipped to 0."""
    if not (np.isfinite(tr) and np.isfinite(fro2) and fro2 > 0):
        raise DataError("the covariance overflows float64 or is zero; rescale the data")
    pr = tr * tr / fro2
    if pr < 1.0 - 1e-9:
        raise DataError(
            f"{name} is not a covariance: its participation ratio tr(C)^2 / ||C||_F^2 is {pr:.3g}, "
            "and a covariance's is at least 1 (it has a negative eigenvalue); check how it was computed"
        )
    return min(1.0, max(0.0, (pr - 1.0) / (d - 1)))


def isoscore_from_cov(C) -> float:
    """IsoScore of a covariance matrix C (D, D): (PR - 1)/(D - 1), PR = tr(C)^2 / ||C||_F^2."""
    c = as_covariance(C)
    if not float(np.trace(c)) > 0:
        raise DataError(ZERO_VARIANCE_MESSAGE.format(name="the covariance", what="IsoScore"))
    return _score(*participation_terms(c), c.shape[0])


def _scatter(a: np.ndarray) -> tuple[float, float, Moments | None]:
    """The :func:`participation_terms` of the centred scatter of rows ``a`` (validated), float64.

    N < D uses the N x N Gram matrix of the centred rows (same trace and Frobenius norm)."""
    n, d = a.shape
    if n < d:
        check_points(a)
        xc = np.asarray(a, dtype=np.float64)
        mean = xc.mean(axis=0)
        xc = xc - mean
        # numpy runs xc @ xc.T as a BLAS syrk and mirrors it, with the GIL released (scipy's dsyrk
        # wrapper holds it, which stalls every other thread of a scorer)
        g = xc @ xc.T
        if variance_is_zero(float(np.trace(g)) / (n - 1), mean, d):
            raise DataError(ZERO_VARIANCE_MESSAGE.format(name="X", what="IsoScore"))
        return (*participation_terms(g), None)
    m = Moments(d, extras=False).update(a)
    m.check_variance("X")
    return (*participation_terms(m.M2), m)


def isoscore(X) -> float:
    """IsoScore of points X (N, D) (numpy or torch), via the covariance (ddof=1) in float64."""
    a = as_rows(X)
    check_points(a, finite=False)  # finiteness is checked block-wise while accumulating
    tr, fro2, _ = _scatter(a)
    return _score(tr, fro2, a.shape[1])


def shrinkage_target(C, target="trace") -> np.ndarray:
    """C0 (D, D) for covariance C: "identity" -> I, "trace" -> tr(C)/D * I, an array -> itself."""
    c = as_covariance(C)
    d = c.shape[0]
    if isinstance(target, str):
        if target == "identity":
            return np.eye(d)
        if target == "trace":
            return np.eye(d) * (np.trace(c) / d)
        raise InputError(
            f"unknown shrinkage target {target!r}; use one of {', '.join(SHRINKAGE_TARGETS)} "
            "or a (D, D) covariance"
        )
    c0 = as_covariance(target, "C0")
    if c0.shape != c.shape:
        raise DataError(f"shrinkage covariance C0 is {c0.shape} but the data covariance is {c.shape}")
    return c0


def isoscore_star_from_cov(C, zeta, target="trace") -> float:
    """IsoScore* = IsoScore of (1 - zeta) * C + zeta * C0, C0 = shrinkage_target(C, target)."""
    z = check_zeta(zeta)
    c = as_covariance(C)
    c0 = shrinkage_target(c, target)
    cz = (1.0 - z) * c + z * c0
    if not float(np.trace(cz)) > 0:
        raise DataError(ZERO_VARIANCE_MESSAGE.format(name="the shrunk covariance", what="IsoScore*"))
    return _score(*participation_terms(cz), c.shape[0], "the shrunk covariance")


def isoscore_star(X, zeta, target="trace") -> float:
    """IsoScore* of points X (N, D); see ``isoscore_star_from_cov``. X must have non-zero variance."""
    check_zeta(zeta)
    a = as_rows(X)
    check_points(a, finite=False)  # finiteness is checked block-wise while accumulating
    d = a.shape[1]
    m = Moments(d, extras=False).update(a)
    m.check_variance("X", "IsoScore*")
    return isoscore_star_from_cov(m.covariance(), zeta, target)


def isoscore_published(X, C0=None, zeta: float = 0.0) -> float:
    """Float64 transcription of the published algorithm (reference for tests; uses an SVD).

    C = cov(X) (ddof=1), shrunk to (1 - zeta) C + zeta C0 when C0 is given; lambda = its singular
    values; lambda_hat = sqrt(D) lambda / ||lambda||; defect = ||lambda_hat - 1|| / sqrt(2 (D - sqrt D));
    k = (D - defect^2 (D - sqrt D))^2 / D; score = (k - 1) / (D - 1).
    """
    a = as_rows(X)
    check_points(a)
    c = np.cov(np.asarray(a, dtype=np.float64).T, ddof=1)
    if variance_is_zero(float(np.trace(c)), a.mean(axis=0), c.shape[0]):
        raise DataError(ZERO_VARIANCE_MESSAGE.format(name="X", what="IsoScore"))
    if C0 is not None:
        c = (1.0 - zeta) * c + zeta * np.asarray(C0, dtype=np.float64)
    lam = np.linalg.svd(c, compute_uv=False)
    d = float(c.shape[0])
    norm = np.linalg.norm(lam)
    lam_hat = lam * np.sqrt(d) / norm
    defect = np.linalg.norm(lam_hat - 1.0) / np.sqrt(2.0 * (d - np.sqrt(d)))
    k = (d - defect**2 * (d - np.sqrt(d))) ** 2 / d
    return float((k - 1.0) / (d - 1.0))


# -- torch (differentiable) -------------------------------------------------------------------


def _out_dtype(t):
    import torch

    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _checked(score, check: bool, what: str):
    if check:
        import torch

        if not bool(torch.isfinite(score)):
            raise DataError(
                f"{what} is not finite: the batch has zero total variance or holds NaN/Inf "
                "-- drop such rows or check the layer"
            )
    return score


def _check_rows_torch(X, what: str):
    if not is_torch(X):
        raise InputError(f"{what} expects a torch tensor; use the numpy function for arrays")
    if X.ndim != 2:
        raise DataError(f"X must be a 2-D tensor of rows (N, D); got shape {tuple(X.shape)}")
    n, d = X.shape
    if n < 2 or d < 2:
        raise DataError(f"X is {n}x{d}; at least 2 rows (points) and 2 columns (dimensions) are needed")


def _terms_torch(x64):
    """(tr(C), ||C||_F^2, Xc) of the batch covariance; N < D goes through the N x N Gram matrix."""
    n, d = x64.shape
    xc = x64 - x64.mean(dim=0, keepdim=True)
    g = xc @ xc.T if n < d else xc.T @ xc
    s = 1.0 / (n - 1)
    return g.diagonal().sum() * s, (g * g).sum() * (s * s), xc


def star_terms(tr, fro2, d, z, target=None):
    """(tr(C_z), ||C_z||_F^2) of C_z = (1 - z) C + z C0 from C's trace and squared Frobenius norm.

    ``target`` None: C0 = tr(C)/d * I (trace-matched, so tr(C_z) = tr(C)); else the triple
    (tr(C0), ||C0||_F^2, <C, C0>_F).  Plain arithmetic: tensors (with grad) or floats alike.
    """
    if target is None:
        return tr, (1 - z) ** 2 * fro2 + (1 - (1 - z) ** 2) * tr * tr / d
    tr0, fro0, cross = target
    return (1 - z) * tr + z * tr0, (1 - z) ** 2 * fro2 + 2 * z * (1 - z) * cross + z * z * fro0


def _target_terms(c0, cross):
    return None if c0 is None else (c0.diagonal().sum(), (c0 * c0).sum(), cross)


def isoscore_torch(X, *, check: bool = True):
    """IsoScore of a batch X (N, D) as a 0-dim tensor, differentiable w.r.t. X.

    Computed in float64 (X of any float dtype is cast inside); returned as float64 for float64 X,
    else float32. ``check=True`` raises DataError when the result is not finite (one device sync).
    """
    _check_rows_torch(X, "isoscore_torch")
    x = X.double()
    tr, fro2, _ = _terms_torch(x)
    score = (tr * tr / fro2 - 1) / (x.shape[1] - 1)
    return _checked(score, check, "IsoScore").to(_out_dtype(X))


def isoscore_star_torch(X, zeta, C0=None, *, check: bool = True):
    """IsoScore* of a batch X (N, D): IsoScore of (1 - zeta) cov(X) + zeta C0, differentiable.

    C0=None: trace-matched identity tr(cov(X))/D * I of the batch (scale-invariant); a (D, D)
    tensor: that covariance (no gradient flows into it unless it requires grad). float64 inside.
    """
    z = check_zeta(zeta)
    _check_rows_torch(X, "isoscore_star_torch")
    x = X.double()
    n, d = x.shape
    tr, fro2, xc = _terms_torch(x)
    cross = c0 = None
    if C0 is not None:
        c0 = _c0_torch(C0, d, x)
        cross = ((xc @ c0) * xc).sum() / (n - 1)
    tz, fz = star_terms(tr, fro2, d, z, _target_terms(c0, cross))
    score = (tz * tz / fz - 1) / (d - 1)
    return _checked(score, check, "IsoScore*").to(_out_dtype(X))


def _c0_torch(C0, d, like):
    import torch

    c0 = C0 if is_torch(C0) else torch.as_tensor(np.asarray(C0))
    if tuple(c0.shape) != (d, d):
        raise DataError(f"shrinkage covariance C0 is {tuple(c0.shape)} but the data has D = {d}")
    return c0.to(device=like.device, dtype=torch.float64)


def isoscore_star_from_cov_torch(C, zeta, C0=None, *, check: bool = True):
    """IsoScore* of a covariance tensor C (D, D) (e.g. from all-reduced moments), differentiable.

    C0=None: trace-matched identity tr(C)/D * I; else the given (D, D) covariance. zeta = 0 gives
    IsoScore of C. float64 inside; float64 result for float64 C, else float32.
    """
    z = check_zeta(zeta)
    if not is_torch(C):
        raise InputError("isoscore_star_from_cov_torch expects a torch tensor; use isoscore_star_from_cov")
    if C.ndim != 2 or C.shape[0] != C.shape[1] or C.shape[0] < 2:
        raise DataError(f"C must be a square (D, D) covariance with D >= 2; got shape {tuple(C.shape)}")
    c = C.double()
    d = c.shape[0]
    tr, fro2 = c.diagonal().sum(), (c * c).sum()
    c0 = cross = None
    if C0 is not None:
        c0 = _c0_torch(C0, d, c)
        cross = (c * c0).sum()
    tz, fz = star_terms(tr, fro2, d, z, _target_terms(c0, cross))
    score = (tz * tz / fz - 1) / (d - 1)
    return _checked(score, check, "IsoScore*").to(_out_dtype(C))
