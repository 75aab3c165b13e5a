"""Writing one HDF5 shard: appended batch by batch, chunk-aligned, atomically published."""

from __future__ import annotations

import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import numpy as np

from geomscope.errors import InputError
from geomscope.fileio import create_exclusive, fsync_dir
from geomscope.store import checksum
from geomscope.store.chunks import chunk_spans, stored_as_rows
from geomscope.store.names import SHARD_FORMAT

CHUNK_BYTES = 2 * 1024 * 1024  # target bytes per (rows, D) chunk of a layer dataset
META_FIELDS = ("token_id", "doc_id", "position")
#: rows whose per-row fields (META_FIELDS, is_special, flags: ~30 bytes a row) are written together
META_BLOCK_ROWS = 1 << 16
#: optional per-row booleans a shard may hold besides is_special: loss_target = the loss has a
#: prediction at this row (gradient runs: the next token, or a masked token)
ROW_FLAGS = ("loss_target",)


@dataclass
class ShardInfo:
    """What the manifest records about a finished shard."""

    index: int
    file: str
    rows: int
    docs: int
    doc_start: int  # first document id (inclusive) assigned to this shard
    doc_stop: int  # last document id (exclusive)
    nonfinite_rows: int
    bytes: int
    sha256: str
    tokens: int | None = None  # token rows measured (= rows unless the run keeps a sample); None: absent
    xxh3_128: str | None = None  # the checksum that is checked (store/checksum.py); None: absent

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ShardInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @property
    def digest(self) -> tuple[str, str] | None:
        """(algorithm, hex digest) to check the file against (``checksum.expected``)."""
        return checksum.expected(self)

    @property
    def documents(self) -> tuple[int, int] | None:
        """The documents [start, stop) this shard's entry assigns it; None where it records none
        (0..0: a shard written through the library without a plan, as before ranges were checked)."""
        return (self.doc_start, self.doc_stop) if self.doc_stop > self.doc_start else None

    @property
    def n_tokens(self) -> int:
        """Token rows this shard measured: its stored rows, or more when it keeps a sample."""
        return self.rows if self.tokens is None else int(self.tokens)


def nonfinite_rows(a: np.ndarray) -> np.ndarray:
    """(rows,) bool: rows of a 2-d float array holding a NaN or an Inf.

    float16 is checked on its bits (exponent all ones), which is ~7x faster than ``np.isfinite`` on
    numpy's emulated half floats.
    """
    if a.dtype == np.float16:
        return ((a.view(np.uint16) & 0x7C00) == 0x7C00).any(axis=1)
    return ~np.isfinite(a).all(axis=1)


def chunk_rows_for(dim: int, itemsize: int) -> int:
    return max(64, CHUNK_BYTES // max(1, dim * itemsize))


def _rows_in_place():
    """Creation settings of a layer dataset: each chunk's file space is allocated when ``resize``
    takes the dataset over it, never filled (every row is written once), so its place in the file is
    known before its rows are written and :class:`_DirectRows` can write them there."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


class _DirectRows:
    """Writes a layer's rows with ``os.pwrite`` straight into the chunks HDF5 allocated for them.

    h5py holds the GIL for the whole of a write, and extract's store thread writes while the thread
    that feeds the GPU needs it for every kernel it queues; ``os.pwrite`` releases it. Rows may start
    and end anywhere in a chunk: its file space exists from the ``resize`` on. Once h5py has had to
    write a dataset it writes all the rest of it, so no chunk that h5py holds in its cache is written
    here behind its back (a chunk written here before, h5py reads from the file). Where the rows cannot
    be placed (``store/chunks.py``: an HDF5 before 1.10.5, say) :meth:`write` returns False and h5py
    writes."""

    def __init__(self, path: Path):
        # os.pwrite is POSIX's; elsewhere h5py writes every row
        self._fd: int | None = os.open(path, os.O_WRONLY) if hasattr(os, "pwrite") else None
        self._by_h5py: set[str] = set()
        self._as_rows: dict[str, bool] = {}

    @property
    def usable(self) -> bool:
        """Whether every layer written so far was written here (so rows need not be chunk-aligned)."""
        return self._fd is not None and not self._by_h5py

    def write(self, ds: h5py.Dataset, start: int, rows: np.ndarray) -> bool:
        """Write ``rows`` (already in the dataset's dtype) as rows ``start:`` of ``ds`` (already
        resized over them); False when h5py must."""
        if self._fd is None or ds.name in self._by_h5py or not len(rows):
            return False
        if ds.name not in self._as_rows:  # its layout, looked up once
            self._as_rows[ds.name] = stored_as_rows(ds)
        spans = chunk_spans(ds, start, start + len(rows)) if self._as_rows[ds.name] else None
        if spans is None or rows.dtype != ds.dtype:
            self._by_h5py.add(ds.name)
            return False
        flat = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))
        at = 0
        for offset, nbytes in spans:
            piece = flat[at : at + nbytes]
            while len(piece):
                written = os.pwrite(self._fd, piece, offset)
                piece, offset = piece[written:], offset + written
            at += nbytes
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_DIGEST_POOL: ThreadPoolExecutor | None = None
_DIGEST_POOL_LOCK = threading.Lock()


def _digest_pool() -> ThreadPoolExecutor:
    """The threads that checksum finished shards (at most 4, at most one per CPU): hashing releases
    the GIL, so shards finished in quick succession are checksummed side by side."""
    global _DIGEST_POOL
    with _DIGEST_POOL_LOCK:
        if _DIGEST_POOL is None:
            workers = max(1, min(4, os.cpu_count() or 1))
            _DIGEST_POOL = ThreadPoolExecutor(workers, thread_name_prefix="geomscope-checksum")
        return _DIGEST_POOL


def _forget_digest_pool() -> None:  # a forked child has none of its parent's threads
    global _DIGEST_POOL
    _DIGEST_POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_digest_pool)


class ShardWriter:
    """Append token rows of every captured layer to one shard.

    A layer's rows go straight to their place in the file as they are appended (:class:`_DirectRows`),
    the per-row fields in blocks of :data:`META_BLOCK_ROWS` rows. Where h5py must write a layer, rows
    are buffered until a whole chunk is ready, so that its writes are chunk-aligned.  HDF5
    stores whole chunks, so a writer that knows how many rows the shard will get passes
    ``expected_rows`` and small shards get small chunks (a 10-row shard would otherwise take 2 MiB
    per layer).  The file lives under ``.<name>.tmp`` until :meth:`close`, which flushes, fsyncs
    and renames it; a crash leaves at most a temporary file that the next run deletes.
    """

    def __init__(
        self,
        path: Path,
        *,
        index: int,
        layer_names: list[str],
        dim: int,
        store_dtype: str = "float16",
        doc_start: int = 0,
        doc_stop: int = 0,
        expected_rows: int | None = None,
        row_flags: tuple[str, ...] = (),
        dims: dict[str, int] | None = None,
    ):
        self.path = Path(path)
        unknown = set(row_flags) - set(ROW_FLAGS)
        if unknown:
            raise ValueError(f"unknown row flags {sorted(unknown)}; known: {ROW_FLAGS}")
        self.row_flags = tuple(row_flags)
        # a fresh name created exclusively (never through a planted link); the next run deletes leftovers
        self.tmp_path = self.path.with_name(f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        self.index = index
        self.layer_names = list(layer_names)
        self.dim = int(dim)
        # each layer's width: ``dims``'s where it gives one (a module layer of another width), else D
        self.dims = {name: int((dims or {}).get(name, self.dim)) for name in self.layer_names}
        self.dtype = np.dtype(store_dtype)
        if self.dtype not in (np.dtype("float16"), np.dtype("float32")):
            raise InputError(f"store dtype must be float16 or float32, not {store_dtype}")
        # the documents [start, stop) assigned to this shard (extract's plan: score refuses a row
        # outside them); 0..0, the default, records none (a shard written through the library)
        self.doc_start, self.doc_stop = doc_start, doc_stop
        # one number of rows per chunk for every layer (rows are buffered and written chunk-aligned
        # for all layers together), sized by the widest
        self.chunk = chunk_rows_for(max(self.dims.values(), default=self.dim), self.dtype.itemsize)
        if expected_rows is not None:  # HDF5 allocates whole chunks: do not make them larger than the shard
            self.chunk = max(1, min(self.chunk, int(expected_rows)))
        self.rows = 0
        self.nonfinite_rows = 0
        # rows with NaN/Inf per layer (layers without any absent)
        self.nonfinite_by_layer: dict[str, int] = {}
        self._docs: set[int] = set()
        self._measured: dict | None = None  # a sample shard's counts over every row it measured
        self._buf: list[dict] = []
        self._buf_rows = 0
        os.close(create_exclusive(self.tmp_path))
        self._f = h5py.File(self.tmp_path, "w")
        # each array of an appended batch (a layer "L:name", its NaN/Inf flags "N:name", a row field)
        # -> its dataset, opened once: an h5py lookup by name costs as much as a small write
        self._datasets: dict[str, h5py.Dataset] = self._create_datasets()
        # the per-row fields and flags of rows already in the layers, written META_BLOCK_ROWS at a time
        self._meta_parts: list[dict] = []
        self._meta_rows = 0
        self._digests = None  # the checksums of the finished file, started by finish()
        self._direct = _DirectRows(self.tmp_path)

    def _create_datasets(self) -> dict[str, h5py.Dataset]:
        """Write the shard's attributes into the new file and create its empty datasets, growable
        by rows and chunked ``chunk`` rows at a time: per layer its rows (``layers/<name>``, laid out
        by :func:`_rows_in_place`) and their NaN/Inf flags (``nonfinite/<name>``), and the per-row
        fields and flags. Returns them by the key of their array in an appended batch."""
        self._f.attrs["format"] = SHARD_FORMAT
        self._f.attrs["shard_index"] = self.index
        self._f.attrs["layer_names"] = np.array(self.layer_names, dtype=h5py.string_dtype())
        g = self._f.create_group("layers")
        nf = self._f.create_group("nonfinite")
        datasets: dict[str, h5py.Dataset] = {}
        for name in self.layer_names:
            d = self.dims[name]
            datasets["L:" + name] = g.create_dataset(
                name,
                shape=(0, d),
                maxshape=(None, d),
                dtype=self.dtype,
                chunks=(self.chunk, d),
                dcpl=_rows_in_place(),
            )
            datasets["N:" + name] = nf.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=bool, chunks=(self.chunk * 8,)
            )
        for name in META_FIELDS:
            datasets[name] = self._f.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(self.chunk * 4,)
            )
        for name in ("is_special", *self.row_flags):
            datasets[name] = self._f.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=bool, chunks=(self.chunk * 8,)
            )
        return datasets

    def append(self, layers: dict, token_id, doc_id, position, is_special, nonfinite=None, **flags) -> None:
        """Add rows: ``layers[name]`` is (rows, D) for every layer name (D: the layer's width); the
        rest are (rows,), and
        ``flags`` gives each of the writer's ``row_flags``. ``nonfinite``: optionally, per layer,
        the (rows,) bool NaN/Inf check the caller already made of those very values (extract does
        it on the GPU); used only for a layer given in the store dtype, else checked here."""
        n = len(token_id)
        if n == 0:
            return
        if set(flags) != set(self.row_flags):
            raise ValueError(f"row flags {sorted(flags)} given; this shard holds {list(self.row_flags)}")
        batch = {
            "token_id": np.asarray(token_id, np.int64),
            "doc_id": np.asarray(doc_id, np.int64),
            "position": np.asarray(position, np.int64),
            "is_special": np.asarray(is_special, bool),
            **{k: np.asarray(v, bool) for k, v in flags.items()},
        }
        any_bad = np.zeros(n, bool)
        for name in self.layer_names:
            a = np.asarray(layers[name])
            if a.shape != (n, self.dims[name]):
                raise ValueError(f"layer {name}: expected shape {(n, self.dims[name])}, got {a.shape}")
            # cast first: NaN/Inf survive the cast, and values that overflow the store dtype become Inf,
            # so one check of the stored values flags both
            with np.errstate(over="ignore", invalid="ignore"):
                stored = a.astype(self.dtype, copy=False)
            given = None if nonfinite is None or a.dtype != self.dtype else nonfinite.get(name)
            bad = nonfinite_rows(stored) if given is None else np.asarray(given, bool).reshape(n)
            any_bad |= bad
            batch["L:" + name] = stored
            batch["N:" + name] = bad
            if bad.any():
                self.nonfinite_by_layer[name] = self.nonfinite_by_layer.get(name, 0) + int(bad.sum())
        self.nonfinite_rows += int(any_bad.sum())
        self._docs.update(np.unique(batch["doc_id"]).tolist())
        if not self._buf and self._direct.usable:
            # every layer so far went in place: these rows go to their place in the file now, whatever
            # chunk they start in -- no chunk assembled by copying, no tail kept (copies hold the GIL)
            self._write(batch)
            return
        self._buf_rows += n
        if self._buf_rows >= self.chunk:
            self._buf.append(batch)
            self._flush(final=False)
        else:  # kept past this call: own the data (the caller may reuse its arrays)
            self._buf.append({k: np.array(v, copy=True) for k, v in batch.items()})

    def _flush(self, final: bool) -> None:
        """Write every whole chunk buffered (everything when ``final``), chunk-aligned.

        All buffered pieces but the last hold fewer than ``chunk`` rows together, so only the first
        chunk is assembled by copying; the rest of the last piece is written straight from it and
        only its tail (< one chunk) is kept, as a copy.
        """
        if not self._buf:
            return
        take = self._buf_rows if final else (self._buf_rows // self.chunk) * self.chunk
        if take == 0:
            return
        *head, last = self._buf
        h = sum(len(p["token_id"]) for p in head)
        if h:
            k = min(take, self.chunk) - h  # rows of `last` that complete the first chunk
            self._write({key: np.concatenate([*(p[key] for p in head), last[key][:k]]) for key in last})
            last = {key: v[k:] for key, v in last.items()}
            take -= h + k
        if take:
            self._write({key: v[:take] for key, v in last.items()})
            last = {key: v[take:] for key, v in last.items()}
        self._buf_rows = len(last["token_id"])
        self._buf = [{key: v.copy() for key, v in last.items()}] if self._buf_rows else []

    def _write(self, arrays: dict) -> None:
        """Write the layers' rows now; keep the per-row fields for :meth:`_write_meta`."""
        n = len(arrays["token_id"])
        start, stop = self.rows, self.rows + n
        meta = {}
        for key, arr in arrays.items():
            if key.startswith("L:"):
                ds = self._datasets[key]
                ds.resize(stop, axis=0)
                if not self._direct.write(ds, start, arr):
                    ds[start:stop] = arr
            else:
                meta[key] = np.array(arr, copy=True)  # may be a view of the caller's arrays
        self.rows = stop
        self._meta_parts.append(meta)
        self._meta_rows += n
        if self._meta_rows >= META_BLOCK_ROWS:
            self._write_meta()

    def _write_meta(self) -> None:
        """Write the per-row fields and flags kept since the last call: a few bytes a row, but each
        h5py call holds the GIL (extract's thread that feeds the GPU waits meanwhile), so they go in
        blocks of many chunks of rows rather than one call per dataset per chunk."""
        if not self._meta_parts:
            return
        start = self.rows - self._meta_rows
        for key in self._meta_parts[0]:
            ds = self._datasets[key]
            ds.resize(self.rows, axis=0)
            ds[start : self.rows] = np.concatenate([part[key] for part in self._meta_parts])
        self._meta_parts, self._meta_rows = [], 0

    def keep_accumulators(self, keeper, sample: int, seed: int) -> None:
        """Make this a ``--keep sample:N`` shard: store the keeper's sample rows and accumulators
        (store/accumulators.py) and count every row it measured, not only the stored ones."""
        from geomscope.store.accumulators import GROUP, MASSIVE_GROUP, write_moments, write_top_abs

        acc, rows, meta = keeper.result()
        self.append(rows, **meta)
        g = self._f.create_group(GROUP)
        for name, parts in acc.items():
            lg = g.create_group(name)
            for part, m in parts.items():
                if part == "regular" or m.n:
                    write_moments(lg, part, m)
        g = self._f.create_group(MASSIVE_GROUP)
        for name, parts in keeper.tops.items():
            lg = g.create_group(name)
            for part, top in parts.items():
                write_top_abs(lg, part, top)
        self._f.attrs["keep"] = "sample"
        self._f.attrs["sample_size"] = int(sample)
        self._f.attrs["sample_seed"] = int(seed)
        self._f.attrs["tokens"] = int(keeper.tokens)
        self._measured = {
            "tokens": int(keeper.tokens),
            "docs": len(keeper.docs),
            "nonfinite_rows": int(keeper.nonfinite_rows),
            "nonfinite_by_layer": dict(keeper.nonfinite_by_layer),
        }
        self.nonfinite_by_layer = dict(keeper.nonfinite_by_layer)

    def close(self) -> ShardInfo:
        """Flush, fsync and publish the shard under its final name; return its manifest entry."""
        self.finish()
        return self.publish()

    def finish(self) -> None:
        """Write the buffered rows and close the HDF5 file: the shard is complete, still under its
        temporary name (:meth:`publish` does the rest, possibly in another thread)."""
        self._flush(final=True)
        self._write_meta()
        self._f.attrs["rows"] = self.rows
        self._f.attrs["doc_start"] = self.doc_start
        self._f.attrs["doc_stop"] = self.doc_stop
        self._f.flush()
        self._f.close()
        self._direct.close()
        # the checksums start now, in a pool shared by the process's shards: publishing waits for
        # them in shard order, while a shard's checksums run beside the one before's (each reads the
        # whole file at sha256's ~1 GB/s, most of the time a fast device needs to store a shard)
        self._digests = _digest_pool().submit(checksum.digests, self.tmp_path)

    def publish(self) -> ShardInfo:
        """Checksum and fsync the finished file, rename it to its final name and return its
        manifest entry."""
        # the checksums (reading the file back from the page cache: CPU) while fsync waits for the disk
        with open(self.tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        digests = self._digests.result() if self._digests else checksum.digests(self.tmp_path)
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        return ShardInfo(
            index=self.index,
            file=self.path.name,
            rows=self.rows,
            docs=self._measured["docs"] if self._measured else len(self._docs),
            doc_start=self.doc_start,
            doc_stop=self.doc_stop,
            nonfinite_rows=self._measured["nonfinite_rows"] if self._measured else self.nonfinite_rows,
            bytes=self.path.stat().st_size,
            sha256=digests[checksum.SLOW],
            tokens=self._measured["tokens"] if self._measured else self.rows,
            xxh3_128=digests[checksum.FAST],
        )

    def abort(self) -> None:
        """Drop the unfinished shard."""
        try:
            self._f.close()
        except Exception:
            pass
        self._direct.close()
        self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
