"""A layer's rogue dimensions (``--metrics rogue``, Timkey & van Schijndel 2021): each dimension's
share of the average cosine, from the unit-vector sums every Moments keeps.

With unit rows u = x/||x||, the average cosine over distinct pairs splits over dimensions,
avgcos = sum_d CC_d, CC_d = (S_d^2 - Q_d) / (n (n - 1)) (S = sum of unit vectors, Q = sum of their
squares: geomscope.metrics.cosine.cosine_contributions), so dimension d's share E[u_d v_d] / E[cos]
is CC_d / avgcos, exactly. The report gives, per layer, the share of the largest contributor and of
the three largest (``rogue_top1_share``, ``rogue_top3_share``), and the ten largest contributors
with their shares (``rogue_dims``); the average cosine after standardising every dimension (what
Timkey & van Schijndel propose to remove them) is ``avgcos_standardised``, which the family turns
on. SEs: the delete-one-group jackknife of the moment metrics, each replicate ranking its own
contributions (the top share is of whichever dimension leads in that replicate); a listed
dimension's ``share_se`` is the jackknife SE of that dimension's share.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.score import compute
from geomscope.score.options import ScoreOptions

KEYS = ("rogue_top1_share", "rogue_top3_share")
#: the contributors ``rogue_dims`` lists, largest first
LISTED = 10


def wanted(o: ScoreOptions) -> bool:
    return o.wants("rogue")


def keys(o: ScoreOptions) -> list[str]:
    return list(KEYS) if wanted(o) else []


def measure(m, o: ScoreOptions, c0, notes: dict) -> tuple[dict, np.ndarray | None]:
    """(the top shares, every dimension's share) of one Moments; null with why where the average
    cosine has no share (fewer than 2 rows of non-zero norm, or an average cosine of exactly 0)."""
    from geomscope.metrics.cosine import rogue_shares

    try:
        shares, _ = rogue_shares(m.sum_unit, m.n_unit(), m.sum_unit_sq)
    except DataError as e:
        for k in KEYS:
            notes.setdefault(k, str(e))
        return dict.fromkeys(KEYS), None
    top = np.sort(shares)[::-1]
    return {"rogue_top1_share": float(top[0]), "rogue_top3_share": float(top[:3].sum())}, shares


def listed(full: np.ndarray | None, replicates: list[np.ndarray | None]) -> list[dict]:
    """The ``LISTED`` largest contributors of the full data: ``{dim, share, share_se}`` (the SE null
    where a replicate has no shares, or there are fewer than 2 replicates)."""
    if full is None:
        return []
    order = np.argsort(-full, kind="stable")[:LISTED]
    out = []
    for d in order:
        reps = [None if r is None else float(r[d]) for r in replicates]
        out.append({"dim": int(d), "share": float(full[d]), "share_se": compute.jackknife_se(reps)})
    return out
