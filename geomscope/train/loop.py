"""The fine-tuning loop: ``finetune(FinetuneConfig) -> summary dict``.

Per epoch: (I-STAR only) recompute C0 in eval mode without gradients; train over the epoch's
global batches with ``L = L_task + lambda * R``; evaluate; write the epoch checkpoint.  The task
loss of a global batch of ``n`` examples is the mean cross-entropy over all ``n`` (each rank
contributes ``sum_CE_local * world / n``, which DDP's gradient averaging turns into the global
mean).  AdamW (torch defaults besides ``lr``), no scheduler, as in the released I-STAR settings.

Outputs in ``out``: ``run.json`` (the options, written first), ``steps.jsonl`` (one line per
optimizer step: step, epoch, loss, task_loss, penalty R, weighted_penalty = lambda * R, batch
isoscore_star, lr, examples, seconds), ``eval.jsonl`` (one line per epoch, see
:func:`geomscope.train.evaluate.evaluate`), ``checkpoint/`` (last finished epoch), and at the end
the model and tokenizer (``save_pretrained``), ``label_map.json`` and ``summary.json``.
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

from geomscope.choices import PENALTY_PRECISIONS, PRECISIONS, REGULARISERS
from geomscope.errors import DataError, InputError
from geomscope.fileio import write_json_atomic
from geomscope.progress import Progress
from geomscope.provenance import package_versions
from geomscope.train import checkpoint as ck
from geomscope.train import distributed as dd
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
# options that must match to resume a run (epochs may grow; device and verbosity may change)
_FINGERPRINT = ("model", "train", "eval", "text_field", "text_field_2", "label_field", "reg", "lam", "zeta",
                "c0_points", "layers", "lr", "batch_size", "max_length", "seed", "precision",
                "include_padding", "penalty_precision")


@dataclass
class FinetuneConfig:
    """Options of one fine-tuning run (the CLI flags of ``geomscope finetune``)."""

    model: str
    train: str
    out: str
    eval: str | None = None
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
    penalty_precision: str = "fp64"  # arithmetic of the I-STAR batch covariance: fp64 | fp32
    monitor: bool = True  # log batch IsoScore* (identity target) also for cosreg / none
    extra: dict = field(default_factory=dict)  # recorded in run.json / summary.json (e.g. model alias)


def _validate(cfg: FinetuneConfig) -> None:
    if cfg.reg not in REGS:
        raise InputError(f"unknown --reg {cfg.reg!r}; use one of {', '.join(REGS)}")
    if cfg.precision not in PRECISIONS:
        raise InputError(f"unknown --precision {cfg.precision!r}; use one of {', '.join(PRECISIONS)}")
    if cfg.penalty_precision not in PENALTY_PRECISIONS:
        raise InputError(f"unknown --penalty-precision {cfg.penalty_precision!r}; use fp64 or fp32")
    if not 0.0 <= cfg.zeta <= 1.0:
        raise InputError(f"--zeta must lie in [0, 1], got {cfg.zeta}")
    for name, v, lo in (("epochs", cfg.epochs, 1), ("batch-size", cfg.batch_size, 1),
                        ("max-length", cfg.max_length, 2), ("c0-points", cfg.c0_points, 2)):
        if v < lo:
            raise InputError(f"--{name} must be at least {lo}, got {v}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise InputError(f"--lr must be a positive number, got {cfg.lr}")
    if not math.isfinite(cfg.lam):
        raise InputError(f"--lambda must be a finite number, got {cfg.lam}")
    if cfg.eval is None:
        raise InputError("an evaluation file is needed: pass --eval FILE")


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


def train_step(model, batch: dict, n_global: int, reg, lam: float, optimizer, scaler, autocast, d: dd.Dist,
               monitor=None) -> dict:
    """One optimizer step on this rank's share of a global batch of ``n_global`` examples.

    ``reg`` is an :class:`~geomscope.train.regularizers.IStar`, a
    :class:`~geomscope.train.regularizers.CosReg` or None; ``monitor`` (an IStar, used without
    gradient) logs the batch IsoScore* when ``reg`` is not I-STAR.  Returns the step record; when
    the loss is not finite (on any rank) no update is made and ``finite`` is False.
    """
    import torch
    import torch.nn.functional as F

    from geomscope.train.regularizers import IStar

    model.train()
    inputs = {k: v.to(d.device, non_blocking=True) for k, v in batch.items() if k != "labels"}
    labels = batch["labels"].to(d.device)
    need_hidden = reg is not None or monitor is not None
    with autocast():
        out = model(**inputs, output_hidden_states=need_hidden)
    ce_sum = F.cross_entropy(out.logits.float(), labels, reduction="sum")
    loss = ce_sum * (d.world_size / n_global)
    pen = iso = None
    if isinstance(reg, IStar):
        pen, iso = reg(out.hidden_states, inputs["attention_mask"])
    elif reg is not None:
        pen = reg(out.hidden_states, inputs["attention_mask"])
    if monitor is not None and iso is None:
        with torch.no_grad():
            iso = monitor.isoscore_star(tuple(h.detach() for h in out.hidden_states), inputs["attention_mask"])
    if pen is not None:
        loss = loss + lam * pen
    stats = dd.all_reduce_sum(torch.stack([ce_sum.detach().double()]), d)
    task = float(stats[0]) / n_global
    pen_v = None if pen is None else float(pen.detach())
    finite = math.isfinite(task) and (pen_v is None or math.isfinite(pen_v))
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
    }


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _fingerprint(cfg: FinetuneConfig, layers: list[int], world: int) -> dict:
    fp = {k: getattr(cfg, k) for k in _FINGERPRINT}
    fp["layers"] = layers
    fp["world_size"] = world
    return fp


def _prepare_out(cfg: FinetuneConfig, out: Path) -> dict | None:
    """Check the output directory; return the checkpoint state when resuming."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    state = ck.read_state(out) if out.exists() else None
    if cfg.resume:
        if state is None:
            raise InputError(f"nothing to resume in {out} (no finished epoch checkpoint); run without --resume")
        return state
    if out.exists() and any((out / n).exists() for n in ("run.json", "steps.jsonl", "summary.json", ck.CKPT)):
        raise InputError(f"{out} already holds a finetune run; pass --resume to continue it or choose another --out")
    return None


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
    import torch

    from geomscope.extract.layers import parse_layers
    from geomscope.train.evaluate import compute_c0, evaluate
    from geomscope.train.model import load_classifier, n_blocks

    out = Path(cfg.out)
    autocast = make_autocast(cfg.precision, d.device)
    state = _on_main(lambda: _prepare_out(cfg, out), d)  # rank 0 decides, before anyone writes
    train_t = load_table(cfg.train, cfg.text_field, cfg.label_field, cfg.text_field_2)
    eval_t = load_table(cfg.eval, cfg.text_field, cfg.label_field, cfg.text_field_2)
    label2id = build_label_map(train_t) if state is None else state["label2id"]
    if state is not None and set(label2id) != set(train_t.labels):
        raise InputError(f"the training labels of {cfg.train} changed since the checkpoint in {out}; use a new --out")
    check_eval_labels(eval_t, label2id)

    _seed_all(cfg.seed)
    src = str(out / ck.CKPT) if state is not None else cfg.model
    model, tokenizer, minfo = load_classifier(src, label2id, note)
    layers = parse_layers(cfg.layers or "blocks", n_blocks(model) + 1)
    fp = _fingerprint(cfg, layers, d.world_size)
    if state is not None:
        diff = [k for k in fp if state["fingerprint"].get(k) != fp[k]]
        if diff:
            k = diff[0]
            raise InputError(f"{out} was trained with {k}={state['fingerprint'].get(k)!r}, not {fp[k]!r}; "
                             f"resume with the same options or choose another --out")
        minfo["head_added"] = state.get("head_added", False)
    model.to(d.device)
    max_length = cfg.max_length
    n_pos = getattr(model.config, "max_position_embeddings", None)
    if isinstance(n_pos, int) and max_length > n_pos:
        note(f"note: --max-length {max_length} exceeds the model's {n_pos} positions; truncating to {n_pos}")
        max_length = n_pos
    train_enc = Encoded(tokenizer, train_t, label2id, max_length)
    eval_enc = Encoded(tokenizer, eval_t, label2id, max_length)
    if len(train_enc) < d.world_size:
        raise DataError(f"{cfg.train} has {len(train_enc)} rows, fewer than the {d.world_size} processes")

    ddp_model = model
    if d.active:
        from torch.nn.parallel import DistributedDataParallel

        ddp_model = DistributedDataParallel(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    start_epoch, step = 0, 0
    if state is not None:
        ck.load_trainer_state(out, optimizer, scaler, d.rank)
        start_epoch, step = state["epochs_done"], state["global_step"]
    else:
        torch.manual_seed(cfg.seed + 7919 * d.rank)  # dropout stream per rank

    reg = make_regularizer(cfg, layers, d)
    from geomscope.train.regularizers import IStar

    # the logged batch IsoScore* of cosreg / none runs: no gradient, float32 scatter (a log value)
    monitor = IStar(layers, cfg.zeta, None, cfg.include_padding, d.reg_group, torch.float32) if (
        cfg.monitor and cfg.reg != "istar") else None
    steps_path, eval_path = out / "steps.jsonl", out / "eval.jsonl"
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if state is None:
            write_json_atomic(out / "run.json", {"config": asdict(cfg), "layers": layers,
                                                    "world_size": d.world_size, "device": str(d.device),
                                                    "batch_isoscore_target": "C0" if cfg.reg == "istar"
                                                    else "trace-matched identity"})
        ck.truncate_jsonl(steps_path, lambda r: r["step"] <= step)
        ck.truncate_jsonl(eval_path, lambda r: r["epoch"] <= start_epoch)
    dd.barrier(d)

    n_train = len(train_enc)
    per_epoch = len(global_batches(list(range(n_train)), cfg.batch_size, d.world_size))
    t_train, n_steps_timed, c0_used = 0.0, 0, None
    logf = open(steps_path, "a") if d.is_main else None
    bar = Progress(enabled=d.is_main and not quiet)
    try:
        with bar:
            progress = bar.add("training", per_epoch * max(cfg.epochs - start_epoch, 0), unit="steps")
            for epoch in range(start_epoch, cfg.epochs):
                order = epoch_order(n_train, cfg.seed, epoch)
                if cfg.reg == "istar":
                    progress.describe(f"epoch {epoch + 1}/{cfg.epochs}: C0")
                    reg.C0, c0_used = compute_c0(model, train_enc, order, layers, cfg.c0_points,
                                                 cfg.batch_size, d, autocast, cfg.include_padding)
                progress.describe(f"epoch {epoch + 1}/{cfg.epochs}")
                for gb in global_batches(order, cfg.batch_size, d.world_size):
                    t0 = time.perf_counter()
                    rec = train_step(ddp_model, train_enc.collate(rank_slice(gb, d.rank, d.world_size)), len(gb),
                                     reg, cfg.lam, optimizer, scaler, autocast, d, monitor)
                    dt = time.perf_counter() - t0
                    step += 1
                    t_train += dt
                    n_steps_timed += 1
                    finite = rec.pop("finite")
                    rec = {"step": step, "epoch": epoch + 1, **rec, "seconds": round(dt, 5)}
                    if logf is not None:
                        logf.write(json.dumps(_json_safe(rec)) + "\n")
                        logf.flush()
                    if not finite:
                        last = ck.read_state(out)
                        kept = (f"the last good checkpoint (epoch {last['epochs_done']}) is kept in {out / ck.CKPT}"
                                if last else "no epoch had finished, so there is no checkpoint")
                        raise DataError(f"loss became NaN/inf at step {step} (epoch {epoch + 1}); training stopped, "
                                        f"{kept}; lower --lr or |--lambda|")
                    progress.advance()
                    progress.info(step_line(rec))
                progress.describe(f"epoch {epoch + 1}/{cfg.epochs}: eval")
                ev = evaluate(model, eval_enc, layers, cfg.zeta, cfg.batch_size, d, autocast, len(label2id),
                              cfg.include_padding)
                ev = {"epoch": epoch + 1, "step": step, **ev, "c0_points_used": c0_used}
                rngs = dd.gather_objects(ck.rng_state(), d)
                if d.is_main:
                    with open(eval_path, "a") as f:
                        f.write(json.dumps(_json_safe(ev)) + "\n")
                    ck.save_checkpoint(out, model, tokenizer, optimizer, scaler,
                                       {"epochs_done": epoch + 1, "global_step": step, "fingerprint": fp,
                                        "label2id": label2id, "head_added": minfo["head_added"]}, rngs)
                    bar.print(eval_line(ev))
                dd.barrier(d)
    finally:
        if logf is not None:
            logf.close()

    summary = None
    if d.is_main:
        evals = [json.loads(ln) for ln in eval_path.read_text().splitlines() if ln.strip()]
        label_map = {"label2id": label2id, "id2label": {str(i): lab for lab, i in label2id.items()}}
        ck.export_model(out, model, tokenizer, {"label_map.json": label_map})
        summary = _json_safe({
            "out": str(out), "model": cfg.model, "reg": cfg.reg, "lambda": cfg.lam, "zeta": cfg.zeta,
            "layers": layers, "include_padding": cfg.include_padding, "c0_points": cfg.c0_points,
            "c0_points_used": c0_used, "epochs": cfg.epochs, "steps": step, "lr": cfg.lr,
            "batch_size": cfg.batch_size, "world_size": d.world_size, "global_batch": cfg.batch_size * d.world_size,
            "precision": cfg.precision, "penalty_precision": cfg.penalty_precision, "device": str(d.device),
            "seed": cfg.seed, "max_length": cfg.max_length,
            "train_examples": n_train, "train_tokens": train_enc.n_tokens, "eval_examples": len(eval_enc),
            "labels": label2id, "head_added": minfo["head_added"], "resumed": state is not None,
            "mean_step_seconds": (t_train / n_steps_timed) if n_steps_timed else None,
            "final": evals[-1] if evals else None, "evals": evals, "extra": cfg.extra,
            "eval_isoscore_target": "trace-matched identity", "versions": package_versions(),
        })
        write_json_atomic(out / "summary.json", summary)
    dd.barrier(d)
    return dd.broadcast_object(summary, d)


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
    return (f"epoch {ev['epoch']}: accuracy {ev['accuracy']:.4f}  macro-F1 {ev['macro_f1']:.4f}  "
            f"eval IsoScore* {'n/a' if iso is None else f'{iso:.4f}'}  "
            f"avg cosine {'n/a' if cos is None else f'{cos:.4f}'}")
