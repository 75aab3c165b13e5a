"""Exact first and second nearest neighbours of every row, by blocked matrix products.

``two_nearest(X)`` returns, for every row x_i of X (N, D), the Euclidean distances r1 <= r2 to its
two nearest *other* rows and their indices. The distances are exact: each is recomputed as
``sqrt(sum((x_i - x_j)**2))`` in float64 from the input values (what ``scipy.spatial.distance.cdist``
computes), so r1 == 0 exactly for an exact duplicate and never for distinct rows.

Algorithm (torch; the same code on ``device="cpu"`` and ``device="cuda"``):

1. Shift X by a column mean (distances are translation invariant; this removes a common offset
   before rounding to float32), scaled by a power of two only if float32 squares could under- or
   overflow.
2. Candidate search in float32: ``d2 = |a|^2 + |b|^2 - 2 a.b`` by GEMM over row strips
   ``X[s:e] @ X[s:].T`` -- only the upper triangle of the distance matrix is computed; each strip
   updates the running top-K (K = 4) of its own rows (row-wise top-k) and of the later rows
   (column-wise top-k). Memory is one strip of ``block_size x N`` float32 (never N x N), plus
   the float32 copy of X and O(N K) for the candidates.
3. Exact float64 recompute of the candidates that can be among the two nearest (those whose
   float32 value minus the error bound below is not above the second value plus it: usually
   just two per row); r1, r2 are the two smallest.
4. Certification. The float32 value of every pair is within ``err_i = c (|a_i|^2 + max_j |b_j|^2)``
   of the true squared distance, ``c = 1.01 ((D+2)u/(1-(D+2)u) + 2u_in + 24u)`` (u = 2^-24; u_in
   = 2^-8 when torch's float32 matmul precision is not "highest", i.e. TF32/bf16 products). Every
   non-candidate j has float32 value >= the K-th candidate value v_K, hence true d2 >= v_K - err_i.
   Rows with exact r2^2 <= v_K - err_i are proven right. The others (near-duplicates far from the
   mean, the float32 trap of real [CLS] vectors) are screened again against all rows, in float32
   with that bound, then in float64 GEMM with the float64 bound, and every pair neither screen
   can exclude is recomputed exactly. The result is exact for every row, whatever the conditioning.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np

from geomscope.devices import resolve_device
from geomscope.errors import DataError, InputError
from geomscope.metrics._validate import as_rows, count_nonfinite_rows, nonfinite_message

#: Bytes allowed for one strip of float32 candidate distances (and for each float64 chunk).
DEFAULT_MEMORY_BUDGET = 256 * 2**20
#: Candidates kept per row by the float32 search (exactly recomputed, then certified).
K_CANDIDATES = 4
_U32 = 2.0**-24
_U64 = 2.0**-53


def default_block_size(n: int, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> int:
    """Rows per strip: ``max(1024, N // 16)`` (strips then compute a fraction 1/2 + B/(2N) of the
    distance matrix; fewer rows per GEMM lose BLAS efficiency), at most 4096 and at most
    ``memory_budget / (4 N)`` (one float32 strip; the top-k passes need no strip-sized
    temporaries), at least 64, at most N."""
    cap = memory_budget // (4 * max(n, 1))
    b = min(max(1024, n // 16), 4096, cap)
    return int(max(1, min(n, max(64, b))))


@contextmanager
def _threads(dev, fraction: float = 0.5):
    """Run torch CPU ops inside with ``max(1, int(threads * fraction))`` threads (restored after).

    The bandwidth-bound passes (shift/scale, exact recompute) gain little from many threads, and
    on a shared machine every multi-threaded op can stall for a scheduler tick waiting for a busy
    core; the GEMM strips keep all of ``torch.get_num_threads()``.
    """
    import torch

    total = torch.get_num_threads()
    want = max(1, int(total * fraction))
    if dev.type != "cpu" or want == total:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(total)


def _input_rounding() -> float:
    """Unit roundoff of float32 GEMM inputs under torch's matmul precision setting."""
    import torch

    try:
        highest = torch.get_float32_matmul_precision() == "highest"
    except Exception:  # pragma: no cover - very old/new torch without the setting
        highest = True
    if highest and torch.backends.cuda.matmul.allow_tf32:
        highest = False
    return 0.0 if highest else 2.0**-8


def _bound_coefficient(d: int, u: float, u_in: float) -> float:
    g = (d + 2) * u
    return 1.01 * (g / (1.0 - g) + 2.0 * u_in + 24.0 * u)


def _as_float_matrix(X) -> np.ndarray:
    a = as_rows(X)
    if a.dtype.itemsize < 4:  # float16 storage: distances need at least float32
        a = a.astype(np.float32)
    return a


def _prepare(Xt, chunk: int):
    """Shift, power-of-two scale, the float32 copy ``(x - shift) * scale`` and its squared norms
    (float32 squares summed in float64: within 2u of the exact norms of the copy).

    Any constant shift leaves distances unchanged; it only has to remove the common offset before
    rounding to float32, so the column mean of at most 4,096 evenly spaced rows is used (in the
    input dtype). The scale is 1 when 2^-30 <= max |x - shift| <= 2^30, else it brings that
    maximum into [0.5, 1) so no float32 square overflows or underflows.
    """
    import torch

    n, d = Xt.shape
    dev = Xt.device
    shift = Xt[:: max(1, n // 4096)].mean(0)
    lo = torch.full((d,), math.inf, dtype=torch.float64, device=dev)
    hi = torch.full((d,), -math.inf, dtype=torch.float64, device=dev)
    for s in range(0, n, chunk):
        cmin, cmax = torch.aminmax(Xt[s : s + chunk], dim=0)
        lo, hi = torch.minimum(lo, cmin.double()), torch.maximum(hi, cmax.double())
    s64 = shift.double()
    maxabs = float(torch.maximum(hi - s64, s64 - lo).max())
    scale = 1.0
    if maxabs > 0 and not 2.0**-30 <= maxabs <= 2.0**30:
        scale = 2.0 ** (-math.frexp(maxabs)[1])
    x32 = torch.empty((n, d), dtype=torch.float32, device=dev)
    n32 = torch.empty(n, dtype=torch.float32, device=dev)
    if Xt.dtype == torch.float32 and scale == 1.0:
        torch.sub(Xt, shift, out=x32)  # X itself is never modified
    for s in range(0, n, chunk):
        if not (Xt.dtype == torch.float32 and scale == 1.0):
            x32[s : s + chunk] = (Xt[s : s + chunk].double() - s64).mul_(scale)  # float64, then rounded
        c = x32[s : s + chunk]
        n32[s : s + chunk] = (c * c).sum(1, dtype=torch.float64)
    return shift, scale, x32, n32


def _candidates(x32, n32, k: int, block: int, slots: int = 8):
    """Float32 top-k smallest squared distances (values, indices) per row, upper triangle only.

    Every strip hands each row it touches at most k candidates; they are parked in one of
    ``slots`` pending columns and merged into the running top-k once every ``slots`` strips.
    """
    import torch

    n = x32.shape[0]
    dev = x32.device
    # work[:, :k] = running top-k; work[:, k (1 + j):k (2 + j)] = pending slot j
    work_v = torch.full((n, k * (1 + slots)), math.inf, dtype=torch.float32, device=dev)
    work_i = torch.zeros((n, k * (1 + slots)), dtype=torch.int64, device=dev)
    buf = torch.empty(block * n, dtype=torch.float32, device=dev)

    def flush():
        v, p = work_v.topk(k, dim=1, largest=False, sorted=False)
        work_i[:, :k] = work_i.gather(1, p)
        work_v[:, :k] = v
        work_v[:, k:] = math.inf

    for t, s in enumerate(range(0, n, block)):
        e = min(s + block, n)
        bs, m = e - s, n - s
        lo = k * (1 + t % slots)
        S = buf[: bs * m].view(bs, m)
        torch.addmm(n32[None, s:], x32[s:e], x32[s:].T, alpha=-2.0, out=S)  # |b|^2 - 2 a.b
        S[:, :bs].diagonal().fill_(math.inf)  # self
        kr = min(k, m)
        rv, ri = S.topk(kr, dim=1, largest=False, sorted=False)
        torch.add(rv, n32[s:e, None], out=work_v[s:e, lo : lo + kr])
        torch.add(ri, s, out=work_i[s:e, lo : lo + kr])
        if e < n:  # the strip's off-diagonal part, read by column, updates the later rows
            T = S[:, bs:]
            T.add_(n32[s:e, None])
            kc = min(k, bs)
            cv, ci = T.topk(kc, dim=0, largest=False, sorted=False)
            work_v[e:, lo : lo + kc] = cv.T
            torch.add(ci.T, s, out=work_i[e:, lo : lo + kc])
        if t % slots == slots - 1:
            flush()
    flush()
    return work_v[:, :k].contiguous(), work_i[:, :k].contiguous()


def _safe_norm(diff, dim: int):
    """Euclidean norms of float64 differences along ``dim``, rescaling entries whose squares could
    underflow or overflow (norm < 1e-140 or inf)."""
    import torch

    res = torch.linalg.vector_norm(diff, dim=dim)
    bad = (res < 1e-140) | torch.isinf(res)
    if bool(bad.any()):
        db = diff.movedim(dim, -1)[bad]
        mx = db.abs().amax(-1, keepdim=True)
        safe = torch.where(mx > 0, mx, torch.ones_like(mx))
        res[bad] = torch.linalg.vector_norm(db / safe, dim=-1) * mx[:, 0]
    return res


def _exact_pairs(Xt, rows, cols, chunk: int):
    """Exact float64 distances ||X[rows] - X[cols]|| (difference, then norm), chunked over pairs."""
    import torch

    out = torch.empty(rows.shape[0], dtype=torch.float64, device=Xt.device)
    for s in range(0, rows.shape[0], chunk):
        diff = Xt[cols[s : s + chunk]].double().sub_(Xt[rows[s : s + chunk]])
        out[s : s + chunk] = _safe_norm(diff, 1)
    return out


def _exact_candidates(Xt, idx, chunk: int):
    """Exact float64 distances ||X[i] - X[idx[i, m]]|| for every row i and candidate m."""
    import torch

    n, k = idx.shape
    out = torch.empty((n, k), dtype=torch.float64, device=Xt.device)
    for s in range(0, n, chunk):
        diff = Xt[idx[s : s + chunk]].double().sub_(Xt[s : s + chunk, None, :])
        out[s : s + chunk] = _safe_norm(diff, 2)
    return out


def _best_two(rows: np.ndarray, cols: np.ndarray, dist: np.ndarray):
    """Per row, the two smallest distances (ties broken by index), from a pair list."""
    order = np.lexsort((cols, dist, rows))
    r, c, d = rows[order], cols[order], dist[order]
    first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    return r[first], d[first], c[first], d[first + 1], c[first + 1]


def _rescreen(Xt, x32, n32, rows, shift, scale, ub2, err32, memory_budget: int):
    """Pairs (row, j), j != row, that cannot be excluded from d(row, j)^2 <= ub2[row] (scaled units).

    1. float32 screen against all rows: every pair's float32 value is within ``err32[row]`` of
       the true squared distance, so pairs with value > ub2 + err32 are excluded.
    2. float64 screen of the remaining columns on ``(x - shift) * scale`` in float64: each value V
       is within ``c64 (|a|^2 + |b|^2)`` of the truth (c64: twice the float64 bound, which also
       covers the float64 norms), so pairs with V - c64 |b|^2 > ub2 + c64 |a|^2 are excluded.
    Whatever is left (at least the row's current two candidates) is recomputed exactly.
    """
    import torch

    n, d = Xt.shape
    thr32 = ((ub2 + err32[rows]) * (1.0 + 2.0**-20)).float()  # margin over float32 rounding
    step = max(1, min(rows.shape[0], memory_budget // (4 * n)))
    cols = []
    for a in range(0, rows.shape[0], step):
        r = rows[a : a + step]
        V = torch.addmm(n32[None, :], x32[r], x32.T, alpha=-2.0).add_(n32[r][:, None])
        cols.append((V <= thr32[a : a + step, None]).nonzero(as_tuple=True)[1])
    U = torch.unique(torch.cat(cols))
    c64 = 2.0 * _bound_coefficient(d, _U64, 0.0)
    s64 = shift.double()
    chunk_rows = max(1, min(rows.shape[0], memory_budget // (32 * d)))
    chunk_cols = max(64, memory_budget // (16 * (d + chunk_rows)))
    blocks = []
    for a in range(0, rows.shape[0], chunk_rows):
        r = rows[a : a + chunk_rows]
        A = (Xt[r].double() - s64).mul_(scale)
        na = torch.linalg.vector_norm(A, dim=1).square_()
        blocks.append((r, A, na, ub2[a : a + chunk_rows] + c64 * na))
    out_r, out_c = [], []
    for s in range(0, U.shape[0], chunk_cols):
        u = U[s : s + chunk_cols]
        B = (Xt[u].double() - s64).mul_(scale)
        nb = torch.linalg.vector_norm(B, dim=1).square_()
        for r, A, na, thr in blocks:
            V = torch.addmm((1.0 - c64) * nb[None, :], A, B.T, alpha=-2.0).add_(na[:, None])
            ii, jj = (V <= thr[:, None]).nonzero(as_tuple=True)
            keep = r[ii] != u[jj]
            out_r.append(r[ii][keep])
            out_c.append(u[jj][keep])
    return torch.cat(out_r), torch.cat(out_c)


def _refine(Xt, x32, n32, best_v, best_i, shift, scale, memory_budget: int, info: dict):
    """Exact r1, r2, i1, i2 from the float32 candidates (see the module docstring, steps 3-4)."""
    import torch

    n, d = Xt.shape
    k = best_v.shape[1]
    dev = Xt.device
    chunk = max(1, memory_budget // (16 * d))
    v, o = best_v.sort(1)
    idx = best_i.gather(1, o)
    v = v.double()
    n64 = n32.double()
    err = _bound_coefficient(d, _U32, _input_rounding()) * (n64 + float(n64.max()))
    # Candidates whose float32 lower bound v - err exceeds the second one's upper bound v_2 + err
    # cannot be among the two nearest: only the others (a prefix, >= 2) are recomputed exactly.
    need = (v - err[:, None]) <= (v[:, 1] + err)[:, None]
    cnt = need.sum(1)
    dist = torch.full((n, k), math.inf, dtype=torch.float64, device=dev)
    dist[:, :2] = _exact_candidates(Xt, idx[:, :2], max(1, chunk // 4))
    for m in range(2, k):
        rm = torch.nonzero(cnt > m).flatten()
        if rm.numel():
            dist[rm, m] = _exact_pairs(Xt, rm, idx[rm, m], max(1, chunk // 2))
    o = idx.argsort(1)  # ties broken by the smaller index
    dist_s, idx_s = dist.gather(1, o), idx.gather(1, o)
    o = dist_s.argsort(dim=1, stable=True)
    dist_s, idx_s = dist_s.gather(1, o), idx_s.gather(1, o)
    r1, r2 = dist_s[:, 0].clone(), dist_s[:, 1].clone()
    i1, i2 = idx_s[:, 0].clone(), idx_s[:, 1].clone()
    if k == n - 1:  # every other row is a candidate
        return r1, r2, i1, i2
    # certified: no non-candidate (true d^2 >= v_K - err) can be closer than the exact r2
    flagged = torch.nonzero((r2 * scale) ** 2 > v[:, k - 1] - err).flatten()
    info["n_flagged"] = int(flagged.numel())
    if flagged.numel():
        ub2 = (r2[flagged] * scale) ** 2
        pr, pc = _rescreen(Xt, x32, n32, flagged, shift, scale, ub2, err, memory_budget)
        info["n_rescreen_pairs"] = int(pr.numel())
        pd = _exact_pairs(Xt, pr, pc, max(1, chunk // 2))
        fr, d1, j1, d2, j2 = _best_two(pr.cpu().numpy(), pc.cpu().numpy(), pd.cpu().numpy())
        fr = torch.from_numpy(fr).to(dev)
        r1[fr], r2[fr] = torch.from_numpy(d1).to(dev), torch.from_numpy(d2).to(dev)
        i1[fr], i2[fr] = torch.from_numpy(j1).to(dev), torch.from_numpy(j2).to(dev)
    return r1, r2, i1, i2


def two_nearest(
    X,
    block_size: int | None = None,
    device=None,
    refine: bool = True,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    return_info: bool = False,
):
    """Exact first and second nearest-neighbour distances of every row (excluding itself).

    Parameters: X (N, D) float array (numpy or torch; float16 is computed in float32, ints in
    float64), N >= 3, finite. ``block_size``: rows per strip of the blocked search (default
    :func:`default_block_size` from ``memory_budget`` bytes). ``device``: torch device for the
    search ("cpu" default, "cuda"). ``refine=False`` skips the exact float64 recompute and returns
    the float32 candidate distances (approximate; may be mis-ranked for near-duplicates).

    Returns ``(r1, r2, i1, i2)``: float64 distances r1 <= r2 and int64 indices of the nearest and
    second-nearest rows; ties are broken by the smaller index. With ``return_info=True`` a fifth
    item, a dict: block_size, k (candidates per row), n_flagged (rows the float32 bound could not
    certify), n_rescreen_pairs (pairs recomputed exactly for them), device.
    """
    a = _as_float_matrix(X)
    n = a.shape[0]
    if n < 3:
        raise DataError(f"X has {n} row(s); two nearest neighbours need at least 3 points")
    bad = count_nonfinite_rows(a)
    if bad:
        raise DataError(nonfinite_message(bad, n))
    return _two_nearest(a, block_size, device, refine, memory_budget, return_info)


def _two_nearest(a: np.ndarray, block_size, device, refine, memory_budget, return_info):
    """:func:`two_nearest` on an already validated float numpy array (N >= 3, finite)."""
    import torch

    a = a.astype(np.float32) if a.dtype.itemsize < 4 else a
    n, d = a.shape
    dev = resolve_device("cpu" if device is None else str(device))
    block = default_block_size(n, memory_budget) if block_size is None else int(block_size)
    if block < 1:
        raise InputError(f"block_size must be >= 1; got {block_size}")
    block = min(block, n)
    Xt = torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    chunk = max(1, memory_budget // (16 * d))  # rows per float64 chunk in the passes over X
    with _threads(dev):
        shift, scale, x32, n32 = _prepare(Xt, chunk)
    k = min(K_CANDIDATES, n - 1)
    info = {"block_size": block, "k": k, "n_flagged": 0, "n_rescreen_pairs": 0, "device": str(dev)}
    best_v, best_i = _candidates(x32, n32, k, block)
    if not refine:
        v, p = best_v.sort(1)
        idx = best_i.gather(1, p)
        r = torch.sqrt(v[:, :2].double().clamp_min(0.0)) / scale
        r, idx = r.cpu().numpy(), idx.cpu().numpy()
        out = (r[:, 0].copy(), r[:, 1].copy(), idx[:, 0].copy(), idx[:, 1].copy())
        return out + (dict(info, refined=False),) if return_info else out
    with _threads(dev):
        r1, r2, i1, i2 = _refine(Xt, x32, n32, best_v, best_i, shift, scale, memory_budget, info)
    out = (r1.cpu().numpy(), r2.cpu().numpy(), i1.cpu().numpy(), i2.cpu().numpy())
    return out + (dict(info, refined=True),) if return_info else out
