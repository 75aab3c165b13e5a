"""``geomscope finetune``: fine-tune a sequence classifier with I-STAR / CosReg.

Thin wrapper over :func:`geomscope.train.finetune`; torch and transformers are imported only
inside the command.  Multi-GPU: launch the same command with ``torchrun --nproc_per_node N -m
geomscope finetune ...`` or ``accelerate launch -m geomscope finetune ...``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from geomscope.cli._app import app


@app.command("finetune")
def finetune_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory, bundled:minilm (all-MiniLM-L6-v2), or a hub name."),
    train: Path = typer.Option(..., "--train", help="Training data: .csv, .tsv, .jsonl or a save_to_disk dir."),
    eval_: Path = typer.Option(..., "--eval", help="Evaluation data, same format and columns as --train."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (model, logs, checkpoint)."),
    reg: str = typer.Option("istar", "--reg", help="istar | cosreg | none."),
    lam: float = typer.Option(-5.0, "--lambda",
                              help="Weight of the penalty. I-STAR: < 0 pushes away from isotropy, > 0 toward it."),
    zeta: float = typer.Option(0.2, "--zeta", help="IsoScore* shrinkage weight on C0 (0 = plain IsoScore)."),
    c0_points: int = typer.Option(250_000, "--c0-points", help="Token vectors used for C0 each epoch (at most)."),
    layers: Optional[str] = typer.Option(
        None, "--layers", help="Hidden-state indices for I-STAR, e.g. 1-6 or 2,4,-1 (default: every block; "
                               "0 = embedding output)."),
    epochs: int = typer.Option(4, "--epochs", help="Training epochs."),
    lr: float = typer.Option(1e-5, "--lr", help="AdamW learning rate (constant)."),
    batch_size: int = typer.Option(32, "--batch-size", help="Examples per step per process."),
    max_length: int = typer.Option(128, "--max-length", help="Truncate inputs to this many tokens."),
    seed: int = typer.Option(0, "--seed", help="Seed for the head, shuffling and dropout."),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | fp16 (CUDA) | bf16 (autocast)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    penalty_precision: str = typer.Option(
        "fp64", "--penalty-precision",
        help="I-STAR batch covariance arithmetic: fp64 (exact) or fp32 (centred rows, about half the cost; "
             "for GPUs with slow float64)."),
    include_padding: bool = typer.Option(False, "--include-padding",
                                         help="Count padding positions in the penalties (the official code's "
                                              "behaviour); default: excluded by the attention mask."),
    text_field: str = typer.Option("sentence", "--text-field", help="Column with the text."),
    text_field_2: Optional[str] = typer.Option(None, "--text-field-2",
                                               help="Second text column for sentence pairs (e.g. QNLI)."),
    label_field: str = typer.Option("label", "--label-field", help="Column with the label."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last epoch checkpoint in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as one JSON object on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Fine-tune a sequence classifier while shaping its activation geometry (I-STAR or CosReg).

    Writes the fine-tuned model and tokenizer (readable by `geomscope extract OUT`), steps.jsonl,
    eval.jsonl, summary.json and an epoch checkpoint into --out.
    """
    from geomscope.train import FinetuneConfig, finetune

    cfg = FinetuneConfig(
        model=model, train=str(train), eval=str(eval_), out=str(out), reg=reg.lower(), lam=lam,
        zeta=zeta, c0_points=c0_points, layers=layers, epochs=epochs, lr=lr, batch_size=batch_size,
        max_length=max_length, seed=seed, precision=precision.lower(), device=device.lower(),
        include_padding=include_padding, penalty_precision=penalty_precision.lower(), text_field=text_field,
        text_field_2=text_field_2,
        label_field=label_field, resume=resume,
    )
    summary = finetune(cfg, quiet=quiet, note=lambda msg: print(msg, file=sys.stderr))
    if os.environ.get("RANK", "0") != "0":  # non-main rank of a torchrun / accelerate run: rank 0 reports
        return
    fin = summary.get("final") or {}
    if not quiet:
        iso, acc = fin.get("isoscore_star"), fin.get("accuracy")
        typer.echo(f"wrote {out}: {summary['steps']} steps, eval accuracy "
                   f"{'n/a' if acc is None else f'{acc:.4f}'}, eval IsoScore* "
                   f"{'n/a' if iso is None else f'{iso:.4f}'}", err=True)
    if as_json:
        typer.echo(json.dumps(summary))
