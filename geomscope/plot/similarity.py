"""Similarity between layers: heat maps of linear CKA and RSA between every pair of layers (the
report's ``similarity`` section, ``score --metrics similarity``), one row of panels per report."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from geomscope.errors import InputError
from geomscope.formatting import shown_name
from geomscope.plot._reports import report_labels, report_name
from geomscope.plot._style import panels, plain_text, styled, wrap_title

HEAT_CMAP = "cividis"  # designed for colour-vision deficiency
METHODS = (("cka", "linear CKA"), ("rsa", "RSA (Spearman)"))


def has_similarity(rep: dict) -> bool:
    sec = rep.get("similarity")
    return isinstance(sec, dict) and isinstance(sec.get("cka"), list) and bool(sec.get("layers"))


def _matrix(rep: dict, method: str, layers: Sequence[str] | None) -> tuple[np.ndarray, list[str]]:
    """The (L, L) matrix of ``method`` and its layer names, cut to ``layers`` where given."""
    sec = rep["similarity"]
    names = list(sec["layers"])
    m = np.array([[np.nan if v is None else float(v) for v in row] for row in sec[method]], dtype=float)
    if layers:
        keep = [i for i, n in enumerate(names) if n in set(layers)]
        m, names = m[np.ix_(keep, keep)], [names[i] for i in keep]
    return m, names


@styled
def plot_similarity(reports: Sequence[dict], *, layers: Sequence[str] | None = None) -> Figure:
    """Linear CKA and RSA between every pair of layers, one row of two panels per report (colour scale
    0 to 1, the values written in the cells while there are at most 16 layers)."""
    missing = [report_name(r) for r in reports if not has_similarity(r)]
    if missing:
        raise InputError(
            f"{missing[0]} has no similarity section; rescore it with --metrics including similarity"
        )
    labels = report_labels(reports)
    size = max(len(r["similarity"]["layers"]) for r in reports)
    side = min(6.0, max(3.2, 0.35 * size + 1.8))
    fig, grid, _ = panels(None, 2 * len(reports), 2 * side + 1.0, side * len(reports) + 0.6, max_cols=2)
    for row, (rep, label) in enumerate(zip(reports, labels, strict=True)):
        for col, (method, title) in enumerate(METHODS):
            ax = grid[row, col]
            m, names = _matrix(rep, method, layers)
            im = ax.imshow(m, vmin=0.0, vmax=1.0, cmap=HEAT_CMAP, interpolation="nearest")
            ticks = [plain_text(shown_name(n)) for n in names]
            ax.set_xticks(range(len(names)), ticks, rotation=90)
            ax.set_yticks(range(len(names)), ticks)
            ax.grid(False)
            if len(names) <= 16:
                for (i, j), v in np.ndenumerate(m):
                    if np.isfinite(v):
                        ax.text(
                            j,
                            i,
                            f"{v:.2f}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="black" if v > 0.6 else "white",
                        )
            rows = rep["similarity"].get("rows")
            ax.set_title(plain_text(title + (f", {rows} rows" if rows else "")))
            if col == 0 and len(reports) > 1:
                ax.set_ylabel(plain_text(wrap_title(label, 30)))
            fig.colorbar(im, ax=ax, pad=0.01, fraction=0.045)
    head = "Similarity between layers (the same sample rows in every layer)"
    fig.suptitle(plain_text(head if len(reports) > 1 else f"{labels[0]}\n{head}"), fontsize=10)
    return fig
