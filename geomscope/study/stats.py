"""Statistics of a study: correlations with intervals over configurations, paired differences,
summaries.

Pure functions of numbers (numpy and scipy only). A study's runs are grouped by design: each
configuration (regulariser, lambda) is run with several seeds. The question a correlation of eval
IsoScore* with accuracy asks is about configurations -- does a setting that makes the geometry
more isotropic go with better scores? -- so its uncertainty comes from which configurations were
run, not only from which seeds: :func:`cluster_correlation` resamples whole configurations and
gives no interval where the design holds too few of them (:data:`MIN_CONFIGURATIONS`) or too few
seeds in one (:data:`MIN_SEEDS`). A paired difference against lambda = 0 is a mean over seeds, with
Student's t interval (:func:`mean_interval`).

Every statistic returned is finite or None (compare.json must be JSON, which has no Infinity): values
are scaled by a power of two (exact) before they are squared or summed, so data near the ends of the
float range (1e160, 1e-170) neither overflow nor underflow, and a result too large for a float (the
SD of +-1.7e308) is None. Sums over runs are numpy's elementwise reductions, not BLAS products, so a
result does not depend on the BLAS kernel or its thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from geomscope.metrics.validate import binary_exponent
from geomscope.study.options import DEFAULT_BOOTSTRAP

#: an interval over configurations needs this many configurations, each with this many seeds
MIN_CONFIGURATIONS = 3
MIN_SEEDS = 3
#: what :func:`cluster_correlation` resamples, and how its interval is formed (recorded with it)
CONFIGURATIONS = "configurations"
CLUSTER_METHOD = "cluster bootstrap over configurations; Fisher z, robust SE, Student t on K-1 df"
T_METHOD = "Student t on n-1 df"
#: the reason given in place of an interval the design cannot support
TOO_FEW_RUNS = "too few runs for an interval"
TOO_FEW_PAIRS = "too few pairs for an interval"


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval (``level`` = nominal coverage, e.g. 0.95).

    ``n``: the values (runs, or pairs) it rests on; ``units``: the independent units it was
    resampled by (configurations; None without resampling); ``undefined``: resamples whose statistic
    was undefined; ``method``: how the interval is formed; ``reason``: why there is none (None where
    there is one)."""

    estimate: float | None
    low: float | None
    high: float | None
    level: float
    n: int
    undefined: int = 0
    resampling: str | None = None
    units: int | None = None
    method: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "level": self.level,
            "n": self.n,
            "units": self.units,
            "undefined": self.undefined,
            "resampling": self.resampling,
            "method": self.method,
            "reason": self.reason,
        }

    def without_interval(self, reason: str) -> Interval:
        return replace(self, low=None, high=None, reason=reason)


def _finite(v) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _unscaled(v: float, e: int) -> float | None:
    with np.errstate(over="ignore"):
        return _finite(np.ldexp(v, e))


def _scaled(a: np.ndarray) -> np.ndarray:
    """``a`` divided by a power of two (exact) into [-1, 1]."""
    return np.ldexp(a, -binary_exponent(a))


def mean_sd(values) -> tuple[float | None, float | None, int]:
    """(mean, sample SD with ddof=1 -- None below 2 values or beyond the float range, n) of the
    finite values."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if a.size == 0:
        return None, None, 0
    e = binary_exponent(a)
    s = np.ldexp(a, -e)
    sd = _unscaled(float(s.std(ddof=1)), e) if a.size >= 2 else None
    return _unscaled(float(s.mean()), e), sd, int(a.size)


def _centred(a: np.ndarray) -> np.ndarray:
    """``a`` scaled by a power of two into (-1, 1), then centred: its sums of squares and products
    neither overflow (values near 1e160) nor underflow (near 1e-170)."""
    s = _scaled(a)
    return s - s.mean()


def pearson(x, y) -> float | None:
    """Pearson's r (None when either variable is constant or fewer than 3 pairs), in [-1, 1]."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or x.min() == x.max() or y.min() == y.max():
        return None
    xc, yc = _centred(x), _centred(y)
    # one division at the end (not unit vectors first): ranks' products sum to an exact 0 where
    # there is no association, so a Spearman rho of 0 stays 0 and takes no sign
    r = float((xc * yc).sum()) / math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    return min(1.0, max(-1.0, r))  # rounding can put r a hair past +-1


def _ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), as scipy.stats.rankdata does."""
    from scipy.stats import rankdata

    return rankdata(a)


def spearman(x, y) -> float | None:
    """Spearman's rho: Pearson's r of the average ranks."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3:
        return None
    return pearson(_ranks(x), _ranks(y))


# ------------------------------------------------------------------ resampling configurations
def _codes(groups) -> np.ndarray:
    """Each run's configuration as 0..K-1, in order of first appearance (``groups``: any hashable
    keys, e.g. (regulariser, lambda) pairs)."""
    index: dict = {}
    keys = groups.tolist() if isinstance(groups, np.ndarray) else list(groups)
    return np.asarray([index.setdefault(g, len(index)) for g in keys], dtype=np.int64)


def design_of(groups) -> tuple[int, int]:
    """(configurations K, the fewest runs in one of them)."""
    counts = np.bincount(_codes(groups)) if len(groups) else np.zeros(0, np.int64)
    return int(counts.size), int(counts.min()) if counts.size else 0


def _cluster_weights(codes: np.ndarray, n_boot: int, rng) -> np.ndarray:
    """(n_boot, runs) integer weights: each row draws K configurations with replacement and gives
    every run the number of times its configuration was drawn (a run drawn twice counts twice)."""
    k = int(codes.max()) + 1
    picks = rng.integers(0, k, (n_boot, k))
    counts = np.zeros((n_boot, k), dtype=np.int64)
    np.add.at(counts, (np.arange(n_boot)[:, None], picks), 1)
    return counts[:, codes]


def _weighted_ranks(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Average ranks of ``v`` in each row's weighted sample, as scipy.stats.rankdata gives them on
    the sample with every run repeated w times: a value's rank is the weight below it plus
    (its tie's weight + 1) / 2. Integer arithmetic (exact, no BLAS) up to that halving."""
    uniq, inv = np.unique(v, return_inverse=True)
    onehot = np.zeros((v.size, uniq.size), dtype=np.int64)
    onehot[np.arange(v.size), inv] = 1
    tie_weight = w @ onehot  # int64 product: exact
    below = np.cumsum(tie_weight, axis=1) - tie_weight
    return (below + (tie_weight + 1) / 2.0)[:, inv]


def _weighted_pearson(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each row's Pearson r of the sample with run i repeated w[row, i] times (x, y scaled into
    [-1, 1]; rows x, y or broadcast vectors); NaN where either variable is constant in the row."""
    total = w.sum(axis=1, keepdims=True)
    xc = x - (w * x).sum(axis=1, keepdims=True) / total
    yc = y - (w * y).sum(axis=1, keepdims=True) / total
    sxx, syy, sxy = ((w * a * b).sum(axis=1) for a, b in ((xc, xc), (yc, yc), (xc, yc)))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.clip(sxy / np.sqrt(sxx * syy), -1.0, 1.0)


def _constant_in(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Rows of ``w`` in which every run drawn has the same value of ``v`` (exact comparison)."""
    present = w > 0
    return np.where(present, v, np.inf).min(axis=1) == np.where(present, v, -np.inf).max(axis=1)


def _resampled_correlations(x, y, w, method: str) -> np.ndarray:
    """The correlation of each weighted resample, NaN where it is undefined."""
    if method == "spearman":
        r = _weighted_pearson(_weighted_ranks(x, w), _weighted_ranks(y, w), w)
    else:
        r = _weighted_pearson(_scaled(x), _scaled(y), w)
    r[_constant_in(x, w) | _constant_in(y, w)] = np.nan
    return r


#: the normal distribution's central 68.27 %: between these quantiles lie +-1 SD
_ONE_SD = (0.15865525393145707, 0.8413447460685429)


def _end(sorted_values: np.ndarray, p: float) -> float:
    """numpy's linear quantile of sorted values, where a neighbour at +-inf gives +-inf."""
    h = (sorted_values.size - 1) * p
    i = math.floor(h)
    a, b = sorted_values[i], sorted_values[min(i + 1, sorted_values.size - 1)]
    if h == i or a == b or not math.isfinite(a):
        return float(a)
    return float(b) if not math.isfinite(b) else float(a + (h - i) * (b - a))


def robust_sd_z(replicates: np.ndarray) -> float:
    """Half the width of the central 68.27 % of the replicates' Fisher z = atanh(r): the SD of z
    where z is normal, unmoved by the resamples at r = +-1 (z infinite) while they are fewer than
    15.9 %. An undefined replicate (NaN) counts below every value for the low quantile and above
    for the high one, so it can only widen; inf where the central range is unbounded."""
    defined = replicates[~np.isnan(replicates)]
    undefined = replicates.size - defined.size
    with np.errstate(divide="ignore"):
        z = np.sort(np.arctanh(defined))
    low = _end(np.concatenate([np.full(undefined, -np.inf), z]), _ONE_SD[0])
    high = _end(np.concatenate([z, np.full(undefined, np.inf)]), _ONE_SD[1])
    return (high - low) / 2.0


def cluster_correlation(
    x,
    y,
    groups,
    *,
    method: str = "spearman",
    n_boot: int = DEFAULT_BOOTSTRAP,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The correlation of x with y across runs, with an interval that resamples configurations.

    Runs of one configuration (``groups``) share everything but the seed, so they are not
    independent draws: the independent units are the K configurations. Each of ``n_boot``
    resamples draws K configurations with replacement and keeps all their runs (the cluster
    bootstrap); r*_b is its correlation, undefined where x or y is constant in it. The interval is

        tanh(atanh(r) -+ t_{K-1, (1+level)/2} * s),   s = (q_{0.841}(z*) - q_{0.159}(z*)) / 2,

    with z*_b = atanh(r*_b) and q_p the p-quantile of the resamples:

    - Fisher's z = atanh(r) makes a correlation's sampling distribution near normal with a spread
      that does not depend on the correlation itself (Pearson; Spearman's rho likewise, Fieller,
      Hartley and Pearson 1957), so a symmetric interval in z is fitting, and tanh keeps it in
      (-1, 1).
    - s estimates the SD of z from the resamples: for a normal z, half its central 68.27 % range.
      Resamples of one or two configurations can be perfectly ordered (r* = +-1, z* infinite),
      which would make the plain SD infinite; the quantiles ignore them while they are rare, and an
      undefined resample counts beyond each end (:func:`robust_sd_z`).
    - Student's t with K - 1 degrees of freedom, not the normal quantile: s is estimated from K
      independent units, and with few of them the normal quantile (and the percentile interval,
      whose resamples of K units vary by only about sqrt((K - 1) / K) of the statistic's spread)
      covers too seldom -- in simulation the percentile interval of 3 configurations covered a
      configuration-level correlation of 0.62 in 77 % of samples at nominal 95 %. With few units
      this is conservative: it errs wide.

    A permutation test across configurations would give an exact p-value for "no association" but
    no interval, and with 3 configurations no p-value below 1/6; the interval here says both the
    sign and the size the runs allow.

    No interval (``reason`` says why) with fewer than :data:`MIN_CONFIGURATIONS` configurations or
    fewer than :data:`MIN_SEEDS` runs in one, where r = +-1 (z is infinite), or where the resamples
    cannot bound s (more than 15.9 % of them constant or perfectly ordered) or do not vary."""
    fn = spearman if method == "spearman" else pearson
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    k, fewest = design_of(groups) if x.size else (0, 0)
    base = Interval(fn(x, y), None, None, level, int(x.size), 0, CONFIGURATIONS, k, CLUSTER_METHOD)
    if base.estimate is None:  # fewer than 3 runs, or a constant variable
        return base.without_interval("no correlation: fewer than 3 runs, or one variable is constant")
    if k < MIN_CONFIGURATIONS or fewest < MIN_SEEDS:
        return base.without_interval(
            f"{TOO_FEW_RUNS}: {k} configuration(s), the fewest with {fewest} seed(s); it needs "
            f"{MIN_CONFIGURATIONS} configurations of {MIN_SEEDS} seeds"
        )
    return _bootstrap_interval(base, x, y, groups, k, method, n_boot, level, seed)


def _bootstrap_interval(
    base: Interval, x, y, groups, k: int, method: str, n_boot: int, level: float, seed: int
) -> Interval:
    """``base`` (the correlation across ``k`` configurations) with the cluster bootstrap's
    interval in Fisher's z (:func:`cluster_correlation`), or without one saying why."""
    weights = _cluster_weights(_codes(groups), n_boot, np.random.default_rng(seed))
    replicates = _resampled_correlations(x, y, weights, method)
    undefined = int(np.isnan(replicates).sum())
    base = replace(base, undefined=undefined)
    if abs(base.estimate) == 1.0:
        return base.without_interval("the runs are perfectly ordered (a correlation of +-1)")
    s = robust_sd_z(replicates)
    if not math.isfinite(s):
        return base.without_interval(
            f"one variable was constant, or the order perfect, in too many of {n_boot} resamples"
        )
    if s == 0.0:
        return base.without_interval("the resamples do not vary")
    from scipy.stats import t

    half = float(t.ppf((1.0 + level) / 2.0, k - 1)) * s
    z = math.atanh(base.estimate)
    return replace(base, low=math.tanh(z - half), high=math.tanh(z + half))


def mean_interval(values, *, level: float = 0.95) -> Interval:
    """The mean of ``values`` (paired differences over seeds) with Student's t interval
    mean -+ t_{n-1, (1+level)/2} * SD / sqrt(n): exact where the differences are normal, and
    sound at small n, where a bootstrap of n values cannot reach past their range (with 3 values
    it misses the mean a quarter of the time). No interval below 3 values (``reason``); no
    estimate where a value, or the mean, is beyond the float range."""
    a = np.asarray(values, np.float64)
    base = Interval(None, None, None, level, int(a.size), method=T_METHOD)
    if a.size == 0 or not np.isfinite(a).all():
        return base.without_interval("no values" if a.size == 0 else "a value is not finite")
    e = binary_exponent(a)
    s = np.ldexp(a, -e)  # exact; the sums of the scaled values cannot overflow
    mean = float(s.mean())
    base = replace(base, estimate=_unscaled(mean, e))
    if a.size < 3:
        return base.without_interval(f"{TOO_FEW_PAIRS}: {a.size} pair(s); it needs 3")
    from scipy.stats import t

    half = float(t.ppf((1.0 + level) / 2.0, a.size - 1)) * float(s.std(ddof=1)) / math.sqrt(a.size)
    low, high = _unscaled(mean - half, e), _unscaled(mean + half, e)
    if base.estimate is None or low is None or high is None:
        return base.without_interval("an end is beyond the float range")
    return replace(base, low=low, high=high)


def line_fit_band(x, y, grid, *, groups=None, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Least-squares line y = a + b x on ``grid`` with a pointwise percentile band from resampled
    configurations (``groups``; None: each run its own): (fit, low, high) arrays, or None when x is
    constant or fewer than 3 points.

    A resample weights each run by how often its configuration was drawn; its line is the weighted
    fit b = sum w (x - xbar)(y - ybar) / sum w (x - xbar)^2, in closed form on values scaled by powers
    of two (np.polyfit squares x, which underflows near 1e-170). A resample of one x is flat."""
    x, y, grid = np.asarray(x, np.float64), np.asarray(y, np.float64), np.asarray(grid, np.float64)
    if x.size < 3 or x.min() == x.max():
        return None
    ex, ey = binary_exponent(x), binary_exponent(y)
    xs, ys, gs = np.ldexp(x, -ex), np.ldexp(y, -ey), np.ldexp(grid, -ex)
    codes = _codes(np.arange(x.size) if groups is None else groups)

    def fits(w):  # (rows, runs) weights -> (rows, grid) lines
        total = w.sum(axis=1, keepdims=True)
        xm, ym = (w * xs).sum(axis=1, keepdims=True) / total, (w * ys).sum(axis=1, keepdims=True) / total
        xc = xs - xm
        sxx = (w * xc * xc).sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            b = np.where(sxx > 0, (w * xc * (ys - ym)).sum(axis=1, keepdims=True) / sxx, 0.0)
        with np.errstate(over="ignore"):
            return np.ldexp(ym + b * (gs - xm), ey)

    reps = fits(_cluster_weights(codes, n_boot, np.random.default_rng(seed)))
    alpha = (1.0 - level) / 2.0
    fit = fits(np.ones((1, x.size), dtype=np.int64))[0]
    return fit, np.quantile(reps, alpha, axis=0), np.quantile(reps, 1 - alpha, axis=0)
