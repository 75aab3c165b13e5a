"""Mergeable float64 sufficient statistics of a stream of rows.

:class:`Moments` accumulates, for rows x (shape (N, D), rows are token vectors):

- ``n``: number of rows; ``mean`` (D,); ``M2`` (D, D) the centred scatter sum_i (x_i - mean)(x_i - mean)^T
- ``sum_unit`` (D,) = sum of x/||x|| over rows with ||x|| > 0; ``sum_unit_sq`` (D,) = sum of (x_d/||x||)^2
  over the same rows; ``n_zero_norm`` rows with ||x|| = 0 (excluded from the unit sums)
- ``sum_sq_norm`` = sum ||x||^2; ``abs_sum`` (D,) = sum |x_d|; ``abs_max`` (D,) = max |x_d|;
  ``count_abs_ge`` (D,) = number of rows with |x_d| >= ``abs_threshold``

Each ``update`` converts its rows block by block (``block_rows``) to float64, once, into a reused
buffer; centres each block on its own mean and merges (n, mean, M2) with Chan et al.'s parallel formula,
so a large common offset (mean 1e4, std 1) costs no precision. The block scatter is a symmetric rank-k
update in float64 (BLAS syrk through numpy, which releases the GIL: scipy's dsyrk wrapper does not, and
would serialise the threads). The merge's rank-one corrections c delta delta^T are kept as rows sqrt(c)
delta and added together, R^T R through numpy's syrk, once 64 are waiting or when M2 is read, rather
than by a scipy BLAS dsyr each: scipy ships its own OpenBLAS, whose threads keep spinning after every
call beside numpy's, so that with multi-threaded BLAS (an in-memory ``update``) the blocks' products
would run at half speed (a scorer runs BLAS on one thread). syrk runs at ~80 % of the float64 GEMM rate:
it is most of the time of a pass, and by default the results match a float64 reference to 1e-10.
``product_dtype="float32"`` rounds each block, once centred in float64, to float32 and multiplies it in
float32 (the block products are still added together in float64): the product runs ~2.3x as fast, and
the covariance and IsoScore carry ~1e-8 relative error against float64 (1.3e-8 on a 200k x 384 float16
run, 2.1e-8 on 50k x 768 float32 rows; the isoscore package's own float32 computation is 6.3e-6 and
2.3e-6 away). The unit-vector and |x| statistics run over cache-sized sub-blocks of 256 rows of the same
float64 copy, sweeping x^2 then |x|, with the sums over rows as matrix-vector products. Memory is
O(block_rows * D + D^2) per thread, independent of N. ``merge`` is the same exact formula, so partial
accumulators from shards/processes combine into the same numbers (up to float64 rounding) as one pass.
Instances hold plain numpy attributes and pickle.

Threads: ``update(x, threads=T)`` and :func:`update_groups` (rows split among several accumulators,
the jackknife groups of a scorer) compute the blocks in T threads and merge them in row order, so
the numbers do not depend on T. A scorer queues every block of a pass on one :class:`OrderedWork`
(``update_groups(..., work=)``), so its threads go on to the next shard's blocks while this shard's
last ones are computed; the merges still follow the rows' order.

:class:`UnitSum` is the second-pass accumulator for the centred / standardised average cosine:
it sums unit vectors of (x - shift) / scale.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from geomscope.choices import PRODUCT_DTYPES
from geomscope.errors import DataError, InputError
from geomscope.metrics.validate import (
    OVERFLOW_MESSAGE,
    ZERO_VARIANCE_MESSAGE,
    NonfiniteRows,
    as_rows,
    count_nonfinite_rows,
    variance_is_zero,
)

BLOCK_ROWS = 4096  # rows per symmetric rank-k update (and Chan merge)
SUB_ROWS = 256  # rows per cache-sized pass of the unit-vector / |x| statistics
MAX_THREADED_M2_BYTES = 64 * 2**20  # larger D x D scatters: blocks one at a time (memory)
MAX_PENDING = 64  # merge corrections waiting to be added to M2 in one product (64 x D floats)
#: float32 products: blocks whose largest |value| is within 2^+-40 are rounded unscaled (their
#: products, ~2^80 at most times the block's rows, stay far inside float32's 3.4e38)
FLOAT32_SAFE_EXPONENT = 40


def _unit_stats(b: np.ndarray, sq: np.ndarray, work: np.ndarray):
    """(sum_unit, sum_unit_sq, n_zero) of rows ``b`` (float64) with squared norms ``sq``."""
    pos = sq > 0
    inv = np.zeros_like(sq)
    np.divide(1.0, np.sqrt(sq, where=pos, out=np.zeros_like(sq)), out=inv, where=pos)
    s = inv @ b
    np.square(b, out=work)
    s2 = (inv * inv) @ work
    return s, s2, int(sq.size - np.count_nonzero(pos))


def _float32_scatter(b: np.ndarray, b32: np.ndarray) -> np.ndarray:
    """b^T b of the centred float64 block ``b``, multiplied in float32 (``b32``: scratch of b's shape),
    as float64. float32's relative precision is the same at any scale inside its range, so a block
    whose largest |value| lies within 2^+-FLOAT32_SAFE_EXPONENT is rounded as it is; a block outside
    is first scaled by a power of two (exact) that brings that value to [1, 2), and the product is
    scaled back, so data at 1e-21 or 1e18 neither underflow nor overflow float32."""
    top = max(float(b.max()), -float(b.min()), 0.0)
    exponent = math.frexp(top)[1] - 1  # top in [2^exponent, 2^(exponent + 1)); 0 for top = 0
    if abs(exponent) <= FLOAT32_SAFE_EXPONENT:
        np.copyto(b32, b, casting="same_kind")
        return (b32.T @ b32).astype(np.float64)
    exponent = max(exponent, -1000)  # 2^-exponent must be a finite float64
    np.multiply(b, math.ldexp(1.0, -exponent), out=b32, casting="same_kind")
    return np.ldexp((b32.T @ b32).astype(np.float64), 2 * exponent)


def _check_block(sq: np.ndarray, a: np.ndarray, name: str = "X") -> None:
    """Cheap finiteness check of a block through its squared row norms; counts over all of ``a``."""
    if not np.isfinite(sq).all():
        bad = count_nonfinite_rows(a)
        if bad:
            raise NonfiniteRows(bad, a.shape[0], name)
        raise DataError(
            "values overflow float64 while accumulating; rescale the data before computing statistics"
        )


class _Work:
    """One thread's scratch space: the float64 block, its float32 copy for float32 products, and the
    extras' cache-sized sub-block."""

    def __init__(self, rows: int, d: int, extras: bool, float32_products: bool = False):
        self.buf = np.empty((rows, d))
        self.buf32 = np.empty((rows, d), np.float32) if float32_products else None
        self.sub = np.empty((min(SUB_ROWS, rows), d)) if extras else None
        self.gathered = None  # rows picked by an index array, in the input dtype

    def rows(self, src: np.ndarray, sel) -> np.ndarray:
        """``src[sel]``: a view for a slice; for an index array a copy into a reused buffer (a fresh
        array of a few MiB per block costs as much in page faults as the copy itself)."""
        if isinstance(sel, slice):
            return src[sel]
        g = self.gathered
        if g is None or g.dtype != src.dtype or g.shape[0] < len(sel):
            g = self.gathered = np.empty((max(len(sel), self.buf.shape[0]), src.shape[1]), src.dtype)
        return np.take(src, sel, axis=0, out=g[: len(sel)], mode="clip")  # indices are valid: no check


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` threads (kept: a scorer updates per block of a few MiB).
    Keyed by process id too: a forked child has none of its parent's threads."""
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="geomscope-moments")
        return _POOLS[key]


def map_in_order(fn, items: list, threads: int = 1, per_thread=None):
    """Yield ``fn(item, scratch)`` for every item, in order; with ``threads`` > 1 computed in a
    thread pool, at most ``threads`` items ahead of the one consumed (bounded memory: each result may
    hold a D x D array). ``per_thread()`` makes one thread's reusable scratch space (None: none);
    a running item holds one, so ``threads`` of them exist."""
    make = per_thread or (lambda: None)
    threads = max(1, min(int(threads), len(items)))
    if threads == 1:
        scratch = make()
        for item in items:
            yield fn(item, scratch)
        return
    spare: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(threads):
        spare.put(make())

    def one(item):
        scratch = spare.get()
        try:
            return fn(item, scratch)
        finally:
            spare.put(scratch)

    pool = _pool(threads)
    ahead: collections.deque = collections.deque()
    try:
        for item in items:
            ahead.append(pool.submit(one, item))
            if len(ahead) > threads:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        for fut in ahead:  # an error or an abandoned generator: drop what has not started
            fut.cancel()


class OrderedWork:
    """Work computed in the process's thread pool and merged on the calling thread in the order it was
    submitted -- across calls, so a stream of blocks keeps every thread busy.

    ``submit(compute, merge, scratch)``: ``merge(compute(s))`` for a reused scratch space ``s``
    (``scratch``: (key, factory, fits): a spare one of the same key that ``fits(s)`` is reused, and
    one that does not is dropped for a new one, so at most ``threads`` exist per key however the
    sizes vary along a pass).
    At most ``threads + 1`` items are in flight (bounded memory: each result may hold a D x D array,
    and each item its rows); submitting one more first merges the oldest. ``then(fn)`` runs ``fn()``
    once everything submitted before it is merged; ``drain()`` merges everything. An error from a
    computation is raised when its turn to merge comes; ``close()`` drops what has not started.

    Why across calls: with one pool per call (``map_in_order``) the scorer's threads would wait at
    every shard boundary for the slowest block of the shard before the next shard's blocks could
    start (a streaming IsoScore of 200k x 384 rows would keep each thread busy only about 86 % of
    the time).
    With ``threads`` = 1 everything runs at once on the calling thread."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self._queue: collections.deque = collections.deque()  # (future or None, merge or then-fn)
        self._in_flight = 0
        self._spare: dict = {}
        self._lock = threading.Lock()

    def submit(self, compute, merge, scratch) -> None:
        if self.threads == 1:
            self.drain()
            merge(self._run(compute, scratch))
            return
        while self._in_flight > self.threads:
            self._merge_oldest()
        self._queue.append((_pool(self.threads).submit(self._run, compute, scratch), merge))
        self._in_flight += 1

    def then(self, fn) -> None:
        if not self._queue:
            fn()
        else:
            self._queue.append((None, fn))

    def drain(self) -> None:
        while self._queue:
            self._merge_oldest()

    def close(self) -> None:
        """Drop the items that have not started and wait for the running ones (they may hold rows)."""
        for fut, _ in self._queue:
            if fut is not None and not fut.cancel():
                with contextlib.suppress(BaseException):
                    fut.result()
        self._queue.clear()
        self._in_flight = 0

    def __enter__(self) -> OrderedWork:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _merge_oldest(self) -> None:
        fut, merge = self._queue.popleft()
        if fut is None:
            merge()
            return
        self._in_flight -= 1
        merge(fut.result())
        while self._queue and self._queue[0][0] is None:  # what waited for this item
            self._queue.popleft()[1]()

    def _run(self, compute, scratch):
        key, make, fits = scratch
        with self._lock:
            spare = self._spare.setdefault(key, [])
            s = spare.pop() if spare else None
        if s is None or not fits(s):
            s = make()
        try:
            return compute(s)
        finally:
            with self._lock:
                spare.append(s)


def _block_jobs(pieces: list, a: np.ndarray, threads: int):
    """(jobs, scratch, threads) for the blocks of ``pieces``: one job (accumulator, rows, selection)
    per block of the accumulator's ``block_rows``; ``scratch`` = (key, factory, fits) of one thread's
    ``_Work`` (OrderedWork.submit); ``threads`` is 1 where each block's D x D scatter is too large to
    hold several."""
    jobs = []
    for acc, rows, sel in pieces:
        n = len(range(*sel.indices(rows.shape[0]))) if isinstance(sel, slice) else len(sel)
        step = min(acc.block_rows, n)
        for i in range(0, n, step):
            if isinstance(sel, slice):
                start = (sel.start or 0) + i
                jobs.append((acc, rows, slice(start, start + min(step, n - i))))
            else:
                jobs.append((acc, rows, sel[i : i + step]))
    d = a.shape[1]
    rows = max((min(acc.block_rows, a.shape[0]) for acc, _, _ in pieces), default=1)
    extras = any(acc.extras for acc, _, _ in pieces)
    float32_products = any(acc.product_dtype == "float32" for acc, _, _ in pieces)
    if 8 * d * d > MAX_THREADED_M2_BYTES:  # each block in flight holds a D x D scatter
        threads = 1
    key = (d, extras, float32_products)
    scratch = (key, lambda: _Work(rows, d, extras, float32_products), lambda w: w.buf.shape[0] >= rows)
    return jobs, scratch, threads


def _block_parts(pieces: list, a: np.ndarray, threads: int):
    """Yield (accumulator, Moments of one block) for every block of every piece, in order.

    ``pieces``: (accumulator, rows, selection): the rows ``rows[selection]`` (a slice or an index
    array) go to that accumulator, in blocks of its ``block_rows``. With ``threads`` > 1 the blocks
    are computed in a thread pool (numpy and BLAS release the GIL), each thread converting into its
    own reused buffer. The blocks, and so the numbers, are the same for any ``threads``.
    """
    jobs, (_, make, _), threads = _block_jobs(pieces, a, threads)
    if not jobs:
        return

    def one(job, work):
        acc, src, sel = job
        return acc, acc._block(work.rows(src, sel), work, a)

    yield from map_in_order(one, jobs, threads, make)


def update_groups(accs: list, x, groups, *, threads: int = 1, work: OrderedWork | None = None) -> None:
    """Add row i of ``x`` to ``accs[groups[i]]`` (the Moments of the jackknife groups of a scorer).

    Each group's rows are gathered from ``x`` block by block (in the threads, with ``threads`` > 1:
    see ``Moments.update``); each block's statistics are merged into its accumulator in row order,
    so the numbers equal one ``update`` per group. On DataError the accumulators are partly updated
    and must be discarded (the scorer stops).

    ``work``: an :class:`OrderedWork` to queue the blocks on (its ``threads`` replace ``threads``).
    They may still be computing when this returns; the work's later calls merge them, in order, so
    ``x`` must stay as it is until ``work.drain()``, and an error in a block comes from a later call.
    """
    if not accs:
        return
    a = accs[0]._rows(x)
    for acc in accs[1:]:
        acc._rows(a[:0])
    g = np.asarray(groups)
    if g.shape != (a.shape[0],):
        raise InputError(f"groups has shape {g.shape}; expected ({a.shape[0]},)")
    if a.shape[0] == 0:
        return
    if g.dtype.kind not in "iu" or g.min() < 0:
        raise InputError("groups must be non-negative integers")
    counts = np.bincount(g, minlength=len(accs))
    if counts.size > len(accs):
        raise InputError(f"group index {counts.size - 1} out of range for {len(accs)} accumulators")
    present = np.flatnonzero(counts)
    if present.size == 1:
        pieces = [(accs[present[0]], a, slice(None))]
    else:  # one stable sort: each group's row indices, in row order
        order = np.argsort(g, kind="stable")
        ends = np.cumsum(counts)
        pieces = [(accs[k], a, order[ends[k] - counts[k] : ends[k]]) for k in present]
    jobs, scratch, threads = _block_jobs(pieces, a, work.threads if work is not None else threads)
    if work is not None and threads == work.threads:
        _queue_blocks(work, jobs, scratch, a)  # merged later, in order, by work's next calls
        return
    if work is not None:  # D x D scatters too large to hold several: the queue is emptied first
        work.drain()
    with OrderedWork(threads) as own:
        _queue_blocks(own, jobs, scratch, a)
        own.drain()


def _queue_blocks(work: OrderedWork, jobs: list, scratch, a: np.ndarray) -> None:
    for acc, src, sel in jobs:

        def compute(w, acc=acc, src=src, sel=sel):
            return acc._block(w.rows(src, sel), w, a)

        work.submit(compute, acc._absorb, scratch)


class Moments:
    """Mergeable float64 sufficient statistics of rows (N, D). See the module docstring.

    ``Moments(dim=None, abs_threshold=6.0, extras=True, block_rows=4096, product_dtype="float64")``:
    ``dim`` is fixed by the first update when None. ``extras=False`` keeps only (n, mean, M2) (about
    10 % faster); the cosine / |x| attributes are then None. ``product_dtype="float32"`` multiplies
    each centred block in float32 (see the module docstring: the product ~2.3x as fast, ~1e-8
    relative error); it
    only changes how this accumulator's own updates are multiplied, so accumulators of either kind
    merge.
    """

    def __init__(
        self,
        dim: int | None = None,
        abs_threshold: float = 6.0,
        *,
        extras: bool = True,
        block_rows: int = BLOCK_ROWS,
        product_dtype: str = "float64",
    ):
        if dim is not None and int(dim) < 1:
            raise InputError(f"Moments dim must be >= 1; got {dim}")
        if block_rows < 1:
            raise InputError(f"block_rows must be >= 1; got {block_rows}")
        if product_dtype not in PRODUCT_DTYPES:
            raise InputError(
                f"product_dtype must be one of {', '.join(PRODUCT_DTYPES)}; got {product_dtype!r}"
            )
        self.dim = None if dim is None else int(dim)
        self.abs_threshold = float(abs_threshold)
        self.extras = bool(extras)
        self.block_rows = int(block_rows)
        self.product_dtype = product_dtype
        self.n = 0
        self.n_zero_norm = 0
        self.sum_sq_norm = 0.0
        self.mean = self._m2 = None
        self.sum_unit = self.sum_unit_sq = self.abs_sum = self.abs_max = self.count_abs_ge = None
        self._pending: list[np.ndarray] = []  # rows sqrt(c) delta of merges not yet added to _m2
        if self.dim is not None:
            self._alloc(self.dim)

    # -- state -------------------------------------------------------------------------------
    def _alloc(self, d: int) -> None:
        self.dim = d
        self.mean = np.zeros(d)
        self._m2 = np.zeros((d, d))
        if self.extras:
            self.sum_unit = np.zeros(d)
            self.sum_unit_sq = np.zeros(d)
            self.abs_sum = np.zeros(d)
            self.abs_max = np.zeros(d)
            self.count_abs_ge = np.zeros(d, dtype=np.int64)

    @property
    def M2(self) -> np.ndarray:
        """Centred scatter (D, D), symmetric (the merges' waiting corrections added first)."""
        if self._m2 is None:
            raise DataError("no rows accumulated yet; M2 is undefined")
        self._add_pending()
        return self._m2

    def _add_pending(self) -> None:
        """Add the waiting merge corrections: M2 += R^T R for their rows R (numpy's syrk, which runs
        on numpy's BLAS threads, the ones the blocks' products use)."""
        if self._pending:
            r = np.array(self._pending)
            self._m2 += r.T @ r
            self._pending = []

    # -- accumulation ------------------------------------------------------------------------
    def update(self, x, *, threads: int = 1) -> Moments:
        """Add rows ``x`` (N, D): numpy array of any float dtype or a torch tensor. Returns self.

        ``threads`` > 1 computes the blocks' statistics in that many threads (BLAS should then run
        single-threaded, as ``geomscope score`` arranges); the numbers do not depend on it.
        Raises DataError (state unchanged) if a row holds NaN/Inf or the dimension differs.
        """
        a = self._rows(x)
        if a.shape[0] == 0:
            return self
        part = None
        for _, blk in _block_parts([(self, a, slice(None))], a, threads):
            part = blk if part is None else part.merge(blk)
        return self._absorb(part)

    def _rows(self, x) -> np.ndarray:
        """``x`` as rows of this accumulator's dimension (fixing it on the first update)."""
        a = as_rows(x)
        d = a.shape[1]
        if self.dim is None:
            if d < 1:
                raise DataError("rows have 0 columns")
        elif d != self.dim:
            raise DataError(f"rows have {d} columns but this accumulator holds dim {self.dim}")
        return a

    def _block(self, xb: np.ndarray, work: _Work, a: np.ndarray) -> Moments:
        """The statistics of one block of rows ``xb`` as a new Moments (``a``: the whole input, for the
        count of bad rows in an error). The rows are converted to float64 once, into ``work.buf``; the
        extras read them there, then they are centred on the block's own mean in place and multiplied
        (BLAS syrk) in float64, or rounded to float32 and multiplied in float32 (``product_dtype``)."""
        m, d = xb.shape
        b = work.buf[:m]
        np.copyto(b, xb)
        blk = Moments(
            None,
            self.abs_threshold,
            extras=self.extras,
            block_rows=self.block_rows,
            product_dtype=self.product_dtype,
        )
        blk.dim, blk.n = d, m
        # NaN/Inf anywhere in the block shows up in its mean
        blk.mean = np.add.reduce(b, axis=0) / m
        _check_block(blk.mean, a)
        if self.extras:
            blk._extras_from_block(b, work.sub, a)
        b -= blk.mean
        # numpy runs b.T @ b as a BLAS syrk (one triangle, mirrored) and releases the GIL meanwhile;
        # scipy.linalg.blas.dsyrk holds the GIL, which serialises the blocks of all threads (two
        # threads would take twice one thread's time for twice the blocks; numpy's product the same)
        if self.product_dtype == "float32":  # centred first, in float64: an offset costs nothing
            blk._m2 = _float32_scatter(b, work.buf32[:m])
        else:
            blk._m2 = b.T @ b
        return blk

    def _extras_from_block(self, b: np.ndarray, work: np.ndarray, a: np.ndarray) -> None:
        """Unit-vector and |x| statistics of the float64 rows ``b``, in cache-sized sub-blocks of
        ``len(work)`` rows (``work``: scratch space of that many rows). Each sub-block is swept a few
        times: x^2 (its row sums are the squared norms, its weighted column sums sum_unit_sq), then |x|;
        the sums over rows are matrix-vector products (faster than numpy's reductions over axis 0)."""
        d = self.dim
        thr = self.abs_threshold
        ones = np.ones(max(d, work.shape[0]))
        su, su2, asum = np.zeros(d), np.zeros(d), np.zeros(d)
        amax = np.zeros(d)
        cnt = np.zeros(d, dtype=np.int64)
        nz, ssq = 0, 0.0
        for j in range(0, b.shape[0], work.shape[0]):
            bs = b[j : j + work.shape[0]]
            w = work[: bs.shape[0]]
            x2 = np.square(bs, out=w)
            sq = x2 @ ones[:d]
            _check_block(sq, a)
            ssq += float(sq.sum())
            pos = sq > 0
            inv = np.zeros_like(sq)
            np.divide(1.0, np.sqrt(sq, where=pos, out=np.zeros_like(sq)), out=inv, where=pos)
            su += inv @ bs
            su2 += (inv * inv) @ x2
            nz += int(sq.size - np.count_nonzero(pos))
            ab = np.abs(bs, out=w)  # |x| of the float64 copy: exact
            asum += ones[: bs.shape[0]] @ ab
            bmax = ab.max(axis=0)
            np.maximum(amax, bmax, out=amax)
            cols = np.flatnonzero(bmax >= thr)
            if cols.size:
                cnt[cols] += np.count_nonzero(ab[:, cols] >= thr, axis=0)
        self.sum_sq_norm, self.n_zero_norm = ssq, nz
        self.sum_unit, self.sum_unit_sq = su, su2
        self.abs_sum, self.abs_max, self.count_abs_ge = asum, amax, cnt

    def _absorb(self, other: Moments) -> Moments:
        """``merge(other)`` for a temporary ``other``: an empty self takes its arrays without a copy."""
        if self.n == 0 and other.n > 0 and other.extras == self.extras:
            if other.abs_threshold != self.abs_threshold or self.dim not in (None, other.dim):
                return self.merge(other)  # raises the usual error
            self.dim, self.n, self.mean = other.dim, other.n, other.mean
            self._m2, self._pending = other._m2, other._pending
            if self.extras:
                self.n_zero_norm, self.sum_sq_norm = other.n_zero_norm, other.sum_sq_norm
                for k in ("sum_unit", "sum_unit_sq", "abs_sum", "abs_max", "count_abs_ge"):
                    setattr(self, k, getattr(other, k))
            return self
        return self.merge(other)

    def merge(self, other: Moments) -> Moments:
        """Add another accumulator's rows (exact parallel formula). Returns self."""
        if not isinstance(other, Moments):
            raise InputError(f"can only merge Moments, got {type(other).__name__}")
        if other.n == 0:
            if self.dim is None and other.dim is not None:
                self._alloc(other.dim)
            return self
        if self.dim is not None and other.dim != self.dim:
            raise DataError(f"cannot merge Moments of dim {other.dim} into dim {self.dim}")
        if other.extras != self.extras or other.abs_threshold != self.abs_threshold:
            raise InputError("cannot merge Moments with different extras/abs_threshold settings")
        if self.n == 0:
            self._alloc(other.dim)
            self._copy_from(other)
            return self
        na, nb = self.n, other.n
        n = na + nb
        delta = other.mean - self.mean
        self.mean = self.mean + delta * (nb / n)
        self._m2 += other._m2
        # Chan's rank-one correction (na nb / n) delta delta^T, kept as a row and added with the others
        self._pending = self._pending + other._pending + [delta * np.sqrt(na * nb / n)]
        if len(self._pending) >= MAX_PENDING:
            self._add_pending()
        self.n = n
        if self.extras:
            self.n_zero_norm += other.n_zero_norm
            self.sum_sq_norm += other.sum_sq_norm
            self.sum_unit += other.sum_unit
            self.sum_unit_sq += other.sum_unit_sq
            self.abs_sum += other.abs_sum
            np.maximum(self.abs_max, other.abs_max, out=self.abs_max)
            self.count_abs_ge += other.count_abs_ge
        return self

    def _copy_from(self, other: Moments) -> None:
        self.n = other.n
        self.mean = other.mean.copy()
        self._m2 = other._m2.copy()
        self._pending = list(other._pending)  # rows are never changed in place
        if self.extras:
            self.n_zero_norm = other.n_zero_norm
            self.sum_sq_norm = other.sum_sq_norm
            for k in ("sum_unit", "sum_unit_sq", "abs_sum", "abs_max", "count_abs_ge"):
                setattr(self, k, getattr(other, k).copy())

    @classmethod
    def from_rows(cls, x, **kwargs) -> Moments:
        """Moments of the rows ``x`` in one call."""
        return cls(**kwargs).update(x)

    # -- results -----------------------------------------------------------------------------
    def _need(self, ddof: int) -> None:
        if self.n <= ddof:
            raise DataError(f"{self.n} row(s) accumulated; at least {ddof + 1} are needed")

    def covariance(self, ddof: int = 1) -> np.ndarray:
        """Sample covariance M2 / (n - ddof), a new (D, D) float64 array."""
        self._need(ddof)
        return self.M2 / (self.n - ddof)

    def variance(self, ddof: int = 1) -> np.ndarray:
        """Per-dimension variance diag(M2) / (n - ddof)."""
        self._need(ddof)
        return np.diagonal(self.M2) / (self.n - ddof)

    def total_variance(self, ddof: int = 1) -> float:
        """tr(C) = sum of per-dimension variances."""
        return float(self.variance(ddof).sum())

    def mean_abs(self) -> np.ndarray:
        """Per-dimension mean |x_d|."""
        self._need_extras("mean_abs")
        self._need(0)
        return self.abs_sum / self.n

    def frac_abs_ge(self) -> np.ndarray:
        """Per-dimension fraction of rows with |x_d| >= abs_threshold."""
        self._need_extras("frac_abs_ge")
        self._need(0)
        return self.count_abs_ge / self.n

    def n_unit(self) -> int:
        """Rows that entered the unit sums (||x|| > 0)."""
        return self.n - self.n_zero_norm

    def check_variance(self, name: str = "X", what: str = "IsoScore") -> None:
        """Raise DataError unless n >= 2, dim >= 2 and the total variance is non-zero."""
        self._need(1)
        if self.dim < 2:
            raise DataError(f"{name} has {self.dim} column(s); at least 2 dimensions are needed")
        total = self.total_variance()
        if not np.isfinite(total) or not np.isfinite(self.M2).all():
            raise DataError(OVERFLOW_MESSAGE.format(name=name))
        if variance_is_zero(total, self.mean, self.dim):
            raise DataError(ZERO_VARIANCE_MESSAGE.format(name=name, what=what))

    def _need_extras(self, what: str) -> None:
        if not self.extras:
            raise InputError(f"{what} needs Moments(extras=True)")

    def __repr__(self) -> str:
        return f"Moments(n={self.n}, dim={self.dim}, extras={self.extras})"


class UnitSum:
    """Sum of unit vectors of (x - shift) / scale, for the centred / standardised average cosine.

    ``UnitSum(shift, scale=None)``: shift (D,) (usually the mean from a first Moments pass), scale
    (D,) (usually the standard deviation, from ``validate.cosine_shift_scale``); a dimension of
    scale inf or 0 is constant and adds exactly 0 ((x - shift) / inf; what the shift leaves of it is
    rounding). Rows whose transformed norm is exactly 0 are counted in ``n_zero_norm`` and
    excluded. Attributes: n, sum_unit, sum_unit_sq, n_zero_norm.
    """

    def __init__(self, shift, scale=None, *, block_rows: int = BLOCK_ROWS):
        self.shift = np.asarray(shift, dtype=np.float64).ravel().copy()
        d = self.shift.size
        if scale is None:
            self.scale = None
        else:
            s = np.asarray(scale, dtype=np.float64).ravel().copy()
            if s.size != d:
                raise InputError(f"scale has {s.size} entries but shift has {d}")
            if np.isnan(s).any() or (s < 0).any():
                raise InputError("scale must be non-negative (inf or 0: a constant dimension)")
            s[s == 0] = np.inf
            self.scale = s
        if not np.isfinite(self.shift).all():
            raise InputError("shift must be finite")
        self.dim = d
        self.block_rows = int(block_rows)
        self.n = 0
        self.n_zero_norm = 0
        self.sum_unit = np.zeros(d)
        self.sum_unit_sq = np.zeros(d)

    def update(self, x) -> UnitSum:
        a = as_rows(x)
        n, d = a.shape
        if d != self.dim:
            raise DataError(f"rows have {d} columns but this accumulator holds dim {self.dim}")
        if n == 0:
            return self
        rows = min(self.block_rows, n)
        buf, work = np.empty((rows, d)), np.empty((rows, d))
        s = np.zeros(d)
        s2 = np.zeros(d)
        nz = 0
        for i in range(0, n, rows):
            b = buf[: min(rows, n - i)]
            np.subtract(a[i : i + rows], self.shift, out=b)
            if self.scale is not None:
                b /= self.scale
            sq = np.einsum("ij,ij->i", b, b)
            _check_block(sq, a)
            u, u2, z = _unit_stats(b, sq, work[: b.shape[0]])
            s += u
            s2 += u2
            nz += z
        self.n += n
        self.n_zero_norm += nz
        self.sum_unit += s
        self.sum_unit_sq += s2
        return self

    def merge(self, other: UnitSum) -> UnitSum:
        if not isinstance(other, UnitSum) or other.dim != self.dim:
            raise InputError("can only merge a UnitSum of the same dimension")
        if not (
            np.array_equal(self.shift, other.shift)
            and (self.scale is None) == (other.scale is None)
            and (self.scale is None or np.array_equal(self.scale, other.scale))
        ):
            raise InputError("cannot merge UnitSums with different shift/scale")
        self.n += other.n
        self.n_zero_norm += other.n_zero_norm
        self.sum_unit += other.sum_unit
        self.sum_unit_sq += other.sum_unit_sq
        return self

    def n_unit(self) -> int:
        return self.n - self.n_zero_norm
