"""Process-group handling for multi-process fine-tuning (torchrun / accelerate launch).

The same command runs once per process; ``torchrun`` and ``accelerate launch`` both export
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.  :func:`setup`
initialises ``torch.distributed`` from them (NCCL on CUDA, gloo on the CPU) unless a process group
already exists (tests create their own), picks the device, and makes a second process group for the
regulariser's all-reduces so they never interleave with DDP's gradient buckets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from geomscope.devices import resolve_device


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: "object"  # torch.device
    reg_group: "object" = None  # process group for penalties (None = default / single process)
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto") -> Dist:
    """Join (or create from the environment) the process group; single process when none."""
    import torch
    import torch.distributed as dist

    owns = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dev = resolve_device(device, local_rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        dev = resolve_device(device, local_rank)
        group = dist.new_group(backend="nccl" if dev.type == "cuda" else "gloo")
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
