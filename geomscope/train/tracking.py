"""``--report-to``: the step and eval records of ``finetune`` sent to an experiment tracker.

``tensorboard`` writes event files into ``OUT/tensorboard/`` (``torch.utils.tensorboard``; needs the
``tensorboard`` package); ``wandb`` logs an offline run under ``OUT/wandb/`` (``WANDB_MODE=offline``,
``wandb sync`` uploads it later); ``mlflow`` logs into a file store ``OUT/mlruns/``.  Only rank 0
logs.  Scalars are named ``train/<key>`` (loss, task_loss, penalty, weighted_penalty,
isoscore_star, lr) at the optimiser step, and ``eval/<key>`` (every number of the eval record) at the
step of the epoch's end.  A resumed run drops what the tracker holds past the checkpoint where the
tracker can (TensorBoard's ``purge_step``).
"""

from __future__ import annotations

import importlib.util
import math
import os
from abc import ABC, abstractmethod
from pathlib import Path

from geomscope.errors import InputError

#: the package each tracker needs (checked before anything is written)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
STEP_KEYS = ("loss", "task_loss", "penalty", "weighted_penalty", "isoscore_star", "lr")
#: directories a tracker writes into OUT (removed by --overwrite when the run's marker records that
#: geomscope created them: train/checkpoint.py)
DIRS = ("tensorboard", "wandb", "mlruns")


def check_tracker(kind: str) -> None:
    """One line when the package of tracker ``kind`` (a declared ``--report-to`` value, one of
    :data:`geomscope.choices.TRACKERS`, which :class:`FinetuneConfig` checks) is not installed."""
    pkg = PACKAGES.get(kind)
    if pkg is not None and importlib.util.find_spec(pkg) is None:
        hint = "'geomscope[tensorboard]'" if kind == "tensorboard" else pkg
        raise InputError(f"--report-to {kind} needs the {pkg} package: pip install {hint}")


def _numbers(rec: dict, keys=None) -> dict[str, float]:
    out = {}
    for k, v in rec.items():
        if keys is not None and k not in keys:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


class Tracker(ABC):
    """A tracker's ``log_step`` / ``log_eval`` / ``close``; ``make_tracker`` picks the backend, which
    implements ``_log``."""

    def log_step(self, rec: dict) -> None:
        self._log("train", _numbers(rec, STEP_KEYS), int(rec["step"]))

    def log_eval(self, ev: dict) -> None:
        nums = {k: v for k, v in _numbers(ev).items() if k not in ("epoch", "step")}
        self._log("eval", nums, int(ev["step"]))

    @abstractmethod
    def _log(self, prefix: str, values: dict, step: int) -> None:
        """Write ``values`` under ``prefix`` (train / eval) at ``step``."""

    def close(self) -> None:  # noqa: B027 -- optional: most backends have nothing to flush
        """Flush and release the backend (nothing by default)."""


class _TensorBoard(Tracker):
    def __init__(self, out: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        kw = {"purge_step": start_step + 1} if start_step > 0 else {}
        self.w = SummaryWriter(log_dir=str(out / "tensorboard"), **kw)

    def _log(self, prefix, values, step):
        for k, v in values.items():
            self.w.add_scalar(f"{prefix}/{k}", v, step)

    def close(self):
        self.w.flush()
        self.w.close()


class _WandB(Tracker):
    def __init__(self, out: Path, config: dict, name: str):
        os.environ.setdefault("WANDB_MODE", "offline")
        import wandb

        self.run = wandb.init(
            project="geomscope", name=name, dir=str(out), config=config, mode=os.environ["WANDB_MODE"]
        )

    def _log(self, prefix, values, step):
        self.run.log({f"{prefix}/{k}": v for k, v in values.items()}, step=step)

    def close(self):
        self.run.finish()


class _MLflow(Tracker):
    def __init__(self, out: Path, config: dict, name: str):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        mlflow.set_experiment("geomscope")
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def _log(self, prefix, values, step):
        self.mlflow.log_metrics({f"{prefix}/{k}": v for k, v in values.items()}, step=step)

    def close(self):
        self.mlflow.end_run()


def make_tracker(kind: str, out: Path, config: dict, start_step: int = 0) -> Tracker | None:
    """The tracker of ``--report-to kind`` (a declared value; None for ``none``); call on rank 0 only."""
    check_tracker(kind)
    if kind == "tensorboard":
        return _TensorBoard(out, start_step)
    if kind == "wandb":
        return _WandB(out, config, out.name)
    if kind == "mlflow":
        return _MLflow(out, config, out.name)
    return None
