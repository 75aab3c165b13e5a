"""I-STAR and CosReg penalties on a mini-batch's hidden states (exact definitions: docs/metrics.md).

I-STAR (Rudman & Eickhoff, ICLR 2024)::

    L = L_task + lambda * (1 - IsoScore*(X~; C0, zeta))

X~ is the union of the token vectors of the chosen hidden-state layers (index 0 = embedding
output, i = output of block i) over the mini-batch; padding positions are excluded by the
attention mask unless ``include_padding`` (the official code's behaviour).  The batch covariance
comes from one float64 ``X~^T X~`` of the concatenated layer tokens centred on their mean (D x D),
so the cost does not grow with the number of layers beyond the concatenation.  Under
``torch.distributed`` the count, the sum (for the global mean) and the centred scatter are summed
over ranks with an autograd-aware all-reduce, so the penalty is IsoScore* of the *global* batch on
every rank.  With DDP's gradient averaging and the
all-reduce's summing backward, the parameter gradient equals the single-process gradient of the
same global batch.

CosReg (Gao et al., 2019)::

    R = (||sum_i x^_i||^2 - N) / N^2        L = L_task + lambda * R

over the last hidden-state layer's token vectors (x^ = x / ||x||), padding excluded likewise.
"""

from __future__ import annotations

import torch

from geomscope.metrics.isotropy import isoscore_star_from_cov_torch


def select_tokens(
    hidden_states,
    layers: list[int],
    attention_mask: torch.Tensor | None,
    include_padding: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Concatenate the token vectors of ``layers`` into one (L * n, D) tensor of ``dtype`` (grad kept).

    ``hidden_states`` is the tuple from ``output_hidden_states=True``; rows are real tokens only
    (``attention_mask == 1``) unless ``include_padding``; layer-major order (all of the first layer's
    tokens, then the next layer's ...).
    """
    D = hidden_states[layers[0]].shape[-1]
    keep = None
    if attention_mask is not None and not include_padding:
        keep = attention_mask.reshape(-1).nonzero().squeeze(1)
    parts = []
    for i in layers:  # a loop over layers (a handful), never over tokens
        h = hidden_states[i].reshape(-1, D)
        parts.append(h if keep is None else h.index_select(0, keep))
    return torch.cat(parts).to(dtype)


class _Scatter(torch.autograd.Function):
    """S = X^T X with the one-matmul backward dX = X (G + G^T) (autograd would do two)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.T @ x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x @ (g + g.T)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist

        ctx.group = group
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllReduceSum.apply(grad, ctx.group), None


def _all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks with gradient (identity when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return t
    return _AllReduceSum.apply(t, group)


def batch_covariance(X: torch.Tensor, group=None) -> torch.Tensor:
    """Sample covariance (divide by n - 1) of the global batch of rows X, as float64 (with grad).

    The rows are centred on the *global* mean before the one ``X^T X`` (no cancellation), and the
    count, sum and centred scatter are summed over ranks (three all-reduces, the last D x D).  The
    arithmetic runs in X's dtype (float64 by default; float32 halves the cost on most hardware).
    """
    n = _all_reduce_sum(torch.tensor([float(X.shape[0])], dtype=X.dtype, device=X.device), group)
    n = n.detach()[0]
    mean = _all_reduce_sum(X.sum(0), group) / n
    S = _all_reduce_sum(_Scatter.apply(X - mean), group)
    return S.to(torch.float64) / (float(n) - 1)


class IStar:
    """The I-STAR penalty ``1 - IsoScore*(X~; C0, zeta)`` of a mini-batch (see module docstring).

    ``C0``: (D, D) float64 shrinkage target (the training covariance of this epoch); ``None``
    uses the trace-matched identity of the batch covariance.  ``dtype``: arithmetic of the batch
    covariance (float64 default; float32 = centred rows, float32 scatter, float64 from there on).
    """

    def __init__(
        self,
        layers: list[int],
        zeta: float,
        C0: torch.Tensor | None = None,
        include_padding: bool = False,
        group=None,
        dtype: torch.dtype = torch.float64,
    ):
        self.dtype = dtype
        self.layers = list(layers)
        self.zeta = float(zeta)
        self.C0 = C0
        self.include_padding = include_padding
        self.group = group

    def isoscore_star(self, hidden_states, attention_mask) -> torch.Tensor:
        """Differentiable IsoScore* of the (global) batch, a 0-dim float64 tensor."""
        X = select_tokens(hidden_states, self.layers, attention_mask, self.include_padding, self.dtype)
        C = batch_covariance(X, self.group)
        C0 = None if self.C0 is None else self.C0.to(device=C.device, dtype=C.dtype)
        return isoscore_star_from_cov_torch(C, self.zeta, C0, check=False)

    def __call__(self, hidden_states, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(penalty = 1 - IsoScore*, IsoScore*) as 0-dim float64 tensors; the penalty has grad."""
        iso = self.isoscore_star(hidden_states, attention_mask)
        return 1.0 - iso, iso


def cosreg_from_sum(u_sum: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """R = (||sum x^||^2 - N) / N^2 from the sum of unit vectors and the count."""
    return (u_sum.dot(u_sum) - n) / (n * n)


class CosReg:
    """Gao et al.'s cosine regulariser on the last hidden-state layer (see module docstring)."""

    def __init__(self, layer: int = -1, include_padding: bool = False, group=None):
        self.layer = layer
        self.include_padding = include_padding
        self.group = group

    def __call__(self, hidden_states, attention_mask) -> torch.Tensor:
        """R of the (global) batch, a 0-dim float64 tensor with grad."""
        h = hidden_states[self.layer]
        X = select_tokens((h,), [0], attention_mask, self.include_padding)
        U = X / X.norm(dim=1, keepdim=True).clamp_min(1e-30)
        u_sum = _all_reduce_sum(U.sum(0), self.group)
        n = _all_reduce_sum(
            torch.tensor([float(U.shape[0])], dtype=torch.float64, device=U.device), self.group
        ).detach()[0]
        return cosreg_from_sum(u_sum, n)
