"""A grid of fine-tuning runs: every (regulariser, lambda, seed), each in its own subdirectory.

``DIR/sweep.json`` lists the grid; ``DIR/<name>/`` is an ordinary finetune output named by its
settings (``istar_lambda-0.1_seed0``). A rerun skips the runs that finished (their
``summary.json`` exists) and redoes the rest; a run that fails is reported and the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from geomscope.errors import GeomscopeError, InputError
from geomscope.fileio import make_dirs, write_json_atomic

SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class GridPoint:
    reg: str
    lam: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.reg}_lambda{self.lam:g}_seed{self.seed}"


def grid(regs, lams, seeds) -> list[GridPoint]:
    """Every combination, in a stable order (regulariser, lambda, seed); duplicates dropped."""
    regs, lams, seeds = list(dict.fromkeys(regs)), list(dict.fromkeys(lams)), list(dict.fromkeys(seeds))
    if not regs or not lams or not seeds:
        raise InputError("the grid is empty: give at least one --reg, --lambda and --seed")
    return [GridPoint(r, float(lam), int(s)) for r in regs for lam in lams for s in seeds]


def is_sweep(points) -> bool:
    return len(points) > 1


def _claim(out: Path, points: list[GridPoint]) -> None:
    """``out`` is new, empty, or a previous sweep (its sweep.json); anything else is refused."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory for the sweep")
    entries = list(out.iterdir()) if out.exists() else []
    if entries and not (out / SWEEP_FILE).is_file():
        raise InputError(
            f"--out {out} holds files and is not a geomscope sweep; choose a new or empty directory"
        )
    make_dirs(out)
    write_json_atomic(
        out / SWEEP_FILE,
        {
            "format": "geomscope-sweep",
            "runs": [{"name": p.name, "reg": p.reg, "lambda": p.lam, "seed": p.seed} for p in points],
        },
    )


def _check_shared_inputs(base) -> None:
    """The data files and the model config every grid point reads, as finetune reads them
    (InputError, one line, for what none of the points could use)."""
    from geomscope.train.model import check_model_source

    if base.task == "qa":
        from geomscope.train.qa import load_qa

        load_qa(base.train)
        load_qa(base.eval)
    else:
        from geomscope.train.data import build_label_map, check_eval_labels, load_table

        train = load_table(base.train, base.text_field, base.label_field, base.text_field_2)
        check_eval_labels(
            load_table(base.eval, base.text_field, base.label_field, base.text_field_2),
            build_label_map(train),
        )
    check_model_source(base.model)


def run_sweep(base, points: list[GridPoint], *, quiet: bool = False, note=None) -> list[dict]:
    """Run every grid point of ``base`` (a FinetuneConfig whose ``out`` is the sweep directory).

    Returns one record per point: ``{name, dir, reg, lambda, seed, status, error}`` with status
    ``done`` | ``skipped`` (finished earlier) | ``failed`` (one-line reason in ``error``): a point
    that fails (a lambda that diverges, a damaged checkpoint of its own) is recorded and the sweep
    goes on. The inputs every point shares (the data files, the model's config) are checked once
    first: an InputError there stops the sweep before any point, as every point would fail the same
    way after loading the model again.
    """
    from geomscope.progress import Progress
    from geomscope.train import finetune

    out = Path(base.out)
    if any(not (out / p.name / "summary.json").is_file() or base.overwrite for p in points):
        _check_shared_inputs(base)
    _claim(out, points)
    say = note or (lambda msg: None)
    results = []
    with Progress(enabled=not quiet) as bar:
        task = bar.add("sweep", len(points), unit="runs")
        for p in points:
            run_dir = out / p.name
            task.describe(f"sweep: {p.name}")
            rec = {
                "name": p.name,
                "dir": str(run_dir),
                "reg": p.reg,
                "lambda": p.lam,
                "seed": p.seed,
                "status": "done",
                "error": None,
            }
            if (run_dir / "summary.json").is_file() and not base.overwrite:
                rec["status"] = "skipped"
            else:  # an interrupted run resumes from its last epoch (with --overwrite everything is redone)
                resume = (run_dir / "checkpoint" / "state.json").is_file() and not base.overwrite
                # a run of ours cut off before its first checkpoint is started again (finetune still
                # refuses a directory it did not write)
                overwrite = base.overwrite or (run_dir.exists() and not resume)
                cfg = replace(
                    base,
                    reg=p.reg,
                    lam=p.lam,
                    seed=p.seed,
                    out=str(run_dir),
                    resume=resume,
                    overwrite=overwrite,
                )
                try:
                    finetune(cfg, quiet=True, note=lambda msg: None)
                except GeomscopeError as e:
                    rec["status"], rec["error"] = "failed", str(e).splitlines()[0]
                    bar.print(f"failed: {p.name}: {rec['error']}")
            results.append(rec)
            task.advance()
    failed = [r for r in results if r["status"] == "failed"]
    say(
        f"sweep: {len(results) - len(failed)} of {len(results)} runs finished"
        + (f"; failed: {', '.join(r['name'] for r in failed)}" if failed else "")
    )
    return results
