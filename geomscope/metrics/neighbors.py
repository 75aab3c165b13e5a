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
   with that bound, then in one float64 GEMM pass whose own bound also tightens each row's r2
   (the pairs among these rows computed once each when they fit), and every pair neither screen
   can exclude is recomputed exactly. The result is exact for every row, whatever the conditioning.

Pruning (CPU, N >= 4096, when a 128-row sample says it pays; ``prune=`` forces either way): lower
bounds ``|a_x - a_y| <= |x - y|`` from the top k principal directions plus the residual norm
(k + 1 numbers per row) replace the D-dim GEMM by a (k + 1)-dim one; each row's two best
candidates, computed exactly, bound its r2, and only the rows whose (rounding-padded) lower bound
is within it are computed exactly. The lower bounds are scanned once, in cache-sized strips: a
learnt guess of each row's threshold (its smallest lower bound plus a margin) keeps the few entries
that can matter, and the rows the guess does not cover are redone on their full row. Exact as
well, whatever the guess: see ``_pruned_search`` and ``_PrunedPass.band``.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import numpy as np

from geomscope.devices import resolve_device
from geomscope.errors import DataError, InputError
from geomscope.metrics.validate import NonfiniteRows, as_rows, count_nonfinite_rows

#: Bytes allowed for one strip of float32 candidate distances (and for each float64 chunk).
DEFAULT_MEMORY_BUDGET = 256 * 2**20
#: The budget on a GPU (a quarter of the memory the search leaves free, if that is less: see
#: :func:`device_budget`): taller strips and larger chunks, because a GPU runs a strip of a few
#: hundred rows well below its throughput (256 MiB gives a 200,000-row search strips of 335 rows).
GPU_MEMORY_BUDGET = 4 * 2**30
#: Candidates kept per row by the float32 search (exactly recomputed, then certified).
K_CANDIDATES = 4
_U32 = 2.0**-24
_U64 = 2.0**-53
#: Bytes per chunk of the bandwidth-bound passes over rows (shift and norms, projections, exact
#: pair distances): a chunk that stays in the cache between the ops reading it makes these passes
#: 2-3x faster than budget-sized chunks (at 20,000 x 768 on a 2-core CPU).
_CACHE_BYTES = 4 * 2**20
#: Bytes per strip of the pruned search's lower bounds (its product, then min and compare passes),
#: and rows per band for which its candidates are computed exactly together.
_STRIP_BYTES, _BAND_ROWS = 4 * 2**20, 2048
#: The pruned pass's guess is this quantile of the margins thr_i - min_j S_ij of recent rows; rows
#: with more entries within their guess are redone in full (bounds memory if the guess is off).
_GUESS_QUANTILE, _GUESS_MAX_ENTRIES = 0.95, 256


def _cache_rows(d: int, memory_budget: int = DEFAULT_MEMORY_BUDGET, dev=None) -> int:
    """Rows of float64 width ``d`` per chunk: the memory budget's, and on the CPU at most a
    cache-sized chunk (a GPU gains nothing from chunks that fit a CPU cache)."""
    rows = memory_budget // (16 * d)
    if dev is None or dev.type == "cpu":
        rows = min(rows, _CACHE_BYTES // (8 * d))
    return max(1, rows)


def device_budget(dev, memory_budget: int | None = None, reserved: int = 0) -> int:
    """The memory budget to use on ``dev``: ``memory_budget`` when given; else
    :data:`DEFAULT_MEMORY_BUDGET` on the CPU, and on a GPU :data:`GPU_MEMORY_BUDGET` or a quarter of
    the free memory left after ``reserved`` bytes (what the search holds besides its strips: the
    rows, their float32 copy, the candidates), whichever is less -- never below the CPU's."""
    if memory_budget is not None:
        return int(memory_budget)
    if dev.type != "cuda":
        return DEFAULT_MEMORY_BUDGET
    import torch

    free, _ = torch.cuda.mem_get_info(dev)
    return max(DEFAULT_MEMORY_BUDGET, min(GPU_MEMORY_BUDGET, (free - reserved) // 4))


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
    if dev.type == "cpu":  # numpy's column reductions are ~20x faster than torch's aminmax(dim=0)
        a = Xt.numpy()
        lo, hi = torch.from_numpy(a.min(0).astype(np.float64)), torch.from_numpy(a.max(0).astype(np.float64))
    else:
        lo, hi = Xt.amin(0).double(), Xt.amax(0).double()
    s64 = shift.double()
    maxabs = float(torch.maximum(hi - s64, s64 - lo).max())
    scale = 1.0
    if maxabs > 0 and not 2.0**-30 <= maxabs <= 2.0**30:
        scale = 2.0 ** (-math.frexp(maxabs)[1])
    x32 = torch.empty((n, d), dtype=torch.float32, device=dev)
    n32 = torch.empty(n, dtype=torch.float32, device=dev)
    direct = Xt.dtype == torch.float32 and scale == 1.0
    for s in range(0, n, chunk):
        c = x32[s : s + chunk]
        if direct:
            torch.sub(Xt[s : s + chunk], shift, out=c)  # X itself is never modified
        else:
            c.copy_((Xt[s : s + chunk].double() - s64).mul_(scale))  # float64, then rounded
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
    tchunk = max(1, min(n, 2**22 // max(block, 1)))  # 16 MiB of transposed strip at a time
    tbuf = torch.empty(tchunk * block, dtype=torch.float32, device=dev)

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
        kc = min(k, bs)
        # the strip's off-diagonal part, read by column, updates the later rows: transposed (and
        # the strip rows' |a|^2 added) in chunks, whose row-wise top-k is ~1.5x cheaper than torch's
        # column-wise top-k over the strip
        for c in range(e, n, tchunk):
            ce = min(c + tchunk, n)
            Tt = tbuf[: (ce - c) * bs].view(ce - c, bs)
            torch.add(S[:, c - s : ce - s].T, n32[None, s:e], out=Tt)
            cv, ci = Tt.topk(kc, dim=1, largest=False, sorted=False)
            work_v[c:ce, lo : lo + kc] = cv
            torch.add(ci, s, out=work_i[c:ce, lo : lo + kc])
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


def _np_norms(diff: np.ndarray) -> np.ndarray:
    """Row norms of float64 differences (numpy), rescaling rows whose squares under/overflow."""
    res = np.sqrt(np.einsum("ij,ij->i", diff, diff))
    bad = (res < 1e-140) | np.isinf(res)
    if bad.any():
        db = diff[bad]
        mx = np.abs(db).max(1)
        safe = np.where(mx > 0, mx, 1.0)
        res[bad] = np.sqrt(np.einsum("ij,ij->i", db / safe[:, None], db / safe[:, None])) * mx
    return res


def _exact_pairs(Xt, rows, cols, chunk: int):
    """Exact float64 distances ||X[rows] - X[cols]|| (difference, then norm), chunked over pairs.

    On the CPU this runs in numpy: its single-threaded gather + einsum is several times faster
    than torch's multi-threaded small ops for these bandwidth-bound chunks."""
    import torch

    if Xt.device.type == "cpu":
        X, r, c = Xt.numpy(), rows.numpy(), cols.numpy()
        out = np.empty(r.shape[0], dtype=np.float64)
        for s in range(0, r.shape[0], chunk):
            diff = X[c[s : s + chunk]].astype(np.float64)
            diff -= X[r[s : s + chunk]]
            out[s : s + chunk] = _np_norms(diff)
        return torch.from_numpy(out)
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=Xt.device)
    for s in range(0, rows.shape[0], chunk):
        diff = Xt[cols[s : s + chunk]].double().sub_(Xt[rows[s : s + chunk]])
        out[s : s + chunk] = _safe_norm(diff, 1)
    return out


def _exact_candidates(Xt, idx, chunk: int):
    """Exact float64 distances ||X[i] - X[idx[i, m]]|| for every row i and candidate m."""
    import torch

    n, k = idx.shape
    rows = torch.arange(n, device=idx.device).repeat_interleave(k)
    return _exact_pairs(Xt, rows, idx.flatten(), max(1, chunk * k)).view(n, k)


def _best_two(rows: np.ndarray, cols: np.ndarray, dist: np.ndarray):
    """Per row, the two smallest distances (ties broken by index), from a pair list."""
    order = np.lexsort((cols, dist, rows))
    r, c, d = rows[order], cols[order], dist[order]
    first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    return r[first], d[first], c[first], d[first + 1], c[first + 1]


class _RunningBestTwo:
    """Each of ``m`` rows' two nearest so far (distances ``dist``, indices ``idx``, (m, 2)), into
    which pair lists are folded as they come: ties go to the smaller index, as in
    :func:`_best_two`. A row starts with two placeholders (infinite, index ``n``), which any real
    pair beats."""

    def __init__(self, m: int, n: int):
        self.dist = np.full((m, 2), np.inf)
        self.idx = np.full((m, 2), n, dtype=np.int64)

    def fold(self, pos: np.ndarray, cols: np.ndarray, dist: np.ndarray) -> None:
        """Add the pairs (row ``pos[t]`` of the m, column ``cols[t]``) at exact distance ``dist[t]``."""
        mine = np.unique(pos)
        rows, d1, j1, d2, j2 = _best_two(
            np.concatenate([np.repeat(mine, 2), pos]),
            np.concatenate([self.idx[mine].ravel(), cols]),
            np.concatenate([self.dist[mine].ravel(), dist]),
        )
        self.dist[rows] = np.stack([d1, d2], axis=1)
        self.idx[rows] = np.stack([j1, j2], axis=1)


def _rescreen(Xt, x32, n32, rows, shift, scale, ub2, err32, memory_budget: int, chunk: int):
    """Exact two nearest of the ``rows`` the float32 search could not certify, given
    ``ub2[t]``, the scaled square of an exact distance from ``rows[t]`` to a second row (so its r2
    is at most that): ``(r1, r2, i1, i2)`` numpy arrays aligned with ``rows``, and the number of
    pairs recomputed exactly.

    1. float32 screen against all rows (:func:`_screened_columns`): the columns no row can reach.
    2. One float64 pass over the remaining pairs on ``(x - shift) * scale`` (:class:`_Float64Pass`):
       each value is within ``c64 (|a|^2 + |b|^2)`` of the true squared distance (c64: twice the
       float64 bound, which also covers the float64 norms; plus a few subnormal units where squares
       fall below float64's normal range), so it gives every pair a lower and an
       upper bound. The second smallest upper bound over a row's other columns bounds its r2^2 and
       tightens ``ub2`` as the pass goes; the pairs whose lower bound is within the row's bound
       are kept, and those still within it at the end are recomputed exactly and folded into the
       row's best two. Where the float32 search could not rank a cluster its candidates are typical
       members, whose r2 would keep half the cluster (51.6 M exact distances on 16,000 x 768 in two
       tight clusters); the tightened bound keeps a few per row.
    3. When the rows' float64 copies fit in half the budget at once, the pairs among the rows
       themselves are computed once each (the upper triangle; both rows of a pair learn from it),
       and only the other screened columns as a rectangle: a tight cluster where every row is
       flagged costs half a float64 distance matrix.

    Memory stays within about the budget however many rows there are: the screen's columns are
    one (N,) mask; the float64 copies of the rows come a group at a time (half the budget), the
    columns' a tile at a time; the kept pairs are pruned against the tightened bounds, and computed
    and folded, whenever they outgrow their share.
    """
    import torch

    n, d = Xt.shape
    m = rows.shape[0]
    thr32 = ((ub2 + err32[rows]) * (1.0 + 2.0**-20)).float()  # margin over float32 rounding
    U = _screened_columns(x32, n32, rows, thr32, memory_budget)
    c64 = 2.0 * _bound_coefficient(d, _U64, 0.0)
    s64 = shift.double()
    group_rows = max(1, memory_budget // (16 * d))  # the rows' float64 copies: half the budget
    tile = max(64, math.isqrt(max(1, memory_budget // 128)))  # tile side: 16 MiB of float64 at 256 MiB
    best = _RunningBestTwo(m, n)
    # pairs recomputed and folded at once: ~150 B each at the fold's peak (index lists, gathers,
    # the exact distances, the fold's concatenations and sort)
    max_pairs = max(4096, memory_budget // 1024)
    pairs = 0
    for g in range(0, m, group_rows):
        r = rows[g : g + group_rows]
        A = Xt[r].double().sub_(s64).mul_(scale)  # in place: 8 B an element, not 16
        group = _Float64Pass(Xt, r, A, ub2[g : g + group_rows], c64, best, g, max_pairs, chunk)
        whole = m <= group_rows  # every flagged row is in this group: pairs among them once
        if whole:
            group.among_rows(tile)
        for u, B, nb in _column_chunks(Xt, U[~torch.isin(U, r)] if whole else U, tile, s64, scale):
            group.against(u, B, nb, tile)
        pairs += group.finish()
    if not (np.isfinite(best.dist).all() and (best.idx < n).all()):  # the row's own two always survive
        raise RuntimeError("internal error: a flagged row lost its two nearest in the float64 rescreen")
    return best.dist[:, 0], best.dist[:, 1], best.idx[:, 0], best.idx[:, 1], pairs


#: What one pair costs the rescreen's float64 pass, in pairs of its float32 screen (the float64
#: GEMM runs at about half the float32 rate on a 2-core EPYC, plus its passes over the tile): the
#: screen stops once the columns it could still exclude cannot repay the rows it has left.
_FLOAT64_PAIR_COST = 2.0


def _screened_columns(x32, n32, rows, thr32, memory_budget: int):
    """The columns some flagged row may reach (float32 value <= ``thr32``, the row's bound plus the
    float32 error bound), a sorted index tensor. The rows are screened in a fixed random order, a
    small sample first: when the columns already reached leave too few to exclude to repay the
    rest of the screen (every row of data in a few tight clusters), every column is kept. That
    decides only how much work the float64 pass does, never its result."""
    import torch

    n = x32.shape[0]
    m = rows.shape[0]
    order = torch.randperm(m, generator=torch.Generator().manual_seed(0)).to(rows.device)
    step = max(1, min(m, memory_budget // (4 * n)))
    hit = torch.zeros(n, dtype=torch.bool, device=x32.device)
    a = 0
    while a < m:
        t = order[a : a + (min(step, 256) if a == 0 else step)]
        a += t.shape[0]
        r = rows[t]
        V = torch.addmm(n32[None, :], x32[r], x32.T, alpha=-2.0).add_(n32[r][:, None])
        hit |= (V <= thr32[t, None]).any(0)
        del V
        unreached = n - int(hit.sum())
        if a < m and unreached * m * _FLOAT64_PAIR_COST < (m - a) * n:
            return torch.arange(n, device=x32.device)
    return hit.nonzero().flatten()


class _Float64Pass:
    """The rescreen's float64 pass over one group of flagged rows (``r``, their shifted and scaled
    float64 copies ``A``), tile by tile; see :func:`_rescreen`. For a tile of values
    ``L = (1 - c64) (|a|^2 + |b|^2) - 2 a.b - tau`` (a lower bound of each pair's true squared
    distance; ``L + 2 c64 (|a|^2 + |b|^2) + 2 tau`` an upper one; tau covers the absolute error of
    squares below float64's normal range) it keeps each row's two smallest upper bounds
    (``two``), lowers the row's bound to the second (padded by 4 c64 for the rounding of the exact
    distances it is compared with), and keeps the pairs with ``L <= bound``. The kept pairs are
    pruned against the bounds as those fall, and recomputed exactly and folded into ``best`` (rows
    ``offset + local index``) when they outgrow ``max_pairs`` and at :meth:`finish`."""

    def __init__(self, Xt, r, A, ub2, c64: float, best, offset: int, max_pairs: int, chunk: int):
        import torch

        self.Xt, self.r, self.A, self.c64 = Xt, r, A, c64
        # below float64's normal range (squares under 2^-1022) an operation's error is absolute, up
        # to half the smallest subnormal: the d products, their sums and the few other operations
        # on each value are covered by tau on top of the relative bound
        self.tau = (A.shape[1] + 8) * 2.0**-1074
        self.na = torch.linalg.vector_norm(A, dim=1).square_()
        self.bound = ub2 * (1.0 + 4.0 * c64) + self.tau
        self.two = torch.full((r.shape[0], 2), math.inf, dtype=torch.float64, device=A.device)
        self.best, self.offset, self.max_pairs, self.chunk = best, offset, max_pairs, chunk
        self.kept: list = []  # (local row, column, L) tensors
        self.n_kept = 0
        self.pairs = 0  # recomputed exactly

    def among_rows(self, tile: int) -> None:
        """Every pair of the group's rows, once: the tiles on and above the diagonal, each also
        read by column for the rows it holds as columns."""
        m = self.r.shape[0]
        for c in range(0, m, tile):
            u, B, nb = self.r[c : c + tile], self.A[c : c + tile], self.na[c : c + tile]
            for a in range(0, c + 1, tile):
                self.tile(a, min(a + tile, m), u, B, nb, mirror=c if a != c else None)

    def against(self, u, B, nb, tile: int) -> None:
        """The group's rows against columns ``u`` (not among them, or the group not the whole)."""
        for a in range(0, self.r.shape[0], tile):
            self.tile(a, min(a + tile, self.r.shape[0]), u, B, nb)

    def tile(self, a: int, b: int, u, B, nb, mirror: int | None = None) -> None:
        """Rows ``a:b`` of the group against columns ``u`` (``B``, ``nb``: their float64 copies and
        squared norms). ``mirror``: the columns are the group's rows from that local index on, and
        the tile also serves them, read by column (the tile below the diagonal is never computed)."""
        import torch

        c64, r, na = self.c64, self.r[a:b], self.na[a:b]
        L = torch.addmm(nb[None, :], self.A[a:b], B.T, beta=1.0 - c64, alpha=-2.0)
        L.add_(na[:, None], alpha=1.0 - c64).sub_(self.tau)
        # a row is not its own neighbour (u and r are sorted)
        at = torch.searchsorted(u, r).clamp_(max=u.shape[0] - 1)
        own = (u[at] == r).nonzero().flatten()
        L[own, at[own]] = math.inf
        self._learn(a, b, L, na, nb, dim=1)
        self._keep_near(L, L <= self.bound[a:b, None], lambda i, j: (i + a, u[j]))
        if mirror is not None:
            e = mirror + u.shape[0]
            self._learn(mirror, e, L, nb, na, dim=0)
            self._keep_near(L, L <= self.bound[None, mirror:e], lambda i, j: (j + mirror, r[i]))

    def _learn(self, a: int, b: int, L, n_rows, n_cols, dim: int) -> None:
        """Rows a:b's two smallest upper bounds merged into ``two`` and their bound lowered to the
        second. The rows run along ``dim`` of ``L``; ``n_rows``, ``n_cols``: the squared norms
        along and across it. The two smallest values of ``L`` are two distinct columns, and each
        gets its own pair's upper bound: any two columns' upper bounds bound r2^2."""
        import torch

        k = min(2, L.shape[dim])
        low, at = L.topk(k, dim=dim, largest=False)
        if dim == 0:
            low, at = low.T, at.T
        up = low + 2.0 * self.c64 * (n_rows[:, None] + n_cols[at]) + 2.0 * self.tau
        two = torch.cat([self.two[a:b], up], dim=1).topk(2, dim=1, largest=False).values
        self.two[a:b] = two
        torch.minimum(self.bound[a:b], two[:, 1] * (1.0 + 4.0 * self.c64) + self.tau, out=self.bound[a:b])

    def _keep_near(self, L, near, pairs) -> None:
        """Keep the tile's entries where ``near`` holds, as pairs ``pairs(i, j) -> (local row,
        column)`` with their ``L``: a slice of the tile's rows at a time where they are many (a tile
        of exact copies keeps every entry, and each costs ~40 B in index lists)."""
        import torch

        # not a bool sum: 100 of those on a 1448 x 1448 tile raised the peak RSS by 98 MiB
        count = int(torch.count_nonzero(near))
        if not count:
            return
        step = near.shape[0] if count <= self.max_pairs else max(1, near.shape[0] * self.max_pairs // count)
        for s in range(0, near.shape[0], step):
            i, j = near[s : s + step].nonzero(as_tuple=True)
            i += s
            pos, cols = pairs(i, j)
            self._keep(pos, cols, L[i, j])

    def _keep(self, pos, cols, low) -> None:
        """Keep pairs (local row, column, lower bound); prune, then flush, when they outgrow their share."""
        if pos.numel():
            self.kept.append((pos, cols, low))
            self.n_kept += int(pos.numel())
        if self.n_kept > self.max_pairs:
            self._prune()
            if self.n_kept > self.max_pairs // 2:
                self._flush()

    def _prune(self) -> None:
        """Drop the kept pairs that the bounds have fallen below."""
        import torch

        if not self.kept:
            return
        pos, cols, low = (torch.cat(t) for t in zip(*self.kept, strict=True))
        live = low <= self.bound[pos]
        self.kept = [(pos[live], cols[live], low[live])]
        self.n_kept = int(live.sum())

    def _flush(self) -> None:
        """Compute the kept pairs exactly and fold them into the rows' best two, ``max_pairs`` at a
        time (a tile of exact copies can keep every one of its pairs)."""
        if self.n_kept:
            pos, cols, _ = self.kept[0]
            for s in range(0, pos.shape[0], self.max_pairs):
                p, c = pos[s : s + self.max_pairs], cols[s : s + self.max_pairs]
                exact = _exact_pairs(self.Xt, self.r[p], c, self.chunk)
                self.best.fold(p.cpu().numpy() + self.offset, c.cpu().numpy(), exact.cpu().numpy())
            self.pairs += int(pos.numel())
        self.kept, self.n_kept = [], 0

    def finish(self) -> int:
        """Fold what is left; the number of pairs this group recomputed exactly."""
        self._prune()
        self._flush()
        return self.pairs


def _column_chunks(Xt, U, chunk_cols: int, s64, scale):
    """(columns, their shifted and scaled float64 rows, squared norms), ``chunk_cols`` at a time."""
    import torch

    for s in range(0, U.shape[0], chunk_cols):
        u = U[s : s + chunk_cols]
        B = Xt[u].double().sub_(s64).mul_(scale)
        yield u, B, torch.linalg.vector_norm(B, dim=1).square_()


def _refine(Xt, x32, n32, best_v, best_i, shift, scale, memory_budget: int, info: dict):
    """Exact r1, r2, i1, i2 from the float32 candidates (see the module docstring, steps 3-4)."""
    import torch

    n, d = Xt.shape
    k = best_v.shape[1]
    dev = Xt.device
    chunk = _cache_rows(d, memory_budget, dev)
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
    with _threads(dev):  # bandwidth-bound; the rescreen's GEMMs below keep every thread
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
    # (>=: a row whose r2 ties the bound, e.g. identical rows where err is 0, may have a
    # non-candidate at the same distance and a smaller index)
    flagged = torch.nonzero((r2 * scale) ** 2 >= v[:, k - 1] - err).flatten()
    info["n_flagged"] = int(flagged.numel())
    if flagged.numel():
        ub2 = (r2[flagged] * scale) ** 2
        d1, d2, j1, j2, pairs = _rescreen(
            Xt, x32, n32, flagged, shift, scale, ub2, err, memory_budget, max(1, chunk // 2)
        )
        info["n_rescreen_pairs"] = pairs
        r1[flagged], r2[flagged] = torch.from_numpy(d1).to(dev), torch.from_numpy(d2).to(dev)
        i1[flagged], i2[flagged] = torch.from_numpy(j1).to(dev), torch.from_numpy(j2).to(dev)
    return r1, r2, i1, i2


# ---------------------------------------------------------------- exact candidate pruning
#
# Activations concentrate most of their variance in a few directions. With W (D, k) the top-k
# principal directions of a sample, each row x gets a_x = [W^T x, |r_x|], r_x = x - W W^T x, and
# |a_x - a_y|^2 = |W^T z|^2 + (|r_x| - |r_y|)^2 <= |z|^2 for z = x - y (Pythagoras, then the
# triangle inequality on the residuals). A float32 search on the (k + 1)-dim a's gives each row two
# candidates whose exact distances bound r2 from above; the row then computes exactly only the
# rows whose lower bound is within that bound. Where the spectrum decays fast a few pairs per row
# survive and the (k + 1)-dim pass costs a fraction of the D-dim GEMM; elsewhere (the MiniLM
# layers: the survivors are 5-30% of all pairs) brute force is kept.

#: PCA widths the pruned search may use (k principal directions, at most D / 4 when automatic).
PRUNE_WIDTHS = (8, 16, 32, 64)
#: Below this many rows the automatic choice is brute force (it takes well under a second).
PRUNE_MIN_ROWS = 4096
#: Rows sampled to estimate the survival rate, and rows used for the principal directions.
_SURVIVAL_SAMPLE, _PCA_SAMPLE = 128, 2048
#: Rough costs measured on a 2-core AVX2 CPU, in float32-GEMM flops: per strip entry of the brute
#: search's top-k passes and of the pruned search's (a row min and a compare + nonzero, beyond its
#: 2 (k + 1) product flops), and per element of an exact float64
#: distance of a gathered pair. Calibrated at 20,000 x 768: brute force 3.6 s, the pruned pass
#: 0.65 s, exact pairs ~1.8 us each.
_COST_BRUTE_PASS, _COST_PRUNED_PASS, _COST_EXACT = 200.0, 90.0, 250.0
#: Pruning is chosen when its estimated cost is below this fraction of brute force's.
_PRUNE_GAIN = 0.6


def _principal_directions(x32, kmax: int):
    """``kmax`` leading principal directions (float64, orthonormal columns, by decreasing variance)
    of at most ``_PCA_SAMPLE`` seeded random rows of the shifted copy: a randomized range finder
    (two power iterations in float32, Rayleigh-Ritz in float64), far cheaper than a D x D eigh.
    Any orthonormal W keeps the search exact; better directions only prune more."""
    import torch

    n, d = x32.shape
    g = torch.Generator().manual_seed(0)
    S = x32[torch.randperm(n, generator=g)[:_PCA_SAMPLE].to(x32.device)]
    Q = torch.randn(d, min(d, kmax + 8), generator=g).to(x32.device)
    # one thread: multi-threaded LAPACK on these small factorizations can be ~100x slower when
    # the cores are shared (a 768 x 72 QR takes 0.13 s on 2 busy threads, 0.7 ms on one)
    with _threads(x32.device, fraction=0.0):
        for _ in range(2):
            Q = torch.linalg.qr(S.T @ (S @ Q))[0]
        Q = torch.linalg.qr(Q.double())[0]
        B = S.double() @ Q
        rot = torch.linalg.eigh(B.T @ B)[1].flip(1)[:, :kmax]
        return torch.linalg.qr(Q @ rot)[0]  # re-orthonormalized in float64 (signs do not matter)


def _pruned_cost(n: int, d: int, k: int, survivors: float) -> float:
    """Estimated cost (float32-GEMM flops) of the pruned search: one full-row pass on the
    (k + 1)-dim rows, then exact distances of each row's survivors and its two candidates."""
    return n * n * (2.0 * (k + 1) + _COST_PRUNED_PASS) + n * (survivors + 2.0) * d * _COST_EXACT


def _estimate_survivors(x32, n32, W, widths):
    """Per width k, the mean number of other rows whose lower bound is within the row's (float32)
    second-NN distance padded as in ``_pruned_search`` (rows far from the mean pad every threshold),
    over ``_SURVIVAL_SAMPLE`` seeded random rows. An estimate for choosing the method: exactness
    never depends on it."""
    import torch

    n = x32.shape[0]
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:_SURVIVAL_SAMPLE].to(x32.device)
    m = rows.numel()
    diag = (torch.arange(m, device=x32.device), rows)
    # the two products with all threads (they are most of the cost), the rest with one (small ops:
    # extra threads only wait on busy cores)
    V = torch.addmm(n32[None, :].float(), x32[rows], x32.T, alpha=-2.0)
    P = x32 @ W.float()
    out = {}
    with _threads(x32.device, fraction=0.0):
        V[diag] = math.inf
        r2 = (V.topk(2, dim=1, largest=False).values[:, 1] + n32[rows].float()).clamp_min(0.0)
        norms = n32.float().sqrt()
        b = 1.01 * _U32 * (norms[rows] + norms.max())
        tail = n32.float()[:, None] - (P * P).cumsum(1)  # |x|^2 - |P[:, :k]|^2 in column k - 1
        for k in widths:
            a = torch.cat([P[:, :k], tail[:, k - 1 : k].clamp_min(0.0).sqrt()], dim=1)
            na = (a * a).sum(1)
            L = torch.addmm(na[None, :], a[rows], a.T, alpha=-2.0).add_(na[rows, None])
            L[diag] = math.inf
            c = _bound_coefficient(k + 1, _U32, _input_rounding()) + 6.1 * _U32
            thr = (r2.sqrt() * 1.0005 + b) ** 2 + c * (na[rows] + na.max())
            out[k] = float((L <= thr[:, None]).sum(1).double().mean())
    return out


def _choose_pruning(x32, n32, forced: bool, info: dict):
    """``(W, k)`` for the pruned search, or ``None`` for brute force (see ``_pruned_cost``)."""
    n, d = x32.shape
    widths = [k for k in PRUNE_WIDTHS if 4 * k <= d] or ([max(1, d // 4)] if forced else [])
    if not widths or (not forced and n < PRUNE_MIN_ROWS):
        return None
    W = _principal_directions(x32, widths[-1])
    surv = _estimate_survivors(x32, n32, W, widths)
    k = min(widths, key=lambda w: _pruned_cost(n, d, w, surv[w]))
    speedup = n * n / 2 * (2.0 * d + _COST_BRUTE_PASS) / _pruned_cost(n, d, k, surv[k])
    info.update(prune_survivors_estimate=surv, prune_speedup_estimate=speedup)
    if not forced and speedup < 1.0 / _PRUNE_GAIN:
        return None
    return W[:, :k].contiguous(), k


def _lower_bound_rows(x32, W, chunk: int):
    """Rows a = [W^T x, |x - W W^T x|] (float64 arithmetic, rounded to float32) and the float64
    squared norms of the float32 rows."""
    import torch

    n, k = x32.shape[0], W.shape[1]
    a32 = torch.empty((n, k + 1), dtype=torch.float32, device=x32.device)
    for s in range(0, n, chunk):
        x = x32[s : s + chunk].double()
        p = x @ W
        a32[s : s + chunk, :k] = p
        a32[s : s + chunk, k] = torch.linalg.vector_norm(x.sub_(p @ W.T), dim=1)
    return a32, (a32.double() ** 2).sum(1)


def _lower_bound_slack(W, d: int) -> tuple[float, float]:
    """``(delta, c)``: for float32 values V of the lower bound (addmm on the float32 a's, as in
    ``_candidates``) and x32 rows x, y:  V <= (1 + delta) |x - y|^2 + c (|a_x|^2 + |a_y|^2).

    delta = D (1 + D), D = ||W^T W - I||_2 (+1e-12 for the float64 error of forming it): with
    q = W^T z, |q|^2 + |z - W W^T z|^2 = |z|^2 + q^T (W^T W - I) q <= (1 + delta) |z|^2.
    c: the float32 GEMM bound of ``_bound_coefficient`` for k + 1 columns, 4.1 u for rounding the
    a's to float32, 2 u for comparing the product with T - |a|^2 instead of adding |a|^2 in
    float32, and 1e-9 for the a's float64 computation (errors ~ D u64 |x|).
    """
    import torch

    k = W.shape[1]
    G = W.T @ W - torch.eye(k, dtype=W.dtype, device=W.device)
    with _threads(W.device, fraction=0.0):  # a small SVD: see _principal_directions
        off = float(torch.linalg.matrix_norm(G, ord=2)) + 1e-12
    return off * (1.0 + off), _bound_coefficient(k + 1, _U32, _input_rounding()) + 6.1 * _U32 + 1e-9


def _mask_nonzero(S, thr):
    """Flat indices of the entries of S (rows, n) with S[i, j] <= thr[i], row-major."""
    import torch

    if S.device.type == "cpu":  # numpy's compare and nonzero scan a strip 2-5x faster than torch's
        return torch.from_numpy(np.flatnonzero(S.numpy() <= thr.numpy()[:, None]))
    return (S <= thr[:, None]).flatten().nonzero().flatten()


def _sparse_two_smallest(pr, pv, m: int):
    """Positions in (pr, pv) of each row's two smallest values (pr: rows in [0, m)), and a mask
    of the rows that have fewer than two entries (their positions are 0)."""
    import torch

    o = pv.argsort(stable=True)
    o = o[pr[o].argsort(stable=True)]  # by row, then value
    cnt = torch.bincount(pr, minlength=m)
    first = torch.cumsum(cnt, 0) - cnt
    few = cnt < 2
    pos = torch.zeros((m, 2), dtype=torch.int64, device=pr.device)
    pos[~few, 0] = o[first[~few]]
    pos[~few, 1] = o[first[~few] + 1]
    return pos, few


class _PrunedPass:
    """The pruned search's pass over the lower bounds, one band of rows at a time (see
    ``_pruned_search``). S_ij = V_ij - |a_i|^2 (float32, the row's own |a_i|^2 left out)."""

    def __init__(self, Xt, x32, n32, W, scale, chunk: int, strip_rows: int, dense_rows: int):
        import torch

        n, d = Xt.shape
        self.Xt, self.n, self.chunk, self.scale = Xt, n, chunk, scale
        self.strip_rows, self.dense_rows = strip_rows, dense_rows
        self.a32, self.na = _lower_bound_rows(x32, W, chunk)
        self.na32 = self.na.float()
        self.delta, c = _lower_bound_slack(W, d)
        norms = torch.sqrt(n32.double()) * 1.01
        self.b = 1.01 * _U32 * (norms + float(norms.max()))
        self.slack = c * (self.na + float(self.na.max()))
        self.margin = None  # the guess of thr_i - min_j S_ij (None: redo every row densely)
        self.gaps = []  # thr_i - min_j S_ij of the last bands, to learn the guess from
        self.n_dense = 0  # rows done on their full row (diagnostic)
        self.buf = torch.empty(max(strip_rows, dense_rows) * n, dtype=torch.float32, device=Xt.device)
        self.threads = _StripThreads(Xt.device)

    def lower_bounds(self, rows):
        """S for the given rows (int64 tensor), with S_ii = inf (self)."""
        import torch

        S = self.buf[: rows.numel() * self.n].view(-1, self.n)
        torch.addmm(self.na32[None, :], self.a32[rows], self.a32.T, alpha=-2.0, out=S)
        S[torch.arange(rows.numel(), device=rows.device), rows] = math.inf
        return S

    def thresholds(self, rows, cand):
        """Exact distances of the rows' two candidates and the rows' thresholds on S (float32,
        rounded up): every j with S_ij above it is farther than both candidates."""
        m = rows.numel()
        dc = _exact_pairs(self.Xt, rows.repeat_interleave(2), cand.flatten(), self.chunk)
        dc = dc.to(rows.device).view(m, 2)
        ub = dc.amax(1) * (self.scale * (1.0 + 1e-12))  # computed float64 distances: rel. error < 1e-15
        T = (1.0 + self.delta) * (ub + self.b[rows]) ** 2 + self.slack[rows]
        na = self.na[rows]
        # V_ij <= T_i  <=>  S_ij <= T_i - |a_i|^2; rounded up into float32 so nothing is lost
        return dc, ((T - na) + 2.0**-20 * (T.abs() + na)).float()

    def dense(self, rows, cand=None, thr=None):
        """Rows done on their full row of S: the candidates (its two smallest entries, unless
        given with their thresholds), then every j with S_ij <= thr_i. Returns the pairs' rows and
        columns, and per row the candidates, their exact distances (None if given), the thresholds
        and min_j S_ij."""
        import torch

        self.n_dense += rows.numel()
        out = [[], [], [], [], [], []]
        for a in range(0, rows.numel(), self.dense_rows):
            r = rows[a : a + self.dense_rows]
            with self.threads.using(self.threads.best()):
                S = self.lower_bounds(r)
            if cand is None:
                c = S.topk(2, dim=1, largest=False, sorted=False).indices
                dc, t = self.thresholds(r, c)
            else:
                c, dc, t = cand[a : a + self.dense_rows], None, thr[a : a + self.dense_rows]
            flat = _mask_nonzero(S, t).to(r.device)
            for lst, v in zip(out, (r[flat // self.n], flat % self.n, c, dc, t, S.amin(1)), strict=True):
                lst.append(v)
        return [torch.cat(v) if v[0] is not None else None for v in out]

    def band(self, s: int, e: int):
        """Rows s..e-1: the rows and columns of the pairs to compute exactly (candidates left
        out), the candidates (e - s, 2) and their exact distances.

        With a guess g of the margin, each strip of S is scanned once, keeping the entries P with
        S_ij <= min_j S_ij + g. A row's two smallest entries in P are its two smallest of all
        (its candidates), and if its threshold t_i <= min_j S_ij + g, P holds every j with
        S_ij <= t_i. Rows with fewer than two entries in P (or more than ``_GUESS_MAX_ENTRIES``,
        dropped from P) or t_i above that are redone on their full row (``dense``). The guess
        decides only the cost, never the result.
        """
        import torch

        dev = self.a32.device
        rows = torch.arange(s, e, device=dev)
        if self.margin is None:
            pr, pc, cand, dc, thr, lo = self.dense(rows)
        else:
            pr, pc, cand, dc, thr, lo = self.guessed(rows)
        self.learn(thr - lo)
        keep = (pc != cand[pr - s, 0]) & (pc != cand[pr - s, 1])  # computed exactly already
        return pr[keep], pc[keep], cand, dc

    def guessed(self, rows):
        """``dense``'s results for a band of consecutive rows, from one scan with the guess."""
        import torch

        dev, s, m = rows.device, int(rows[0]), rows.numel()
        prs, pcs, pvs, los = [], [], [], []
        for a in range(0, m, self.strip_rows):
            with self.threads.using(self.threads.pick(), min(self.strip_rows, m - a)):
                S = self.lower_bounds(rows[a : a + self.strip_rows])
                lo = S.amin(1)
            flat = _mask_nonzero(S, lo + self.margin).to(dev)
            r = flat // self.n
            crowded = torch.bincount(r, minlength=lo.numel()) > _GUESS_MAX_ENTRIES
            if bool(crowded.any()):  # a guess far too wide for these rows: they are redone in full
                flat = flat[~crowded[r]]
                r = flat // self.n
            prs.append(r + a)
            pcs.append(flat % self.n)
            pvs.append(S.view(-1)[flat])
            los.append(lo)
        pr, pc, pv, lo = torch.cat(prs), torch.cat(pcs), torch.cat(pvs), torch.cat(los)
        guess = lo + self.margin  # the same float32 values the strips were compared with
        pos, few = _sparse_two_smallest(pr, pv, m)
        cand = pc[pos] if pc.numel() else torch.zeros((m, 2), dtype=torch.int64, device=dev)
        dc = torch.empty((m, 2), dtype=torch.float64, device=dev)
        thr = torch.empty(m, dtype=torch.float32, device=dev)
        ok = torch.nonzero(~few).flatten()
        dc[ok], thr[ok] = self.thresholds(rows[ok], cand[ok])
        over = ~few & (thr > guess)
        keep = ~(few | over)[pr] & (pv <= thr[pr])
        prs, pcs = [pr[keep] + s], [pc[keep]]
        fr = torch.nonzero(few).flatten()
        if fr.numel():
            qr, qc, cand[fr], dc[fr], thr[fr], _ = self.dense(rows[fr])
            prs.append(qr)
            pcs.append(qc)
        orr = torch.nonzero(over).flatten()
        if orr.numel():
            qr, qc, *_ = self.dense(rows[orr], cand[orr], thr[orr])
            prs.append(qr)
            pcs.append(qc)
        return torch.cat(prs), torch.cat(pcs), cand, dc, thr, lo

    def learn(self, gaps):
        """The guess: the ``_GUESS_QUANTILE`` quantile of thr_i - min_j S_ij over the last 4,096
        rows, so that about one row in twenty is redone densely and P stays a few entries per row
        (0.9 to 0.98 cost within 5% of each other at 20,000 x 768)."""
        import torch

        self.gaps = (self.gaps + [gaps.float()])[-max(1, 4096 // max(1, gaps.numel())) :]
        self.margin = float(torch.quantile(torch.cat(self.gaps), _GUESS_QUANTILE))


class _StripThreads:
    """Torch CPU threads for each strip of the pruned pass: all of them or one, whichever has the
    lower running mean seconds per row. Each is tried first; the slower one is tried again for one
    strip after 8 strips, then after 16, 32, 64 (at most) while it stays slower. The pass is
    hundreds of ~1 ms multi-threaded calls: on an idle machine all threads are ~1.4x faster, but
    when other processes hold the cores each call can wait a scheduler tick for them, and one
    thread is 2-10x faster (at 20,000 x 768 on 2 shared cores).
    """

    def __init__(self, dev):
        import torch

        total = torch.get_num_threads()
        self.options = [total, 1] if dev.type == "cpu" and total > 1 else []
        self.mean: dict[int, float] = {}  # running mean seconds per row of each option
        self.wait, self.since = 8, 0  # strips before the slower option is tried again, and since
        self.original = None  # the thread count to restore, once changed

    def pick(self):
        untried = [o for o in self.options if o not in self.mean]
        if untried or len(self.options) < 2:
            return (untried or self.options or [None])[0]
        fast, slow = sorted(self.options, key=self.mean.__getitem__)
        self.since += 1
        if self.since <= self.wait:
            return fast
        self.since, self.wait = 0, min(64, 2 * self.wait)
        return slow

    def best(self):
        return min(self.mean, key=self.mean.__getitem__) if self.mean else None

    @contextmanager
    def using(self, choice, rows: int = 0):
        """Run with ``choice`` threads (None: unchanged); with ``rows``, time it for the mean. The
        setting is changed only when the choice changes (a change can cost the BLAS a re-init)
        and stays until ``restore``."""
        import time

        import torch

        if choice is not None and choice != torch.get_num_threads():
            self.original = self.original or torch.get_num_threads()
            torch.set_num_threads(choice)
        t0 = time.perf_counter()
        yield
        if choice is not None and rows:
            t = (time.perf_counter() - t0) / rows
            self.mean[choice] = 0.7 * self.mean[choice] + 0.3 * t if choice in self.mean else t

    def restore(self):
        import torch

        if self.original:
            torch.set_num_threads(self.original)
            self.original = None


def _pruned_search(Xt, x32, n32, W, scale, block: int, memory_budget: int, info: dict):
    """Exact r1, r2, i1, i2 by the pruned search (see the section comment above): one pass over
    full-row strips of float32 lower bounds, with each row's exact candidates and threshold.

    Certificate, per row i: its two other rows c1, c2 of smallest lower bound give ub_i = max of
    their exact distances >= r2_i. Any j with d_ij <= ub_i has |x32_i - x32_j| <= scale ub_i + b_i
    (b_i: float32 rounding of the two rows), so its lower bound V_ij <= T_i = (1 + delta)(scale
    ub_i + b_i)^2 + c (|a_i|^2 + max |a|^2) (``_lower_bound_slack``). Every j with V_ij <= T_i is
    computed exactly, so the row's exact two nearest are among its computed pairs. (Any two other
    rows would give a valid ub_i; the smallest lower bounds give a tight one.)

    Cost: the (k + 1)-dim product and one compare pass per strip; strips of ``_STRIP_BYTES``
    stay in the cache between them. The candidates' exact distances are computed per band of
    rows (``_BAND_ROWS``), the other pairs' once at the end.
    """
    import torch

    n, d = Xt.shape
    dev = Xt.device
    chunk = _cache_rows(d, memory_budget, dev)
    strip = max(1, min(block, max(32, _STRIP_BYTES // (4 * n))))
    dense = max(1, min(block, memory_budget // (4 * n)))
    with _threads(dev):  # a loop of small float64 products: see _threads
        ps = _PrunedPass(Xt, x32, n32, W, scale, chunk, strip, dense)
    # the first band, done densely, only teaches the guess: a few strips long
    band = max(strip, min(_BAND_ROWS, n // 8))
    starts = [0] + list(range(min(band, 8 * strip), n, band))
    rows, cols, cands, dcs = [], [], [], []
    try:
        for s, e in zip(starts, starts[1:] + [n], strict=True):
            pr, pc, cand, dc = ps.band(s, e)
            rows.append(pr)
            cols.append(pc)
            cands.append(cand)
            dcs.append(dc)
    finally:
        ps.threads.restore()
    cand, dc = torch.cat(cands).cpu().numpy(), torch.cat(dcs).cpu().numpy()
    pr, pc = torch.cat(rows).cpu().numpy(), torch.cat(cols).cpu().numpy()
    pd = _pair_distances(Xt, pr, pc, cand, dc, chunk)
    rr = np.arange(n).repeat(2)
    _, d1, j1, d2, j2 = _best_two(np.r_[rr, pr], np.r_[cand.ravel(), pc], np.r_[dc.ravel(), pd])
    info.update(
        pruned=True,
        prune_width=int(W.shape[1]),
        prune_dense_rows=ps.n_dense,
        n_exact_pairs=int(rr.size + pr.size),
        pair_fraction=float((rr.size + pr.size) / (n * (n - 1))),
    )
    return d1, d2, j1, j2


def _pair_distances(Xt, pr, pc, cand, dc, chunk: int) -> np.ndarray:
    """Exact distances of the pairs (pr, pc) (numpy), each unordered pair computed once and those
    already computed as a candidate of pc (``cand``, ``dc``) reused: the distance is symmetric."""
    import torch

    n, dev = Xt.shape[0], Xt.device
    out = np.empty(pr.size, dtype=np.float64)
    rev = cand[pc] == pr[:, None]  # pr is one of pc's candidates
    known = rev.any(1)
    out[known] = dc[pc[known], rev[known].argmax(1)]
    u = ~known
    key, inv = np.unique(np.minimum(pr[u], pc[u]) * n + np.maximum(pr[u], pc[u]), return_inverse=True)
    d = _exact_pairs(Xt, torch.from_numpy(key // n).to(dev), torch.from_numpy(key % n).to(dev), chunk)
    out[u] = d.cpu().numpy()[inv]
    return out


def two_nearest(
    X,
    block_size: int | None = None,
    device=None,
    refine: bool = True,
    memory_budget: int | None = None,
    return_info: bool = False,
    prune: bool | None = None,
):
    """Exact first and second nearest-neighbour distances of every row (excluding itself).

    Parameters: X (N, D) float array (numpy or torch; float16 is computed in float32, ints in
    float64), N >= 3, finite. ``block_size``: rows per strip of the blocked search (default
    :func:`default_block_size` from ``memory_budget`` bytes; None: :func:`device_budget`, 256 MiB
    on the CPU, up to 4 GiB on a GPU). ``device``: torch device for the search ("cpu" default,
    "cuda"). ``refine=False`` skips the exact float64 recompute and returns
    the float32 candidate distances (approximate; may be mis-ranked for near-duplicates).

    Returns ``(r1, r2, i1, i2)``: float64 distances r1 <= r2 and int64 indices of the nearest and
    second-nearest rows; ties are broken by the smaller index. With ``return_info=True`` a fifth
    item, a dict: block_size, k (candidates per row), n_flagged (rows the float32 bound could not
    certify), n_rescreen_pairs (pairs recomputed exactly for them), device; and for the pruned
    search pruned, prune_width, prune_dense_rows (rows its one-scan guess did not cover, redone
    in full), n_exact_pairs (ordered pairs; each unordered pair is computed once), pair_fraction
    (of all N (N - 1)).

    ``prune``: None (default) estimates on a sample whether exact candidate pruning on the top
    principal directions pays (data with a fast-decaying spectrum) and uses it only then; True
    forces it, False forces the brute-force search. The result is the same exact answer either way.
    """
    a = _as_float_matrix(X)
    n = a.shape[0]
    if n < 3:
        raise DataError(f"X has {n} row(s); two nearest neighbours need at least 3 points")
    bad = count_nonfinite_rows(a)
    if bad:
        raise NonfiniteRows(bad, n)
    return two_nearest_unchecked(a, block_size, device, refine, memory_budget, return_info, prune)


def two_nearest_unchecked(a: np.ndarray, block_size, device, refine, memory_budget, return_info, prune=None):
    """:func:`two_nearest` on an already validated float numpy array (N >= 3, finite)."""
    import torch

    a = a.astype(np.float32) if a.dtype.itemsize < 4 else a
    n, d = a.shape
    dev = resolve_device("cpu" if device is None else str(device))
    # the rows on the device, their float32 copy, and per row the candidates' work arrays (~450 B)
    memory_budget = device_budget(dev, memory_budget, reserved=n * d * (a.itemsize + 4) + 450 * n)
    block = default_block_size(n, memory_budget) if block_size is None else int(block_size)
    if block < 1:
        raise InputError(f"block_size must be >= 1; got {block_size}")
    block = min(block, n)
    with warnings.catch_warnings():  # read-only rows (a memory map): never written, only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        Xt = torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    chunk = _cache_rows(d, memory_budget, dev)  # rows per float64 chunk in the passes over X
    with _threads(dev):
        shift, scale, x32, n32 = _prepare(Xt, chunk)
    k = min(K_CANDIDATES, n - 1)
    info = {"block_size": block, "k": k, "n_flagged": 0, "n_rescreen_pairs": 0, "device": str(dev)}
    info["pruned"] = False
    # pruning needs the exact refinement; on a GPU the brute-force GEMM is cheap, so auto means CPU
    auto = prune is None and dev.type == "cpu"
    chosen = _choose_pruning(x32, n32, bool(prune), info) if refine and (prune or auto) else None
    if chosen is not None:
        out = _pruned_search(Xt, x32, n32, chosen[0], scale, block, memory_budget, info)
        return out + (dict(info, refined=True),) if return_info else out
    best_v, best_i = _candidates(x32, n32, k, block)
    if not refine:
        v, p = best_v.sort(1)
        idx = best_i.gather(1, p)
        r = torch.sqrt(v[:, :2].double().clamp_min(0.0)) / scale
        r, idx = r.cpu().numpy(), idx.cpu().numpy()
        out = (r[:, 0].copy(), r[:, 1].copy(), idx[:, 0].copy(), idx[:, 1].copy())
        return out + (dict(info, refined=False),) if return_info else out
    r1, r2, i1, i2 = _refine(Xt, x32, n32, best_v, best_i, shift, scale, memory_budget, info)
    out = (r1.cpu().numpy(), r2.cpu().numpy(), i1.cpu().numpy(), i2.cpu().numpy())
    return out + (dict(info, refined=True),) if return_info else out
