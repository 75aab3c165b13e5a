"""A grid of fine-tuning runs: every (regulariser, lambda, seed), each in its own subdirectory.

``DIR/sweep.json`` lists the grid; ``DIR/<name>/`` is an ordinary finetune output named by its
settings (``istar_lambda-0.1_seed0``; a lambda that ``:g`` would round is written in full,
``istar_lambda1.000001e-06_seed0``, so distinct settings never share a directory). A rerun skips a
run that finished with the options asked now (the fingerprint its checkpoint holds, the one a
single run's ``--resume`` compares, and as many epochs), resumes one that was cut off, and refuses,
before any run, naming the difference, a run trained with other options (``--overwrite`` redoes
them); a run that fails is reported and the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from geomscope.errors import GeomscopeError, InputError, first_line
from geomscope.fileio import make_dirs, write_json_atomic
from geomscope.progress import Log, Progress, log_to
from geomscope.schema import SWEEP_FORMAT

SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class GridPoint:
    reg: str
    lam: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.reg}_lambda{lambda_text(self.lam)}_seed{self.seed}"


def lambda_text(x: float) -> str:
    """``:g`` (the names sweeps have always had) when it reads back as ``x``, else the shortest text
    that does (``repr``): ``:g`` keeps 6 digits, so 1e-6 and 1.000001e-6 would share a name. The one
    home of how a lambda is written (run names; compare's table and messages)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def grid(regs, lams, seeds) -> list[GridPoint]:
    """Every combination, in a stable order (regulariser, lambda, seed); duplicates dropped; a seed
    the generators cannot take, a lambda that is not a finite number, or two points that would share
    a directory, refused."""
    from geomscope.options import check_value
    from geomscope.train.config import FinetuneConfig, caseless, check_seed

    regs = list(dict.fromkeys(caseless(r) for r in regs))  # as the run reads them: --reg ISTAR is istar
    lams, seeds = list(dict.fromkeys(lams)), list(dict.fromkeys(seeds))
    if not regs or not lams or not seeds:
        raise InputError("the grid is empty: give at least one --reg, --lambda and --seed")
    for lam in lams:  # nan or inf would train a NaN loss, under a name (lambdanan) compare refuses
        check_value(FinetuneConfig, "lam", float(lam))
    for s in seeds:
        check_seed(s)
    points = [GridPoint(r, float(lam), int(s)) for r in regs for lam in lams for s in seeds]
    seen: dict[str, GridPoint] = {}
    for p in points:
        if p.name in seen:
            q = seen[p.name]
            raise InputError(
                f"--lambda {q.lam!r} and {p.lam!r} would both be run in {p.name}/; give values that "
                "differ in their written form"
            )
        seen[p.name] = p
    return points


def is_sweep(points) -> bool:
    return len(points) > 1


def _check_claim(out: Path) -> None:
    """``out`` is new, empty, or a previous sweep (its sweep.json); anything else is refused."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory for the sweep")
    entries = list(out.iterdir()) if out.exists() else []
    if entries and not (out / SWEEP_FILE).is_file():
        raise InputError(
            f"--out {out} holds files and is not a geomscope sweep; choose a new or empty directory"
        )


def _claim(out: Path, points: list[GridPoint]) -> None:
    """Write ``out/sweep.json`` (after :func:`_check_claim`)."""
    _check_claim(out)
    make_dirs(out)
    write_json_atomic(
        out / SWEEP_FILE,
        {
            "format": SWEEP_FORMAT,
            "runs": [{"name": p.name, "reg": p.reg, "lambda": p.lam, "seed": p.seed} for p in points],
        },
    )


def _check_shared_inputs(base, log: Log | None) -> None:
    """What every grid point shares, checked as finetune checks it: the options, the device, the
    data files and the model (how its name resolves, its config and tokenizer). InputError, one line,
    for what none of the points could use."""
    from geomscope.model.classifier import check_model_source
    from geomscope.model.names import resolve_model
    from geomscope.train.engine import check_device
    from geomscope.train.loop import read_data

    resolve_model(base.model, log=log)  # first: a hub name that does not resolve is one line at once
    base.validate()
    check_device(base.device, base.precision)
    read_data(base)
    check_model_source(base.model)


def point_config(base, p: GridPoint, todo: str):
    """The finetune options of grid point ``p`` (``todo`` from :func:`_plan`: run or resume)."""
    return replace(
        base,
        reg=p.reg,
        lam=p.lam,
        seed=p.seed,
        out=str(Path(base.out) / p.name),
        resume=todo == "resume",
        overwrite=base.overwrite,
    )


def check_sweep(base, points: list[GridPoint], log: Log | None = None) -> dict:
    """What :func:`run_sweep` checks before its first run, and each point's ``--out`` as its finetune
    checks it, writing nothing (``finetune --dry-run``); returns the plan (point -> run | resume |
    skip). A point whose directory its run could not use is refused naming the point; ``log`` as
    :func:`run_sweep`'s."""
    from geomscope.train.loop import check_out

    _check_claim(Path(base.out))
    _check_shared_inputs(base, log)
    plan = _plan(base, points)
    for p in points:
        if plan[p] == "skip":
            continue
        try:
            check_out(point_config(base, p, plan[p]))
        except InputError as e:
            raise InputError(f"run {p.name}: {first_line(e)}") from None
    return plan


def _plan(base, points: list[GridPoint]) -> dict:
    """What each point needs: ``skip`` (finished with these options), ``resume`` (a checkpoint of these
    options, fewer epochs than asked or not exported yet) or ``run``. A point whose checkpoint was
    trained with other options is refused here, before any point runs, as ``finetune --resume``
    refuses it (``--overwrite``: every point is redone)."""
    from geomscope.train import checkpoint as ck
    from geomscope.train.config import check_same_run
    from geomscope.train.loop import planned_fingerprint

    plan = {p: "run" for p in points}
    if base.overwrite:
        return plan
    advice = "rerun with the same options, pass --overwrite to redo the sweep's runs, or choose another --out"
    asked = None
    for p in points:
        run_dir = Path(base.out) / p.name
        if ck.read_marker(run_dir) is None:
            continue
        if not (run_dir / ck.CKPT / "state.json").is_file():
            if (run_dir / "summary.json").is_file():
                raise InputError(
                    f"{run_dir} finished but has no {ck.CKPT}/state.json to tell which options it was "
                    "trained with; pass --overwrite to redo it, or choose another --out"
                )
            continue  # cut off before its first epoch: finetune starts it again
        try:
            state = ck.read_state(run_dir)
        except InputError:
            continue  # damaged: the point's own finetune reports it, as before
        asked = asked or planned_fingerprint(base)
        fp = {**asked, "reg": p.reg, "lam": p.lam, "seed": p.seed}
        check_same_run(run_dir, state["fingerprint"], fp, base.epochs, advice)
        done = state["epochs_done"]
        if done > base.epochs:
            raise InputError(f"{run_dir} was trained for {done} epochs, not {base.epochs}; {advice}")
        finished = done == base.epochs and (run_dir / "summary.json").is_file()
        plan[p] = "skip" if finished else "resume"
    return plan


def run_sweep(base, points: list[GridPoint], *, progress: bool = False, log: Log | None = None) -> list[dict]:
    """Run every grid point of ``base`` (a FinetuneConfig whose ``out`` is the sweep directory).

    Returns one record per point: ``{name, dir, reg, lambda, seed, status, error}`` with status
    ``done`` | ``skipped`` (finished earlier with these options, see :func:`_plan`) | ``failed``
    (one-line reason in ``error``): a point that fails (a lambda that diverges, a damaged checkpoint
    of its own) is recorded and the sweep goes on. The inputs every point shares (the data files, the
    model's config) are checked once first, and the finished points' options against those asked: an
    InputError there stops the sweep before any point, as every point would fail the same way after
    loading the model again. ``progress`` and ``log`` follow :mod:`geomscope.progress`: a bar over
    the points (a failed point is printed above it), and the closing count to ``log``.
    """
    from geomscope.train import finetune

    out = Path(base.out)
    _check_shared_inputs(base, log)  # the data's hashes are in the fingerprints compared below
    plan = _plan(base, points)
    _claim(out, points)
    say = log_to(log)
    results = []
    with Progress(enabled=progress) as bar:
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
            if plan[p] == "skip":
                rec["status"] = "skipped"
            else:  # a run cut off before its first checkpoint is started again by finetune itself
                cfg = point_config(base, p, plan[p])
                try:
                    finetune(cfg)
                except GeomscopeError as e:
                    rec["status"], rec["error"] = "failed", first_line(e)
                    bar.print(f"failed: {p.name}: {rec['error']}")
            results.append(rec)
            task.advance()
    failed = [r for r in results if r["status"] == "failed"]
    say(
        f"sweep: {len(results) - len(failed)} of {len(results)} runs finished"
        + (f"; failed: {', '.join(r['name'] for r in failed)}" if failed else "")
    )
    return results
