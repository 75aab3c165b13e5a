"""The scatter of float16 rows from exact float16 parts, multiplied at the tensor cores' speed.

``extract --keep sample --products split`` folds each batch's rows into a float64 scatter without a
float64 matrix product (a GPU multiplies float16 about 13x faster than float64: 790 against 60
TFLOP/s on an H100/H200). For a block of m float16 rows x with float64 mean x̄:

1. **Shift.** Per column, s = x̄ rounded to a multiple of q = 2^max(floor(log2 sd) - 10, -24)
   (sd: the block's standard deviation), so |x̄ - s| <= q/2 <= sd / 2048. y = x - s is exact in
   float64 and a multiple of 2^-24 (as every float16 value is), and it has at most 22 significant
   bits unless |y| exceeds about 2048 sd or |x| < 2^-11 |s|. Centring keeps the products' partial
   sums near the scatter's own size: uncentred, a column whose mean is k standard deviations from
   zero multiplies the summation error by about (1 + k)^2.
2. **Split.** hi = fp16(fp32(y)), lo = fp16(fp32(y - hi)), so y = hi + lo + r with
   |r| <= 2^-21 |y| (two roundings at each step), and r = 0 whenever y has at most 22 significant
   bits (lo, a multiple of 2^-24, is then exact even among float16's subnormals). A column holding
   some |y| above float16's 65504 is halved first (exactly), which adds at most 2^-25 in absolute
   value to r where lo falls below float16's normal range.
3. **Products.** For each block of b = :data:`SPLIT_ROWS` rows, Z = [hi | lo] and Z^T Z in float32:
   the products of float16 parts are exact in float32 (22-bit significands, no overflow, no
   underflow), so the only rounding is the float32 summation over the b rows. hi^T hi + hi^T lo +
   lo^T hi + lo^T lo is added in float64, and blocks are summed in float64.
4. **Centring and diagonal.** M2 = sum(y y^T) - m ȳ ȳ^T with ȳ = x̄ - s in float64, and the
   diagonal sum((x - x̄)^2) computed directly in float64 (O(m D), exact to float64 rounding): the
   diagonal is the entry where float32 summation errors, all of one sign, add up coherently.

**Error bound.** Off the diagonal, with A_ij = sum |y_i| |y_j| <= sqrt(P_ii P_jj) (P = sum y y^T,
P_ii = M2_ii + m ȳ_i^2 <= (1 + 2^-22) M2_ii by the shift rule):

    |M2_ij - M2_ij(exact)| <= (gamma_(b-1) (1 + 2^-9) + 2^-20 (1 + 2^-22)) A_ij + O(2^-50) A_ij,

where gamma_k = k u / (1 - k u) and u is the float32 summation's unit roundoff (2^-24 rounding to
nearest; 2^-23 on hardware that truncates). This worst case assumes every rounding error of a sum
has the same sign (for b = 2048 it is 1.2e-4). Measured on activation-like rows (heavy tails,
strongly correlated dimensions, outlier dimensions with |x| hundreds of times the median, means
up to 20 standard deviations from zero: tests/test_metrics_split_scatter.py) with the CPU's float32
sums (round to nearest): below 1e-7 of ||M2||_F in Frobenius norm, and below 5e-7 of
sqrt(M2_ii M2_jj) for every entry, the largest for correlated pairs, whose partial sums drift with
their covariance so that the rounding errors add up as the diagonal's would. The diagonal's error
is float64's. Shorter blocks shrink the float32 error (about 1e-7 per entry at b = 64) but make
the float64 additions between blocks, a D x D float32 result read once per b rows, bound by
memory on a GPU.
"""

from __future__ import annotations

#: rows per float32 block: a block does 2 b x 2.1 D^2 flops (the triangle of the 2D x 2D product)
#: and moves about 33 D^2 bytes (its float32 result written and read, the float64 sum updated), so
#: b / 8 flops per byte: at b = 2048 about an H100's float16 rate over its memory bandwidth (989
#: TFLOP/s / 3.35 TB/s = 295), where the product stops waiting on memory
SPLIT_ROWS = 2048
#: column block of the accelerator's triangular product (as moments_torch.SYRK_BLOCK)
GRAM_BLOCK = 256
FLOAT16_MAX = 65504.0


def float32_product(a, b):
    """a @ b of float16 matrices with exact products and float32 sums: on a CUDA GPU the float16
    tensor cores with a float32 result; elsewhere (and where torch has no ``out_dtype``) the
    float16 values cast to float32 first (exact), then a float32 product."""
    import torch

    if a.device.type == "cuda":
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without mm(out_dtype=)
            pass
    return a.float() @ b.float()


def gram_upper(z, blocked: bool):
    """z^T z in float32, its blocks on or above the diagonal valid (all of it when not ``blocked``)."""
    import torch

    d = z.shape[1]
    if not blocked:
        return float32_product(z.T, z)
    out = torch.zeros((d, d), dtype=torch.float32, device=z.device)
    for i in range(0, d, GRAM_BLOCK):
        out[i : i + GRAM_BLOCK, i:] = float32_product(z[:, i : i + GRAM_BLOCK].T, z[:, i:])
    return out


def split_parts(y):
    """``(hi, lo, scale)``: float16 parts of the float64 rows ``y`` with ``y * scale = hi + lo + r``,
    |r| <= 2^-21 |y * scale| (module docstring), ``scale`` 1 or 1/2 per column."""
    import torch

    scale = torch.where(y.abs().amax(0) > FLOAT16_MAX, 0.5, 1.0).to(y.dtype)
    ys = y * scale
    hi = ys.float().half()
    lo = (ys - hi.double()).float().half()
    return hi, lo, scale


def split_products(hi, lo, rows: int = SPLIT_ROWS, blocked: bool = False):
    """sum over rows of (hi + lo)(hi + lo)^T, its upper triangle valid, float64: four float16 part
    products with float32 sums over blocks of ``rows`` rows, float64 between blocks."""
    import torch

    m, d = hi.shape
    out = torch.zeros((d, d), dtype=torch.float64, device=hi.device)
    for r in range(0, m, rows):
        g = gram_upper(torch.cat([hi[r : r + rows], lo[r : r + rows]], 1), blocked)
        cross = g[:d, d:].double()  # hi^T lo, all of it; lo^T hi is its transpose
        out += g[:d, :d].double()
        out += g[d:, d:].double()
        out += cross
        out += cross.T
    return out


def centring_shift(mean, sd):
    """Each column's shift: ``mean`` rounded to a multiple of q = 2^max(floor(log2 sd) - 10, -24)
    (exact in float64; a multiple of 2^-24, so x - shift is too)."""
    import torch

    e = torch.floor(torch.log2(sd)).clamp(min=-14) - 10  # log2(0) = -inf: a constant column, q = 2^-24
    q = torch.exp2(e)
    return torch.round(mean / q) * q


def split_scatter(xb, mean, rows: int = SPLIT_ROWS, blocked: bool = False):
    """sum over rows of (x - mean)(x - mean)^T for float16 rows ``xb`` (held in float64) and their
    float64 ``mean``: the upper triangle valid, the diagonal in float64, the rest from float16
    parts (module docstring: shift, split, products, bound)."""
    import torch

    m = xb.shape[0]
    centred = xb - mean
    diag = centred.square_().sum(0)
    del centred
    shift = centring_shift(mean, (diag / m).sqrt())
    hi, lo, scale = split_parts(xb - shift)
    m2 = split_products(hi, lo, rows, blocked)
    m2 /= torch.outer(scale, scale)  # powers of two: exact
    ybar = mean - shift
    m2 -= torch.outer(ybar, ybar * m)
    m2.diagonal().copy_(diag)
    return m2
