"""Statistics of a study: correlations with bootstrap intervals, paired differences, summaries.

Pure functions of numbers (numpy and scipy only). The bootstrap resamples *seeds within
configurations*: a run's configuration (regulariser, lambda) is fixed by design, so a resample
keeps every configuration's number of runs and redraws which of its seeds appear. Intervals are
percentile intervals of ``n_boot`` resamples with a fixed seed, so a study's numbers are
reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided percentile interval (``level`` = coverage, e.g. 0.95)."""

    estimate: float | None
    low: float | None
    high: float | None
    level: float
    n: int

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "level": self.level,
            "n": self.n,
        }


def mean_sd(values) -> tuple[float | None, float | None, int]:
    """(mean, sample SD with ddof=1 -- None below 2 values, n) of the finite values."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if a.size == 0:
        return None, None, 0
    return float(a.mean()), (float(a.std(ddof=1)) if a.size >= 2 else None), int(a.size)


def pearson(x, y) -> float | None:
    """Pearson's r (None when either variable is constant or fewer than 3 pairs)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    xc, yc = x - x.mean(), y - y.mean()
    return float((xc @ yc) / math.sqrt((xc @ xc) * (yc @ yc)))


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


def _percentile_interval(estimate, replicates: list, level: float, n: int) -> Interval:
    reps = np.asarray([r for r in replicates if r is not None], dtype=np.float64)
    if estimate is None or reps.size < 2:
        return Interval(estimate, None, None, level, n)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(reps, [alpha, 1.0 - alpha])
    return Interval(float(estimate), float(low), float(high), level, n)


def bootstrap_correlation(
    x, y, groups, *, method: str = "spearman", n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> Interval:
    """A correlation across runs with a bootstrap interval that resamples runs within their group
    (configuration): each resample keeps every group's size."""
    fn = spearman if method == "spearman" else pearson
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    groups = np.asarray(groups)
    members = [np.flatnonzero(groups == g) for g in dict.fromkeys(groups.tolist())]
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        idx = np.concatenate([rng.choice(m, size=m.size, replace=True) for m in members])
        reps.append(fn(x[idx], y[idx]))
    return _percentile_interval(fn(x, y), reps, level, int(x.size))


def bootstrap_mean(values, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> Interval:
    """The mean of ``values`` (e.g. paired differences over seeds) with a percentile bootstrap interval."""
    a = np.asarray(values, np.float64)
    if a.size == 0:
        return Interval(None, None, None, level, 0)
    rng = np.random.default_rng(seed)
    reps = [float(a[rng.integers(0, a.size, a.size)].mean()) for _ in range(n_boot)] if a.size >= 2 else []
    return _percentile_interval(float(a.mean()), reps, level, int(a.size))


def line_fit_band(x, y, grid, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Least-squares line y = a + b x on ``grid`` with a pointwise bootstrap band (resampling runs):
    (fit, low, high) arrays, or None when x is constant or fewer than 3 points."""
    x, y, grid = np.asarray(x, np.float64), np.asarray(y, np.float64), np.asarray(grid, np.float64)
    if x.size < 3 or np.ptp(x) == 0:
        return None

    def fit(ix):
        b, a = np.polyfit(x[ix], y[ix], 1) if np.ptp(x[ix]) > 0 else (0.0, y[ix].mean())
        return a + b * grid

    rng = np.random.default_rng(seed)
    reps = np.stack([fit(rng.integers(0, x.size, x.size)) for _ in range(n_boot)])
    alpha = (1.0 - level) / 2.0
    return fit(np.arange(x.size)), np.quantile(reps, alpha, axis=0), np.quantile(reps, 1 - alpha, axis=0)
