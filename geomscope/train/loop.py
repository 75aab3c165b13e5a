"""The fine-tuning loop: ``finetune(FinetuneConfig) -> summary dict``.

Per epoch: (I-STAR only) recompute C0 in eval mode without gradients; train over the epoch's
global batches with ``L = L_task + lambda * R``; evaluate; write the epoch checkpoint.  The task
loss of a global batch of ``n`` examples is the mean cross-entropy over all ``n`` (each rank
contributes ``sum_CE_local * world / n``, which DDP's gradient averaging turns into the global
mean).  ``task="qa"`` (extractive question answering, :mod:`geomscope.train.qa`) batches tokenised
context windows (features) instead of examples, with the span loss (CE(start) + CE(end)) / 2 per
feature scaled the same way, and evaluates exact match / F1.  AdamW (torch defaults besides ``lr``),
no scheduler, as in the released I-STAR settings.

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


def make_autocast(precision: str, device):
    """Autocast context factory: none for fp32; fp16 needs CUDA; bf16 works on CUDA and CPU."""
    import torch

    if precision == "fp32":
        return nullcontext
    if precision == "fp16" and device.type != "cuda":
        raise InputError("--precision fp16 needs a CUDA GPU; use --precision bf16 or fp32 on the CPU")
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


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
    batch: dict,
    n_global: int,
    reg,
    lam: float,
    optimizer,
    scaler,
    autocast,
    d: dd.Dist,
    monitor=None,
    geometry=None,
) -> dict:
    """One optimizer step on this rank's share of a global batch of ``n_global`` examples.

    ``reg`` is an :class:`~geomscope.train.regularizers.IStar`, a
    :class:`~geomscope.train.regularizers.CosReg` or None; ``monitor`` (an IStar, used without
    gradient) logs the batch IsoScore* when ``reg`` is not I-STAR; ``geometry`` (a
    :class:`~geomscope.train.geometry.GeometryLog`, on the logged steps only -- the same steps on
    every rank) adds the ``geometry`` record, from gradients of the task loss taken before the
    backward pass without touching the parameter gradients.  Returns the step record; when the loss
    is not finite (on any rank) no update is made and ``finite`` is False.
    """
    import torch
    import torch.nn.functional as F

    from geomscope.train.regularizers import IStar

    model.train()
    inputs = {k: v.to(d.device, non_blocking=True) for k, v in batch.items() if k != "labels"}
    labels = batch["labels"].to(d.device)
    need_hidden = reg is not None or monitor is not None or geometry is not None
    with autocast():
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
        loss = loss + lam * pen
    stats = dd.all_reduce_sum(torch.stack([ce_sum.detach().double()]), d)
    task = float(stats[0]) / n_global
    pen_v = None if pen is None else float(pen.detach())
    finite = math.isfinite(task) and (pen_v is None or math.isfinite(pen_v))
    if geometry is not None and finite:  # `finite` is global: every rank takes this branch or none
        t_geo = time.perf_counter()
        scale = float(scaler.get_scale()) if scaler is not None else None
        grads = geometry.hidden_grads(task_loss, out.hidden_states, scale)
        rec = geometry.record(out.hidden_states, grads, inputs["attention_mask"])
        del grads
        geo = {"geometry": rec, "geometry_seconds": round(time.perf_counter() - t_geo, 5)}
    if finite:
        if scaler is not None:
            scaler.scale(loss.float()).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": task + (lam * pen_v if pen_v is not None else 0.0),
        "task_loss": task,
        "penalty": pen_v,
        "weighted_penalty": None if pen_v is None else lam * pen_v,
        "isoscore_star": None if iso is None else float(iso.detach()),
        "lr": optimizer.param_groups[0]["lr"],
        "examples": n_global,
        "finite": finite,
        **(geo or {}),
    }


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
    return fp


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
    d = dd.setup(cfg.device)
    try:
        return _run(cfg, d, quiet, note if d.is_main else (lambda msg: None))
    finally:
        dd.teardown(d)


def _run(cfg: FinetuneConfig, d: dd.Dist, quiet: bool, note) -> dict:
    return _Trainer(cfg, d, note).setup().train(quiet).finish()


class _Trainer:
    """One fine-tuning run: ``setup()`` (data, model, optimizer, logs), ``train()`` (the epochs),
    ``finish()`` (export and summary, on rank 0). State lives on the instance so that each step is a
    method a reader can hold in mind."""

    def __init__(self, cfg: FinetuneConfig, d: dd.Dist, note):
        self.cfg, self.d, self.note = cfg, d, note
        self.out = Path(cfg.out)
        self.autocast = make_autocast(cfg.precision, d.device)
        self.start_epoch = self.step = 0
        self.t_train, self.n_steps_timed, self.c0_used = 0.0, 0, None

    # -- set-up ------------------------------------------------------------------------------
    def setup(self) -> _Trainer:
        cfg, d = self.cfg, self.d
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
        src = str(self.out / ck.CKPT) if state is not None else cfg.model
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
            old = {"task": "classification", **state["fingerprint"]}
            new = {"task": "classification", **self.fp}
            diff = [k for k in new if old.get(k) != new[k]]
            if diff:
                k = diff[0]
                raise InputError(
                    f"{self.out} was trained with {k}={old.get(k)!r}, not "
                    f"{new[k]!r}; resume with the same options or choose another --out"
                )
            self.minfo["head_added"] = state.get("head_added", False)
        self.model.to(d.device)
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
        self.ddp_model = self.model
        if d.active:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp_model = DistributedDataParallel(
                self.model, device_ids=[d.device.index] if d.device.type == "cuda" else None
            )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
        if self.state is not None:
            ck.load_trainer_state(self.out, self.optimizer, self.scaler, d.rank)
            self.start_epoch, self.step = self.state["epochs_done"], self.state["global_step"]
        else:
            torch.manual_seed(cfg.seed + 7919 * d.rank)  # dropout stream per rank

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
                        "config": asdict(cfg),
                        "layers": self.layers,
                        "world_size": d.world_size,
                        "device": str(d.device),
                        "batch_isoscore_target": "C0" if cfg.reg == "istar" else "trace-matched identity",
                        **(
                            {"geometry": self.geometry.metadata(cfg.log_geometry)}
                            if self.geometry is not None
                            else {}
                        ),
                    },
                )
            ck.truncate_jsonl(self.steps_path, lambda r: r["step"] <= self.step)
            ck.truncate_jsonl(self.eval_path, lambda r: r["epoch"] <= self.start_epoch)
        dd.barrier(d)

    # -- training ----------------------------------------------------------------------------
    def train(self, quiet: bool) -> _Trainer:
        cfg, d = self.cfg, self.d
        per_epoch = len(global_batches(list(range(len(self.train_enc))), cfg.batch_size, d.world_size))
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
        return self

    def _epoch(self, epoch: int, progress) -> None:
        from geomscope.train.evaluate import compute_c0

        cfg, d = self.cfg, self.d
        order = epoch_order(len(self.train_enc), cfg.seed, epoch)
        if cfg.reg == "istar" or self.geometry is not None:  # --log-geometry: C0 for cosreg / none too
            progress.describe(f"epoch {epoch + 1}/{cfg.epochs}: C0")
            C0, self.c0_used = compute_c0(
                self.model,
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
        for gb in global_batches(order, cfg.batch_size, d.world_size):
            t0 = time.perf_counter()
            rec = train_step(
                self.ddp_model,
                self.train_enc.collate(rank_slice(gb, d.rank, d.world_size)),
                len(gb),
                self.reg,
                cfg.lam,
                self.optimizer,
                self.scaler,
                self.autocast,
                d,
                self.monitor,
                self.geometry if self._log_geometry_now() else None,
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
        if every and self.d.is_main and (initial or self.step % every == 0):
            ck.save_snapshot(self.out, self.model, self.tokenizer, self.step)

    def _log_step(self, rec: dict, finite: bool, epoch: int) -> None:
        """Append the step to steps.jsonl; stop on a non-finite loss, keeping the last good checkpoint."""
        if self.logf is not None:
            self.logf.write(json.dumps(_json_safe(rec)) + "\n")
            self.logf.flush()
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
                self.model,
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
                self.model,
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
        if not d.is_main:
            return None
        with open(self.eval_path, "a") as f:
            f.write(json.dumps(_json_safe(ev)) + "\n")
        ck.save_checkpoint(
            self.out,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.scaler,
            {
                "epochs_done": epoch + 1,
                "global_step": self.step,
                "fingerprint": self.fp,
                "label2id": self.label2id,
                "head_added": self.minfo["head_added"],
            },
            rngs,
        )
        return ev

    # -- the end -----------------------------------------------------------------------------
    def finish(self) -> dict:
        summary = None
        if self.d.is_main:
            label_map = {
                "label2id": self.label2id,
                "id2label": {str(i): lab for lab, i in self.label2id.items()},
            }
            extra = {"label_map.json": label_map} if self.cfg.task == "classification" else {}
            ck.export_model(self.out, self.model, self.tokenizer, extra)
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
                "global_batch": cfg.batch_size * d.world_size,
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
