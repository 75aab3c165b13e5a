"""A layer's all-but-the-top and whitened metrics (``--metrics abtt``, ``whitened``): the covariance
metrics of every jackknife replicate, and the second pass's average cosines.

IsoScore and IsoScore* of the processed rows are exact functions of a replicate's covariance
(geomscope.metrics.postprocess): computed for the full data and each replicate with the moment
metrics. Their average cosine needs the rows: each replicate's mean and eigenvectors (or whitening
map) go to the second pass, which sums every replicate's processed unit vectors in one set of
products (the replicates of a group that is empty take the full data's), as the centred cosine's
do (multiunit.py). A replicate's own mean and eigenvectors carry their uncertainty into the SE.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.schema import ABTT_METRICS, abtt_key
from geomscope.score.options import ScoreOptions

WHITENED_KEYS = ("whitened_isoscore", "whitened_isoscore_star", "whitened_avgcos")


def keys(o: ScoreOptions) -> list[str]:
    """The scalar keys the options request, in report order."""
    out = []
    if o.wants("abtt"):
        out += [abtt_key(k, m) for k in o.abtt_k for m in ABTT_METRICS]
    if o.wants("whitened"):
        out += list(WHITENED_KEYS)
    return out


def params(o: ScoreOptions) -> dict:
    """The report's params of these families (none unless requested: other reports keep their keys)."""
    return {"abtt_k": list(o.abtt_k)} if o.wants("abtt") else {}


def wanted(o: ScoreOptions) -> bool:
    return o.postprocessed


def measure(m, o: ScoreOptions, c0, notes: dict) -> tuple[dict, dict]:
    """(values, second-pass pieces) of one Moments ``m``: IsoScore and IsoScore* after removing each
    k and after whitening, and per family its (mean, basis) -- the top max(k) eigenvectors, or the
    whitening map -- for the average cosine. A null value's reason goes to ``notes``."""
    from geomscope.metrics.postprocess import (
        eigh_descending,
        removed_top_isoscores,
        whitened_isoscores,
        whitening_map,
    )

    out: dict = dict.fromkeys(k for k in keys(o) if not k.endswith("_avgcos"))
    pieces: dict = {}
    try:
        m.check_variance("the layer", "all-but-the-top and whitening")
        cov = m.covariance()
        lam, vec = eigh_descending(cov)
    except DataError as e:
        for k in keys(o):
            notes.setdefault(k, str(e))
        return out, pieces
    if o.wants("abtt"):
        try:
            for k, (iso, star) in removed_top_isoscores(cov, o.abtt_k, o.zeta, c0).items():
                out[abtt_key(k, "isoscore")], out[abtt_key(k, "isoscore_star")] = iso, star
            pieces["abtt"] = (m.mean.copy(), vec[:, : max(o.abtt_k)].copy())
        except DataError as e:
            for k in keys(o):
                if k.startswith("abtt"):
                    notes.setdefault(k, str(e))
    if o.wants("whitened"):
        try:
            out["whitened_isoscore"], out["whitened_isoscore_star"], _ = whitened_isoscores(cov, o.zeta, c0)
            pieces["whitened"] = (m.mean.copy(), whitening_map(lam, vec))
        except DataError as e:
            for k in WHITENED_KEYS:
                notes.setdefault(k, str(e))
    return out, pieces


def pass_spec(full: dict, replicates: dict[int, dict], groups: int) -> dict:
    """The second pass's spec per family: (shifts (R, D), bases) over the G jackknife replicates and
    the full data last; a replicate without pieces (an empty group, or one whose covariance gave
    none) takes the full data's (its value is not used). A family the full data has no pieces for
    is left out."""
    spec = {}
    for family, (shift, basis) in full.items():
        rows = [replicates.get(r, {}).get(family, (shift, basis)) for r in range(groups)]
        rows.append((shift, basis))
        shifts = np.stack([s for s, _ in rows])
        if family == "abtt":
            spec[family] = (shifts, np.stack([b for _, b in rows]))
        else:
            spec[family] = (shifts, [b for _, b in rows])
    return spec


def cosine_values(sums: dict, o: ScoreOptions, live: list[int], have: set, notes: dict):
    """(values, replicate values) of the processed rows' average cosines from the second pass's
    sums: the full data's (the last replicate), and those of the ``live`` replicates; a replicate
    not in ``have`` (its covariance gave no pieces) has no value."""
    values, reps = {}, {}

    def one(key, fn, r, where):
        try:
            return float(fn(r))
        except DataError as e:
            where.setdefault(key, str(e))
            return None

    for family, s in sums.items():
        last = s.replicates - 1
        fns = (
            {abtt_key(k, "avgcos"): (lambda r, k=k, s=s: s.avgcos(r, k)) for k in o.abtt_k}
            if family == "abtt"
            else {"whitened_avgcos": s.avgcos}
        )
        for key, fn in fns.items():
            values[key] = one(key, fn, last, notes)
            if live:
                reps[key] = [one(key, fn, r, {}) if r in have else None for r in live]
    return values, reps


def unavailable(o: ScoreOptions, why: str, values: dict, notes: dict) -> None:
    """The processed rows' average cosines cannot be served from what the source kept: null, why."""
    for key in keys(o):
        if key.endswith("_avgcos"):
            values[key] = None
            notes[key] = why
