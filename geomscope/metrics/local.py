"""Local isotropy (Cai, Huang, Bian & Church, *Isotropy in the Contextual Embedding Space: Clusters
and Manifolds*, ICLR 2021): a space that is anisotropic as a whole can be isotropic within its
clusters. The rows are clustered by k-means; within each cluster, IsoScore, the average cosine of
its rows as they are and after centring them on the cluster's mean (Cai et al.'s local measure), and
its intrinsic dimension (TwoNN).

- :func:`kmeans`: Lloyd's algorithm from k-means++ starts (Arthur & Vassilvitskii 2007), seeded,
  ``n_init`` starts keeping the one of least inertia, in float64; ties in assignment go to the lower
  cluster index. Deterministic for a seed.
- :func:`silhouette`: the mean silhouette (Rousseeuw 1987) s(i) = (b_i - a_i) / max(a_i, b_i), a_i the
  mean distance to the other rows of its cluster, b_i the least mean distance to another cluster's
  rows (0 for a row alone in its cluster); :func:`choose_k` picks the k of largest silhouette.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError

#: Lloyd iterations at most, and the relative change of inertia that stops them
MAX_ITER = 100
TOL = 1e-9


def _sq_dists(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances (n, k), clipped at 0 (the GEMM form's rounding)."""
    d = (x * x).sum(axis=1)[:, None] - 2.0 * x @ c.T + (c * c).sum(axis=1)[None, :]
    return np.maximum(d, 0.0)


def _plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ starting centres: the first uniformly, each next with probability proportional to
    the squared distance to the nearest chosen one."""
    centres = [x[rng.integers(len(x))]]
    d = _sq_dists(x, np.array(centres))[:, 0]
    for _ in range(1, k):
        total = d.sum()
        i = rng.choice(len(x), p=d / total) if total > 0 else rng.integers(len(x))
        centres.append(x[i])
        d = np.minimum(d, _sq_dists(x, x[i : i + 1])[:, 0])
    return np.array(centres)


def _lloyd(x: np.ndarray, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    prev = np.inf
    for _ in range(MAX_ITER):
        d = _sq_dists(x, centres)
        labels = np.argmin(d, axis=1)
        inertia = float(d[np.arange(len(x)), labels].sum())
        for j in range(len(centres)):
            members = labels == j
            if members.any():  # an emptied cluster keeps its centre
                centres[j] = x[members].mean(axis=0)
        if prev - inertia <= TOL * max(inertia, 1e-300):
            break
        prev = inertia
    d = _sq_dists(x, centres)
    labels = np.argmin(d, axis=1)
    return labels, centres, float(d[np.arange(len(x)), labels].sum())


def kmeans(x, k: int, seed: int = 0, n_init: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(labels, centres) of the rows ``x`` in ``k`` clusters: the best of ``n_init`` seeded starts."""
    a = np.asarray(x, np.float64)
    if not 2 <= k <= len(a):
        raise DataError(f"{len(a)} rows cannot make {k} clusters; k must be from 2 to the rows")
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(max(1, int(n_init))):
        labels, centres, inertia = _lloyd(a, _plus_plus(a, k, rng))
        if best is None or inertia < best[2]:
            best = (labels, centres, inertia)
    return best[0], best[1]


def silhouette(x, labels) -> float:
    """The mean silhouette of the rows ``x`` under ``labels`` (at least 2 clusters)."""
    a = np.asarray(x, np.float64)
    lab = np.asarray(labels)
    names = np.unique(lab)
    if names.size < 2:
        raise DataError("a silhouette needs at least 2 clusters")
    d = np.sqrt(_sq_dists(a, a))
    np.fill_diagonal(d, 0.0)
    s = np.zeros(len(a))
    means = np.stack([d[:, lab == c].sum(axis=1) for c in names], axis=1)  # (n, clusters) sums
    sizes = np.array([(lab == c).sum() for c in names])
    own = np.searchsorted(names, lab)
    for i in range(len(a)):
        n_own = sizes[own[i]]
        if n_own == 1:
            continue
        ai = means[i, own[i]] / (n_own - 1)
        others = np.delete(means[i] / sizes, own[i])
        bi = others.min()
        s[i] = (bi - ai) / max(ai, bi) if max(ai, bi) > 0 else 0.0
    return float(s.mean())


def choose_k(x, ks, seed: int = 0, rows: int = 1000) -> tuple[int, dict[int, float]]:
    """(the k of ``ks`` with the largest silhouette on the first ``rows`` rows, every k's silhouette)."""
    a = np.asarray(x, np.float64)[:rows]
    scores = {}
    for k in ks:
        if 2 <= k < len(a):
            labels, _ = kmeans(a, k, seed, n_init=2)
            if np.unique(labels).size >= 2:
                scores[int(k)] = silhouette(a, labels)
    if not scores:
        raise DataError(f"{len(a)} rows are too few to choose a number of clusters")
    return max(scores, key=lambda k: (scores[k], -k)), scores
