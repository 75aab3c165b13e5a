"""A layer's massive activations (``--metrics massive``, Sun et al. 2024): the largest |x| entries
with where they sit, and their ratio to the median |x|, from the moments pass's
:class:`~geomscope.metrics.massive.TopAbs` (or, for a ``--keep sample`` run, the one each shard
kept while extracting).

Report: ``massive_max_abs`` (the largest |x|) and ``massive_ratio`` (it over the median |x| of every
entry), and ``massive`` {k, entries [{value, dim, token_id, doc_id, position, special}], median_abs,
median_abs_bounds, ratio_bounds, first_token, special}: ``first_token`` and ``special`` count the
listed entries on a document's first position and on special tokens ([CLS], [SEP], BOS, EOS: the
run's flags). The median is the geometric midpoint of the histogram bin holding it, and its bounds
are that bin's edges (within 1.09 %). No SE: a maximum has no jackknife SE (the delete-one-group
replicates of a maximum are the maximum itself but in one of them), so the SEs are null with why.
"""

from __future__ import annotations

import math

from geomscope.score.options import ScoreOptions
from geomscope.store.sample import POSITION_BITS

KEYS = ("massive_max_abs", "massive_ratio")
NO_SE = "no standard error: the jackknife does not estimate the spread of a maximum"


def wanted(o: ScoreOptions) -> bool:
    return o.wants("massive")


def keys(o: ScoreOptions) -> list[str]:
    return list(KEYS) if wanted(o) else []


def summary(top, notes: dict) -> tuple[dict, dict | None]:
    """(the scalar values, the ``massive`` entry) of a layer's TopAbs (None: the source kept none,
    with why in ``notes``)."""
    from geomscope.errors import DataError

    if top is None or top.n == 0:
        why = notes.get("massive") or "no usable rows"
        for k in KEYS:
            notes.setdefault(k, why)
        return dict.fromkeys(KEYS), None
    entries = top.entries()
    largest = abs(entries[0]["value"])
    mask = (1 << POSITION_BITS) - 1
    listed = [
        {
            "value": e["value"],
            "dim": e["dim"],
            "token_id": None if e["token_id"] < 0 else e["token_id"],
            "doc_id": e["key"] >> POSITION_BITS,
            "position": e["key"] & mask,
            "special": e["special"],
        }
        for e in entries
    ]
    try:
        low, high = top.median_bounds()
    except DataError as e:
        low = high = None
        notes.setdefault("massive_ratio", str(e))
    median = None if low is None else math.sqrt(low * high)
    ratio = None
    if median:
        ratio = largest / median
    elif median == 0.0:
        notes.setdefault("massive_ratio", "at least half of the entries are exactly 0: the median |x| is 0")
    for k in KEYS:
        notes.setdefault(f"se.{k}", NO_SE)
    section = {
        "k": top.k,
        "entries": listed,
        "median_abs": median,
        "median_abs_bounds": None if low is None else [low, high],
        "ratio_bounds": [largest / high, largest / low] if low else None,
        "first_token": sum(e["position"] == 0 for e in listed),
        "special": sum(bool(e["special"]) for e in listed),
    }
    return {"massive_max_abs": largest, "massive_ratio": ratio}, section
