"""Studies across fine-tuning runs: a grid of runs (:mod:`~geomscope.study.sweep`) and the
comparison of isotropy with accuracy (:mod:`~geomscope.study.compare`, :mod:`~geomscope.study.stats`)."""

from geomscope.study.compare import compare
from geomscope.study.sweep import grid, run_sweep

__all__ = ["compare", "grid", "run_sweep"]
