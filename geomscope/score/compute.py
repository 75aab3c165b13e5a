"""Per-layer numbers from merged accumulators: values, jackknife replicates, standard errors.

Moment-based metrics (IsoScore, IsoScore*, average cosine, spectrum) are functions of the
accumulated statistics. Their uncertainty is a delete-one-group jackknife: rows are split into G
groups (run: by document, ``doc_id % G``; array: G contiguous row blocks); replicate r is the
metric on every group but r (its Moments merged exactly from the other groups' Moments). With
the G' non-empty groups and theta_r the replicates,

    se = sqrt((G' - 1) / G' * sum_r (theta_r - mean_r theta_r)^2).

The centred / standardised cosine of replicate r uses replicate r's own mean / standard deviation
(the second streaming pass accumulates every replicate's unit-vector sum: multiunit.py), so the
mean's own uncertainty is included. A shrinkage target C0 from a reference covariance is held
fixed across replicates; the trace-matched identity follows each replicate's trace.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.score.options import ScoreOptions

TOP_K = (1, 5, 10)
SPECTRUM_KEYS = ("pr", "erank", "top1_share", "top5_share", "top10_share")
AVGCOS_KEY = {"plain": "avgcos", "centred": "avgcos_centred", "standardised": "avgcos_standardised"}


def merged(groups: list, skip: int | None = None):
    """A new Moments holding every group's rows except group ``skip``."""
    from geomscope.metrics import Moments

    g0 = groups[0]
    out = Moments(g0.dim, g0.abs_threshold, extras=g0.extras, product_dtype=g0.product_dtype)
    for i, g in enumerate(groups):
        if i != skip:
            out.merge(g)
    return out


def nonempty(groups: list) -> list[int]:
    return [i for i, g in enumerate(groups) if g.n > 0]


def jackknife_se(reps) -> float | None:
    """Delete-one-group jackknife standard error from the replicate values (None if any is None)."""
    vals = list(reps)
    if len(vals) < 2 or any(v is None for v in vals):
        return None
    a = np.asarray(vals, dtype=np.float64)
    g = a.size
    return float(math.sqrt((g - 1) / g * float(((a - a.mean()) ** 2).sum())))


def replicate_ses(values: dict, reps: list[dict], keys, notes: dict, undefined: str) -> dict:
    """Each key's jackknife SE over the replicate records ``reps`` (None without replicates), and
    the note ``undefined`` on each key whose full-data value is None."""
    for k in keys:
        if values[k] is None:
            notes.setdefault(k, undefined)
    return {k: jackknife_se([rep[k] for rep in reps]) if reps else None for k in keys}


def value_or_note(fn, notes: dict, key: str):
    """``fn()``, or None with the DataError's message noted under ``key`` (why that metric is null)."""
    try:
        return fn()
    except DataError as e:
        notes.setdefault(key, str(e))
        return None


def moment_values(m, opts: ScoreOptions, c0, notes: dict, *, full: bool) -> dict:
    """Scalar moment metrics of one Moments ``m`` (dict key -> float|None).

    ``full=True`` also returns "eigenvalues" and keeps the reasons for nulls in ``notes``.
    """
    from geomscope.metrics import avgcos_from_sum, isoscore_from_cov, isoscore_star_from_cov, spectrum

    out: dict = {}
    nts = notes if full else {}
    cov = None
    if any(opts.wants(k) for k in ("isoscore", "isoscore_star", "spectrum")):

        def _cov():
            m.check_variance("the layer", "every covariance metric")
            return m.covariance()

        cov = value_or_note(_cov, nts, "covariance")
    if opts.wants("isoscore"):
        out["isoscore"] = (
            None if cov is None else value_or_note(lambda: isoscore_from_cov(cov), nts, "isoscore")
        )
    if opts.wants("isoscore_star"):
        out["isoscore_star"] = (
            None
            if cov is None
            else value_or_note(lambda: isoscore_star_from_cov(cov, opts.zeta, c0), nts, "isoscore_star")
        )
    if opts.wants("avgcos") and "plain" in opts.avgcos_variants:
        out["avgcos"] = value_or_note(lambda: float(avgcos_from_sum(m.sum_unit, m.n_unit())), nts, "avgcos")
    if opts.wants("spectrum"):
        sp = None if cov is None else value_or_note(lambda: spectrum(cov, top_k=TOP_K), nts, "spectrum")
        if sp is None:
            out.update(dict.fromkeys(SPECTRUM_KEYS))
        else:
            out["pr"], out["erank"] = float(sp["pr"]), float(sp["erank"])
            share = _top_share(sp)
            for k in TOP_K:
                out[f"top{k}_share"] = share.get(k)
            if full:
                out["eigenvalues"] = [float(v) for v in sp["eigenvalues"]]
    for key, why in (("isoscore", "covariance"), ("isoscore_star", "covariance"), ("pr", "covariance")):
        if full and key in out and out[key] is None and why in nts:
            nts.setdefault(key, nts[why])
    return out


def _top_share(sp: dict) -> dict[int, float | None]:
    share = sp.get("top_k_share")
    if isinstance(share, dict):
        return {int(k): (None if v is None else float(v)) for k, v in share.items()}
    ev = np.asarray(sp["eigenvalues"], dtype=np.float64)
    tot = ev.sum()
    return {k: (float(ev[: min(k, ev.size)].sum() / tot) if k <= ev.size else None) for k in TOP_K}


def unit_shift_scale(m, variant: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Shift/scale of the second-pass unit sums for a cosine variant, from that replicate's Moments
    (:func:`geomscope.metrics.validate.cosine_shift_scale`: constant dimensions add exactly 0)."""
    from geomscope.metrics.validate import cosine_shift_scale

    variance = m.variance() if m.n >= 2 else np.zeros(m.dim)  # one row: every dimension constant
    return cosine_shift_scale(m.mean, variance, variant)


def load_cov_file(path: str, dim: int) -> np.ndarray:
    """A (D, D) covariance from a .npy file, checked: square, D matches, finite, symmetric."""
    if not Path(path).is_file():  # (a FIFO would block the read)
        raise InputError(
            f"--shrinkage-target {path} is not a file; give a (D, D) covariance saved with numpy.save"
        )
    from geomscope.score.formats import npy_header
    from geomscope.score.sources import npy_error

    try:
        with open(path, "rb") as f:  # the shape is checked before anything is read from it
            shape = tuple(npy_header(f)[0])
    except (OSError, ValueError, EOFError) as e:
        raise InputError(npy_error(path, e, "--shrinkage-target ")) from e
    if len(shape) != 2 or shape[0] != shape[1]:
        raise InputError(f"--shrinkage-target {path} has shape {shape}; a (D, D) covariance is needed")
    if shape[0] != dim:
        raise InputError(f"--shrinkage-target {path} is {shape[0]} x {shape[0]} but the data has D = {dim}")
    try:
        c = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise InputError(npy_error(path, e, "--shrinkage-target ")) from e
    from geomscope.metrics.validate import as_covariance, check_psd

    name = f"--shrinkage-target {path}"
    try:  # the library's own checks of a covariance, said of the option
        c = as_covariance(c, name)
        check_psd(np.linalg.eigvalsh((c + c.T) / 2), name)
    except DataError as e:
        raise InputError(str(e)) from e
    return c
