"""Representational similarity between layers: linear CKA and RSA, with delete-one-group jackknife
replicates, on rows that are the same inputs in every layer.

Linear CKA (Kornblith, Norouzi, Lee & Hinton, *Similarity of Neural Network Representations
Revisited*, ICML 2019) of row sets X (n, D1) and Y (n, D2), the rows being the same n inputs:

    CKA(X, Y) = <K_c, L_c>_F / (||K_c||_F ||L_c||_F),   K_c = H X X^T H,  L_c = H Y Y^T H,

H = I - 11^T/n (HSIC's 1/(n-1)^2 cancels). It equals ||Y_c^T X_c||_F^2 / (||X_c^T X_c||_F
||Y_c^T Y_c||_F) with column-centred rows. Every layer's centred Gram matrix is flattened, and one
product M M^T of the stacked vectors gives every pair's <K_c, L_c> at once.

RSA (Kriegeskorte, Mur & Bandettini, *Representational similarity analysis*, Front. Syst.
Neurosci. 2008) with Spearman's rank correlation: each layer's representational dissimilarity
matrix is 1 - Pearson correlation between two rows' activation patterns (each row centred over its
own features); RSA(X, Y) is Spearman's rho between the two matrices' entries above the diagonal
(average ranks for ties; the dissimilarities are rounded to 12 decimals first, so that values equal
up to float64 rounding tie).

A replicate r leaves out the rows of group r: its Gram matrices are re-centred on the rows left,
its dissimilarities re-ranked among the pairs left.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError

#: the fewest rows a similarity is computed from
LEAST_ROWS = 4
#: the decimals dissimilarities are rounded to before they are ranked (ties up to float64 rounding)
DISSIMILARITY_DECIMALS = 12


def _check(samples: list[np.ndarray]) -> int:
    if not samples:
        raise DataError("no layers to compare")
    n = samples[0].shape[0]
    if any(s.shape[0] != n for s in samples):
        raise DataError("every layer must hold the same rows (the same inputs in the same order)")
    if n < LEAST_ROWS:
        raise DataError(f"{n} row(s) shared by the layers; similarities need at least {LEAST_ROWS}")
    return n


def _centred(k: np.ndarray) -> np.ndarray:
    """H K H: K less its row and column means, plus its grand mean."""
    row = k.mean(axis=1)
    return k - row[:, None] - row[None, :] + row.mean()


def _normalised_gram(m: np.ndarray) -> np.ndarray:
    """The matrix of cosines of the rows of ``m`` (a row of zeros: 0 with everything)."""
    g = m @ m.T
    d = np.sqrt(np.clip(np.diagonal(g), 0.0, None))
    d[d == 0] = np.inf
    return g / d[:, None] / d[None, :]


def _subsets(groups: np.ndarray, replicates: list[int]) -> list[np.ndarray]:
    """The rows of the full data (first) and of each replicate (every group but r)."""
    return [np.arange(groups.size)] + [np.flatnonzero(groups != r) for r in replicates]


def cka_matrices(samples: list[np.ndarray], groups: np.ndarray, replicates: list[int]) -> list[np.ndarray]:
    """Linear CKA between every pair of ``samples`` (the same rows in each), for the full data and
    each replicate r of ``replicates`` (the rows whose ``groups`` label is not r): a list of (L, L)
    matrices, the full data's first."""
    _check(samples)
    grams = [np.asarray(s, np.float64) @ np.asarray(s, np.float64).T for s in samples]
    out = []
    for rows in _subsets(np.asarray(groups), replicates):
        if rows.size < LEAST_ROWS:
            raise DataError(f"a jackknife replicate keeps {rows.size} rows; similarities need {LEAST_ROWS}")
        flat = np.stack([_centred(g[np.ix_(rows, rows)]).ravel() for g in grams])
        out.append(_normalised_gram(flat))
    return out


def _upper_ranks(r: np.ndarray) -> np.ndarray:
    """Average ranks of the entries above the diagonal of ``r``, centred and scaled to unit norm."""
    from scipy.stats import rankdata

    iu = np.triu_indices(r.shape[0], 1)
    ranks = rankdata(r[iu])
    ranks -= ranks.mean()
    norm = np.linalg.norm(ranks)
    return ranks / norm if norm > 0 else ranks


def _dissimilarity(r: np.ndarray) -> np.ndarray:
    """1 - r rounded to 12 decimals (it lies in [0, 2]): dissimilarities equal up to float64 rounding
    (the pairs of two identical rows, rows that differ by a scale) tie, whichever way they are
    computed, instead of being ranked by their rounding."""
    return np.round(1.0 - r, DISSIMILARITY_DECIMALS)


def rsa_matrices(samples: list[np.ndarray], groups: np.ndarray, replicates: list[int]) -> list[np.ndarray]:
    """Spearman RSA between every pair of ``samples`` (correlation-distance dissimilarities), for the
    full data and each replicate (as :func:`cka_matrices`)."""
    _check(samples)
    corr = []
    for s in samples:
        z = np.asarray(s, np.float64)
        z = z - z.mean(axis=1, keepdims=True)
        corr.append(_normalised_gram(z))  # Pearson correlation between rows
    out = []
    for rows in _subsets(np.asarray(groups), replicates):
        if rows.size < LEAST_ROWS:
            raise DataError(f"a jackknife replicate keeps {rows.size} rows; similarities need {LEAST_ROWS}")
        ranked = np.stack([_upper_ranks(_dissimilarity(c[np.ix_(rows, rows)])) for c in corr])
        out.append(ranked @ ranked.T)
    return out
