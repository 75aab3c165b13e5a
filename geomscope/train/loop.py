"""The fine-tuning loop: ``finetune(FinetuneConfig) -> summary dict``.

Per epoch: (I-STAR only) recompute C0 in eval mode without gradients; train over the epoch's
global batches with ``L = L_task + lambda * R``; evaluate; write the epoch checkpoint.  The task
loss of a global batch of ``n`` examples is the mean cross-entropy over all ``n`` (each rank
contributes ``sum_CE_local * world / n``, which DDP's gradient averaging turns into the global
mean).  ``task="qa"`` (extractive question answering, :mod:`geomscope.train.qa`) batches tokenised
context windows (features) instead of examples, with the span loss (CE(start) + CE(end)) / 2 per
feature scaled the same way, and evaluates exact match / F1.  The loop is geomscope's; the engine
under it (process group, model wrapping by the launch -- DDP or FSDP --, mixed precision,
backward, ``no_sync``) is Hugging Face Accelerate, :mod:`geomscope.train.engine`, which says why.
By default AdamW (torch defaults besides ``lr``, so weight decay 0.01 on every parameter) at a
constant learning rate, as in the released I-STAR settings.

Training options (each left out of ``run.json`` and the resume fingerprint while at its default, so
older checkpoints still resume):

* ``weight_decay``: AdamW weight decay W on the weights, none on biases and LayerNorm weights (as
  transformers' Trainer groups them).  Unset (the default) keeps torch's AdamW default above.
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
* ``lora`` R (``lora_alpha``, ``lora_target``): low-rank adapters, :mod:`geomscope.train.lora`.
* ``report_to``: an experiment tracker for the step and eval records, :mod:`geomscope.train.tracking`.

Outputs in ``out``: ``run.json`` (the options, written first), ``steps.jsonl`` (one line per
optimizer step: step, epoch, loss, task_loss, penalty R, weighted_penalty = lambda * R, batch
isoscore_star, lr, examples, seconds; with ``--log-geometry EVERY`` every EVERY-th step also carries
``geometry``, the per-layer gradient energy in the top-r subspace of C0 and batch IsoScore*, and
``geometry_seconds``: :mod:`geomscope.train.geometry`), ``eval.jsonl`` (one line per epoch, see
:func:`geomscope.train.evaluate.evaluate`), ``checkpoint/`` (last finished epoch), and at the end
the model and tokenizer (``save_pretrained``), ``label_map.json`` (classification only) and
``summary.json``.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from geomscope import distributed as dd
from geomscope.choices import PENALTY_PRECISIONS, PRECISIONS, REGULARISERS
from geomscope.errors import DataError, InputError
from geomscope.fileio import write_json_atomic
from geomscope.progress import Progress
from geomscope.provenance import package_versions
from geomscope.train import checkpoint as ck
from geomscope.train.data import (
    Encoded,
    build_label_map,
    check_eval_labels,
    epoch_order,
    global_batches,
    load_table,
    rank_slice,
)

REGS = REGULARISERS
TASKS = ("classification", "qa")
SCHEDULERS = ("constant", "linear", "cosine")
#: the training options added after the first release, with their defaults: recorded in run.json and the
#: resume fingerprint only when set to something else (so checkpoints written before them still resume)
NEW_DEFAULTS = {
    "weight_decay": None,
    "scheduler": "constant",
    "warmup": 0.0,
    "grad_accum": 1,
    "lora": None,
    "lora_alpha": None,
    "lora_target": "q,v",
    "report_to": "none",
}
_NOT_FINGERPRINTED = ("report_to",)
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
    lora: int | None = None  # LoRA rank (None: full fine-tuning)
    lora_alpha: float | None = None  # LoRA alpha (None: 2 * rank)
    lora_target: str = "q,v"  # module names (or q, k, v, o) that get adapters
    report_to: str = "none"  # none | tensorboard | wandb | mlflow
    extra: dict = field(default_factory=dict)  # recorded in run.json / summary.json (e.g. model alias)


def _validate(cfg: FinetuneConfig) -> None:
    if cfg.task not in TASKS:
        raise InputError(f"unknown --task {cfg.task!r}; use one of {', '.join(TASKS)}")
    if cfg.reg not in REGS:
        raise InputError(f"unknown --reg {cfg.reg!r}; use one of {', '.join(REGS)}")
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


def split_micro(global_batch: list[int], n: int, world_size: int) -> list[list[int]]:
    """``--grad-accum n``: a global batch cut into at most ``n`` contiguous micro-batches, each with at
    least ``world_size`` examples (so every rank gets one); the same cut on every rank."""
    m = max(1, min(n, len(global_batch) // world_size))
    q, r = divmod(len(global_batch), m)
    out, lo = [], 0
    for i in range(m):
        hi = lo + q + (1 if i < r else 0)
        out.append(global_batch[lo:hi])
        lo = hi
    return out


def _is_no_decay(name: str, module) -> bool:
    return name.endswith("bias") or "norm" in type(module).__name__.lower()


def optimizer_groups(model, weight_decay: float | None):
    """AdamW's parameters: all of the model's (torch's default decay) when ``weight_decay`` is None;
    else two groups, ``weight_decay`` on weights and 0 on biases and LayerNorm (any *Norm) weights.
    Frozen parameters (LoRA) are left out."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if weight_decay is None:
        return [p for _, p in params]
    owner = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = mod
    decay = [p for n, p in params if not _is_no_decay(n, owner.get(n))]
    no_decay = [p for n, p in params if _is_no_decay(n, owner.get(n))]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_scheduler(cfg: FinetuneConfig, optimizer, total_steps: int):
    """transformers' ``get_scheduler`` for ``--scheduler`` / ``--warmup`` (None for constant without
    warmup: the optimizer is left alone, bit for bit the behaviour before schedules existed)."""
    if cfg.scheduler == "constant" and cfg.warmup == 0:
        return None
    from transformers import get_scheduler

    warmup = math.ceil(total_steps * cfg.warmup)
    name = "constant_with_warmup" if cfg.scheduler == "constant" else cfg.scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def make_regularizer(cfg: FinetuneConfig, layers: list[int], d: dd.Dist):
    import torch

    from geomscope.train.regularizers import CosReg, IStar

    if cfg.reg == "istar":
        dtype = torch.float64 if cfg.penalty_precision == "fp64" else torch.float32
        return IStar(layers, cfg.zeta, None, cfg.include_padding, d.reg_group, dtype)
    if cfg.reg == "cosreg":
        return CosReg(-1, cfg.include_padding, d.reg_group)
    return None


def train_step(
    model,
    batch: dict | list[dict],
    n_global: int,
    reg,
    lam: float,
    optimizer,
    engine,
    monitor=None,
    geometry=None,
    scheduler=None,
) -> dict:
    """One optimizer step on this rank's share of a global batch of ``n_global`` examples.

    ``batch`` is one collated batch, or (``--grad-accum``) a list of micro-batches whose gradients
    are summed before the single update: the task loss of each is its cross-entropy sum scaled by
    ``world / n_global`` (so the sum is the global batch's mean loss, as without accumulation) and its
    penalty is weighted ``lambda / len(batch)`` (the penalty of each micro-batch's own hidden states,
    averaged; gradients are synchronised across processes on the last micro-batch only).

    ``model`` and ``optimizer`` are what ``engine.prepare`` returned (:mod:`geomscope.train.engine`:
    Accelerate does the backward pass, the fp16 loss scaling and the synchronisation).  ``reg`` is an
    :class:`~geomscope.train.regularizers.IStar`, a :class:`~geomscope.train.regularizers.CosReg` or
    None; ``monitor`` (an IStar, used without gradient) logs the batch IsoScore* when ``reg`` is not
    I-STAR; ``geometry`` (a :class:`~geomscope.train.geometry.GeometryLog`, on the logged steps only --
    the same steps on every rank; one batch only) adds the ``geometry`` record, from gradients of the
    task loss taken before the backward pass without touching the parameter gradients; ``scheduler``
    (an LR scheduler) is stepped after the update.  Returns the step record (``lr``: the rate this
    update used); when the loss is not finite (on any rank) no update is made and ``finite`` is False.
    """
    micro = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    if geometry is not None and len(micro) > 1:
        raise ValueError("the geometry log takes one batch per step")
    model.train()
    ce_total, pens, isos, geo, finite = 0.0, [], [], None, True
    w_pen = lam / len(micro)  # lam itself for one batch
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        with nullcontext() if last else engine.no_sync(model):
            ce, pen_v, iso, finite, geo = _micro_step(
                model, mb, n_global, reg, w_pen, engine, monitor, geometry
            )
        ce_total += ce
        if pen_v is not None:
            pens.append(pen_v)
        if iso is not None:
            isos.append(iso)
        if not finite:  # global: every rank stops here
            break
    if finite:
        optimizer.step()  # Accelerate's optimizer: unscales and skips on overflow under fp16
    lr = optimizer.param_groups[0]["lr"]
    if finite and scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    task = ce_total / n_global
    pen_v = sum(pens) / len(pens) if pens else None
    return {
        "loss": task + (lam * pen_v if pen_v is not None else 0.0),
        "task_loss": task,
        "penalty": pen_v,
        "weighted_penalty": None if pen_v is None else lam * pen_v,
        "isoscore_star": sum(isos) / len(isos) if isos else None,
        "lr": lr,
        "examples": n_global,
        "finite": finite,
        **(geo or {}),
    }


def _micro_step(model, batch, n_global, reg, w_pen, engine, monitor, geometry):
    """Forward and backward of one (micro-)batch: (global CE sum, penalty, batch IsoScore*, finite,
    geometry record or None).  No backward when the loss is not finite on some rank."""
    import torch
    import torch.nn.functional as F

    from geomscope.train.regularizers import IStar

    d = engine.d
    inputs = {k: v.to(d.device, non_blocking=True) for k, v in batch.items() if k != "labels"}
    labels = batch["labels"].to(d.device)
    need_hidden = reg is not None or monitor is not None or geometry is not None
    with engine.autocast():
        out = model(**inputs, output_hidden_states=need_hidden)
    if hasattr(out, "start_logits"):  # --task qa: (CE(start) + CE(end)) / 2 per feature
        from geomscope.train.qa import qa_loss_sum

        ce_sum = qa_loss_sum(out, labels, inputs["attention_mask"])
    else:
        ce_sum = F.cross_entropy(out.logits.float(), labels, reduction="sum")
    loss = task_loss = ce_sum * (d.world_size / n_global)
    pen = iso = geo = None
    if isinstance(reg, IStar):
        pen, iso = reg(out.hidden_states, inputs["attention_mask"])
    elif reg is not None:
        pen = reg(out.hidden_states, inputs["attention_mask"])
    if monitor is not None and iso is None:
        with torch.no_grad():
            iso = monitor.isoscore_star(
                tuple(h.detach() for h in out.hidden_states), inputs["attention_mask"]
            )
    if pen is not None:
        loss = loss + w_pen * pen
    stats = dd.all_reduce_sum(torch.stack([ce_sum.detach().double()]), d)
    ce = float(stats[0])
    pen_v = None if pen is None else float(pen.detach())
    finite = math.isfinite(ce) and (pen_v is None or math.isfinite(pen_v))
    if geometry is not None and finite:  # `finite` is global: every rank takes this branch or none
        t_geo = time.perf_counter()
        scale = float(engine.scaler.get_scale()) if engine.scaler is not None else None
        grads = geometry.hidden_grads(task_loss, out.hidden_states, scale)
        rec = geometry.record(out.hidden_states, grads, inputs["attention_mask"])
        del grads
        geo = {"geometry": rec, "geometry_seconds": round(time.perf_counter() - t_geo, 5)}
    if finite:
        engine.backward(loss.float() if engine.scaler is not None else loss)
    return ce, pen_v, None if iso is None else float(iso.detach()), finite, geo


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _fingerprint(cfg: FinetuneConfig, layers: list[int], world: int) -> dict:
    fp = {k: getattr(cfg, k) for k in _FINGERPRINT}
    if cfg.task == "classification":
        del fp["task"]  # checkpoints written before --task existed stay resumable
    fp["layers"] = layers
    fp["world_size"] = world
    fp.update(_changed_options(cfg, fingerprint=True))
    if "scheduler" in fp or "warmup" in fp:  # a schedule spans the whole run: its length must match
        fp["epochs"] = cfg.epochs
    return fp


def _changed_options(cfg: FinetuneConfig, fingerprint: bool = False) -> dict:
    """The options of :data:`NEW_DEFAULTS` that differ from their defaults (LoRA's alpha and targets
    only with --lora)."""
    out = {}
    for k, default in NEW_DEFAULTS.items():
        v = getattr(cfg, k)
        if v == default or (fingerprint and k in _NOT_FINGERPRINTED):
            continue
        out[k] = v
    if cfg.lora is not None:  # the resolved alpha is what trains
        out["lora_alpha"] = _lora_alpha(cfg)
        out["lora_target"] = cfg.lora_target
    return out


def _lora_alpha(cfg: FinetuneConfig) -> float:
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora


def _config_record(cfg: FinetuneConfig) -> dict:
    """run.json's ``config``: every option, the newer ones only when not at their defaults."""
    rec = {k: v for k, v in asdict(cfg).items() if k not in NEW_DEFAULTS}
    rec.update(_changed_options(cfg))
    return rec


def _norm(v):
    """Fingerprint values compare as JSON reads them back (tuples are lists)."""
    return list(v) if isinstance(v, tuple) else v


def _prepare_out(cfg: FinetuneConfig, out: Path) -> dict | None:
    """Claim the output directory (refusing one geomscope did not write); return the checkpoint state
    when resuming."""
    if cfg.resume and cfg.overwrite:
        raise InputError("--resume continues a run and --overwrite replaces it; pass one of them")
    state = ck.read_state(out) if cfg.resume and ck.read_marker(out) is not None else None
    if cfg.resume and state is None:
        raise InputError(
            f"nothing to resume in {out} (no finished epoch checkpoint of a geomscope finetune run); "
            "run without --resume"
        )
    ck.check_output(out, resume=cfg.resume, overwrite=cfg.overwrite)
    return state


#: what a sharded run (FSDP) does not offer, and why
_NOT_SHARDED = {
    "--resume": "the sharded optimizer state is not checkpointed, only the gathered model",
    "--lora": "the adapters are merged into the full weights at the end, which a shard does not hold",
    "--log-geometry": "its extra gradient pass runs outside the hooks that gather the shards",
}


def _check_sharded(cfg: FinetuneConfig, sharded: bool) -> None:
    """One line, before anything is written, for an option a sharded launch cannot honour."""
    if not sharded:
        return
    used = {"--resume": cfg.resume, "--lora": cfg.lora is not None, "--log-geometry": cfg.log_geometry}
    for flag, why in _NOT_SHARDED.items():
        if used[flag]:
            raise InputError(
                f"{flag} is not available under FSDP ({why}); launch with DDP "
                "(accelerate launch --multi_gpu, or torchrun) for it"
            )


def _on_main(fn, d: dd.Dist):
    """Run ``fn`` on rank 0 only; every rank returns its result or raises its GeomscopeError."""
    from geomscope.errors import GeomscopeError

    res = err = None
    if d.is_main:
        try:
            res = fn()
        except GeomscopeError as e:
            err = e
    res, err = dd.broadcast_object((res, err), d)
    if err is not None:
        raise err
    return res


def _resolve_model_alias(cfg: FinetuneConfig) -> FinetuneConfig:
    """What ``extract`` accepts as MODEL (``bundled:minilm``, a directory, a hub name) -> a loadable
    path, with the user's name and its resolution recorded in ``extra``."""
    from geomscope.extract.models import resolve_model

    if "model_arg" in cfg.extra:  # already resolved (a resumed or re-entered config)
        return cfg
    path, info = resolve_model(cfg.model)
    return replace(cfg, model=path, extra={**cfg.extra, "model_arg": cfg.model, "model_info": info})


def finetune(cfg: FinetuneConfig, *, quiet: bool = False, note=None) -> dict:
    """Run the fine-tuning described by ``cfg``; return the summary (also written to summary.json)."""
    note = note or (lambda msg: print(msg, file=sys.stderr))
    cfg = _resolve_model_alias(cfg)
    _validate(cfg)
    from geomscope.train import engine as en

    eng = en.start(cfg.device, cfg.precision)
    try:
        return _run(cfg, eng, quiet, note if eng.d.is_main else (lambda msg: None))
    finally:
        en.stop(eng)


def _run(cfg: FinetuneConfig, eng, quiet: bool, note) -> dict:
    return _Trainer(cfg, eng, note).setup().train(quiet).finish()


class _Trainer:
    """One fine-tuning run: ``setup()`` (data, model, optimizer, logs), ``train()`` (the epochs),
    ``finish()`` (export and summary, on rank 0). State lives on the instance so that each step is a
    method a reader can hold in mind."""

    def __init__(self, cfg: FinetuneConfig, eng, note):
        self.cfg, self.eng, self.d, self.note = cfg, eng, eng.d, note
        self.out = Path(cfg.out)
        self.autocast = eng.autocast  # Accelerate's mixed precision (a no-op context for fp32)
        self.start_epoch = self.step = 0
        self.t_train, self.n_steps_timed, self.c0_used = 0.0, 0, None

    # -- set-up ------------------------------------------------------------------------------
    def setup(self) -> _Trainer:
        cfg, d = self.cfg, self.d
        _check_sharded(cfg, self.eng.sharded)
        self.state = _on_main(lambda: _prepare_out(cfg, self.out), d)  # rank 0 decides, before anyone writes
        self._load_data()
        _seed_all(cfg.seed)
        self._load_model()
        self._make_optimizer()
        self._make_regularisers()
        self._prepare_logs()
        return self

    def _load_data(self) -> None:
        cfg = self.cfg
        if cfg.task == "qa":
            from geomscope.train.qa import load_qa

            self.train_t, self.eval_t, self.label2id = load_qa(cfg.train), load_qa(cfg.eval), {}
            return
        self.train_t = load_table(cfg.train, cfg.text_field, cfg.label_field, cfg.text_field_2)
        self.eval_t = load_table(cfg.eval, cfg.text_field, cfg.label_field, cfg.text_field_2)
        self.label2id = build_label_map(self.train_t) if self.state is None else self.state["label2id"]
        if self.state is not None and set(self.label2id) != set(self.train_t.labels):
            raise InputError(
                f"the training labels of {cfg.train} changed since the checkpoint in {self.out}; "
                "use a new --out"
            )
        check_eval_labels(self.eval_t, self.label2id)

    def _load_model(self) -> None:
        from geomscope.extract.layers import parse_layers
        from geomscope.train.model import load_classifier, n_blocks

        cfg, d, state = self.cfg, self.d, self.state
        # a LoRA checkpoint holds the adapter: the adapters are rebuilt on the original model
        src = str(self.out / ck.CKPT) if state is not None and cfg.lora is None else cfg.model
        if cfg.task == "qa":
            from geomscope.train.model import load_qa_model

            self.model, self.tokenizer, self.minfo = load_qa_model(src, self.note)
        else:
            self.model, self.tokenizer, self.minfo = load_classifier(src, self.label2id, self.note)
        self.n_hidden = n_blocks(self.model) + 1
        self.layers = parse_layers(cfg.layers or "blocks", self.n_hidden)
        if cfg.log_geometry is not None:
            from geomscope.train.geometry import check_ranks

            check_ranks(cfg.geometry_rank, self.model.config.hidden_size)
        self.fp = _fingerprint(cfg, self.layers, d.world_size)
        if state is not None:
            dflt = {"task": "classification", **NEW_DEFAULTS}
            old = {**dflt, **state["fingerprint"]}
            new = {**dflt, **self.fp}
            old.setdefault("epochs", cfg.epochs)  # no schedule before: the run's length was free
            new.setdefault("epochs", old["epochs"])
            # new holds every newer option (its default when unset): a run of an older version compares
            # equal on them; keys only an old fingerprint has are ignored, as before
            diff = [k for k in new if _norm(old.get(k)) != _norm(new[k])]
            if diff:
                k = diff[0]
                raise InputError(
                    f"{self.out} was trained with {k}={old.get(k)!r}, not "
                    f"{new[k]!r}; resume with the same options or choose another --out"
                )
            self.minfo["head_added"] = state.get("head_added", False)
        if cfg.lora is not None:
            self._wrap_lora()
        max_length = self._max_length()
        if cfg.task == "qa":
            from geomscope.train.qa import QAEncoded

            self.train_enc = QAEncoded(self.tokenizer, self.train_t, max_length)
            self.eval_enc = QAEncoded(self.tokenizer, self.eval_t, max_length)
        else:
            self.train_enc = Encoded(self.tokenizer, self.train_t, self.label2id, max_length)
            self.eval_enc = Encoded(self.tokenizer, self.eval_t, self.label2id, max_length)
        if len(self.train_enc) < d.world_size:
            raise DataError(
                f"{cfg.train} has {len(self.train_enc)} "
                f"{'features' if cfg.task == 'qa' else 'rows'}, fewer than the {d.world_size} processes"
            )

    def _wrap_lora(self) -> None:
        """--lora: adapters on the chosen modules (the head trains in full); on resume the checkpoint's
        adapter weights are loaded into them."""
        from geomscope.train import lora

        cfg = self.cfg
        targets = lora.resolve_targets(self.model, cfg.lora_target)
        self.model = lora.wrap(self.model, cfg.lora, _lora_alpha(cfg), targets)
        self.lora_record = {
            "rank": cfg.lora,
            "alpha": _lora_alpha(cfg),
            "targets": targets,
            "trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
        if self.state is not None:
            lora.load_adapter(self.model, self.out / ck.CKPT)

    def _max_length(self) -> int:
        """--max-length, clamped to the model's positions (with a note)."""
        n_pos = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(n_pos, int) and self.cfg.max_length > n_pos:
            self.note(
                f"note: --max-length {self.cfg.max_length} exceeds the model's {n_pos} positions; "
                f"truncating to {n_pos}"
            )
            return n_pos
        return self.cfg.max_length

    def _make_optimizer(self) -> None:
        import torch

        cfg, d = self.cfg, self.d
        if cfg.weight_decay is None and cfg.lora is None:
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)  # as before the options
        else:
            optimizer = torch.optim.AdamW(optimizer_groups(self.model, cfg.weight_decay), lr=cfg.lr)
        # the model as the launch wraps it (DDP across processes), and Accelerate's optimizer
        self.ddp_model, self.optimizer = self.eng.prepare(self.model, optimizer)
        # the no-gradient passes (C0, evaluation): the module itself, unless it is sharded (FSDP: only
        # the wrapper gathers the parameters a forward needs)
        self.fwd_model = self.ddp_model if self.eng.sharded else self.model
        self.per_epoch = len(self._batches(list(range(len(self.train_enc)))))
        self.scheduler = make_scheduler(cfg, optimizer, self.per_epoch * cfg.epochs)
        self.scaler = self.eng.scaler
        if self.state is not None:
            ck.load_trainer_state(self.out, optimizer, self.scaler, d.rank, self.scheduler)
            self.start_epoch, self.step = self.state["epochs_done"], self.state["global_step"]
        else:
            torch.manual_seed(cfg.seed + 7919 * d.rank)  # dropout stream per rank

    def _batches(self, order: list[int]) -> list[list[int]]:
        """The epoch's global batches: one per optimiser step (``batch_size * grad_accum * world``)."""
        return global_batches(order, self.cfg.batch_size * self.cfg.grad_accum, self.d.world_size)

    def _make_regularisers(self) -> None:
        import torch

        from geomscope.train.regularizers import IStar

        cfg = self.cfg
        self.reg = make_regularizer(cfg, self.layers, self.d)
        self.geometry = None
        if cfg.log_geometry is not None:
            from geomscope.train.geometry import GeometryLog

            self.geometry = GeometryLog(
                self.layers,
                self.n_hidden,
                self.model.config.hidden_size,
                cfg.geometry_rank,
                cfg.zeta,
                cfg.include_padding,
                self.d,
                isoscore_target_c0=cfg.reg == "istar",
            )
        # the logged batch IsoScore* of cosreg / none runs: no gradient, float32 scatter (a log value)
        self.monitor = (
            IStar(self.layers, cfg.zeta, None, cfg.include_padding, self.d.reg_group, torch.float32)
            if (cfg.monitor and cfg.reg != "istar")
            else None
        )

    def _prepare_logs(self) -> None:
        """run.json on a new run; on resume, the logs cut back to the checkpoint."""
        cfg, d = self.cfg, self.d
        self.steps_path, self.eval_path = self.out / "steps.jsonl", self.out / "eval.jsonl"
        if d.is_main:
            ck.take_output(self.out, resume=self.state is not None)
            if self.state is None:
                write_json_atomic(
                    self.out / "run.json",
                    {
                        "config": _config_record(cfg),
                        "layers": self.layers,
                        "world_size": d.world_size,
                        "device": str(d.device),
                        "batch_isoscore_target": "C0" if cfg.reg == "istar" else "trace-matched identity",
                        **(
                            {"geometry": self.geometry.metadata(cfg.log_geometry)}
                            if self.geometry is not None
                            else {}
                        ),
                        **self._options_record(),
                    },
                )
            ck.truncate_jsonl(self.steps_path, lambda r: r["step"] <= self.step)
            ck.truncate_jsonl(self.eval_path, lambda r: r["epoch"] <= self.start_epoch)
        self.tracker = None
        if d.is_main and cfg.report_to != "none":
            from geomscope.train.tracking import make_tracker

            self.tracker = make_tracker(cfg.report_to, self.out, _config_record(cfg), self.step)
        dd.barrier(d)

    def _options_record(self) -> dict:
        """What the newer options resolved to (run.json / summary.json; empty at the defaults)."""
        cfg, rec = self.cfg, {}
        if self.scheduler is not None:
            rec["lr_schedule"] = {
                "scheduler": cfg.scheduler,
                "warmup_steps": math.ceil(self.per_epoch * cfg.epochs * cfg.warmup),
                "total_steps": self.per_epoch * cfg.epochs,
            }
        if cfg.grad_accum > 1:
            rec["accumulation"] = {
                "micro_batches": cfg.grad_accum,
                "examples_per_step": cfg.batch_size * cfg.grad_accum * self.d.world_size,
                "penalty": "per micro-batch, averaged",
            }
        if cfg.lora is not None:
            rec["lora_adapters"] = self.lora_record
        return rec

    # -- training ----------------------------------------------------------------------------
    def train(self, quiet: bool) -> _Trainer:
        cfg, d = self.cfg, self.d
        per_epoch = self.per_epoch
        self.logf = open(self.steps_path, "a") if d.is_main else None
        bar = Progress(enabled=d.is_main and not quiet)
        if self.step == 0:
            self._snapshot(initial=True)  # step0: the model before any update
        try:
            with bar:
                progress = bar.add(
                    "training", per_epoch * max(cfg.epochs - self.start_epoch, 0), unit="steps"
                )
                for epoch in range(self.start_epoch, cfg.epochs):
                    self._epoch(epoch, progress)
                    ev = self._end_epoch(epoch, progress)
                    if ev is not None:
                        bar.print(eval_line(ev))
                    dd.barrier(d)
        finally:
            if self.logf is not None:
                self.logf.close()
            if self.tracker is not None:
                self.tracker.close()
        return self

    def _epoch(self, epoch: int, progress) -> None:
        from geomscope.train.evaluate import compute_c0

        cfg, d = self.cfg, self.d
        order = epoch_order(len(self.train_enc), cfg.seed, epoch)
        if cfg.reg == "istar" or self.geometry is not None:  # --log-geometry: C0 for cosreg / none too
            progress.describe(f"epoch {epoch + 1}/{cfg.epochs}: C0")
            C0, self.c0_used = compute_c0(
                self.fwd_model,
                self.train_enc,
                order,
                self.layers,
                cfg.c0_points,
                cfg.batch_size,
                d,
                self.autocast,
                cfg.include_padding,
            )
            if cfg.reg == "istar":
                self.reg.C0 = C0
            if self.geometry is not None:
                self.geometry.set_c0(C0)
        progress.describe(f"epoch {epoch + 1}/{cfg.epochs}")
        for gb in self._batches(order):
            t0 = time.perf_counter()
            micro = [
                self.train_enc.collate(rank_slice(mb, d.rank, d.world_size))
                for mb in split_micro(gb, cfg.grad_accum, d.world_size)
            ]
            rec = train_step(
                self.ddp_model,
                micro[0] if len(micro) == 1 else micro,
                len(gb),
                self.reg,
                cfg.lam,
                self.optimizer,
                self.eng,
                self.monitor,
                self.geometry if self._log_geometry_now() else None,
                self.scheduler,
            )
            dt = time.perf_counter() - t0
            self.step += 1
            self.t_train += dt
            self.n_steps_timed += 1
            finite = rec.pop("finite")
            geo = {k: rec.pop(k) for k in ("geometry", "geometry_seconds") if k in rec}
            rec = {"step": self.step, "epoch": epoch + 1, **rec, "seconds": round(dt, 5), **geo}
            self._log_step(rec, finite, epoch)
            self._snapshot()
            progress.advance()
            progress.info(step_line(rec))

    def _log_geometry_now(self) -> bool:
        """--log-geometry EVERY: the step about to run is a multiple of EVERY (the same on every rank)."""
        every = self.cfg.log_geometry
        return self.geometry is not None and (self.step + 1) % every == 0

    def _snapshot(self, initial: bool = False) -> None:
        """--save-every: the model as it is now, for trajectories (rank 0 writes)."""
        every = self.cfg.save_every
        if every and (initial or self.step % every == 0):
            weights = self._sharded_weights()
            if self.d.is_main:
                ck.save_snapshot(self.out, self.model, self.tokenizer, self.step, weights)

    def _sharded_weights(self) -> dict | None:
        """The whole model's state dict under FSDP, gathered by every process (each must
        call this at the same point); None otherwise (``save_pretrained`` reads the module)."""
        return self.eng.full_state_dict(self.ddp_model) if self.eng.sharded else None

    def _log_step(self, rec: dict, finite: bool, epoch: int) -> None:
        """Append the step to steps.jsonl; stop on a non-finite loss, keeping the last good checkpoint."""
        if self.logf is not None:
            self.logf.write(json.dumps(_json_safe(rec)) + "\n")
            self.logf.flush()
        if self.tracker is not None:
            self.tracker.log_step(rec)
        if not finite:
            last = ck.read_state(self.out)
            kept = (
                f"the last good checkpoint (epoch {last['epochs_done']}) is kept in {self.out / ck.CKPT}"
                if last
                else "no epoch had finished, so there is no checkpoint"
            )
            raise DataError(
                f"loss became NaN/inf at step {self.step} (epoch {epoch + 1}); training stopped, "
                f"{kept}; lower --lr or |--lambda|"
            )

    def _end_epoch(self, epoch: int, progress) -> dict | None:
        """Evaluate, log and checkpoint; return the evaluation on rank 0."""
        from geomscope.train.evaluate import evaluate

        cfg, d = self.cfg, self.d
        progress.describe(f"epoch {epoch + 1}/{cfg.epochs}: eval")
        if cfg.task == "qa":
            from geomscope.train.qa import evaluate_qa

            ev = evaluate_qa(
                self.fwd_model,
                self.eval_enc,
                self.layers,
                cfg.zeta,
                cfg.batch_size,
                d,
                self.autocast,
                cfg.include_padding,
            )
        else:
            ev = evaluate(
                self.fwd_model,
                self.eval_enc,
                self.layers,
                cfg.zeta,
                cfg.batch_size,
                d,
                self.autocast,
                len(self.label2id),
                cfg.include_padding,
            )
        ev = {"epoch": epoch + 1, "step": self.step, **ev, "c0_points_used": self.c0_used}
        rngs = dd.gather_objects(ck.rng_state(), d)
        weights = self._sharded_weights()
        if not d.is_main:
            return None
        with open(self.eval_path, "a") as f:
            f.write(json.dumps(_json_safe(ev)) + "\n")
        if self.tracker is not None:
            self.tracker.log_eval(ev)
        ck.save_checkpoint(
            self.out,
            self.model,
            self.tokenizer,
            None if self.eng.sharded else self.optimizer,
            self.scaler,
            {
                "epochs_done": epoch + 1,
                "global_step": self.step,
                "fingerprint": self.fp,
                "label2id": self.label2id,
                "head_added": self.minfo["head_added"],
            },
            rngs,
            self.scheduler,
            weights,
        )
        return ev

    # -- the end -----------------------------------------------------------------------------
    def finish(self) -> dict:
        summary = None
        weights = self._sharded_weights()
        if self.d.is_main:
            label_map = {
                "label2id": self.label2id,
                "id2label": {str(i): lab for lab, i in self.label2id.items()},
            }
            extra = {"label_map.json": label_map} if self.cfg.task == "classification" else {}
            if self.cfg.lora is not None:  # OUT/adapter/, and the merged model as an ordinary checkpoint
                from geomscope.train import lora

                lora.export(self.out, self.model, self.tokenizer, extra)
            else:
                ck.export_model(self.out, self.model, self.tokenizer, extra, weights)
            summary = self._summary()
            write_json_atomic(self.out / "summary.json", summary)
        dd.barrier(self.d)
        return dd.broadcast_object(summary, self.d)

    def _summary(self) -> dict:
        cfg, d = self.cfg, self.d
        evals = [json.loads(ln) for ln in self.eval_path.read_text().splitlines() if ln.strip()]
        qa = cfg.task == "qa"
        if qa:
            from geomscope.train.qa import MAX_ANSWER_TOKENS, N_BEST

            task_info = {
                "train_features": len(self.train_enc),
                "eval_features": len(self.eval_enc),
                "doc_stride": self.train_enc.stride,
                "n_best": N_BEST,
                "max_answer_tokens": MAX_ANSWER_TOKENS,
                "exact_match": evals[-1]["exact_match"] if evals else None,
                "f1": evals[-1]["f1"] if evals else None,
                "qa_score_scale": "percent (0-100), official SQuAD v1.1 normalisation",
            }
        return _json_safe(
            {
                "out": str(self.out),
                "model": cfg.model,
                **({"task": cfg.task} if qa else {}),
                "reg": cfg.reg,
                "lambda": cfg.lam,
                "zeta": cfg.zeta,
                "layers": self.layers,
                "include_padding": cfg.include_padding,
                "c0_points": cfg.c0_points,
                "c0_points_used": self.c0_used,
                "epochs": cfg.epochs,
                "steps": self.step,
                "lr": cfg.lr,
                "batch_size": cfg.batch_size,
                "world_size": d.world_size,
                "global_batch": cfg.batch_size * cfg.grad_accum * d.world_size,  # examples per optimiser step
                "precision": cfg.precision,
                "penalty_precision": cfg.penalty_precision,
                "log_geometry": cfg.log_geometry,
                "geometry_rank": list(cfg.geometry_rank) if cfg.log_geometry else None,
                "device": str(d.device),
                "seed": cfg.seed,
                "max_length": cfg.max_length,
                "train_examples": self.train_enc.n_examples if qa else len(self.train_enc),
                "train_tokens": self.train_enc.n_tokens,
                "eval_examples": self.eval_enc.n_examples if qa else len(self.eval_enc),
                **(task_info if qa else {"labels": self.label2id}),
                "head_added": self.minfo["head_added"],
                "resumed": self.state is not None,
                "mean_step_seconds": (self.t_train / self.n_steps_timed) if self.n_steps_timed else None,
                "final": evals[-1] if evals else None,
                "evals": evals,
                "extra": cfg.extra,
                **_changed_options(cfg),
                **self._options_record(),
                "eval_isoscore_target": "trace-matched identity",
                "versions": package_versions(),
            }
        )


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def step_line(rec: dict) -> str:
    """The running numbers beside the training bar."""
    line = f"loss {rec['loss']:.4f}"
    if rec.get("isoscore_star") is not None:
        line += f"  IsoScore* {rec['isoscore_star']:.4f}"
    return line


def eval_line(ev: dict) -> str:
    """One line per epoch evaluation."""
    iso, cos = ev.get("isoscore_star"), ev.get("avgcos")
    if "exact_match" in ev:  # --task qa
        head = f"epoch {ev['epoch']}: exact match {ev['exact_match']:.2f}  F1 {ev['f1']:.2f}  "
    else:
        head = f"epoch {ev['epoch']}: accuracy {ev['accuracy']:.4f}  macro-F1 {ev['macro_f1']:.4f}  "
    return (
        head + f"eval IsoScore* {'n/a' if iso is None else f'{iso:.4f}'}  "
        f"avg cosine {'n/a' if cos is None else f'{cos:.4f}'}"
    )
