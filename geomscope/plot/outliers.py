"""Outlier dimensions: a layer x dimension heat map of the per-dimension outlier statistic, with the
dimensions flagged under the report's rule marked."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from geomscope.errors import InputError
from geomscope.formatting import shown_name
from geomscope.options import check_value
from geomscope.plot._reports import layer_key, report_labels, report_name, select_layers
from geomscope.plot._style import panels, plain_text, styled
from geomscope.plot.options import DEFAULT_TOP_K, PlotOptions

HEAT_CMAP = "cividis"  # designed for colour-vision deficiency


def has_outlier_statistic(rep: dict) -> bool:
    return any(
        isinstance(lay.get("outlier_statistic"), list) and lay["outlier_statistic"] for lay in rep["layers"]
    )


def outlier_matrix(
    rep: dict, top_k: int | None = DEFAULT_TOP_K, *, relative: bool = False
) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
    """(stat, layer names, dims shown, flagged) for one report.

    ``stat`` is (layers, dims shown): the ``outlier_statistic`` of each layer that has one, in
    depth order.  When D > ``top_k``, the dims shown are the ``top_k`` with the largest
    statistic relative to their layer (max over layers of stat / mean |stat| of that layer), the
    flagged ``outliers`` first; they are drawn in ascending dimension order.  ``flagged`` is a
    boolean mask of the same shape as ``stat``.  ``relative=True`` divides each layer's statistic
    by its mean over all D dimensions (for the ``variance`` rule: the multiple of the mean
    variance that the threshold is stated in).
    """
    rows = [
        (layer_key(lay, pos), lay)
        for pos, lay in enumerate(rep["layers"])
        if isinstance(lay.get("outlier_statistic"), list) and lay["outlier_statistic"]
    ]
    rows.sort(key=lambda t: t[0])
    widths = {len(lay["outlier_statistic"]) for _, lay in rows}
    if len(widths) != 1:
        raise InputError(
            f"{report_name(rep)}: outlier_statistic lengths differ across layers {sorted(widths)}; "
            "rescore the run"
        )
    stat = np.array(
        [[np.nan if v is None else float(v) for v in lay["outlier_statistic"]] for _, lay in rows]
    )
    n_layers, d = stat.shape
    flagged_full = np.zeros_like(stat, dtype=bool)
    for r, (_, lay) in enumerate(rows):
        for dim in lay.get("outliers") or []:
            if isinstance(dim, int) and 0 <= dim < d:
                flagged_full[r, dim] = True
    scale = np.nanmean(np.abs(stat), axis=1, keepdims=True)
    scale[~(scale > 0)] = 1.0
    dims = np.arange(d)
    if top_k is not None and d > top_k:
        score = np.nanmax(np.where(np.isfinite(stat), stat / scale, -np.inf), axis=0)
        priority = flagged_full.any(axis=0).astype(float)
        order = np.lexsort((-score, -priority))  # flagged first, then by relative statistic
        dims = np.sort(order[:top_k])
    shown = stat[:, dims] / scale if relative else stat[:, dims]
    return shown, [lay["layer"] for _, lay in rows], dims, flagged_full[:, dims]


_STAT_NAMES = {
    "variance": "variance",
    "zscore": "statistic",
    "quantile": "median |x_d|",
    "magnitude": "fraction of tokens over threshold",
}


def _relative_for(rep: dict, relative: bool | None) -> bool:
    """Per-layer normalisation: as asked, else on except for the ``magnitude`` rule (whose statistic,
    a fraction of tokens, is already comparable across layers)."""
    if relative is not None:
        return relative
    return (rep.get("params") or {}).get("outlier_rule") != "magnitude"


def _rule_text(params: dict | None) -> str:
    p = params or {}
    rule, thr = p.get("outlier_rule"), p.get("outlier_threshold")
    if rule is None:
        return "outlier statistic"
    return f"rule={rule}" + (f", threshold={float(thr):g}" if thr is not None else "")


@styled
def plot_outliers(
    reports: Sequence[dict],
    *,
    layers: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    top_k: int | None = DEFAULT_TOP_K,
    relative: bool | None = None,
    ax=None,
) -> Figure:
    """Heat map of ``layers[].outlier_statistic`` (rows: layers, columns: dimensions), one panel per
    report, with the dimensions in ``layers[].outliers`` marked by a dot.  When the hidden size
    exceeds ``top_k`` only the top-K dimensions are shown, and the panel title says so.  With
    ``relative`` (default: every rule but ``magnitude``) each layer's statistic is divided by its
    mean over all dimensions, so layers of different scale share one colour scale (for the
    ``variance`` rule the threshold k is marked on the colorbar); raw values get a log colour scale
    when positive and spanning more than two decades.  A report whose layers have several widths (a
    run of ``extract --modules``) takes one panel per width.  ``ax``: draw into these Axes (one per
    panel) of the caller's figure and return that figure.
    """
    reports = select_layers(reports, layers)
    missing = [report_name(r) for r in reports if not has_outlier_statistic(r)]
    if missing:
        raise InputError(
            f"{missing[0]} has no outlier_statistic; rescore it with --metrics including outliers"
        )
    if top_k is not None:  # None: every dimension (a library call's choice)
        check_value(PlotOptions, "top_k", top_k)
    labels = list(labels) if labels is not None else report_labels(reports)
    reports, labels = _by_width(reports, labels)
    relatives = [_relative_for(r, relative) for r in reports]
    matrices = [outlier_matrix(r, top_k, relative=q) for r, q in zip(reports, relatives, strict=True)]
    width = min(13.0, max(6.0, 0.2 * max(m[2].size for m in matrices) + 3.0))
    heights = [max(1.6, 0.24 * m[0].shape[0] + 1.3) for m in matrices]
    extra = {"rows_only": True, "height_ratios": heights} if ax is None else {}
    fig, grid, own = panels(ax, len(reports), width, sum(heights) + 0.7, **extra)
    axes = grid.ravel()
    scale_values = _scale_values(reports, relatives, matrices)
    for k, (panel, rep) in enumerate(zip(axes, reports, strict=True)):
        norm = _heat_norm(scale_values[k], relatives[k])
        _draw_heatmap(fig, panel, rep, labels[k], matrices[k], norm, relatives[k])
    marker = Line2D(
        [],
        [],
        linestyle="none",
        marker="o",
        markerfacecolor="white",
        markeredgecolor="black",
        markersize=5,
        label="flagged outlier dimension",
    )
    if not own:
        axes[0].legend(handles=[marker], loc="upper right", fontsize=7)
        return fig
    fig.legend(handles=[marker], loc="outside lower right", frameon=False)
    fig.suptitle("Outlier dimensions by layer", fontsize=11)
    return fig


def _by_width(reports: Sequence[dict], labels: list[str]) -> tuple[list[dict], list[str]]:
    """The reports and their labels, each report whose layers' outlier statistics have several
    widths (a dimension of one width is no dimension of another) cut into one report per width,
    labelled with it; a report of one width as it is."""
    out, named = [], []
    for rep, label in zip(reports, labels, strict=True):
        stats = [lay.get("outlier_statistic") for lay in rep["layers"]]
        widths = sorted({len(v) for v in stats if isinstance(v, list) and v})
        if len(widths) <= 1:
            out.append(rep)
            named.append(label)
            continue
        for w in widths:
            kept = [
                lay
                for lay, v in zip(rep["layers"], stats, strict=True)
                if isinstance(v, list) and len(v) == w
            ]
            out.append({**rep, "layers": kept})
            named.append(f"{label}, {w} wide")
    return out, named


def _scale_values(reports: Sequence[dict], relatives: Sequence[bool], matrices) -> list[np.ndarray]:
    """The finite values each panel's colour scale spans: all panels' together when they show the
    same quantity (one rule, all relative or all raw: e.g. checkpoints of a model), else its own."""
    rules = {
        (q, (r.get("params") or {}).get("outlier_rule")) for r, q in zip(reports, relatives, strict=True)
    }
    each = [m[0][np.isfinite(m[0])] for m in matrices]
    return [np.concatenate(each)] * len(each) if len(rules) == 1 else each


def _heat_norm(finite: np.ndarray, relative: bool) -> Normalize:
    """The colour scale over the ``finite`` values: logarithmic for raw values, all positive and
    spanning more than two decades, else linear (0 to 1 when there are none)."""
    pos = finite[finite > 0]
    if not relative and finite.size and pos.size == finite.size and finite.max() / finite.min() > 100:
        return LogNorm(vmin=finite.min(), vmax=finite.max())
    return Normalize(vmin=finite.min() if finite.size else 0, vmax=finite.max() if finite.size else 1)


def _draw_heatmap(fig: Figure, ax, rep: dict, label: str, matrix, norm: Normalize, relative: bool) -> None:
    """One report's panel: its :func:`outlier_matrix` as a heat map in ``norm``, the flagged
    dimensions dotted, the layers and dimensions as ticks, a title saying which dimensions are shown,
    and the colorbar (:func:`_stat_colorbar`)."""
    stat, names, dims, flagged = matrix
    im = ax.imshow(stat, aspect="auto", interpolation="nearest", cmap=HEAT_CMAP, norm=norm)
    rr, cc = np.nonzero(flagged)
    ax.scatter(cc, rr, s=18, marker="o", facecolors="white", edgecolors="black", linewidths=0.8, zorder=3)
    ax.set_yticks(range(len(names)), [plain_text(shown_name(n)) for n in names])
    step = max(1, int(np.ceil(dims.size / 60)))
    ax.set_xticks(
        range(0, dims.size, step), [str(d) for d in dims[::step]], rotation=90 if dims.size > 12 else 0
    )
    ax.grid(False)
    ax.set_xlabel("hidden dimension")
    ax.set_ylabel("layer")
    d_total = len(next(lay["outlier_statistic"] for lay in rep["layers"] if lay.get("outlier_statistic")))
    shown = (
        f"top {dims.size} of {d_total} dimensions by statistic"
        if dims.size < d_total
        else f"all {d_total} dimensions"
    )
    ax.set_title(plain_text(f"{label}: {shown}"))
    _stat_colorbar(fig, ax, im, norm, rep.get("params") or {}, relative)


def _stat_colorbar(fig: Figure, ax, im, norm: Normalize, params: dict, relative: bool) -> None:
    """The heat map's colorbar, labelled with the statistic and the rule; for the ``variance`` rule
    drawn relative to the layer mean, the threshold k marked where it is on the scale."""
    cbar = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.04)
    stat_name = _STAT_NAMES.get(params.get("outlier_rule"), "outlier statistic")
    what = f"{stat_name} / layer mean" if relative else stat_name
    cbar.set_label(plain_text(f"{what}\n({_rule_text(params)})"), fontsize=8)
    thr = params.get("outlier_threshold")
    if (
        relative
        and params.get("outlier_rule") == "variance"
        and thr is not None
        and norm.vmin <= float(thr) <= norm.vmax
    ):
        cbar.ax.axhline(float(thr), color="white", linewidth=2.4)
        cbar.ax.axhline(float(thr), color="black", linewidth=1.2, linestyle=(0, (2, 1)))
