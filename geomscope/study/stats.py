"""Statistics of a study: correlations with bootstrap intervals, paired differences, summaries.

Pure functions of numbers (numpy and scipy only). The bootstrap of a correlation resamples *seeds
within configurations* where it can: a run's configuration (regulariser, lambda) is fixed by design,
so a resample keeps every configuration's number of runs and redraws which of its seeds appear. Where
a configuration has a single run, that scheme has nothing to redraw for it (it would hold the run
fixed, and with one seed everywhere give an interval of zero width), so the runs themselves are
resampled instead (:func:`bootstrap_correlation`). Intervals are percentile intervals of ``n_boot``
resamples with a fixed seed, so a study's numbers are reproducible; a resample whose correlation is
undefined (one variable constant) is counted, not dropped (:func:`_percentile_interval`).

Every statistic returned is finite or None (compare.json must be JSON, which has no Infinity): values
are scaled by a power of two (exact) before they are squared or summed, so data near the ends of the
float range (1e160, 1e-170) neither overflow nor underflow, and a result too large for a float (the
SD of +-1.7e308) is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from geomscope.metrics._validate import binary_exponent

#: how :func:`bootstrap_correlation` resampled (recorded with each interval)
WITHIN_CONFIGURATIONS = "seeds within configurations"
ACROSS_RUNS = "runs"


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided percentile interval (``level`` = coverage, e.g. 0.95).

    ``undefined``: resamples whose statistic was undefined (counted in the interval, see
    :func:`_percentile_interval`); ``resampling``: what was resampled (None without a bootstrap)."""

    estimate: float | None
    low: float | None
    high: float | None
    level: float
    n: int
    undefined: int = 0
    resampling: str | None = None

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "level": self.level,
            "n": self.n,
            "undefined": self.undefined,
            "resampling": self.resampling,
        }


def _finite(v) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _unscaled(v: float, e: int) -> float | None:
    with np.errstate(over="ignore"):
        return _finite(np.ldexp(v, e))


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
    s = np.ldexp(a, -binary_exponent(a))
    return s - s.mean()


def pearson(x, y) -> float | None:
    """Pearson's r (None when either variable is constant or fewer than 3 pairs), in [-1, 1]."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or x.min() == x.max() or y.min() == y.max():
        return None
    xc, yc = _centred(x), _centred(y)
    # one division at the end (not unit vectors first): ranks' products sum to an exact 0 where
    # there is no association, so a Spearman rho of 0 stays 0 and takes no sign
    r = float(xc @ yc) / math.sqrt(float(xc @ xc) * float(yc @ yc))
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


def _percentile_interval(
    estimate, replicates: list, level: float, n: int, resampling: str | None = None
) -> Interval:
    """The percentile interval of ``replicates``, where a replicate of None (a resample whose
    statistic is undefined, e.g. a constant accuracy) is counted as a value that could lie anywhere.

    Dropping those would condition on the resamples that happen to be defined, which can move both
    ends (away from zero, when the undefined resamples are the ones without the run that carries an
    association), and calling them 0 would invent a value. Instead each end is the percentile it is
    whatever values they take: for the low end they count as lying below every defined replicate,
    for the high end above. Where an end would need one of them (more than about (1 - level) / 2 of
    the replicates undefined), it is unbounded and no interval is given."""
    defined = np.sort(np.asarray([r for r in replicates if r is not None], dtype=np.float64))
    undefined, total = len(replicates) - int(defined.size), len(replicates)
    if estimate is None or defined.size < 2:
        return Interval(estimate, None, None, level, n, undefined, resampling)
    alpha = (1.0 - level) / 2.0
    # the order statistics each end interpolates between (numpy's linear rule), in the sorted
    # replicates with the undefined ones first (low end) or last (high end)
    if (
        math.floor((total - 1) * alpha) < undefined
        or math.ceil((total - 1) * (1 - alpha)) >= total - undefined
    ):
        return Interval(float(estimate), None, None, level, n, undefined, resampling)
    # (the undefined ones stand in as the extreme defined value: they are never interpolated with)
    low = np.quantile(np.concatenate([np.full(undefined, defined[0]), defined]), alpha)
    high = np.quantile(np.concatenate([defined, np.full(undefined, defined[-1])]), 1.0 - alpha)
    return Interval(float(estimate), float(low), float(high), level, n, undefined, resampling)


def _members(groups) -> list[np.ndarray]:
    groups = np.asarray(groups)
    return [np.flatnonzero(groups == g) for g in dict.fromkeys(groups.tolist())]


def resampling_of(groups) -> str:
    """What :func:`bootstrap_correlation` resamples for these groups (see there)."""
    members = _members(groups)
    return WITHIN_CONFIGURATIONS if members and all(m.size >= 2 for m in members) else ACROSS_RUNS


def bootstrap_correlation(
    x, y, groups, *, method: str = "spearman", n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> Interval:
    """A correlation across runs with a bootstrap interval.

    When every group (configuration) has at least two runs, runs are resampled within their group:
    each resample keeps every group's size (``resampling`` = "seeds within configurations"). A group
    of one run has no seeds to redraw -- within-group resampling would hold it fixed as if it were
    known exactly, and with one seed in every group every resample is the data itself, a zero-width
    interval -- so then all runs are resampled together, the ordinary pairs bootstrap of a
    correlation. It treats each run's (x, y) as one draw and so also varies the mix of
    configurations: where it errs, it errs wide. Its ``resampling`` is "runs"."""
    fn = spearman if method == "spearman" else pearson
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    estimate = fn(x, y)
    if estimate is None:  # fewer than 3 runs, or a constant variable: nothing to put an interval on
        return Interval(None, None, None, level, int(x.size))
    scheme, members = resampling_of(groups), _members(groups)
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        if scheme == WITHIN_CONFIGURATIONS:
            idx = np.concatenate([rng.choice(m, size=m.size, replace=True) for m in members])
        else:
            idx = rng.integers(0, x.size, x.size)
        reps.append(fn(x[idx], y[idx]))
    return _percentile_interval(estimate, reps, level, int(x.size), scheme)


def bootstrap_mean(values, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> Interval:
    """The mean of ``values`` (e.g. paired differences over seeds) with a percentile bootstrap interval
    (no estimate where a value, or the mean, is beyond the float range)."""
    a = np.asarray(values, np.float64)
    if a.size == 0 or not np.isfinite(a).all():
        return Interval(None, None, None, level, int(a.size))
    e = binary_exponent(a)
    s = np.ldexp(a, -e)  # exact; the sums of the scaled values cannot overflow
    rng = np.random.default_rng(seed)
    reps = (
        [_unscaled(s[rng.integers(0, a.size, a.size)].mean(), e) for _ in range(n_boot)]
        if a.size >= 2
        else []
    )
    estimate = _unscaled(s.mean(), e)
    return _percentile_interval(estimate, reps, level, int(a.size), "values" if reps else None)


def line_fit_band(x, y, grid, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Least-squares line y = a + b x on ``grid`` with a pointwise bootstrap band (resampling runs):
    (fit, low, high) arrays, or None when x is constant or fewer than 3 points.

    The line is fitted in closed form on values scaled by powers of two: np.polyfit squares x, which
    underflows near 1e-170 (its SVD then fails to converge)."""
    x, y, grid = np.asarray(x, np.float64), np.asarray(y, np.float64), np.asarray(grid, np.float64)
    if x.size < 3 or x.min() == x.max():
        return None
    ex, ey = binary_exponent(x), binary_exponent(y)
    xs, ys, gs = np.ldexp(x, -ex), np.ldexp(y, -ey), np.ldexp(grid, -ex)

    def fit(ix):
        xi, yi = xs[ix], ys[ix]
        xm, ym = xi.mean(), yi.mean()
        xc = xi - xm
        sxx = float(xc @ xc)
        b = float(xc @ (yi - ym)) / sxx if sxx > 0 else 0.0  # a resample of one x: its mean, flat
        with np.errstate(over="ignore"):
            return np.ldexp(ym + b * (gs - xm), ey)

    rng = np.random.default_rng(seed)
    reps = np.stack([fit(rng.integers(0, x.size, x.size)) for _ in range(n_boot)])
    alpha = (1.0 - level) / 2.0
    return fit(np.arange(x.size)), np.quantile(reps, alpha, axis=0), np.quantile(reps, 1 - alpha, axis=0)
