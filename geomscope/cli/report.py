"""``geomscope report REPORT... --html FILE.html``: one self-contained page to share. A thin wrapper
over :func:`geomscope.htmlreport.write_html`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from geomscope import choices
from geomscope.cli._app import app
from geomscope.cli._options import json_option, quiet_option, split_list


@app.command("report")
def report_cmd(
    inputs: List[str] = typer.Argument(
        ..., metavar="REPORT", help="Score report JSON files (or directories holding report.json)."
    ),
    html_out: Path = typer.Option(..., "--html", metavar="FILE.html", help="The page to write."),
    kind: Optional[List[str]] = typer.Option(
        None,
        "--kind",
        "-k",
        metavar="LIST",
        help=f"Figures: {'|'.join(k for k in choices.PLOT_KINDS if k != 'training')} "
        "(comma list; default auto: every kind the reports support).",
    ),
    title: Optional[str] = typer.Option(None, "--title", metavar="TEXT", help="Page title."),
    as_json: bool = json_option('{"html": path, "reports": n}'),
    quiet: bool = quiet_option("Do not name the written file on stderr."),
) -> None:
    """Write one self-contained HTML page (no network needed to view it): provenance, parameters, the
    per-layer table with standard errors, the notes on null metrics, and every figure `plot` draws
    for these reports."""
    from geomscope.htmlreport import write_html
    from geomscope.plot import read_report

    reports = [read_report(p) for p in inputs]
    path = write_html(reports, html_out, kinds=split_list(kind) or ["auto"], title=title)
    if not quiet:
        typer.echo(f"wrote {path}", err=True)
    if as_json:
        typer.echo(json.dumps({"html": str(path), "reports": len(reports)}))
