"""``geomscope plot``: figures from score reports (or training logs).  Thin wrapper over
:func:`geomscope.plot.plot_files`; matplotlib is imported only inside the command."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from geomscope.cli._app import app


def _split(values: Optional[List[str]]) -> list[str]:
    """Accept repeated options and comma-separated lists alike."""
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


@app.command("plot")
def plot_cmd(
    inputs: List[str] = typer.Argument(..., metavar="REPORT",
                                       help="Score report JSON files (or finetune output dirs / steps.jsonl)."),
    out: str = typer.Option(..., "--out", "-o",
                            help="FILE.png|svg|pdf for one figure, or DIR/ for one file per kind."),
    kind: Optional[List[str]] = typer.Option(
        None, "--kind", "-k",
        help="auto|layers|spectrum|outliers|trajectory|training (repeat or comma-separate; default auto)."),
    metrics: Optional[List[str]] = typer.Option(
        None, "--metrics", "-m",
        help="Metrics to draw (comma-separated); default isoscore_star,isoscore,avgcos,twonn where present."),
    layers: Optional[List[str]] = typer.Option(None, "--layers", help="Only these layers (names or indices)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="png|svg|pdf for DIR/ output (default png)."),
    dpi: int = typer.Option(150, "--dpi", help="Resolution of raster output."),
    log_x: Optional[bool] = typer.Option(
        None, "--log-x/--linear-x",
        help="Trajectory: log (step 0 kept) or linear step axis; default log when steps span 2 decades."),
    normalise: bool = typer.Option(False, "--normalise",
                                   help="Spectrum: explained-variance ratio against index / D."),
    top_k: int = typer.Option(40, "--top-k", help="Outliers: show at most this many dimensions."),
    as_json: bool = typer.Option(False, "--json", help='Print one JSON object {"figures": list of paths, "kinds": list of kinds} to stdout.'),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not list the written files on stderr."),
) -> None:
    """Draw metric-by-layer curves, eigenspectra, outlier-dimension heat maps, checkpoint trajectories
    or training curves."""
    from geomscope.plot import plot_files

    written = plot_files(
        inputs, out, kinds=_split(kind) or ["auto"], fmt=fmt, dpi=dpi, metrics=_split(metrics) or None,
        layers=_split(layers) or None, log_x=log_x, normalise=normalise, top_k=top_k,
    )
    if not quiet:
        for w in written:
            typer.echo(f"wrote {w['kind']}: {w['path']}", err=True)
    if as_json:
        typer.echo(json.dumps({"figures": [w["path"] for w in written], "kinds": [w["kind"] for w in written]}))
