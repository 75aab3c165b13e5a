"""The fine-tuning loop: ``finetune(FinetuneConfig) -> summary dict``.

Per epoch: (I-STAR only) recompute C0 in eval mode without gradients; train over the epoch's
global batches with ``L = L_task + lambda * R``; evaluate; write the epoch checkpoint.  The task
loss of a global batch of ``n`` examples is the mean cross-entropy over all ``n`` (each rank
contributes ``sum_CE_local * world / n``, which DDP's gradient averaging turns into the global
mean).  ``task="qa"`` (extractive question answering, :mod:`geomscope.train.qa`) batches tokenised
context windows (features) instead of examples, with the span loss (CE(start) + CE(end)) / 2 per
feature scaled the same way, and evaluates exact match / F1.  ``task="causal-lm"`` (next-token
training of a decoder, :mod:`geomscope.train.causal_lm`) batches token rows (packed blocks or one
document each) and divides the global batch's summed token cross-entropy by its number of predicted
tokens, and evaluates perplexity.  The loop is geomscope's; the engine
under it (process group, model wrapping by the launch -- DDP or FSDP --, mixed precision,
backward, ``no_sync``) is Hugging Face Accelerate, :mod:`geomscope.train.engine`, which says why.
By default AdamW (torch defaults besides ``lr``, so weight decay 0.01 on every parameter) at a
constant learning rate, as in the released I-STAR settings.

The options and their checks: :mod:`geomscope.train.config`; one optimiser step:
:mod:`geomscope.train.step`.

Outputs in ``out``: ``run.json`` (the options, written first), ``steps.jsonl`` (one line per
optimizer step: step, epoch, loss, task_loss, penalty R, weighted_penalty = lambda * R, batch
isoscore_star, lr, examples, seconds; with ``--log-geometry EVERY`` every EVERY-th step also carries
``geometry``, the per-layer gradient energy in the layer's own top-r activation subspace with its
normal controls, and batch IsoScore*, and
``geometry_seconds``: :mod:`geomscope.train.geometry`), ``eval.jsonl`` (one line per epoch, see
:func:`geomscope.train.evaluate.evaluate`), ``checkpoint/`` (last finished epoch), and at the end
the model and tokenizer (``save_pretrained``), ``label_map.json`` (classification only) and
``summary.json``.  A causal-LM step record also carries ``predicted_tokens``, the global batch's
number of predicted tokens (its ``examples`` are rows).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

from geomscope import distributed as dd
from geomscope.errors import DataError, InputError
from geomscope.fileio import loads_json, read_regular_text, write_json_atomic
from geomscope.progress import Log, Progress, log_to, silent
from geomscope.provenance import package_versions
from geomscope.train import checkpoint as ck
from geomscope.train.config import (
    FinetuneConfig,
    changed_options,
    check_same_run,
    config_record,
    fingerprint,
    resolved_lora_alpha,
)
from geomscope.train.data import (
    Encoded,
    build_label_map,
    check_eval_labels,
    epoch_order,
    global_batches,
    load_table,
    rank_slice,
)
from geomscope.train.engine import configure_deepspeed
from geomscope.train.proofs import file_states, new_file_digests
from geomscope.train.resume_checks import check_progress
from geomscope.train.step import make_scheduler, optimizer_groups, split_micro, train_step

__all__ = ["FinetuneConfig", "finetune"]


def make_regularizer(cfg: FinetuneConfig, layers: list[int], d: dd.Dist):
    import torch

    from geomscope.train.regularizers import CosReg, IStar

    if cfg.reg == "istar":
        dtype = torch.float64 if cfg.penalty_precision == "fp64" else torch.float32
        return IStar(layers, cfg.zeta, None, cfg.include_padding, d.reg_group, dtype)
    if cfg.reg == "cosreg":
        return CosReg(-1, cfg.include_padding, d.reg_group)
    return None


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _prepare_out(cfg: FinetuneConfig, out: Path, note, *, recover: bool = True) -> dict | None:
    """Claim the output directory (refusing one geomscope did not write); return the checkpoint state
    when resuming. ``recover=False`` (``--dry-run``) changes nothing in ``out``."""
    if cfg.resume and cfg.overwrite:
        raise InputError("--resume continues a run and --overwrite replaces it; pass one of them")
    ours = ck.read_marker(out) is not None
    if ours and recover:
        ck.recover_checkpoint(out)
    has_checkpoint = ours and (out / ck.CKPT / "state.json").exists()
    state = ck.read_state(out) if cfg.resume and has_checkpoint else None
    if state is not None:
        check_progress(out / ck.CKPT / "state.json", state, cfg.epochs)
    # stopped (Ctrl-C, a crash) before its first epoch checkpoint and never finished: nothing of it is
    # worth keeping, so the plain command and --resume both start it again (what the interrupt says)
    restart = ours and not has_checkpoint and not cfg.overwrite and not (out / "summary.json").exists()
    if cfg.resume and state is None and not restart:
        raise InputError(
            f"nothing to resume in {out} (no finished epoch checkpoint of a geomscope finetune run); "
            "run without --resume"
        )
    writes, writes_into = _planned_outputs(cfg)
    ck.check_output(
        out,
        resume=state is not None,
        overwrite=cfg.overwrite or restart,
        writes=writes,
        writes_into=writes_into,
        from_step=state["global_step"] if state is not None else 0,
    )
    if restart:
        note(f"note: {out} holds a run stopped before its first epoch finished; starting it again")
    return state


def _planned_outputs(cfg: FinetuneConfig) -> tuple[list[str], list[str]]:
    """What this run writes into --out (checkpoint.planned_outputs for its options)."""
    return ck.planned_outputs(
        lora=cfg.lora is not None, tracker_dir=_tracker_dir(cfg), snapshots=cfg.save_every is not None
    )


def _tracker_dir(cfg: FinetuneConfig) -> str | None:
    """The folder of --out that --report-to's tracker writes into (None without one)."""
    if cfg.report_to == "none":
        return None
    from geomscope.train.tracking import DIRS, PACKAGES

    return DIRS[list(PACKAGES).index(cfg.report_to)]


#: what a sharded run (FSDP, DeepSpeed ZeRO) does not offer, and why
_NOT_SHARDED = {
    "--resume": "the sharded optimizer state is not checkpointed, only the gathered model",
    "--lora": "the adapters are merged into the full weights at the end, which a shard does not hold",
    "--log-geometry": "its extra gradient pass runs outside the hooks that gather the shards",
}


def _check_sharded(cfg: FinetuneConfig, eng) -> None:
    """One line, before anything is written, for an option a sharded launch cannot honour."""
    if not eng.sharded:
        return
    used = {"--resume": cfg.resume, "--lora": cfg.lora is not None, "--log-geometry": cfg.log_geometry}
    for flag, why in _NOT_SHARDED.items():
        if used[flag]:
            raise InputError(
                f"{flag} is not available under {eng.kind} ({why}); launch with DDP "
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


def _resolve_model_alias(cfg: FinetuneConfig, log: Log | None = None) -> FinetuneConfig:
    """What ``extract`` accepts as MODEL (``bundled:minilm``, a directory, a hub name) -> a loadable
    path, with the user's name and its resolution recorded in ``extra`` (a note to ``log`` when the
    hub cannot be reached and its cache holds the model)."""
    from geomscope.model.names import resolve_model

    if "model_arg" in cfg.extra:  # already resolved (a resumed or re-entered config)
        return cfg
    path, info = resolve_model(cfg.model, log=log)
    return replace(cfg, model=path, extra={**cfg.extra, "model_arg": cfg.model, "model_info": info})


def _planned_layers(cfg: FinetuneConfig) -> tuple[object, list[int]]:
    """(the model's config, the layers the run penalises and measures), from the config alone (no
    weights read), with the same one-line errors as loading it."""
    from types import SimpleNamespace

    from geomscope.layers import parse_layers
    from geomscope.model.classifier import check_model_source
    from geomscope.model.probe import n_blocks

    config = check_model_source(cfg.model)
    return config, parse_layers(cfg.layer_selection(), n_blocks(SimpleNamespace(config=config)) + 1)


def planned_fingerprint(cfg: FinetuneConfig) -> dict:
    """The fingerprint ``finetune(cfg)`` records in its checkpoint, from the model's config alone (no
    weights read): what a sweep compares its finished runs with before deciding to skip them."""
    cfg = _resolve_model_alias(cfg)
    cfg.validate()
    return fingerprint(cfg, _planned_layers(cfg)[1], dd.world_from_env()[1])


def read_data(cfg: FinetuneConfig, label2id: dict | None = None):
    """(train table, eval table, label map) as a run reads them: the eval labels must be among the
    training labels, and those of a run resumed (``label2id`` from its checkpoint) unchanged."""
    if cfg.task == "qa":
        from geomscope.train.qa import load_qa

        return load_qa(cfg.train), load_qa(cfg.eval), {}
    if cfg.task == "causal-lm":
        from geomscope.train.data import read_documents

        return read_documents(cfg.train, cfg.text_field), read_documents(cfg.eval, cfg.text_field), {}
    train_t = load_table(cfg.train, cfg.text_field, cfg.label_field, cfg.text_field_2)
    eval_t = load_table(cfg.eval, cfg.text_field, cfg.label_field, cfg.text_field_2)
    if label2id is None:
        label2id = build_label_map(train_t)
    elif set(label2id) != set(train_t.labels):
        raise InputError(
            f"the training labels of {cfg.train} changed since the checkpoint in {cfg.out}; use a new --out"
        )
    check_eval_labels(eval_t, label2id)
    return train_t, eval_t, label2id


def check_out(cfg: FinetuneConfig) -> dict | None:
    """Whether this run may write ``--out`` (see _prepare_out), changing nothing there; the checkpoint
    state when it resumes one."""
    return _prepare_out(cfg, Path(cfg.out), lambda msg: None, recover=False)


def check_run(cfg: FinetuneConfig, log: Log | None = None) -> FinetuneConfig:
    """What ``finetune(cfg)`` checks before it trains, with the same one-line errors, reading only the
    model's config and tokenizer and writing nothing (``--dry-run``): the options, the device, how
    the model resolves, its config and layers, the data files and their labels, and ``--out`` (a
    checkpoint of other options is refused as ``--resume`` refuses it). Returns the resolved config;
    ``log`` as :func:`finetune`'s."""
    from geomscope.train.engine import check_device

    cfg = _resolve_model_alias(cfg, log)
    cfg.validate()
    check_device(cfg.device, cfg.precision)
    out = Path(cfg.out)
    state = check_out(cfg)
    read_data(cfg, None if state is None else state["label2id"])
    config, layers = _planned_layers(cfg)
    if cfg.log_geometry is not None:
        from geomscope.train.geometry import check_ranks

        check_ranks(cfg.geometry_rank, config.hidden_size)
    if state is not None:
        check_same_run(
            out, state["fingerprint"], fingerprint(cfg, layers, dd.world_from_env()[1]), cfg.epochs
        )
    return cfg


def finetune(cfg: FinetuneConfig, *, progress: bool = False, log: Log | None = None) -> dict:
    """Run the fine-tuning described by ``cfg``; return the summary (also written to summary.json).

    ``progress`` and ``log`` follow :mod:`geomscope.progress` (a bar on stderr; notes such as a
    clamped ``--max-length`` one line each to ``log``), on the main process only.
    """
    note = log_to(log)
    cfg = _resolve_model_alias(cfg, note)
    cfg.validate()
    from geomscope.train import engine as en

    eng = en.start(cfg.device, cfg.precision)
    try:
        return _run(cfg, eng, progress, note if eng.d.is_main else silent)
    finally:
        en.stop(eng)


def _run(cfg: FinetuneConfig, eng, progress: bool, note: Log) -> dict:
    return _Trainer(cfg, eng, note).setup().train(progress).finish()


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
        self.c0 = None  # the epoch's C0 (I-STAR's shrinkage target), for the eval's isoscore_star_c0_*

    # -- set-up ------------------------------------------------------------------------------
    def setup(self) -> _Trainer:
        cfg, d = self.cfg, self.d
        _check_sharded(cfg, self.eng)
        # rank 0 decides, before anyone writes
        self.state = _on_main(lambda: _prepare_out(cfg, self.out, self.note), d)
        self._load_data()
        _seed_all(cfg.seed)
        self._load_model()
        self._make_optimizer()
        self._make_regularisers()
        self._prepare_logs()
        return self

    def _load_data(self) -> None:
        label2id = None if self.state is None else self.state["label2id"]
        self.train_t, self.eval_t, self.label2id = read_data(self.cfg, label2id)

    def _load_model(self) -> None:
        from geomscope.layers import parse_layers
        from geomscope.model.classifier import load_classifier
        from geomscope.model.probe import n_blocks

        cfg, d, state = self.cfg, self.d, self.state
        # a LoRA checkpoint holds the adapter: the adapters are rebuilt on the original model
        src = str(self.out / ck.CKPT) if state is not None and cfg.lora is None else cfg.model
        if cfg.task == "qa":
            from geomscope.model.classifier import load_qa_model

            self.model, self.tokenizer, self.minfo = load_qa_model(src, self.note)
        elif cfg.task == "causal-lm":
            from geomscope.model.classifier import load_causal_lm

            self.model, self.tokenizer, self.minfo = load_causal_lm(src, self.note)
        else:
            self.model, self.tokenizer, self.minfo = load_classifier(src, self.label2id, self.note)
        self.n_hidden = n_blocks(self.model) + 1
        self.layers = parse_layers(cfg.layer_selection(), self.n_hidden)
        if cfg.log_geometry is not None:
            from geomscope.train.geometry import check_ranks

            check_ranks(cfg.geometry_rank, self.model.config.hidden_size)
        self.fp = fingerprint(cfg, self.layers, d.world_size)
        if state is not None:
            check_same_run(self.out, state["fingerprint"], self.fp, cfg.epochs)
            self.minfo["head_added"] = state.get("head_added", False)
        if cfg.gradient_checkpointing:
            self._checkpoint_activations()
        if cfg.lora is not None:
            self._wrap_lora()
        self._encode(self._max_length())
        if len(self.train_enc) < d.world_size:
            raise DataError(
                f"{cfg.train} has {len(self.train_enc)} "
                f"{'features' if cfg.task == 'qa' else 'rows'}, fewer than the {d.world_size} processes"
            )

    def _encode(self, max_length: int) -> None:
        """The training and eval sets as the task batches them (examples, QA features or LM rows)."""
        cfg = self.cfg
        if cfg.task == "qa":
            from geomscope.train.qa import QAEncoded

            self.train_enc = QAEncoded(self.tokenizer, self.train_t, max_length)
            self.eval_enc = QAEncoded(self.tokenizer, self.eval_t, max_length)
        elif cfg.task == "causal-lm":
            from geomscope.train.causal_lm import LMEncoded, eos_token_id

            eos = eos_token_id(self.tokenizer, self.model.config)
            self.train_enc = LMEncoded(self.tokenizer, self.train_t, max_length, cfg.lm_batching, eos)
            self.eval_enc = LMEncoded(self.tokenizer, self.eval_t, max_length, cfg.lm_batching, eos)
        else:
            self.train_enc = Encoded(self.tokenizer, self.train_t, self.label2id, max_length)
            self.eval_enc = Encoded(self.tokenizer, self.eval_t, self.label2id, max_length)

    def _checkpoint_activations(self) -> None:
        """--gradient-checkpointing: transformers' own, non-reentrant (dropout masks are replayed, so
        the gradients are those of a plain backward pass)."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise InputError(
                f"{type(self.model).__name__} does not support gradient checkpointing; run without "
                "--gradient-checkpointing"
            )
        kwargs = {"use_reentrant": False}
        enable = getattr(
            self.model, "activation_checkpointing_enable", None
        )  # its name from transformers 5.x
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def _wrap_lora(self) -> None:
        """--lora: adapters on the chosen modules (the head trains in full); on resume the checkpoint's
        adapter weights are loaded into them."""
        from geomscope.train import lora

        cfg = self.cfg
        targets = lora.resolve_targets(self.model, cfg.lora_targets())
        self.model = lora.wrap(self.model, cfg.lora, resolved_lora_alpha(cfg), targets)
        self.lora_record = {
            "rank": cfg.lora,
            "alpha": resolved_lora_alpha(cfg),
            "targets": targets,
            "trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
        if self.state is not None:
            from geomscope.model.classifier import load_lora_adapter

            load_lora_adapter(self.model, self.out / ck.CKPT)

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

        def adamw(module):
            if cfg.weight_decay is None and cfg.lora is None:
                return torch.optim.AdamW(module.parameters(), lr=cfg.lr)  # as before the options
            return torch.optim.AdamW(optimizer_groups(module, cfg.weight_decay), lr=cfg.lr)

        # the model as the launch wraps it (DDP across processes, FSDP, DeepSpeed), and Accelerate's optimizer
        configure_deepspeed(self.eng, cfg.batch_size, cfg.grad_accum, cfg.max_grad_norm)
        self.ddp_model, self.optimizer, optimizer = self.eng.prepare(self.model, adamw)
        self.fwd_model = self.eng.forward_model(self.ddp_model, self.model)  # C0, evaluation
        self.per_epoch = len(self._batches(list(range(len(self.train_enc)))))
        self.scheduler = make_scheduler(cfg, optimizer, self.per_epoch * cfg.epochs)
        self.scaler = self.eng.scaler
        if self.state is not None:
            check_progress(self.out / ck.CKPT / "state.json", self.state, cfg.epochs, self.per_epoch)
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
                controls=cfg.geometry_controls,
                seed=cfg.seed,
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
            writes, writes_into = _planned_outputs(cfg)
            ck.take_output(self.out, resume=self.state is not None, writes=writes, writes_into=writes_into)
            if self.state is None:
                write_json_atomic(
                    self.out / "run.json",
                    {
                        "config": config_record(cfg),
                        "layers": self.layers,
                        "world_size": d.world_size,
                        "engine": self.eng.kind,
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

            # what is in its folder before: only the files the tracker writes get recorded digests
            self.tracker_files = file_states(self.out / _tracker_dir(cfg))
            self.tracker = make_tracker(cfg.report_to, self.out, config_record(cfg), self.step)
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
    def train(self, progress: bool) -> _Trainer:
        cfg, d = self.cfg, self.d
        per_epoch = self.per_epoch
        self.logf = open(self.steps_path, "a") if d.is_main else None
        bar = Progress(enabled=d.is_main and progress)
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
                folder = _tracker_dir(cfg)
                ck.record_outputs(self.out, [], new_file_digests(self.out, folder, self.tracker_files))
        return self

    def _epoch(self, epoch: int, progress) -> None:
        from geomscope.train.evaluate import compute_c0

        cfg, d = self.cfg, self.d
        order = epoch_order(len(self.train_enc), cfg.seed, epoch)
        if cfg.reg == "istar":
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
            self.c0 = self.reg.C0 = C0
            if self.geometry is not None:  # the logged batch IsoScore*'s target
                self.geometry.set_c0(C0)
        progress.describe(f"epoch {epoch + 1}/{cfg.epochs}")
        for gb in self._batches(order):
            t0 = time.perf_counter()
            micro = [
                self.train_enc.collate(rank_slice(mb, d.rank, d.world_size))
                for mb in split_micro(gb, cfg.grad_accum, d.world_size)
            ]
            lm = cfg.task == "causal-lm"  # the loss is a mean over the global batch's predicted tokens
            rec = train_step(
                self.ddp_model,
                micro[0] if len(micro) == 1 else micro,
                self.train_enc.predicted(gb) if lm else len(gb),
                self.reg,
                cfg.lam,
                self.optimizer,
                self.eng,
                self.monitor,
                self.geometry if self._log_geometry_now() else None,
                self.scheduler,
                cfg.max_grad_norm,
                n_examples=len(gb) if lm else None,
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
        """The whole model's state dict under FSDP or DeepSpeed, gathered by every process (each must
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
        # the model, eval set and settings both evaluators take first
        common = (self.fwd_model, self.eval_enc, self.layers, cfg.zeta, cfg.batch_size, d, self.autocast)
        if cfg.task == "qa":
            from geomscope.train.qa import evaluate_qa

            ev = evaluate_qa(*common, C0=self.c0)
        elif cfg.task == "causal-lm":
            from geomscope.train.causal_lm import evaluate_lm

            ev = evaluate_lm(*common, C0=self.c0)
        else:
            ev = evaluate(*common, len(self.label2id), self.c0)
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
    def _task_info(self, final: dict) -> dict:
        """summary.json's fields of the task: the label map; QA's features and scores; or the LM's
        rows, predicted tokens and perplexity (``final``: the last eval record)."""
        cfg = self.cfg
        if cfg.task == "qa":
            from geomscope.train.qa import MAX_ANSWER_TOKENS, N_BEST

            return {
                "train_features": len(self.train_enc),
                "eval_features": len(self.eval_enc),
                "doc_stride": self.train_enc.stride,
                "n_best": N_BEST,
                "max_answer_tokens": MAX_ANSWER_TOKENS,
                "exact_match": final.get("exact_match"),
                "f1": final.get("f1"),
                "qa_score_scale": "percent (0-100), official SQuAD v1.1 normalisation",
            }
        if cfg.task == "causal-lm":
            train, ev = self.train_enc, self.eval_enc
            return {
                "lm_batching": cfg.lm_batching,
                "train_rows": len(train),
                "train_predicted_tokens": train.n_predicted,
                "eval_rows": len(ev),
                "eval_predicted_tokens": ev.n_predicted,
                "blank_documents": {"train": train.blank, "eval": ev.blank},
                "short_documents": {"train": train.short, "eval": ev.short},
                "eval_loss": final.get("eval_loss"),
                "perplexity": final.get("perplexity"),
            }
        return {"labels": self.label2id}

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
        evals = [loads_json(ln) for ln in read_regular_text(self.eval_path).splitlines() if ln.strip()]
        by_example = cfg.task != "classification"  # QA features and LM rows are not the examples
        return _json_safe(
            {
                "out": str(self.out),
                "model": cfg.model,
                **({"task": cfg.task} if by_example else {}),
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
                "engine": self.eng.kind,  # one process, DDP, FSDP or DeepSpeed ZeRO-n
                "global_batch": cfg.batch_size * cfg.grad_accum * d.world_size,  # examples per optimiser step
                "precision": cfg.precision,
                "penalty_precision": cfg.penalty_precision,
                "log_geometry": cfg.log_geometry,
                "geometry_rank": list(cfg.geometry_rank) if cfg.log_geometry else None,
                "device": str(d.device),
                "seed": cfg.seed,
                "max_length": cfg.max_length,
                "train_examples": self.train_enc.n_examples if by_example else len(self.train_enc),
                "train_tokens": self.train_enc.n_tokens,
                "eval_examples": self.eval_enc.n_examples if by_example else len(self.eval_enc),
                **self._task_info(evals[-1] if evals else {}),
                "head_added": self.minfo["head_added"],
                "resumed": self.state is not None,
                "mean_step_seconds": (self.t_train / self.n_steps_timed) if self.n_steps_timed else None,
                "final": evals[-1] if evals else None,
                "evals": evals,
                "extra": cfg.extra,
                **changed_options(cfg),
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
    """One line per epoch evaluation (IsoScore* against both targets, :mod:`geomscope.train.evaluate`)."""
    iso, iso_c0, cos = ev.get("isoscore_star"), ev.get("isoscore_star_c0_pooled"), ev.get("avgcos")
    return (
        f"epoch {ev['epoch']}: "
        + "  ".join(task_scores(ev))
        + f"  eval IsoScore* trace {_value(iso, '.4f')}  "
        + ("" if iso_c0 is None else f"C0 {iso_c0:.4f}  ")
        + f"avg cosine {_value(cos, '.4f')}"
    )


def task_scores(ev: dict, brief: bool = False) -> list[str]:
    """The task's own numbers of an evaluation record, each as "name value": QA's exact match and F1
    (percent), a causal LM's perplexity, a classifier's accuracy and (unless ``brief``) macro-F1."""
    if "exact_match" in ev:  # --task qa
        return [f"exact match {ev['exact_match']:.2f}", f"F1 {ev['f1']:.2f}"]
    if "perplexity" in ev:  # --task causal-lm
        return [f"perplexity {_value(ev['perplexity'], '.4g')}"]
    accuracy = [f"accuracy {_value(ev.get('accuracy'), '.4f')}"]
    return accuracy if brief else [*accuracy, f"macro-F1 {_value(ev.get('macro_f1'), '.4f')}"]


def _value(v: float | None, spec: str) -> str:
    """``v`` formatted by ``spec``, or n/a where it is undefined."""
    return "n/a" if v is None else format(v, spec)
