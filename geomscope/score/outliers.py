"""Outlier dimensions per layer under the chosen rule (geomscope.metrics.outliers), with support.

- ``variance`` / ``zscore``: from the layer's accumulated per-dimension variance (zscore: or mean
  |x|, ``--outlier-stat``).
- ``quantile``: on the layer's seeded row sample (the intrinsic-dimension sample, ``--id-sample``).
- ``magnitude``: across the scored layers (|x_d| >= threshold in >= 6 % of a layer's tokens, in
  >= 25 % of the layers); every layer reports the same dimensions and its own per-dimension
  fraction of tokens over the threshold as ``outlier_statistic``. Layers of several widths (a run
  of ``extract --modules``) are judged among the layers of their own width.

Uncertainty ("outlier_support"): for each reported dimension, the fraction of the jackknife
replicates (every document group but one) in which the rule flags it too (1.0 = stable); a
replicate where the rule is undefined (no variance) is not counted. The quantile rule works on a
sample without groups: no support (a note says so).

variance / zscore on variance follow IsoScore's zero-variance rule (Moments.check_variance): a layer
without variance has no outlier dimension (null, with a note), and a constant dimension's variance
is exactly 0 (validate.cosine_shift_scale's per-dimension rule), not its mean's rounding residue.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.formatting import counted
from geomscope.score import compute
from geomscope.score.options import ScoreOptions

LAYER_FRAC, TOKEN_FRAC = 0.25, 0.06


def _variance(m) -> np.ndarray:
    """Per-dimension variance under the zero-variance rule of IsoScore and the cosines: DataError
    for a layer without variance, and exactly 0 for a constant dimension. What accumulating leaves of
    a constant is rounding of its mean (identical rows give variances of 1e-27, which would flag the
    dimension of largest |x| with support 1.0 where IsoScore refuses the layer)."""
    m.check_variance("the layer", "an outlier dimension by variance")
    variance = m.variance()
    _, scale = compute.unit_shift_scale(m, "standardised")  # inf: constant (validate.cosine_shift_scale)
    return np.where(np.isinf(scale), 0.0, variance)


def _rule_on_moments(m, o: ScoreOptions):
    from geomscope.metrics import outliers_variance, outliers_zscore

    if o.outlier_rule == "variance":
        return outliers_variance(_variance(m), k=o.outlier_threshold)
    # mean |x| is no spread: identical rows have one, and it is no rounding residue
    stat = _variance(m) if o.outlier_stat == "variance" else m.mean_abs()
    return outliers_zscore(stat, z=o.outlier_threshold, stat_name=o.outlier_stat)


def replicate_statistic(m, o: ScoreOptions):
    """The outlier dimensions of one jackknife replicate (set), or None where not applicable."""
    if not o.wants("outliers") or o.outlier_rule not in ("variance", "zscore"):
        return None
    try:
        return set(_rule_on_moments(m, o).dims)
    except DataError:
        return None


def _support(dims: list[int], rep_sets: list) -> list[float]:
    sets = [s for s in rep_sets if s is not None]
    if not sets:
        return []
    return [float(np.mean([d in s for s in sets])) for d in dims]


def layer_outliers(full, sample, rep_sets: list, o: ScoreOptions, notes: dict) -> dict | None:
    """{"dims", "statistic", "support"} for rules variance/zscore/quantile; None (+ note) if undefined."""
    from geomscope.metrics import outliers_quantile

    try:
        if o.outlier_rule == "quantile":
            if sample is None or len(sample) < 1:
                raise DataError("no sampled rows for the quantile rule")
            res = outliers_quantile(np.asarray(sample, dtype=np.float64), q=o.outlier_threshold)
            notes.setdefault("outlier_support", "quantile rule runs on a row sample: no jackknife support")
            support: list[float] = []
        else:
            if full is None:
                raise DataError("fewer than 2 usable rows")
            res = _rule_on_moments(full, o)
            support = _support(res.dims, rep_sets)
            if not support and res.dims:
                notes.setdefault(
                    "outlier_support",
                    "jackknife off or fewer than 2 document groups"
                    if not rep_sets
                    else "the rule is undefined in every jackknife replicate (none has variance)",
                )
    except DataError as e:
        notes.setdefault("outliers", str(e))
        return None
    return {
        "dims": [int(d) for d in res.dims],
        "statistic": [float(v) for v in res.statistic],
        "support": support,
    }


def apply_magnitude(entries: list[dict], extras: dict, o: ScoreOptions) -> None:
    """Fill outliers/outlier_statistic/outlier_support of every entry under the magnitude rule: over
    the scored layers of each width (a dimension of one width is no dimension of another: a run of
    ``extract --modules`` may hold several)."""
    names = [e["layer"] for e in entries]
    ok = [n for n in names if extras.get(n, {}).get("count_abs_ge") is not None]
    if not ok:
        for e in entries:
            e["notes"].setdefault("outliers", "no layer has enough rows for the magnitude rule")
        return
    by_width: dict[int, list[str]] = {}
    for n in ok:
        by_width.setdefault(len(extras[n]["count_abs_ge"][0]), []).append(n)
    found = {}
    for width, group in by_width.items():
        found.update(_magnitude_over(group, extras, o, width if len(by_width) > 1 else None))
    for e, n in zip(entries, names, strict=True):
        if n in found:
            dims, statistic, support, why = found[n]
            e["outliers"] = list(dims)
            e["outlier_statistic"] = statistic
            e["outlier_support"] = support
            e["notes"].setdefault("outlier_rule", why)
        else:
            e["notes"].setdefault("outliers", "too few usable rows in this layer")


def _magnitude_over(ok: list[str], extras: dict, o: ScoreOptions, width: int | None) -> dict:
    """The magnitude rule over the layers ``ok`` (one width; ``width``: said in the note when the
    run has several): ``{layer: (dims, statistic, support, note)}``."""
    from geomscope.metrics import outliers_magnitude

    counts = {n: np.stack(extras[n]["count_abs_ge"]).astype(np.float64) for n in ok}  # (G, D)
    ns = {n: np.asarray(extras[n]["n_groups"], dtype=np.float64) for n in ok}  # (G,)
    frac = np.stack([counts[n].sum(0) / ns[n].sum() for n in ok])
    res = outliers_magnitude(
        frac, layer_frac=LAYER_FRAC, token_frac=TOKEN_FRAC, abs_threshold=o.outlier_threshold
    )
    rep_sets = []
    n_groups = len(next(iter(ns.values())))
    if n_groups >= 2:
        for r in range(n_groups):
            if not any(ns[n][r] > 0 for n in ok):
                continue
            fr = []
            for n in ok:
                rest = ns[n].sum() - ns[n][r]
                fr.append((counts[n].sum(0) - counts[n][r]) / rest if rest > 0 else np.zeros(frac.shape[1]))
            rep_sets.append(
                set(
                    outliers_magnitude(
                        np.stack(fr),
                        layer_frac=LAYER_FRAC,
                        token_frac=TOKEN_FRAC,
                        abs_threshold=o.outlier_threshold,
                    ).dims
                )
            )
    support = _support(res.dims, rep_sets) if len(rep_sets) >= 2 else []
    layers = counted(len(ok), "scored layer") + (f" {width} wide" if width is not None else "")
    why = (
        f"magnitude rule over the {layers}: |x_d| >= {o.outlier_threshold:g} in >= "
        f"{TOKEN_FRAC:.0%} of a layer's tokens in >= {LAYER_FRAC:.0%} of the layers; statistic = this "
        "layer's fraction of tokens over the threshold"
    )
    dims = [int(d) for d in res.dims]
    return {n: (dims, [float(v) for v in frac[i]], support, why) for i, n in enumerate(ok)}
