# ruff: noqa: F401  (this module re-exports the public API)
"""geomscope.metrics: pure metric functions and mergeable accumulators (numpy at import only).

Rows are points: every X is (N, D). torch is imported lazily inside the *_torch functions.
"""

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

# --- intrinsic dimension (twonn engineer adds its import line below this marker) ---
