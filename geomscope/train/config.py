"""The options of ``geomscope finetune`` (:class:`FinetuneConfig`), their one-line checks, and what of
them a run records (``run.json``) and must match to resume (the fingerprint).

Training options (each left out of ``run.json`` and the resume fingerprint while at its default, so
older checkpoints still resume):

* ``weight_decay``: AdamW weight decay W on the weights, none on biases and LayerNorm weights (as
  transformers' Trainer groups them).  Unset (the default) keeps torch's AdamW default, 0.01 on every
  parameter, as the released I-STAR settings do.
* ``scheduler`` (constant | linear | cosine) and ``warmup`` (a fraction of the optimiser steps,
  rounded up, as transformers' ``warmup_ratio``): transformers' ``get_scheduler``, stepped once per
  optimiser step; its state is in the checkpoint and ``lr`` in steps.jsonl is the rate the step used.
  A schedule depends on the run's length, so ``epochs`` joins the resume fingerprint.
* ``grad_accum`` N: every optimiser step consumes N micro-batches of ``batch_size`` per process (so
  ``batch_size * N * world`` examples), gradients summed before one update; the task loss is the
  mean over the whole global batch, exactly as without accumulation.  The I-STAR / CosReg penalty
  is taken per micro-batch (each micro-batch's own covariance, C0 unchanged) and the step's
  gradient is the mean of the N micro-batch penalty gradients: a covariance over the accumulated
  batch would need every micro-batch's hidden states (and their graphs) alive at once, which is what
  accumulation exists to avoid.  ``penalty`` / ``isoscore_star`` in steps.jsonl are the means over
  the step's micro-batches.  With N = 1 nothing changes.
* ``max_grad_norm``: the global L2 norm of the step's gradient (task loss and penalty, after DDP's
  averaging, over every parameter) clipped to this value before the update, by Accelerate's
  ``clip_grad_norm_`` (which unscales fp16 gradients first and works on FSDP shards); ``grad_norm``
  in steps.jsonl is the norm before clipping.  Unset: no clipping, and no ``grad_norm``.
* ``gradient_checkpointing``: transformers' activation checkpointing (non-reentrant, so dropout
  replays the same masks): the same gradients for less memory, so it is not in the fingerprint.
* ``lora`` R (``lora_alpha``, ``lora_target``): low-rank adapters, :mod:`geomscope.train.lora`.
* ``report_to``: an experiment tracker for the step and eval records, :mod:`geomscope.train.tracking`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from geomscope.choices import PENALTY_PRECISIONS, PRECISIONS, REGULARISERS, SCHEDULERS, TASKS
from geomscope.errors import InputError

#: the training options added after the first release, with their defaults: recorded in run.json and the
#: resume fingerprint only when set to something else (so checkpoints written before them still resume)
NEW_DEFAULTS = {
    "weight_decay": None,
    "scheduler": "constant",
    "warmup": 0.0,
    "grad_accum": 1,
    "max_grad_norm": None,
    "gradient_checkpointing": False,
    "lora": None,
    "lora_alpha": None,
    "lora_target": "q,v",
    "report_to": "none",
}
_NOT_FINGERPRINTED = ("report_to", "gradient_checkpointing")  # neither changes what is learnt
# options that must match to resume a run (epochs may grow; device and verbosity may change)
_FINGERPRINT = (
    "model",
    "train",
    "eval",
    "text_field",
    "text_field_2",
    "label_field",
    "reg",
    "lam",
    "zeta",
    "c0_points",
    "layers",
    "lr",
    "batch_size",
    "max_length",
    "seed",
    "precision",
    "include_padding",
    "penalty_precision",
    "task",
)


@dataclass
class FinetuneConfig:
    """Options of one fine-tuning run (the CLI flags of ``geomscope finetune``)."""

    model: str
    train: str
    out: str
    eval: str | None = None
    task: str = "classification"  # classification (single sentences / pairs) | qa (SQuAD-style spans)
    reg: str = "istar"
    lam: float = -5.0
    zeta: float = 0.2
    c0_points: int = 250_000
    layers: str | None = None
    epochs: int = 4
    lr: float = 1e-5
    batch_size: int = 32
    max_length: int = 128
    seed: int = 0
    precision: str = "fp32"
    device: str = "auto"
    include_padding: bool = False
    text_field: str = "sentence"
    text_field_2: str | None = None
    label_field: str = "label"
    resume: bool = False
    overwrite: bool = False  # replace a previous finetune output in out (only what it wrote)
    penalty_precision: str = "fp64"  # arithmetic of the I-STAR batch covariance: fp64 | fp32
    monitor: bool = True  # log batch IsoScore* (identity target) also for cosreg / none
    save_every: int | None = None  # keep out/checkpoints/step<N>/ every N optimiser steps (and step0)
    log_geometry: int | None = None  # every N steps: per-layer gradient energy / IsoScore* (train.geometry)
    geometry_rank: tuple[int, ...] = (8, 32)  # ranks r of the top-r C0 subspaces of --log-geometry
    weight_decay: float | None = None  # None: torch's AdamW default (0.01 on every parameter)
    scheduler: str = "constant"  # constant | linear | cosine (transformers' get_scheduler)
    warmup: float = 0.0  # warmup fraction of the optimiser steps
    grad_accum: int = 1  # micro-batches of batch_size per optimiser step (penalty per micro-batch)
    max_grad_norm: float | None = None  # clip the global gradient norm before each update (None: no clip)
    gradient_checkpointing: bool = False  # recompute block activations in backward (memory for compute)
    lora: int | None = None  # LoRA rank (None: full fine-tuning)
    lora_alpha: float | None = None  # LoRA alpha (None: 2 * rank)
    lora_target: str = "q,v"  # module names (or q, k, v, o) that get adapters
    report_to: str = "none"  # none | tensorboard | wandb | mlflow
    extra: dict = field(default_factory=dict)  # recorded in run.json / summary.json (e.g. model alias)


def validate(cfg: FinetuneConfig) -> None:
    if cfg.task not in TASKS:
        raise InputError(f"unknown --task {cfg.task!r}; use one of {', '.join(TASKS)}")
    if cfg.reg not in REGULARISERS:
        raise InputError(f"unknown --reg {cfg.reg!r}; use one of {', '.join(REGULARISERS)}")
    if cfg.precision not in PRECISIONS:
        raise InputError(f"unknown --precision {cfg.precision!r}; use one of {', '.join(PRECISIONS)}")
    if cfg.penalty_precision not in PENALTY_PRECISIONS:
        raise InputError(f"unknown --penalty-precision {cfg.penalty_precision!r}; use fp64 or fp32")
    if not 0.0 <= cfg.zeta <= 1.0:
        raise InputError(f"--zeta must lie in [0, 1], got {cfg.zeta}")
    for name, v, lo in (
        ("epochs", cfg.epochs, 1),
        ("batch-size", cfg.batch_size, 1),
        ("max-length", cfg.max_length, 2),
        ("c0-points", cfg.c0_points, 2),
    ):
        if v < lo:
            raise InputError(f"--{name} must be at least {lo}, got {v}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise InputError(f"--lr must be a positive number, got {cfg.lr}")
    if not math.isfinite(cfg.lam):
        raise InputError(f"--lambda must be a finite number, got {cfg.lam}")
    check_seed(cfg.seed)
    if cfg.eval is None:
        raise InputError("an evaluation file is needed: pass --eval FILE")
    if cfg.save_every is not None and cfg.save_every < 1:
        raise InputError(f"--save-every must be at least 1 step, got {cfg.save_every}")
    if cfg.log_geometry is not None:
        from geomscope.train.geometry import check_ranks

        if cfg.log_geometry < 1:
            raise InputError(f"--log-geometry must be at least 1 step, got {cfg.log_geometry}")
        check_ranks(cfg.geometry_rank)  # whole numbers >= 1 here; below D once the model is loaded
    _validate_training_options(cfg)


def _validate_training_options(cfg: FinetuneConfig) -> None:
    """The options of issue 14 (weight decay, schedule, accumulation, LoRA, tracker): one-line errors."""
    from geomscope.train.tracking import check_tracker

    wd = cfg.weight_decay
    if wd is not None and not (math.isfinite(wd) and wd >= 0):
        raise InputError(f"--weight-decay must be a number >= 0, got {wd}")
    if cfg.scheduler not in SCHEDULERS:
        raise InputError(f"unknown --scheduler {cfg.scheduler!r}; use one of {', '.join(SCHEDULERS)}")
    if not (math.isfinite(cfg.warmup) and 0.0 <= cfg.warmup <= 1.0):
        raise InputError(f"--warmup is a fraction of the steps in [0, 1], got {cfg.warmup}")
    if isinstance(cfg.grad_accum, bool) or not isinstance(cfg.grad_accum, int) or cfg.grad_accum < 1:
        raise InputError(f"--grad-accum must be at least 1 (micro-batches per step), got {cfg.grad_accum}")
    mgn = cfg.max_grad_norm
    if mgn is not None and not (math.isfinite(mgn) and mgn > 0):
        raise InputError(f"--max-grad-norm must be a positive number, got {mgn}")
    if cfg.grad_accum > 1 and cfg.log_geometry is not None:
        raise InputError("--log-geometry does not support --grad-accum > 1 yet; pass one of them")
    if cfg.lora is None:
        if cfg.lora_alpha is not None or cfg.lora_target != NEW_DEFAULTS["lora_target"]:
            raise InputError("--lora-alpha and --lora-target need --lora RANK")
    else:
        from geomscope.train.lora import check_peft

        if cfg.lora < 1:
            raise InputError(f"--lora is the adapter rank, at least 1, got {cfg.lora}")
        if cfg.lora_alpha is not None and not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
            raise InputError(f"--lora-alpha must be a positive number, got {cfg.lora_alpha}")
        if cfg.save_every is not None:
            raise InputError("--save-every does not support --lora yet (snapshots would hold only adapters)")
        check_peft()
    check_tracker(cfg.report_to)


#: the fingerprint's records of the data files' contents (a file changed in place keeps its path)
_DATA_KEYS = {"train_data": "train", "eval_data": "eval"}
#: the largest --seed + 1: the seed is mixed with the epoch (data.epoch_order) and the rank (dropout)
#: into torch generator seeds, which must stay below 2**64; NumPy takes seeds below 2**32
SEED_LIMIT = 2**32


def check_seed(seed) -> None:
    """One line for a seed the generators cannot take (checked by a grid before any run, too)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise InputError(f"--seed must be a whole number from 0 to {SEED_LIMIT - 1}, got {seed}")


def data_identity(path: str) -> dict:
    """sha256 and size of a data file's bytes (of a save_to_disk directory's files), as extract
    records its inputs."""
    from pathlib import Path

    from geomscope.extract.sources import InputFile, hash_input

    p = Path(path)
    inp = InputFile(arg=str(path), path=p, kind="dataset" if p.is_dir() else "file")
    hash_input(inp)
    return {"sha256": inp.sha256, "bytes": inp.bytes}


def fingerprint(cfg: FinetuneConfig, layers: list[int], world: int) -> dict:
    fp = {k: getattr(cfg, k) for k in _FINGERPRINT}
    for key, field_name in _DATA_KEYS.items():
        fp[key] = data_identity(getattr(cfg, field_name))
    if cfg.task == "classification":
        del fp["task"]  # checkpoints written before --task existed stay resumable
    fp["layers"] = layers
    fp["world_size"] = world
    fp.update(changed_options(cfg, fingerprint=True))
    if "scheduler" in fp or "warmup" in fp:  # a schedule spans the whole run: its length must match
        fp["epochs"] = cfg.epochs
    return fp


def check_same_run(out, stored: dict, asked: dict, epochs: int, advice: str | None = None) -> None:
    """Refuse, naming the first difference, to continue (or count as done) the run in ``out`` whose
    checkpoint holds the fingerprint ``stored`` with the options whose fingerprint is ``asked``.

    Options added since a checkpoint was written compare at their defaults; keys only an old
    fingerprint has are ignored; a checkpoint from before the data files' contents were recorded is
    compared on their paths alone (it cannot say more)."""
    advice = advice or "resume with the same options or choose another --out"
    dflt = {"task": "classification", **NEW_DEFAULTS}
    old = {**dflt, **stored}
    new = {**dflt, **asked}
    old.setdefault("epochs", epochs)  # no schedule before: the run's length was free
    new.setdefault("epochs", old["epochs"])
    for k in new:
        if k in _DATA_KEYS and k not in stored:
            continue
        if json_value(old.get(k)) == json_value(new[k]):
            continue
        if k in _DATA_KEYS:
            was, now = old[k] or {}, new[k]
            raise InputError(
                f"{out} was trained on other contents of {new[_DATA_KEYS[k]]} (sha256 "
                f"{str(was.get('sha256'))[:12]}, {was.get('bytes')} bytes; now {now['sha256'][:12]}, "
                f"{now['bytes']} bytes); {advice}"
            )
        raise InputError(f"{out} was trained with {k}={old.get(k)!r}, not {new[k]!r}; {advice}")


def changed_options(cfg: FinetuneConfig, fingerprint: bool = False) -> dict:
    """The options of :data:`NEW_DEFAULTS` that differ from their defaults (LoRA's alpha and targets
    only with --lora)."""
    out = {}
    for k, default in NEW_DEFAULTS.items():
        v = getattr(cfg, k)
        if v == default or (fingerprint and k in _NOT_FINGERPRINTED):
            continue
        out[k] = v
    if cfg.lora is not None:  # the resolved alpha is what trains
        out["lora_alpha"] = resolved_lora_alpha(cfg)
        out["lora_target"] = cfg.lora_target
    return out


def resolved_lora_alpha(cfg: FinetuneConfig) -> float:
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora


def config_record(cfg: FinetuneConfig) -> dict:
    """run.json's ``config``: every option, the newer ones only when not at their defaults."""
    rec = {k: v for k, v in asdict(cfg).items() if k not in NEW_DEFAULTS}
    rec.update(changed_options(cfg))
    return rec


def json_value(v):
    """Fingerprint values compare as JSON reads them back (tuples are lists)."""
    return list(v) if isinstance(v, tuple) else v
