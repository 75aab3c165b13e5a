"""Reading a run: the manifest, its shards, and streaming a shard in bounded chunks."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.store import checksum, remote
from geomscope.store.chunks import row_spans
from geomscope.store.manifest import (
    MANIFEST_NAME,
    check_manifest,
    identity_digest,
    read_logs,
    read_manifest,
    with_logged,
)
from geomscope.store.shard import META_FIELDS, ShardInfo

READ_CHUNK_BYTES = 64 * 1024 * 1024  # default bytes of one read step (its rows' layers and fields)


def row_bytes(dim: int, itemsize: int, n_layers: int) -> int:
    """Bytes one row of a read step takes: its layers' values, its index fields (token_id, doc_id,
    position: int64; is_special) and a non-finite flag per layer. Counting the fields keeps a step
    bounded for narrow layers too (D = 2 in float16 would otherwise read 16M rows, 0.4 GB of fields)."""
    return dim * itemsize * n_layers + 3 * 8 + 1 + n_layers


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


def _corrupt(path, why: str) -> DataError:
    return DataError(
        f"shard {path} is corrupt or truncated ({why}); rerun the same `geomscope extract` command to redo it"
    )


def _missing(path) -> DataError:
    return DataError(f"shard {path} is missing; rerun the same `geomscope extract` command to redo it")


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


def check_regular_file(path) -> None:
    """A local shard must be a regular file in its run: not a symbolic link (its bytes would come
    from elsewhere, unchecked by where the run lies), a FIFO or a device (a read that blocks or never
    ends). DataError (one line) otherwise. A ``file://`` URL is checked at its local path (it names
    the same file); another URL is left to its filesystem."""
    if remote.is_url(path):
        local = remote.local_path(path)
        if local is None:
            return
        path = local
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError as e:
        raise _missing(path) from e
    except OSError as e:
        raise _corrupt(path, f"cannot read it: {e}") from e
    if stat.S_ISLNK(mode):
        raise DataError(
            f"shard {path} is a symbolic link; geomscope reads only the files extract wrote into the "
            "run: put the shard itself there"
        )
    if not stat.S_ISREG(mode):
        raise _corrupt(path, "not a regular file")


def open_regular(path):
    """A local shard opened for reading (an unbuffered binary file), checked as
    :func:`check_regular_file` checks it but on the open file itself: a link is refused by the open
    (``O_NOFOLLOW``), a FIFO does not block it (``O_NONBLOCK``), and what is not a regular file is
    refused by its ``fstat`` -- nothing can be put in its place between the check and the reads."""
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise _missing(path) from e
    except OSError as e:
        check_regular_file(path)  # a link (ELOOP) or what else it is, said as such
        raise _corrupt(path, f"cannot read it: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # (before open(): a directory would raise there)
        os.close(fd)
        raise _corrupt(path, "not a regular file")
    return open(fd, "rb", buffering=0)  # noqa: SIM115 -- the caller closes it


def identity(path) -> tuple | None:
    """What tells this local file from one put in its place or changed: (this machine's name, device,
    inode, size, modification time in ns). None for a URL, or a path that is not a regular file now
    (the checks before any read say what it is)."""
    if remote.is_url(path):
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return file_identity(st) if stat.S_ISREG(st.st_mode) else None


def file_identity(st: os.stat_result) -> tuple:
    """:func:`identity` of a file's ``os.stat`` / ``os.fstat`` result."""
    return (socket.gethostname(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_same_file(path, fd: int, expected: tuple | None) -> None:
    """DataError unless the open file ``fd`` is the file ``expected`` (:func:`identity`) describes:
    the shard was replaced or changed since, and the bytes checked and the rows read could otherwise
    come from different files. An identity taken on another machine (a Dask worker elsewhere, reading
    a shared filesystem whose device and inode numbers are its own) is not compared."""
    if expected is None:
        return
    now = file_identity(os.fstat(fd))
    if expected[0] == now[0] and tuple(expected) != now:
        raise DataError(
            f"shard {path} was replaced or changed while geomscope read it (another `geomscope extract` "
            "writing into this run?); score it again once that is done"
        )


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
        raise _missing(path)
    check_regular_file(path)
    try:
        if remote.is_url(path):
            f = _StreamedFile(remote.open_binary(path), path)
        else:
            f = h5py.File(path, "r")
    except FileNotFoundError as e:
        raise _missing(path) from e
    except OSError as e:
        raise _corrupt(path, str(e).split("(")[0].strip() or "cannot open") from e
    try:
        fd = _descriptor(f)
        if fd is not None:
            check_same_file(path, fd, expected)
        elif expected is not None and not remote.is_url(path):  # another HDF5 driver: by path
            with open_regular(path) as again:
                check_same_file(path, again.fileno(), expected)
        if f.attrs.get("format") != "geomscope-shard" or "layers" not in f:
            raise _corrupt(path, "not a geomscope shard")
    except BaseException:
        f.close()
        raise
    return f


def open_shard(path, expected: tuple | None = None) -> h5py.File:
    """A finished shard (a path or a URL) opened for reading; DataError (one line) when it is missing
    or not a shard, or (``expected``: :func:`identity`) no longer the file it was."""
    return _open(remote.location(path), expected)


def read_accumulated(f: h5py.File, layer: str, *, extras: bool, dim: int, tokens: int):
    """``(tokens, regular, special | None)`` of a ``--keep sample`` shard: the rows it measured and
    the layer's stored Moments (store/accumulators.py), checked against its manifest entry (``tokens``
    measured, the run's width ``dim``); DataError naming the shard otherwise."""
    from geomscope.store.accumulators import GROUP, read_moments

    path = getattr(f, "location", f.filename)
    try:
        if f.attrs.get("keep") != "sample":
            raise _corrupt(path, "it keeps every row, but the run records a --keep sample")
        if f.attrs.get("tokens") != tokens:
            raise _corrupt(path, f"it says it measured {f.attrs.get('tokens')} rows, its entry {tokens}")
        if layer not in f[GROUP]:
            raise _corrupt(path, f"it has no accumulators of layer {layer}")
        lg = f[GROUP][layer]
        regular = read_moments(lg["regular"], dim=dim, most=tokens, extras=extras)
        special = None
        if "special" in lg:
            special = read_moments(lg["special"], dim=dim, most=tokens - regular.n, extras=extras)
        return tokens, regular, special
    except DataError as e:
        if str(path) in str(e):
            raise
        raise _corrupt(path, str(e).split(";")[0]) from e
    except READ_ERRORS as e:
        raise _corrupt(path, _h5_reason(e)) from e


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
        raise _corrupt(path, f"no {key}")
    if not isinstance(link, h5py.HardLink):
        raise _corrupt(path, f"{key} is a link to another file or place")
    ds = f[key]
    if not isinstance(ds, h5py.Dataset):
        raise _corrupt(path, f"{key} is not a dataset")
    if ds.external or ds.is_virtual:
        raise _corrupt(path, f"{key} keeps its data outside the shard")
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
            raise _corrupt(path, f"{key} is not a column of integers")
        if n is None:
            n = int(ds.shape[0])
        elif ds.shape[0] != n:
            raise _corrupt(path, f"{key} has {ds.shape[0]} rows, token_id has {n}")
    if rows is not None and n != rows:
        raise _corrupt(path, f"it stores {n} rows, its manifest entry says {rows}")
    for name in layers:
        ds = _own_dataset(f, f"layers/{name}", path)
        if ds.ndim != 2 or ds.dtype.kind != "f":
            raise _corrupt(path, f"layer {name} is not a (rows, D) float array")
        if ds.shape[0] != n:
            raise _corrupt(path, f"layer {name} has {ds.shape[0]} rows, the index has {n}")
        if dim is not None and ds.shape[1] != dim:
            raise _corrupt(path, f"layer {name} is {ds.shape[1]} wide, the run's layers {dim}")
        if f.get(f"nonfinite/{name}", getlink=True) is not None:
            flags = _own_dataset(f, f"nonfinite/{name}", path)
            if flags.shape != (n,) or flags.dtype.kind not in "bui":
                raise _corrupt(path, f"the non-finite flags of layer {name} are not {n} booleans")
    return n


def verify_layout(path, layers, *, rows: int | None = None, dim: int | None = None) -> None:
    """:func:`check_layout` of a shard (``inspect --verify``: a shard that would stop ``score`` is
    reported as damaged there too)."""
    path = remote.location(path)
    with _open(path) as f:
        try:
            check_layout(f, path, layers, rows=rows, dim=dim)
        except READ_ERRORS as e:
            raise _corrupt(path, str(e)) from e


def read_shard_index(path: Path, rows: int | None = None) -> dict[str, np.ndarray]:
    """The per-row metadata of a shard (token_id, doc_id, position, is_special), no activations;
    ``rows``: the manifest's count, checked before anything is read."""
    path = remote.location(path)
    with _open(path) as f:
        try:
            check_layout(f, path, rows=rows)
            return {k: f[k][:] for k in (*META_FIELDS, "is_special")}
        except READ_ERRORS as e:
            raise _corrupt(path, str(e)) from e


def shard_dim(path: Path, layer: str) -> int:
    """The width D of ``layer`` in one shard."""
    path = remote.location(path)
    with _open(path) as f:
        try:
            return int(f["layers"][layer].shape[1])
        except (OSError, KeyError) as e:
            raise _corrupt(path, str(e).split("(")[0].strip()) from e


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
                raise _corrupt(self.path, "a chunk of rows ends past the end of the file")
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
    before anything is read. ``expected``: the shard's :func:`identity` when it was planned (checked
    on the open file). ``docs``: the documents [start, stop) its manifest entry assigns it; a row of
    another document is refused (it would be counted twice, or in the wrong jackknife group).
    """
    path = remote.location(path)
    with _open(path, expected) as f, contextlib.closing(_RowReader(path, f)) as reader:
        try:
            stored = f["layers"]
            if not isinstance(stored, h5py.Group):
                raise _corrupt(path, "its layers are not a group of datasets")
            names = list(stored.keys()) if layers is None else list(layers)
            for n in names:
                if n not in stored:
                    raise _corrupt(path, f"it has no layer {n!r}, which the run lists")
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
                    raise _corrupt(path, f"layer {ds.name} has {ds.shape[0]} rows, index has {n_rows}")
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
            raise _corrupt(path, _h5_reason(e)) from e


def _h5_reason(e: BaseException) -> str:
    """The first words of what h5py or numpy said, without HDF5's parenthesised detail and quotes."""
    return str(e).split("(")[0].strip().strip("\"'").strip() or type(e).__name__


def check_documents(path, doc_id: np.ndarray, docs: tuple[int, int]) -> None:
    """Every document id of a shard's rows lies in [start, stop), the range its entry assigns it."""
    if doc_id.size and (int(doc_id.min()) < docs[0] or int(doc_id.max()) >= docs[1]):
        raise _corrupt(
            path,
            f"it stores rows of documents {int(doc_id.min())}..{int(doc_id.max())}, outside its range "
            f"{docs[0]}..{docs[1] - 1}",
        )


def shard_counts(path: Path, rows: int | None = None) -> tuple[int, int]:
    """(rows, distinct documents) actually stored in a shard (``rows``: see read_shard_index)."""
    idx = read_shard_index(path, rows)
    return int(idx["doc_id"].shape[0]), int(np.unique(idx["doc_id"]).size)


def verify_shard(path: Path, info: ShardInfo) -> None:
    """Check size and checksum of a shard (a path, or a URL whose bytes are streamed through fsspec)
    against its manifest entry (DataError if they differ)."""
    path = remote.location(path)
    if not remote.exists(path):
        raise _missing(path)
    check_regular_file(path)
    try:
        size = remote.size(path)
        if size != info.bytes:
            raise _corrupt(path, f"{size} bytes on disk, {info.bytes} recorded")
        digest = info.digest
        same = digest is not None and checksum.matches(path, digest)
    except FileNotFoundError as e:
        raise _missing(path) from e
    except OSError as e:
        raise _corrupt(path, f"cannot read it: {e}") from e
    if not same:
        raise _corrupt(path, "checksum differs from the manifest")


def _read_manifest(run_dir) -> dict:
    """The checked manifest of a run at a location: a URL's JSON text is read through fsspec and
    goes through the same checks as a local manifest (a shard ``file`` must be a plain shard name)."""
    mpath = remote.join(run_dir, MANIFEST_NAME)
    if not remote.is_url(mpath):
        return read_manifest(mpath)
    import json

    try:
        m = json.loads(remote.read_text(mpath))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(
            f"{mpath} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "check the run at that URL, or extract it again"
        ) from e
    return check_manifest(m, mpath)


class Run:
    """A run directory opened for reading: a path, or an fsspec URL (``self.dir`` is then the URL
    string, and :meth:`shard_path` gives URLs)."""

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
        self.manifest = _read_manifest(self.dir)
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

    def resolve_layers(self, wanted: list[str] | None) -> list[str]:
        """Map user layer names or indices (``"3"``, ``"-1"``, ``"layer_03"``) to stored layer names."""
        names = self.layer_names
        if not wanted:
            return names
        out = []
        for w in wanted:
            w = str(w).strip()
            if w in names:
                out.append(w)
                continue
            by_index = {str(layer.get("index")): layer["name"] for layer in self.layers}
            if w in by_index:
                out.append(by_index[w])
                continue
            try:
                i = int(w)
            except ValueError:
                i = None
            if i is not None and -len(names) <= i < 0:
                out.append(names[i])
                continue
            raise InputError(f"layer {w!r} is not in this run (it has {', '.join(names)}); pick one of those")
        return out

    def __repr__(self) -> str:
        return (
            f"Run({str(self.dir)!r}, layers={len(self.layer_names)}, rows={self.total_rows}, "
            f"complete={self.complete})"
        )
