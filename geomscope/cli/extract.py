"""``geomscope extract MODEL INPUT... --out RUN_DIR``: a thin wrapper over :func:`geomscope.extract.run.extract`."""

from __future__ import annotations

from pathlib import Path

import typer

from geomscope.cli._app import app


@app.command("extract")
def extract_cmd(
    model: str = typer.Argument(..., help="Local model directory, hub name (org/name), or bundled:minilm "
                                          "(the packaged all-MiniLM-L6-v2)."),
    inputs: list[str] = typer.Argument(..., help="Text files (one document per line), .jsonl, .csv/.tsv, a "
                                                 "datasets.save_to_disk directory, or - for stdin."),
    out: Path = typer.Option(..., "--out", "-o", help="Run directory to write (rerun the same command to resume)."),
    layers: str = typer.Option("all", "--layers", "-l", help="all | 0,6,12 | 4-8 | -1: indices into the hidden "
                                                             "states (0 = embeddings, i = block i)."),
    revision: str = typer.Option(None, "--revision", help="Hub revision: tag, branch or commit."),
    dtype: str = typer.Option("float32", "--dtype", help="Model computation dtype: float32, float16, bfloat16."),
    store_dtype: str = typer.Option("float16", "--store-dtype", help="Shard dtype: float16 or float32."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the model's own code."),
    stack: str = typer.Option(None, "--stack", help="Encoder-decoder models: encoder (default) or decoder "
                                                    "(teacher-forced on the document)."),
    text_field: str = typer.Option("text", "--text-field", help="Text field of .jsonl records and datasets."),
    text_column: str = typer.Option("text", "--text-column", help="Text column of .csv/.tsv files."),
    max_docs: int = typer.Option(None, "--max-docs", help="Use only the first N non-empty documents."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Stop after N rows (tokens); the last document is cut."),
    max_length: int = typer.Option(None, "--max-length", help="Truncate documents to N tokens (default: the "
                                                              "model's limit)."),
    batch_tokens: int = typer.Option(8192, "--batch-tokens", help="Padded tokens per batch (memory knob; does "
                                                                  "not change the stored rows)."),
    shard_docs: int = typer.Option(1000, "--shard-docs", help="Documents per shard (the unit of resume)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing run in --out and start over."),
    cache_dir: str = typer.Option(None, "--cache-dir", help="Hugging Face cache directory."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Exit 0 even if activations hold NaN/Inf "
                                                                          "(they are flagged either way)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or messages."),
) -> None:
    """Run a checkpoint over texts and store every requested layer's token activations as HDF5 shards."""
    import json
    import sys

    from rich.console import Console

    from geomscope.errors import GeomscopeError
    from geomscope.extract.run import extract

    console = Console(stderr=True)
    log = None if quiet else (lambda msg: console.print(msg, markup=False, highlight=False, soft_wrap=True))
    try:
        summary = extract(
            model, inputs, out, layers=layers, revision=revision, dtype=dtype, store_dtype=store_dtype,
            device=device, trust_remote_code=trust_remote_code, stack=stack, text_field=text_field,
            text_column=text_column, max_docs=max_docs, max_tokens=max_tokens, max_length=max_length,
            batch_tokens=batch_tokens, shard_docs=shard_docs, overwrite=overwrite, cache_dir=cache_dir,
            progress=not quiet, allow_nonfinite=allow_nonfinite, log=log, stdin=sys.stdin,
        )
    except GeomscopeError as e:
        if json_out and getattr(e, "summary", None) is not None:
            typer.echo(json.dumps(e.summary))
        raise
    if json_out:
        typer.echo(json.dumps(summary))
