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
model wrapping by the launch configuration (DDP, FSDP) in ``prepare``, mixed precision
(autocast and the fp16 gradient scaler), ``backward``, ``no_sync`` for accumulation, and gathering
a sharded model's full state dict for saving.

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
from dataclasses import dataclass, replace

from geomscope import distributed as dd
from geomscope.devices import resolve_device
from geomscope.errors import InputError

#: --precision -> Accelerate's ``mixed_precision``
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class Engine:
    """An ``Accelerator`` (``acc``) and the processes' :class:`~geomscope.distributed.Dist` (``d``)."""

    acc: object
    d: dd.Dist
    owns_group: bool = False  # the process group was made by start() (closed by stop())

    @property
    def sharded(self) -> bool:
        """FSDP (from ``accelerate launch --config_file``; DeepSpeed is refused by :func:`start`):
        parameters and optimizer state are split over the processes, so saving gathers them and
        resume is not offered."""
        from accelerate.utils import DistributedType

        return self.acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    @property
    def scaler(self):
        """The fp16 gradient scaler Accelerate made (None unless ``--precision fp16``)."""
        return self.acc.scaler

    def autocast(self):
        return self.acc.autocast()

    def prepare(self, model, optimizer):
        """The model wrapped for the launch (DDP, FSDP or as it is) and the optimizer."""
        if not self.sharded:
            model.to(self.d.device)
        return self.acc.prepare(model, optimizer)

    def backward(self, loss) -> None:
        self.acc.backward(loss)

    def no_sync(self, model):
        return self.acc.no_sync(model)

    def unwrap(self, model):
        return self.acc.unwrap_model(model)

    def full_state_dict(self, model):
        """The whole model's state dict, gathered from the shards under FSDP (a collective:
        every process calls it; only the main process gets the tensors under FSDP)."""
        return self.acc.get_state_dict(model)


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


def start(device: str, precision: str) -> Engine:
    """One Accelerator for this run (any earlier one in this process is forgotten first: Accelerate's
    state is a process-wide singleton, and a notebook or test may run several fine-tunings)."""
    import datetime

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    _, world, local = dd.world_from_env()
    _export_world(*dd.world_from_env())
    dev = resolve_device(device, local)
    if precision == "fp16" and dev.type != "cuda":
        raise InputError("--precision fp16 needs a CUDA GPU; use --precision bf16 or fp32 on the CPU")
    import torch.distributed as dist

    existed = dist.is_initialized()
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch --mixed_precision
    if launched not in ("no", MIXED_PRECISION[precision]):
        raise InputError(
            f"accelerate launch asks for --mixed_precision {launched} but finetune has --precision "
            f"{precision}; geomscope's flag decides, so pass --precision {launched.replace('no', 'fp32')}"
        )
    AcceleratorState._reset_state(reset_partial_state=True)
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=dd.timeout_seconds()))
    try:
        with warnings.catch_warnings():  # its thread-count notice for CPU processes
            warnings.filterwarnings("ignore", message=".*OMP_NUM_THREADS.*")
            acc = Accelerator(
                cpu=dev.type == "cpu",
                mixed_precision=MIXED_PRECISION[precision],
                device_placement=False,
                step_scheduler_with_optimizer=False,
                kwargs_handlers=[timeout],
            )
    except (RuntimeError, ValueError) as e:  # no rendezvous (DistStoreError / DistNetworkError)
        if world <= 1:
            raise
        raise dd.RankFailed(
            f"the {world} processes of this command did not meet within {dd.TIMEOUT_ENV}="
            f"{dd.timeout_seconds():g} s ({str(e).splitlines()[0][:160]}); start them all, with the "
            "same MASTER_ADDR and MASTER_PORT"
        ) from None
    _refuse_deepspeed(acc)
    d = dd.setup(device)  # the group exists now: this adds the penalties' own group
    if acc.num_processes != d.world_size:  # cannot happen with a launcher; guards a half-made group
        raise InputError(
            f"Accelerate sees {acc.num_processes} processes but torch.distributed {d.world_size}; "
            "start the run with torchrun, accelerate launch or srun"
        )
    if d.active or dev.type != "cpu":
        d = replace(d, device=acc.device if d.active else dev)
    eng = Engine(acc, d, owns_group=not existed and dist.is_initialized())
    if eng.sharded:  # each forward gathers parameters from every process: no pass may skip one
        eng.d = replace(d, lockstep=True)
    return eng


def _refuse_deepspeed(acc) -> None:
    """DeepSpeed's engine takes the optimiser step inside ``backward`` and scales the loss itself: the
    loop's micro-batch accumulation with a per-micro-batch penalty and its skip of a non-finite step
    would have to be rebuilt around that, and no DeepSpeed could be run here to check it."""
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise InputError(
            "finetune does not run under DeepSpeed yet (its engine steps the optimizer inside backward, "
            "around the I-STAR accumulation); use an FSDP config (distributed_type: FSDP) or DDP"
        )


def stop(engine: Engine) -> None:
    """Forget the Accelerator (its process group stays for whoever made it; :func:`start`'s own group
    is closed when this process made it)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if engine.owns_group and dist.is_initialized():
        dist.destroy_process_group()
