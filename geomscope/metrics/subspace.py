"""Gradient energy in the activation subspace (docs/metrics.md, "Gradient energy in the activation
subspace"): how much of a layer's backpropagated gradient lies in the top principal directions of its
activations, against random "normal" subspaces of the same rank.

Bernas et al. 2026 ("Revisiting Anisotropy in Language Transformers: The Geometry of Learning
Dynamics") fit low-rank "tangent proxies" U_r (top-r PCA directions of the hidden states) and find that
they hold far more of the gradients' energy than matched-rank random "normal" directions: learning
moves the representations along the directions in which they already vary. This module measures
that, per layer and rank, from matrices the score engine has already accumulated in float64:

    S      (D, D)  uncentred gradient second moment sum_t g_t g_t^T (any positive scale)
    g-bar  (D,)    mean gradient
    C_act  (D, D)  activation covariance of the same layer (possibly from another run)

U_r = top-r eigenvectors of C_act, V_r = top-r eigenvectors of S (descending eigenvalues).

    energy      E      = tr(U_r^T S U_r) / tr(S)                  in [0, 1]
    baseline           = r / D                                    (E of an isotropic S, any U_r)
    energy_max  E_max  = (sum of S's top r eigenvalues) / tr(S)   (Ky Fan: the largest E of any
                                                                   rank-r subspace, reached at V_r)
    kappa              = (E - r/D) / (E_max - r/D)                0: no better than chance, 1: the
                                                                   best any rank-r subspace can do
    mean_energy e      = ||U_r^T g-bar||^2 / ||g-bar||^2          (the systematic part alone)
    overlap            = ||U_r^T V_r||_F^2 / r                    (1: U_r = V_r, r/D: chance)

kappa is what makes layers comparable: E alone grows with r/D and with how concentrated S is.

S and C_act must be PSD (their smallest eigenvalue is checked, validate.check_psd). U_r is unique
only while lambda_r(C_act) > 0: an eigenvalue at or below D * eps * lambda_1 is 0 (rounding, see
_NULL_EIGENVALUE), and for r above that numerical rank k the last r - k columns of U_r are arbitrary
null-space directions, so E, kappa, e, overlap, activation_gap and the controls are None, with
``subspace_note`` saying "use r <= k" (the same for V_r and overlap when r exceeds S's rank).

Normal controls: K uniformly random rank-r subspaces Q_k of the (D - r)-dimensional orthogonal
complement of U_r (a Gaussian D x r matrix, U_r projected out twice, orthonormalised by QR). They
exist only when r <= D - r. Control k of rank r is the k-th draw of ``np.random.default_rng([seed,
r])``, so a rank's controls depend on (seed, r) only -- not on which other ranks are asked -- and K
controls are the first K of any larger K. Exact expectation: Q_k Q_k^T averages to
P_perp * r/(D - r) (it is a rotation-invariant projector of trace r inside the complement, whose
projector P_perp = I - U_r U_r^T has trace D - r), so

    E[E_k] = tr(S P_perp) r/(D - r) / tr(S) = r/(D - r) * (1 - E)       (control_energy_expected)

The controls also answer the one-sided permutation-style test p = (1 + #{E_k >= E}) / (K + 1).

Removal test: IsoScore* (Rudman & Eickhoff 2024; geomscope.metrics.isotropy) of the activations with
a subspace Q projected out, in the (D - r) coordinates of its complement: C' = B^T C_act B with B an
orthonormal basis of the complement (targets: "trace" -> tr(C')/(D - r) I of C' itself, "identity"
-> I_{D-r}, a matrix C0 -> B^T C0 B). B is never formed: with P = I - Q Q^T = B B^T and C, C0
symmetric,

    tr(C')       = tr(C) - tr(Q^T C Q)
    ||C'||_F^2   = tr(C P C P) = ||C||_F^2 - 2 ||C Q||_F^2 + ||Q^T C Q||_F^2
    tr(C' C0')   = tr(C P C0 P) = tr(C C0) - 2 tr(Q^T C C0 Q) + tr((Q^T C Q)(Q^T C0 Q))

so each control costs O(D^2 r). For U_r itself (C_act's largest variances, where these differences
would cancel) P C_act P is formed explicitly with two rank-r updates, also O(D^2 r). Removing U_r
versus removing a control says whether the anisotropy sits in the directions the gradients use.
The squared norms are taken of C_act (and C0) scaled by a power of two, so that covariances of any
size (rows at 1e-100 or 1e80) give the same IsoScore* (_Removal).

Cost: one partial eigendecomposition of C_act and one of S (top max(ranks) + 1 pairs, shared by all
ranks) and, per control, products of S, C_act (and C0) with D x r blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from geomscope.choices import DEFAULT_CONTROLS, DEFAULT_ZETA
from geomscope.errors import DataError, InputError
from geomscope.metrics.isotropy import SHRINKAGE_TARGETS, check_zeta, isoscore_star_from_cov
from geomscope.metrics.validate import (
    ZERO_VARIANCE_MESSAGE,
    as_covariance,
    binary_exponent,
    check_psd,
    to_numpy,
    whole_number,
)

# Fractions (E, E_max, r/D, control energies) live in [0, 1]; below this a difference or a control
# mean is float64 rounding, not signal.
_TINY = 1e-12
# Eigenvalues at or below D * eps * lambda_1 are 0. LAPACK's symmetric eigensolver is backward
# stable: its eigenvalues are exact for a matrix within about D * eps * ||A||_2 of the one given
# (||A||_2 = lambda_1 for a PSD matrix), so a computed eigenvalue that small cannot be told from 0,
# and its eigenvector is whichever direction of the numerical null space rounding picks (rotating
# the problem picks another). A covariance of N <= D rows in float64 puts its null eigenvalues
# near eps * lambda_1, well under this bound (measured: 4e-17 to 6e-16 of lambda_1, D 12 to 768).
_NULL_EIGENVALUE = np.finfo(np.float64).eps
# Columns of control subspaces multiplied by S and C_act at once (memory: 3 x D x this, float64).
_BLOCK_COLS = 2048


def _symmetric(a, name: str) -> np.ndarray:
    """``a`` checked as a covariance (or second moment) to rounding (``as_covariance``: square, finite,
    symmetric, non-negative diagonal), then symmetrised exactly."""
    m = as_covariance(a, name)
    return (m + m.T) / 2.0


def _smallest_eigenvalue(a: np.ndarray) -> float:
    from scipy.linalg import eigh

    return float(eigh(a, eigvals_only=True, subset_by_index=[0, 0], driver="evr")[0])


def _check_psd(a: np.ndarray, top: float, name: str) -> None:
    """DataError unless symmetric ``a`` (largest eigenvalue ``top``) is PSD to rounding: a symmetric
    matrix with a positive diagonal can still have a negative eigenvalue, and then E_max, kappa and
    the controls read beyond [0, 1] (E_max reaches 1.18)."""
    check_psd(np.array([_smallest_eigenvalue(a), top]), name)


def _numerical_rank(lam: np.ndarray, d: int) -> int:
    """How many of the descending eigenvalues ``lam`` (of a PSD D x D matrix) are not 0 (_NULL_EIGENVALUE)."""
    return int(np.count_nonzero(lam > d * _NULL_EIGENVALUE * float(lam[0])))


def _check_ranks(ranks, d: int) -> list[int]:
    try:
        ranks = list(ranks)
    except TypeError:  # one rank: an int, a numpy integer, a 0-d array
        ranks = [ranks]
    out = []
    for given in ranks:
        r = whole_number(given)
        if r is None:
            raise InputError(f"--rank must be a whole number; got {given!r}")
        if r >= d:
            raise InputError(f"--rank {r} is not below the hidden size D = {d}; use ranks from 1 to {d - 1}")
        if r < 1:
            raise InputError(f"--rank {r} is below 1; use ranks from 1 to {d - 1}")
        out.append(r)
    if not out:
        raise InputError("no rank given; pass at least one rank, e.g. 8 32 128")
    return out


def _check_count(controls) -> int:
    return _non_negative(controls, "--controls", " (0 draws no normal controls)")


def _check_seed(seed) -> int:
    return _non_negative(seed, "--seed")


def _non_negative(value, flag: str, meaning: str = "") -> int:
    """``value`` as an int >= 0; InputError naming ``flag`` otherwise (``meaning``: what 0 does)."""
    k = whole_number(value)
    if k is None:
        raise InputError(f"{flag} must be a whole number >= 0; got {value!r}")
    if k < 0:
        raise InputError(f"{flag} must be >= 0{meaning}; got {k}")
    return k


def _check_mean(grad_mean, d: int) -> np.ndarray | None:
    if grad_mean is None:
        return None
    g = np.asarray(to_numpy(grad_mean), dtype=np.float64)
    if g.shape != (d,):
        raise DataError(f"grad_mean must have shape ({d},) like S's hidden size; got {g.shape}")
    if not np.isfinite(g).all():
        raise DataError("grad_mean contains NaN or Inf; check the gradients it was computed from")
    return g


def _check_target(target, d: int) -> np.ndarray | None:
    """None for the named targets, else the symmetrised (D, D) matrix C0."""
    if isinstance(target, str):
        if target not in SHRINKAGE_TARGETS:
            raise InputError(
                f"unknown shrinkage target {target!r}; use one of {', '.join(SHRINKAGE_TARGETS)} "
                "or a (D, D) covariance"
            )
        return None
    c0 = _symmetric(target, "C0")
    if c0.shape != (d, d):
        raise DataError(f"shrinkage covariance C0 is {c0.shape} but C_act is {(d, d)}")
    return c0


def _top_eigh(a: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest eigenpairs of symmetric ``a``, descending. LAPACK's output is a deterministic
    function of the input, so tied eigenvalues always split the same way for the same matrix."""
    from scipy.linalg import eigh

    d = a.shape[0]
    w, v = eigh(a, subset_by_index=[d - k, d - 1], driver="evr")
    return w[::-1].copy(), np.ascontiguousarray(v[:, ::-1])


def _check_k(given, d: int) -> int:
    k = whole_number(given)
    if k is None:
        raise InputError(f"k must be a whole number of eigenpairs from 1 to D = {d}; got {given!r}")
    if not 1 <= k <= d:
        raise InputError(f"k = {k} eigenpairs asked of a {d} x {d} matrix; use k from 1 to {d}")
    return k


def top_eigenpairs(C, k: int) -> tuple[np.ndarray, np.ndarray]:
    """((k,), (D, k)): the top-k eigenvalues and eigenvectors of a covariance C (symmetric to
    rounding, as ``as_covariance`` checks), descending, 1 <= k <= D -- the U_r of every rank r <= k
    as its first r columns (the same split of ties as :func:`gradient_energy`)."""
    c = _symmetric(C, "C")
    return _top_eigh(c, _check_k(k, c.shape[0]))


def top_eigenvectors(C, k: int) -> np.ndarray:
    """(D, k): the eigenvectors of :func:`top_eigenpairs`."""
    return top_eigenpairs(C, k)[1]


def captured_energy(S, U: np.ndarray) -> np.ndarray:
    """(k,): E of U's first r columns for r = 1..k, i.e. tr(U_r^T S U_r) / tr(S) (S PSD, tr(S) > 0)."""
    s = np.asarray(S, dtype=np.float64)
    return np.cumsum(np.einsum("ij,ij->j", U, s @ U)) / float(np.trace(s))


def _iter_controls(u: np.ndarray, count: int, seed: int) -> Iterator[np.ndarray]:
    d, r = u.shape
    rng = np.random.default_rng([seed, r])
    for _ in range(count):
        g = rng.standard_normal((d, r))
        for _ in range(2):  # project out U_r twice ("twice is enough" against cancellation)
            g -= u @ (u.T @ g)
        q, _ = np.linalg.qr(g)
        yield q


def normal_controls(U_r, count: int, seed: int = 0) -> np.ndarray:
    """The ``count`` normal controls ``gradient_energy`` draws for the subspace U_r (D, r), as an
    array (count, D, r) of orthonormal bases of uniformly random rank-r subspaces of U_r's
    orthogonal complement. Control k is the k-th draw of ``np.random.default_rng([seed, r])``."""
    u = np.asarray(to_numpy(U_r), dtype=np.float64)
    if u.ndim != 2 or not 1 <= u.shape[1] or 2 * u.shape[1] > u.shape[0]:
        raise DataError(f"U_r must be (D, r) with 1 <= r <= D/2 for a rank-r complement; got {u.shape}")
    k, s = _check_count(count), _check_seed(seed)
    return np.stack(list(_iter_controls(u, k, s))) if k else np.empty((0,) + u.shape)


def _project_out(a: np.ndarray, q: np.ndarray, aq: np.ndarray) -> np.ndarray:
    """P A P (D, D) for symmetric A, P = I - Q Q^T, given A Q: two rank-r updates, O(D^2 r)."""
    qap = aq.T - (q.T @ aq) @ q.T  # Q^T A P
    return a - aq @ q.T - q @ qap


class _Removal:
    """IsoScore* of C_act with a subspace Q projected out, in O(D^2 r) (module docstring).

    Controls use the trace identities. U_r holds C_act's largest variances, so there the identities
    would subtract nearly equal numbers (||C||_F^2 - 2 ||C U_r||_F^2 + ... loses ||C||^2/||C'||^2 of
    the precision: 1e-6 at a 1e5 eigenvalue ratio); P C P is formed explicitly instead (also
    O(D^2 r)), whose entries lose only ||C|| / ||C'||.

    ``c`` (and ``c0``) are the matrices the caller multiplies Q by: C_act (and C0) times one power of
    two, and, for the identity and matrix targets, times their weights (1 - zeta) and zeta. Traces,
    squared norms and cross terms square the entries, which overflow beyond about 1e154 and fall
    among float64's subnormals below about 1e-154 (covariances of rows at 1e80 or 1e-100 then read
    "no variance left"); scaled so the larger term's entries are near 1 they stay in range, and
    IsoScore* does not change: tr^2 / ||.||_F^2 is invariant to scale, and a power of two is exact.
    """

    def __init__(self, c: np.ndarray, zeta: float, target, c0: np.ndarray | None):
        self.z = zeta
        self.kind = "matrix" if c0 is not None else target
        self.c0 = self.ident = None
        if self.kind == "trace":  # the target tr(C')/(D - r) I follows C: C's own size sets the scale
            e = binary_exponent(c)
            self.c = np.ldexp(c, -e)
        else:  # the shrunk (1 - zeta) C' + zeta T: the larger of the two sets the scale
            top_t = float(np.abs(c0).max()) if c0 is not None else 1.0
            e = binary_exponent([(1.0 - zeta) * float(np.abs(c).max()), zeta * top_t])
            self.c = np.ldexp((1.0 - zeta) * c, -e)
            if c0 is not None:
                self.c0 = np.ldexp(zeta * c0, -e)
            else:
                self.ident = math.ldexp(zeta, -e)  # the identity target's diagonal, zeta I scaled alike
        self.tr, self.fro = float(np.trace(self.c)), float(np.vdot(self.c, self.c))
        if self.c0 is not None:
            self.tr0, self.fro0 = float(np.trace(self.c0)), float(np.vdot(self.c0, self.c0))
            self.cross = float(np.vdot(self.c, self.c0))  # tr(C C0) for symmetric C, C0

    def score(
        self, q: np.ndarray, cq: np.ndarray, c0q: np.ndarray | None, explicit: bool = False, name: str = "Q"
    ) -> tuple[float | None, str | None]:
        """(IsoScore* of the remainder, None) or (None, why it is undefined, naming the subspace
        ``name``). ``cq`` = self.c @ q, ``c0q`` = self.c0 @ q; ``explicit``: form P C P (and P C0 P)
        instead of the identities."""
        d = q.shape[0] - q.shape[1]
        if d < 2:
            return None, f"only D - r = {d} dimension(s) remain; IsoScore* needs 2"
        tr0 = fro0 = cross = 0.0
        if explicit:
            cp = _project_out(self.c, q, cq)
            tr, fro = float(np.trace(cp)), float(np.vdot(cp, cp))
            if self.c0 is not None:
                c0p = _project_out(self.c0, q, c0q)
                tr0, fro0, cross = float(np.trace(c0p)), float(np.vdot(c0p, c0p)), float(np.vdot(cp, c0p))
        else:
            qcq = q.T @ cq
            tr = self.tr - float(np.trace(qcq))
            fro = self.fro - 2.0 * float(np.vdot(cq, cq)) + float(np.vdot(qcq, qcq))
            if self.c0 is not None:
                qc0q = q.T @ c0q
                tr0 = self.tr0 - float(np.trace(qc0q))
                fro0 = self.fro0 - 2.0 * float(np.vdot(c0q, c0q)) + float(np.vdot(qc0q, qc0q))
                cross = self.cross - 2.0 * float(np.vdot(cq, c0q)) + float(np.vdot(qcq, qc0q))
        empty = not tr > _TINY * self.tr  # what is left of C_act is rounding: it is 0
        if empty:
            tr = fro = cross = 0.0
        r = q.shape[1]
        none_left = (
            f"C_act has no variance outside {name} (its rank is at most {r})"
            + (
                ""
                if self.kind == "trace"
                else " and the shrinkage target adds none (zeta = 0 or C0 has none there)"
            )
            + "; IsoScore* is undefined"
        )
        z = self.z
        if self.kind == "trace":
            if empty:
                return None, none_left
            tz, fz = tr, (1 - z) ** 2 * fro + (1 - (1 - z) ** 2) * tr * tr / d
        elif self.kind == "identity":  # (1 - zeta) C' + zeta I, both already weighted and scaled
            tz, fz = tr + self.ident * d, fro + 2.0 * self.ident * tr + self.ident * self.ident * d
        else:
            tz, fz = tr + tr0, fro + 2.0 * cross + fro0
        if not tz > 0:
            return None, none_left
        if not (fz > 0 and np.isfinite(tz * tz / fz)):  # cancellation in the identities (controls only)
            return (
                None,
                f"the remainder's squared Frobenius norm came out {fz:.3g} (rounding); "
                "IsoScore* is undefined",
            )
        return min(1.0, max(0.0, (tz * tz / fz - 1.0) / (d - 1))), None


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), (float(a.std(ddof=1)) if a.size >= 2 else None)


def gradient_energy(
    S,
    grad_mean,
    C_act,
    ranks: Sequence[int],
    *,
    controls: int = DEFAULT_CONTROLS,
    seed: int = 0,
    zeta: float = DEFAULT_ZETA,
    target="trace",
    act_eig: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[dict]:
    """Share of the gradient second moment S in the top-r activation subspace U_r, per rank.

    ``act_eig``: C_act's top eigenpairs from :func:`top_eigenpairs` with k >= max(ranks) + 1, when
    the caller needs U_r too (score's jackknife): the eigendecomposition is then not repeated.

    S (D, D): uncentred gradient second moment (PSD, any positive scale); grad_mean (D,): mean
    gradient (None: ``mean_energy`` is None); C_act (D, D): activation covariance of the same layer;
    ranks: each 1 <= r < D. ``controls`` normal controls per rank (0: none), seeded by (seed, r);
    ``zeta`` and ``target`` ("trace", "identity" or a (D, D) covariance of the activations) set the
    removal test's IsoScore*. Definitions and the controls' exact expectation: module docstring.

    Returns one JSON-ready dict per rank, in the order given, with keys: rank, dim, energy, baseline,
    energy_max, kappa, mean_energy, overlap, activation_share (top-r share of C_act's variance),
    activation_gap ((lambda_r - lambda_{r+1}) / lambda_r of C_act, in [0, 1]; near 0, U_r is
    ill-defined), controls, control_energy_mean, control_energy_sd, control_energy_expected,
    energy_ratio, p_value, controls_note, isoscore_star (of C_act, nothing removed),
    removal_isoscore_star, removal_control_isoscore_star_mean, removal_control_isoscore_star_sd,
    removal_note, subspace_note.
    None marks an undefined value (kappa of an isotropic S, e of a zero g-bar, control fields
    without controls or when 2r > D, sd with fewer than 2 controls, everything that uses U_r (V_r)
    when r exceeds C_act's (S's) numerical rank); the notes say why. S or C_act with a negative
    eigenvalue beyond rounding raises DataError; a malformed ``act_eig`` InputError.
    """
    z = check_zeta(zeta)
    count = _check_count(controls)
    seed = _check_seed(seed)
    s, c, rs, gbar, c0 = _checked_matrices(S, grad_mean, C_act, ranks, target)
    layer = _layer_subspaces(s, c, gbar, max(rs), act_eig, z, target, c0)
    return [_rank_row(layer, r, count, seed) for r in rs]


def _checked_matrices(S, grad_mean, C_act, ranks, target):
    """(S, C_act, ranks, g-bar or None, C0 or None) of :func:`gradient_energy`: S and C_act
    symmetrised, of one hidden size D and with a positive trace; each rank 1 <= r < D."""
    s = _symmetric(S, "S")
    c = _symmetric(C_act, "C_act")
    if c.shape != s.shape:
        raise DataError(
            f"C_act is {c.shape} but S is {s.shape}; both must belong to the same layer (same hidden size D)"
        )
    d = s.shape[0]
    rs = _check_ranks(ranks, d)
    gbar = _check_mean(grad_mean, d)
    c0 = _check_target(target, d)
    if not float(np.trace(s)) > 0:
        raise DataError(
            "S has zero trace: the gradients are all zero (the loss does not reach this layer, or no "
            "backward pass was recorded); check that the layer is trainable and gradients were captured"
        )
    if not float(np.trace(c)) > 0:
        raise DataError(ZERO_VARIANCE_MESSAGE.format(name="C_act", what="the activation subspace U_r"))
    return s, c, rs, gbar, c0


@dataclass(frozen=True)
class _LayerSubspaces:
    """What every rank of one :func:`gradient_energy` call reads, from the top ``rmax`` eigenpairs of
    C_act and S. The ``*_upto`` arrays are cumulative: entry r - 1 belongs to rank r."""

    s: np.ndarray  # S, symmetrised
    trace_s: float  # tr(S)
    act_eigenvalues: np.ndarray  # C_act's top rmax + 1 eigenvalues, descending, 0 past act_rank
    act_rank: int  # C_act's numerical rank: U_r is unique for r <= act_rank
    grad_rank: int  # S's numerical rank: V_r is unique for r <= grad_rank
    u_top: np.ndarray  # U_rmax (D, rmax): U_r is its first r columns
    removal: _Removal  # the removal test's IsoScore*
    removal_cu: np.ndarray  # removal.c @ u_top
    removal_c0u: np.ndarray | None  # removal.c0 @ u_top (matrix target)
    energy_upto: np.ndarray  # E = tr(U_r^T S U_r) / tr(S)
    energy_max_upto: np.ndarray  # E_max = (sum of S's top r eigenvalues) / tr(S)
    act_share_upto: np.ndarray  # top-r share of C_act's variance
    mean_energy_upto: np.ndarray | None  # e = ||U_r^T g-bar||^2 / ||g-bar||^2 (None: no or zero g-bar)
    u_t_v: np.ndarray  # U_rmax^T V_rmax (overlap of rank r: its top-left r x r block)
    isoscore_star: float | None  # of C_act, nothing removed

    @property
    def dim(self) -> int:
        """The hidden size D."""
        return self.s.shape[0]


def _layer_subspaces(s, c, gbar, rmax: int, act_eig, zeta: float, target, c0) -> _LayerSubspaces:
    """The eigendecompositions (C_act's from ``act_eig`` when given), checked PSD, the removal test
    (``zeta``, ``target``, ``c0``) and the cumulative fractions of every rank up to ``rmax``."""
    d = s.shape[0]
    if act_eig is not None:
        lam_c, u_all = _check_act_eig(act_eig, d, rmax + 1)
    else:
        lam_c, u_all = _top_eigh(c, rmax + 1)
    lam_s, v_all = _top_eigh(s, rmax)
    _check_psd(s, float(lam_s[0]), "S")
    _check_psd(c, float(lam_c[0]), "C_act")
    # below the rounding bound the eigenvalues are 0 (and a rounding negative one too)
    rank_c = _numerical_rank(lam_c, d)
    lam_c = np.where(np.arange(lam_c.size) < rank_c, lam_c, 0.0)
    u_all = u_all[:, :rmax]
    removal = _Removal(c, zeta, target, c0)
    tr_s = float(np.trace(s))
    if gbar is not None and float(np.vdot(gbar, gbar)) > 0:
        cum_g = np.cumsum((u_all.T @ gbar) ** 2) / float(np.vdot(gbar, gbar))
    else:
        cum_g = None
    return _LayerSubspaces(
        s=s,
        trace_s=tr_s,
        act_eigenvalues=lam_c,
        act_rank=rank_c,
        grad_rank=_numerical_rank(lam_s, d),
        u_top=u_all,
        removal=removal,
        removal_cu=removal.c @ u_all,
        removal_c0u=removal.c0 @ u_all if removal.c0 is not None else None,
        energy_upto=np.cumsum(np.einsum("ij,ij->j", u_all, s @ u_all)) / tr_s,
        energy_max_upto=np.cumsum(lam_s) / tr_s,
        act_share_upto=np.cumsum(lam_c) / float(np.trace(c)),
        mean_energy_upto=cum_g,
        u_t_v=u_all.T @ v_all,
        isoscore_star=isoscore_star_from_cov(c, zeta, target if c0 is None else c0),
    )


def _rank_row(layer: _LayerSubspaces, r: int, count: int, seed: int) -> dict:
    """The JSON-ready dict of rank r, with :func:`gradient_energy`'s keys in its order."""
    d = layer.dim
    # U_r (V_r) is unique only while lambda_r > 0: past the numerical rank its last columns are
    # arbitrary null-space directions, and everything measured with them is undefined
    u_defined, v_defined = r <= layer.act_rank, r <= layer.grad_rank
    # fractions in [0, 1]: clipped against rounding (an E_max of 1 + 4e-16 occurs)
    e = min(1.0, max(0.0, float(layer.energy_upto[r - 1])))
    base = r / d
    e_max = min(1.0, float(layer.energy_max_upto[r - 1]))
    lam_r, lam_next = float(layer.act_eigenvalues[r - 1]), float(layer.act_eigenvalues[r])
    block = layer.u_t_v[:r, :r]
    rem, why = _removal_of_u(layer, r, u_defined)
    row = {
        "rank": r,
        "dim": d,
        "energy": e if u_defined else None,
        "baseline": base,
        "energy_max": e_max,
        "kappa": (e - base) / (e_max - base) if u_defined and e_max - base > _TINY else None,
        "mean_energy": None
        if layer.mean_energy_upto is None or not u_defined
        else float(layer.mean_energy_upto[r - 1]),
        "overlap": min(1.0, float(np.vdot(block, block)) / r) if u_defined and v_defined else None,
        "activation_share": min(1.0, float(layer.act_share_upto[r - 1])),
        "activation_gap": (lam_r - lam_next) / lam_r if lam_r > 0 else None,
        "controls": 0,
        "control_energy_mean": None,
        "control_energy_sd": None,
        "control_energy_expected": None,
        "energy_ratio": None,
        "p_value": None,
        "controls_note": None,
        "isoscore_star": layer.isoscore_star,
        "removal_isoscore_star": rem,
        "removal_control_isoscore_star_mean": None,
        "removal_control_isoscore_star_sd": None,
        "removal_note": why,
        "subspace_note": _subspace_note(r, layer.act_rank, layer.grad_rank),
    }
    if u_defined:
        row.update(_controls_of_rank(layer, r, e, count, seed))
    else:
        row["controls_note"] = "U_r is not unique (see subspace_note); no normal controls"
    return row


def _removal_of_u(layer: _LayerSubspaces, r: int, u_defined: bool) -> tuple[float | None, str | None]:
    """(IsoScore* of C_act with U_r removed, None) or (None, why it is undefined)."""
    removal = layer.removal
    if not u_defined and removal.kind == "matrix":
        # C_act has nothing left either way, but P C0 P depends on the arbitrary columns
        return None, "U_r is not unique (see subspace_note), and neither is C0 with U_r removed"
    c0u = None if layer.removal_c0u is None else layer.removal_c0u[:, :r]
    return removal.score(layer.u_top[:, :r], layer.removal_cu[:, :r], c0u, explicit=True, name="U_r")


def _subspace_note(r: int, act_rank: int, grad_rank: int) -> str | None:
    """Why U_r (or V_r) is not unique at rank r and what that leaves undefined; None while both are."""
    if r > act_rank:
        return (
            f"r = {r} exceeds C_act's numerical rank k = {act_rank} (eigenvalues at or below D eps "
            f"lambda_1 are 0), so U_r's last {r - act_rank} column(s) are arbitrary null-space directions: "
            f"energy, kappa, mean_energy, overlap, activation_gap and the controls are undefined; "
            f"use r <= {act_rank}"
        )
    if r > grad_rank:
        return (
            f"r = {r} exceeds S's numerical rank {grad_rank}, so V_r's last {r - grad_rank} column(s) are "
            f"arbitrary null-space directions: overlap is undefined; use r <= {grad_rank} for it"
        )
    return None


def _controls_of_rank(layer: _LayerSubspaces, r: int, e: float, count: int, seed: int) -> dict:
    """The control fields of a rank whose U_r is unique: the ``count`` normal controls and their
    expectation, or a ``controls_note`` saying why there are none."""
    d = layer.dim
    if 2 * r > d:
        return {
            "controls_note": f"no rank-{r} subspace fits in the {d - r}-dimensional complement of U_r "
            f"(needs 2r <= D = {d}); no normal controls"
        }
    expected = {"control_energy_expected": r / (d - r) * (1.0 - e)}
    if count == 0:
        return {**expected, "controls_note": "controls = 0: no normal controls were drawn"}
    u = layer.u_top[:, :r]
    return {**expected, **_control_fields(layer.s, u, count, seed, layer.trace_s, e, layer.removal)}


def _check_act_eig(act_eig, d: int, need: int) -> tuple[np.ndarray, np.ndarray]:
    """``act_eig`` as (eigenvalues (k,), eigenvectors (D, k)) with k >= ``need``, else InputError."""
    try:
        lam, vecs = act_eig
        lam = np.asarray(to_numpy(lam), dtype=np.float64)
        vecs = np.asarray(to_numpy(vecs), dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(
            "act_eig must be the pair (eigenvalues, eigenvectors) that top_eigenpairs(C_act, k) returns"
        ) from None
    if lam.ndim != 1 or vecs.shape != (d, lam.size):
        raise InputError(
            f"act_eig holds eigenvalues of shape {lam.shape} and eigenvectors of shape {vecs.shape}, but "
            f"C_act is {d} x {d}; pass top_eigenpairs(C_act, {need}) of this C_act"
        )
    if lam.size < need:
        raise InputError(
            f"act_eig holds {lam.size} eigenpairs; max(ranks) + 1 = {need} are needed: pass "
            f"top_eigenpairs(C_act, {need})"
        )
    if not (np.isfinite(lam).all() and np.isfinite(vecs).all()):
        raise InputError("act_eig contains NaN or Inf; pass top_eigenpairs(C_act, k) of this C_act")
    return lam, vecs


def _control_fields(s, u, k, seed, tr_s, e, removal: _Removal) -> dict:
    r = u.shape[1]
    per_block = max(1, _BLOCK_COLS // r)
    energies: list[float] = []
    removals: list[float] = []
    it = _iter_controls(u, k, seed)
    while len(energies) < k:
        block = list(islice(it, min(per_block, k - len(energies))))
        qb = np.hstack(block)
        sq, cq = s @ qb, removal.c @ qb
        c0q = removal.c0 @ qb if removal.c0 is not None else None
        for j, q in enumerate(block):
            cols = slice(j * r, (j + 1) * r)
            energies.append(float(np.vdot(q, sq[:, cols])) / tr_s)
            rem, _ = removal.score(q, cq[:, cols], None if c0q is None else c0q[:, cols])
            if rem is not None:
                removals.append(rem)
    mean, sd = _mean_sd(energies)
    rmean, rsd = _mean_sd(removals)
    return {
        "controls": k,
        "control_energy_mean": mean,
        "control_energy_sd": sd,
        "energy_ratio": e / mean if mean > _TINY else None,
        "p_value": (1 + sum(x >= e for x in energies)) / (k + 1),
        "removal_control_isoscore_star_mean": rmean,
        "removal_control_isoscore_star_sd": rsd,
    }
