"""The training engine under ``finetune``: Hugging Face Accelerate.

Why Accelerate and not ``transformers.Trainer`` with a ``compute_loss`` override: the I-STAR
penalty needs four things Trainer's loop would fight. (1) Its covariance is taken over the *global*
batch with a gradient-carrying all-reduce on a process group of its own, and the task loss is the
global batch's mean, so each process must know the global batch; Trainer's ``DistributedSampler``
pads the last batch by repeating examples. (2) C0 is recomputed in eval mode at every epoch start.
(3) Global batches are a function of (seed, epoch) alone, so a resumed run and a run on another
number of processes see the same examples. (4) Checkpoints are never pickles; Trainer's
``rng_state.pth`` and ``optimizer.pt`` are. Accelerate gives the parts that are library work without
taking the loop: the process group and device (``torchrun``, ``accelerate launch``, ``srun``),
model wrapping by the launch configuration (DDP, FSDP, DeepSpeed ZeRO) in ``prepare``, mixed
precision (autocast and the fp16 gradient scaler), ``backward``, ``no_sync`` for accumulation, and
gathering a sharded model's full state dict for saving.

DeepSpeed is the one engine that owns more of the step: its ``backward`` scales the loss by its
accumulation count and its ``step`` clips, updates and clears the gradients.  The loop already
scales each micro-batch's loss itself (:mod:`geomscope.train.step`), so :class:`Engine` calls
DeepSpeed's engine directly, with the accumulation boundary set per micro-batch and its own loss
scaling off, and :func:`configure_deepspeed` writes geomscope's batch, accumulation and clipping
options into the launch's DeepSpeed config (refusing a config that asks for something else).

:func:`start` builds the :class:`Engine`: one ``Accelerator`` and the :class:`geomscope.distributed.Dist`
the penalties use (the same processes; the penalty's all-reduces run on a second process group so they
never interleave with DDP's gradient buckets). The learning-rate scheduler is stepped by the loop,
once per optimiser step, so it is not passed to ``prepare`` (Accelerate would step it once per
process). Accelerate's device placement is off: the loop places the model itself, so an explicit
``--device cuda:N`` in a single process is honoured as before.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, replace

from geomscope import distributed as dd
from geomscope.devices import resolve_device
from geomscope.errors import InputError, first_line

#: --precision -> Accelerate's ``mixed_precision``
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class Engine:
    """An ``Accelerator`` (``acc``) and the processes' :class:`~geomscope.distributed.Dist` (``d``)."""

    acc: object
    d: dd.Dist
    owns_group: bool = False  # the process group was made by start() (closed by stop())

    @property
    def deepspeed(self) -> bool:
        """A DeepSpeed launch (``accelerate launch`` with ``distributed_type: DEEPSPEED``)."""
        from accelerate.utils import DistributedType

        return self.acc.distributed_type == DistributedType.DEEPSPEED

    @property
    def fsdp(self) -> bool:
        """An FSDP launch (``distributed_type: FSDP``; on CPU processes too, see :func:`_fsdp_on_cpu`)."""
        from accelerate.utils import DistributedType

        return self.acc.distributed_type == DistributedType.FSDP

    @property
    def sharded(self) -> bool:
        """FSDP or DeepSpeed ZeRO (from ``accelerate launch --config_file``): the optimizer state (and
        under FSDP and ZeRO-3 the parameters) is split over the processes, so saving gathers the
        model and resume is not offered."""
        return self.deepspeed or self.fsdp

    @property
    def kind(self) -> str:
        """The launch's engine, for messages: ``FSDP``, ``DeepSpeed ZeRO-2``, ``DDP`` or ``one process``."""
        if self.deepspeed:
            return f"DeepSpeed ZeRO-{self.acc.state.deepspeed_plugin.zero_stage}"
        if self.sharded:
            return "FSDP"
        return "DDP" if self.d.active else "one process"

    @property
    def scaler(self):
        """The fp16 gradient scaler Accelerate made (None unless ``--precision fp16``)."""
        return self.acc.scaler

    def autocast(self):
        return self.acc.autocast()

    def prepare(self, model, make_optimizer):
        """(the model wrapped for the launch -- DDP, FSDP, a DeepSpeed engine or as it is --, Accelerate's
        optimizer, the torch optimizer inside it).  ``make_optimizer(module)`` builds the torch optimizer
        over the module's parameters."""
        if not self.sharded:
            model.to(self.d.device)
        optimizer = make_optimizer(model)
        if self.fsdp:
            model, wrapped = self.acc.prepare(model, optimizer)
            _hold_sharded_parameters(optimizer, make_optimizer(model))
            return model, wrapped, optimizer
        try:
            return *self.acc.prepare(model, optimizer), optimizer
        except (AssertionError, ValueError, TypeError) as e:
            if not self.deepspeed:
                raise
            # DeepSpeed's config checks
            raise InputError(f"DeepSpeed refused its config: {first_line(e, 240)}") from None

    def forward_model(self, prepared, module):
        """What the no-gradient passes (C0, evaluation) call: FSDP's wrapper, the only one that gathers
        the shards a forward needs; otherwise the module itself (DeepSpeed's ZeRO-3 gathers through
        hooks on the module, and its engine's ``config`` is not the model's)."""
        return prepared if self.fsdp else module

    def micro_batch(self, model, last: bool):
        """The context of one micro-batch's forward and backward: gradients are synchronised (and under
        DeepSpeed accumulated into the update) at the ``last`` micro-batch of a step only."""
        if self.deepspeed:
            model.set_gradient_accumulation_boundary(last)
            return nullcontext()
        return nullcontext() if last else self.acc.no_sync(model)

    def backward(self, loss, model=None) -> None:
        if self.deepspeed:  # the loop has scaled the loss for accumulation already
            model.backward(loss, scale_wrt_gas=False)
        else:
            self.acc.backward(loss)

    def step(self, model, optimizer, max_grad_norm: float | None) -> float | None:
        """Clip (``max_grad_norm``) and update; the global gradient norm before clipping, when clipping.
        Under DeepSpeed its engine does both, with the clip :func:`configure_deepspeed` set."""
        if self.deepspeed:
            model.step()
            return None if max_grad_norm is None else float(model.get_global_grad_norm())
        norm = None
        if max_grad_norm is not None:
            norm = float(self.acc.clip_grad_norm_(model.parameters(), max_grad_norm))
        optimizer.step()  # Accelerate's optimizer: unscales and skips on overflow under fp16
        return norm

    def unwrap(self, model):
        return self.acc.unwrap_model(model)

    def full_state_dict(self, model):
        """The whole model's state dict, gathered from the shards under FSDP (a collective:
        every process calls it; only the main process gets the tensors under FSDP)."""
        return self.acc.get_state_dict(model)


def _hold_sharded_parameters(optimizer, fresh) -> None:
    """Point ``optimizer``'s parameter groups at the sharded parameters, group for group, as ``fresh`` (the
    same optimizer built over the sharded model) holds them.  Accelerate remaps an FSDP2 optimizer
    itself, but its remapping can give one rank's optimizer a parameter twice and another none (so
    that parameter never moves there); building the groups again cannot mismatch."""
    if len(optimizer.param_groups) != len(fresh.param_groups) or optimizer.state:
        raise RuntimeError("the optimizer changed between its two builds")
    for group, new in zip(optimizer.param_groups, fresh.param_groups, strict=True):
        group["params"] = list(new["params"])


def _export_world(rank: int, world: int, local: int) -> None:
    """Accelerate reads RANK / WORLD_SIZE / LOCAL_RANK: give it the group that already exists (tests and
    notebooks create one themselves) or the one SLURM described (``dd.world_from_env`` maps it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
        # Accelerate checks these before it sees that the group exists; no rendezvous will use them
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))


def check_device(device: str, precision: str):
    """The torch device this process trains on (``--device``), refusing a ``--precision`` it lacks."""
    dev = resolve_device(device, dd.world_from_env()[2])
    if precision == "fp16" and dev.type != "cuda":
        raise InputError("--precision fp16 needs a CUDA GPU; use --precision bf16 or fp32 on the CPU")
    return dev


def start(device: str, precision: str) -> Engine:
    """One Accelerator for this run (any earlier one in this process is forgotten first: Accelerate's
    state is a process-wide singleton, and a notebook or test may run several fine-tunings)."""
    from accelerate.state import AcceleratorState

    world = dd.world_from_env()[1]
    _export_world(*dd.world_from_env())
    dev = check_device(device, precision)
    import torch.distributed as dist

    existed = dist.is_initialized()
    _check_launch_precision(precision)
    AcceleratorState._reset_state(reset_partial_state=True)
    _name_deepspeed_accelerator()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed:
        _need_deepspeed()
    on_cpu = dev.type == "cpu"
    acc = _accelerator(precision, world, on_cpu=on_cpu, deepspeed=deepspeed)
    if on_cpu:
        _fsdp_on_cpu(acc)
    d = _penalty_dist(acc, device, dev)
    eng = Engine(acc, d, owns_group=not existed and dist.is_initialized())
    if eng.sharded:  # each forward gathers parameters from every process: no pass may skip one
        eng.d = replace(d, lockstep=True)
    return eng


def _check_launch_precision(precision: str) -> None:
    """A launch's ``--mixed_precision`` (``accelerate launch``) other than ``--precision``'s is refused:
    geomscope's flag decides."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch --mixed_precision
    if launched not in ("no", MIXED_PRECISION[precision]):
        raise InputError(
            f"accelerate launch asks for --mixed_precision {launched} but finetune has --precision "
            f"{precision}; geomscope's flag decides, so pass --precision {launched.replace('no', 'fp32')}"
        )


def _accelerator(precision: str, world: int, *, on_cpu: bool, deepspeed: bool):
    """The Accelerator of ``world`` processes (it starts a multi-process launch's group); processes
    that do not meet within the timeout raise :class:`geomscope.distributed.RankFailed` in one line."""
    import datetime

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # DeepSpeed runs on the CPU too (its CPU accelerator, gloo), but Accelerate starts it only for a
    # process not marked cpu, and then needs the backend named
    group = InitProcessGroupKwargs(
        timeout=datetime.timedelta(seconds=dd.timeout_seconds()),
        **({"backend": "gloo"} if deepspeed and on_cpu else {}),
    )
    try:
        with warnings.catch_warnings():  # its thread-count notice for CPU processes
            warnings.filterwarnings("ignore", message=".*OMP_NUM_THREADS.*")
            return Accelerator(
                cpu=on_cpu and not deepspeed,
                mixed_precision=MIXED_PRECISION[precision],
                device_placement=False,
                step_scheduler_with_optimizer=False,
                kwargs_handlers=[group],
            )
    except (RuntimeError, ValueError) as e:  # no rendezvous (DistStoreError / DistNetworkError)
        if world <= 1:
            raise
        raise dd.RankFailed(
            f"the {world} processes of this command did not meet within {dd.TIMEOUT_ENV}="
            f"{dd.timeout_seconds():g} s ({first_line(e, 160)}); start them all, with the "
            "same MASTER_ADDR and MASTER_PORT"
        ) from None


def _penalty_dist(acc, device: str, dev) -> dd.Dist:
    """The :class:`~geomscope.distributed.Dist` the penalties use, on the group the Accelerator
    started (:func:`geomscope.distributed.setup` adds their own group) and on the device it trains on."""
    d = dd.setup(device)  # the group exists now: this adds the penalties' own group
    if acc.num_processes != d.world_size:  # cannot happen with a launcher; guards a half-made group
        raise InputError(
            f"Accelerate sees {acc.num_processes} processes but torch.distributed {d.world_size}; "
            "start the run with torchrun, accelerate launch or srun"
        )
    if d.active or dev.type != "cpu":
        d = replace(d, device=acc.device if d.active else dev)
    return d


def _fsdp_on_cpu(acc) -> None:
    """An FSDP launch of CPU processes.  Accelerate takes its FSDP path for GPU-type processes only and
    would run CPU processes as DDP, silently unsharded; torch's FSDP2 (``fully_shard``) runs on CPU
    processes with gloo, so the state is switched to Accelerate's FSDP path here.  FSDP1 needs GPUs:
    refused in one line."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not asked or acc.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin()  # from the launch's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise InputError(
            "FSDP on CPU processes needs fsdp_version: 2 in the launch's FSDP config (FSDP1 needs GPUs)"
        )
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    from accelerate.state import PartialState

    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    # as Accelerate does for GPU processes: its state objects are re-read from PartialState's
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _name_deepspeed_accelerator() -> None:
    """Where DeepSpeed is installed, transformers imports it at every ``save_pretrained`` and it warns
    that it found no GPU; on a machine without one, name its CPU accelerator so it need not guess."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _need_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise InputError(
            "the launch asks for DeepSpeed (distributed_type: DEEPSPEED) but it is not installed; "
            "pip install 'geomscope[deepspeed]'"
        ) from None


def _same_number(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def configure_deepspeed(
    engine: Engine, batch_size: int, grad_accum: int, max_grad_norm: float | None
) -> None:
    """Write finetune's options into the launch's DeepSpeed config before ``prepare``: the per-process
    micro-batch (``--batch-size``), the accumulation count (``--grad-accum``) and the clip
    (``--max-grad-norm``; 0 is DeepSpeed's "off"), and under ZeRO-3 the gathering of the 16-bit weights
    for saving.  geomscope's flags decide; a config that sets one of them to another number, or has an
    optimizer or scheduler section, is refused with one line (as a launch's ``--mixed_precision``
    is), rather than silently overridden."""
    if not engine.deepspeed:
        return
    ds = engine.acc.state.deepspeed_plugin.deepspeed_config
    for section, flags in (
        ("optimizer", "--lr and --weight-decay"),
        ("scheduler", "--scheduler and --warmup"),
    ):
        if section in ds:  # DeepSpeed would make its own, beside the run's AdamW and schedule
            raise InputError(
                f"the DeepSpeed config has a {section} section, but finetune makes its own from "
                f"{flags}; remove the section"
            )
    world = engine.acc.num_processes
    wanted = {
        "train_micro_batch_size_per_gpu": (batch_size, "--batch-size"),
        "gradient_accumulation_steps": (grad_accum, "--grad-accum"),
        "train_batch_size": (batch_size * grad_accum * world, "--batch-size x --grad-accum x processes"),
        "gradient_clipping": (max_grad_norm or 0.0, "--max-grad-norm"),
    }
    for key, (value, flag) in wanted.items():
        have = ds.get(key, "auto")
        if have not in ("auto", None) and not _same_number(have, value):
            raise InputError(
                f"the DeepSpeed config sets {key} {have} but finetune has {flag} = {value:g}; "
                f"geomscope's flags decide, so set it to auto in the config or change {flag}"
            )
        ds[key] = value
    zero = ds.setdefault("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3:  # the saved model is the gathered full weights
        zero["stage3_gather_16bit_weights_on_model_save"] = True


def stop(engine: Engine) -> None:
    """Forget the Accelerator (its process group stays for whoever made it; :func:`start`'s own group
    is closed when this process made it)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if engine.owns_group and dist.is_initialized():
        dist.destroy_process_group()
