"""Choosing the torch device: one rule for ``extract`` and ``finetune``."""

from __future__ import annotations

from geomscope.errors import InputError

DEVICE_HELP = "auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps"


def resolve_device(device: str | None, local_rank: int = 0):
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` | ``mps`` -> a ``torch.device``.

    ``auto`` and a bare ``cuda`` take the GPU of this process's local rank (one process per GPU
    under torchrun); an explicit ``cuda:N`` is kept. A device that is not here is an InputError.
    """
    import torch

    spec = (device or "auto").strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {device} is not a device; use {DEVICE_HELP}") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise InputError(f"--device {device} is not supported; use {DEVICE_HELP}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: no CUDA device is available here; use --device cpu or auto")
        count = torch.cuda.device_count()
        index = local_rank % count if dev.index is None else dev.index
        if index >= count:
            raise InputError(
                f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise InputError(f"--device {device}: MPS is not available here; use --device cpu or auto")
    return dev
