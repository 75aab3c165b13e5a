"""``geomscope report REPORT... --html FILE.html``: one self-contained page to share. A thin wrapper
over :func:`geomscope.htmlreport.write_html`; each option of
:class:`~geomscope.htmlreport.ReportOptions` is built from its declaration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import typer

from geomscope.cli._app import app
from geomscope.cli._options import json_option, options_from, quiet_option
from geomscope.htmlreport import ReportOptions, write_html


@app.command("report")
@options_from(ReportOptions, repeated=("kinds",))
def report_cmd(
    inputs: List[str] = typer.Argument(
        ..., metavar="REPORT", help="Score report JSON files (or directories holding report.json)."
    ),
    html_out: Path = typer.Option(..., "--html", metavar="FILE.html", help="The page to write."),
    as_json: bool = json_option('{"html": path, "reports": n}'),
    quiet: bool = quiet_option("Do not name the written file on stderr."),
    **chosen,
) -> None:
    """Write one self-contained HTML page (no network needed to view it): provenance, parameters, the
    per-layer table with standard errors, the notes on null metrics, and every figure `plot` draws
    for these reports."""
    from geomscope.plot import read_report

    options = ReportOptions(**chosen).validate()
    reports = [read_report(p) for p in inputs]
    path = write_html(reports, html_out, options)
    if not quiet:
        typer.echo(f"wrote {path}", err=True)
    if as_json:
        typer.echo(json.dumps({"html": str(path), "reports": len(reports)}))
