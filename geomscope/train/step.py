"""One optimiser step of ``finetune``: the micro-batches of a global batch, their task loss and
penalty, the backward passes through the engine (:mod:`geomscope.train.engine`), and the update; with
the optimiser's parameter groups and the learning-rate schedule it steps.

The task loss of a global batch of ``n`` examples is the mean cross-entropy over all ``n``: each
process contributes ``sum_CE_local * world / n``, which DDP's gradient averaging turns into the
global mean.  For a causal LM ``n`` is the global batch's number of predicted tokens and the sum is
over token cross-entropies (:mod:`geomscope.train.causal_lm`).  With ``--grad-accum`` the penalty
is taken per micro-batch and averaged (:mod:`geomscope.train.config` says why).
"""

from __future__ import annotations

import math
import time

from geomscope import distributed as dd
from geomscope.train.config import FinetuneConfig


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
    max_grad_norm: float | None = None,
    n_examples: int | None = None,
) -> dict:
    """One optimizer step on this rank's share of a global batch of ``n_global`` examples (causal
    LM: predicted tokens, with ``n_examples`` the batch's rows; the record then says both).

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
    (an LR scheduler) is stepped after the update; ``max_grad_norm`` clips the gradient's global norm
    first (``grad_norm`` in the record is the norm before clipping).  Returns the step record
    (``lr``: the rate this update used); when the loss is not finite (on any rank) no update is made
    and ``finite`` is False.
    """
    micro = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    if geometry is not None and len(micro) > 1:
        raise ValueError("the geometry log takes one batch per step")
    model.train()
    w_pen = lam / len(micro)  # lam itself for one batch
    ce_total, pens, isos, geo, finite = _micro_steps(
        model, micro, n_global, reg, w_pen, engine, monitor, geometry
    )
    lr, grad_norm = _update(model, optimizer, engine, scheduler, max_grad_norm, finite)
    task = ce_total / n_global
    pen_v = sum(pens) / len(pens) if pens else None
    return {
        "loss": task + (lam * pen_v if pen_v is not None else 0.0),
        "task_loss": task,
        "penalty": pen_v,
        "weighted_penalty": None if pen_v is None else lam * pen_v,
        "isoscore_star": sum(isos) / len(isos) if isos else None,
        "lr": lr,
        "examples": n_global if n_examples is None else n_examples,
        **({"predicted_tokens": n_global} if n_examples is not None else {}),
        **({"grad_norm": grad_norm} if max_grad_norm is not None else {}),
        "finite": finite,
        **(geo or {}),
    }


def _micro_steps(model, micro, n_global, reg, w_pen, engine, monitor, geometry):
    """Forward and backward of each micro-batch in turn, stopping at the first whose loss is not
    finite: (global CE sum, penalties, batch IsoScore*s, geometry record or None, finite)."""
    ce_total, pens, isos, geo, finite = 0.0, [], [], None, True
    for i, mb in enumerate(micro):
        with engine.micro_batch(model, last=i == len(micro) - 1):
            ce, pen_v, iso, finite, geo = _micro_step(
                model, mb, n_global, reg, w_pen, engine, monitor, geometry
            )
        ce_total += ce
        if pen_v is not None:
            pens.append(pen_v)
        if iso is not None:
            isos.append(iso)
        if not finite:  # global: every rank stops here
            if i > 0 and engine.deepspeed:
                raise _accumulated_inside_deepspeed(i)
            break
    return ce_total, pens, isos, geo, finite


def _update(model, optimizer, engine, scheduler, max_grad_norm, finite: bool):
    """The step's update when its loss is ``finite`` (clipped, then the scheduler stepped) and the
    gradients cleared either way: (the learning rate the update used, the gradient norm or None)."""
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = engine.step(model, optimizer, max_grad_norm) if finite else None
    if finite and scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm


def _accumulated_inside_deepspeed(i: int):
    """DeepSpeed holds the earlier micro-batches' gradients inside its engine (reduced into its
    partitions) and has no call that discards them, so the step cannot be skipped as elsewhere."""
    from geomscope.errors import DataError

    return DataError(
        f"the loss is not finite in micro-batch {i + 1} of a step under DeepSpeed, after earlier "
        "micro-batches were accumulated; lower --lr or the regulariser's weight, or use --grad-accum 1 "
        "(a non-finite step is then skipped)"
    )


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
    elif out.logits.dim() == 3:  # --task causal-lm: next-token CE summed over the predicted tokens
        from geomscope.train.causal_lm import lm_loss_sum

        ce_sum, _ = lm_loss_sum(out.logits, labels)
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
        engine.backward(loss.float() if engine.scaler is not None else loss, model)
    return ce, pen_v, None if iso is None else float(iso.detach()), finite, geo
