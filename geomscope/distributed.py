"""Process groups for the commands that run as many processes: ``finetune`` and ``extract``.

The same command runs once per process; ``torchrun`` and ``accelerate launch`` both export
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; SLURM's ``srun``
exports ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID``, which :func:`world_from_env` maps
to the same (the rendezvous address still comes from ``MASTER_ADDR``/``MASTER_PORT``).
:func:`setup` initialises ``torch.distributed`` from them (NCCL on CUDA, gloo on the CPU, or the
backend asked for) unless a process group already exists (tests create their own), picks the
device, and makes a second process group for the regulariser's all-reduces so they never
interleave with DDP's gradient buckets.

Every collective waits at most ``GEOMSCOPE_DIST_TIMEOUT`` seconds (default 1800) for the other
processes, so a process whose peer died exits with an error instead of hanging. :func:`agree`
tells every process whether any of them failed, and with what message, without pickle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from geomscope.devices import resolve_device
from geomscope.errors import GeomscopeError, InputError, first_line

TIMEOUT_ENV = "GEOMSCOPE_DIST_TIMEOUT"
_MESSAGE_BYTES = 1024


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process: torchrun/accelerate's variables, else SLURM's
    (``srun`` with several tasks), else a single process. SLURM's are copied to the torch names.
    Each is a whole number in its range (:func:`_checked_world`), or InputError names it."""
    env = os.environ
    if "WORLD_SIZE" in env:
        world = _whole("WORLD_SIZE", env["WORLD_SIZE"])
        rank = _whole("RANK", env.get("RANK", "0"))
        local = _whole("LOCAL_RANK", env.get("LOCAL_RANK", str(rank)))
        return _checked_world(("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local))
    tasks = _whole("SLURM_NTASKS", env.get("SLURM_NTASKS") or "1")  # (empty: no task count)
    if tasks > 1 and "SLURM_PROCID" in env:
        rank = _whole("SLURM_PROCID", env["SLURM_PROCID"])
        local = _whole("SLURM_LOCALID", env.get("SLURM_LOCALID", "0"))
        _checked_world(("SLURM_PROCID", rank), ("SLURM_NTASKS", tasks), ("SLURM_LOCALID", local))
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise InputError(
                "srun started several tasks but MASTER_ADDR / MASTER_PORT are not set; export them "
                "(e.g. the first host of $SLURM_JOB_NODELIST and a free port) before srun"
            )
        env.update(RANK=str(rank), WORLD_SIZE=str(tasks), LOCAL_RANK=str(local))
        return rank, tasks, local
    return 0, 1, 0


def _whole(name: str, raw: str) -> int:
    """The launcher variable ``name`` as an integer (what ``int`` reads), or InputError naming it."""
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"{name}={raw!r} is not a whole number; check the launcher") from None


def _checked_world(rank: tuple[str, int], world: tuple[str, int], local: tuple[str, int]):
    """(rank, world size, local rank), each given as (variable name, value): InputError naming the
    variable unless the world has at least one process, 0 <= rank < world and local rank >= 0 (a
    rank past the world would wait for peers that never come, until the rendezvous timeout)."""
    (rank_name, r), (world_name, w), (local_name, lr) = rank, world, local
    if w < 1:
        raise InputError(f"{world_name}={w} is not a number of processes (1 or more); check the launcher")
    if not 0 <= r < w:
        raise InputError(
            f"{rank_name}={r} is not a rank of {world_name}={w} (0 to {w - 1}); check the launcher"
        )
    if lr < 0:
        raise InputError(f"{local_name}={lr} is not a local rank (0 or more); check the launcher")
    return r, w, lr


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "1800")
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise InputError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return t


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: "object"  # torch.device
    reg_group: "object" = None  # process group for penalties (None = default / single process)
    owns_group: bool = False
    #: every forward pass is a collective (finetune under FSDP): no-gradient passes over a
    #: dataset make as many forwards on every process (geomscope.train.evaluate.rank_batches)
    lockstep: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", backend: str | None = None) -> Dist:
    """Join (or create from the environment) the process group; single process when none.

    ``backend``: None = NCCL on CUDA, gloo on the CPU (finetune's gradients); "gloo" for
    coordination only (extract: small CPU tensors, whatever the device).
    """
    import datetime

    import torch
    import torch.distributed as dist

    owns = False
    _, world, local_rank = world_from_env()
    if not dist.is_initialized() and world > 1:
        dev = resolve_device(device, local_rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        try:
            dist.init_process_group(
                backend=backend or ("nccl" if dev.type == "cuda" else "gloo"),
                timeout=datetime.timedelta(seconds=timeout_seconds()),
            )
        except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError: no rendezvous
            raise RankFailed(
                f"the {world} processes of this command did not meet within {TIMEOUT_ENV}="
                f"{timeout_seconds():g} s ({first_line(e, 160)}); start them all, with the "
                "same MASTER_ADDR and MASTER_PORT"
            ) from None
        owns = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        dev = resolve_device(device, local_rank)
        group = dist.new_group(backend=backend or ("nccl" if dev.type == "cuda" else "gloo"))
        return Dist(rank, world, local_rank, dev, group, owns)
    return Dist(0, 1, 0, resolve_device(device), None, False)


def teardown(d: Dist) -> None:
    import torch.distributed as dist

    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t, d: Dist):
    """In-place sum over ranks of a tensor without gradient; returns it."""
    import torch.distributed as dist

    if d.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=d.reg_group)
    return t


def broadcast(t, d: Dist, src: int = 0):
    """Make ``t`` bitwise identical on every rank (rank ``src``'s copy); returns it."""
    import torch.distributed as dist

    if d.active:
        dist.broadcast(t, src=src, group=d.reg_group)
    return t


def gather_objects(obj, d: Dist) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    if not d.active:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, d: Dist, src: int = 0):
    import torch.distributed as dist

    if not d.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(d: Dist) -> None:
    import torch.distributed as dist

    if d.active:
        dist.barrier()


class RankFailed(GeomscopeError):
    """Another process of the same command failed; this one stops too, with its message."""


def agree(d: Dist, failure: GeomscopeError | BaseException | None) -> None:
    """A collective every process calls at the same point: if any process passes a failure, every
    process raises -- the failing one its own error, the others :class:`RankFailed` naming the
    first failing rank, its message and its exit code. The messages travel as bytes in a tensor
    (no pickle). A peer that died makes the collective time out (``GEOMSCOPE_DIST_TIMEOUT``),
    raised here as RankFailed too, so no process waits for ever."""
    import torch
    import torch.distributed as dist

    if not d.active:
        if failure is not None:
            raise failure
        return
    box = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if failure is not None:
        code = getattr(failure, "exit_code", 1)
        raw = first_line(failure).encode("utf-8", "replace")[: _MESSAGE_BYTES - 2]
        box[0], box[1] = 1, int(code) % 256
        box[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    got = [torch.zeros_like(box) for _ in range(d.world_size)]
    try:
        dist.all_gather(got, box, group=d.reg_group)
    except RuntimeError as e:
        if failure is not None:
            raise failure from None
        raise RankFailed(
            f"another process of this command stopped answering ({first_line(e, 200)}); "
            "check its log, then rerun the same command: finished shards are kept"
        ) from None
    if failure is not None:
        raise failure
    for rank, t in enumerate(got):
        if int(t[0]) == 1:
            msg = bytes(t[2:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
            err = RankFailed(f"process {rank} failed: {msg}")
            err.exit_code = int(t[1]) or 1
            raise err
