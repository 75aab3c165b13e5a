"""The anisotropy diagnostics of ``score`` against layer: one panel per family a report holds
(all-but-the-top, whitening, rogue dimensions, massive activations, similarity with the previous
layer, frequency and position bins, contextuality, local isotropy), each panel's lines the family's
metrics (and, where the family is a correction, the uncorrected metric beside it), ±1 SE bars."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from geomscope.errors import InputError
from geomscope.plot._reports import check_common_layers, is_number, report_labels, report_name, select_layers
from geomscope.plot._style import (
    grid_shape,
    hide_spare_panels,
    layer_errorbar,
    panels,
    plain_text,
    series_style,
    styled,
)
from geomscope.plot.layers import layer_series
from geomscope.schema import diagnostic_keys, metric_label


def _abtt(keys: list[str]) -> list[str]:
    ks = sorted({int(m.group(1)) for k in keys if (m := re.match(r"^abtt(\d+)_isoscore$", k))})
    return ["isoscore"] + [f"abtt{k}_isoscore" for k in ks]


def _bins(keys: list[str], short: str) -> list[str]:
    return [k for k in keys if re.match(rf"^{short}\d+_avgcos$", k)]


#: (panel title, the metrics it draws from the keys present, log scale)
PANELS = (
    ("All-but-the-top: IsoScore after removing k directions", _abtt, False),
    ("Whitening: average cosine", lambda keys: ["avgcos", "avgcos_centred", "whitened_avgcos"], False),
    (
        "Rogue dimensions: share of the average cosine",
        lambda keys: ["rogue_top1_share", "rogue_top3_share"],
        False,
    ),
    ("Massive activations: largest |x| / median |x|", lambda keys: ["massive_ratio"], True),
    ("Similarity with the previous layer", lambda keys: ["cka_prev", "rsa_prev"], False),
    ("Average cosine by token-frequency bin", lambda keys: _bins(keys, "freq"), False),
    ("Average cosine by position bin", lambda keys: _bins(keys, "pos"), False),
    (
        "Contextuality, less the anisotropy baseline",
        lambda keys: ["selfsim_adj", "intrasim_adj", "mev_adj"],
        False,
    ),
    (
        "Local isotropy (within k-means clusters)",
        lambda keys: ["isoscore", "local_isoscore", "local_avgcos_centred"],
        False,
    ),
)
#: the metric of each panel that says the family is present (the others are context)
_OWN = {
    0: "abtt",
    1: "whitened_",
    2: "rogue_",
    3: "massive_",
    4: "cka_prev",
    5: "freq",
    6: "pos",
    7: "selfsim",
    8: "local_",
}


def has_diagnostics(rep: dict) -> bool:
    """A report with a value of some diagnostic family's metric."""
    layers = rep.get("layers") or []
    return any(is_number(e.get(k)) for k in diagnostic_keys(layers) for e in layers)


def _chosen(reports: Sequence[dict]) -> list[tuple[str, list[str], bool]]:
    keys = []
    for r in reports:
        keys += [k for k in diagnostic_keys(r["layers"]) if k not in keys]
    out = []
    for i, (title, metrics_of, log) in enumerate(PANELS):
        own = [k for k in keys if k.startswith(_OWN[i])]
        if not own:
            continue
        present = [
            m for m in metrics_of(keys) if any(is_number(e.get(m)) for r in reports for e in r["layers"])
        ]
        if present:
            out.append((title, present, log))
    return out


@styled
def plot_diagnostics(reports: Sequence[dict], *, layers: Sequence[str] | None = None) -> Figure:
    """One panel per diagnostic family the reports hold, the family's metrics against layer index,
    one line per (report, metric), ±1 SE bars where the report gives them."""
    reports = select_layers(reports, layers)
    check_common_layers(reports)
    chosen = _chosen(reports)
    if not chosen:
        names = report_name(reports[0]) if reports else "the reports"
        raise InputError(f"{names} holds no diagnostics; rescore it with --metrics all (or a diagnostic)")
    labels = report_labels(reports)
    nrows, ncols = grid_shape(len(chosen))
    fig, axes, _ = panels(None, len(chosen), 4.6 * ncols, 3.3 * nrows + 0.6)
    for n, (title, metrics, log) in enumerate(chosen):
        ax = axes[n // ncols][n % ncols]
        i = 0
        for rep, lab in zip(reports, labels, strict=True):
            for m in metrics:
                x, y, se = layer_series(rep, m)
                if np.all(np.isnan(y)):
                    continue
                name = metric_label(m) + (f" ({lab})" if len(reports) > 1 else "")
                layer_errorbar(ax, x, y, se, name, series_style(i), size=3.5, width=1.3, bar=0.9)
                i += 1
        if log:
            ax.set_yscale("log")
        ax.set_title(plain_text(title), fontsize=9)
        ax.set_xlabel("layer index")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best", fontsize=6, frameon=True, framealpha=0.8)
    hide_spare_panels(axes, len(chosen))
    fig.suptitle(
        "Anisotropy diagnostics by layer" + (f": {plain_text(labels[0])}" if len(reports) == 1 else ""),
        fontsize=11,
    )
    return fig
