"""Scoring: stream a run directory (or an (N, D) array) through the metric accumulators.

Public API::

    from geomscope.score import score, ScoreOptions
    report = score("run_dir", ScoreOptions(metrics=("isoscore", "avgcos"), workers=2))

``score`` returns the report dict described in :mod:`geomscope.report` (save it with
:func:`geomscope.report.save_report`). A run is streamed ONCE through the moment accumulators; a
second streaming pass happens only for the centred / standardised average cosine, whose
definitions subtract the global mean (known after the first pass); ``--max-rows`` adds a cheap
metadata pass. No layer is ever loaded whole. How it streams, what it samples and how standard errors
are computed: see :mod:`geomscope.score.engine`, :mod:`~geomscope.score.compute`,
:mod:`geomscope.store.sample` and :mod:`~geomscope.score.idest`.
"""

from geomscope.schema import SCALAR_METRIC_NAMES as SCALAR_METRICS
from geomscope.score.options import AVGCOS_VARIANTS, CORE_METRICS, DEFAULT_METRICS, ScoreOptions


def __getattr__(name: str):
    """``score`` on first use: the options (what ``geomscope score --help`` is built from) import
    nothing heavy, the engine imports numpy."""
    if name == "score":
        from geomscope.score.engine import score

        return score
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AVGCOS_VARIANTS", "CORE_METRICS", "DEFAULT_METRICS", "SCALAR_METRICS", "ScoreOptions", "score"]
