"""``PlotOptions``: what ``plot`` draws, besides its inputs and where it writes, declared once
(:mod:`geomscope.options`): ``geomscope plot --help`` is built from these fields, and
:func:`geomscope.plot.figures.plot_files` takes the same object. A light module: no matplotlib."""

from __future__ import annotations

from dataclasses import dataclass, replace

from geomscope.choices import DPI_RANGE, FIGURE_FORMATS, PLOT_KINDS
from geomscope.layers import STORED_LAYERS_HELP, layer_items
from geomscope.options import (
    POSITIVE_INT,
    Choice,
    CommaList,
    Flag,
    Interval,
    Layers,
    check,
    choice_metavar,
    option,
)

#: the resolutions of raster figures, in dots per inch
DPI = Interval(whole=True, low=DPI_RANGE[0], high=DPI_RANGE[1])
#: the resolution of a raster figure when none is asked for, in dots per inch
DEFAULT_DPI = 150
#: the format of the figures written to a directory when none is asked for
DEFAULT_FORMAT = "png"
#: the most dimensions an outlier heat map shows when none is asked for
DEFAULT_TOP_K = 40
#: the metrics drawn when the user names none (those present in the reports, in this order)
DEFAULT_METRICS = ("isoscore_star", "isoscore", "avgcos", "twonn")
KIND_LIST = CommaList("figure kinds")
METRIC_LIST = CommaList("metric names")


@dataclass(frozen=True)
class PlotOptions:
    """What ``plot`` draws, declared once (:mod:`geomscope.options`).

    The lists (``kinds``, ``metrics``, ``layers``) may be one comma string or a list of them, as the
    command line gives them; :meth:`validate` makes each a list of names. ``kinds``: the figure
    kinds (an empty list is ``auto``), checked by name where they are drawn
    (:func:`geomscope.plot.figures.resolve_kinds`); ``metrics`` None or empty: the defaults of each
    figure; ``layers`` None: every layer (:mod:`geomscope.layers`' grammar).
    """

    kinds: tuple[str, ...] | list | str = option(
        ("auto",),
        KIND_LIST,
        f"{' | '.join(PLOT_KINDS)} (repeat or comma-separate).",
        metavar="LIST",
        flag="--kind",
        short="-k",
    )
    metrics: tuple[str, ...] | list | str | None = option(
        None,
        METRIC_LIST,
        f"Metrics to draw (comma list); default {','.join(DEFAULT_METRICS)} where present. "
        "A trajectory draws any trajectory.csv column (iw_*, final_norm_*, norms_*, gradient_energy_*).",
        metavar="LIST",
        short="-m",
        optional=True,
    )
    layers: tuple[str, ...] | list | str | None = option(
        None, Layers(), STORED_LAYERS_HELP, metavar="LIST", short="-l", optional=True
    )
    fmt: str | None = option(
        None,
        Choice(FIGURE_FORMATS),
        f"Image format for DIR/ output (default {DEFAULT_FORMAT}).",
        metavar=choice_metavar(FIGURE_FORMATS),
        flag="--format",
        optional=True,
    )
    dpi: int = option(
        DEFAULT_DPI,
        DPI,
        f"Resolution of raster output, dots per inch ({DPI_RANGE[0]} to {DPI_RANGE[1]}).",
        metavar="N",
    )
    log_x: bool | None = option(
        None,
        Flag(),
        "Trajectory: log (step 0 kept) or linear step axis; default log when steps span 2 decades.",
        off="--linear-x",
        optional=True,
    )
    normalise: bool = option(False, Flag(), "Spectrum: explained-variance ratio against index / D.")
    top_k: int = option(
        DEFAULT_TOP_K, POSITIVE_INT, "Outliers: show at most this many dimensions.", metavar="N"
    )

    def validate(self) -> PlotOptions:
        """A checked copy with the lists as lists of names; OptionError (one line) naming the option
        otherwise."""
        check(self)
        metrics = None if self.metrics is None else METRIC_LIST.items(self.metrics)
        return replace(
            self,
            kinds=KIND_LIST.items(self.kinds) or ["auto"],
            metrics=metrics or None,
            layers=layer_items(self.layers) or None,
            dpi=int(self.dpi),
            top_k=int(self.top_k),
        )
