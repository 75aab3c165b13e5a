"""Checkpoint trajectories: reports of one model at several training revisions -> each metric against
training step, one line per layer coloured by depth, ±1 se as a band."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from geomscope.errors import InputError
from geomscope.formatting import shown_name
from geomscope.layers import is_gradient
from geomscope.plot._reports import (
    check_common_layers,
    choose_metrics,
    is_number,
    layer_key,
    parse_step,
    report_name,
    select_layers,
)
from geomscope.plot._style import (
    GRAD_LINESTYLE,
    add_caption,
    depth_cmap,
    depth_colorbar,
    depth_norm,
    gradient_key,
    grid_shape,
    hide_spare_panels,
    metric_name,
    metric_title,
    panels,
    plain_text,
    step_formatter,
    styled,
    uncertainty_caption,
)


def trajectory_steps(reports: Sequence[dict]) -> list[int]:
    """The training step of every report; InputError naming the first report without one, a mix of
    models, or a step given twice."""
    steps = []
    for rep in reports:
        s = parse_step(rep)
        if s is None:
            rev = (rep.get("model") or {}).get("revision")
            raise InputError(
                f"{report_name(rep)} has no training step (revision {rev!r}, expected 'stepN' "
                'or a "step" key); a trajectory needs reports of checkpoints'
            )
        steps.append(s)
    names = sorted({shown_name((r.get("model") or {}).get("name")) for r in reports})
    if len(names) > 1:
        raise InputError(
            f"a trajectory follows one model, these reports mix {', '.join(names)}; "
            "plot each model separately or use --kind layers"
        )
    dup = sorted({s for s in steps if steps.count(s) > 1})
    if dup:
        raise InputError(f"two reports are at step {dup[0]}; give one report per checkpoint")
    return steps


def is_trajectory(reports: Sequence[dict]) -> bool:
    """True when the reports can form a trajectory (>= 2 checkpoints of one model)."""
    if len(reports) < 2:
        return False
    try:
        trajectory_steps(reports)
    except InputError:
        return False
    return True


@styled
def plot_trajectory(
    reports: Sequence[dict],
    metrics: Sequence[str] | None = None,
    *,
    layers: Sequence[str] | None = None,
    log_x: bool | None = None,
    ax=None,
) -> Figure:
    """Each metric against training step (steps parsed from ``stepN`` revisions or a ``step`` key).

    One panel per metric, one line per layer (all, or ``layers``) coloured by depth with a
    colorbar (gradient layers, ``*.grad``, dashed, with a legend saying so); x values are the steps
    themselves.  ``log_x`` uses a symmetric-log axis whose linear part ends at the smallest positive
    step, so step 0 stays on the axis; None (default) chooses it when the positive steps span two
    decades or more (Pythia's step0, step1000 ... step143000).
    ``ax``: draw into these Axes (one per metric) of the caller's figure and return that figure.
    """
    reports = select_layers(reports, layers)
    steps = trajectory_steps(reports)
    check_common_layers(reports)
    metrics = choose_metrics(reports, metrics)
    order = np.argsort(steps, kind="stable")
    reports = [reports[i] for i in order]
    x = np.asarray(sorted(steps), dtype=float)
    if log_x is None:
        pos = x[x > 0]
        log_x = bool(pos.size >= 2 and pos.max() / pos.min() >= 100)
    depth: dict[str, int] = {}
    for rep in reports:
        for pos, lay in enumerate(rep["layers"]):
            depth.setdefault(lay["layer"], layer_key(lay, pos))
    names = sorted(depth, key=lambda n: depth[n])
    norm = depth_norm(depth.values())
    cmap = depth_cmap()
    colours = {name: cmap(norm(depth[name])) for name in names}
    nrows, ncols = grid_shape(len(metrics))
    fig, axes, own = panels(ax, len(metrics), 4.6 * ncols + 0.8, 3.0 * nrows + 0.9)
    ncols = axes.shape[1]
    for k, metric in enumerate(metrics):
        _draw_trajectories(axes[k // ncols][k % ncols], reports, metric, x, colours, log_x)
    hide_spare_panels(axes, len(metrics))
    if any(is_gradient(n) for n in names):
        axes[0][0].legend(handles=gradient_key(), loc="best", fontsize=7)
    depth_colorbar(fig, axes, norm, cmap)
    if not own:
        return fig
    model = shown_name(_short_name((reports[0].get("model") or {}).get("name") or "model"))
    span = f"step {step_formatter(x[0])}–{step_formatter(x[-1])}"
    fig.suptitle(plain_text(f"{model} over training ({len(reports)} checkpoints, {span})"), fontsize=11)
    add_caption(fig, uncertainty_caption(reports, metrics).replace("Error bars", "Bands"))
    return fig


def _draw_trajectories(
    ax, reports: Sequence[dict], metric: str, x: np.ndarray, colours: dict, log_x: bool
) -> None:
    """One metric's panel: a line per layer of ``colours`` (name -> colour, in depth order) over the
    steps ``x`` of the step-ordered ``reports``, with its ±1 se band where given, and the step axis."""
    for name, color in colours.items():
        y, se = _layer_values(reports, name, metric)
        ax.plot(
            x,
            y,
            color=color,
            marker="o",
            markersize=3,
            linewidth=1.3,
            # a gradient layer has its activation layer's index, so its colour: dashed to tell them apart
            linestyle=GRAD_LINESTYLE if is_gradient(name) else "-",
            label=plain_text(name),
        )
        if np.isfinite(se).any():
            ax.fill_between(x, y - se, y + se, color=color, alpha=0.18, linewidth=0)
    if log_x:
        _log_step_axis(ax, x)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.xaxis.set_major_formatter(FuncFormatter(step_formatter))
    ax.set_title(plain_text(metric_title(metric, reports[0].get("params"))))
    ax.set_xlabel("training step" + (" (symlog)" if log_x and (x == 0).any() else ""))
    ax.set_ylabel(plain_text(metric_name(metric).split(" (")[0]))


def _layer_values(reports: Sequence[dict], name: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(value, se) of layer ``name``'s ``metric`` in each report; NaN where the report lacks the layer
    or gives no value (no non-negative se)."""
    y, se = np.full(len(reports), np.nan), np.full(len(reports), np.nan)
    for j, rep in enumerate(reports):
        lay = next((la for la in rep["layers"] if la["layer"] == name), None)
        if lay is None:
            continue
        if is_number(lay.get(metric)):
            y[j] = lay[metric]
        e = (lay.get("se") or {}).get(metric)
        if is_number(e) and e >= 0:
            se[j] = e
    return y, se


def _short_name(name: str) -> str:
    """A hub name as it is; a local path by its last two parts (``ft/checkpoints``)."""
    import os

    if os.sep in name and (name.startswith((os.sep, ".")) or os.path.exists(name)):
        parts = [p for p in name.split(os.sep) if p]
        return os.sep.join(parts[-2:])
    return name


def _log_step_axis(ax, x: np.ndarray) -> None:
    """Log training-step axis.  With step 0 present: symmetric log whose linear part ends at the
    smallest positive step, ticks at 0 and at the powers of ten from there on (no overlapping 0)."""
    pos = x[x > 0]
    if not (x == 0).any() or not pos.size:
        ax.set_xscale("log")
        return
    lin = float(pos.min())
    ax.set_xscale("symlog", linthresh=lin, linscale=0.5)
    lo, hi = int(np.ceil(np.log10(lin))), int(np.floor(np.log10(max(pos.max(), lin))))
    ticks = [0.0] + [10.0**k for k in range(lo, hi + 1)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(step_formatter))
    ax.xaxis.set_minor_locator(NullLocator())
