"""``geomscope extract MODEL INPUT... --out RUN_DIR``: a thin wrapper over
:func:`geomscope.extract.run.extract`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from geomscope import choices
from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import (
    ComputeDtype,
    Stack,
    StoreDtype,
    choice_metavar,
    json_option,
    layers_option,
    quiet_option,
    value,
)


@app.command("extract")
def extract_cmd(
    model: str = typer.Argument(
        ...,
        metavar="MODEL",
        help="Local model directory, hub name (org/name), or bundled:minilm (the packaged all-MiniLM-L6-v2).",
    ),
    inputs: list[str] = typer.Argument(
        ...,
        metavar="INPUT",
        help="Text files (one document per line), "
        ".jsonl, .csv/.tsv, a datasets.save_to_disk directory, or - for stdin.",
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        metavar="RUN_DIR",
        help="Run directory to write (rerun the same command to resume); with --revisions, the "
        "directory that holds one run per revision.",
    ),
    layers: str = layers_option(
        "all",
        "all | blocks | 0,6,12 | 4-8 | -1 | layer_06 | final_norm: hidden states to keep (0 = embeddings, "
        "i = block i, -1 = the last block, final_norm = the final norm's output).",
        _complete.model_layers,
    ),
    revision: Optional[str] = typer.Option(
        None, "--revision", metavar="REV", help="Hub revision: tag, branch or commit."
    ),
    revisions: Optional[str] = typer.Option(
        None,
        "--revisions",
        metavar="LIST|FILE|PRESET|GLOB",
        help="Many checkpoints, one run each in --out/<revision>/: hub revisions (comma list or a "
        "file, one per line), the preset pythia-mm21 (step0, step7000 ... step143000), or local "
        "checkpoint directories (a glob, e.g. 'ft_out/checkpoints/*'). A finished run is skipped when "
        "asked for as before (the same model files or commit, inputs and options); otherwise it is "
        "extracted as one extract would (resumed, or refused naming what differs).",
    ),
    drop_weights: bool = typer.Option(
        False,
        "--drop-weights",
        help="With --revisions: delete each revision's snapshot from the hub cache once its run is "
        "complete, if this command downloaded it (disk stays at about one checkpoint).",
    ),
    dtype: ComputeDtype = typer.Option(
        "float32", "--dtype", metavar=choice_metavar(choices.COMPUTE_DTYPES), help="Model computation dtype."
    ),
    store_dtype: StoreDtype = typer.Option(
        "auto",
        "--store-dtype",
        metavar=choice_metavar(choices.STORE_DTYPES),
        help="Shard dtype (auto: float16, or float32 when gradients are stored).",
    ),
    device: str = typer.Option(
        "auto",
        "--device",
        metavar="DEVICE",
        help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps.",
    ),
    device_map: Optional[str] = typer.Option(
        None,
        "--device-map",
        metavar="auto|balanced|balanced_low_0|sequential",
        help="A model larger than one device: spread its layers over the GPUs (and CPU) with "
        "accelerate's big-model loading; one process per model replica.",
    ),
    max_memory: Optional[str] = typer.Option(
        None,
        "--max-memory",
        metavar="DEV=SIZE,...",
        help="Limits of --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB.",
    ),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the model's own code."),
    stack: Optional[Stack] = typer.Option(
        None,
        "--stack",
        metavar=choice_metavar(choices.STACKS),
        help="Encoder-decoder models: the encoder (default) or the decoder (teacher-forced on the document).",
    ),
    text_field: str = typer.Option(
        "text",
        "--text-field",
        metavar="NAME",
        help="Text field of .jsonl records and datasets, or column of .csv/.tsv files.",
    ),
    text_column: Optional[str] = typer.Option(
        None, "--text-column", hidden=True, help="Deprecated spelling of --text-field for .csv/.tsv files."
    ),
    max_docs: Optional[int] = typer.Option(
        None, "--max-docs", min=1, metavar="N", help="Use only the first N non-empty documents."
    ),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=1, metavar="N", help="Stop after N rows (tokens); the last document is cut."
    ),
    max_length: Optional[int] = typer.Option(
        None,
        "--max-length",
        min=1,
        metavar="N",
        help="Truncate documents to N tokens (default: the model's limit).",
    ),
    batch_tokens: int = typer.Option(
        8192,
        "--batch-tokens",
        min=1,
        metavar="N",
        help="Padded tokens per batch (memory knob; does not change the stored rows).",
    ),
    shard_docs: int = typer.Option(
        1000, "--shard-docs", min=1, metavar="N", help="Documents per shard (the unit of resume)."
    ),
    keep: str = typer.Option(
        "all",
        "--keep",
        metavar="all|sample[:N]",
        help=(
            "all: store every row. sample:N (sample = sample:5000): store per shard each layer's "
            "float64 accumulators, measured on the model's device during the forward pass, and the "
            "seeded sample of N rows that score --id-sample draws; for corpora too large to store."
        ),
    ),
    seed: int = typer.Option(
        0,
        "--seed",
        min=0,
        metavar="N",
        help="Seed of the --keep sample (score --seed N draws the same rows) and of the masked-lm masks.",
    ),
    capture: str = typer.Option(
        "activations",
        "--capture",
        metavar="activations|gradients|activations,gradients",
        help="What to store per token: the hidden states, and/or the gradient of the loss with "
        "respect to them (stored as <layer>.grad, one forward and backward pass).",
    ),
    loss: str = typer.Option(
        "auto",
        "--loss",
        metavar=choice_metavar(choices.LOSSES),
        help="The loss of --capture gradients: causal-lm (next token), masked-lm, classification "
        "(--label-field); auto = the checkpoint's own head. Each document's loss is its mean.",
    ),
    mlm_probability: float = typer.Option(
        0.15,
        "--mlm-probability",
        metavar="P",
        help="masked-lm: chance that a token is masked (seeded by --seed and the document id).",
    ),
    label_field: str = typer.Option(
        "label", "--label-field", metavar="NAME", help="classification: the label field or column."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete an existing run in --out and start over."
    ),
    cache_dir: Optional[str] = typer.Option(
        None, "--cache-dir", metavar="DIR", help="Hugging Face cache directory."
    ),
    allow_nonfinite: bool = typer.Option(
        False,
        "--allow-nonfinite",
        help="Exit 0 even if activations hold NaN/Inf (they are flagged either way).",
    ),
    json_out: bool = json_option("the summary"),
    quiet: bool = quiet_option(),
) -> None:
    """Run a checkpoint over texts and store every requested layer's token activations (or the loss's
    gradients with respect to them) as HDF5 shards."""
    import json
    import sys

    from rich.console import Console

    from geomscope.errors import GeomscopeError
    from geomscope.extract.options import ExtractOptions
    from geomscope.extract.run import extract

    console = Console(stderr=True)
    log = None if quiet else (lambda msg: console.print(msg, markup=False, highlight=False, soft_wrap=True))
    try:
        options = ExtractOptions(
            layers=layers,
            revision=revision,
            dtype=value(dtype),
            store_dtype=value(store_dtype),
            device=device,
            device_map=device_map,
            max_memory=max_memory,
            trust_remote_code=trust_remote_code,
            stack=value(stack),
            text_field=text_field,
            text_column=text_column or text_field,
            max_docs=max_docs,
            max_tokens=max_tokens,
            max_length=max_length,
            batch_tokens=batch_tokens,
            shard_docs=shard_docs,
            overwrite=overwrite,
            cache_dir=cache_dir,
            allow_nonfinite=allow_nonfinite,
            keep=keep,
            seed=seed,
            capture=capture,
            loss=loss,
            mlm_probability=mlm_probability,
            label_field=label_field,
        )
        if revisions is not None:
            from geomscope.errors import InputError
            from geomscope.extract.revisions import extract_revisions
            from geomscope.model.revisions import resolve_revisions

            if revision is not None:
                raise InputError("give either --revision (one checkpoint) or --revisions (many), not both")
            summary = extract_revisions(
                model,
                inputs,
                out,
                resolve_revisions(model, revisions),
                options,
                drop_weights=drop_weights,
                progress=not quiet,
                log=log,
                stdin=sys.stdin,
            )
        else:
            if drop_weights:
                from geomscope.errors import InputError

                raise InputError("--drop-weights applies to --revisions runs")
            summary = extract(model, inputs, out, options, progress=not quiet, log=log, stdin=sys.stdin)
    except GeomscopeError as e:
        if json_out and getattr(e, "summary", None) is not None:
            typer.echo(json.dumps(e.summary))
        raise
    if json_out and _is_main_process():  # several processes (torchrun): one summary, from process 0
        typer.echo(json.dumps(summary))


def _is_main_process() -> bool:
    from geomscope.distributed import world_from_env

    return world_from_env()[0] == 0
