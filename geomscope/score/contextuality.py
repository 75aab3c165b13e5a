"""A layer's contextuality (``--metrics contextuality``, Ethayarajh 2019): self-similarity and maximum
explainable variance of token types across their contexts, intra-sentence similarity, each with the
anisotropy baseline subtracted (geomscope.metrics.contextuality).

What is measured, per layer, from one pass beside the moments (ordinary tokens only: special tokens
are no word type, and [CLS]/[SEP] in every sentence would swamp the average):

- types: the token ids with at least ``--context-min`` occurrences in the run that never occur as
  special tokens (a metadata pass counts them); at most ``--context-types`` of them, those of
  smallest hash(token id; seed); each keeps its ``--context-occurrences`` occurrences of smallest
  hash(doc_id, position; seed). SelfSim and MEV are averaged over the types;
- sentences: a run's documents (a line of text is a sentence), the ``--context-docs`` of smallest
  hash(doc_id; seed); IntraSim is averaged over them;
- baselines: the average cosine of every pair of ordinary tokens (exact, from their unit sums) for
  SelfSim and IntraSim; for MEV, the mean MEV of disjoint sets of ``--context-occurrences`` tokens
  drawn from a seeded pool of ordinary tokens (MEV depends on how many rows it is taken over, so the
  baseline is taken over as many as a type's).

SEs: delete-one-group jackknife over document groups; each replicate recomputes every type's
values from its occurrences outside the group, the sentences outside it and the baselines without
it. ``contextuality.by_frequency``: SelfSim and MEV averaged within the token-frequency bins of
``--metrics stratified`` (``--frequency-bins``).
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.score import compute
from geomscope.score.options import ScoreOptions

KEYS = ("selfsim", "selfsim_adj", "intrasim", "intrasim_adj", "mev", "mev_adj")
#: rows of the pool the MEV baseline is drawn from, in sets of --context-occurrences
POOL_SETS = 64


def wanted(o: ScoreOptions) -> bool:
    return o.wants("contextuality")


def keys(o: ScoreOptions) -> list[str]:
    return list(KEYS) if wanted(o) else []


def chosen_types(counts: np.ndarray, special: np.ndarray, o: ScoreOptions) -> np.ndarray:
    """The token ids measured: at least ``--context-min`` occurrences, never special, at most
    ``--context-types`` of them by smallest hash(token id; seed)."""
    from geomscope.store.sample import STREAM_CONTEXT_TYPES, row_hash

    counts = np.asarray(counts, np.int64)
    special = np.zeros(counts.size, np.int64) if special is None else np.asarray(special, np.int64)
    special = np.pad(special, (0, max(0, counts.size - special.size)))[: counts.size]
    ok = np.flatnonzero((counts >= o.context_min) & (special == 0))
    if ok.size > o.context_types:
        ok = ok[np.argsort(row_hash(ok.astype(np.uint64), o.seed, STREAM_CONTEXT_TYPES), kind="stable")]
        ok = np.sort(ok[: o.context_types])
    return ok


# ------------------------------------------------------------------------------ one layer
def _type_values(k: np.ndarray) -> tuple[float, float]:
    """(SelfSim, MEV) of occurrences whose Gram matrix (raw rows) is ``k``."""
    d = np.sqrt(np.clip(np.diagonal(k), 0.0, None))
    n = k.shape[0]
    safe = np.where(d > 0, d, np.inf)
    cos = k / safe[:, None] / safe[None, :]
    selfsim = float((cos.sum() - np.trace(cos)) / (n * (n - 1)))
    tr = float(np.trace(k))
    if not tr > 0:
        raise DataError("the occurrences are all zero")
    return selfsim, float(np.linalg.eigvalsh(k)[-1] / tr)


def _types(occurrences: dict, live: list[int]) -> tuple[dict, dict]:
    """{type: (SelfSim, MEV)} of the full data, and per live replicate r the same over the occurrences
    outside group r (types left with fewer than 2 are left out)."""
    full, reps = {}, {r: {} for r in live}
    for t, (rows, groups) in occurrences.items():
        if len(rows) < 2:
            continue
        x = np.asarray(rows, np.float64)
        k = x @ x.T
        try:
            full[t] = _type_values(k)
        except DataError:
            continue
        for r in live:
            keep = np.flatnonzero(groups != r)
            if keep.size >= 2:
                try:
                    reps[r][t] = _type_values(k[np.ix_(keep, keep)])
                except DataError:
                    pass
    return full, reps


def _mean(values, i: int) -> float | None:
    vals = [v[i] for v in values]
    return float(np.mean(vals)) if vals else None


def _docs_value(docs, skip: int | None) -> float | None:
    from geomscope.metrics.contextuality import intra_similarity

    vals = []
    for _, group, n, sx, su in docs:
        if group != skip:
            try:
                vals.append(intra_similarity(sx, su, n))
            except DataError:
                continue
    return float(np.mean(vals)) if vals else None


def _baseline_cos(unit_sum: np.ndarray, unit_n: np.ndarray, skip: int | None) -> float | None:
    from geomscope.metrics import avgcos_from_sum

    rows = [g for g in range(len(unit_n)) if g != skip]
    try:
        return avgcos_from_sum(unit_sum[rows].sum(axis=0), int(unit_n[rows].sum()))
    except DataError:
        return None


def _baseline_mev(pool, size: int, skip: int | None) -> float | None:
    """The mean MEV of disjoint sets of ``size`` pool rows (in hash order), the group ``skip`` left out."""
    from geomscope.metrics.contextuality import explainable_variance

    if pool is None:
        return None
    rows, groups = pool
    if skip is not None:
        rows = rows[groups != skip]
    vals = []
    for i in range(0, len(rows) - size + 1, size):
        try:
            vals.append(explainable_variance(rows[i : i + size]))
        except DataError:
            continue
    return float(np.mean(vals)) if vals else None


def _values(types: dict, docs, base_cos, base_mev) -> dict:
    selfsim, mev = _mean(types.values(), 0), _mean(types.values(), 1)
    intra = docs

    def minus(a, b):
        return None if a is None or b is None else a - b

    return {
        "selfsim": selfsim,
        "selfsim_adj": minus(selfsim, base_cos),
        "intrasim": intra,
        "intrasim_adj": minus(intra, base_cos),
        "mev": mev,
        "mev_adj": minus(mev, base_mev),
    }


def summary(
    part, o: ScoreOptions, groups: int, bins: np.ndarray | None, notes: dict
) -> tuple[dict, dict, dict]:
    """(values, SEs, the layer's ``contextuality`` entry) from its accumulators (``part``: a
    metrics.contextuality.Contexts, or None with why in ``notes["contextuality"]``)."""
    if part is None:
        why = notes.get("contextuality", "no rows")
        for k in KEYS:
            notes.setdefault(k, why)
        return dict.fromkeys(KEYS), dict.fromkeys(KEYS), None
    occurrences = part.types.occurrences()
    docs = part.docs.documents()
    pool = part.pool_rows()
    unit_sum, unit_n = part.unit_sum, part.unit_n
    live = [g for g in range(groups) if unit_n[g] > 0] if groups >= 2 else []
    live = live if len(live) >= 2 else []
    full_types, rep_types = _types(occurrences, live)
    size = o.context_occurrences
    values = _values(
        full_types,
        _docs_value(docs, None),
        _baseline_cos(unit_sum, unit_n, None),
        _baseline_mev(pool, size, None),
    )
    reps = [
        _values(
            rep_types[r],
            _docs_value(docs, r),
            _baseline_cos(unit_sum, unit_n, r),
            _baseline_mev(pool, size, r),
        )
        for r in live
    ]
    undefined = "no type with 2 occurrences or no sentence: nothing to measure"
    ses = compute.replicate_ses(values, reps, KEYS, notes, undefined)
    entry = {
        "types": len(full_types),
        "occurrences": int(sum(len(r) for r, _ in occurrences.values())),
        "sentences": len(docs),
        "baseline_cos": _baseline_cos(unit_sum, unit_n, None),
        "baseline_mev": _baseline_mev(pool, size, None),
        "by_frequency": _by_frequency(full_types, rep_types, live, bins, o),
    }
    return values, ses, entry


def _by_frequency(
    full: dict, reps: dict, live: list[int], bins: np.ndarray | None, o: ScoreOptions
) -> list[dict]:
    """SelfSim and MEV averaged within each token-frequency bin, with jackknife SEs."""
    if bins is None:
        return []
    out = []
    for b in range(o.frequency_bins):
        members = [t for t in full if t < bins.size and bins[t] == b]
        row = {"bin": b + 1, "types": len(members)}
        for i, name in ((0, "selfsim"), (1, "mev")):
            row[name] = _mean([full[t] for t in members], i)
            rep_vals = [_mean([reps[r][t] for t in members if t in reps[r]], i) for r in live]
            row[f"{name}_se"] = compute.jackknife_se(rep_vals) if len(rep_vals) >= 2 else None
        out.append(row)
    return out


def params(o: ScoreOptions, described: dict | None) -> dict:
    if not wanted(o):
        return {}
    return {"contextuality": described}


def pool_rows(o: ScoreOptions) -> int:
    return POOL_SETS * o.context_occurrences
