"""Registry of intrinsic-dimension estimators behind one interface.

``ID_ESTIMATORS[name](**params)`` builds an estimator with ``fit(X) -> self`` that sets
``dimension_`` and ``result_`` (an :class:`IDResult`). ``estimate_id(X, name, **params)`` does both.

Every estimator validates X the same way (rows are points (N, D); finite; D >= 2; optional
``expect_dim`` / ``allow_wide`` against transposed input), removes exact duplicate rows first
(``dedup=True``, counted in the result) and can run on a seeded subsample (``max_points``, ``seed``).

* ``twonn``: geomscope's exact, duplicate-safe TwoNN (:mod:`geomscope.metrics.twonn`).
* the others wrap scikit-dimension 0.5.0 (``skdim.id.<Class>(**params).fit(X).dimension_``) on the
  de-duplicated points. ESS and PH are left out (about a minute for 1,000 points), KNN too (it
  returned 1-2 on a 5-d Gaussian). Estimators with a ``random_state`` get ``seed`` (0 when None), so
  every result is reproducible.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field

from geomscope.errors import DataError, InputError
from geomscope.metrics.neighbors import two_nearest
from geomscope.metrics.twonn import (
    TwoNN,
    TwoNNError,
    TwoNNResult,
    dedup_rows,
    prepare_points,
    twonn,
    twonn_error,
)

__all__ = ["ID_ESTIMATORS", "IDResult", "SKDIM_ESTIMATORS", "TwoNN", "TwoNNError", "TwoNNResult", "dedup_rows",
           "estimate_id", "two_nearest", "twonn", "twonn_error"]

#: registry name -> scikit-dimension class name
SKDIM_ESTIMATORS = {
    "mle": "MLE", "lpca": "lPCA", "danco": "DANCo", "mada": "MADA", "corrint": "CorrInt",
    "fishers": "FisherS", "mom": "MOM", "tle": "TLE", "mind_ml": "MiND_ML", "gride": "GRIDE",
}


@dataclass
class IDResult:
    """Common result: ``dimension`` by ``estimator`` (registry name) with ``params``.

    n_points: input rows; n_duplicates_removed: exact duplicates dropped; n_used: distinct points
    the estimator saw (after subsampling and de-duplication); details: estimator-specific extras.
    """

    dimension: float
    estimator: str
    n_points: int
    n_used: int
    n_duplicates_removed: int
    params: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"dimension": float(self.dimension), "estimator": self.estimator, "n_points": self.n_points,
                "n_used": self.n_used, "n_duplicates_removed": self.n_duplicates_removed,
                "params": dict(self.params), **self.details}


class _Base:
    name = ""

    def __init__(self, dedup: bool = True, max_points: int | None = None, seed: int | None = None,
                 expect_dim: int | None = None, allow_wide: bool = True, **params):
        self.dedup, self.max_points, self.seed = dedup, max_points, seed
        self.expect_dim, self.allow_wide = expect_dim, allow_wide
        self.params = params

    def _finish(self, result: IDResult):
        if not math.isfinite(result.dimension):
            raise DataError(f"{self.name} returned {result.dimension} on these points; "
                            "check for degenerate data or try another estimator")
        self.result_ = result
        self.dimension_ = result.dimension
        self.n_duplicates_removed_ = result.n_duplicates_removed
        return self


class TwoNNEstimator(_Base):
    """``twonn``: params discard_fraction (0.1), estimator ("linear" | "mle"), block_size, device."""

    name = "twonn"

    def fit(self, X, y=None):
        p = {"discard_fraction": 0.1, "estimator": "linear", **self.params}
        unknown = set(p) - {"discard_fraction", "estimator", "block_size", "device"}
        if unknown:
            raise InputError(f"unknown twonn parameter(s) {sorted(unknown)}; "
                             "use discard_fraction, estimator, block_size, device")
        r = twonn(X, dedup=self.dedup, seed=self.seed, max_points=self.max_points,
                  expect_dim=self.expect_dim, allow_wide=self.allow_wide, **p)
        params = {"discard_fraction": r.discard_fraction, "estimator": r.estimator,
                  "f_convention": r.f_convention, "dedup": self.dedup, "max_points": self.max_points,
                  "seed": self.seed}
        return self._finish(IDResult(r.dimension, self.name, r.n_points, r.n_used, r.n_duplicates_removed,
                                     params, {"n_fit": r.n_fit}))


class SkdimEstimator(_Base):
    """A scikit-dimension estimator; ``params`` go to its constructor unchanged."""

    def __init__(self, name: str, **kw):
        self.name = name
        super().__init__(**kw)

    def fit(self, X, y=None):
        import skdim

        a, n_points, removed, sub = prepare_points(X, self.dedup, self.max_points, self.seed,
                                                   self.expect_dim, self.allow_wide)
        cls = getattr(skdim.id, SKDIM_ESTIMATORS[self.name])
        kw = dict(self.params)
        if "random_state" in inspect.signature(cls.__init__).parameters and "random_state" not in kw:
            kw["random_state"] = 0 if self.seed is None else self.seed  # deterministic by default
        try:
            est = cls(**kw)
        except TypeError as e:
            raise InputError(f"bad parameter for {self.name} (skdim.id.{cls.__name__}): {e}") from None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est.fit(a.astype("float64", copy=False))
        except (ValueError, ZeroDivisionError, FloatingPointError, IndexError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{self.name} (skdim.id.{cls.__name__}) failed on these points: {msg}; "
                            "try more points or another estimator") from None
        params = {**kw, "dedup": self.dedup, "max_points": self.max_points, "seed": self.seed,
                  "implementation": f"skdim.id.{cls.__name__}"}
        return self._finish(IDResult(float(est.dimension_), self.name, n_points, int(a.shape[0]), removed,
                                     params, {"subsampled_from": sub}))


def _skdim_factory(name: str):
    def make(**params):
        return SkdimEstimator(name, **params)

    make.__name__ = f"make_{name}"
    make.__doc__ = f"skdim.id.{SKDIM_ESTIMATORS[name]} behind the geomscope interface"
    return make


#: name -> factory(**params) -> estimator with fit(X) -> self, dimension_, result_ (IDResult)
ID_ESTIMATORS = {"twonn": TwoNNEstimator, **{n: _skdim_factory(n) for n in SKDIM_ESTIMATORS}}


def estimate_id(X, name: str = "twonn", **params) -> IDResult:
    """Intrinsic dimension of the points X (N, D) by the registered estimator ``name``.

    Common params: dedup=True, max_points=None, seed=None, expect_dim=None, allow_wide=True; the
    rest go to the estimator (twonn: discard_fraction, estimator, block_size, device; skdim
    estimators: their constructor arguments).
    """
    try:
        factory = ID_ESTIMATORS[name]
    except KeyError:
        raise InputError(f"unknown intrinsic-dimension estimator {name!r}; "
                         f"choose from {', '.join(ID_ESTIMATORS)}") from None
    return factory(**params).fit(X).result_
