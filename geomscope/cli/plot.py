"""``geomscope plot``: figures from score reports (or training logs).  Thin wrapper over
:func:`geomscope.plot.plot_files`; each option of :class:`~geomscope.plot.options.PlotOptions` is
built from its declaration, and matplotlib is imported only inside the command."""

from __future__ import annotations

import json
from typing import List

import typer

from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import json_option, options_from, out_option, quiet_option, selection
from geomscope.plot.options import PlotOptions

REPORT_HELP = "Score report JSON files, a trajectory.csv (or finetune output dirs / steps.jsonl)."


@app.command("plot")
@options_from(
    PlotOptions,
    complete={"metrics": _complete.plot_metrics, "layers": _complete.report_layers},
    repeated=("kinds", "metrics", "layers"),
)
def plot_cmd(
    inputs: List[str] = typer.Argument(..., metavar="REPORT", help=REPORT_HELP),
    out: str = out_option("FILE|DIR/", "FILE.png|svg|pdf for one figure, or DIR/ for one file per kind."),
    as_json: bool = json_option('{"figures": [paths], "kinds": [kinds]}'),
    quiet: bool = quiet_option("Do not list the written files on stderr."),
    **chosen,
) -> None:
    """Draw metric-by-layer curves, eigenspectra, outlier-dimension heat maps, checkpoint trajectories,
    gradient energy in the activation subspace or training curves."""
    from geomscope.plot import plot_files

    written = plot_files(inputs, out, PlotOptions(**{**chosen, "layers": selection(chosen["layers"])}))
    if not quiet:
        for w in written:
            typer.echo(f"wrote {w['kind']}: {w['path']}", err=True)
    if as_json:
        typer.echo(
            json.dumps({"figures": [w["path"] for w in written], "kinds": [w["kind"] for w in written]})
        )
