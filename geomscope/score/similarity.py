"""Similarity between the layers of a source (``--metrics similarity``): linear CKA and RSA (Spearman)
between every pair of layers, on the seeded row sample, with delete-one-group jackknife SEs.

The rows: each layer's seeded sample (the rows with the smallest ``hash(doc_id, position; seed)``,
the sample TwoNN uses: store/sample.py) holds the same (document, position) rows in every layer,
but for rows a layer drops (NaN/Inf). The rows every layer kept, in hash order, are cut to the first
``--similarity-rows``: the same inputs in every layer, in the same order. Jackknife groups: the
rows' own (document groups of a run, contiguous blocks of an array), each replicate leaving one
group's rows out (geomscope.metrics.similarity).

Report: the top-level ``similarity`` section {layers, rows, groups, cka, cka_se, rsa, rsa_se,
rsa_distance, sample} and, per layer, ``cka_prev`` and ``rsa_prev``: the similarity with the layer
before it in the report (null for the first), with SEs.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.score.options import ScoreOptions

KEYS = ("cka_prev", "rsa_prev")


def wanted(o: ScoreOptions) -> bool:
    return o.wants("similarity")


def keys(o: ScoreOptions) -> list[str]:
    return list(KEYS) if wanted(o) else []


def aligned(samples: dict, names: list[str], most: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(each layer's rows, their jackknife groups): the rows every layer's sample holds (by hash), in
    hash order, the first ``most`` of them. ``samples``: layer -> (hashes, rows, groups)."""
    common = None
    for n in names:
        h = samples[n][0]
        common = h if common is None else np.intersect1d(common, h, assume_unique=True)
    common = np.sort(common)[:most]
    rows, groups = [], None
    for n in names:
        h, x, g = samples[n]
        at = np.searchsorted(h, common)  # (each sample is sorted by hash)
        rows.append(np.asarray(x[at], np.float64))
        groups = g[at] if groups is None else groups
    return rows, groups


def _se(matrices: list[np.ndarray]) -> np.ndarray | None:
    """Element-wise jackknife SE of the replicate matrices (None with fewer than 2)."""
    if len(matrices) < 2:
        return None
    a = np.stack(matrices)
    g = a.shape[0]
    return np.sqrt((g - 1) / g * ((a - a.mean(axis=0)) ** 2).sum(axis=0))


def _rows_of(m) -> list | None:
    return None if m is None else [[float(v) for v in row] for row in m]


def jackknife_matrices(rows: list[np.ndarray], groups, o: ScoreOptions) -> dict:
    """``{rows, groups, cka, cka_se, rsa, rsa_se}`` of aligned row sets (the same inputs in each): the
    matrices of the full data and their delete-one-group jackknife SEs over the rows' ``groups``
    (null with fewer than 2 groups, or with the jackknife off)."""
    from geomscope.metrics.similarity import cka_matrices, rsa_matrices

    live = sorted(int(g) for g in np.unique(groups)) if groups is not None else []
    replicates = live if len(live) >= 2 and o.jackknife_groups >= 2 else []
    cka = cka_matrices(rows, groups, replicates)
    rsa = rsa_matrices(rows, groups, replicates)
    return {
        "rows": int(rows[0].shape[0]),
        "groups": len(replicates),
        "cka": _rows_of(cka[0]),
        "cka_se": _rows_of(_se(cka[1:])),
        "rsa": _rows_of(rsa[0]),
        "rsa_se": _rows_of(_se(rsa[1:])),
    }


def section(samples: dict, names: list[str], o: ScoreOptions) -> tuple[dict | None, str | None]:
    """(the report's ``similarity`` section, or None with why) of the layers ``names`` whose samples
    ``samples`` holds (layer -> (hashes sorted, rows, groups))."""
    missing = [n for n in names if samples.get(n) is None]
    if missing:
        return None, f"layer {missing[0]} has no sample rows"
    if len(names) < 2:
        return None, "one layer: nothing to compare it with"
    rows, groups = aligned(samples, names, o.similarity_rows)
    try:
        matrices = jackknife_matrices(rows, groups, o)
    except DataError as e:
        return None, str(e)
    return {
        "layers": list(names),
        **matrices,
        "rsa_distance": "1 - Pearson correlation of two rows; Spearman's rho between the matrices",
        "sample": (
            f"the first {o.similarity_rows} rows by hash(doc_id, position; seed {o.seed}) of the seeded "
            "sample that every layer kept: the same inputs in every layer"
        ),
    }, None


def fill_layers(entries: list[dict], sec: dict | None, why: str | None) -> None:
    """Each layer's ``cka_prev`` and ``rsa_prev`` (and their SEs) from the section, with why they are
    null where they are (the first layer has no layer before it)."""
    for i, e in enumerate(entries):
        for key, method in (("cka_prev", "cka"), ("rsa_prev", "rsa")):
            notes = e["notes"]
            notes.pop(key, None)
            if sec is None:
                notes[key] = why or "no similarity"
                continue
            if i == 0:
                notes[key] = "the first layer has no layer before it"
                continue
            e[key] = sec[method][i - 1][i]
            se = sec[f"{method}_se"]
            e["se"][key] = None if se is None else se[i - 1][i]
            if e["se"][key] is None:
                notes.setdefault(f"se.{key}", "standard error undefined: fewer than 2 jackknife groups")
            else:
                notes.pop(f"se.{key}", None)


def uncertainty(o: ScoreOptions) -> dict:
    """The report's ``params.uncertainty`` entry of the family."""
    return {
        "similarity": "delete-one-group jackknife over the sample rows' groups (each replicate re-centres "
        "the Gram matrices and re-ranks the dissimilarities on the rows it keeps)"
    }
