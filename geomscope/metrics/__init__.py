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

# --- intrinsic dimension (twonn engineer adds its import line below this marker) ---
from geomscope.metrics.intrinsic import (
    ID_ESTIMATORS,
    IDResult,
    TwoNN,
    TwoNNError,
    TwoNNResult,
    dedup_rows,
    estimate_id,
    two_nearest,
    twonn,
    twonn_error,
)  # isort: skip
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
