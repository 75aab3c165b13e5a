"""The :class:`~geomscope.metrics.moments.Moments` statistics accumulated by torch where the rows live.

``extract --keep sample:N`` measures during the forward pass: each batch's hidden states are
folded into float64 accumulators on the model's device, so that no (rows, D) block has to leave
it; only the D x D result is copied to the host, once per shard, as a numpy ``Moments``.

The arithmetic mirrors ``Moments.update`` (so the two agree to float64 rounding, tested): each
update centres its block on the block's own float64 mean and merges (n, mean, M2) by Chan et al.'s
parallel formula, which keeps a large common offset harmless; the unit-vector and |x| statistics
use the uncentred rows. The scatter is a symmetric product: BLAS syrk through numpy on the CPU
(where torch tensors share numpy's memory) and, on an accelerator, a blocked product of the column
blocks on or above the diagonal (b(b+1)/2 of b^2 block products, e.g. 0.53 of the full GEMM for
D = 4096 in 256-wide blocks). Only the upper triangle is read.

:func:`device_moments` picks the accumulator for a device: on the CPU the numpy ``Moments`` itself
(zero-copy views of the tensors; its cache-sized sub-blocks make it 2.4x faster there than these
torch ops), elsewhere :class:`TorchMoments`. ``products="split"`` (``extract --products split``)
forms the scatter from exact float16 parts multiplied with float32 sums in short blocks and float64
between them (split_scatter.py: the arithmetic and its error bound), on any device, the CPU
included (where it emulates the GPU's arithmetic in float32).

Nothing in an update reads a value back from the device: the |x| counts cover every column on an
accelerator (a count of the columns that reach the threshold would wait for the GPU), so a batch's
updates are queued behind its forward pass and the next batch's.
"""

from __future__ import annotations

import numpy as np

from geomscope.choices import ACCUMULATOR_PRODUCTS
from geomscope.metrics.moments import Moments

SYRK_BLOCK = 256  # column block of the accelerator's triangular product


def _syrk_upper_blocked(b, block: int = SYRK_BLOCK):
    """Upper triangle (and diagonal blocks) of b^T b by column blocks at or above the diagonal."""
    import torch

    d = b.shape[1]
    out = torch.zeros((d, d), dtype=b.dtype, device=b.device)
    for i in range(0, d, block):
        bi = b[:, i : i + block]
        # one product per block row: the columns from the diagonal block to the end
        out[i : i + block, i:] = bi.T @ b[:, i:]
    return out


def _syrk_upper(b, blocked: bool | None = None):
    """b^T b, upper triangle valid (the lower one is not meaningful)."""
    import torch

    if blocked is None:
        blocked = b.device.type != "cpu"
    if blocked:
        return _syrk_upper_blocked(b)
    a = b.numpy()  # the CPU: numpy's a.T @ a is a BLAS syrk that releases the GIL (scipy's dsyrk does not)
    return torch.from_numpy(a.T @ a)


def device_moments(dim: int, device, abs_threshold: float, products: str = "float64"):
    """An accumulator with ``update(tensor)`` and ``to_moments()`` for rows living on ``device``,
    its scatter from ``products`` (``float64``, or ``split``: float16 rows only)."""
    if getattr(device, "type", str(device)) == "cpu" and products == "float64":
        return HostMoments(dim, abs_threshold)
    return TorchMoments(dim, device, abs_threshold, products=products)


class HostMoments(Moments):
    """``Moments`` fed CPU tensors (through their numpy views: no copy)."""

    def update(self, x) -> HostMoments:
        return super().update(x.numpy() if hasattr(x, "numpy") else x)

    def to_moments(self) -> Moments:
        return self


class TorchMoments:
    """float64 count, mean, upper scatter, unit-vector and |x| statistics on ``device``.

    ``update(x)`` takes an (m, D) tensor of any float dtype on that device, whose rows are finite
    (the caller drops the others and counts them); ``to_moments()`` returns the numpy ``Moments``
    holding the same numbers. ``blocked`` forces (True) or forbids (False) the accelerator's blocked
    triangular product; by default it is used off the CPU. ``products="split"`` takes float16 rows
    and forms the scatter from their float16 parts (split_scatter.py); the other statistics are the
    same float64 sums either way.
    """

    def __init__(
        self,
        dim: int,
        device,
        abs_threshold: float = 6.0,
        *,
        blocked: bool | None = None,
        products: str = "float64",
    ):
        import torch

        if products not in ACCUMULATOR_PRODUCTS:
            raise ValueError(f"products must be one of {', '.join(ACCUMULATOR_PRODUCTS)}; got {products!r}")
        self.dim, self.device, self.abs_threshold = int(dim), device, float(abs_threshold)
        self.blocked, self.products = blocked, products
        self.on_cpu = getattr(device, "type", str(device)) == "cpu"
        z = {"dtype": torch.float64, "device": device}
        self.n = 0
        self.mean = torch.zeros(self.dim, **z)
        self.m2 = torch.zeros((self.dim, self.dim), **z)
        self.sum_unit = torch.zeros(self.dim, **z)
        self.sum_unit_sq = torch.zeros(self.dim, **z)
        self.abs_sum = torch.zeros(self.dim, **z)
        self.abs_max = torch.zeros(self.dim, **z)
        self.count_abs_ge = torch.zeros(self.dim, dtype=torch.int64, device=device)
        self.sum_sq_norm = torch.zeros((), **z)
        self.n_zero_norm = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, x) -> TorchMoments:
        import torch

        m = int(x.shape[0])
        if m == 0:
            return self
        xb = x.to(torch.float64)
        mean_b = xb.sum(0) / m
        m2_b = self._scatter(x, xb, mean_b)
        x2 = xb * xb
        sq = x2.sum(1)
        pos = sq > 0
        inv = torch.where(pos, sq.clamp_min(torch.finfo(torch.float64).tiny).rsqrt(), torch.zeros_like(sq))
        self.sum_unit += inv @ xb
        self.sum_unit_sq += (inv * inv) @ x2
        self.sum_sq_norm += sq.sum()
        self.n_zero_norm += (~pos).sum()
        ab = xb.abs_() if xb is not x else xb.abs()  # in place on the float64 copy: one (m, D) less
        self.abs_sum += ab.sum(0)
        col_max = ab.amax(0)
        torch.maximum(self.abs_max, col_max, out=self.abs_max)
        if not self.on_cpu:  # every column: choosing some would read their number back
            self.count_abs_ge += (ab >= self.abs_threshold).sum(0)
        else:
            cols = torch.nonzero(col_max >= self.abs_threshold).flatten()
            if cols.numel():  # only the columns that reach the threshold are counted
                self.count_abs_ge.index_add_(0, cols, (ab[:, cols] >= self.abs_threshold).sum(0))
        if self.n == 0:
            self.mean, self.m2 = mean_b, m2_b
        else:  # Chan et al.: merge (n, mean, M2) of the block into the running state
            n = self.n + m
            delta = mean_b - self.mean
            self.m2 += m2_b
            self.m2 += torch.outer(delta, delta * (self.n * m / n))
            self.mean = self.mean + delta * (m / n)
        self.n += m
        return self

    def _scatter(self, x, xb, mean_b):
        """The block's centred scatter about ``mean_b``, upper triangle valid (float64)."""
        import torch

        if self.products == "float64":
            return _syrk_upper(xb - mean_b, self.blocked)
        if x.dtype != torch.float16:
            raise ValueError(f"products='split' takes float16 rows; got {x.dtype}")
        from geomscope.metrics.split_scatter import split_scatter

        blocked = not self.on_cpu if self.blocked is None else self.blocked
        return split_scatter(xb, mean_b, blocked=blocked)

    def to_moments(self):
        """The numpy :class:`Moments` of the rows seen (one host copy of the D x D scatter)."""
        out = Moments(self.dim, self.abs_threshold)
        if self.n == 0:
            return out
        host = lambda t: t.detach().cpu().numpy()  # noqa: E731
        m2 = np.triu(host(self.m2))
        out.n = self.n
        out.mean = host(self.mean).copy()
        out._m2 = m2 + np.triu(m2, 1).T
        out.sum_unit, out.sum_unit_sq = host(self.sum_unit).copy(), host(self.sum_unit_sq).copy()
        out.abs_sum, out.abs_max = host(self.abs_sum).copy(), host(self.abs_max).copy()
        out.count_abs_ge = host(self.count_abs_ge).astype(np.int64)
        out.sum_sq_norm = float(self.sum_sq_norm)
        out.n_zero_norm = int(self.n_zero_norm)
        return out
