"""I-STAR and CosReg penalties on a mini-batch's hidden states (exact definitions: docs/metrics.md).

I-STAR (Rudman & Eickhoff, ICLR 2024)::

    L = L_task + lambda * (1 - IsoScore*(X~; C0, zeta))

X~ is the union of the token vectors of the chosen hidden-state layers (index 0 = embedding
output, i = output of block i) over the mini-batch; padding positions are excluded by the
attention mask unless ``include_padding`` (the official code's behaviour).  The batch covariance
comes from one float64 ``X~^T X~`` of the concatenated layer tokens centred on their mean (D x D),
so the cost does not grow with the number of layers beyond the concatenation.  Under
``torch.distributed`` the count, the sum (for the global mean) and the centred scatter are summed
over ranks, so the penalty is IsoScore* of the *global* batch on every rank, and the backward sums
the scatter's gradient over ranks as an all-reduce's backward does.  With DDP's gradient
averaging, the parameter gradient then equals the single-process gradient of the same global
batch.  Both penalties have their gradients in closed form (``_IStarRows``, ``_CosRegRows``): a
few operations each way, whatever the number of layers, and one read of a few numbers back to the
host in the forward (so neither can be captured in a CUDA graph or compiled whole; geomscope does
neither).

CosReg (Gao et al., 2019)::

    R = (||sum_i x^_i||^2 - N) / N^2        L = L_task + lambda * R

over the last hidden-state layer's token vectors (x^ = x / ||x||; a zero row counts in N with
x^ = 0), padding excluded likewise; under ``torch.distributed`` the sum and N are those of the
global batch, as for I-STAR.
"""

from __future__ import annotations

import numpy as np
import torch

from geomscope.errors import DataError
from geomscope.metrics.isotropy import check_zeta, star_terms


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
    @torch.autograd.function.once_differentiable
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


class _IStarRows(torch.autograd.Function):
    """IsoScore* of the chosen layers' real tokens, its forward and backward in a few kernels each.

    On a GPU a fine-tuning step of a small model is bound by the host that queues its kernels, so
    the penalty's cost is its number of operations, not its arithmetic: built from autograd's
    pieces it took ~115 (a gather, a cast and a scatter per layer, a dozen scalar ops each way).
    Here the forward stacks the layers, keeps the real tokens with one gather, centres them on the
    (global) mean and forms S = Xc^T Xc; tr(S), ||S||_F^2 and <S, C0>_F come back to the host in
    one transfer (the step reads the loss right after the penalty, so the wait is the step's
    own), and the score and its gradient's coefficients are float64 host arithmetic.  With
    C = S / (n - 1), dIsoScore*/dC = a I + b C + c C0 (docs/metrics.md), so the backward is one
    D x D combination, one product dX = 2 Xc (a I + b C + c C0) / (n - 1) and one scatter of the
    rows back to the layers (the stack copies the chosen layers whole, padding included, for the
    forward's duration: one copy instead of one per layer).  The mean's share of the gradient,
    -sum(dX)/n, is left out: sum(Xc) is zero, so it is zero in exact arithmetic (rounding apart).
    The backward is not itself differentiable: nothing in fine-tuning takes second derivatives of
    the penalty.
    """

    @staticmethod
    def forward(ctx, spec: IStar, keep, *hidden):
        L, D = len(hidden), hidden[0].shape[-1]
        H = torch.stack(hidden).view(L, -1, D)
        X = (H if keep is None else H.index_select(1, keep)).reshape(-1, D).to(spec.dtype)
        total, n = X.sum(0), X.shape[0]
        group, c0 = spec.group, spec.target_on(X.device)
        many = _world_size(group) > 1
        if many:
            total, n = _global_sum_and_count(total, n, group)
        Xc = X - total / n
        S = Xc.T @ Xc
        if many:
            import torch.distributed as dist

            dist.all_reduce(S, group=group)
        S64 = S.double()
        flat = S64.view(-1)
        parts = [S64.trace(), flat.dot(flat)]
        if c0 is not None:
            parts.append(flat.dot(c0.view(-1)))
        if many:
            parts.append(n.double())
        terms = torch.stack(parts).tolist()  # the one wait for the device
        score, (a, b, c) = _istar_with_gradient(terms, D, spec.zeta, spec.target_terms, None if many else n)
        if any(ctx.needs_input_grad[2:]):
            ctx.save_for_backward(Xc, S64, keep)
            ctx.coef, ctx.group, ctx.many, ctx.c0 = (a, b, c), group, many, c0
            ctx.hidden = [(h.shape, h.dtype) for h in hidden]
            ctx.rows = H.shape[1]
        return torch.full((), score, dtype=torch.float64, device=X.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        Xc, S64, keep = ctx.saved_tensors
        a, b, c = ctx.coef
        G = S64 * b
        if ctx.c0 is not None:
            G.add_(ctx.c0, alpha=c)
        G.diagonal().add_(a)
        G.mul_(grad)
        if ctx.many:  # as the autograd all-reduce of S: its gradient summed over the ranks
            import torch.distributed as dist

            dist.all_reduce(G, group=ctx.group)
        L, D = len(ctx.hidden), Xc.shape[1]
        dtypes = {dtype for _, dtype in ctx.hidden}
        # one cast for layers of one dtype (the rule); from the arithmetic's dtype to each otherwise
        dX = (Xc @ G.to(Xc.dtype)).view(L, -1, D)
        if len(dtypes) == 1:
            dX = dX.to(dtypes.pop())
        if keep is not None:
            dX = dX.new_zeros(L, ctx.rows, D).index_copy_(1, keep, dX)
        wanted = zip(ctx.hidden, ctx.needs_input_grad[2:], strict=True)
        grads = [dX[i].view(shape).to(dtype) if w else None for i, ((shape, dtype), w) in enumerate(wanted)]
        return (None, None, *grads)


def _istar_with_gradient(terms, d, z, target, n=None):
    """IsoScore* of C = S / (n - 1) and the coefficients (a, b, c) of ``dX = Xc (a I + b S + c C0)``.

    ``terms``: tr(S), ||S||_F^2, [<S, C0>_F], [n] (the count comes last when ``n`` is None);
    ``target``: None (trace-matched identity) or (tr(C0), ||C0||_F^2).  With tz = tr(C_z),
    fz = ||C_z||_F^2, score = (tz^2 / fz - 1) / (d - 1), and dscore/dC =
    (2 tz / fz dtz - tz^2 / fz^2 dfz) / (d - 1).  Division by zero gives inf/NaN, as on the device
    (a batch with no variance is then not finite, and the step is skipped).
    """
    terms = [np.float64(t) for t in terms]
    m = (terms.pop() if n is None else np.float64(n)) - 1
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tr, fro2 = terms[0] / m, terms[1] / (m * m)
        cross = terms[2] / m if target is not None else None
        tz, fz = star_terms(tr, fro2, d, z, None if target is None else (*target, cross))
        score = (tz * tz / fz - 1) / (d - 1)
        k1, k2 = 2 * tz / (fz * (d - 1)), tz * tz / (fz * fz * (d - 1))
        if target is None:  # tz = tr, fz = (1 - z)^2 ||C||^2 + (1 - (1 - z)^2) tr^2 / d
            on_i, on_c0 = k1 - k2 * (1 - (1 - z) ** 2) * 2 * tr / d, 0.0
        else:  # tz = (1 - z) tr + z tr0, fz = (1 - z)^2 ||C||^2 + 2 z (1 - z) <C, C0> + z^2 ||C0||^2
            on_i, on_c0 = k1 * (1 - z), -k2 * 2 * z * (1 - z)
        on_c = -k2 * 2 * (1 - z) ** 2
        # dX = Xc (G + G^T) with G = dscore/dS = dscore/dC / m, and C = S / m
        coef = (2 * on_i / m, 2 * on_c / (m * m), 2 * on_c0 / m)
    return float(score), tuple(float(x) for x in coef)


def _real_rows(attention_mask, include_padding: bool) -> torch.Tensor | None:
    """Indices of the real tokens among a batch's flattened positions; None for all of them."""
    if attention_mask is None or include_padding:
        return None
    keep = attention_mask.reshape(-1).nonzero().squeeze(1)
    return None if keep.numel() == attention_mask.numel() else keep


def _global_sum_and_count(total: torch.Tensor, n: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's column sums and row count summed over the ranks, in one all-reduce (the count rides
    along as one more column, in the sums' dtype): (global sums, global count as a 0-dim tensor)."""
    import torch.distributed as dist

    packed = torch.nn.functional.pad(total, (0, 1), value=float(n))
    dist.all_reduce(packed, group=group)
    return packed[:-1], packed[-1]


def _world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class IStar:
    """The I-STAR penalty ``1 - IsoScore*(X~; C0, zeta)`` of a mini-batch (see module docstring).

    ``C0``: (D, D) shrinkage target, a constant (the training covariance of this epoch; it may be
    replaced or changed in place between steps; only its symmetric part counts, as for any
    covariance); ``None`` uses the trace-matched identity of the batch covariance.
    ``dtype``: arithmetic of the batch covariance (float64 default; float32 = centred rows,
    float32 scatter, float64 from there on).
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
        self.zeta = zeta
        self.C0 = C0
        self.include_padding = include_padding
        self.group = group

    @property
    def zeta(self) -> float:
        return self._zeta

    @zeta.setter
    def zeta(self, zeta: float) -> None:
        self._zeta = check_zeta(zeta)

    @property
    def C0(self) -> torch.Tensor | None:
        return self._C0

    @C0.setter
    def C0(self, C0: torch.Tensor | None) -> None:
        """A new target: its trace and squared norm once, its copy on the device when first asked."""
        self._C0, self._on_device = C0, {}
        self._C0_version = None if C0 is None else C0._version
        c0 = None if C0 is None else C0.detach().to(torch.float64)
        if c0 is not None:  # the symmetric part, as in target_on: ||C0||_F^2 of the whole counted an
            c0 = (c0 + c0.T) / 2  # antisymmetric part no other term sees (IsoScore* 0.455 for 0.504)
        self.target_terms = None if c0 is None else (float(c0.trace()), float(c0.square().sum()))

    def target_on(self, device) -> torch.Tensor | None:
        """The symmetric part of C0 as contiguous float64 on ``device`` (copied there once per target;
        <S, C0> only sees that part, and the gradient needs it as such)."""
        if self._C0 is None:
            return None
        if self._C0._version != self._C0_version:  # changed in place since it was set
            self.C0 = self._C0
        if device not in self._on_device:
            c0 = self._C0.detach().to(device=device, dtype=torch.float64)
            self._on_device[device] = ((c0 + c0.T) / 2).contiguous()
        return self._on_device[device]

    def isoscore_star(self, hidden_states, attention_mask) -> torch.Tensor:
        """Differentiable IsoScore* of the (global) batch, a 0-dim float64 tensor."""
        hidden = [hidden_states[i] for i in self.layers]
        D = hidden[0].shape[-1]
        if D < 2:
            raise DataError(f"IsoScore* needs at least 2 dimensions; the hidden states have D = {D}")
        if tuple(self.C0.shape if self.C0 is not None else (D, D)) != (D, D):
            raise DataError(f"shrinkage covariance C0 is {tuple(self.C0.shape)} but the data has D = {D}")
        keep = _real_rows(attention_mask, self.include_padding)
        return _IStarRows.apply(self, keep, *hidden)

    def __call__(self, hidden_states, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(penalty = 1 - IsoScore*, IsoScore*) as 0-dim float64 tensors; the penalty has grad."""
        iso = self.isoscore_star(hidden_states, attention_mask)
        return 1.0 - iso, iso


class _CosRegRows(torch.autograd.Function):
    """CosReg's R of one layer's real tokens, forward and backward in a few kernels (as
    :class:`_IStarRows`, and for the same reason).  With u = x / |x| and s = sum_i u_i (both s and
    N summed over ranks), R = (s.s - N) / N^2, so dR/du_i = v = 2 s / N^2 for every row and
    dx_i = (v - (u_i . v) u_i) / |x_i|: one matrix-vector product, one fused multiply-subtract and
    one scaling.  A zero row has no direction: it counts in N with u = 0 and gets no gradient
    (dividing by a clamped norm instead would give it 1e30 v, which overflows float16).  The backward sums
    v over ranks, as an all-reduce's backward does."""

    @staticmethod
    def forward(ctx, group, keep, h):
        D = h.shape[-1]
        X = h.reshape(-1, D)
        X = (X if keep is None else X.index_select(0, keep)).to(torch.float64)
        # 1/|x|, and 0 for a zero row (1/0 = inf, set to 0)
        inv = torch.linalg.vector_norm(X, dim=1, keepdim=True).reciprocal_().nan_to_num_(posinf=0.0)
        U = X * inv
        s, n = U.sum(0), U.shape[0]
        many = _world_size(group) > 1
        if many:
            s, n = _global_sum_and_count(s, n, group)
            ss, n = torch.stack([s.dot(s), n.to(s.dtype)]).tolist()
        else:
            ss = s.dot(s).item()  # the one wait for the device
        with np.errstate(divide="ignore", invalid="ignore"):
            R, v_scale = (np.float64(ss) - n) / np.float64(n * n), 2 / np.float64(n * n)
        if ctx.needs_input_grad[2]:
            ctx.save_for_backward(U, inv, s, keep)
            ctx.group, ctx.many, ctx.v_scale, ctx.hidden = group, many, float(v_scale), (h.shape, h.dtype)
        return torch.full((), float(R), dtype=torch.float64, device=X.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        U, inv, s, keep = ctx.saved_tensors
        v = (s * grad).mul_(ctx.v_scale)
        if ctx.many:  # as the autograd all-reduce of s: its gradient summed over the ranks
            import torch.distributed as dist

            dist.all_reduce(v, group=ctx.group)
        dX = torch.addcmul(v, U, (U @ v).unsqueeze(1), value=-1).mul_(inv).to(ctx.hidden[1])
        if keep is not None:
            dX = dX.new_zeros(ctx.hidden[0].numel() // dX.shape[1], dX.shape[1]).index_copy_(0, keep, dX)
        return None, None, dX.view(ctx.hidden[0])


class CosReg:
    """Gao et al.'s cosine regulariser on the last hidden-state layer (see module docstring)."""

    def __init__(self, layer: int = -1, include_padding: bool = False, group=None):
        self.layer = layer
        self.include_padding = include_padding
        self.group = group

    def __call__(self, hidden_states, attention_mask) -> torch.Tensor:
        """R of the (global) batch, a 0-dim float64 tensor with grad."""
        keep = _real_rows(attention_mask, self.include_padding)
        return _CosRegRows.apply(self.group, keep, hidden_states[self.layer])
