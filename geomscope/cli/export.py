"""``geomscope export RUN --to arrow|npy DIR``: a run in other tools' formats. A thin wrapper over
:func:`geomscope.export.export_run`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import declared_option, json_option, quiet_option, selection
from geomscope.export_options import ExportOptions


@app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A finished run written by `geomscope extract`."
    ),
    to: str = declared_option(ExportOptions, "to"),
    out: Path = typer.Option(
        ..., "--out", "-o", metavar="DIR", help="A new (or empty) directory to write; never overwritten."
    ),
    layers: Optional[List[str]] = declared_option(
        ExportOptions, "layers", _complete.run_layers, repeated=True
    ),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="Skip the shard checksum check (size is still checked)."
    ),
    as_json: bool = json_option("the export summary"),
    quiet: bool = quiet_option("No progress or summary on stderr."),
) -> None:
    """Write a run's rows for other tools, with document id, position, token id and special-token
    columns beside each layer's vectors (same row order). Streams shard by shard; written to a
    temporary directory and renamed into place when complete."""
    import json
    import sys

    from geomscope.export import export_run
    from geomscope.formatting import counted
    from geomscope.progress import Progress
    from geomscope.store import Run

    options = ExportOptions(to=to, layers=selection(layers), verify=not no_verify).validate()
    total = Run(run_dir).total_rows if not quiet else 0
    with Progress(enabled=not quiet) as prog:
        bar = prog.add("exporting", total, unit="rows", rate_unit="rows")
        summary = export_run(run_dir, out, options, progress=bar.advance if not quiet else None)
        bar.complete()
    if as_json:
        typer.echo(json.dumps(summary))
    elif not quiet:
        print(
            f"exported {counted(summary['rows'], 'row')} x {counted(len(summary['layers']), 'layer')} "
            f"to {out} ({options.to})",
            file=sys.stderr,
        )
