"""Reading a run: :class:`Run` (its manifest, layers, shards as tasks, the checks before a read),
a shard streamed in bounded chunks (:func:`iter_shard`) or as the blocks ``score`` and ``export``
read (:func:`iter_shard_blocks`, :func:`iter_shard_meta`), and a ``--keep sample`` shard's stored
accumulators (:func:`read_accumulated`). The file checks each read goes through are integrity.py's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.store import remote
from geomscope.store.blocks import Block, Task, groups_of_docs, row_bytes
from geomscope.store.chunks import row_spans
from geomscope.store.integrity import (
    check_regular_file,
    check_same_file,
    corrupt,
    manifest_problems,
    missing,
    open_regular,
)
from geomscope.store.integrity import identity as shard_identity
from geomscope.store.manifest import (
    identity_digest,
    read_logs,
    read_manifest,
    with_logged,
)
from geomscope.store.names import MANIFEST_NAME, SHARD_FORMAT
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


class _StreamedFile(h5py.File):
    """A shard read through a Python file object (a URL opened with fsspec), closed with the file."""

    def __init__(self, fobj, where: str):
        try:
            super().__init__(fobj, "r")
        except BaseException:
            fobj.close()
            raise
        self._fobj = fobj
        self.location = where

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._fobj.close()


def _descriptor(f: h5py.File) -> int | None:
    """The file descriptor through which h5py reads a local shard (HDF5's default "sec2" driver);
    None for a URL's file object or another driver (set by ``HDF5_DRIVER``, say)."""
    if f.driver != "sec2":
        return None
    return f.id.get_vfd_handle()


def _open(path, expected: tuple | None = None) -> h5py.File:
    """A shard at a location (a Path, or a URL read through fsspec) opened for reading; a local one,
    when ``expected`` is given, must still be that file (:func:`check_same_file`)."""
    if not remote.exists(path):
        raise missing(path)
    check_regular_file(path)
    try:
        if remote.is_url(path):
            f = _StreamedFile(remote.open_binary(path), path)
        else:
            f = h5py.File(path, "r")
    except FileNotFoundError as e:
        raise missing(path) from e
    except OSError as e:
        raise corrupt(path, str(e).split("(")[0].strip() or "cannot open") from e
    try:
        fd = _descriptor(f)
        if fd is not None:
            check_same_file(path, fd, expected)
        elif expected is not None and not remote.is_url(path):  # another HDF5 driver: by path
            with open_regular(path) as again:
                check_same_file(path, again.fileno(), expected)
        if f.attrs.get("format") != SHARD_FORMAT or "layers" not in f:
            raise corrupt(path, "not a geomscope shard")
    except BaseException:
        f.close()
        raise
    return f


def open_shard(path, expected: tuple | None = None) -> h5py.File:
    """A finished shard (a path or a URL) opened for reading; DataError (one line) when it is missing
    or not a shard, or (``expected``: integrity.identity) no longer the file it was."""
    return _open(remote.location(path), expected)


def read_accumulated(f: h5py.File, layer: str, *, extras: bool, dim: int, tokens: int):
    """``(tokens, regular, special | None)`` of a ``--keep sample`` shard: the rows it measured and
    the layer's stored Moments (store/accumulators.py), checked against its manifest entry (``tokens``
    measured, the run's width ``dim``); DataError naming the shard otherwise."""
    from geomscope.store.accumulators import GROUP, read_moments

    path = getattr(f, "location", f.filename)
    try:
        if f.attrs.get("keep") != "sample":
            raise corrupt(path, "it keeps every row, but the run records a --keep sample")
        if f.attrs.get("tokens") != tokens:
            raise corrupt(path, f"it says it measured {f.attrs.get('tokens')} rows, its entry {tokens}")
        if layer not in f[GROUP]:
            raise corrupt(path, f"it has no accumulators of layer {layer}")
        lg = f[GROUP][layer]
        regular = read_moments(lg["regular"], dim=dim, most=tokens, extras=extras)
        special = None
        if "special" in lg:
            special = read_moments(lg["special"], dim=dim, most=tokens - regular.n, extras=extras)
        return tokens, regular, special
    except DataError as e:
        if str(path) in str(e):
            raise
        raise corrupt(path, str(e).split(";")[0]) from e
    except READ_ERRORS as e:
        raise corrupt(path, _h5_reason(e)) from e


#: what a damaged or crafted shard's structure makes h5py or numpy raise while it is read
READ_ERRORS = (
    OSError,
    KeyError,
    ValueError,
    TypeError,
    IndexError,
    AttributeError,
    OverflowError,
    RuntimeError,  # h5py, for a name it cannot look up (a NUL in it)
    UnicodeError,  # a name that is no text (a lone surrogate)
)


def _own_dataset(f: h5py.File, key: str, path) -> h5py.Dataset:
    """``f[key]``, a dataset whose data lie in the shard itself: not a link to another file or place,
    not external raw storage, not a virtual dataset (each would read files outside the run, which the
    shard's checksum does not cover)."""
    link = f.get(key, getlink=True)
    if link is None:
        raise corrupt(path, f"no {key}")
    if not isinstance(link, h5py.HardLink):
        raise corrupt(path, f"{key} is a link to another file or place")
    ds = f[key]
    if not isinstance(ds, h5py.Dataset):
        raise corrupt(path, f"{key} is not a dataset")
    if ds.external or ds.is_virtual:
        raise corrupt(path, f"{key} keeps its data outside the shard")
    return ds


def check_layout(f: h5py.File, path, layers=(), *, rows: int | None = None, dim: int | None = None) -> int:
    """A shard's structure before anything is read or allocated from it: the row index (token_id,
    doc_id, position, is_special) one-dimensional integer columns of one length n (``rows``: the
    manifest's count, when known), each of ``layers`` an (n, D) float dataset (``dim``: the run's D,
    when known), its non-finite flags (n,) booleans, every one stored in the shard itself. Returns n;
    DataError (one line, naming the shard) for anything else: a crafted shape cannot make a read
    allocate beyond what the manifest announced, nor loop over rows that are not there."""
    n = None
    for key in (*META_FIELDS, "is_special"):
        ds = _own_dataset(f, key, path)
        if ds.ndim != 1 or ds.dtype.kind not in "iub":
            raise corrupt(path, f"{key} is not a column of integers")
        if n is None:
            n = int(ds.shape[0])
        elif ds.shape[0] != n:
            raise corrupt(path, f"{key} has {ds.shape[0]} rows, token_id has {n}")
    if rows is not None and n != rows:
        raise corrupt(path, f"it stores {n} rows, its manifest entry says {rows}")
    for name in layers:
        ds = _own_dataset(f, f"layers/{name}", path)
        if ds.ndim != 2 or ds.dtype.kind != "f":
            raise corrupt(path, f"layer {name} is not a (rows, D) float array")
        if ds.shape[0] != n:
            raise corrupt(path, f"layer {name} has {ds.shape[0]} rows, the index has {n}")
        if dim is not None and ds.shape[1] != dim:
            raise corrupt(path, f"layer {name} is {ds.shape[1]} wide, the run's layers {dim}")
        if f.get(f"nonfinite/{name}", getlink=True) is not None:
            flags = _own_dataset(f, f"nonfinite/{name}", path)
            if flags.shape != (n,) or flags.dtype.kind not in "bui":
                raise corrupt(path, f"the non-finite flags of layer {name} are not {n} booleans")
    return n


def verify_layout(path, layers, *, rows: int | None = None, dim: int | None = None) -> None:
    """:func:`check_layout` of a shard (``inspect --verify``: a shard that would stop ``score`` is
    reported as damaged there too)."""
    path = remote.location(path)
    with _open(path) as f:
        try:
            check_layout(f, path, layers, rows=rows, dim=dim)
        except READ_ERRORS as e:
            raise corrupt(path, str(e)) from e


def read_shard_index(path: Path, rows: int | None = None) -> dict[str, np.ndarray]:
    """The per-row metadata of a shard (token_id, doc_id, position, is_special), no activations;
    ``rows``: the manifest's count, checked before anything is read."""
    path = remote.location(path)
    with _open(path) as f:
        try:
            check_layout(f, path, rows=rows)
            return {k: f[k][:] for k in (*META_FIELDS, "is_special")}
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
    with _open(path) as f:
        try:
            ds = f["layers"][layer]
            return int(ds.shape[1]), ds.dtype
        except (OSError, KeyError) as e:
            raise corrupt(path, str(e).split("(")[0].strip()) from e


class _RowReader:
    """Rows ``start:stop`` of a shard's (rows, D) datasets, as ``ds[start:stop]`` gives them.

    h5py holds the GIL for the whole of a read (3.4-3.9 ms for a shard of 25,000 x 384 float16 rows on
    the 2-core benchmark machine), and ``score`` reads the next shard in a thread while its own threads
    multiply: they could not come back from a product meanwhile. A dataset stored as geomscope writes
    it -- chunks of whole rows, no filter, numbers in this machine's byte order -- is read here chunk by
    chunk, its bytes straight into the array with ``os.preadv``, which releases the GIL (and is faster:
    the 8 shards of the 200k x 384 benchmark run in 34 ms against h5py's 54-56). It reads the file
    h5py opened (a duplicate of its descriptor, read at explicit offsets), never the path again: what
    h5py's checks and the identity check saw is what the rows come from. Any other layout, a filter,
    a chunk never written, or a shard behind a URL is read by h5py."""

    def __init__(self, path, f: h5py.File):
        self.path = path
        fd = _descriptor(f) if hasattr(os, "preadv") else None
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
    rows: int | None = None,
    dim: int | None = None,
    expected: tuple | None = None,
    docs: tuple[int, int] | None = None,
) -> Iterator[ShardChunk]:
    """Stream a shard in chunks of rows; memory is bounded by ``chunk_rows`` x D x len(layers).

    ``activations=False`` reads only the row index and the non-finite flags of ``layers`` (a chunk's
    ``layers`` is then empty): the metadata pass of ``score --max-rows``. ``path``: a path or a URL.
    ``rows``, ``dim``: the manifest's row count and the run's width, checked (:func:`check_layout`)
    before anything is read. ``expected``: the shard's integrity.identity when it was planned (checked
    on the open file). ``docs``: the documents [start, stop) its manifest entry assigns it; a row of
    another document is refused (it would be counted twice, or in the wrong jackknife group).
    """
    path = remote.location(path)
    with _open(path, expected) as f, contextlib.closing(_RowReader(path, f)) as reader:
        try:
            stored = f["layers"]
            if not isinstance(stored, h5py.Group):
                raise corrupt(path, "its layers are not a group of datasets")
            names = list(stored.keys()) if layers is None else list(layers)
            for n in names:
                if n not in stored:
                    raise corrupt(path, f"it has no layer {n!r}, which the run lists")
            n_rows = check_layout(f, path, names, rows=rows, dim=dim)
            if names and activations:
                d = f["layers"][names[0]].shape[1]
                item = f["layers"][names[0]].dtype.itemsize
                default = max(1024, READ_CHUNK_BYTES // row_bytes(d, item, len(names)))
            else:
                default = max(1024, READ_CHUNK_BYTES // row_bytes(0, 0, len(names)))
            step = chunk_rows or default
            for ds in [f["layers"][n] for n in names]:
                if ds.shape[0] != n_rows:
                    raise corrupt(path, f"layer {ds.name} has {ds.shape[0]} rows, index has {n_rows}")
            for start in range(0, n_rows, step):
                stop = min(n_rows, start + step)
                meta = {k: f[k][start:stop] for k in (*META_FIELDS, "is_special")}
                if docs is not None:
                    check_documents(path, meta["doc_id"], docs)
                yield ShardChunk(
                    start=start,
                    stop=stop,
                    layers={n: reader.rows(f["layers"][n], start, stop) for n in names}
                    if activations
                    else {},
                    nonfinite={n: f["nonfinite"][n][start:stop] for n in names if n in f["nonfinite"]},
                    token_id=meta["token_id"],
                    doc_id=meta["doc_id"],
                    position=meta["position"],
                    is_special=meta["is_special"],
                )
        except READ_ERRORS as e:  # truncated file, broken chunk, a structure no writer made
            raise corrupt(path, _h5_reason(e)) from e


def iter_shard_meta(task: Task, layers: list[str], n_groups: int) -> Iterator[Block]:
    """Metadata (keys, groups, special, non-finite flags) of a shard task, without activations: the
    row index and the stored non-finite flags alone are read."""
    for ch in iter_shard(
        task.path,
        layers,
        chunk_rows=1 << 20,
        activations=False,
        rows=task.rows,
        expected=task.identity,
        docs=task.docs,
    ):
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
        )


def iter_shard_blocks(
    task: Task, layers: list[str], n_groups: int, block_rows: int | None
) -> Iterator[Block]:
    """A shard task's rows with the activations of ``layers``, in blocks of ``block_rows`` (None: the
    default read step), held to what the task records (rows, width, identity, documents)."""
    for ch in iter_shard(
        task.path,
        layers,
        chunk_rows=block_rows,
        rows=task.rows,
        dim=task.dim or None,
        expected=task.identity,
        docs=task.docs,
    ):
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
        )


def _h5_reason(e: BaseException) -> str:
    """The first words of what h5py or numpy said, without HDF5's parenthesised detail and quotes."""
    return str(e).split("(")[0].strip().strip("\"'").strip() or type(e).__name__


def check_documents(path, doc_id: np.ndarray, docs: tuple[int, int]) -> None:
    """Every document id of a shard's rows lies in [start, stop), the range its entry assigns it."""
    if doc_id.size and (int(doc_id.min()) < docs[0] or int(doc_id.max()) >= docs[1]):
        raise corrupt(
            path,
            f"it stores rows of documents {int(doc_id.min())}..{int(doc_id.max())}, outside its range "
            f"{docs[0]}..{docs[1] - 1}",
        )


def shard_counts(path: Path, rows: int | None = None) -> tuple[int, int]:
    """(rows, distinct documents) actually stored in a shard (``rows``: see read_shard_index)."""
    idx = read_shard_index(path, rows)
    return int(idx["doc_id"].shape[0]), int(np.unique(idx["doc_id"]).size)


class Run:
    """A run directory opened for reading: a path, or an fsspec URL (``self.dir`` is then the URL
    string, and :meth:`shard_path` gives URLs).

    What ``score``, ``export`` and ``inspect`` know of a run comes from here: its checked manifest
    (with the shards of an unfinished run's logs folded in), layers and their indices in the model,
    the kept sample's size (:attr:`kept_sample`), the manifest's agreement with itself
    (:meth:`check_consistent`), and its shards as tasks (:meth:`shard_tasks`) whose rows
    :func:`iter_shard_blocks` and :func:`iter_shard_meta` stream, and whose stored accumulators
    :func:`read_accumulated` reads."""

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
        model = self.identity.get("model", {})
        return model.get("hidden_size")

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
        keep = self.identity.get("keep")
        if keep is None:
            return None
        head, _, n = str(keep).partition(":")
        if head != "sample" or not n.isdigit():
            raise InputError(
                f"{self.dir}: the manifest's keep {keep!r} is not one geomscope writes; the run is damaged"
            )
        return int(n)

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

    def shard_tasks(self, dim: int, *, accumulated: bool = False) -> list[Task]:
        """The run's shards as tasks, in index order: path, rows, recorded size and checksum, their
        documents, and the identity of each file now (the reads must come from the file planned).
        ``dim``: the width every layer is held to (0: not checked); ``accumulated``: the shards of a
        ``--keep sample`` run (:attr:`kept_sample`)."""
        return [
            Task(
                kind="shard",
                path=str(self.shard_path(s)),
                index=s.index,
                rows=s.rows,
                nbytes=s.bytes,
                digest=s.digest,
                identity=shard_identity(self.shard_path(s)),
                dim=dim,
                accumulated=accumulated,
                docs=s.documents,
                tokens=s.n_tokens,
            )
            for s in sorted(self.shards, key=lambda s: s.index)
        ]

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
