"""The work one task does: stream its rows once and return mergeable partial accumulators.

Row filter, per layer and in this order (each reason counted): rows with NaN/Inf in that layer
("nonfinite"), special tokens when excluded ("special"), rows outside the ``--max-rows`` sample
("not_sampled"); the rest are the rows the metrics see.

Pass kinds (picklable :class:`PassSpec`):

- ``"select"``: metadata only; per layer the bottom-k hashes of the eligible rows (--max-rows).
- ``"moments"``: per layer one :class:`~geomscope.metrics.Moments` per jackknife group, the
  intrinsic-dimension reservoir and the row counts.
- ``"sample"``: per layer the seeded row sample alone (the similarity between runs).
- ``"count"``: metadata only; the occurrences of every token id (the frequency bins of strata.py).
- ``"unit"``: per layer and cosine variant, the unit-vector sums of every jackknife replicate r (rows
  of every group but r, shifted/scaled by replicate r's mean/std) plus all rows
  (:class:`~geomscope.score.multiunit.MultiUnitSum`); and those of the rows after all-but-the-top
  and whitening, with replicate r's mean and eigenvectors (score/postprocess.py).

Results of tasks are merged by the parent in task order, so one worker and many give the same
numbers (to float64 rounding of the merge tree, which is the same tree either way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from geomscope.errors import DataError
from geomscope.metrics.moments import OrderedWork, update_groups
from geomscope.metrics.validate import NonfiniteRows
from geomscope.score.sources import iter_blocks, iter_meta
from geomscope.store.blocks import Task
from geomscope.store.integrity import check_task_file, checked_reads
from geomscope.store.sample import STREAM_ID_SAMPLE, STREAM_MAX_ROWS, BottomK, Reservoir, row_hash

COUNT_KEYS = ("seen", "nonfinite", "special", "not_sampled", "used")


@dataclass
class PassSpec:
    kind: str  # "select" | "count" | "moments" | "sample" | "unit"
    layers: list[str]
    n_groups: int = 1
    exclude_special: bool = False
    seed: int = 0
    max_rows: int | None = None  # "select": k
    thresholds: dict[str, int] | None = None  # max-rows hash threshold per layer
    extras: bool = True
    abs_threshold: float = 6.0
    product_dtype: str = "float64"  # "moments": the dtype of the covariance's block products
    id_k: int = 0
    unit: dict | None = None  # layer -> variant -> (shifts (R, D), scales (R, D) | None)
    post: dict | None = None  # layer -> family -> its spec (score/postprocess.pass_spec)
    abtt_k: tuple[int, ...] = ()  # "unit" with post: the all-but-the-top k
    massive_k: int = 0  # "moments": the largest |x| entries kept per layer (0: none)
    strata: dict | None = None  # "moments": score/strata.py's bins (frequency, position), or None
    context: dict | None = None  # "moments": score/contextuality.py's {types, per_type, docs, pool}
    checksum: bool = False
    block_rows: int | None = None
    threads: int = 1  # threads per task for the block statistics (engine.py picks: cores / workers)


@dataclass
class LayerPart:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))
    groups: list | None = None  # Moments per jackknife group
    reservoir: Reservoir | None = None
    select: BottomK | None = None
    unit: dict | None = None  # variant -> MultiUnitSum (R replicates)
    post: dict | None = None  # family -> RemovedTopUnitSums / WhitenedUnitSums (R replicates)
    massive: object | None = None  # metrics.massive.TopAbs: the largest |x| entries, the |x| histogram
    massive_missing: bool = False  # a --keep sample shard kept none: the layer has no such entries
    strata: dict | None = None  # kind -> B x G Moments (bin-major): the moments of each bin's rows
    token_counts: np.ndarray | None = None  # "count": occurrences of each token id
    special_counts: np.ndarray | None = None  # "count": occurrences of each token id as a special token
    context: object | None = None  # metrics.contextuality.Contexts of the layer's ordinary rows

    def merge(self, other: LayerPart) -> LayerPart:
        for k in COUNT_KEYS:
            self.counts[k] += other.counts[k]
        if other.groups is not None:
            if self.groups is None:
                self.groups = other.groups
            else:
                for a, b in zip(self.groups, other.groups, strict=True):
                    a.merge(b)
        if other.reservoir is not None:
            self.reservoir = (
                other.reservoir if self.reservoir is None else self.reservoir.merge(other.reservoir)
            )
        self.massive_missing |= other.massive_missing
        if other.token_counts is not None:
            self.token_counts = _added(self.token_counts, other.token_counts)
        if other.special_counts is not None:
            self.special_counts = _added(self.special_counts, other.special_counts)
        if other.context is not None:
            self.context = other.context if self.context is None else self.context.merge(other.context)
        if other.strata is not None:
            if self.strata is None:
                self.strata = other.strata
            else:
                for kind, accs in other.strata.items():
                    for a, b in zip(self.strata[kind], accs, strict=True):
                        a.merge(b)
        if other.massive is not None:
            self.massive = other.massive if self.massive is None else self.massive.merge(other.massive)
        if other.select is not None:
            self.select = other.select if self.select is None else self.select.merge(other.select)
        for attr in ("unit", "post"):
            theirs = getattr(other, attr)
            if theirs is not None:
                if getattr(self, attr) is None:
                    setattr(self, attr, theirs)
                else:
                    for v, sums in theirs.items():
                        getattr(self, attr)[v].merge(sums)
        return self


def _added(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    """Two count vectors added, the shorter padded with zeros."""
    if a is None:
        return b
    if a.size < b.size:
        a, b = b, a
    a = a.copy()
    a[: b.size] += b
    return a


def merge_parts(parts: list[dict[str, LayerPart]]) -> dict[str, LayerPart]:
    """Merge task results (dicts layer -> LayerPart) in the given order."""
    out: dict[str, LayerPart] = {}
    for p in parts:
        for name, lp in p.items():
            out[name] = lp if name not in out else out[name].merge(lp)
    return out


def _filter(block, name: str, spec: PassSpec, counts: dict | None) -> np.ndarray:
    """Boolean mask of the rows of ``block`` that layer ``name`` uses; counts the dropped ones."""
    bad = np.asarray(block.nonfinite.get(name, np.zeros(len(block.keys), bool)), bool)
    keep = ~bad
    if counts is not None:
        counts["seen"] += len(keep)
        counts["nonfinite"] += int(bad.sum())
    if spec.exclude_special:
        sp = keep & block.special
        if counts is not None:
            counts["special"] += int(sp.sum())
        keep &= ~block.special
    if spec.thresholds and spec.thresholds.get(name) is not None:
        sel = row_hash(block.keys, spec.seed, STREAM_MAX_ROWS) <= np.uint64(spec.thresholds[name])
        if counts is not None:
            counts["not_sampled"] += int((keep & ~sel).sum())
        keep &= sel
    if counts is not None:
        counts["used"] += int(keep.sum())
    return keep


def _new_part(spec: PassSpec, dim: int | None) -> LayerPart:
    from geomscope.metrics import Moments

    lp = LayerPart()
    if spec.kind == "moments":
        lp.groups = [
            Moments(dim, spec.abs_threshold, extras=spec.extras, product_dtype=spec.product_dtype)
            for _ in range(spec.n_groups)
        ]
        if spec.id_k > 0:
            lp.reservoir = Reservoir(spec.id_k)
        if spec.massive_k > 0:
            from geomscope.metrics.massive import TopAbs

            lp.massive = TopAbs(spec.massive_k)
        if spec.context:
            from geomscope.metrics.contextuality import Contexts

            c = spec.context
            lp.context = Contexts(c["types"], c["per_type"], c["docs"], c["pool"], spec.n_groups)
        if spec.strata:
            lp.strata = {
                kind: [
                    Moments(dim, spec.abs_threshold, extras=True, product_dtype=spec.product_dtype)
                    for _ in range(bins * spec.n_groups)
                ]
                for kind, bins in _strata_bins(spec.strata).items()
            }
    elif spec.kind == "select":
        lp.select = BottomK(spec.max_rows)
    elif spec.kind == "sample":
        lp.reservoir = Reservoir(spec.id_k)
    return lp


def _strata_bins(strata: dict) -> dict[str, int]:
    """The number of bins of each stratification a pass keeps (score/strata.py's spec)."""
    out = {}
    if strata.get("frequency") is not None:
        out["frequency"] = int(strata["frequency_bins"])
    if strata.get("position") is not None:
        out["position"] = len(strata["position"]) + 1
    return out


def _unit_part(spec: PassSpec, name: str) -> dict:
    from geomscope.score.multiunit import MultiUnitSum

    return {
        v: MultiUnitSum(shifts, scales) for v, (shifts, scales) in (spec.unit or {}).get(name, {}).items()
    }


def _post_part(spec: PassSpec, name: str) -> dict | None:
    """The all-but-the-top and whitened unit sums of a layer's spec (score/postprocess.pass_spec:
    family -> (shifts, bases or maps))."""
    from geomscope.metrics.postprocess import RemovedTopUnitSums, WhitenedUnitSums

    wanted = (spec.post or {}).get(name)
    if not wanted:
        return None
    make = {"abtt": lambda s, b: RemovedTopUnitSums(s, b, spec.abtt_k), "whitened": WhitenedUnitSums}
    return {family: make[family](*pieces) for family, pieces in wanted.items()}


def run_task(task: Task, spec: PassSpec, progress=None, into: dict | None = None) -> dict[str, LayerPart]:
    """Process one task; ``progress(rows)`` is called after each block when given. A shard's size is
    checked first, its checksum (``spec.checksum``) while it is read. ``into``: accumulate into these
    parts (in place: one set of accumulators when tasks run in this process) instead of new ones."""
    with checked_reads(task, checksum=spec.checksum) as task:
        return _run(task, spec, progress, {} if into is None else into)


@contextmanager
def _checksum_first(finishes: list):
    """A pass that fails is first held to the checksums of the shards it began (``finishes``: their
    check_task_file ``finish()``es, read when it fails): a changed file is said as such -- its
    damage, not what the damage made the reading or the statistics find (a flipped bit read as an
    Inf, a chunk index pointing nowhere)."""
    try:
        yield
    except Exception:
        for finish in list(finishes):
            finish()  # raises the checksum's DataError when the bytes differ
        raise


def run_tasks(tasks: list[Task], spec: PassSpec, progress=None, into: dict | None = None) -> dict:
    """``run_task`` for every task in order, into one set of accumulators (``into``, or new ones).

    With ``spec.threads`` > 1 one reader thread reads the next block while this one is computed, across
    task boundaries: a shard of a few tens of MB is a single block, so a read-ahead inside each task
    would overlap nothing, and every shard's read, about a seventh of a pass, would wait. The blocks,
    the order in which they are added and so the numbers are those of ``run_task`` one task after
    another; a bad shard's error comes after the blocks read before it, as there."""
    parts = {} if into is None else into
    streamed = (
        spec.threads > 1 and spec.kind not in ("select", "count") and not any(t.accumulated for t in tasks)
    )
    if not streamed or len(tasks) <= 1:
        for t in tasks:
            run_task(t, spec, progress, into=parts)
        return parts
    _new_parts(parts, spec)

    started = []  # the checksums of the tasks begun
    merging = _Merging()

    def stream():
        for planned in tasks:
            finish, t = check_task_file(planned, checksum=spec.checksum)
            started.append(finish)
            for block in iter_blocks(t, spec.layers, spec.n_groups, spec.block_rows):
                yield t, block
            yield t, _TaskDone(finish)  # the task's last block is in: its checksum is due

    with (
        _checksum_first(started),  # (the list fills as tasks begin)
        _unflagged_rows_named(merging),
        contextlib.closing(_read_ahead(stream())) as items,
    ):
        _merge_blocks(items, spec, parts, progress, merging)
    return parts


@dataclass
class _TaskDone:
    finish: Callable[[], None]  # check_task_file's finish()


def _new_parts(parts: dict, spec: PassSpec) -> None:
    for name in spec.layers:
        if name not in parts:
            parts[name] = _new_part(spec, None)
            if spec.kind == "unit":
                parts[name].unit = _unit_part(spec, name)
                parts[name].post = _post_part(spec, name)


def _run(task: Task, spec: PassSpec, progress, parts: dict) -> dict[str, LayerPart]:
    _new_parts(parts, spec)
    if task.accumulated:
        return _run_accumulated(task, spec, progress, parts)
    if spec.kind == "count":  # every row's token id, whatever the layers' filters
        for block in iter_meta(task, spec.layers[:1], spec.n_groups):
            if block.token_id is not None and block.token_id.size:
                lp = parts[spec.layers[0]]
                tokens = np.asarray(block.token_id, np.int64)
                lp.token_counts = _added(lp.token_counts, np.bincount(tokens))
                special = tokens[np.asarray(block.special, bool)]
                lp.special_counts = _added(lp.special_counts, np.bincount(special, minlength=1))
            if progress:
                progress(len(block.keys))
        return parts
    if spec.kind == "select":
        flt = PassSpec("select", [], exclude_special=spec.exclude_special)
        for block in iter_meta(task, spec.layers, spec.n_groups):
            for name in spec.layers:
                lp = parts[name]
                keep = _filter(block, name, flt, lp.counts)
                lp.select.add(row_hash(block.keys[keep], spec.seed, STREAM_MAX_ROWS))
            if progress:
                progress(len(block.keys))
        return parts
    blocks = iter_blocks(task, spec.layers, spec.n_groups, spec.block_rows)
    merging = _Merging()
    with _unflagged_rows_named(merging):
        read = contextlib.closing(_read_ahead(blocks)) if spec.threads > 1 else contextlib.nullcontext(blocks)
        with read as blocks_read:
            _merge_blocks(((task, block) for block in blocks_read), spec, parts, progress, merging)
    return parts


def _merge_blocks(items, spec: PassSpec, parts: dict, progress, merging: _Merging) -> None:
    """Add each ``(task, block)`` of ``items`` to ``parts`` in order (:func:`_add_block`, on
    ``spec.threads`` ordered workers), calling ``progress(rows)`` after each block; a
    ``(task, _TaskDone)`` item runs its ``finish()`` once the blocks before it are merged, so a
    shard's checksum error comes in row order."""
    with OrderedWork(spec.threads) as work:
        for task, item in items:
            if isinstance(item, _TaskDone):
                work.then(item.finish)
                continue
            _add_block(item, spec, parts, work, task, merging)
            if progress:
                progress(len(item.keys))
        work.drain()


@dataclass
class _Merging:
    """The task and layer whose rows ``work`` is merging now, for an error raised by their statistics
    (which surfaces when the block's turn to merge comes, not when it is queued)."""

    task: Task | None = None
    layer: str = ""

    def mark(self, work: OrderedWork, task: Task, layer: str) -> None:
        """The rows queued on ``work`` from now on are ``task``'s ``layer``'s (in merge order)."""
        work.then(lambda: self._set(task, layer))

    def _set(self, task: Task, layer: str) -> None:
        self.task, self.layer = task, layer


@contextmanager
def _unflagged_rows_named(merging: _Merging):
    """A shard's non-finite flags mark every row whose stored values hold a NaN or an Inf (the store
    checks what it writes), and the scorer drops the flagged rows. Rows that the statistics still find
    NaN or Inf mean the file changed after extract wrote it: said as a corrupt shard, with its layer
    (the statistics alone know neither)."""
    try:
        yield
    except NonfiniteRows as e:
        task = merging.task
        if task is None or task.kind != "shard":
            raise
        raise DataError(
            f"shard {task.path} is corrupt ({e.bad} of {e.n} rows of layer {merging.layer} hold NaN or "
            "Inf that its non-finite flags do not mark); rerun the same `geomscope extract` command to "
            "redo it"
        ) from e


def _add_block(block, spec: PassSpec, parts: dict, work: OrderedWork, task: Task, merging: _Merging) -> None:
    """One block of rows into the "moments" or "unit" accumulators of every layer: its statistics are
    queued on ``work`` (merged in order by its later calls, so the threads never wait for a block's
    last piece before the next block's first; ``work.drain()`` completes them). ``merging`` is told
    whose rows each queued piece holds (``task``'s layer)."""
    for name in spec.layers:
        merging.mark(work, task, name)
        x = block.layers[name]
        lp = parts[name]
        keep = _filter(block, name, spec, lp.counts if spec.kind in ("moments", "sample") else None)
        if not keep.any():
            continue
        whole = bool(keep.all())  # the common case: no copy
        xs = x if whole else x[keep]
        gs = block.group if whole else block.group[keep]
        keys = block.keys if whole else block.keys[keep]
        if lp.reservoir is not None:
            lp.reservoir.add(row_hash(keys, spec.seed, STREAM_ID_SAMPLE), xs, {"group": gs})
        if spec.kind == "moments":
            update_groups(lp.groups, xs, gs, work=work)
            if lp.massive is not None:
                _update_massive(lp.massive, xs, keys, block, keep, whole, work)
            tokens = block.token_id if block.token_id is None or whole else block.token_id[keep]
            if lp.strata is not None:
                _update_strata(lp.strata, spec, xs, gs, keys, tokens, work)
            if lp.context is not None:
                special = block.special if whole else block.special[keep]
                _update_context(lp.context, spec.seed, xs, keys, tokens, special, gs)
        elif spec.kind == "unit":
            if lp.unit:
                _update_units(lp.unit, xs, gs, work)
            if lp.post:
                _update_post(lp.post, xs, gs, work)


def _read_ahead(blocks):
    """Yield the items of the iterator ``blocks``, reading the next one in a thread meanwhile (the file
    reads overlap the block statistics: one more block of rows in memory). Errors come out in order;
    leaving the loop early stops the reader and closes ``blocks``. Callers close the generator
    themselves (``contextlib.closing``): its ``finally`` joins the reader thread, and a join run by
    the garbage collector in a thread that holds h5py's lock would wait on a reader that needs it."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for item in blocks:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as e:  # handed to the consumer
            put((None, e))
        finally:
            getattr(blocks, "close", lambda: None)()

    th = threading.Thread(target=read, daemon=True, name="geomscope-read-ahead")
    th.start()
    try:
        while True:
            item, err = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        th.join()


def _update_units(unit: dict, xs: np.ndarray, gs: np.ndarray, work: OrderedWork) -> None:
    """Every cosine variant's unit-vector sums of the rows ``xs``, the variants together (they share
    the shifted rows: multiunit.update_all), with one reused float64 scratch space per thread."""
    from geomscope.score.multiunit import BLOCK_ROWS, batches_of, new_work, update_all

    sums = list(unit.values())
    d = xs.shape[1]
    batches = batches_of(sums)  # the layout of their columns, which fresh copies share

    def update(part, x, g, scratch):
        update_all(part, x, g, scratch, batches)

    _sums_in_blocks(sums, xs, gs, work, BLOCK_ROWS, update, ("unit sums", d), lambda n: new_work(n, d))


def _sums_in_blocks(sums: list, xs, gs, work: OrderedWork, block_rows: int, update, key, new_scratch) -> None:
    """``update(sums, xs, gs, scratch)`` for sums that merge (``fresh()``, ``merge()``). With
    ``work.threads`` > 1 each block of ``block_rows`` rows goes into fresh sums in a thread (its
    scratch ``new_scratch(block_rows)``, reused under ``key``); those are added in row order: the same
    additions as one update, so the same numbers."""
    if work.threads <= 1:  # (one thread: nothing is ever left in flight)
        update(sums, xs, gs, new_scratch(len(xs)))
        return

    def merge(part):
        for s, p in zip(sums, part, strict=True):
            s.merge(p)

    for i in range(0, len(xs), block_rows):

        def compute(scratch, i=i):
            part = [s.fresh() for s in sums]
            update(part, xs[i : i + block_rows], gs[i : i + block_rows], scratch)
            return part

        work.submit(compute, merge, (key, lambda: new_scratch(block_rows), lambda w: True))


def _update_strata(strata: dict, spec: PassSpec, xs, gs, keys, tokens, work: OrderedWork) -> None:
    """The rows ``xs`` into the accumulators of their bins: row i of bin b and jackknife group g goes to
    accumulator b x G + g of each stratification (score/strata.py)."""
    for kind, bins in _strata_labels(spec.strata, keys, tokens).items():
        update_groups(strata[kind], xs, bins.astype(np.int64) * spec.n_groups + gs, work=work)


def _update_context(context, seed: int, xs, keys, tokens, special, gs) -> None:
    """The ordinary rows of a block into a layer's contextuality accumulators (score/contextuality.py),
    with the hashes that decide what they keep: a type's occurrences by row, sentences by document,
    the baseline's pool by row, each from its own stream."""
    from geomscope.store.sample import (
        POSITION_BITS,
        STREAM_CONTEXT_DOCS,
        STREAM_CONTEXT_POOL,
        STREAM_CONTEXT_ROWS,
    )

    ordinary = ~np.asarray(special, bool)
    if not ordinary.any():
        return
    k = np.asarray(keys, np.uint64)[ordinary]
    docs = k >> np.uint64(POSITION_BITS)
    context.update(
        np.asarray(xs)[ordinary],
        token_ids=None if tokens is None else np.asarray(tokens)[ordinary],
        type_hashes=row_hash(k, seed, STREAM_CONTEXT_ROWS),
        doc_ids=docs.astype(np.int64),
        doc_hashes=row_hash(docs, seed, STREAM_CONTEXT_DOCS),
        pool_hashes=row_hash(k, seed, STREAM_CONTEXT_POOL),
        groups=np.asarray(gs)[ordinary],
    )


def _strata_labels(spec: dict, keys, tokens) -> dict[str, np.ndarray]:
    """Each row's bin per stratification of ``spec`` (score/strata.py's: ``{"frequency":
    bin_of_token, "frequency_bins": B, "position": edges}``), from its token id (one the bins do not
    know: the rarest bin) and its key (the position: the key's low bits)."""
    from geomscope.store.sample import POSITION_BITS

    out = {}
    if spec.get("frequency") is not None:
        bin_of = spec["frequency"]
        t = np.asarray(tokens, np.int64)
        inside = (t >= 0) & (t < bin_of.size)
        rarest = spec["frequency_bins"] - 1
        out["frequency"] = np.where(inside, bin_of[np.clip(t, 0, max(0, bin_of.size - 1))], rarest)
    if spec.get("position") is not None:
        pos = np.asarray(keys, np.uint64) & np.uint64((1 << POSITION_BITS) - 1)
        out["position"] = np.searchsorted(np.asarray(spec["position"], np.uint64), pos, side="right")
    return out


def _update_massive(top, xs, keys, block, keep, whole: bool, work: OrderedWork) -> None:
    """The block's largest |x| entries and |x| histogram (metrics/massive.py) into ``top``: computed
    in a thread into a fresh TopAbs, merged in order (which entries are kept does not depend on the
    order: ties go by key and dimension)."""
    from geomscope.metrics.massive import TopAbs

    tokens = block.token_id if block.token_id is None or whole else block.token_id[keep]
    special = block.special if whole else block.special[keep]

    def compute(_scratch):
        return TopAbs(top.k).update(xs, keys, tokens, special)

    work.submit(compute, top.merge, (("massive", 0), lambda: None, lambda w: True))


def _update_post(post: dict, xs: np.ndarray, gs: np.ndarray, work: OrderedWork) -> None:
    """The all-but-the-top and whitened unit sums of the rows ``xs`` (score/postprocess.py)."""
    from geomscope.metrics.postprocess import BLOCK_ROWS

    def update(part, x, g, _scratch):
        for s in part:
            s.update(x, g)

    _sums_in_blocks(list(post.values()), xs, gs, work, BLOCK_ROWS, update, ("post sums", 0), lambda n: None)


def _merge_kept(task: Task, spec: PassSpec, parts: dict, checked: dict) -> None:
    """A ``--keep sample`` shard's checked accumulators (``checked``: integrity.check_shard's) into
    jackknife group ``shard index % G``, its rows counted."""
    for name in spec.layers:
        m, special = checked[name]
        n_special = special.n if special is not None else 0
        c = parts[name].counts
        c["seen"] += task.tokens
        c["nonfinite"] += task.tokens - m.n - n_special  # (check_shard: the rows its entry records)
        if spec.exclude_special:
            c["special"] += n_special
        elif special is not None:
            m.merge(special)
        c["used"] += m.n
        parts[name].groups[task.index % spec.n_groups].merge(m)


def _merge_kept_top(f, task: Task, spec: PassSpec, parts: dict) -> None:
    """A ``--keep sample`` shard's largest |x| entries and |x| histogram (store/accumulators.py) into
    each layer's, its special tokens' too unless they are excluded; a shard that holds none (no
    ``/massive`` group) leaves the layer without them (``massive_missing``)."""
    from geomscope.store.accumulators import MASSIVE_GROUP, read_top_abs

    for name in spec.layers:
        lp = parts[name]
        g = f.get(f"{MASSIVE_GROUP}/{name}")
        if g is None:
            lp.massive_missing = True
            continue
        width = task.width(name) or int(f["layers"][name].shape[1])  # (0: a run that records no width)
        for part in ("regular", "special"):
            if part in g and not (part == "special" and spec.exclude_special):
                lp.massive.merge(read_top_abs(g[part], dim=width, most=task.tokens * width))


def _run_accumulated(task: Task, spec: PassSpec, progress, parts: dict) -> dict[str, LayerPart]:
    """A ``--keep sample`` shard: its stored accumulators go whole into jackknife group
    ``shard index % G``, and its sampled rows feed the intrinsic-dimension reservoir, filtered as the
    rows of a full run would be. Only the "moments" pass, and the "sample" pass (the sample alone),
    can be served (the engine asks no other)."""
    if spec.kind not in ("moments", "sample"):
        raise AssertionError(f"a {spec.kind!r} pass cannot read a --keep sample shard")
    from geomscope.store.reader import iter_shard_blocks, opened_task

    with opened_task(task, spec.layers, extras=spec.extras) as (f, checked):
        if spec.kind == "moments":
            _merge_kept(task, spec, parts, checked)
        if spec.massive_k:
            _merge_kept_top(f, task, spec, parts)
        for block in iter_shard_blocks(task, spec.layers, spec.n_groups, spec.block_rows, opened=f):
            for name in spec.layers:
                lp = parts[name]
                if lp.reservoir is None:
                    continue
                keep = _filter(block, name, spec, None)
                lp.reservoir.add(
                    row_hash(block.keys[keep], spec.seed, STREAM_ID_SAMPLE),
                    block.layers[name][keep],
                    {"group": block.group[keep]},
                )
    if progress:
        progress(task.rows)
    return parts
