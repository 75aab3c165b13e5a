"""Outlier dimensions: four named rules (docs/metrics.md). Each returns an OutlierResult that carries the
rule, its threshold and the statistic it thresholded; ``dims`` are sorted by that statistic,
largest first.

- ``variance``   per-dimension variance >= k * mean per-dimension variance (k = 5); the principal
                 outlier is argmax variance (Rudman, Chen & Eickhoff 2023).
- ``zscore``     a per-dimension statistic (variance or mean |x|) more than z = 3 population standard
                 deviations (over dimensions) above its mean over dimensions (Kovaleva et al. 2021).
- ``quantile``   median over tokens of |x_d| above the q = 0.99 quantile of all |x| of the sample
                 (Macocco et al. 2025).
- ``magnitude``  |x_d| >= 6 in >= 6 % of the tokens of a layer, in >= 25 % of the layers
                 (Dettmers et al. 2022); input: per-layer fraction of tokens with |x_d| >= 6.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.metrics.validate import NonfiniteRows, as_rows, count_nonfinite_rows


@dataclass
class OutlierResult:
    rule: str
    threshold: float
    dims: list[int]
    statistic: np.ndarray
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-friendly form (numpy scalars/arrays as Python numbers/lists)."""

        def plain(v):
            if isinstance(v, np.ndarray):
                return v.tolist()
            if isinstance(v, np.generic):
                return v.item()
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        return {
            "rule": self.rule,
            "threshold": float(self.threshold),
            "dims": [int(d) for d in self.dims],
            "statistic": plain(self.statistic),
            "details": plain(self.details),
        }


def _vector(v, name: str) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    if a.ndim != 1 or a.size < 2:
        raise DataError(
            f"{name} must be a 1-D per-dimension vector with at least 2 entries; got shape {a.shape}"
        )
    if not np.isfinite(a).all():
        raise DataError(f"{name} contains NaN or Inf")
    return a


def _sorted_dims(stat: np.ndarray, mask: np.ndarray) -> list[int]:
    idx = np.flatnonzero(mask)
    return [int(i) for i in idx[np.argsort(-stat[idx], kind="stable")]]


def outliers_variance(variance, k: float = 5.0) -> OutlierResult:
    """Dimensions with variance >= k * mean(variance)."""
    v = _vector(variance, "variance")
    if not k > 0:
        raise InputError(f"k must be > 0; got {k}")
    mean = float(v.mean())
    if not mean > 0:
        raise DataError("all per-dimension variances are 0; no outlier dimension is defined")
    cut = k * mean
    return OutlierResult(
        "variance",
        float(k),
        _sorted_dims(v, v >= cut),
        v,
        {"principal": int(np.argmax(v)), "mean_variance": mean, "cutoff": cut, "ratio_to_mean": v / mean},
    )


def outliers_zscore(stat, z: float = 3.0, stat_name: str = "variance") -> OutlierResult:
    """Dimensions whose statistic is > mean + z * std over dimensions (std with ddof=0)."""
    if stat_name not in ("variance", "mean_abs"):
        raise InputError(f"stat_name must be 'variance' or 'mean_abs'; got {stat_name!r}")
    s = _vector(stat, stat_name)
    mu, sd = float(s.mean()), float(s.std())
    if sd == 0:
        scores = np.zeros_like(s)
    else:
        scores = (s - mu) / sd
    return OutlierResult(
        "zscore",
        float(z),
        _sorted_dims(s, scores > z),
        s,
        {"stat_name": stat_name, "mean": mu, "std": sd, "cutoff": mu + z * sd, "zscores": scores},
    )


def outliers_quantile(X_sample, q: float = 0.99) -> OutlierResult:
    """Dimensions whose median |x_d| over the sampled rows exceeds the q-quantile of all |x|."""
    if not 0.0 < q < 1.0:
        raise InputError(f"q must be in (0, 1); got {q}")
    a = as_rows(X_sample, "X_sample")
    if a.shape[0] < 1 or a.shape[1] < 2:
        raise DataError(f"X_sample is {a.shape}; at least 1 row and 2 dimensions are needed")
    bad = count_nonfinite_rows(a)
    if bad:
        raise NonfiniteRows(bad, a.shape[0], "X_sample")
    ab = np.abs(np.asarray(a, dtype=np.float64))
    cut = float(np.quantile(ab, q))
    med = np.median(ab, axis=0)
    return OutlierResult(
        "quantile", float(q), _sorted_dims(med, med > cut), med, {"cutoff": cut, "n_rows": int(a.shape[0])}
    )


def outliers_magnitude(
    frac_ge, layer_frac: float = 0.25, token_frac: float = 0.06, abs_threshold: float = 6.0
) -> OutlierResult:
    """Dimensions with |x| >= abs_threshold in >= token_frac of tokens in >= layer_frac of layers.

    ``frac_ge`` (L, D): per layer, the fraction of tokens with |x_d| >= abs_threshold (e.g.
    Moments.frac_abs_ge() of each layer, stacked); a 1-D vector counts as one layer.
    ``abs_threshold`` is only recorded (the fractions were computed with it).
    """
    f = np.asarray(frac_ge, dtype=np.float64)
    if f.ndim == 1:
        f = f[None, :]
    if f.ndim != 2 or f.shape[1] < 2:
        raise DataError(f"frac_ge must be (layers, D) with D >= 2; got shape {np.shape(frac_ge)}")
    if not np.isfinite(f).all() or (f < 0).any() or (f > 1).any():
        raise DataError("frac_ge must hold fractions in [0, 1]")
    if not (0 < layer_frac <= 1 and 0 < token_frac <= 1):
        raise InputError("layer_frac and token_frac must be in (0, 1]")
    hit = f >= token_frac
    share = hit.mean(axis=0)
    return OutlierResult(
        "magnitude",
        float(abs_threshold),
        _sorted_dims(share, share >= layer_frac),
        share,
        {
            "layer_frac": layer_frac,
            "token_frac": token_frac,
            "n_layers": int(f.shape[0]),
            "layers_hit": hit.sum(axis=0),
        },
    )


OUTLIER_RULES = {
    "variance": outliers_variance,
    "zscore": outliers_zscore,
    "quantile": outliers_quantile,
    "magnitude": outliers_magnitude,
}

OUTLIER_INPUTS = {
    "variance": "per-dimension variance (D,)",
    "zscore": "per-dimension statistic (D,): variance or mean |x|",
    "quantile": "a sample of rows (n, D)",
    "magnitude": "per-layer fraction of tokens with |x_d| >= 6, (L, D)",
}


def rule_defaults(name: str) -> dict:
    """The default parameters of a registered rule, e.g. {'k': 5.0} for 'variance'."""
    if name not in OUTLIER_RULES:
        raise InputError(f"unknown outlier rule {name!r}; use one of {', '.join(OUTLIER_RULES)}")
    params = list(inspect.signature(OUTLIER_RULES[name]).parameters.values())[1:]
    return {p.name: p.default for p in params}
