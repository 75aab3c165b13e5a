"""Similarity between layers: heat maps of linear CKA and RSA between every pair of layers (the
report's ``similarity`` section, ``score --metrics similarity``), one row of panels per report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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


# ----------------------------------------------------------------------- across runs
def is_similarity_file(path) -> bool:
    """A ``similarity.json`` of ``score DIR --metrics similarity`` (by its format tag)."""
    from geomscope.outputs import HEAD_BYTES, json_format_is
    from geomscope.schema import SIMILARITY_FORMAT

    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return json_format_is(SIMILARITY_FORMAT)(f.read(HEAD_BYTES))


def read_similarity(path) -> dict:
    """A ``similarity.json``, checked to be shaped as score writes it; InputError (one line) otherwise."""
    from geomscope.fileio import read_json
    from geomscope.schema import similarity_file_defect

    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {path} ({str(e).splitlines()[0][:160]})") from None
    why = similarity_file_defect(data)
    if why:
        raise InputError(f"{path} is a damaged similarity.json ({why}); score the runs again")
    return data


@styled
def plot_run_similarity(results: Sequence[dict], *, layers: Sequence[str] | None = None) -> Figure:
    """Linear CKA between the runs (revisions) of each layer of ``similarity.json`` results: one heat
    map per layer (runs x runs), colour scale 0 to 1."""
    panels_: list[tuple[str, np.ndarray, list[str]]] = []
    for res in results:
        revisions = res.get("revisions") or []
        distinct = len(set(revisions)) == len(res["names"])  # (else the runs' folder names)
        names = [shown_name(n) for n in (revisions if distinct else res["names"])]
        for layer, sec in res["layers"].items():
            if sec is None or (layers and layer not in set(layers)):
                continue
            panels_.append((layer, np.array(sec["cka"], dtype=float), names))
    if not panels_:
        raise InputError("no layer of these similarity files has values to draw")
    side = min(4.0, max(2.4, 0.3 * max(len(p[2]) for p in panels_) + 1.4))
    fig, grid, _ = panels(None, len(panels_), 3 * side + 1, side * -(-len(panels_) // 3) + 0.6)
    axes = grid.ravel()
    for ax, (layer, m, names) in zip(axes, panels_, strict=False):
        im = ax.imshow(m, vmin=0.0, vmax=1.0, cmap=HEAT_CMAP, interpolation="nearest")
        ticks = [plain_text(n) for n in names]
        ax.set_xticks(range(len(names)), ticks, rotation=90, fontsize=6)
        ax.set_yticks(range(len(names)), ticks, fontsize=6)
        ax.grid(False)
        ax.set_title(plain_text(shown_name(layer)), fontsize=9)
        fig.colorbar(im, ax=ax, pad=0.01, fraction=0.045)
    for ax in axes[len(panels_) :]:
        ax.set_visible(False)
    fig.suptitle("Linear CKA of each layer between runs (the same sample rows in every run)", fontsize=10)
    return fig
