"""The figure of ``geomscope compare``: the outcome (accuracy; F1 for QA; perplexity, lower is better,
for a causal LM) against eval IsoScore* (one point per run, colour by
lambda, marker by regulariser, the fitted line with a bootstrap band that resamples configurations
where the design supports an interval), and accuracy and IsoScore* against lambda (mean ± SD over
seeds per regulariser)."""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.figure import Figure

from geomscope.plot.options import DEFAULT_DPI
from geomscope.study import stats

MARKERS = {"istar": "o", "cosreg": "s", "none": "^"}
#: the largest value of a bounded outcome (QA scores are percentages); perplexity has none
_SCALE_TOP = {"accuracy": 1.0, "macro_f1": 1.0, "f1": 100.0, "exact_match": 100.0}


def study_png(result: dict, *, dpi: int = DEFAULT_DPI) -> bytes:
    """The figure as PNG bytes, marked as geomscope's (:func:`geomscope.plot.figures.is_figure`), drawn
    before compare writes anything, so that a figure that cannot be drawn leaves no outputs of this
    comparison beside older ones: InputError, one line, for data matplotlib cannot draw."""
    from geomscope.errors import InputError
    from geomscope.plot.figures import close_figure
    from geomscope.schema import FIGURE_CREATOR

    fig = None
    buf = io.BytesIO()
    try:
        # values near the float range's ends overflow in matplotlib's margins and numpy's quantiles:
        # what cannot be drawn raises below, the rest would only print RuntimeWarnings to stderr
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            fig = study_figure(result)
            # "Software" is where save_figure records a PNG's creator
            fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": FIGURE_CREATOR})
    except (ValueError, ArithmeticError) as e:  # mathtext, axis limits, LinAlgError: ValueErrors
        why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "no detail")
        raise InputError(
            f"cannot draw the comparison's figure ({type(e).__name__}: {why}); nothing was written: "
            "check the runs' reg, lambda and final values in their summary.json"
        ) from None
    finally:
        if fig is not None:
            close_figure(fig)
    return buf.getvalue()


def _label(reg: str) -> str:
    """A regulariser's name (from each run's summary.json) as a legend shows it: control characters as
    escapes, ``$`` literal (not the start of mathtext, which may not parse), and a leading ``_``
    kept (matplotlib leaves a label that starts with ``_`` out of the legend)."""
    from geomscope.formatting import shown
    from geomscope.plot._style import plain_text

    text = plain_text(shown(reg, markup=False))
    return " " + text if text.startswith("_") else text


def study_figure(result: dict, ax=None) -> Figure:
    """Two panels (or, with ``ax`` = a pair of Axes, drawn into the caller's figure)."""
    if ax is None:
        fig = Figure(figsize=(10, 4), layout="constrained")
        ax = fig.subplots(1, 2)
    else:
        fig = ax[0].figure
    _scatter(ax[0], result)
    _by_lambda(ax[1], result)
    fig.suptitle(result["sentence"], fontsize=8, wrap=True)
    return fig


def _outcome(result: dict) -> tuple[str, str]:
    """The outcome key (accuracy; F1 for question answering; perplexity for a causal LM) and its axis
    label (which says "lower is better" where it is)."""
    from geomscope.study.compare import LABELS, LOWER_IS_BETTER

    key = result.get("outcome", "accuracy")
    return key, LABELS[key] + (", lower is better" if key in LOWER_IS_BETTER else "")


def _scatter(ax, result: dict) -> None:
    key, label = _outcome(result)
    runs = [r for r in result["runs"] if r[key] is not None and r["isoscore_star"] is not None]
    import matplotlib

    lams = sorted({r["lambda"] for r in runs})
    cmap = matplotlib.colormaps["coolwarm"]
    # lambdas of +-1e308 span more than a float: their colour scale would divide by inf
    spread = len(lams) > 1 and math.isfinite(lams[-1] - lams[0])
    norm = matplotlib.colors.Normalize(lams[0], lams[-1]) if spread else None
    for reg in sorted({r["reg"] for r in runs}):
        mine = [r for r in runs if r["reg"] == reg]
        colours = [cmap(norm(r["lambda"])) if norm else "C0" for r in mine]
        ax.scatter(
            [r["isoscore_star"] for r in mine],
            [r[key] for r in mine],
            c=colours,
            marker=MARKERS.get(reg, "D"),
            edgecolors="k",
            linewidths=0.5,
            label=_label(reg),
            zorder=3,
        )
    x = np.array([r["isoscore_star"] for r in runs])
    y = np.array([r[key] for r in runs])
    grid = np.linspace(x.min(), x.max(), 50) if x.size else x
    assoc = result.get("association", {})  # the resamples and seed --bootstrap and --seed set
    groups = [(r["reg"], r["lambda"]) for r in runs]
    band = stats.line_fit_band(
        x, y, grid, groups=groups, n_boot=assoc.get("n_boot", 1000), seed=assoc.get("seed", 0)
    )
    if band is not None:
        fit, lo, hi = band
        k, fewest = stats.design_of(groups)
        if k >= stats.MIN_CONFIGURATIONS and fewest >= stats.MIN_SEEDS:
            ax.plot(grid, fit, color="0.3", lw=1)
            band_label = "least-squares fit, 95% band (configurations)"
            ax.fill_between(grid, lo, hi, color="0.6", alpha=0.3, lw=0, label=band_label)
        else:  # as the correlation's interval: no band the design cannot support
            ax.plot(grid, fit, color="0.3", lw=1, label="least-squares fit (too few runs for a band)")
    if y.size:  # the band may run far past the data where x has few distinct values: show the data's range
        top = _SCALE_TOP.get(key, math.inf)
        pad = max(0.02 * (top if math.isfinite(top) else float(np.abs(y).max())), 0.1 * float(np.ptp(y)))
        ax.set_ylim(max(0.0, y.min() - pad), min(top, y.max() + pad))
    if norm is not None:
        sm = matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap)
        ax.figure.colorbar(sm, ax=ax, label="lambda")
    ax.set_xlabel("eval IsoScore*")
    ax.set_ylabel(f"eval {label}")
    ax.legend(fontsize=7)


def _by_lambda(ax, result: dict) -> None:
    key, label = _outcome(result)
    twin = ax.twinx()
    for i, reg in enumerate(sorted({r["reg"] for r in result["table"]})):
        rows = sorted((r for r in result["table"] if r["reg"] == reg), key=lambda r: r["lambda"])
        lam = [r["lambda"] for r in rows]
        for axis, metric, style in ((ax, key, "-"), (twin, "isoscore_star", "--")):
            mean = np.array([np.nan if r[f"{metric}_mean"] is None else r[f"{metric}_mean"] for r in rows])
            sd = np.array([0.0 if r[f"{metric}_sd"] is None else r[f"{metric}_sd"] for r in rows])
            axis.errorbar(
                lam,
                mean,
                yerr=sd,
                ls=style,
                marker=MARKERS.get(reg, "D"),
                color=f"C{i}",
                capsize=2,
                label=f"{_label(reg)}: {label if metric == key else 'IsoScore*'}",
            )
    ax.set_xlabel("lambda")
    ax.set_ylabel(f"eval {label} (solid)")
    twin.set_ylabel("eval IsoScore* (dashed)")
    lines = ax.get_legend_handles_labels()
    lines2 = twin.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7)
