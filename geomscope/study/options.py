"""``CompareOptions``: how ``compare`` relates isotropy to accuracy, besides the runs it reads and
where it writes, declared once (:mod:`geomscope.options`): ``geomscope compare --help`` is built from
these fields, and :func:`geomscope.study.compare.compare` takes the same object. A light module: no
numpy."""

from __future__ import annotations

from dataclasses import dataclass

from geomscope.options import SEED, SEED_RANGE, Flag, Interval, check, option

#: the fewest bootstrap resamples of an interval
MIN_BOOTSTRAP = 100
#: the bootstrap resamples of an interval when none are asked for
DEFAULT_BOOTSTRAP = 2000


@dataclass(frozen=True)
class CompareOptions:
    """How ``compare`` relates isotropy to accuracy, declared once (:mod:`geomscope.options`).
    ``n_boot`` resamples give each interval (the correlations' and the figure's fit band), drawn
    with ``seed``."""

    allow_mixed: bool = option(False, Flag(), "Compare runs of different models or eval sets.")
    n_boot: int = option(
        DEFAULT_BOOTSTRAP,
        Interval(whole=True, low=MIN_BOOTSTRAP),
        f"Bootstrap resamples of each interval (at least {MIN_BOOTSTRAP}).",
        metavar="N",
        flag="--bootstrap",
    )
    seed: int = option(0, SEED, f"Seed of the bootstrap: {SEED_RANGE}.", metavar="N")

    def validate(self) -> CompareOptions:
        """``self`` when every option meets its declaration; OptionError (one line) naming the
        option otherwise."""
        check(self)
        return self
