"""TwoNN intrinsic dimension (Facco, d'Errico, Rodriguez & Laio 2017), duplicate-safe and exact.

For every point, mu = r2 / r1, the ratio of its second to its first nearest-neighbour distance.
Under local uniformity mu ~ Pareto(1, d). With N points (after exact duplicates are removed),
mu sorted ascending, k = int(N * (1 - discard_fraction)) smallest kept and F_i = i / N:

* ``estimator="linear"`` (Facco et al.): least-squares slope through the origin of
  y_i = -log(1 - F_i) on x_i = log mu_i, i = 1..k, i.e. d = sum(x y) / sum(x^2).
* ``estimator="mle"``: log mu ~ Exponential(d); keeping the k smallest of N is type-II censoring and
  d = (k - 1) / (sum_{i<=k} log mu_i + (N - k) log mu_k), which is (N - 1) / sum(log mu) for
  discard_fraction = 0.

These are scikit-dimension 0.5.0's ``TwoNN(discard_fraction, method)`` conventions exactly. Unlike
it, exact duplicate rows are removed first (they make r1 = 0) and counted, and r1, r2 are exact
(:func:`geomscope.metrics.neighbors.two_nearest`), so the answer does not depend on rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from geomscope.choices import DEFAULT_DISCARD_FRACTION, TWONN_FITS
from geomscope.errors import DataError, InputError
from geomscope.metrics.neighbors import two_nearest_unchecked
from geomscope.metrics.validate import NonfiniteRows, as_rows, count_nonfinite_rows, whole_number

F_CONVENTION = "F_i = i/N"
ESTIMATORS = TWONN_FITS


def _canonical_rows(a: np.ndarray) -> np.ndarray:
    """Contiguous float32/float64 copy with -0.0 -> 0.0 and every NaN the same bit pattern."""
    dt = np.float64 if a.dtype.kind != "f" or a.dtype.itemsize > 4 else np.float32
    c = np.add(a, dt(0.0), dtype=dt, order="C")  # a copy, and -0.0 + 0.0 == +0.0
    if not np.isfinite(c.sum()):  # NaNs (or an overflowing sum): only then the NaN pass
        c[np.isnan(c)] = np.nan
    return c


def _row_keys(c: np.ndarray) -> np.ndarray:
    """uint64 key per row of a contiguous float array: the xxh3-64 hash of the row's bytes (equal
    rows always get equal keys; 1.7-4x faster than an integer multiply-add of the words,
    from 1,000,000 x 384 to 20,000 x 4096)."""
    import xxhash

    return np.fromiter(map(xxhash.xxh3_64_intdigest, c), dtype=np.uint64, count=c.shape[0])


def dedup_rows(X):
    """Remove exact duplicate rows, keeping each row's first occurrence in the original order.

    Rows are compared byte for byte in one dtype: float64, or float32 when X is float32 or float16
    (float16 -> float32 is exact), with -0.0 == 0.0 and all NaNs equal. Rows are hashed
    (``_row_keys``) and only rows whose key is shared are compared byte for byte (a sort of their
    bytes), so a hash collision costs time, never a wrong answer. Returns
    ``(X_unique, n_removed, index)`` with ``X_unique = X[index]`` (ascending indices); when no
    row is removed, ``X_unique`` is X itself as a numpy array (not a copy).
    """
    a = as_rows(X)
    n, d = a.shape
    if n == 0:
        return a.copy(), 0, np.zeros(0, dtype=np.int64)
    c = _canonical_rows(a)
    keys = _row_keys(c)
    order = np.argsort(keys, kind="stable")
    same = keys[order[1:]] == keys[order[:-1]]
    shared = np.zeros(n, dtype=bool)
    shared[order[1:][same]] = shared[order[:-1][same]] = True
    keep = ~shared
    cand = np.flatnonzero(shared)
    if cand.size:
        rows = np.ascontiguousarray(c[cand]).view(np.dtype((np.void, c.dtype.itemsize * d))).ravel()
        _, first = np.unique(rows, return_index=True)
        keep[cand[first]] = True
    index = np.flatnonzero(keep).astype(np.int64)
    if index.size == n:  # nothing removed: no copy of what may be gigabytes
        return a, 0, index
    return a[index], int(n - index.size), index


@dataclass
class TwoNNResult:
    """Outcome of :func:`twonn`. ``dimension`` is the estimate; the rest says how it was made.

    n_points: input rows; n_duplicates_removed: exact duplicates dropped; n_used: distinct points
    whose mu enter F (= N); n_fit: the k smallest mu kept after discarding; mu: sorted ratios of
    the n_used points (all of them, before discarding).
    """

    dimension: float
    estimator: str
    discard_fraction: float
    n_points: int
    n_duplicates_removed: int
    n_used: int
    n_fit: int
    f_convention: str = F_CONVENTION
    n_dims: int = 0
    subsampled_from: int | None = None
    seed: int | None = None
    mu: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    neighbor_info: dict = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict:
        """JSON-friendly record (without the mu array)."""
        return {
            "dimension": float(self.dimension),
            "estimator": self.estimator,
            "discard_fraction": self.discard_fraction,
            "f_convention": self.f_convention,
            "n_points": self.n_points,
            "n_duplicates_removed": self.n_duplicates_removed,
            "n_used": self.n_used,
            "n_fit": self.n_fit,
            "n_dims": self.n_dims,
            "subsampled_from": self.subsampled_from,
            "seed": self.seed,
        }


def _check_params(discard_fraction: float, estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise InputError(f"unknown TwoNN estimator {estimator!r}; use one of {', '.join(ESTIMATORS)}")
    if not 0.0 <= discard_fraction < 1.0:
        raise InputError(f"discard_fraction must be in [0, 1); got {discard_fraction}")


def _n_keep(n: int, discard_fraction: float, estimator: str) -> int:
    k = int(n * (1 - discard_fraction))
    if k < 2:
        raise DataError(
            f"only {k} ratio(s) left after discarding {discard_fraction:.0%} of {n} points; "
            "use more points or a smaller discard_fraction"
        )
    if estimator == "linear" and k >= n:
        raise InputError(
            "the linear TwoNN fit needs discard_fraction > 1/N (F_N = 1 gives -log 0); "
            "use discard_fraction=0.1 or estimator='mle'"
        )
    return k


def fit_mu(
    mu: np.ndarray, discard_fraction: float = DEFAULT_DISCARD_FRACTION, estimator: str = "linear"
) -> tuple[float, int]:
    """Dimension from the ratios mu of N distinct points (any order): ``(d, n_fit)``."""
    _check_params(discard_fraction, estimator)
    mu = np.sort(np.asarray(mu, dtype=np.float64))
    n = mu.size
    k = _n_keep(n, discard_fraction, estimator)
    x = np.log(mu[:k])
    if estimator == "mle":
        denom = x.sum() + (n - k) * x[-1]
        if not denom > 0:
            raise DataError("all kept ratios r2/r1 equal 1 (equidistant neighbours); TwoNN is undefined")
        return float((k - 1) / denom), k
    y = -np.log1p(-np.arange(1, k + 1) / n)
    sxx = float(x @ x)
    if not sxx > 0:
        raise DataError("all kept ratios r2/r1 equal 1 (equidistant neighbours); TwoNN is undefined")
    return float(x @ y) / sxx, k


def check_matrix(X, expect_dim: int | None = None, allow_wide: bool = True, min_rows: int = 3) -> np.ndarray:
    """Validate points X (N, D): 2-D, numeric, finite, D >= 2, N >= min_rows, the expected D.

    ``expect_dim``: the feature dimension the caller knows (e.g. the model's hidden size); a
    mismatch, in particular a transposed (D, N) array, raises DataError. ``allow_wide=False``
    refuses N < D, the shape of a transposed sample. Returns a float numpy array.
    """
    a = as_rows(X)
    n, d = a.shape
    if expect_dim is not None and d != expect_dim:
        hint = " (it looks transposed: pass X.T)" if n == expect_dim else ""
        raise DataError(f"X has shape {a.shape} but rows must be points with D={expect_dim} columns{hint}")
    if d < 2:
        raise DataError(f"X has {d} column(s); intrinsic dimension needs D >= 2 (rows are points: (N, D))")
    if not allow_wide and n < d:
        raise DataError(
            f"X has fewer rows ({n}) than columns ({d}); rows must be points: pass X.T if "
            "it is transposed, or allow_wide=True"
        )
    bad = count_nonfinite_rows(a)
    if bad:
        raise NonfiniteRows(bad, n)
    if n < min_rows:
        raise DataError(f"X has {n} point(s); at least {min_rows} are needed")
    return a


def _whole_or_none(value, name: str, low: int) -> int | None:
    """None, or ``value`` as an int >= ``low`` (:func:`~geomscope.metrics.validate.whole_number`:
    50.5, "50" and True are refused)."""
    if value is None:
        return None
    v = whole_number(value)
    if v is None:
        raise InputError(f"{name} must be a whole number >= {low} or None; got {value!r}")
    if v < low:
        raise InputError(f"{name} must be >= {low}; got {v}")
    return v


def prepare_points(
    X,
    dedup: bool = True,
    max_points: int | None = None,
    seed: int | None = None,
    expect_dim: int | None = None,
    allow_wide: bool = True,
):
    """Validate, optionally subsample (seeded, without replacement) and de-duplicate X.

    Returns ``(points, n_points, n_removed, subsampled_from)``; at least 3 distinct points remain.
    ``max_points`` (None or a whole number >= 3) and ``seed`` (None or a whole number >= 0) are
    checked first: InputError, not numpy's TypeError or ValueError.
    """
    max_points = _whole_or_none(max_points, "max_points", 3)
    seed = _whole_or_none(seed, "seed", 0)
    a = check_matrix(X, expect_dim=expect_dim, allow_wide=allow_wide)
    n_points = a.shape[0]
    sub = None
    if max_points is not None and n_points > max_points:
        pick = np.sort(np.random.default_rng(seed).choice(n_points, size=max_points, replace=False))
        a, sub = a[pick], n_points
    removed = 0
    if dedup:
        a, removed, _ = dedup_rows(a)
        if a.shape[0] < 3:
            raise DataError(
                f"only {a.shape[0]} distinct point(s) after removing {removed} duplicate rows; "
                "at least 3 are needed"
            )
    return a, n_points, removed, sub


def twonn(
    X,
    discard_fraction: float = DEFAULT_DISCARD_FRACTION,
    estimator: str = "linear",
    dedup: bool = True,
    block_size: int | None = None,
    device=None,
    seed: int | None = None,
    max_points: int | None = None,
    expect_dim: int | None = None,
    allow_wide: bool = True,
    prune: bool | None = None,
) -> TwoNNResult:
    """TwoNN intrinsic dimension of the points X (N, D) (see the module docstring for definitions).

    ``dedup``: remove exact duplicate rows first (default). With ``dedup=False`` a duplicate
    raises DataError instead of giving a silent number. ``max_points``: estimate on a seeded
    uniform subsample of that many rows (``seed``). ``block_size``, ``device``: passed to
    :func:`~geomscope.metrics.neighbors.two_nearest`. ``expect_dim`` / ``allow_wide``: see
    :func:`check_matrix`. ``prune``: exact candidate pruning in the neighbour search (None: where a
    sample says it pays; see :func:`~geomscope.metrics.neighbors.two_nearest`); the result is the same.
    """
    _check_params(discard_fraction, estimator)
    a, n_points, removed, sub = prepare_points(X, dedup, max_points, seed, expect_dim, allow_wide)
    r1, r2, _, _, info = two_nearest_unchecked(a, block_size, device, True, None, True, prune)
    zero = int(np.count_nonzero(r1 == 0))
    if zero:
        raise DataError(f"{zero} rows have an exact duplicate (r1 = 0); use dedup=True to remove them")
    mu = np.sort(r2 / r1)
    d, k = fit_mu(mu, discard_fraction, estimator)
    return TwoNNResult(
        dimension=d,
        estimator=estimator,
        discard_fraction=discard_fraction,
        n_points=n_points,
        n_duplicates_removed=removed,
        n_used=int(mu.size),
        n_fit=k,
        n_dims=int(a.shape[1]),
        subsampled_from=sub,
        seed=seed,
        mu=mu,
        neighbor_info=info,
    )


class TwoNNError(NamedTuple):
    """``estimate`` (full-sample TwoNN), its ``standard_error``, and ``method`` (record it)."""

    estimate: float
    standard_error: float
    method: str


def decimation_se(points: np.ndarray, estimate, n_splits: int, rng) -> float | None:
    """Standard error by decimation: the points split at random into ``n_splits`` disjoint parts,
    ``estimate`` on each, SE = std(ddof=1) / sqrt(n_splits). None when a part would have < 3 points."""
    parts = np.array_split(rng.permutation(points.shape[0]), n_splits)
    if min(p.size for p in parts) < 3:
        return None
    reps = [estimate(points[np.sort(p)]) for p in parts]
    return float(np.std(reps, ddof=1) / np.sqrt(n_splits))


def twonn_error(
    X,
    method: str = "bootstrap",
    n_repeats: int = 200,
    n_splits: int = 4,
    discard_fraction: float = DEFAULT_DISCARD_FRACTION,
    estimator: str = "linear",
    dedup: bool = True,
    seed: int | None = 0,
    block_size: int | None = None,
    device=None,
    expect_dim: int | None = None,
) -> TwoNNError:
    """TwoNN estimate with a standard error.

    ``method="bootstrap"``: the neighbour search runs once; the N ratios mu are resampled with
    replacement ``n_repeats`` times (seeded) and refitted; SE = sample std (ddof=1) of the refits.
    ``method="decimation"``: the distinct points are split at random into ``n_splits`` disjoint
    parts, TwoNN (own neighbour search) is run on each, SE = std(ddof=1) / sqrt(n_splits) of the part
    estimates (the error of their mean; each part sees neighbours at a coarser scale, so a large
    spread also flags scale dependence). The estimate is always the full-sample TwoNN.
    Returns :class:`TwoNNError`; its ``method`` string says all of this in one line.
    """
    res = twonn(X, discard_fraction, estimator, dedup, block_size, device, expect_dim=expect_dim)
    rng = np.random.default_rng(seed)
    tag = f"{estimator} estimator, discard_fraction={discard_fraction}, {F_CONVENTION}"
    if method == "bootstrap":
        if n_repeats < 2:
            raise InputError(f"n_repeats must be >= 2; got {n_repeats}")
        mu = res.mu
        reps = [
            fit_mu(mu[rng.integers(0, mu.size, mu.size)], discard_fraction, estimator)[0]
            for _ in range(n_repeats)
        ]
        se = float(np.std(reps, ddof=1))
        desc = (
            f"bootstrap over points of mu: {n_repeats} resamples with replacement of the "
            f"{mu.size} ratios (seed={seed}), SE = std(ddof=1) of the refits; {tag}"
        )
    elif method == "decimation":
        if n_splits < 2:
            raise InputError(f"n_splits must be >= 2; got {n_splits}")
        a, _, _, _ = prepare_points(X, dedup, expect_dim=expect_dim)
        se = decimation_se(
            a,
            lambda p: twonn(p, discard_fraction, estimator, False, block_size, device).dimension,
            n_splits,
            rng,
        )
        if se is None:
            raise DataError(f"{a.shape[0]} points are too few to split into {n_splits} parts of >= 3")
        desc = (
            f"decimation: {a.shape[0]} distinct points split at random into {n_splits} disjoint parts "
            f"(seed={seed}), SE = std(ddof=1)/sqrt({n_splits}) of the part estimates; {tag}"
        )
    else:
        raise InputError(f"unknown error method {method!r}; use 'bootstrap' or 'decimation'")
    return TwoNNError(float(res.dimension), se, desc)
