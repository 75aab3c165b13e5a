"""``geomscope plot``: figures from score reports (or training logs).  Thin wrapper over
:func:`geomscope.plot.plot_files`; matplotlib is imported only inside the command."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from geomscope import choices
from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import (
    STORED_LAYERS_HELP,
    FigureFormat,
    json_option,
    layers_option,
    metrics_option,
    quiet_option,
    split_list,
    value,
)
from geomscope.options import choice_metavar

REPORT_HELP = "Score report JSON files, a trajectory.csv (or finetune output dirs / steps.jsonl)."
KIND_HELP = f"{' | '.join(choices.PLOT_KINDS)} (repeat or comma-separate; default auto)."
METRICS_HELP = "Metrics to draw (comma list); default isoscore_star,isoscore,avgcos,twonn where present."
LOG_X_HELP = "Trajectory: log (step 0 kept) or linear step axis; default log when steps span 2 decades."


@app.command("plot")
def plot_cmd(
    inputs: List[str] = typer.Argument(..., metavar="REPORT", help=REPORT_HELP),
    out: str = typer.Option(
        ...,
        "--out",
        "-o",
        metavar="FILE|DIR/",
        help="FILE.png|svg|pdf for one figure, or DIR/ for one file per kind.",
    ),
    kind: Optional[List[str]] = typer.Option(None, "--kind", "-k", metavar="LIST", help=KIND_HELP),
    metrics: Optional[List[str]] = metrics_option(None, METRICS_HELP, _complete.plot_metrics),
    layers: Optional[List[str]] = layers_option(None, STORED_LAYERS_HELP, _complete.report_layers),
    fmt: Optional[FigureFormat] = typer.Option(
        None,
        "--format",
        metavar=choice_metavar(choices.FIGURE_FORMATS),
        help="Image format for DIR/ output (default png).",
    ),
    dpi: int = typer.Option(
        150,
        "--dpi",
        metavar="N",
        min=choices.DPI_RANGE[0],
        max=choices.DPI_RANGE[1],
        help="Resolution of raster output, dots per inch.",
    ),
    log_x: Optional[bool] = typer.Option(None, "--log-x/--linear-x", help=LOG_X_HELP),
    normalise: bool = typer.Option(
        False, "--normalise", help="Spectrum: explained-variance ratio against index / D."
    ),
    top_k: int = typer.Option(
        40, "--top-k", min=1, metavar="N", help="Outliers: show at most this many dimensions."
    ),
    as_json: bool = json_option('{"figures": [paths], "kinds": [kinds]}'),
    quiet: bool = quiet_option("Do not list the written files on stderr."),
) -> None:
    """Draw metric-by-layer curves, eigenspectra, outlier-dimension heat maps, checkpoint trajectories,
    gradient energy in the activation subspace or training curves."""
    from geomscope.plot import plot_files

    written = plot_files(
        inputs,
        out,
        kinds=split_list(kind) or ["auto"],
        fmt=value(fmt),
        dpi=dpi,
        metrics=split_list(metrics) or None,
        layers=split_list(layers) or None,
        log_x=log_x,
        normalise=normalise,
        top_k=top_k,
    )
    if not quiet:
        for w in written:
            typer.echo(f"wrote {w['kind']}: {w['path']}", err=True)
    if as_json:
        typer.echo(
            json.dumps({"figures": [w["path"] for w in written], "kinds": [w["kind"] for w in written]})
        )
