"""Reading a run: :class:`Run` (its manifest, layers, shards as tasks, the checks before a read),
a shard streamed in bounded chunks (:func:`iter_task`: a run's shard; :func:`iter_shard`: a shard
file on its own) or as the blocks ``score`` reads (:func:`iter_shard_blocks`,
:func:`iter_shard_meta`). The checks each read goes through are integrity.py's: the file's, the one
notion of a valid shard (:func:`check_shard`, a ``--keep sample`` shard's accumulators among them)
and each chunk's rows as they stream (:func:`check_chunk`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from geomscope.errors import InputError
from geomscope.store import remote
from geomscope.store.blocks import Block, Task, groups_of_docs, row_bytes
from geomscope.store.chunks import row_spans
from geomscope.store.integrity import (
    READ_ERRORS,
    check_chunk,
    check_layout,
    check_rows,
    check_shard,
    checked_reads,
    corrupt,
    h5_descriptor,
    h5_reason,
    kept_size,
    layer_dims,
    manifest_problems,
    open_checked,
    shard_task,
    stored_flags,
)
from geomscope.store.manifest import (
    identity_digest,
    read_logs,
    read_manifest,
    with_logged,
)
from geomscope.store.names import MANIFEST_NAME
from geomscope.store.sample import run_keys
from geomscope.store.shard import META_FIELDS, ShardInfo

READ_CHUNK_BYTES = 64 * 1024 * 1024  # default bytes of one read step (its rows' layers and fields)


@dataclass
class ShardChunk:
    """A contiguous block of rows of one shard."""

    start: int
    stop: int
    layers: dict[str, np.ndarray]  # name -> (rows, D) in the stored dtype
    nonfinite: dict[str, np.ndarray]  # name -> (rows,) bool
    token_id: np.ndarray
    doc_id: np.ndarray
    position: np.ndarray
    is_special: np.ndarray
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.stop - self.start


def open_shard(path, expected: tuple | None = None) -> h5py.File:
    """A finished shard (a path or a URL) opened for reading; DataError (one line) when it is missing
    or not a shard, or (``expected``: integrity.identity) no longer the file it was."""
    return open_checked(remote.location(path), expected)


def read_shard_index(path: Path, rows: int | None = None) -> dict[str, np.ndarray]:
    """The per-row metadata of a shard (token_id, doc_id, position, is_special), no activations;
    ``rows``: the manifest's count, checked before anything is read."""
    path = remote.location(path)
    with open_checked(path) as f:
        try:
            check_layout(f, path, rows=rows)
            index = {k: f[k][:] for k in (*META_FIELDS, "is_special")}
            check_rows(path, None, index)
            return index
        except READ_ERRORS as e:
            raise corrupt(path, str(e)) from e


def shard_dim(path: Path, layer: str) -> int:
    """The width D of ``layer`` in one shard."""
    return _layer_form(path, layer)[0]


def shard_dtype(path: Path, layer: str) -> str:
    """The stored dtype of ``layer`` in one shard, as numpy writes it (``"<f2"``)."""
    return _layer_form(path, layer)[1].str


def _layer_form(path: Path, layer: str) -> tuple[int, np.dtype]:
    """(width, dtype) of ``layer``'s dataset in one shard."""
    path = remote.location(path)
    with open_checked(path) as f:
        try:
            ds = f["layers"][layer]
            return int(ds.shape[1]), ds.dtype
        except (OSError, KeyError) as e:
            raise corrupt(path, str(e).split("(")[0].strip()) from e


class _RowReader:
    """Rows ``start:stop`` of a shard's (rows, D) datasets, as ``ds[start:stop]`` gives them.

    h5py holds the GIL for the whole of a read (a few ms for a shard of 25,000 x 384 float16 rows), and
    ``score`` reads the next shard in a thread while its own threads multiply: they could not come back
    from a product meanwhile. A dataset stored as geomscope writes it -- chunks of whole rows, no
    filter, numbers in this machine's byte order -- is read here chunk by chunk, its bytes straight into
    the array with ``os.preadv``, which releases the GIL (and takes about two thirds of h5py's time). It
    reads the file h5py opened (a duplicate of its descriptor, read at explicit offsets), never the path
    again: what h5py's checks and the identity check saw is what the rows come from. Any other layout, a
    filter, a chunk never written, or a shard behind a URL is read by h5py."""

    def __init__(self, path, f: h5py.File):
        self.path = path
        fd = h5_descriptor(f) if hasattr(os, "preadv") else None
        self._fd = None if fd is None else os.dup(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def rows(self, ds: h5py.Dataset, start: int, stop: int) -> np.ndarray:
        spans = None if self._fd is None else row_spans(ds, start, stop)
        if spans is None:
            return ds[start:stop]
        out = np.empty((stop - start, ds.shape[1]), ds.dtype)
        flat = memoryview(out.reshape(-1).view(np.uint8))
        at = 0
        for offset, nbytes in spans:
            self._read_exactly(offset, flat[at : at + nbytes])
            at += nbytes
        return out

    def _read_exactly(self, offset: int, into: memoryview) -> None:
        while len(into):
            n = os.preadv(self._fd, [into], offset)
            if not n:
                raise corrupt(self.path, "a chunk of rows ends past the end of the file")
            into, offset = into[n:], offset + n


def iter_shard(
    path: Path,
    layers: list[str] | None = None,
    *,
    chunk_rows: int | None = None,
    activations: bool = True,
) -> Iterator[ShardChunk]:
    """Stream a shard file on its own in chunks of rows; memory is bounded by ``chunk_rows`` x D x
    len(layers). Its structure is checked (integrity.check_layout) before anything is read, and each
    chunk as it streams (integrity.check_chunk, against what any run allows). A run's shard is read
    as its task plans it: :func:`iter_task`.

    ``activations=False`` reads only the row index and the non-finite flags of ``layers`` (a chunk's
    ``layers`` is then empty). ``path``: a path or a URL.
    """
    path = remote.location(path)
    with open_checked(path) as f:
        try:
            names = _layer_names(f, path, layers)
            check_layout(f, path, names)
        except READ_ERRORS as e:
            raise corrupt(path, h5_reason(e)) from e
        yield from _chunks(f, path, names, None, chunk_rows, activations)


@contextlib.contextmanager
def opened_task(task: Task, layers: list[str], *, extras: bool = True):
    """A run's shard opened as its task plans it (the file planned: integrity.open_checked) and held
    to integrity.check_shard: ``(f, checked)``, ``checked`` being a ``--keep sample`` shard's
    accumulators (``extras``: with their cosine and |x| parts), ``{}`` for a shard of every row."""
    path = remote.location(task.path)
    with open_checked(path, task.identity) as f:
        yield f, check_shard(f, path, task, layers, extras=extras)


def iter_task(
    task: Task,
    layers: list[str],
    *,
    chunk_rows: int | None = None,
    activations: bool = True,
    opened: h5py.File | None = None,
) -> Iterator[ShardChunk]:
    """A run's shard task streamed as :func:`iter_shard` streams a file, held to everything
    ``score``, ``export``, ``inspect --verify`` and resume hold a shard to: integrity.check_shard
    before anything is read (its rows, each layer's width, a sample's accumulators), then each chunk to
    integrity.check_chunk (documents in its entry's range, positions and token ids the run allows,
    NaN or Inf exactly where flagged). ``opened``: the shard opened already by :func:`opened_task`
    (checked there)."""
    path = remote.location(task.path)
    if opened is not None:
        yield from _chunks(opened, path, list(layers), task, chunk_rows, activations)
        return
    with opened_task(task, layers) as (f, _):
        yield from _chunks(f, path, list(layers), task, chunk_rows, activations)


def _layer_names(f: h5py.File, path, layers: list[str] | None) -> list[str]:
    """The layers to read: ``layers``, or every one the shard stores; each must be there."""
    stored = f["layers"]
    if not isinstance(stored, h5py.Group):
        raise corrupt(path, "its layers are not a group of datasets")
    names = list(stored.keys()) if layers is None else list(layers)
    for n in names:
        if n not in stored:
            raise corrupt(path, f"it has no layer {n!r}, which the run lists")
    return names


def _chunks(
    f: h5py.File, path, names: list[str], task: Task | None, chunk_rows: int | None, activations: bool
) -> Iterator[ShardChunk]:
    """The rows of the open, checked shard ``f``, ``chunk_rows`` at a time (None: about
    READ_CHUNK_BYTES), each held to integrity.check_chunk."""
    with contextlib.closing(_RowReader(path, f)) as reader:
        try:
            n_rows = int(f["token_id"].shape[0])
            if names and activations:
                # the layers' mean width, rounded up (layers of several widths: extract --modules)
                d = -(-sum(int(f["layers"][n].shape[1]) for n in names) // len(names))
                item = f["layers"][names[0]].dtype.itemsize
                default = max(1024, READ_CHUNK_BYTES // row_bytes(d, item, len(names)))
            else:
                default = max(1024, READ_CHUNK_BYTES // row_bytes(0, 0, len(names)))
            step = chunk_rows or default
            flagged = stored_flags(f, names)
            for start in range(0, n_rows, step):
                stop = min(n_rows, start + step)
                meta = {k: f[k][start:stop] for k in (*META_FIELDS, "is_special")}
                values = {n: reader.rows(f["layers"][n], start, stop) for n in names} if activations else {}
                flags = {n: f["nonfinite"][n][start:stop] for n in flagged}
                check_chunk(path, task, meta, values, flags)
                yield ShardChunk(
                    start=start,
                    stop=stop,
                    layers=values,
                    nonfinite=flags,
                    token_id=meta["token_id"],
                    doc_id=meta["doc_id"],
                    position=meta["position"],
                    is_special=meta["is_special"],
                )
        except READ_ERRORS as e:  # truncated file, broken chunk, a structure no writer made
            raise corrupt(path, h5_reason(e)) from e


def iter_shard_meta(task: Task, layers: list[str], n_groups: int) -> Iterator[Block]:
    """Metadata (keys, groups, special, non-finite flags) of a shard task, without activations: the
    row index and the stored non-finite flags alone are read."""
    for ch in iter_task(task, layers, chunk_rows=1 << 20, activations=False):
        n = ch.stop - ch.start
        nf = {
            name: np.asarray(ch.nonfinite[name], bool) if name in ch.nonfinite else np.zeros(n, bool)
            for name in layers
        }
        yield Block(
            keys=run_keys(ch.doc_id, ch.position),
            group=groups_of_docs(ch.doc_id, n_groups),
            special=np.asarray(ch.is_special, bool),
            nonfinite=nf,
            token_id=np.asarray(ch.token_id, np.int64),
        )


def iter_shard_blocks(
    task: Task,
    layers: list[str],
    n_groups: int,
    block_rows: int | None,
    *,
    opened: h5py.File | None = None,
) -> Iterator[Block]:
    """A shard task's rows with the activations of ``layers``, in blocks of ``block_rows`` (None: the
    default read step), held to what the task records (:func:`iter_task`; ``opened``: the shard
    opened and checked by :func:`opened_task`)."""
    for ch in iter_task(task, layers, chunk_rows=block_rows, opened=opened):
        nf = {}
        for n in layers:
            if n in ch.nonfinite:  # the store flags every row whose stored values hold NaN/Inf
                nf[n] = np.asarray(ch.nonfinite[n], bool)
            else:  # a shard without flags: find those rows here
                nf[n] = ~np.isfinite(ch.layers[n]).all(axis=1)
        yield Block(
            keys=run_keys(ch.doc_id, ch.position),
            group=groups_of_docs(ch.doc_id, n_groups),
            special=np.asarray(ch.is_special, bool),
            layers=ch.layers,
            nonfinite=nf,
            token_id=np.asarray(ch.token_id, np.int64),
        )


class Run:
    """A run directory opened for reading: a path, or an fsspec URL (``self.dir`` is then the URL
    string, and :meth:`shard_path` gives URLs).

    What ``score``, ``export`` and ``inspect`` know of a run comes from here: its checked manifest
    (with the shards of an unfinished run's logs folded in), layers and their indices in the model,
    the kept sample's size (:attr:`kept_sample`), the manifest's agreement with itself
    (:meth:`check_consistent`), and its shards as tasks (:meth:`shard_tasks`) whose rows
    :meth:`checked_chunks`, :func:`iter_shard_blocks` and :func:`iter_shard_meta` stream, and whose
    stored accumulators integrity.check_shard checks and returns."""

    def __init__(self, run_dir: Path | str):
        self.dir = remote.location(run_dir)
        mpath = remote.join(self.dir, MANIFEST_NAME)
        if not remote.exists(mpath):
            if not remote.exists(self.dir):
                raise InputError(
                    f"{self.dir} does not exist; give a run directory made by `geomscope extract`"
                )
            raise InputError(
                f"{self.dir} is not a geomscope run directory (no {MANIFEST_NAME}); "
                "run `geomscope extract` first"
            )
        # the shard logs before the manifest: a writer rewrites the manifest before it removes a
        # log, so a shard is in one or the other whenever this reads them
        logs = [] if remote.is_url(self.dir) else read_logs(Path(self.dir))
        self.manifest = read_manifest(mpath)
        if logs and not self.complete:
            self._fold_logs(logs)

    def _fold_logs(self, logs) -> None:
        """An unfinished run's shards that its processes' shard logs hold and its manifest does not
        yet (a run being written or stopped: store/manifest.py); nothing is written."""
        digest = identity_digest(self.identity)
        logged = [e for _, d, entries in logs if d == digest for e in entries]
        self.manifest["shards"] = with_logged(self.manifest["shards"], logged)

    @property
    def identity(self) -> dict:
        return self.manifest.get("identity", {})

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def layer_names(self) -> list[str]:
        return [layer["name"] for layer in self.identity.get("layers", [])]

    @property
    def layers(self) -> list[dict]:
        """Layer descriptions: name, index (in hidden_states), and whatever extract recorded."""
        return list(self.identity.get("layers", []))

    @property
    def dim(self) -> int | None:
        """The run's width D: the model's hidden size (None: not recorded)."""
        model = self.identity.get("model", {})
        return model.get("hidden_size")

    @property
    def layer_dims(self) -> dict[str, int]:
        """Each layer's width: the one its entry records (a module layer narrower or wider than the
        hidden size: grouped-query keys, MLP intermediates), else the run's :attr:`dim`; a layer of
        a run that records neither is absent."""
        own = layer_dims(self.identity)
        return {n: own.get(n, self.dim) for n in self.layer_names if own.get(n, self.dim) is not None}

    @property
    def shards(self) -> list[ShardInfo]:
        return [ShardInfo.from_dict(s) for s in self.manifest.get("shards", [])]

    def shard_path(self, info: ShardInfo) -> Path | str:
        return remote.join(self.dir, info.file)

    @property
    def total_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def kept_sample(self) -> int | None:
        """N of a ``--keep sample:N`` run, whose shards keep accumulators and N sampled rows each
        (None: a run of every row). InputError for a ``keep`` geomscope never writes."""
        try:
            return kept_size(self.identity.get("keep"))
        except ValueError as e:
            raise self._damaged(e) from None

    def _damaged(self, e: ValueError) -> InputError:
        return InputError(f"{self.dir}: {e}; the run is damaged")

    def check_consistent(self, where) -> None:
        """InputError unless the manifest agrees with itself (integrity.manifest_problems: a shard
        listed twice, documents claimed twice, totals that disagree...): every row is read once, by
        score and by export alike, or the run is refused. ``where``: the run as the user named it."""
        problems = manifest_problems(self)
        if problems:
            raise InputError(
                f"{where} is damaged: its manifest disagrees with itself ({problems[0]}); rerun "
                "`geomscope extract` with --overwrite, or into a new --out"
            )

    def layer_indices(self, names: list[str]) -> dict[str, int | None]:
        """layer -> its index in the model as the run records it (None where it records no integer)."""
        recorded = {lay.get("name"): lay.get("index") for lay in self.layers}
        out = {}
        for n in names:
            v = recorded.get(n)
            out[n] = v if isinstance(v, int) and not isinstance(v, bool) else None
        return out

    def shard_tasks(self, dim: int) -> list[Task]:
        """The run's shards as tasks, in index order (integrity.shard_task: path, rows, recorded size
        and checksum, documents, the identity of each file now -- the reads must come from the file
        planned -- and a ``--keep sample`` run's sample). ``dim``: the width every layer is held to
        that records none of its own (0: not checked); one that does is held to its own."""
        entries = sorted(self.manifest.get("shards", []), key=lambda s: s["index"])
        vocab = self.manifest.get("vocab_size")
        try:
            return [
                shard_task(self.shard_path(info), info, self.identity, dim, e.get("stats"), vocab=vocab)
                for e, info in ((e, ShardInfo.from_dict(e)) for e in entries)
            ]
        except ValueError as e:  # a keep geomscope never writes
            raise self._damaged(e) from None

    def checked_chunks(self, task: Task, layers, verify: bool) -> Iterator[ShardChunk]:
        """The chunks of one of :meth:`shard_tasks`, read as score reads a shard: its size against
        the manifest now, its checksum (``verify``) while it is read (integrity.checked_reads, which
        says a changed file's checksum first when the reads fail), the shard held to
        integrity.check_shard and its rows, from the file checked, to integrity.check_chunk
        (:func:`iter_task`: documents, positions, token ids, non-finite flags)."""
        with checked_reads(task, checksum=verify) as task:
            yield from iter_task(task, layers)

    def resolve_layers(self, wanted) -> list[str]:
        """The stored layer names a ``--layers`` selection picks (``"3"``, ``"-1"``, ``"layer_03"``,
        ``"1-3"``, ``"blocks"`` ...: the grammar of :mod:`geomscope.layers`), in the run's order,
        each once; None or an empty list: every layer."""
        from geomscope.layers import select_names, stored_layers

        return select_names(wanted, stored_layers(self.layers, "this run"))

    def __repr__(self) -> str:
        return (
            f"Run({str(self.dir)!r}, layers={len(self.layer_names)}, rows={self.total_rows}, "
            f"complete={self.complete})"
        )
