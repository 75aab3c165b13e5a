"""Gradient energy in the activation subspace (``score GRADRUN --basis ACTRUN``, the report's
``gradient_energy``): captured energy E against rank, and kappa against layer.

One row per report, two panels per row: E(r) per gradient layer (coloured by depth) with its normal
controls' band (mean ± SD), E_max (faint dotted) and the isotropic baseline r/D (dashed black); then
kappa = (E − r/D)/(E_max − r/D) by layer, one line per rank, with 0 and 1 marked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

from geomscope.errors import InputError
from geomscope.formatting import shown_name
from geomscope.layers import activation_name, layer_number, listed_layers, select_names
from geomscope.plot._reports import is_number, layer_key, report_labels, report_name
from geomscope.plot._style import (
    add_caption,
    depth_cmap,
    depth_norm,
    panels,
    plain_text,
    series_style,
    styled,
)

#: at most this many layers are named in the E panel's legend (evenly spaced, first and last kept)
MAX_LEGEND_LAYERS = 8
#: opacity of the E_max lines and of the control bands
_EMAX_ALPHA = 0.45
_BAND_ALPHA = 0.13


def energy_section(rep: dict) -> dict | None:
    """The report's ``gradient_energy`` section when it holds some layer with values, else None."""
    ge = rep.get("gradient_energy")
    if not isinstance(ge, dict) or not isinstance(ge.get("layers"), dict):
        return None
    return ge if any(isinstance(v, list) and v for v in ge["layers"].values()) else None


def has_energy(rep: dict, layers: Sequence[str] | None = None) -> bool:
    """Whether the report has a ``gradient_energy`` section with values (in the selected layers)."""
    if energy_section(rep) is None:
        return False
    try:
        return any(isinstance(v, list) and v for _, v in energy_layers(rep, layers))
    except InputError:
        return False


def _layer_index(rep: dict, name: str, pos: int) -> int:
    """The layer's ``index`` in ``report["layers"]``, else its position in the section."""
    for lay in rep.get("layers") or []:
        if isinstance(lay, dict) and lay.get("layer") == name:
            return layer_key(lay, pos)
    return pos


def energy_layers(rep: dict, layers: Sequence[str] | None = None) -> list[tuple[str, list | None]]:
    """``[(gradient layer, per-rank dicts or None)]`` in the section's (depth) order, kept by
    ``layers``: a ``--layers`` selection (:mod:`geomscope.layers`) over the report's layers, the
    section's gradient layers and their activation pairs, so that ``layer_01`` keeps
    ``layer_01.grad``; an index keeps the gradient layer at that index.

    A name or index that is neither in the section nor among the report's layers is an InputError.
    """
    ge = rep.get("gradient_energy") or {}
    items = [(str(k), v) for k, v in (ge.get("layers") or {}).items()]
    if not layers:
        return items
    pairs = ge.get("pairs") or {}
    index_of: dict[str, int] = {}
    for pos, lay in enumerate(rep.get("layers") or []):
        if isinstance(lay, dict) and "layer" in lay:
            index_of.setdefault(str(lay["layer"]), layer_key(lay, pos))
    for pos, (name, _) in enumerate(items):
        index_of.setdefault(name, _layer_index(rep, name, pos))
        index_of.setdefault(str(pairs.get(name, activation_name(name))), index_of[name])
    chosen = set(
        select_names(layers, listed_layers(list(index_of), list(index_of.values()), report_name(rep)))
    )
    return [
        (name, v)
        for name, v in items
        if name in chosen or str(pairs.get(name, activation_name(name))) in chosen
    ]


def short_layer(name: str) -> str:
    """Tick label of a layer: ``layer_01.grad`` -> ``1``, ``final_norm.grad`` -> ``fn``."""
    base = activation_name(name)
    number = layer_number(base)
    if number is not None:
        return str(number)
    parts = [p for p in re.split(r"[_.\-]+", base) if p]
    if len(parts) > 1:
        return "".join(p[0] for p in parts)
    return base


def _short_labels(names: Sequence[str]) -> list[str]:
    short = [short_layer(n) for n in names]
    if len(set(short)) < len(short):  # an ambiguous short form: the names without the suffix
        return [activation_name(n) for n in names]
    return short


def _num(v) -> float:
    return float(v) if is_number(v) else np.nan


def _column(rows: Sequence[dict], key: str) -> np.ndarray:
    return np.asarray([_num(r.get(key)) for r in rows], dtype=float)


def _rows(entries) -> list[dict]:
    """The per-rank dicts of a layer with a numeric rank, in rank order (None -> [])."""
    rows = [r for r in entries or [] if isinstance(r, dict) and is_number(r.get("rank")) and r["rank"] > 0]
    return sorted(rows, key=lambda r: r["rank"])


def _baseline(rows: Sequence[dict]) -> np.ndarray:
    """r/D per row: the report's ``baseline``, else rank / dim."""
    out = []
    for r in rows:
        b = r.get("baseline")
        if not is_number(b) and is_number(r.get("dim")) and r["dim"] > 0:
            b = r["rank"] / r["dim"]
        out.append(_num(b))
    return np.asarray(out, dtype=float)


def _legend_layers(n: int) -> list[int]:
    if n <= MAX_LEGEND_LAYERS:
        return list(range(n))
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, MAX_LEGEND_LAYERS)})


@styled
def plot_energy(
    reports: Sequence[dict],
    *,
    layers: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    ax=None,
) -> Figure:
    """Gradient energy captured by the top-r activation subspace (the report's ``gradient_energy``).

    One row per report, two panels: (1) captured energy E against rank r (log x, the report's
    ranks), one line per gradient layer coloured by depth, with the normal controls' mean ± SD as a
    light band (the mean alone where no SD), E_max (the best any rank-r subspace captures) as a
    faint dotted line and the isotropic baseline r/D dashed black; (2) kappa = (E − r/D)/(E_max −
    r/D) against layer (the section's order, ticks are short layer names), one line per rank, with 0
    and 1 marked.  Null values leave gaps.  ``layers``: names, activation names or indices.
    ``ax``: draw into these Axes (two per report) of the caller's figure and return that figure.
    """
    if not reports:
        raise InputError("no reports given; pass report JSON files from `geomscope score --basis ACTRUN`")
    for rep in reports:
        if energy_section(rep) is None:
            raise InputError(
                f"{report_name(rep)} has no gradient_energy; score a gradient run with --basis ACTRUN"
            )
    selected = [energy_layers(rep, layers) for rep in reports]
    for rep, sel in zip(reports, selected, strict=True):
        if not any(isinstance(v, list) and v for _, v in sel):
            raise InputError(
                f"{report_name(rep)}: the selected layers have no gradient energy; "
                f"choose --layers among {', '.join(energy_section(rep)['layers'])}"
            )
    labels = list(labels) if labels is not None else report_labels(reports)
    n = len(reports)
    fig, axes, own = panels(ax, 2 * n, 10.0, 3.4 * n + 0.9, max_cols=2)
    flat = list(axes.ravel())
    cmap = depth_cmap()
    for i, (rep, sel) in enumerate(zip(reports, selected, strict=True)):
        ge = rep["gradient_energy"]
        # colour = depth = position in the whole section (depth order), so a filter keeps colours
        order = {name: pos for pos, name in enumerate(ge["layers"])}
        depth = [order[name] for name, _ in sel]
        norm = depth_norm(depth)
        colours = [cmap(norm(d)) for d in depth]
        row_label = labels[i] + (f" (basis {ge['basis_model']})" if ge.get("basis_model") else "")
        _draw_energy(flat[2 * i], ge, sel, colours, row_label, own)
        _draw_kappa(flat[2 * i + 1], ge, sel)
    if not own:
        return fig
    fig.suptitle("Gradient energy in the top-r activation subspace", fontsize=11)
    add_caption(fig, _caption(reports, selected, labels))
    return fig


def _draw_energy(ax, ge: dict, sel, colours, title: str, own: bool) -> None:
    """E against rank on ``ax``: per layer of ``sel`` with values (in its colour of ``colours``) its
    controls, E_max and E (:func:`_draw_layer_energy`); each distinct r/D baseline once; the rank
    axis; a legend naming at most MAX_LEGEND_LAYERS layers and the reference lines drawn."""
    ranks_seen: set[int] = set()
    baselines: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    handles = []
    drawn_at = [k for k, (_, v) in enumerate(sel) if _rows(v)]
    shown = {drawn_at[j] for j in _legend_layers(len(drawn_at))}
    band = mean_only = False
    for k, ((name, entries), colour) in enumerate(zip(sel, colours, strict=True)):
        rows = _rows(entries)
        if not rows:
            continue
        x = np.asarray([float(r["rank"]) for r in rows])
        ranks_seen |= {int(r["rank"]) for r in rows}
        line, layer_band, layer_mean_only = _draw_layer_energy(ax, x, rows, colour, name)
        band, mean_only = band or layer_band, mean_only or layer_mean_only
        if k in shown:
            handles.append(line)
        b = _baseline(rows)
        key = tuple(zip(x.tolist(), np.round(b, 12).tolist(), strict=True))
        if np.isfinite(b).any() and key not in baselines:
            baselines[key] = (x, b)
    for x, b in baselines.values():
        ax.plot(x, b, color="black", linestyle="--", linewidth=1.1, gid="baseline", label="_r/D")
    _rank_axis(ax, sorted(ranks_seen) or [int(r) for r in ge.get("ranks") or [] if is_number(r) and r > 0])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("rank r of the activation subspace")
    ax.set_ylabel("captured gradient energy E")
    ax.set_title(plain_text(title), loc="left")
    _energy_legend(ax, handles, len(drawn_at), band, mean_only, own)


def _draw_layer_energy(
    ax, x: np.ndarray, rows: Sequence[dict], colour, name: str
) -> tuple[Line2D, bool, bool]:
    """One gradient layer's curves at ranks ``x``: its controls' mean ± SD as a band where both are
    given, the mean alone (dash-dotted) where only it is, E_max dotted and E; returns (the E line,
    whether a band was drawn, whether a mean alone was)."""
    mean, sd = _column(rows, "control_energy_mean"), _column(rows, "control_energy_sd")
    has_sd = np.isfinite(mean) & np.isfinite(sd)
    band = bool(has_sd.any())
    if band:
        ax.fill_between(
            x, mean - sd, mean + sd, where=has_sd, color=colour, alpha=_BAND_ALPHA, linewidth=0, gid="control"
        )
    mean_only = bool((np.isfinite(mean) & ~has_sd).any())
    if mean_only:
        ax.plot(
            x,
            np.where(has_sd, np.nan, mean),
            color=colour,
            alpha=0.5,
            linewidth=0.8,
            linestyle="-.",
            marker=".",
            markersize=3,
            gid="control_mean",
            label=f"_{plain_text(name)}",
        )
    emax = _column(rows, "energy_max")
    if np.isfinite(emax).any():
        ax.plot(
            x,
            emax,
            color=colour,
            alpha=_EMAX_ALPHA,
            linewidth=0.9,
            linestyle=":",
            gid="energy_max",
            label=f"_{plain_text(name)}",
        )
    e = _column(rows, "energy")
    (line,) = ax.plot(
        x, e, color=colour, linewidth=1.5, marker="o", markersize=3.5, gid="energy", label=plain_text(name)
    )
    return line, band, mean_only


def _rank_axis(ax, ranks: Sequence[int]) -> None:
    """A log rank axis with a tick at each of ``ranks`` (a range around a single one)."""
    ax.set_xscale("log")
    if ranks:
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.xaxis.set_minor_locator(NullLocator())
        if len(ranks) == 1:
            ax.set_xlim(ranks[0] / 1.5, ranks[0] * 1.5)


def _energy_legend(ax, handles: list, n_drawn: int, band: bool, mean_only: bool, own: bool) -> None:
    """The E panel's legend: the layers' lines in ``handles`` (of ``n_drawn`` drawn), then r/D, E_max
    and the controls' band or mean where drawn; outside the panel on a figure of our own."""
    refs = [Line2D([], [], color="black", linestyle="--", label="r/D (isotropic)")]
    refs.append(Line2D([], [], color="0.4", alpha=_EMAX_ALPHA + 0.2, linestyle=":", label="E_max"))
    if band:
        refs.append(Patch(color="0.5", alpha=0.3, label="controls mean ± SD"))
    if mean_only:
        refs.append(Line2D([], [], color="0.4", linestyle="-.", label="controls mean"))
    layer_title = "layer" if len(handles) == n_drawn else f"layer ({len(handles)} of {n_drawn})"
    ax.legend(
        handles=handles + refs,
        labels=[short_or(h.get_label()) for h in handles]
        + [r.get_label() for r in refs],  # (lines' labels: escaped)
        loc="upper left" if own else "best",
        bbox_to_anchor=(1.01, 1.0) if own else None,
        fontsize=7,
        title=layer_title,
        title_fontsize=7,
    )


def short_or(name: str) -> str:
    """Legend label of a gradient layer: the name without ``.grad``."""
    return activation_name(name)


def _draw_kappa(ax, ge: dict, sel) -> None:
    names = [name for name, _ in sel]
    x = np.arange(len(names), dtype=float)
    by_rank: dict[int, np.ndarray] = {}
    for pos, (_, entries) in enumerate(sel):
        for r in _rows(entries):
            rank = int(r["rank"])
            by_rank.setdefault(rank, np.full(len(names), np.nan))[pos] = _num(r.get("kappa"))
    order = [int(r) for r in ge.get("ranks") or [] if is_number(r) and int(r) in by_rank]
    order += sorted(set(by_rank) - set(order))
    ax.axhline(0.0, color="0.35", linestyle="--", linewidth=0.9, gid="kappa_ref")
    ax.axhline(1.0, color="0.35", linestyle=":", linewidth=0.9, gid="kappa_ref")
    drawn = False
    for j, rank in enumerate(order):
        y = by_rank[rank]
        if not np.isfinite(y).any():
            continue
        style = series_style(j)
        ax.plot(
            x,
            y,
            color=style["color"],
            marker=style["marker"],
            markersize=4,
            linewidth=1.4,
            gid="kappa",
            label=f"r = {rank}",
        )
        drawn = True
    ticks = _short_labels(names)
    step = max(1, int(np.ceil(len(names) / 16)))
    ax.set_xticks(x[::step], [plain_text(shown_name(t)) for t in ticks[::step]])
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("κ = (E − r/D) / (E_max − r/D)")
    ax.set_title("kappa: 0 = isotropic, 1 = best rank-r subspace", loc="left")
    if drawn:
        ax.legend(loc="best", fontsize=7, title="rank", title_fontsize=7)


def _caption(reports: Sequence[dict], selected, labels: Sequence[str]) -> str:
    ks = sorted(
        {
            int(r["controls"])
            for sel in selected
            for _, v in sel
            for r in _rows(v)
            if is_number(r.get("controls")) and r["controls"] > 0
        }
    )
    text = (
        "E: share of the gradients' uncentred second moment in the span of the top-r eigenvectors of "
        "the basis run's activation covariance; E_max: the top-r eigenvalues' share of it; r/D: a "
        "random subspace's expectation."
    )
    if ks:
        k = f"{ks[0]}" if len(ks) == 1 else f"{ks[0]}–{ks[-1]}"
        text += f" Bands: mean ± SD of E over K = {k} random rank-r subspaces orthogonal to the top-r one."
    gaps = []
    for rep, sel, lab in zip(reports, selected, labels, strict=True):
        notes = rep["gradient_energy"].get("notes") or {}
        for name, v in sel:
            if not (isinstance(v, list) and v):
                gaps.append(
                    f"{short_or(name)}"
                    + (f" of {lab}" if len(reports) > 1 else "")
                    + f" ({notes.get(name) or 'no reason recorded'})"
                )
    if gaps:
        text += " No values: " + "; ".join(gaps[:3]) + ("; …" if len(gaps) > 3 else "") + "."
    return text
