"""The final norm's effect, for a run that holds the last block's output both before (``layer_N``,
the norm's input) and after the model's final norm (``final_norm``); see geomscope/extract/layers.py.

Machina & Mercer (NAACL 2024) argue that large Pythia models tune their final LayerNorm for
isotropy. The report's ``final_norm`` entry gives what that claim needs:

- ``metrics``: every scalar metric of the two layers, ``{metric: {before, after, change}}`` (change =
  after - before), with the layers' standard errors left in their own entries.
- ``gain`` / ``bias``: the norm's per-dimension gain γ and bias β (recorded by ``extract`` from the
  checkpoint) against the per-dimension variance before the norm, as Spearman rank correlations
  ``spearman_abs_gain_variance`` and ``spearman_abs_bias_variance`` (a negative correlation: the
  norm shrinks the dimensions that vary most). A LayerNorm or RMSNorm divides every token by one
  per-token scale, so dimension d's share of the output variance moves by γ_d² relative to the
  other dimensions; ``outliers`` lists, for each outlier dimension of the layer before the norm
  (the report's rule), its variance over the mean variance and ``gain_ratio`` = |γ_d| / median |γ|,
  with ``damped`` (< 1) or ``amplified`` (> 1); both null, with a ``note``, when the median |γ| is
  0 or not a number (the ratio is then undefined).

Every norm a run stores on both sides (``extract --modules norms``, or ``PATH:in`` and ``PATH``)
gets the same entry in the report's ``norms`` list (:func:`norm_effects`), with the gain read from
the norm's parameters where extract recorded them (``gain``, as above) and the gain measured from
the rows: ``measured_gain`` relates g_d = sd(y_d) / sd(x_d), the output's standard deviation over
the input's in dimension d, to the input variance (``spearman_gain_variance``, ``median_gain``),
and each outlier row adds ``measured_gain_ratio`` = g_d / median g and ``measured_effect``. The
measured gain includes what the weight does not: the per-token division and, for a LayerNorm, the
centring.
"""

from __future__ import annotations

import numpy as np

from geomscope.layers import FINAL_NORM_LAYER, is_gradient, is_hidden_state
from geomscope.schema import SCALAR_METRIC_NAMES


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    from scipy.stats import spearmanr

    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.ptp(a[ok]) == 0 or np.ptp(b[ok]) == 0:
        return None
    return float(spearmanr(a[ok], b[ok]).statistic)


#: why a norm's entry has no parameter statistics (gain and bias null) when its gain is not recorded
NO_RECORDED_GAIN = "the run does not record the norm's gain (re-extract it with this version)"
NO_VARIANCE = "per-dimension variance unavailable (score with a moment metric, e.g. isoscore)"


def final_norm_effect(
    layers: list[dict], extras: dict, params: dict | None
) -> tuple[dict | None, str | None]:
    """(the report's ``final_norm`` entry, None) or (None, why it is null)."""
    by_name = {e["layer"]: e for e in layers}
    after = by_name.get(FINAL_NORM_LAYER)
    if after is None:
        return None, (
            "no final_norm layer scored (the run lacks it -- extract with --layers all or name "
            "final_norm -- or --layers left it out; BERT-style models have no final norm)"
        )
    before_idx = (after.get("index") or 0) - 1
    before = _layer_before(layers, after, before_idx)
    if before is None:
        return (
            None,
            f"the layer before the final norm (index {before_idx}) was not scored; add it to --layers",
        )
    var = (extras.get(before["layer"]) or {}).get("variance")
    return norm_effect(before, after, var, params), None


def norm_effect(before: dict, after: dict, var, params: dict | None, no_gain: str = NO_RECORDED_GAIN) -> dict:
    """The effect of a norm whose input's report entry is ``before`` and output's ``after``:
    ``{before, after, metrics, gain, bias, outliers}`` (module docstring), ``var`` the input's
    per-dimension variance (None: not computed), ``params`` the norm's recorded parameters
    (``{module, type, gain, bias}``); a ``note`` says why the parameter statistics are null."""
    out = {
        "before": before["layer"],
        "after": after["layer"],
        "metrics": _metric_changes(before, after),
        "gain": None,
        "bias": None,
    }
    if var is None:
        out["note"] = NO_VARIANCE
        return out
    var = np.asarray(var, float)
    gain = (params or {}).get("gain")
    if gain is None or len(gain) != var.size:
        out["note"] = no_gain
        return out
    _add_parameter_effect(out, np.abs(np.asarray(gain, float)), var, params, before.get("outliers") or [])
    return out


def _layer_before(layers: list[dict], after: dict, before_idx: int) -> dict | None:
    """The entry of the activations before the norm: the layer of index ``before_idx`` (a gradient
    layer, ``layer_N.grad``, shares its layer's index and is not it); of several, the hidden state
    ``layer_N`` (the last block's modules, ``extract --modules``, share its index too); None when
    it was not scored."""
    found = [
        e for e in layers if e.get("index") == before_idx and e is not after and not is_gradient(e["layer"])
    ]
    return next((e for e in found if is_hidden_state(e["layer"])), found[0] if found else None)


def _metric_changes(before: dict, after: dict) -> dict:
    """``{metric: {before, after, change}}`` for every scalar metric either layer has (change =
    after - before, None unless both have it)."""
    metrics = {}
    for m in SCALAR_METRIC_NAMES:
        b, a = before.get(m), after.get(m)
        if b is None and a is None:
            continue
        metrics[m] = {
            "before": b,
            "after": a,
            "change": (a - b) if (a is not None and b is not None) else None,
        }
    return metrics


def _add_parameter_effect(out: dict, g: np.ndarray, var: np.ndarray, params: dict, outlier_dims) -> None:
    """Fill ``out``'s ``gain`` and ``bias`` (the Spearman correlations of |γ| and |β| with the
    per-dimension variance ``var`` before the norm; ``g`` = |γ|) and its ``outliers`` (each of
    ``outlier_dims`` with its variance ratio and gain ratio), with a ``note`` when the median |γ|
    leaves the gain ratio undefined."""
    med = float(np.median(g))
    out["gain"] = {
        "module": params.get("module"),
        "type": params.get("type"),
        "spearman_abs_gain_variance": _spearman(g, var),
        "median_abs_gain": med if np.isfinite(med) else None,
    }
    bias = params.get("bias")
    if bias is not None and len(bias) == var.size:
        out["bias"] = {"spearman_abs_bias_variance": _spearman(np.abs(np.asarray(bias, float)), var)}
    # |gamma_d| / median |gamma| needs a positive, finite median: with more than half the gains 0
    # (pruned or dead dimensions) every non-zero gain is infinitely above it, and reading the median
    # as 1 would read a dimension the norm amplifies relative to the others as "damped"
    usable = np.isfinite(med) and med > 0
    if not usable:
        out["note"] = (
            f"the median |gain| is {med:g} (more than half of the norm's gains are 0, or some are not "
            "numbers), so gain_ratio = |gain_d| / median |gain| is undefined: gain_ratio and effect are null"
        )
    out["outliers"] = _outlier_rows(outlier_dims, g, var, med if usable else None)


def _outlier_rows(outlier_dims, g: np.ndarray, var: np.ndarray, med: float | None) -> list[dict]:
    """One row per outlier dimension d: its variance over the mean variance, ``gain_ratio`` =
    |γ_d| / median |γ| (``med``; None when undefined) and its ``effect`` (damped, amplified or
    unchanged; None with the ratio)."""
    mean_var = float(var.mean()) or 1.0
    rows = []
    for d in outlier_dims:
        ratio = float(g[d] / med) if med is not None else None
        if ratio is None or not np.isfinite(ratio):
            ratio = None
        effect = _effect(ratio)
        rows.append(
            {
                "dim": int(d),
                "variance_ratio": float(var[d] / mean_var),
                "gain_ratio": ratio,
                "effect": effect,
            }
        )
    return rows


#: why a module norm's entry has no parameter statistics
NO_MODULE_GAIN = (
    "no gain recorded for this norm (it applies neither its weight nor 1 + weight, or has no weight); "
    "measured_gain is read from the rows"
)
NO_NORM_PAIR = (
    "no norm module scored at both its input and its output: store both sides (extract --modules norms, "
    "or PATH:in,PATH) and keep both in --layers"
)


def norm_effects(
    layers: list[dict], extras: dict, entries: list[dict], params_by_module: dict | None
) -> tuple[list[dict] | None, str | None]:
    """(the report's ``norms``: one entry per norm module scored at its input and its output, in the
    run's order, None) or (None, why there is none). ``entries``: the run's layer entries (a norm
    module's carry ``module``, ``side`` and ``norm``); ``params_by_module``: the manifest's
    ``module_norms``."""
    by_name = {e["layer"]: e for e in layers}
    out = []
    for stored_in, stored_out in _norm_pairs(entries):
        before, after = by_name.get(stored_in["name"]), by_name.get(stored_out["name"])
        if before is None or after is None:
            continue
        var_in = (extras.get(before["layer"]) or {}).get("variance")
        var_out = (extras.get(after["layer"]) or {}).get("variance")
        params = (params_by_module or {}).get(stored_out["module"])
        entry = {
            "module": stored_out["module"],
            "type": stored_out.get("type"),
            "block": stored_out.get("block"),
            **norm_effect(before, after, var_in, params, no_gain=NO_MODULE_GAIN),
        }
        _add_measured_gain(entry, var_in, var_out, before.get("outliers") or [])
        out.append(entry)
    return (out, None) if out else (None, NO_NORM_PAIR)


def stores_norms(entries: list[dict]) -> bool:
    """Whether a run's layer entries hold a norm module (its report then has a ``norms`` key)."""
    return any(e.get("kind") == "module" and e.get("norm") for e in entries)


def _norm_pairs(entries: list[dict]) -> list[tuple[dict, dict]]:
    """(input entry, output entry) of every norm module a run stores on both sides (activations)."""
    sides: dict[str, dict] = {}
    for e in entries:
        if e.get("kind") == "module" and e.get("norm") and not e.get("part") and not is_gradient(e["name"]):
            sides.setdefault(e["module"], {})[e.get("side")] = e
    return [(s["in"], s["out"]) for s in sides.values() if "in" in s and "out" in s]


def _add_measured_gain(entry: dict, var_in, var_out, outlier_dims) -> None:
    """``measured_gain`` of a norm from its input's and output's per-dimension variances: g_d =
    sqrt(var_out_d / var_in_d) against var_in (Spearman, median g), and each outlier row's
    ``measured_gain_ratio`` = g_d / median g with its ``measured_effect``; None without both
    variances."""
    if var_in is None or var_out is None:
        entry["measured_gain"] = None
        return
    var_in, var_out = np.asarray(var_in, float), np.asarray(var_out, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(var_in > 0, np.sqrt(var_out / var_in), np.nan)
    finite = g[np.isfinite(g)]
    med = float(np.median(finite)) if finite.size else None
    entry["measured_gain"] = {"spearman_gain_variance": _spearman(g, var_in), "median_gain": med}
    usable = med if med is not None and med > 0 else None
    rows = entry.get("outliers")
    if rows is None:
        rows = entry["outliers"] = _outlier_rows(outlier_dims, g, var_in, None)  # no parameter ratio
    for row in rows:
        ratio = float(g[row["dim"]] / usable) if usable is not None else None
        if ratio is None or not np.isfinite(ratio):
            ratio = None
        row["measured_gain_ratio"] = ratio
        row["measured_effect"] = _effect(ratio)


def _effect(ratio: float | None) -> str | None:
    """``damped`` below 1, ``amplified`` above, ``unchanged`` at 1; None without a ratio."""
    if ratio is None:
        return None
    return "damped" if ratio < 1 else ("amplified" if ratio > 1 else "unchanged")
