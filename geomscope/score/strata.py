"""Moment metrics by token-frequency bin and by position bin (``--metrics stratified``): is a layer's
anisotropy a frequency effect, or a position effect?

- Frequency bins: the token types, most frequent first, are cut into ``--frequency-bins`` B bins of
  about equal token mass: a type goes to bin floor(B x (occurrences of the more frequent types) /
  (all occurrences)), so bin 1 holds the few most frequent types and bin B the many rare ones (a
  type that alone holds more than 1/B of the tokens leaves the bins after it fewer tokens, or none).
  Counts come from the run itself (a metadata pass over every row's token id) or from
  ``--token-counts FILE`` (a .json ``{token_id: count}`` or a .npy of counts indexed by token id:
  the corpus a model was trained on, say); a token the file does not count is rarest (bin B).
- Position bins: ``--position-edges`` e_1 < e_2 < ... cut positions into [0, e_1), [e_1, e_2), ...,
  [e_last, inf): by default the first token alone, then 1-7, 8-31, 32-127, 128 and beyond.

Per layer and bin the moments pass keeps one Moments per jackknife group (rows routed by their bin
and document group), so each bin's IsoScore, IsoScore* and average cosine (``freq<b>_<metric>``,
``pos<b>_<metric>``) is exact and has the delete-one-group jackknife SE of the layer's own metrics.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from geomscope.errors import InputError
from geomscope.score import compute
from geomscope.score.options import ScoreOptions

METRICS = ("isoscore", "isoscore_star", "avgcos")
KINDS = (("frequency", "freq"), ("position", "pos"))


def wanted(o: ScoreOptions) -> bool:
    return o.wants("stratified")


def n_bins(o: ScoreOptions) -> dict[str, int]:
    return {"frequency": o.frequency_bins, "position": len(o.position_edges) + 1}


def keys(o: ScoreOptions) -> list[str]:
    if not wanted(o):
        return []
    bins = n_bins(o)
    return [f"{short}{b}_{m}" for kind, short in KINDS for b in range(1, bins[kind] + 1) for m in METRICS]


# ----------------------------------------------------------------------------- frequency bins
def read_counts(path: str) -> np.ndarray:
    """Token counts indexed by token id from a .npy (1-D whole numbers) or a .json
    ``{token_id: count}``; InputError (one line) otherwise."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--token-counts {path} is not a file; give a .json {{token_id: count}} or a .npy")
    try:
        if p.suffix.lower() == ".npy":
            counts = np.load(p, allow_pickle=False)
        else:
            from geomscope.fileio import read_json

            data = read_json(p)
            if not isinstance(data, dict) or not all(re.fullmatch(r"[0-9]+", str(k)) for k in data):
                raise ValueError("not an object of token ids")
            ids = np.array([int(k) for k in data], np.int64)
            counts = np.zeros(int(ids.max()) + 1 if ids.size else 0, np.int64)
            counts[ids] = [data[k] for k in data]
    except (OSError, ValueError, TypeError, OverflowError) as e:
        raise InputError(
            f"--token-counts {path} is no table of counts ({str(e).splitlines()[0][:120]}); give a .json "
            "{token_id: count} or a .npy of counts indexed by token id"
        ) from None
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.dtype.kind not in "iuf" or not np.isfinite(counts).all():
        raise InputError(f"--token-counts {path} must hold one whole number per token id")
    if (counts < 0).any() or (counts != np.round(counts)).any() or counts.size > 2**31:
        raise InputError(f"--token-counts {path} holds a count that is not a whole number >= 0")
    return counts.astype(np.int64)


def frequency_bins(counts: np.ndarray, bins: int) -> tuple[np.ndarray, list[dict]]:
    """(the bin of every token id, 0-based; the bins' descriptions): the types by count, most frequent
    first (ties by id), cut at equal shares of the occurrences; a type never counted is in the last."""
    counts = np.asarray(counts, np.int64)
    order = np.lexsort((np.arange(counts.size), -counts))
    order = order[counts[order] > 0]
    total = int(counts.sum())
    bin_of = np.full(counts.size, bins - 1, np.int16)
    if total:
        before = np.cumsum(counts[order]) - counts[order]
        bin_of[order] = np.minimum(bins - 1, before * bins // total).astype(np.int16)
    out = []
    for b in range(bins):
        types = order[bin_of[order] == b]
        c = counts[types]
        out.append(
            {
                "bin": b + 1,
                "types": int(types.size),
                "tokens": int(c.sum()),
                "counts": [int(c.min()), int(c.max())] if c.size else None,
            }
        )
    return bin_of, out


def position_bins(edges) -> list[dict]:
    """The position bins' descriptions: [0, e_1), [e_1, e_2), ..., [e_last, null)."""
    lows = [0, *edges]
    highs = [*edges, None]
    return [{"bin": i + 1, "positions": [lo, hi]} for i, (lo, hi) in enumerate(zip(lows, highs, strict=True))]


# ----------------------------------------------------------------------------- per layer
def summary(parts: dict | None, o: ScoreOptions, c0, groups: int, notes: dict) -> tuple[dict, dict]:
    """(the scalar values, the layer's ``strata`` entry {kind: [{bin, rows}]}) from its bins'
    accumulators (``parts``: kind -> B x G Moments, bin-major), with jackknife SEs under ``se``."""
    values, ses, listed = {}, {}, {}
    sub = replace(o, metrics=METRICS, avgcos_variants=("plain",))
    for kind, short in KINDS:
        accs = (parts or {}).get(kind)
        listed[kind] = []
        for b in range(n_bins(o)[kind]):
            names = {m: f"{short}{b + 1}_{m}" for m in METRICS}
            if accs is None:
                for name in names.values():
                    values[name] = None
                    notes.setdefault(name, notes.get("strata", "no rows of this layer in any bin"))
                continue
            bin_groups = accs[b * groups : (b + 1) * groups]
            full = compute.merged(bin_groups)
            listed[kind].append({"bin": b + 1, "rows": int(full.n)})
            why: dict = {}
            got = compute.moment_values(full, sub, c0, why, full=True) if full.n >= 2 else {}
            live = compute.nonempty(bin_groups) if groups >= 2 else []
            reps = [
                compute.moment_values(compute.merged(bin_groups, skip=r), sub, c0, {}, full=False)
                for r in live
            ]
            for m, name in names.items():
                values[name] = got.get(m)
                if values[name] is None:
                    notes.setdefault(
                        name, why.get(m) or why.get("covariance") or f"{full.n} row(s) in this bin"
                    )
                ses[name] = compute.jackknife_se([r.get(m) for r in reps]) if len(live) >= 2 else None
    return {"values": values, "se": ses}, listed


def params(o: ScoreOptions, described: dict | None) -> dict:
    """The report's ``params.strata`` (only when requested)."""
    if not wanted(o):
        return {}
    return {"strata": described}
