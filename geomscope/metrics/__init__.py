# ruff: noqa: F401  (this module re-exports the public API)
"""geomscope.metrics: pure metric functions and mergeable accumulators (numpy at import only).

Rows are points: every X is (N, D). torch is imported lazily inside the *_torch functions.
"""

from geomscope.metrics.cosine import (
    COSINE_VARIANTS,
    avgcos,
    avgcos_from_sum,
    avgcos_pairs,
    cosine_contributions,
    cosreg_penalty_torch,
    unit_sum,
)
from geomscope.metrics.isotropy import (
    SHRINKAGE_TARGETS,
    isoscore,
    isoscore_cap,
    isoscore_from_cov,
    isoscore_published,
    isoscore_star,
    isoscore_star_from_cov,
    isoscore_star_from_cov_torch,
    isoscore_star_torch,
    isoscore_torch,
    rank_limited,
    shrinkage_target,
)
from geomscope.metrics.moments import Moments, UnitSum
from geomscope.metrics.neighbors import two_nearest
from geomscope.metrics.outliers import (
    OUTLIER_INPUTS,
    OUTLIER_RULES,
    OutlierResult,
    outliers_magnitude,
    outliers_quantile,
    outliers_variance,
    outliers_zscore,
    rule_defaults,
)
from geomscope.metrics.partition import partition_isotropy, partition_log_z
from geomscope.metrics.spectrum import effective_rank, eigenvalues, participation_ratio, spectrum
from geomscope.metrics.twonn import TwoNNError, TwoNNResult, dedup_rows, twonn, twonn_error

# The scikit-learn-style estimators (intrinsic.py) derive from sklearn's BaseEstimator, and importing
# scikit-learn takes about a second: they load on first use, so that scoring without them (and every
# worker process a scorer spawns) does not pay for it.
_INTRINSIC = ("ID_ESTIMATORS", "IDResult", "TwoNN", "estimate_id")
_LAZY = dict.fromkeys(_INTRINSIC, "geomscope.metrics.intrinsic")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
