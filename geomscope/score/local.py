"""A layer's local isotropy (``--metrics local``, Cai et al. 2021), on its seeded row sample (the
sample TwoNN uses, ``--id-sample`` rows): k-means clusters (``--clusters``, or the k in 2..8 of
largest silhouette on the first 1000 rows), and within each cluster IsoScore, the average cosine of
its rows, the average cosine after centring them on the cluster's mean, and TwoNN
(geomscope.metrics.local). The layer's values (``local_isoscore``, ``local_avgcos``,
``local_avgcos_centred``, ``local_twonn``) are the cluster-size-weighted means over the clusters
where the metric is defined; ``layers[].local`` lists the clusters.

SEs: delete-one-group jackknife over the sample rows' document groups with the clusters held fixed
(each replicate recomputes every cluster's metrics from its rows outside the group): the SE of the
local metrics given the clustering, not of the clustering itself.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.score import compute
from geomscope.score.options import ScoreOptions

KEYS = ("local_isoscore", "local_avgcos", "local_avgcos_centred", "local_twonn")
#: the numbers of clusters ``--clusters 0`` chooses among
AUTO_KS = tuple(range(2, 9))


def wanted(o: ScoreOptions) -> bool:
    return o.wants("local")


def keys(o: ScoreOptions) -> list[str]:
    return list(KEYS) if wanted(o) else []


def cluster_values(x: np.ndarray, o: ScoreOptions) -> dict:
    """IsoScore, the average cosine (as is and centred) and TwoNN of one cluster's rows (None where
    undefined: too few rows, no variance, too few distinct points)."""
    from geomscope.metrics import avgcos, isoscore
    from geomscope.metrics.twonn import twonn

    def value(fn):
        try:
            return float(fn())
        except DataError:
            return None

    return {
        "n": int(len(x)),
        "isoscore": value(lambda: isoscore(x)),
        "avgcos": value(lambda: avgcos(x, "plain")),
        "avgcos_centred": value(lambda: avgcos(x, "centred")),
        "twonn": value(
            lambda: twonn(x, discard_fraction=o.discard_fraction, estimator=o.twonn_fit).dimension
        ),
    }


def _weighted(clusters: list[dict]) -> dict:
    """Each metric's cluster-size-weighted mean over the clusters where it is defined."""
    out = {}
    for key, name in zip(KEYS, ("isoscore", "avgcos", "avgcos_centred", "twonn"), strict=True):
        pairs = [(c["n"], c[name]) for c in clusters if c[name] is not None]
        weight = sum(n for n, _ in pairs)
        out[key] = sum(n * v for n, v in pairs) / weight if weight else None
    return out


def summary(sample, groups, o: ScoreOptions, notes: dict) -> tuple[dict, dict, dict | None]:
    """(values, SEs, the layer's ``local`` entry) of the sample rows ``sample`` with their jackknife
    ``groups``."""
    from geomscope.metrics.local import choose_k, kmeans

    if sample is None or len(sample) < 4:
        why = f"{0 if sample is None else len(sample)} sample row(s); local isotropy needs clusters of rows"
        for k in KEYS:
            notes.setdefault(k, why)
        return dict.fromkeys(KEYS), dict.fromkeys(KEYS), None
    x = np.asarray(sample, np.float64)
    try:
        if o.clusters:
            k, scores = o.clusters, None
        else:
            k, scores = choose_k(x, AUTO_KS, o.seed)
        labels, _ = kmeans(x, k, o.seed)
    except DataError as e:
        for key in KEYS:
            notes.setdefault(key, str(e))
        return dict.fromkeys(KEYS), dict.fromkeys(KEYS), None
    clusters = [cluster_values(x[labels == c], o) for c in range(k)]
    values = _weighted(clusters)
    g = np.asarray(groups) if groups is not None else np.zeros(len(x), np.int64)
    live = sorted(int(v) for v in np.unique(g)) if o.jackknife_groups >= 2 else []
    reps = []
    if len(live) >= 2:
        for r in live:
            keep = g != r
            reps.append(_weighted([cluster_values(x[keep & (labels == c)], o) for c in range(k)]))
    undefined = "undefined in every cluster (too few rows or no variance)"
    ses = compute.replicate_ses(values, reps, KEYS, notes, undefined)
    entry = {
        "k": int(k),
        "chosen_by": "given (--clusters)"
        if o.clusters
        else "largest silhouette on the first 1000 sample rows",
        "silhouette": None if scores is None else {str(kk): v for kk, v in scores.items()},
        "rows": int(len(x)),
        "clusters": clusters,
    }
    return values, ses, entry
