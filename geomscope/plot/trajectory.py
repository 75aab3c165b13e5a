"""Checkpoint trajectories: reports of one model, or of several (sizes), at several training revisions
-> each metric against training step. One model: one line per layer coloured by depth, ±1 se as a
band. Several models: one colour per model, its layers in shades of it (the deepest in full colour,
shallower ones lighter), a legend of the models.

Any column of trajectory.csv can be drawn (:mod:`geomscope.score.trajectory`): a layer's metrics,
the sections that describe a layer (``final_norm_*``, ``norms_*``, ``gradient_energy_*``) on the
layers they describe, and the per-revision I(W) (``iw_*``) as one line per model. Reports read from
JSON get the same columns from the same rule, so the inputs' form does not matter.
"""

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
    PALETTE,
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
from geomscope.score.trajectory import is_revision_wide, model_of, revision_columns, section_columns

#: the label of the line of a per-revision column (``iw_*``), one value per checkpoint
REVISION_LINE = "per revision"


def trajectory_steps(reports: Sequence[dict]) -> list[int]:
    """The training step of every report; InputError naming the first report without one, or a step
    given twice for one model."""
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
    seen: set[tuple] = set()
    for rep, step in zip(reports, steps, strict=True):
        key = (model_of(rep), step)
        if key in seen:
            who = f" (of {shown_name(key[0])})" if key[0] else ""
            raise InputError(f"two reports are at step {step}{who}; give one report per checkpoint")
        seen.add(key)
    return steps


def trajectory_models(reports: Sequence[dict]) -> dict[str | None, list[dict]]:
    """The reports of each model (:func:`geomscope.score.trajectory.model_of`), models in the order
    they first appear."""
    out: dict[str | None, list[dict]] = {}
    for rep in reports:
        out.setdefault(model_of(rep), []).append(rep)
    return out


def is_trajectory(reports: Sequence[dict]) -> bool:
    """True when the reports can form a trajectory (>= 2 checkpoints of each model)."""
    if len(reports) < 2:
        return False
    try:
        trajectory_steps(reports)
    except InputError:
        return False
    return all(len(reps) >= 2 for reps in trajectory_models(reports).values())


def with_trajectory_columns(rep: dict) -> dict:
    """A copy of a report whose layer entries also hold its trajectory columns (those of its sections
    on the layer they describe, ``iw_*`` on every layer), as read back from trajectory.csv; the
    values a layer entry holds already are kept."""
    by_layer = section_columns(rep)
    wide = revision_columns(rep)
    layers = [
        {**{k: v for k, v in {**wide, **by_layer.get(lay["layer"], {})}.items() if v is not None}, **lay}
        for lay in rep["layers"]
    ]
    return {**rep, "layers": layers}


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

    One panel per metric (any trajectory column, module docstring). Reports of one model: one line
    per layer (all, or ``layers``) coloured by depth with a colorbar (gradient layers, ``*.grad``,
    dashed, with a legend saying so). Reports of several models (:func:`trajectory_models`): one
    colour per model with a legend, its layers in shades of it (:func:`_shades`), each model's
    line over its own steps; ``layers`` picks in each report, so ``-1`` is each model's last layer.
    A per-revision column (``iw_*``) is one line per model. x values are the steps themselves:
    ``log_x`` uses a symmetric-log axis whose linear part ends at the smallest positive step, so
    step 0 stays on the axis (as 0, left of the decades); None (default) chooses it when the
    positive steps span two decades or more (Pythia's step0, step1000 ... step143000).
    ``ax``: draw into these Axes (one per metric) of the caller's figure and return that figure.
    """
    reports = select_layers(reports, layers)
    steps = trajectory_steps(reports)
    models = trajectory_models(reports)
    for reps in models.values():
        check_common_layers(reps)
    drawn = [with_trajectory_columns(r) for r in reports]
    metrics = choose_metrics(drawn, metrics) if metrics else choose_metrics(reports, None)
    if log_x is None:
        log_x = _spans_decades(np.asarray(steps, dtype=float))
    if len(models) > 1:
        return _plot_models(trajectory_models(drawn), metrics, log_x, ax)
    order = np.argsort(steps, kind="stable")
    reports = [drawn[i] for i in order]
    x = np.asarray(sorted(steps), dtype=float)
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


def _spans_decades(x: np.ndarray) -> bool:
    """The default step axis: log when the positive steps span two decades or more."""
    pos = x[x > 0]
    return bool(pos.size >= 2 and pos.max() / pos.min() >= 100)


def _draw_trajectories(
    ax, reports: Sequence[dict], metric: str, x: np.ndarray, colours: dict, log_x: bool
) -> None:
    """One metric's panel: a line per layer of ``colours`` (name -> colour, in depth order) over the
    steps ``x`` of the step-ordered ``reports``, with its ±1 se band where given, and the step axis.
    A per-revision metric is one line, the revision's value."""
    if is_revision_wide(metric):
        name = _first_with_values(reports, metric, list(colours))
        _draw_line(ax, x, *_layer_values(reports, name, metric), "0.2", REVISION_LINE)
        colours = {}
    for name, color in colours.items():
        _draw_line(ax, x, *_layer_values(reports, name, metric), color, name)
    _step_axis(ax, x, log_x)
    _label_panel(ax, metric, reports)


def _draw_line(
    ax, x: np.ndarray, y: np.ndarray, se: np.ndarray, color, name: str, label: str | None = None
) -> bool:
    """One layer's line over the steps, dashed for a gradient layer, with its ±1 se band; whether
    it has a band."""
    ax.plot(
        x,
        y,
        color=color,
        marker="o",
        markersize=3,
        linewidth=1.3,
        # a gradient layer has its activation layer's index, so its colour: dashed to tell them apart
        linestyle=GRAD_LINESTYLE if is_gradient(name) else "-",
        label=plain_text(label or name),
    )
    if not np.isfinite(se).any():
        return False
    ax.fill_between(x, y - se, y + se, color=color, alpha=0.18, linewidth=0)
    return True


def _step_axis(ax, x: np.ndarray, log_x: bool) -> None:
    if log_x:
        _log_step_axis(ax, x)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.xaxis.set_major_formatter(FuncFormatter(step_formatter))


def _label_panel(ax, metric: str, reports: Sequence[dict]) -> None:
    """A panel's title and axis labels; the step axis says ``symlog`` where step 0 is on it."""
    x = np.asarray([parse_step(r) for r in reports], dtype=float)
    ax.set_title(plain_text(metric_title(metric, reports[0].get("params"))))
    ax.set_xlabel("training step" + (" (symlog)" if ax.get_xscale() == "symlog" and (x == 0).any() else ""))
    ax.set_ylabel(plain_text(metric_name(metric).split(" (")[0]))


def _layer_values(reports: Sequence[dict], name: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(value, se) of layer ``name``'s ``metric`` in each report; NaN where the report lacks the layer
    or gives no value (no non-negative se). The se is the layer's ``se.<metric>``, else its
    ``<metric>_se`` column (``gradient_energy_r8_energy_se``)."""
    y, se = np.full(len(reports), np.nan), np.full(len(reports), np.nan)
    for j, rep in enumerate(reports):
        lay = next((la for la in rep["layers"] if la["layer"] == name), None)
        if lay is None:
            continue
        if is_number(lay.get(metric)):
            y[j] = lay[metric]
        e = (lay.get("se") or {}).get(metric, lay.get(f"{metric}_se"))
        if is_number(e) and e >= 0:
            se[j] = e
    return y, se


def _first_with_values(reports: Sequence[dict], metric: str, names: list[str]) -> str:
    """The first of ``names`` (depth order) with a value of ``metric`` in some report."""
    return next((n for n in names if np.isfinite(_layer_values(reports, n, metric)[0]).any()), names[0])


# ---------------------------------------------------------------------------------- several models
def _plot_models(models: dict, metrics: Sequence[str], log_x: bool, ax) -> Figure:
    """The figure of several models: one colour per model (legend), each model's layers in shades of
    it over that model's own steps; only the layers with a value of a panel's metric are drawn."""
    from matplotlib.lines import Line2D

    colours = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(models)}
    ordered = {m: sorted(reps, key=parse_step) for m, reps in models.items()}
    every = sorted(parse_step(r) for reps in ordered.values() for r in reps)
    all_x = np.asarray(every, dtype=float)
    nrows, ncols = grid_shape(len(metrics))
    fig, axes, own = panels(ax, len(metrics), 4.6 * ncols + 0.8, 3.0 * nrows + 1.2)
    ncols = axes.shape[1]
    shaded = gradients = banded = False
    for k, metric in enumerate(metrics):
        panel = axes[k // ncols][k % ncols]
        for model, reps in ordered.items():
            x = np.asarray([parse_step(r) for r in reps], dtype=float)
            names = _names_with_values(reps, metric)
            if is_revision_wide(metric):
                names = names[:1]
            shaded |= len(names) > 1
            gradients |= any(is_gradient(n) for n in names)
            for name, colour in _shades(colours[model], names).items():
                shown = REVISION_LINE if is_revision_wide(metric) else name
                label = f"{_short_name(model or 'model')}: {shown}"
                banded |= _draw_line(panel, x, *_layer_values(reps, name, metric), colour, shown, label)
        _step_axis(panel, all_x, log_x)
        _label_panel(panel, metric, [r for reps in ordered.values() for r in reps])
    hide_spare_panels(axes, len(metrics))
    handles = [
        Line2D(
            [], [], color=c, marker="o", markersize=3, label=plain_text(shown_name(_short_name(m or "model")))
        )
        for m, c in colours.items()
    ]
    axes[0][0].legend(handles=handles + (gradient_key() if gradients else []), loc="best", fontsize=7)
    if not own:
        return fig
    span = f"step {step_formatter(all_x[0])}–{step_formatter(all_x[-1])}"
    fig.suptitle(
        plain_text(f"{len(models)} models over training ({len(every)} checkpoints, {span})"), fontsize=11
    )
    caption = "One colour per model" + ("; shallower layers in lighter shades." if shaded else ".")
    if banded:
        bands = uncertainty_caption([r for reps in ordered.values() for r in reps], metrics)
        caption = bands.replace("Error bars", "Bands") + " " + caption
    add_caption(fig, caption)
    return fig


def _names_with_values(reports: Sequence[dict], metric: str) -> list[str]:
    """The layers of a model's reports, in depth order, with a value of ``metric`` in some report."""
    depth: dict[str, int] = {}
    for rep in reports:
        for pos, lay in enumerate(rep["layers"]):
            depth.setdefault(lay["layer"], layer_key(lay, pos))
    names = sorted(depth, key=lambda n: depth[n])
    return [n for n in names if np.isfinite(_layer_values(reports, n, metric)[0]).any()]


def _shades(colour: str, names: list[str]) -> dict[str, tuple]:
    """``{layer: colour}``: the deepest of ``names`` (depth order) in ``colour``, shallower ones mixed
    towards white, the shallowest at 35 % of the colour."""
    from matplotlib.colors import to_rgb

    rgb = np.asarray(to_rgb(colour))
    n = len(names)
    out = {}
    for i, name in enumerate(names):
        t = 1.0 if n == 1 else 0.35 + 0.65 * i / (n - 1)
        out[name] = tuple(1.0 - t * (1.0 - rgb))
    return out


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
