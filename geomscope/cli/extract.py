"""``geomscope extract MODEL INPUT... --out RUN_DIR``: a thin wrapper over
:func:`geomscope.extract.run.extract`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import json_option, options_from, out_option, quiet_option
from geomscope.extract.options import ExtractOptions

MODEL_HELP = "Local model directory, hub name (org/name), or bundled:minilm (the packaged all-MiniLM-L6-v2)."
INPUT_HELP = (
    "Text files (one document per line), .jsonl, .csv/.tsv, a datasets.save_to_disk directory, "
    "or - for stdin."
)
OUT_HELP = (
    "Run directory to write (rerun the same command to resume); with --revisions, the directory that "
    "holds one run per revision."
)
REVISIONS_HELP = (
    "Many checkpoints, one run each in --out/<revision>/: hub revisions (comma list or a file, one per "
    "line), the preset pythia-mm21 (step0, step7000 ... step143000), or local checkpoint directories (a "
    "glob, e.g. 'ft_out/checkpoints/*'). A finished run is skipped when asked for as before (the same "
    "model files or commit, inputs and options); otherwise it is extracted as one extract would "
    "(resumed, or refused naming what differs)."
)
DROP_WEIGHTS_HELP = (
    "With --revisions: delete each revision's snapshot from the hub cache once its run is complete, if "
    "this command downloaded it (disk stays at about one checkpoint)."
)


@app.command("extract")
@options_from(ExtractOptions, complete={"layers": _complete.model_layers})
def extract_cmd(
    model: str = typer.Argument(..., metavar="MODEL", help=MODEL_HELP),
    inputs: list[str] = typer.Argument(..., metavar="INPUT", help=INPUT_HELP),
    out: Path = out_option("RUN_DIR", OUT_HELP),
    revisions: Optional[str] = typer.Option(
        None, "--revisions", metavar="LIST|FILE|PRESET|GLOB", help=REVISIONS_HELP
    ),
    drop_weights: bool = typer.Option(False, "--drop-weights", help=DROP_WEIGHTS_HELP),
    json_out: bool = json_option("the summary"),
    quiet: bool = quiet_option(),
    **chosen,
) -> None:
    """Run a checkpoint over texts and store every requested layer's token activations (or the loss's
    gradients with respect to them) as HDF5 shards."""
    import json

    from geomscope.errors import GeomscopeError

    try:
        options = ExtractOptions(**chosen)
        summary = _extract(model, inputs, out, options, revisions, drop_weights, quiet)
    except GeomscopeError as e:
        if json_out and getattr(e, "summary", None) is not None:
            typer.echo(json.dumps(e.summary))
        raise
    if json_out and _is_main_process():  # several processes (torchrun): one summary, from process 0
        typer.echo(json.dumps(summary))


def _extract(model, inputs, out, options, revisions, drop_weights: bool, quiet: bool) -> dict:
    """One run, or one run per revision of ``--revisions``: the summary the library returns."""
    import sys

    from geomscope.extract.revisions import check_revisions_request, extract_revisions
    from geomscope.extract.run import extract
    from geomscope.model.revisions import resolve_revisions
    from geomscope.progress import command_output

    progress, log = command_output(quiet)
    check_revisions_request(options, revisions=revisions is not None, drop_weights=drop_weights)
    if revisions is None:
        return extract(model, inputs, out, options, progress=progress, log=log, stdin=sys.stdin)
    return extract_revisions(
        model,
        inputs,
        out,
        resolve_revisions(model, revisions),
        options,
        drop_weights=drop_weights,
        progress=progress,
        log=log,
        stdin=sys.stdin,
    )


def _is_main_process() -> bool:
    from geomscope.distributed import world_from_env

    return world_from_env()[0] == 0
