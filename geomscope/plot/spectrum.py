"""Eigenspectra: covariance eigenvalues against their index, log-scale y, one curve per layer coloured
by depth (one panel per report, one shared colorbar)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from geomscope.errors import InputError
from geomscope.layers import is_gradient
from geomscope.plot._reports import (
    is_number,
    layer_key,
    report_labels,
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
    panels,
    plain_text,
    styled,
)


def _has_eigenvalues(rep: dict) -> bool:
    return any(isinstance(lay.get("eigenvalues"), list) and lay["eigenvalues"] for lay in rep["layers"])


def has_spectrum(rep: dict) -> bool:
    """Whether some layer has a positive eigenvalue: a curve to draw on the log axis."""
    return any(
        is_number(v) and v > 0
        for lay in rep["layers"]
        if isinstance(lay.get("eigenvalues"), list)
        for v in lay["eigenvalues"]
    )


def spectrum_curve(eigenvalues: Sequence[float], *, normalise: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one layer's spectrum: x = 1..D (or i/D when normalised), y = λ_i (or λ_i/Σλ).

    Non-positive and non-finite eigenvalues (rank deficiency, rounding) are dropped: they have no
    place on a log axis.
    """
    lam = np.asarray([v if v is not None else np.nan for v in eigenvalues], dtype=float)
    d = lam.size
    x = np.arange(1, d + 1, dtype=float)
    if normalise:
        total = np.nansum(np.where(lam > 0, lam, 0.0))
        lam = lam / total if total > 0 else lam * np.nan
        x = x / d
    keep = np.isfinite(lam) & (lam > 0)
    return x[keep], lam[keep]


#: eigenvalues below FLOOR x the largest of their layer are numerical zeros; the y axis stops there
FLOOR = 1e-7


def visible_floor(y: np.ndarray) -> tuple[float, bool]:
    """(lowest eigenvalue of the curve at or above FLOOR x its largest, whether some are below)."""
    floor = float(y.max()) * FLOOR
    kept = y[y >= floor]
    return (float(kept.min()) if kept.size else floor), bool((y < floor).any())


@styled
def plot_spectrum(
    reports: Sequence[dict],
    *,
    layers: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    normalise: bool = False,
    log_x: bool = True,
    ax=None,
) -> Figure:
    """Covariance eigenspectra per layer (``layers[].eigenvalues``, descending).

    One panel per report; one curve per layer, coloured by layer index with a shared colorbar
    (gradient layers, ``*.grad``, dashed in their activation layer's colour, and a legend saying
    so); log-scale y, cut at FLOOR x the largest eigenvalue of a layer (numerical zeros stay in the
    line data but below the axis; a caption says so).  ``normalise=True`` draws the explained-variance
    ratio λ_i/Σλ against i/D so
    that models of different width and scale compare directly.  ``log_x`` (default) draws the
    index on a log axis too, where a power-law spectrum is a straight line.  When the reports have
    different depths, colour is the relative depth (layer index / last index of that report).
    ``ax``: draw into these Axes (one per report) of the caller's figure and return that figure.
    """
    reports = select_layers(reports, layers)
    _check_spectra(reports)
    labels = list(labels) if labels is not None else report_labels(reports)
    lasts = {max(layer_key(lay, pos) for pos, lay in enumerate(r["layers"])) for r in reports}
    relative = len(lasts) > 1
    depths = [_depth(r, pos, relative) for r in reports for pos in range(len(r["layers"]))]
    norm = depth_norm(depths, 0.01 if relative else 1)
    cmap = depth_cmap()
    nrows, ncols = grid_shape(len(reports))
    fig, axes, own = panels(ax, len(reports), 4.4 * ncols + 0.8, 3.3 * nrows + 0.5, sharey=normalise)
    ncols = axes.shape[1]
    clipped = False
    for i, rep in enumerate(reports):
        colours = [cmap(norm(_depth(rep, pos, relative))) for pos in range(len(rep["layers"]))]
        clipped |= _draw_spectra(
            axes[i // ncols][i % ncols], rep, colours, labels[i], normalise, log_x, i % ncols
        )
    hide_spare_panels(axes, len(reports))
    if relative:
        depth_colorbar(fig, axes, norm, cmap, "relative depth (layer index / last layer)", whole=False)
    else:
        depth_colorbar(fig, axes, norm, cmap)
    if not own:
        return fig
    fig.suptitle("Covariance eigenspectra by layer" + (" (normalised)" if normalise else ""), fontsize=11)
    if clipped:
        add_caption(
            fig,
            f"Eigenvalues below 1e{int(np.log10(FLOOR))} × λ₁ of their layer (numerical zeros, "
            "e.g. the direction LayerNorm removes) run off the bottom of the axes.",
        )
    return fig


def _check_spectra(reports: Sequence[dict]) -> None:
    """InputError naming the first report without eigenvalues, else the first without a positive one."""
    missing = [report_name(r) for r in reports if not _has_eigenvalues(r)]
    if missing:
        raise InputError(f"{missing[0]} has no eigenvalues; rescore it with --metrics including spectrum")
    empty = [report_name(r) for r in reports if not has_spectrum(r)]
    if empty:  # every eigenvalue zero or null: nothing a log axis can show
        raise InputError(
            f"{empty[0]} has no positive eigenvalue in the layers drawn (all zero or null), so there is "
            "no spectrum to draw; choose other --layers or rescore the run"
        )


def _depth(rep: dict, pos: int, relative: bool) -> float:
    """The colour value of the layer at ``pos``: its index, or with ``relative`` its index over the
    report's last index (0 when that is 0)."""
    k = layer_key(rep["layers"][pos], pos)
    if not relative:
        return k
    last = max(layer_key(la, j) for j, la in enumerate(rep["layers"]))
    return k / last if last > 0 else 0.0


def _draw_spectra(ax, rep: dict, colours, title: str, normalise: bool, log_x: bool, column: int) -> bool:
    """One report's panel: a curve per layer with eigenvalues in its colour of ``colours`` (gradient
    layers dashed, with a legend saying so), the y axis cut at the layers' visible floors, and the
    axes' scales and labels (normalised panels share y: those past the grid's first ``column`` have no
    y label).  Returns whether some eigenvalues run off the bottom."""
    lows: list[float] = []
    grads = clipped = False
    for pos, lay in enumerate(rep["layers"]):
        ev = lay.get("eigenvalues")
        if not ev:
            continue
        x, y = spectrum_curve(ev, normalise=normalise)
        grad = is_gradient(lay["layer"])  # its activation layer's colour (same index), dashed
        grads |= grad
        ax.plot(
            x,
            y,
            color=colours[pos],
            linewidth=1.1,
            linestyle=GRAD_LINESTYLE if grad else "-",
            label=plain_text(lay["layer"]),
        )
        if y.size:
            low, cut = visible_floor(y)
            lows.append(low)
            clipped |= cut
    ax.set_yscale("log")
    if lows and ax.get_ylim()[0] < min(lows) / 2:
        ax.set_ylim(min(lows) / 2, ax.get_ylim()[1])
    if log_x:
        ax.set_xscale("log")
    ax.set_title(plain_text(title))
    if grads:
        ax.legend(handles=gradient_key(), loc="best", fontsize=7)
    ax.set_xlabel("eigenvalue index / D" if normalise else "eigenvalue index")
    ax.set_ylabel("explained variance ratio λᵢ/Σλ" if normalise else "eigenvalue λᵢ of the covariance")
    if not normalise and not log_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if normalise and column:
        ax.set_ylabel("")
    ax.grid(True, which="major", alpha=0.3)
    return clipped
