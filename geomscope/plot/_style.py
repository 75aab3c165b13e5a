"""Figure factory, colour-blind-safe palette and the metric titles (with their variants) shared by the
figure kinds.

Figures are :class:`matplotlib.figure.Figure` objects attached to an explicit Agg canvas: nothing
goes through pyplot's global figure registry, so no state leaks between figures.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Okabe & Ito (2008) colour-blind-safe qualitative palette (black last)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
#: sequential, perceptually uniform and colour-blind safe: used for depth (layer index)
DEPTH_CMAP = "viridis"
#: the line style of gradient layers (``layer_06.grad``), told from their activations' solid lines
GRAD_LINESTYLE = "--"


def plain_text(text) -> str:
    """``text`` as matplotlib draws it literally: every ``$`` escaped as ``\\$``.

    Matplotlib reads a string with an even number of unescaped ``$`` as mathtext: a model, layer,
    dataset or file name from a report such as ``exp$A$`` would be drawn with an italic A, and
    ``$\\foo{$`` stops the drawing with a parse error.  Pass every string that comes from data
    (reports, logs, the caller) through this once, where it becomes a title, label, tick, legend
    entry or caption; the figure's own wording has no ``$``.  (Applied twice, a ``$`` shows a
    backslash before it.)
    """
    return str(text).replace("$", r"\$")


def gradient_key(color: str = "0.3") -> list:
    """Legend entries that say which line style is which where activation and gradient layers
    share an axis: solid activations, :data:`GRAD_LINESTYLE` gradients."""
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], color=color, linestyle="-", label="activations"),
        Line2D([], [], color=color, linestyle=GRAD_LINESTYLE, label="gradients (.grad)"),
    ]


def depth_cmap():
    """viridis without its palest 8 % (pale yellow lines vanish on white)."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    return ListedColormap(colormaps[DEPTH_CMAP](np.linspace(0.0, 0.92, 256)), name="viridis_depth")


def depth_norm(depths, min_span: float = 1):
    """The colour scale of lines coloured by depth: from the least of ``depths`` to the greatest, over
    at least ``min_span`` (one layer alone, or layers of one depth, still get a range)."""
    from matplotlib.colors import Normalize

    low = min(depths)
    return Normalize(vmin=low, vmax=max(max(depths), low + min_span))


def depth_colorbar(fig: Figure, axes, norm, cmap, label: str = "layer index (depth)", whole: bool = True):
    """The one colorbar of lines coloured by depth (``cmap`` over ``norm``), beside every panel of the
    2-D array ``axes``; ticks at whole numbers where depth is a layer index (``whole``)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.ticker import MaxNLocator

    cbar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes.ravel().tolist(), shrink=0.9, pad=0.02)
    cbar.set_label(label)
    if whole:
        cbar.locator = MaxNLocator(integer=True)
        cbar.update_ticks()


RC = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
}


def styled(fn):
    """Run a figure function under :data:`RC` (a local rc_context: the global rcParams are untouched)."""
    import functools

    from matplotlib import rc_context

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with rc_context(RC):
            return fn(*args, **kwargs)

    return wrapper


def new_figure(width: float, height: float) -> Figure:
    """A constrained-layout Figure on its own Agg canvas (never registered with pyplot)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def panels(ax, n: int, width: float, height: float, *, max_cols: int = 3, rows_only: bool = False, **kw):
    """The Axes a figure function draws its ``n`` panels on, as ``(figure, 2-D array of Axes, own)``.

    ``ax=None``: a new figure of ``width`` x ``height`` inches with a grid of subplots (one column
    when ``rows_only``), ``own=True`` -- the function adds its titles, legend and caption.  Otherwise
    the caller's Axes (one Axes when ``n == 1``, or a sequence of ``n``), in a row, and ``own=False``:
    the function draws into them and leaves the caller's figure its own title and layout.
    """
    import numpy as np
    from matplotlib.axes import Axes

    from geomscope.errors import InputError

    if ax is None:
        nrows, ncols = (n, 1) if rows_only else grid_shape(n, max_cols)
        fig = new_figure(width, height)
        return fig, fig.subplots(nrows, ncols, squeeze=False, **kw), True
    given = [ax] if isinstance(ax, Axes) else list(np.asarray(ax, dtype=object).ravel())
    if len(given) != n or not all(isinstance(a, Axes) for a in given):
        raise InputError(f"ax: this figure draws {n} panel(s); pass {n} matplotlib Axes (got {len(given)})")
    out = np.empty((1, n), dtype=object)
    out[0, :] = given
    return given[0].figure, out, False


def series_style(i: int) -> dict:
    """Colour, line style and marker of the i-th series (distinct for the first 32)."""
    return {
        "color": PALETTE[i % len(PALETTE)],
        "linestyle": LINESTYLES[(i // len(PALETTE)) % len(LINESTYLES)],
        "marker": MARKERS[i % len(MARKERS)],
    }


def layer_errorbar(ax, x, y, se, label: str, style: dict, *, size: float, width: float, bar: float, **kw):
    """One series over the layers with its SE bars (none where every SE is NaN), labelled as plain
    text: markers of ``size``, a line ``width`` wide, bars without caps ``bar`` wide."""
    import numpy as np

    return ax.errorbar(
        x,
        y,
        yerr=None if np.all(np.isnan(se)) else se,
        label=plain_text(label),
        markersize=size,
        linewidth=width,
        capsize=0,
        elinewidth=bar,
        **kw,
        **style,
    )


def grid_shape(n: int, max_cols: int = 3) -> tuple[int, int]:
    """(rows, cols) of a panel grid for n panels: one row up to 3, then 2 x 2, then rows of 3."""
    cols = n if n <= max_cols else (2 if n == 4 else max_cols)
    return (n + cols - 1) // cols, cols


def hide_spare_panels(axes, n: int) -> None:
    """Hide the panels of the 2-D array ``axes`` after the first ``n`` (the grid's last row may have
    room to spare)."""
    nrows, ncols = axes.shape
    for k in range(n, nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)


def wrap_title(text: str, width: int = 42) -> str:
    """Break a long ``name (variant)`` title before the parenthesis so it stays over its panel."""
    if len(text) <= width or " (" not in text:
        return text
    head, _, rest = text.partition(" (")
    return f"{head}\n({rest}"


def step_formatter(value: float, _pos=None) -> str:
    """Tick label of a training step: 0, 500, 30k, 1.5M."""
    v = abs(value)
    if v >= 1e6:
        return f"{value / 1e6:g}M"
    if v >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def _short_target(target) -> str:
    t = str(target)
    if ":" in t:
        kind, _, rest = t.partition(":")
        if kind in ("file", "run"):
            return f"{kind}:{os.path.basename(os.path.normpath(rest)) or rest}"
    return t


def _pct(x) -> str:
    return f"{100 * float(x):g}%"


_NAMES = {
    "isoscore_star": "IsoScore*",
    "isoscore": "IsoScore",
    "avgcos": "avg cosine (plain)",
    "avgcos_centred": "avg cosine (centred)",
    "avgcos_standardised": "avg cosine (standardised)",
    "pr": "participation ratio (Σλ)²/Σλ²",
    "erank": "effective rank exp H(λ/Σλ)",
    "twonn": "TwoNN intrinsic dimension",
}


def metric_name(metric: str) -> str:
    """Human name of a metric (without parameters)."""
    if metric in _NAMES:
        return _NAMES[metric]
    if metric.startswith("id_") and len(metric) > 3:
        return f"{metric[3:]} intrinsic dimension"
    if metric.startswith("top") and metric.endswith("_share") and metric[3:-6].isdigit():
        return f"top-{metric[3:-6]} variance share"
    return metric


def metric_variant(metric: str, params: dict | None) -> str:
    """The parameters that define this metric's variant in a report, e.g. ``ζ=0.2, target=trace``."""
    p = params or {}
    parts = []
    if metric == "isoscore_star":
        if p.get("zeta") is not None:
            parts.append(f"ζ={float(p['zeta']):g}")
        if p.get("target") is not None:
            parts.append(f"target={_short_target(p['target'])}")
    elif metric == "twonn" or metric.startswith("id_"):
        fit = p.get("twonn_fit") if metric == "twonn" else None
        if fit == "mle":
            parts.append("MLE")
        elif fit is not None:
            parts.append(f"{fit} fit")
        if metric == "twonn" and fit != "mle" and p.get("discard_fraction") is not None:
            parts.append(f"discard {_pct(p['discard_fraction'])}")
        if p.get("id_sample") is not None:
            parts.append(f"sample {p['id_sample']}")
    return ", ".join(parts)


def metric_title(metric: str, params: dict | None) -> str:
    """``name (variant)``, e.g. ``IsoScore* (ζ=0.2, target=trace)``."""
    var = metric_variant(metric, params)
    return wrap_title(f"{metric_name(metric)} ({var})" if var else metric_name(metric))


def _is_id(metric: str) -> bool:
    return metric == "twonn" or metric.startswith("id_")


def uncertainty_caption(reports: Sequence[dict], metrics: Sequence[str]) -> str:
    """One caption line saying what the error bars are, from ``params.uncertainty`` (key
    ``moments`` for the moment-based metrics, the metric's own key for intrinsic dimensions)."""
    methods = []
    for rep in reports:
        unc = (rep.get("params") or {}).get("uncertainty") or {}
        keys = (["moments"] if any(not _is_id(m) for m in metrics) else []) + [
            m for m in metrics if _is_id(m)
        ]
        for key in keys:
            if unc.get(key):
                name = "moment metrics" if key == "moments" else metric_name(key).split(" (")[0]
                if key == "twonn":
                    name = "TwoNN"
                text = f"{name}: {unc[key]}"
                if text not in methods:
                    methods.append(text)
    body = "; ".join(methods) if methods else "method not recorded in the report"
    return "Error bars: ±1 standard error (" + body + ")."


def add_caption(fig: Figure, text: str, width_chars: int | None = None) -> None:
    """A small caption under the axes (part of the constrained layout), wrapped to the figure width.
    ``text`` is plain (names from the reports as they are): it is escaped here, once."""
    width = width_chars or max(40, int(fig.get_figwidth() * 17))
    fig.supxlabel(plain_text("\n".join(textwrap.wrap(text, width))), fontsize=7.5, color="0.3")
