"""``geomscope finetune``: fine-tune a sequence classifier (or, with ``--task qa``, an extractive
question-answering model on SQuAD-format data; with ``--task causal-lm``, a decoder on its
next-token loss) with I-STAR / CosReg.

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
from pathlib import Path

import typer

from geomscope.cli import _complete
from geomscope.cli._app import app
from geomscope.cli._options import declared_option, json_option, options_from, out_option, quiet_option
from geomscope.options import CommaList, OptionError, check_value, declared
from geomscope.progress import command_output
from geomscope.train.config import FinetuneConfig, caseless

_MODEL = typer.Argument(
    ..., metavar="MODEL", help="Checkpoint directory, bundled:minilm (all-MiniLM-L6-v2), or a hub name."
)
_TRAIN = typer.Option(
    ...,
    "--train",
    metavar="FILE",
    help="Training data: .csv, .tsv, .jsonl or a save_to_disk dir; with --task qa SQuAD v1.1 .json or "
    ".jsonl records (id, context, question, answers); with --task causal-lm also a text file, one "
    "document per line.",
)
_EVAL = typer.Option(
    ..., "--eval", metavar="FILE", help="Evaluation data, same format and columns as --train."
)
_OUT = out_option("DIR", "Output directory (model, logs, checkpoint).")
_DRY_RUN = typer.Option(
    False,
    "--dry-run",
    help="Check what a run checks before it trains (the model resolves and its config and "
    "tokenizer load, the data files, --out), print the run directories and exit; nothing is "
    "trained or written.",
)
#: the grid's options (comma lists on the command line) and how each item is read
_GRID = (("reg", caseless), ("lam", float), ("seed", int))


def _grid_option(name: str):
    """A grid option: its declaration's option, read as text (a comma list of values)."""
    return declared_option(FinetuneConfig, name)


@app.command("finetune")
@options_from(FinetuneConfig, complete={"layers": _complete.model_layers})
def finetune_cmd(
    model: str = _MODEL,
    train: Path = _TRAIN,
    eval_: Path = _EVAL,
    out: Path = _OUT,
    reg: str = _grid_option("reg"),
    lam: str = _grid_option("lam"),
    seed: str = _grid_option("seed"),
    dry_run: bool = _DRY_RUN,
    as_json: bool = json_option("the run summary"),
    quiet: bool = quiet_option("No progress bar."),
    **chosen,
) -> None:
    """Fine-tune a sequence classifier (or a QA model: --task qa; a decoder on next-token loss: --task
    causal-lm) while shaping its activation geometry (I-STAR or CosReg).

    Writes the fine-tuned model and tokenizer (readable by `geomscope extract OUT`), steps.jsonl,
    eval.jsonl, summary.json and an epoch checkpoint into --out. Comma lists in --reg, --lambda and
    --seed run the grid, each run in --out/<reg>_lambda<L>_seed<S>/ (a rerun skips the runs finished
    with the same options); `geomscope compare OUT` then relates isotropy to accuracy.
    """
    chosen.update(reg=reg, lam=lam, seed=seed)
    points, cfg = _plan(FinetuneConfig(model=model, train=str(train), eval=str(eval_), out=str(out)), chosen)
    if dry_run:
        _dry_run(cfg, points, out, quiet)
    elif len(points) > 1:
        _sweep(cfg, points, out, quiet, as_json)
    else:
        _one_run(cfg, out, quiet, as_json)


def _plan(base: FinetuneConfig, chosen: dict):
    """(the grid's points, the first point's checked options) from the command's values: each item
    of the comma lists in --reg, --lambda and --seed is checked against its declared field."""
    from dataclasses import replace

    from geomscope.study.sweep import grid

    points = grid(*(_axis(name, chosen[name], read) for name, read in _GRID))
    first = {
        "reg": points[0].reg,
        "lam": points[0].lam,
        "seed": points[0].seed,
    }
    return points, replace(base, **{**chosen, **first}).validate()


def _axis(name: str, text, read) -> list:
    """The values of the comma list ``text`` of grid option ``name``, each read by ``read`` and
    checked against the option's declaration (one line naming the flag for the first that fails)."""
    opt = declared(FinetuneConfig)[name]
    axis = CommaList("one or more values", opt.constraint, read, nonempty=True)
    values = axis.items(str(text))
    if not values:
        raise OptionError(f"{opt.flag} must be {axis.describe()}, not {text!r}")
    for v in values:
        check_value(FinetuneConfig, name, v)
    return values


def _sweep(cfg: FinetuneConfig, points, out: Path, quiet: bool, as_json: bool) -> None:
    """Every point of the grid, one run each in ``out``; one line for the runs that failed."""
    from geomscope.errors import GeomscopeError
    from geomscope.study.sweep import run_sweep

    progress, log = command_output(quiet, warns=True)
    results = run_sweep(cfg, points, progress=progress, log=log)
    if as_json:
        typer.echo(json.dumps({"sweep": str(out), "runs": results}))
    failed = [r for r in results if r["status"] == "failed"]
    if failed:
        raise GeomscopeError(
            f"{len(failed)} of {len(results)} runs failed (first: {failed[0]['name']}: "
            f"{failed[0]['error']}); the others finished and a rerun skips them"
        )


def _one_run(cfg: FinetuneConfig, out: Path, quiet: bool, as_json: bool) -> None:
    """One run; rank 0 says what it wrote (and prints the summary with --json)."""
    from geomscope.cli import SPACE_ERRNOS
    from geomscope.errors import GeomscopeError
    from geomscope.train import finetune

    progress, log = command_output(quiet, warns=True)
    try:
        summary = finetune(cfg, progress=progress, log=log)
    except KeyboardInterrupt:
        raise GeomscopeError(_interrupted(out), exit_code=130) from None
    except OSError as e:
        if e.errno not in SPACE_ERRNOS:
            raise
        raise GeomscopeError(_out_of_space(out, e)) from None
    if os.environ.get("RANK", "0") != "0":  # non-main rank of a torchrun / accelerate run: rank 0 reports
        return
    if not quiet:
        typer.echo(_wrote(out, summary), err=True)
    if as_json:
        typer.echo(json.dumps(summary))


def _wrote(out: Path, summary: dict) -> str:
    """The line that says what one run wrote and how it scored on the eval set."""
    from geomscope.train.loop import task_scores

    fin = summary.get("final") or {}
    iso = fin.get("isoscore_star")
    score = "eval " + ", ".join(task_scores(fin, brief=True))
    isoscore = "n/a" if iso is None else f"{iso:.4f}"
    return f"wrote {out}: {summary['steps']} steps, {score}, eval IsoScore* {isoscore}"


def _dry_run(cfg, points, out: Path, quiet: bool) -> None:
    """--dry-run: every check a run makes before it trains (a grid's: :func:`check_sweep`; one run's:
    :func:`check_run`), then the run directories on stdout and what a run would do on stderr."""
    from geomscope.study.sweep import check_sweep
    from geomscope.train.loop import check_run

    if len(points) > 1:
        plan = check_sweep(cfg, points, command_output(quiet, warns=True)[1])
        for p in points:
            typer.echo(str(out / p.name))
        todo = {k: sum(v == k for v in plan.values()) for k in ("run", "resume", "skip")}
        said = f"{todo['run']} to run, {todo['resume']} to resume, {todo['skip']} finished (skipped)"
    else:
        check_run(cfg, command_output(quiet, warns=True)[1])
        typer.echo(f"{out}: {points[0].name}")
        said = "1 run"
    if not quiet:
        typer.echo(f"checked: model {cfg.model}, data and --out; {said}; nothing trained", err=True)


def _interrupted(out: Path) -> str:
    """The line for Ctrl-C (or SIGTERM) during one run: the command that continues it. The generic
    "rerun the same command" would be wrong here: a finished epoch is continued by --resume, and the
    same command with --overwrite would throw it away."""
    from geomscope.train.checkpoint import CKPT

    cmd = _resume_command(out)
    if cmd is None:
        return (
            f"interrupted before the first epoch of {out} finished; rerun the same command to start it again"
        )
    return f"interrupted; the finished epochs are kept in {out / CKPT}; to continue, run: {cmd}"


def _out_of_space(out: Path, e: OSError) -> str:
    """The line for a full disk (or quota, or file-size limit) during one run: the checkpoint being
    written was removed whole, the previous one is kept, and --resume continues from it."""
    from geomscope.train.checkpoint import CKPT

    why = (e.strerror or os.strerror(e.errno)).lower()
    head = f"{why}{f' writing {e.filename}' if e.filename else ''}; free some space"
    cmd = _resume_command(out)
    if cmd is None:
        return f"{head}, then rerun the same command (no epoch of {out} had finished)"
    return f"{head}; the finished epochs are kept in {out / CKPT}; to continue, run: {cmd}"


def _resume_command(out: Path) -> str | None:
    """The command line that continues the run in ``out`` (this one's, with --resume in place of
    --overwrite), or None when it has no finished epoch checkpoint to continue from."""
    from geomscope.cli._app import state
    from geomscope.train.checkpoint import CKPT

    if not (out / CKPT / "state.json").is_file():
        return None
    argv = [a for a in (state.get("argv") or []) if a not in ("--overwrite", "--resume")]
    return shlex.join([*argv, "--resume"]) if argv else "the same command with --resume"
