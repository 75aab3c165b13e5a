"""Metric against layer: one panel per metric, one line per report, ±1 standard-error bars."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from geomscope.formatting import shown_name
from geomscope.layers import activation_name, is_gradient
from geomscope.plot._reports import (
    check_common_layers,
    choose_metrics,
    is_number,
    layer_key,
    layer_positions,
    report_labels,
    select_layers,
)
from geomscope.plot._style import (
    GRAD_LINESTYLE,
    add_caption,
    grid_shape,
    hide_spare_panels,
    layer_errorbar,
    metric_name,
    metric_title,
    metric_variant,
    panels,
    plain_text,
    series_style,
    styled,
    uncertainty_caption,
)

#: at most this many layer names label a categorical layer axis (evenly thinned beyond)
MAX_NAME_TICKS = 24


def layer_series(
    rep: dict, metric: str, *, gradients: bool | None = None, x_of: dict[str, int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x = layer index, y = metric value, se) of one report; NaN where null/missing.

    ``gradients``: only the gradient layers (True), only the activation layers (False) or all
    (None).  ``x_of``: each layer's x by name (a categorical axis, :func:`layer_positions`) instead
    of its index.
    """
    xs, ys, es = [], [], []
    for pos, lay in enumerate(rep["layers"]):
        if gradients is not None and is_gradient(lay["layer"]) != gradients:
            continue
        xs.append(x_of[lay["layer"]] if x_of is not None else layer_key(lay, pos))
        v = lay.get(metric)
        ys.append(float(v) if is_number(v) else np.nan)
        se = (lay.get("se") or {}).get(metric)
        es.append(float(se) if is_number(se) and se >= 0 else np.nan)
    order = np.argsort(xs, kind="stable")
    return np.asarray(xs, float)[order], np.asarray(ys)[order], np.asarray(es)[order]


def _series(reports: Sequence[dict], labels: Sequence[str]) -> list[tuple[int, str, bool]]:
    """``(report, label, gradients)`` per line: a report's activation layers and its gradient layers
    (``*.grad``, which share their activations' indices) are two lines, never one zig-zag."""
    out = []
    for i, (rep, lab) in enumerate(zip(reports, labels, strict=True)):
        kinds = {is_gradient(lay["layer"]) for lay in rep["layers"]}
        if False in kinds:
            out.append((i, lab, False))
        if True in kinds:
            out.append((i, f"{lab} (gradients)", True))
    return out


@styled
def plot_layers(
    reports: Sequence[dict],
    metrics: Sequence[str] | None = None,
    *,
    layers: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    ax=None,
) -> Figure:
    """Each metric against layer index.

    One panel per metric (default: isoscore_star, isoscore, avgcos, twonn, those present); one
    line per report, labelled ``model@revision``, and a second, dashed one ``... (gradients)`` for
    its gradient layers (``*.grad``) when it has them; error bars are ±1 ``se`` of the report
    (absent where the report gives none).  Panel titles carry the metric's variant taken from
    ``params`` (e.g. ``IsoScore* (ζ=0.2, target=trace)``); when the reports differ in a variant, it
    goes into the legend labels instead.  Null values leave gaps.  When the reports' indices do not
    place their layers consistently (array reports scored with different ``--column`` lists), the
    x axis names the layers instead (:func:`~geomscope.plot._reports.layer_positions`).  Labels
    (``labels`` too) are drawn as plain text (:func:`~geomscope.plot._style.plain_text`).  ``ax``:
    draw into these Axes (one per metric) of the caller's figure instead of a new one, and return
    that figure.
    """
    reports = select_layers(reports, layers)
    check_common_layers(reports)
    metrics = choose_metrics(reports, metrics)
    labels = list(labels) if labels is not None else report_labels(reports)
    series = _series(reports, labels)
    x_of = layer_positions(reports)
    nrows, ncols = grid_shape(len(metrics))
    height = 3.0 * nrows + 0.7 + 0.2 * ((len(series) + 2) // 3)
    fig, axes, own = panels(ax, len(metrics), 4.4 * ncols, height)
    ncols = axes.shape[1]
    handles = []
    for k, metric in enumerate(metrics):
        drawn = _draw_metric(axes[k // ncols][k % ncols], reports, metric, series, x_of)
        if k == 0:
            handles = drawn
    hide_spare_panels(axes, len(metrics))
    shown = [plain_text(lab) for _, lab, _ in series]
    if not own:  # the caller's figure: a legend on the first panel, no title or caption
        axes[0][0].legend(handles=handles, labels=shown, loc="best", fontsize=7)
        return fig
    # the legend heads the figure (its title is the figure title); the caption sits below the panels
    fig.legend(
        handles=handles,
        labels=shown,
        loc="outside upper center",
        ncols=min(len(series), 3),
        frameon=False,
        title="Geometry by layer",
        title_fontsize=11,
    )
    add_caption(fig, _caption(reports, metrics, labels, by_name=x_of is not None))
    return fig


def _draw_metric(ax, reports: Sequence[dict], metric: str, series, x_of: dict[str, int] | None) -> list:
    """One metric's panel: a line with error bars per entry of ``series`` (:func:`_series`), the
    metric's title, its layer axis (by index, or by name where ``x_of`` places the layers), and a
    legend of variants when the reports differ in the metric's variant.  Returns the lines' containers,
    in ``series`` order."""
    variants = [metric_variant(metric, r.get("params")) for r in reports]
    same = len(set(variants)) == 1
    drawn = []
    for i, lab, grad in series:
        x, y, se = layer_series(reports[i], metric, gradients=grad, x_of=x_of)
        if not same and variants[i]:
            lab = variants[i] + (" (gradients)" if grad else "")
        style = series_style(i)
        if grad:  # the report's colour and marker, dashed and hollow
            style.update(linestyle=GRAD_LINESTYLE, markerfacecolor="none")
        drawn.append(layer_errorbar(ax, x, y, se, lab, style, size=4, width=1.4, bar=1.0, alpha=0.95))
    title = metric_title(metric, reports[0].get("params")) if same else metric_name(metric)
    ax.set_title(plain_text(title))
    ax.set_ylabel(plain_text(metric_name(metric).split(" (")[0]))
    if x_of is None:
        ax.set_xlabel("layer index")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        _name_ticks(ax, x_of)
    if not same:  # the reports differ in this metric's variant: say which is which, in short
        ax.legend(loc="best", frameon=True, framealpha=0.8, fontsize=7, title="variant", title_fontsize=7)
    return drawn


def _name_ticks(ax, x_of: dict[str, int]) -> None:
    """A categorical layer axis: ticks at the positions, labelled with the (activation) names."""
    names: dict[int, str] = {}
    for name, x in x_of.items():
        names.setdefault(x, shown_name(activation_name(name)))
    at = sorted(names)
    step = max(1, int(np.ceil(len(at) / MAX_NAME_TICKS)))
    ax.set_xticks(at[::step], [plain_text(names[x]) for x in at[::step]], rotation=90 if len(at) > 8 else 0)
    ax.set_xlabel("layer")


def _caption(reports: Sequence[dict], metrics: Sequence[str], labels: Sequence[str], by_name: bool) -> str:
    """Error-bar method, row counts, special tokens, why values are missing, layer flags, and, when
    the layers are placed ``by_name``, that they are."""
    text = uncertainty_caption(reports, metrics)
    rows = sorted({lay.get("n_rows") for r in reports for lay in r["layers"] if is_number(lay.get("n_rows"))})
    if rows:
        text += f" Rows per layer: {rows[0]:,}" + (f"–{rows[-1]:,}." if rows[-1] != rows[0] else ".")
    excl = {bool((r.get("params") or {}).get("exclude_special")) for r in reports if r.get("params")}
    if excl == {True}:
        text += " Special tokens excluded."
    gaps = missing_values(reports, metrics, labels)
    if gaps:
        text += " No value: " + "; ".join(gaps[:3]) + ("; …" if len(gaps) > 3 else "") + "."
    flags: dict[str, list[str]] = {}
    for rep in reports:
        for lay in rep["layers"]:
            for f in lay.get("flags") or []:
                flags.setdefault(str(f), [])
                if lay["layer"] not in flags[str(f)]:
                    flags[str(f)].append(lay["layer"])
    if flags:
        text += " Flags: " + "; ".join(f"{f} ({_few(ls)})" for f, ls in flags.items()) + "."
    if by_name:
        text += " Layers are placed by name: the reports number them differently."
    return text


def missing_values(reports: Sequence[dict], metrics: Sequence[str], labels: Sequence[str]) -> list[str]:
    """``"<metric> at <layers> of <report> (<reason from notes>)"`` for every null value drawn as a gap."""
    out = []
    for rep, lab in zip(reports, labels, strict=True):
        for m in metrics:
            by_reason: dict[str, list[str]] = {}
            for lay in rep["layers"]:
                if not is_number(lay.get(m)):
                    reason = (lay.get("notes") or {}).get(m) or "no reason recorded"
                    by_reason.setdefault(reason, []).append(lay["layer"])
            for reason, names in by_reason.items():
                where = "all layers" if len(names) == len(rep["layers"]) else _few(names)
                out.append(f"{m} at {where}" + (f" of {lab}" if len(reports) > 1 else "") + f" ({reason})")
    return out


def _few(names: Sequence[str], k: int = 3) -> str:
    return ", ".join(map(shown_name, names[:k])) + (f" +{len(names) - k} more" if len(names) > k else "")
