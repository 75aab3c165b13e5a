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

from sklearn.base import BaseEstimator

from geomscope.choices import DEFAULT_DISCARD_FRACTION, SKDIM_ESTIMATORS
from geomscope.errors import DataError, InputError, first_line
from geomscope.metrics.neighbors import two_nearest
from geomscope.metrics.twonn import (
    TwoNNError,
    TwoNNResult,
    dedup_rows,
    prepare_points,
    twonn,
    twonn_error,
)

__all__ = [
    "ID_ESTIMATORS",
    "IDResult",
    "SKDIM_ESTIMATORS",
    "SkdimEstimator",
    "TwoNN",
    "TwoNNError",
    "TwoNNResult",
    "dedup_rows",
    "estimate_id",
    "two_nearest",
    "twonn",
    "twonn_error",
]


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
        return {
            "dimension": float(self.dimension),
            "estimator": self.estimator,
            "n_points": self.n_points,
            "n_used": self.n_used,
            "n_duplicates_removed": self.n_duplicates_removed,
            "params": dict(self.params),
            **self.details,
        }


class _IDEstimator(BaseEstimator):
    """The scikit-learn estimator contract shared by every intrinsic-dimension estimator.

    Parameters are set in ``__init__`` and stored unchanged (so ``get_params``, ``set_params`` and
    ``clone`` work); all checking happens in ``fit``, which returns ``self`` and sets
    ``dimension_``, ``n_duplicates_removed_`` and ``result_`` (an :class:`IDResult`).
    """

    registry_name = ""

    def _finish(self, result: IDResult):
        if not math.isfinite(result.dimension):
            raise DataError(
                f"{result.estimator} returned {result.dimension} on these points; "
                "check for degenerate data or try another estimator"
            )
        self.result_ = result
        self.dimension_ = result.dimension
        self.n_duplicates_removed_ = result.n_duplicates_removed
        return self

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = True
        tags.non_deterministic = False
        return tags


class TwoNN(_IDEstimator):
    """geomscope's exact, duplicate-safe TwoNN (:func:`geomscope.metrics.twonn.twonn`).

    ``TwoNN(discard_fraction=0.1, estimator="linear").fit(X).dimension_``; ``result_.details``
    holds the number of ratios fitted.
    """

    registry_name = "twonn"

    def __init__(
        self,
        discard_fraction: float = DEFAULT_DISCARD_FRACTION,
        estimator: str = "linear",
        dedup: bool = True,
        max_points: int | None = None,
        seed: int | None = None,
        expect_dim: int | None = None,
        allow_wide: bool = True,
        block_size: int | None = None,
        device=None,
    ):
        self.discard_fraction = discard_fraction
        self.estimator = estimator
        self.dedup = dedup
        self.max_points = max_points
        self.seed = seed
        self.expect_dim = expect_dim
        self.allow_wide = allow_wide
        self.block_size = block_size
        self.device = device

    def fit(self, X, y=None) -> TwoNN:
        r = twonn(
            X,
            discard_fraction=self.discard_fraction,
            estimator=self.estimator,
            dedup=self.dedup,
            block_size=self.block_size,
            device=self.device,
            seed=self.seed,
            max_points=self.max_points,
            expect_dim=self.expect_dim,
            allow_wide=self.allow_wide,
        )
        params = {
            "discard_fraction": r.discard_fraction,
            "estimator": r.estimator,
            "f_convention": r.f_convention,
            "dedup": self.dedup,
            "max_points": self.max_points,
            "seed": self.seed,
        }
        return self._finish(
            IDResult(
                r.dimension,
                self.registry_name,
                r.n_points,
                r.n_used,
                r.n_duplicates_removed,
                params,
                {"n_fit": r.n_fit},
            )
        )


class SkdimEstimator(_IDEstimator):
    """A scikit-dimension estimator (``skdim.id.<Class>(**params)``) on the de-duplicated points.

    ``name`` is its registry name (``mle``, ``lpca`` ...); ``params`` go to its constructor
    unchanged; one with a ``random_state`` gets ``seed`` (0 when None), so results are reproducible.
    With ``dedup=False`` duplicate rows raise DataError (as for TwoNN) instead of a silent number; a
    parameter of the wrong type raises InputError.
    """

    def __init__(
        self,
        name: str = "mle",
        params: dict | None = None,
        dedup: bool = True,
        max_points: int | None = None,
        seed: int | None = None,
        expect_dim: int | None = None,
        allow_wide: bool = True,
    ):
        self.name = name
        self.params = params
        self.dedup = dedup
        self.max_points = max_points
        self.seed = seed
        self.expect_dim = expect_dim
        self.allow_wide = allow_wide

    def _skdim_estimator(self):
        import skdim

        if self.name not in SKDIM_ESTIMATORS:
            raise InputError(
                f"unknown scikit-dimension estimator {self.name!r}; choose from {', '.join(SKDIM_ESTIMATORS)}"
            )
        cls = getattr(skdim.id, SKDIM_ESTIMATORS[self.name])
        kw = dict(self.params or {})
        if "random_state" in inspect.signature(cls.__init__).parameters and "random_state" not in kw:
            kw["random_state"] = 0 if self.seed is None else self.seed  # deterministic by default
        try:
            return cls(**kw), kw
        except TypeError as e:
            raise InputError(f"bad parameter for {self.name} (skdim.id.{cls.__name__}): {e}") from None

    def fit(self, X, y=None) -> SkdimEstimator:
        est, kw = self._skdim_estimator()
        a, n_points, removed, sub = prepare_points(
            X, self.dedup, self.max_points, self.seed, self.expect_dim, self.allow_wide
        )
        implementation = f"skdim.id.{type(est).__name__}"
        if not self.dedup:
            # scikit-dimension reads a duplicate's zero neighbour distance as a number (its MLE
            # gives 0.0 on rows repeated 4x): refused, as TwoNN refuses it
            n_dup = dedup_rows(a)[1]
            if n_dup:
                raise DataError(
                    f"{n_dup} rows of X repeat an earlier row, and with dedup=False {self.name} would "
                    "read their zero distances as data; pass dedup=True or remove the duplicates"
                )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est.fit(a.astype("float64", copy=False))
        except (ValueError, ZeroDivisionError, FloatingPointError, IndexError) as e:
            raise DataError(
                f"{self.name} ({implementation}) failed on these points: {first_line(e)}; "
                "try more points or another estimator"
            ) from None
        except TypeError as e:  # a parameter of the wrong type, e.g. tle's epsilon="x" (UFuncTypeError)
            raise InputError(
                f"bad parameter for {self.name} ({implementation}): {first_line(e)}; "
                f"check the types of {', '.join(sorted(kw)) or 'its parameters'}"
            ) from None
        params = {
            **kw,
            "dedup": self.dedup,
            "max_points": self.max_points,
            "seed": self.seed,
            "implementation": implementation,
        }
        return self._finish(
            IDResult(
                float(est.dimension_),
                self.name,
                n_points,
                int(a.shape[0]),
                removed,
                params,
                {"subsampled_from": sub},
            )
        )


#: parameters every estimator takes; the rest are the estimator's own
COMMON_PARAMS = ("dedup", "max_points", "seed", "expect_dim", "allow_wide")


def _skdim_factory(name: str):
    def make(**params) -> SkdimEstimator:
        common = {k: params.pop(k) for k in COMMON_PARAMS if k in params}
        return SkdimEstimator(name, params, **common)

    make.__name__ = f"make_{name}"
    make.__doc__ = f"skdim.id.{SKDIM_ESTIMATORS[name]} behind the geomscope interface"
    return make


#: name -> factory(**params) -> a scikit-learn estimator with fit(X) -> self, dimension_, result_
ID_ESTIMATORS = {"twonn": TwoNN, **{n: _skdim_factory(n) for n in SKDIM_ESTIMATORS}}


def estimate_id(X, name: str = "twonn", **params) -> IDResult:
    """Intrinsic dimension of the points X (N, D) by the registered estimator ``name``.

    Common params: dedup=True, max_points=None, seed=None, expect_dim=None, allow_wide=True; the
    rest go to the estimator (twonn: discard_fraction, estimator, block_size, device; skdim
    estimators: their constructor arguments).
    """
    try:
        factory = ID_ESTIMATORS[name]
    except KeyError:
        raise InputError(
            f"unknown intrinsic-dimension estimator {name!r}; choose from {', '.join(ID_ESTIMATORS)}"
        ) from None
    try:
        estimator = factory(**params)
    except TypeError as e:
        raise InputError(f"bad parameter for {name}: {e}") from None
    return estimator.fit(X).result_
