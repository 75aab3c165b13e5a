"""Eigen-spectrum summaries of a covariance matrix C (D, D).

- eigenvalues: of C, descending; small negative values from rounding are set to 0 (reported);
  a negative one beyond rounding (below -1e-4 of the largest) means C is no covariance: refused
- explained: lambda_i / sum(lambda)
- pr (participation ratio): tr(C)^2 / ||C||_F^2 = (sum lambda)^2 / sum lambda^2
  (so IsoScore = (pr - 1)/(D - 1))
- erank (effective rank, Roy & Vetterli 2007) of the covariance: exp(H(p)), p = lambda / sum(lambda),
  H = -sum p log p with 0 log 0 = 0. (Of the covariance's eigenvalues, i.e. of the SQUARED singular
  values of the centred data -- not of the singular values themselves.)
- top_k_share: sum_{i<=k} lambda_i / sum(lambda); k larger than D gives 1.0
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.metrics.validate import ZERO_VARIANCE_MESSAGE, as_covariance, check_psd, participation_terms


def _checked_cov(C) -> np.ndarray:
    c = as_covariance(C)
    if not np.trace(c) > 0:
        raise DataError(ZERO_VARIANCE_MESSAGE.format(name="the covariance", what="the spectrum"))
    return c


def eigenvalues(C) -> tuple[np.ndarray, dict]:
    """Eigenvalues of symmetric C, descending, negatives clipped to 0; and a dict describing the clip."""
    c = _checked_cov(C)
    lam = np.linalg.eigvalsh((c + c.T) / 2.0)[::-1]
    check_psd(lam)
    neg = lam < 0
    info = {"n_clipped": int(neg.sum()), "min_raw": float(lam[-1])}
    if neg.any():
        lam = np.where(neg, 0.0, lam)
    return lam, info


def participation_ratio(C) -> float:
    """tr(C)^2 / ||C||_F^2, in [1, D] for a covariance."""
    tr, fro2 = participation_terms(_checked_cov(C))
    return float(tr * tr / fro2)


def _erank(lam: np.ndarray) -> float:
    p = lam / lam.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def effective_rank(C) -> float:
    """exp(entropy of lambda / sum lambda) of the covariance eigenvalues, in [1, D]."""
    lam, _ = eigenvalues(C)
    return _erank(lam)


def spectrum(C, top_k=(1, 5, 10)) -> dict:
    """Summary of the spectrum of covariance C: see the module docstring for each key.

    Returns {eigenvalues, explained, pr, erank, erank_of, top_k_share: {k: share}, n_clipped,
    min_raw_eigenvalue, note}. ``note`` is "" unless eigenvalues were clipped or k > D.
    """
    c = _checked_cov(C)
    lam, info = eigenvalues(c)
    tr, fro2 = participation_terms(c)
    total = lam.sum()
    cum = np.cumsum(lam) / total
    d = lam.size
    notes = []
    if info["n_clipped"]:
        notes.append(
            f"{info['n_clipped']} negative eigenvalue(s) (min {info['min_raw']:.3g}, rounding) set to 0"
        )
    shares = {}
    for k in top_k:
        k = int(k)
        if k < 1:
            raise DataError(f"top-k share needs k >= 1; got {k}")
        if k > d:
            notes.append(f"top-{k} share is over all {d} dimensions")
        shares[k] = float(cum[min(k, d) - 1])
    return {
        "eigenvalues": lam,
        "explained": lam / total,
        "pr": float(tr * tr / fro2),
        "erank": _erank(lam),
        "erank_of": "covariance eigenvalues",
        "top_k_share": shares,
        "n_clipped": info["n_clipped"],
        "min_raw_eigenvalue": info["min_raw"],
        "note": "; ".join(notes),
    }
