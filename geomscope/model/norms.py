"""A norm module's parameters as a run records them: its per-dimension gain and bias, so that score
can relate them to the per-dimension variance before the norm without the checkpoint.

The gain is measured, not assumed from the class: most norms (LayerNorm, RMSNorm, T5's) multiply
by their weight, Gemma's RMSNorm by 1 + weight (its weight stores the offset from 1), and reading
the weight as the gain there made a damped outlier dimension read as amplified.
"""

from __future__ import annotations


def is_norm(module) -> bool:
    """Whether a module is a normalisation layer: a torch LayerNorm / RMSNorm, or a class whose
    name ends in ``Norm`` (transformers' LlamaRMSNorm, T5LayerNorm ...)."""
    import torch

    kinds = tuple(k for k in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None)) if k is not None)
    return isinstance(module, kinds) or type(module).__name__.lower().endswith("norm")


def norm_params(module, name: str, width: int) -> dict:
    """``{module, type, gain, gain_is, bias}`` of the norm ``module`` (called ``name``): ``gain`` the
    per-dimension factor it applies when it could be measured and agrees with its weight
    (:func:`applied_gain`; ``gain_is`` says which: ``weight`` or ``1 + weight``), else None;
    ``bias`` its bias, or None."""

    def values(attr):
        t = getattr(module, attr, None)
        return None if t is None else [float(v) for v in t.detach().float().cpu().reshape(-1)]

    weight = values("weight")
    gain, applied = None, None
    if weight is not None and len(weight) == width:
        gain, applied = applied_gain(module, weight)
    return {
        "module": name,
        "type": type(module).__name__,
        "gain": gain,
        "gain_is": applied,  # "weight", "1 + weight" (Gemma's RMSNorm), or None: not recorded
        "bias": values("bias"),
    }


def _probe_input(dim: int):
    """A vector of mean 0 and root mean square 1 with no zero entry: a LayerNorm and an RMSNorm
    both normalise it to itself (up to their eps)."""
    import numpy as np

    x = np.where(np.arange(dim) % 2 == 0, 1.0, -1.0)
    if dim % 2:  # odd: the last three as (2, -1, -1) keep the mean 0
        x[-3:] = (2.0, -1.0, -1.0)
    return x / np.sqrt(np.mean(x * x))


def applied_gain(mod, weight: list[float]) -> tuple[list[float] | None, str | None]:
    """The per-dimension factor the norm applies, and what it is made of: for a probe x that the
    norm normalises to x itself, y(x) - y(-x) = 2 g x (a bias cancels). The weight, or 1 + weight,
    is returned where the measure agrees with it; otherwise no gain (None, None)."""
    import numpy as np
    import torch

    try:
        param = next(mod.parameters())
        x = _probe_input(len(weight))
        t = torch.tensor(x, dtype=param.dtype, device=param.device).reshape(1, 1, -1)
        with torch.no_grad():
            measured = ((mod(t) - mod(-t)).float().cpu().reshape(-1).numpy()) / (2.0 * x)
    except Exception:  # a norm that cannot be called alone: nothing measured, nothing claimed
        return None, None
    w = np.asarray(weight, dtype=np.float64)
    tol = (1e-4 if param.dtype in (torch.float32, torch.float64) else 2e-2) * max(
        1.0, float(np.abs(w).max()) + 1
    )
    for applied, g in (("weight", w), ("1 + weight", w + 1.0)):
        if np.all(np.abs(measured - g) <= tol):
            return [float(v) for v in g], applied
    return None, None
