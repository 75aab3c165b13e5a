"""``geomscope export RUN --to arrow|npy DIR``: a run in other tools' formats. A thin wrapper over
:func:`geomscope.export.export_run`."""

from __future__ import annotations

from pathlib import Path

import typer

from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import (
    json_option,
    options_from,
    out_option,
    quiet_option,
    selection,
)
from geomscope.export_options import ExportOptions


@app.command("export")
@options_from(ExportOptions, complete={"layers": _complete.run_layers}, repeated=("layers",))
def export_cmd(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A finished run written by `geomscope extract`."
    ),
    out: Path = out_option("DIR", "A new (or empty) directory to write; never overwritten."),
    as_json: bool = json_option("the export summary"),
    quiet: bool = quiet_option("No progress or summary on stderr."),
    **chosen,
) -> None:
    """Write a run's rows for other tools, with document id, position, token id and special-token
    columns beside each layer's vectors (same row order). Streams shard by shard; written to a
    temporary directory and renamed into place when complete."""
    import json

    from geomscope.export import export_run
    from geomscope.progress import command_output, silent

    layers = selection(chosen.pop("layers"))
    options = ExportOptions(**chosen, layers=layers).validate()
    progress, log = command_output(quiet)
    summary = export_run(run_dir, out, options, progress=progress, log=silent if as_json else log)
    if as_json:
        typer.echo(json.dumps(summary))
