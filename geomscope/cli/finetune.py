"""``geomscope finetune``: fine-tune a sequence classifier (or, with ``--task qa``, an extractive
question-answering model on SQuAD-format data) with I-STAR / CosReg.

Thin wrapper over :func:`geomscope.train.finetune`; torch and transformers are imported only
inside the command.  The loop runs on Hugging Face Accelerate (:mod:`geomscope.train.engine`):
multi-GPU is the same command under ``torchrun --nproc_per_node N -m geomscope finetune ...`` or
``accelerate launch [--config_file fsdp.yaml|zero3.yaml] -m geomscope finetune ...`` (DDP, FSDP,
DeepSpeed ZeRO).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from geomscope import choices
from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import (
    PenaltyPrecision,
    Precision,
    choice_enum,
    flatten,
    float_list,
    json_option,
    layers_option,
    quiet_option,
    regulariser_list,
    seed_list,
    value,
    zeta_option,
)
from geomscope.options import choice_metavar

Scheduler = choice_enum("Scheduler", choices.SCHEDULERS)
Tracker = choice_enum("Tracker", choices.TRACKERS)


@app.command("finetune")
def finetune_cmd(
    model: str = typer.Argument(
        ..., metavar="MODEL", help="Checkpoint directory, bundled:minilm (all-MiniLM-L6-v2), or a hub name."
    ),
    train: Path = typer.Option(
        ...,
        "--train",
        metavar="FILE",
        help="Training data: .csv, .tsv, .jsonl or a save_to_disk dir; with --task qa SQuAD v1.1 .json or "
        ".jsonl records (id, context, question, answers).",
    ),
    eval_: Path = typer.Option(
        ..., "--eval", metavar="FILE", help="Evaluation data, same format and columns as --train."
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", metavar="DIR", help="Output directory (model, logs, checkpoint)."
    ),
    task: str = typer.Option(
        "classification",
        "--task",
        metavar="classification|qa",
        help="classification (single sentences or pairs, --text-field[-2], --label-field) or qa: "
        "extractive question answering (SQuAD; span head, eval exact_match and f1 in percent).",
    ),
    reg: List[str] = typer.Option(
        ["istar"],
        "--reg",
        metavar=choice_metavar(choices.REGULARISERS) + "[,...]",
        parser=regulariser_list,
        help="Regulariser: I-STAR, CosReg or none; a comma list runs a grid.",
    ),
    lam: List[float] = typer.Option(
        [-5.0],
        "--lambda",
        metavar="FLOAT[,...]",
        parser=float_list,
        help="Weight of the penalty (I-STAR: < 0 pushes away from isotropy, > 0 toward it); a comma list "
        "(e.g. -1,-0.1,0,0.1,1) runs a grid.",
    ),
    zeta: float = zeta_option("IsoScore* shrinkage weight on C0 (0 = plain IsoScore)."),
    c0_points: int = typer.Option(
        250_000, "--c0-points", min=2, metavar="N", help="Token vectors used for C0 each epoch (at most)."
    ),
    save_every: Optional[int] = typer.Option(
        None,
        "--save-every",
        min=1,
        metavar="STEPS",
        help="Also keep the model every STEPS optimiser steps (and before the first) as "
        "DIR/checkpoints/step<N>/, for `extract --revisions 'DIR/checkpoints/*'`.",
    ),
    log_geometry: Optional[int] = typer.Option(
        None,
        "--log-geometry",
        metavar="EVERY",
        help="Every EVERY optimiser steps, log per chosen layer (--layers) in steps.jsonl the share of the "
        "task-loss gradient's energy in the top-r principal subspace of C0 (the epoch's training "
        "covariance of the chosen layers pooled; computed for cosreg/none too) against r/D, and the "
        "batch IsoScore*. `geomscope plot DIR` draws it.",
    ),
    geometry_rank: str = typer.Option(
        "8,32",
        "--geometry-rank",
        metavar="LIST",
        help="Ranks r of the C0 subspaces for --log-geometry (each below the hidden size D).",
    ),
    layers: Optional[str] = layers_option(
        None,
        "Hidden states for I-STAR: blocks | all | 1-6 | 2,4,-1 | layer_03 (default: blocks, every "
        "block; 0 = embedding output).",
        _complete.model_layers,
    ),
    epochs: int = typer.Option(4, "--epochs", min=1, metavar="N", help="Training epochs."),
    lr: float = typer.Option(
        1e-5, "--lr", min=0.0, metavar="FLOAT", help="AdamW learning rate (peak rate with --scheduler)."
    ),
    weight_decay: Optional[float] = typer.Option(
        None,
        "--weight-decay",
        metavar="W",
        help="AdamW weight decay W on weights, none on biases and LayerNorm weights (as transformers "
        "does). Default: torch's AdamW default, 0.01 on every parameter (the released I-STAR setting).",
    ),
    scheduler: Scheduler = typer.Option(
        "constant",
        "--scheduler",
        metavar=choice_metavar(choices.SCHEDULERS),
        help="Learning-rate schedule over the run's optimiser steps (transformers' get_scheduler).",
    ),
    warmup: float = typer.Option(
        0.0,
        "--warmup",
        metavar="RATIO",
        help="Linear warmup over this fraction of the optimiser steps (rounded up), then --scheduler.",
    ),
    grad_accum: int = typer.Option(
        1,
        "--grad-accum",
        metavar="N",
        help="Micro-batches of --batch-size per optimiser step (gradients summed; the task loss is the "
        "mean over all N*batch examples). The I-STAR/CosReg penalty is taken per micro-batch (its own "
        "covariance) and averaged: one covariance over the accumulated batch would need every "
        "micro-batch's hidden states in memory at once.",
    ),
    max_grad_norm: Optional[float] = typer.Option(
        None,
        "--max-grad-norm",
        metavar="NORM",
        help="Clip the global gradient norm (task loss + penalty, over all processes) to NORM before "
        "each update, through Accelerate; steps.jsonl logs grad_norm before clipping. Default: no "
        "clipping (the released I-STAR setting).",
    ),
    gradient_checkpointing: bool = typer.Option(
        False,
        "--gradient-checkpointing",
        help="Recompute each block's activations in the backward pass instead of storing them "
        "(transformers' gradient checkpointing): less memory for big models, about a third more "
        "compute, the same gradients.",
    ),
    lora: Optional[int] = typer.Option(
        None,
        "--lora",
        metavar="R",
        help="Train rank-R LoRA adapters (and the task head) instead of every weight; needs "
        "pip install 'geomscope[lora]'. Writes the merged model to --out and the adapter to --out/adapter/.",
    ),
    lora_alpha: Optional[float] = typer.Option(
        None, "--lora-alpha", metavar="A", help="LoRA scaling alpha (default: 2*R)."
    ),
    lora_target: str = typer.Option(
        "q,v",
        "--lora-target",
        metavar="LIST",
        help="Modules that get adapters: module names (query, value, q_proj, ...) or q, k, v, o.",
    ),
    report_to: Tracker = typer.Option(
        "none",
        "--report-to",
        metavar=choice_metavar(choices.TRACKERS),
        help="Also log the step and eval records to TensorBoard (--out/tensorboard/), wandb (offline) or "
        "MLflow (file store --out/mlruns/); rank 0 only.",
    ),
    batch_size: int = typer.Option(
        32, "--batch-size", min=1, metavar="N", help="Examples per step per process."
    ),
    max_length: int = typer.Option(
        128, "--max-length", min=2, metavar="N", help="Truncate inputs to this many tokens."
    ),
    seed: List[int] = typer.Option(
        [0],
        "--seed",
        metavar="N[,...]",
        parser=seed_list,
        help="Seed for the head, shuffling and dropout; a comma list runs a grid.",
    ),
    precision: Precision = typer.Option(
        "fp32",
        "--precision",
        metavar=choice_metavar(choices.PRECISIONS),
        help="Training arithmetic, through Accelerate's mixed precision: fp32, fp16 (CUDA, gradient "
        "scaling) or bf16 (autocast).",
    ),
    device: str = typer.Option(
        "auto",
        "--device",
        metavar="DEVICE",
        help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps.",
    ),
    penalty_precision: PenaltyPrecision = typer.Option(
        "fp64",
        "--penalty-precision",
        metavar=choice_metavar(choices.PENALTY_PRECISIONS),
        help="I-STAR batch covariance arithmetic: fp64 (exact) or fp32 (centred rows, about half the cost; "
        "for GPUs with slow float64).",
    ),
    include_padding: bool = typer.Option(
        False,
        "--include-padding",
        help="Count padding positions in the training penalties and C0 (the official code's "
        "behaviour); default: excluded by the attention mask. The eval geometry (eval.jsonl, compare) "
        "never counts padding, so it does not depend on --batch-size.",
    ),
    text_field: str = typer.Option(
        "sentence", "--text-field", metavar="NAME", help="Text field (column) of the examples."
    ),
    text_field_2: Optional[str] = typer.Option(
        None, "--text-field-2", metavar="NAME", help="Second text column for sentence pairs (e.g. QNLI)."
    ),
    label_field: str = typer.Option("label", "--label-field", metavar="NAME", help="Column with the label."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a previous finetune output in --out (only the files it wrote)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last epoch checkpoint in --out."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check what a run checks before it trains (the model resolves and its config and "
        "tokenizer load, the data files, --out), print the run directories and exit; nothing is "
        "trained or written.",
    ),
    as_json: bool = json_option("the run summary"),
    quiet: bool = quiet_option("No progress bar."),
) -> None:
    """Fine-tune a sequence classifier (or a QA model: --task qa) while shaping its activation geometry
    (I-STAR or CosReg).

    Writes the fine-tuned model and tokenizer (readable by `geomscope extract OUT`), steps.jsonl,
    eval.jsonl, summary.json and an epoch checkpoint into --out. Comma lists in --reg, --lambda and
    --seed run the grid, each run in --out/<reg>_lambda<L>_seed<S>/ (a rerun skips the runs finished
    with the same options); `geomscope compare OUT` then relates isotropy to accuracy.
    """
    from geomscope.errors import GeomscopeError
    from geomscope.study.sweep import grid, run_sweep
    from geomscope.train import FinetuneConfig, finetune

    points = grid(flatten(reg), flatten(lam), flatten(seed))
    cfg = FinetuneConfig(
        model=model,
        train=str(train),
        eval=str(eval_),
        out=str(out),
        task=task.strip().lower(),
        reg=points[0].reg,
        lam=points[0].lam,
        zeta=zeta,
        c0_points=c0_points,
        layers=layers,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        max_length=max_length,
        seed=points[0].seed,
        precision=value(precision),
        device=device.lower(),
        include_padding=include_padding,
        penalty_precision=value(penalty_precision),
        text_field=text_field,
        text_field_2=text_field_2,
        label_field=label_field,
        resume=resume,
        overwrite=overwrite,
        save_every=save_every,
        log_geometry=log_geometry,
        geometry_rank=_ranks(geometry_rank),
        weight_decay=weight_decay,
        scheduler=value(scheduler),
        warmup=warmup,
        grad_accum=grad_accum,
        max_grad_norm=max_grad_norm,
        gradient_checkpointing=gradient_checkpointing,
        lora=lora,
        lora_alpha=lora_alpha,
        lora_target=lora_target,
        report_to=value(report_to),
    )
    if dry_run:
        _dry_run(cfg, points, out, quiet)
        return
    if len(points) > 1:
        results = run_sweep(cfg, points, quiet=quiet, note=lambda msg: print(msg, file=sys.stderr))
        if as_json:
            typer.echo(json.dumps({"sweep": str(out), "runs": results}))
        failed = [r for r in results if r["status"] == "failed"]
        if failed:
            raise GeomscopeError(
                f"{len(failed)} of {len(results)} runs failed (first: {failed[0]['name']}: "
                f"{failed[0]['error']}); the others finished and a rerun skips them"
            )
        return
    try:
        summary = finetune(cfg, quiet=quiet, note=lambda msg: print(msg, file=sys.stderr))
    except KeyboardInterrupt:
        raise GeomscopeError(_interrupted(out), exit_code=130) from None
    if os.environ.get("RANK", "0") != "0":  # non-main rank of a torchrun / accelerate run: rank 0 reports
        return
    fin = summary.get("final") or {}
    if not quiet:
        iso, acc = fin.get("isoscore_star"), fin.get("accuracy")
        if "exact_match" in fin:  # --task qa
            score = f"eval exact match {fin['exact_match']:.2f}, F1 {fin['f1']:.2f}"
        else:
            score = f"eval accuracy {'n/a' if acc is None else f'{acc:.4f}'}"
        typer.echo(
            f"wrote {out}: {summary['steps']} steps, {score}, eval IsoScore* "
            f"{'n/a' if iso is None else f'{iso:.4f}'}",
            err=True,
        )
    if as_json:
        typer.echo(json.dumps(summary))


def _dry_run(cfg, points, out: Path, quiet: bool) -> None:
    """--dry-run: every check a run makes before it trains (a grid's: :func:`check_sweep`; one run's:
    :func:`check_run`), then the run directories on stdout and what a run would do on stderr."""
    from geomscope.study.sweep import check_sweep
    from geomscope.train.loop import check_run

    if len(points) > 1:
        plan = check_sweep(cfg, points)
        for p in points:
            typer.echo(str(out / p.name))
        todo = {k: sum(v == k for v in plan.values()) for k in ("run", "resume", "skip")}
        said = f"{todo['run']} to run, {todo['resume']} to resume, {todo['skip']} finished (skipped)"
    else:
        check_run(cfg)
        typer.echo(f"{out}: {points[0].name}")
        said = "1 run"
    if not quiet:
        typer.echo(f"checked: model {cfg.model}, data and --out; {said}; nothing trained", err=True)


def _interrupted(out: Path) -> str:
    """The line for Ctrl-C (or SIGTERM) during one run: the command that continues it. The generic
    "rerun the same command" would be wrong here: a finished epoch is continued by --resume, and the
    same command with --overwrite would throw it away."""
    from geomscope.cli._app import state
    from geomscope.train.checkpoint import CKPT

    if not (out / CKPT / "state.json").is_file():
        return (
            f"interrupted before the first epoch of {out} finished; rerun the same command to start it again"
        )
    argv = [a for a in (state.get("argv") or []) if a not in ("--overwrite", "--resume")]
    cmd = shlex.join([*argv, "--resume"]) if argv else "the same command with --resume"
    return f"interrupted; the finished epochs are kept in {out / CKPT}; to continue, run: {cmd}"


def _ranks(spec: str) -> tuple:
    """``--geometry-rank 8,32`` -> (8, 32); a word that is not a whole number is kept for the library's
    one-line error."""
    items = [x.strip() for x in str(spec).split(",") if x.strip()]
    return tuple(int(x) if x.lstrip("-").isdigit() else x for x in items)
