"""Activation files of other tools: named 2-D arrays, one per layer, aligned by row.

Every reader answers two questions, without loading a layer whole:

- :func:`describe` -- which layers a path holds (name -> rows, width, dtype) and how it splits into
  independent read units (:class:`FilePart`: one file, a row range, its first global row);
- :func:`read_rows` -- the rows ``[start, stop)`` of a part, in blocks of at most ``block_rows``,
  as ``{layer: (m, D) array}`` plus the optional per-row ``doc_id`` and ``special`` columns.

Formats (``FORMATS``):

- ``npz`` -- one layer per member. Members stored uncompressed are memory-mapped (random access);
  compressed members are streamed from the start, so such a file is one read unit. A compressed
  member in Fortran (column) order holds no row until its last column: it is read whole (bounded
  by memory; numpy.savez, or C order, streams).
- ``safetensors`` -- one layer per tensor, read by row slices (memory-mapped by the library).
- ``pt`` -- ``torch.load(weights_only=True)`` only: a tensor, a dict of tensors or a list/tuple of
  tensors (named as a run names hidden states: ``layer_00``, ``layer_01`` ...). Zip-format files
  are memory-mapped; a legacy (non-zip) file is loaded whole, so it is one read unit; nothing is
  ever unpickled.
- ``arrow`` -- Arrow IPC files (file or stream format), a ``datasets.save_to_disk`` directory, or a
  directory of such directories (SAELens' activation cache: one ``shard_i`` dataset per buffer);
  ``parquet`` -- a Parquet file or a directory of them, each row group decoded a block at a time
  (memory follows the block, not the writer's row-group size). An IPC file is decoded a record
  batch at a time as it is read (opening it reads headers only); a compressed batch, or a Parquet
  page, is decompressed whole, so what its header declares it decompresses to is held against
  ``--memory-mb`` before anything is (:meth:`_ArrowFile.check_decoded`, decoded_sizes.py). A
  column whose cells are vectors is a layer with one row per cell; a column whose cells are
  matrices (datasets' ``Array2D``, SAELens: ``context_size x d_in``) is a layer with one row per
  matrix row. Integer ``doc_id`` and boolean ``special`` columns, when present (``geomscope
  export`` writes them), give the jackknife document groups and ``--exclude-special`` their
  meaning; a layer column's field metadata ``geomscope.layer_index`` (export writes it) is the
  layer's index in the model.

Layers read together must have the same number of rows (they describe the same tokens) and the same
width; ``--column`` picks among them. Every cell of a layer holds numbers (a null cell, a null inside
one or a null ``doc_id`` is a one-line error), every matrix cell as many rows as the first; an Arrow
IPC batch is validated in full before it is read (a crafted list offset aborted the process), and a
data directory holds regular files only (a FIFO there blocked for ever).
"""

from __future__ import annotations

import math
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geomscope.errors import DataError, InputError, first_line
from geomscope.fileio import read_json
from geomscope.layers import layer_name
from geomscope.schema import LAYER_INDEX_KEY
from geomscope.score.decoded_sizes import HeaderError, ipc_messages, parquet_pages

FORMATS = ("npz", "safetensors", "pt", "arrow", "parquet")
SUFFIX_FORMATS = {
    ".npz": "npz",
    ".safetensors": "safetensors",
    ".pt": "pt",
    ".pth": "pt",
    ".arrow": "arrow",
    ".parquet": "parquet",
}
META_COLUMNS = ("doc_id", "special")  # optional per-row columns of arrow/parquet sources
EXPORT_META_COLUMNS = ("doc_id", "position", "token_id", "special")  # what `geomscope export` adds


@dataclass(frozen=True)
class FilePart:
    """One independent read unit: rows ``[start, stop)`` of one file, the first being global row
    ``offset`` of the source."""

    path: str
    start: int
    stop: int
    offset: int


@dataclass
class Layout:
    """What :func:`describe` finds: layers (name -> (rows, width, dtype name)), the read units, and
    which optional per-row columns exist."""

    fmt: str
    layers: dict[str, tuple[int, int, str]]
    parts: list[FilePart]
    meta: tuple[str, ...] = ()
    files: int = 1
    notes: list[str] = field(default_factory=list)
    indices: dict[str, int] = field(default_factory=dict)  # layer -> index in the model, where recorded


@dataclass
class Rows:
    start: int  # global row of the first row
    layers: dict[str, np.ndarray]
    doc_id: np.ndarray | None = None
    special: np.ndarray | None = None


def format_of(path: Path) -> str | None:
    """The format a path is read as, or None when it is not one of :data:`FORMATS`."""
    if path.is_dir():
        return _dir_format(path)
    return SUFFIX_FORMATS.get(path.suffix.lower())


def _dir_format(path: Path) -> str | None:
    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        return "arrow"
    if any(path.glob("*.parquet")):
        return "parquet"
    if any(path.glob("*.arrow")) or any((d / "state.json").exists() for d in _subdirs(path)):
        return "arrow"
    return None


def _subdirs(path: Path) -> list[Path]:
    return sorted((d for d in path.iterdir() if d.is_dir()), key=_natural)


def _natural(p: Path):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _check_2d(path: Path, name: str, shape: tuple, kind: str) -> None:
    if len(shape) != 2:
        raise InputError(
            f"{path}: {name!r} has shape {tuple(shape)}; score expects 2-D (N, D) arrays "
            "(rows = token vectors); save X.reshape(-1, X.shape[-1]) or pick others with --column"
        )
    if kind not in "fiu":
        raise InputError(f"{path}: {name!r} holds {kind!r}-kind numbers; score expects real numbers")


def describe(
    path: Path, fmt: str, columns: list[str] | None, block_rows: int, memory_mb: float | None = None
) -> Layout:
    """The layers of ``path`` (only ``columns`` when given) and its read units; InputError (one
    line) when the file cannot be read, a named column is missing or is not a 2-D float array, or
    the layers do not line up, or (``memory_mb``: score's --memory-mb; None: no bound) where one
    compressed Arrow batch or Parquet page decompresses to more than it."""
    if fmt in ("arrow", "parquet"):
        lay = _arrow_describe(path, fmt, columns, block_rows, memory_mb)
    else:
        reader = {"npz": _npz_describe, "safetensors": _st_describe, "pt": _pt_describe}[fmt]
        lay = reader(path, fmt, columns, block_rows)
    if not lay.layers:
        raise InputError(
            f"{path} holds no 2-D numeric array to score"
            + (f" among {', '.join(columns)}" if columns else "")
            + "; save one (N, D) array per layer"
        )
    if len({n for n, _, _ in lay.layers.values()}) > 1:  # (each layer may have its own width)
        listing = ", ".join(f"{k} {n}x{d}" for k, (n, d, _) in lay.layers.items())
        raise InputError(
            f"{path}: the layers differ in shape ({listing}); layers scored together describe the same "
            "tokens -- pick those that match with --column"
        )
    n, d = min((n, d) for n, d, _ in lay.layers.values())
    if n < 2 or d < 2:
        raise DataError(
            f"{path} is {n} x {d}; at least 2 rows (points) and 2 columns (dimensions) are needed"
        )
    return lay


def _pick(path: Path, found: dict, columns: list[str] | None, what: str) -> dict:
    """``found`` restricted to ``columns`` (in that order), with a one-line error naming what exists."""
    if not columns:
        return found
    missing = [c for c in columns if c not in found]
    if missing:
        have = ", ".join(list(found)[:12]) or "none"
        raise InputError(f"{path} has no {what} {missing[0]!r} (it has {have}); name one with --column")
    return {c: found[c] for c in columns}


def _row_parts(path: Path, n: int, block_rows: int, offset: int = 0) -> list[FilePart]:
    return [FilePart(str(path), s, min(n, s + block_rows), offset + s) for s in range(0, n, block_rows)]


# --------------------------------------------------------------------------------------- npz
def npy_header(f) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy stream ``f``, which is left at the data; ValueError
    for a header numpy cannot parse or whose shape is not of counts (a negative dimension, which
    numpy maps as a length that overflows)."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    if any(n < 0 for n in shape):
        raise ValueError(f"its header declares shape {tuple(shape)}, with a negative dimension")
    return shape, fortran, dtype


# what a damaged member raises when it is opened or its header read: a bad local header
# (BadZipFile), an encrypted entry (RuntimeError), an unknown compression method
# (NotImplementedError), a corrupt deflate stream (zlib.error), a file cut short (EOFError, and
# struct.error for a local header cut short)
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    RuntimeError,
    NotImplementedError,
    OSError,
    EOFError,
    zlib.error,
    struct.error,
)


@dataclass(frozen=True)
class _Member:
    """One .npy member of an .npz file, from its headers only."""

    info: zipfile.ZipInfo
    shape: tuple
    dtype: np.dtype
    fortran: bool
    data_at: int  # offset of the data in the zip file; -1 when compressed
    header_len: int  # bytes of the .npy header before the data

    @property
    def nbytes(self) -> int:
        # Python ints: np.prod wraps in int64, and a crafted (2**33, 2**31) passed the size check
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole(self) -> bool:
        """Compressed in Fortran (column) order: no row is complete before the last column is
        decompressed, so the member is read whole (streaming it as rows scrambled them)."""
        return self.data_at < 0 and self.fortran and len(self.shape) > 1


def _npz_members(path: Path) -> dict[str, _Member]:
    """member name -> :class:`_Member`, read from the .npy headers only; InputError (one line) for a
    damaged archive or member."""
    out = {}
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise InputError(f"{path} is not a readable .npz file ({e}); save it with numpy.savez") from e
    with zf, open(path, "rb") as raw:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            try:
                with zf.open(info) as f:
                    try:
                        shape, fortran, dtype = npy_header(f)
                    except ValueError as e:
                        raise InputError(f"{path}: member {info.filename} is not a .npy array ({e})") from e
                    header_len = f.tell()
                data_at = -1
                if info.compress_type == zipfile.ZIP_STORED:
                    raw.seek(info.header_offset)
                    local = raw.read(30)
                    name_len, extra_len = struct.unpack("<HH", local[26:30])
                    data_at = info.header_offset + 30 + name_len + extra_len + header_len
            except _ZIP_ERRORS as e:
                raise InputError(
                    f"{path}: member {info.filename} cannot be read ({first_line(e, 160)}); the file is "
                    "damaged or not one numpy.savez writes -- save the arrays again"
                ) from None
            if dtype.hasobject:
                raise InputError(
                    f"{path}: member {info.filename} holds Python objects; geomscope never unpickles -- "
                    "save numeric arrays"
                )
            out[info.filename[: -len(".npy")]] = _Member(
                info, tuple(shape), dtype, fortran, data_at, header_len
            )
    return out


def _whole_bytes_limit() -> int:
    """The most bytes of compressed Fortran-order members read whole into memory: a quarter of this
    machine's memory (the score's accumulators need the rest); 4 GiB where the OS does not say."""
    from geomscope.score import resources

    total = resources.physical_memory()
    return total // 4 if total else 4 << 30


def _check_members(path: Path, members: dict[str, _Member]) -> None:
    """InputError (one line) unless every member holds the bytes its header declares, and the
    members read whole fit in memory -- checked before anything is allocated from a shape."""
    size = path.stat().st_size
    for k, m in members.items():
        if m.data_at >= 0 and m.data_at + m.nbytes > size:
            raise InputError(f"{path}: member {k!r} is truncated (the file ends before its data does)")
        # the archive's own record of the member's size: the decompression stops there
        if m.data_at < 0 and m.header_len + m.nbytes > m.info.file_size:
            raise InputError(
                f"{path}: member {k!r} is truncated (it declares shape {m.shape} but holds "
                f"{max(0, m.info.file_size - m.header_len)} bytes of data); save it again"
            )
        # a member read whole is allocated from its shape: deflate expands at most ~1032:1, so a
        # shape beyond that of the whole file is a crafted one (whatever the archive records)
        if m.whole and m.info.compress_type == zipfile.ZIP_DEFLATED and m.nbytes > 1100 * size:
            raise InputError(
                f"{path}: member {k!r} declares shape {m.shape}, more than its compressed bytes can hold; "
                "the file is damaged -- save it again"
            )
    whole = sum(m.nbytes for m in members.values() if m.whole)
    if whole > _whole_bytes_limit():
        raise InputError(
            f"{path}: its compressed Fortran-order members ({whole / 2**30:.1f} GiB) are read whole and "
            "do not fit in memory; save them with numpy.savez (uncompressed) or in C order "
            "(np.ascontiguousarray(X))"
        )


def _npz_describe(path: Path, fmt: str, columns, block_rows: int) -> Layout:
    members = _pick(path, _npz_members(path), columns, "array")
    layers = {}
    for name, m in members.items():
        if columns or (len(m.shape) == 2 and m.dtype.kind in "fiu"):
            _check_2d(path, name, m.shape, m.dtype.kind)
            layers[name] = (m.shape[0], m.shape[1], m.dtype.name)
    n = next(iter(layers.values()))[0] if layers else 0
    _check_members(path, {k: members[k] for k in layers})
    stored = all(members[k].data_at >= 0 for k in layers)
    parts = _row_parts(path, n, block_rows) if stored else [FilePart(str(path), 0, n, 0)]
    notes = (
        [] if stored else ["compressed .npz: read in one stream (save with numpy.savez for parallel reads)"]
    )
    if any(members[k].whole for k in layers):
        notes.append("compressed Fortran-order member: read whole into memory (save in C order to stream it)")
    return Layout(fmt, layers, parts, notes=notes)


def _npz_rows(part: FilePart, names: list[str], block_rows: int) -> Iterator[Rows]:
    path = Path(part.path)
    members = {n: m for n, m in _npz_members(path).items() if n in names}
    _check_members(path, members)  # again: this read may come from a file replaced since
    mapped, streams = {}, {}
    zf = zipfile.ZipFile(part.path)
    try:
        for n in names:
            m = members[n]
            if m.data_at >= 0:
                order = "F" if m.fortran else "C"
                mapped[n] = np.memmap(part.path, m.dtype, "r", offset=m.data_at, shape=m.shape, order=order)
            elif m.whole:  # (bounded by _check_members) its rows are then slices of the array
                with zf.open(m.info) as f:
                    mapped[n] = np.lib.format.read_array(f, allow_pickle=False)
            else:  # compressed, C order: stream the member from its start (parts of such files start at 0)
                f = zf.open(m.info)
                npy_header(f)
                streams[n] = (f, m.dtype, m.shape[1])
        for s in range(part.start, part.stop, block_rows):
            e = min(part.stop, s + block_rows)
            out = {}
            for n in names:
                if n in mapped:
                    out[n] = np.ascontiguousarray(mapped[n][s:e])
                else:
                    f, dtype, d = streams[n]
                    buf = f.read((e - s) * d * dtype.itemsize)
                    out[n] = np.frombuffer(buf, dtype=dtype).reshape(e - s, d)
            yield Rows(part.offset + (s - part.start), out)
    finally:
        for f, _, _ in streams.values():
            f.close()
        zf.close()


# ------------------------------------------------------------------------------- safetensors
_ST_KINDS = {"F": "f", "B": "f", "I": "i", "U": "u"}  # F16/F32/F64, BF16, I8.., U8..


def _st_open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # the library raises its own error types for a bad header
        raise InputError(f"{path} is not a readable .safetensors file ({e})") from e


def _st_describe(path: Path, fmt: str, columns, block_rows: int) -> Layout:
    with _st_open(path) as f:
        found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    found = _pick(path, found, columns, "tensor")
    layers = {}
    for name, (shape, dt) in found.items():
        kind = _ST_KINDS.get(dt[:1], "?") if dt != "BOOL" else "b"
        if columns or (len(shape) == 2 and kind in "fiu"):
            _check_2d(path, name, shape, kind)
            layers[name] = (shape[0], shape[1], dt.lower())
    n = next(iter(layers.values()))[0] if layers else 0
    return Layout(fmt, layers, _row_parts(path, n, block_rows))


def _torch_to_numpy(t) -> np.ndarray:
    import torch

    # a saved nn.Parameter requires grad, and .numpy() refuses such a tensor
    t = t.detach()
    # numpy has no bfloat16 nor any float8 type; float16 math is slow
    if t.dtype in (torch.bfloat16, torch.float16) or (t.is_floating_point() and t.element_size() == 1):
        t = t.float()
    return t.numpy()


def _st_rows(part: FilePart, names: list[str], block_rows: int) -> Iterator[Rows]:
    with _st_open(Path(part.path)) as f:
        slices = {n: f.get_slice(n) for n in names}
        for s in range(part.start, part.stop, block_rows):
            e = min(part.stop, s + block_rows)
            yield Rows(
                part.offset + (s - part.start), {n: _torch_to_numpy(sl[s:e]) for n, sl in slices.items()}
            )


# ---------------------------------------------------------------------------------------- pt
def _pt_load(path: Path) -> tuple[dict, bool]:
    """(name -> tensor, whether memory-mapped), through ``torch.load(weights_only=True)``
    (memory-mapped when the file is a zip archive). A file that needs pickle to load is refused,
    never unpickled."""
    import pickle
    import warnings

    import torch

    try:
        # torch warns about a pickle protocol it may not read before it refuses the file: the
        # refusal below says what matters, in one line
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
                mapped = True
            except RuntimeError as e:
                if "mmap" not in str(e) and "zip" not in str(e):
                    raise
                obj = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy format
                mapped = False
    except pickle.UnpicklingError:
        raise InputError(
            f"{path} cannot be read without unpickling (it holds objects besides tensors, or is damaged), "
            "and geomscope never unpickles (it reads .pt files with weights_only=True); save tensors "
            "(torch.save of a tensor or a dict of tensors), or use .safetensors"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise InputError(f"{path} is not a readable .pt file ({first_line(e, 160)})") from None
    if isinstance(obj, torch.Tensor):
        return {"array": obj}, mapped
    if isinstance(obj, (list, tuple)):
        obj = {layer_name(i, len(obj)): t for i, t in enumerate(obj)}  # as a run names hidden states
    if not isinstance(obj, dict):
        raise InputError(f"{path} holds a {type(obj).__name__}; save a tensor, or a dict or list of tensors")
    return {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}, mapped


def _pt_describe(path: Path, fmt: str, columns, block_rows: int) -> Layout:
    import torch

    tensors, mapped = _pt_load(path)
    found = _pick(path, tensors, columns, "tensor")
    layers = {}
    for name, t in found.items():
        kind = (
            "f" if t.is_floating_point() else "c" if t.is_complex() else "b" if t.dtype == torch.bool else "i"
        )
        if columns or (t.ndim == 2 and kind in "fiu"):
            _check_2d(path, name, tuple(t.shape), kind)
            if t.layout != torch.strided:  # (its rows cannot be sliced: it failed as "truncated")
                raise InputError(f"{path}: {name!r} is a sparse tensor; save it with .to_dense()")
            layers[name] = (t.shape[0], t.shape[1], str(t.dtype).removeprefix("torch."))
    n = next(iter(layers.values()))[0] if layers else 0
    # a legacy (non-zip) file cannot be memory-mapped: each read unit would load it whole again
    parts = _row_parts(path, n, block_rows) if mapped else [FilePart(str(path), 0, n, 0)]
    return Layout(fmt, layers, parts)


def _pt_rows(part: FilePart, names: list[str], block_rows: int) -> Iterator[Rows]:
    tensors, _ = _pt_load(Path(part.path))
    for s in range(part.start, part.stop, block_rows):
        e = min(part.stop, s + block_rows)
        yield Rows(part.offset + (s - part.start), {n: _torch_to_numpy(tensors[n][s:e]) for n in names})


# ---------------------------------------------------------------------------- arrow / parquet
def _pa():
    try:
        import pyarrow
    except ImportError:
        raise InputError(
            "reading Arrow/Parquet needs pyarrow: pip install pyarrow (or 'geomscope[formats]')"
        ) from None
    return pyarrow


def _arrow_files(path: Path, fmt: str) -> list[Path]:
    """The data files of an arrow/parquet path, in order."""
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").exists():
        splits = ", ".join(d.name for d in _subdirs(path))
        raise InputError(f"{path} is a DatasetDict; give one split's directory ({splits})")
    if (path / "state.json").exists():
        _check_regular(path / "state.json")
        try:
            state = read_json(path / "state.json")
            names = [d["filename"] for d in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}/state.json is not a datasets state file ({e})") from None
        if not names:
            raise InputError(f"{path}/state.json lists no data files; save the dataset again (save_to_disk)")
        for n in names:  # a file name, never a path out of the directory
            if not isinstance(n, str) or Path(n).name != n or not (path / n).is_file():
                raise InputError(f"{path}/state.json names a data file {n!r} that is not in the directory")
        return [path / n for n in names]
    suffix = ".parquet" if fmt == "parquet" else ".arrow"
    files = sorted(path.glob(f"*{suffix}"), key=_natural)
    for f in files:
        _check_regular(f)
    if not files and fmt == "arrow":
        for d in _subdirs(path):
            if (d / "state.json").exists():
                files += _arrow_files(d, fmt)
    if not files:
        raise InputError(f"{path} holds no {suffix} files")
    return files


def _check_regular(path: Path) -> None:
    """InputError (one line) unless ``path`` is a regular file (or a link to one): opening a FIFO
    blocks for ever (pyarrow does not even end on SIGTERM there), a device never ends."""
    if not path.is_file():
        raise InputError(
            f"{path} is not a regular file (a pipe, a device or a folder); move it out of {path.parent}"
        )


class _ArrowFile:
    """Record batches of one Arrow IPC (file or stream format) or Parquet file, read lazily: opening
    it reads headers only (every IPC batch's, walked in order without decoding: decoded_sizes.py;
    the Parquet footer), and each batch is decoded as it is read, so opening a compressed IPC file
    decompresses nothing. :meth:`check_decoded` holds what one batch or page decompresses
    to against a budget before anything is."""

    def __init__(self, path: Path, fmt: str):
        pa = _pa()
        self.path, self.fmt = path, fmt
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                self._pq = pq.ParquetFile(str(path))
                self.schema = self._pq.schema_arrow
                self.num_rows = self._pq.metadata.num_rows
            else:
                self._open_ipc(pa)
        except (pa.ArrowException, OSError, HeaderError) as e:
            raise InputError(f"{path} is not a readable {fmt} file ({first_line(e, 160)})") from None

    def _open_ipc(self, pa) -> None:
        """The IPC file's batches from their headers, the schema from its first message. An IPC file
        holds the stream format after its 8-byte magic: both are read as a stream, the file's up to
        the record batches its footer counts."""
        source = pa.memory_map(str(self.path), "r")
        self._start = 8 if source.read(6) == b"ARROW1" else 0
        counted = None
        if self._start:
            source.seek(0)
            counted = pa.ipc.open_file(source).num_record_batches
        source.seek(self._start)
        self._batches = []
        for batch in [] if counted == 0 else ipc_messages(source):
            self._batches.append(batch)
            if counted is not None and sum(not b.dictionary for b in self._batches) == counted:
                break  # (what follows the file's batches is its footer)
        self._source = source
        self.schema = self._stream().schema
        self.num_rows = sum(b.rows for b in self._batches if not b.dictionary)

    def _stream(self):
        self._source.seek(self._start)
        return _pa().ipc.open_stream(self._source)

    def check_decoded(self, columns: list[str], memory_mb: float | None) -> None:
        """InputError (one line) where one compressed IPC batch, or one Parquet page of ``columns``,
        decompresses to more than ``memory_mb`` MiB: it is decompressed whole before a row of it
        is read (a 4 KB file could hold a 2 GiB zstd page). None: no bound."""
        if memory_mb is None:
            return
        budget = memory_mb * 2**20
        if self.fmt != "parquet":
            for i, b in enumerate(self._batches):
                if b.compressed and b.decoded_bytes > budget:
                    what = "dictionary batch" if b.dictionary else "record batch"
                    self._too_large(f"its {what} {i} decompresses to", b.decoded_bytes, memory_mb)
            return
        try:
            self._check_pages(columns, budget, memory_mb)
        except (HeaderError, OSError) as e:
            raise InputError(f"{self.path} is not a readable parquet file ({first_line(e, 160)})") from None

    def _check_pages(self, columns: list[str], budget: float, memory_mb: float) -> None:
        """Every page of ``columns``' chunks (decoded_sizes.parquet_pages) within ``budget`` bytes."""
        with open(self.path, "rb") as f:
            for g, chunk, start in self._chunks_of(columns):
                for page in parquet_pages(f, start, chunk.total_compressed_size):
                    if page.uncompressed > budget:
                        where = f"a page of column {chunk.path_in_schema!r} (row group {g})"
                        self._too_large(f"{where} decompresses to", page.uncompressed, memory_mb)

    def _chunks_of(self, columns: list[str]):
        """(row group, column chunk metadata, its first byte) of every chunk of ``columns``: from its
        dictionary page where it has one before its data, as Parquet's reader reads it."""
        md = self._pq.metadata
        for g in range(md.num_row_groups):
            group = md.row_group(g)
            for c in range(group.num_columns):
                chunk = group.column(c)
                if chunk.path_in_schema.split(".")[0] not in columns:
                    continue
                start = chunk.data_page_offset
                dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
                yield g, chunk, dictionary if dictionary is not None and 0 < dictionary < start else start

    def _too_large(self, what: str, nbytes: int, memory_mb: float) -> None:
        fix = (
            "write it with smaller pages (pyarrow.parquet.write_table(..., data_page_size=...))"
            if self.fmt == "parquet"
            else "write it in smaller batches, or uncompressed"
        )
        raise InputError(
            f"{self.path}: {what} {nbytes / 2**20:.0f} MiB, more than --memory-mb {memory_mb:g} "
            f"(it is decompressed whole before a row of it is read); {fix}, or raise --memory-mb"
        )

    def _parquet_batches(self, columns: list[str], start: int, stop: int, cells: int):
        """Cells [start, stop) of a Parquet file, row group by row group, each decoded ``cells`` at a
        time: memory follows the batch, not the writer's row group (pyarrow's default writer puts up
        to 1M rows in one: a 245 KB file of zeros was 5.4 GB read whole, 0.4 GB in batches of 16,000
        rows of 512). One reader per row group: across them iter_batches reads far ahead (390 MB of
        Arrow memory for a 217 MB file, against 47 MB row group by row group)."""
        pos = 0
        for g in range(self._pq.metadata.num_row_groups):
            n = self._pq.metadata.row_group(g).num_rows
            lo, hi = max(start, pos), min(stop, pos + n)
            if lo < hi:
                decoded = self._pq.iter_batches(batch_size=cells, row_groups=[g], columns=columns)
                try:
                    yield from _batches_of(decoded, lo - pos, hi - lo, cells)
                except (_pa().ArrowException, OSError) as e:  # a page that does not decompress ...
                    raise InputError(
                        f"{self.path} is damaged ({first_line(e, 160)}); write it again"
                    ) from None
            pos += n
            if pos >= stop:
                return

    def batches(self, columns: list[str], start: int, stop: int, cells: int):
        """Record batches covering cells [start, stop), at most ``cells`` each."""
        if self.fmt == "parquet":
            yield from self._parquet_batches(columns, start, stop, cells)
            return
        pa = _pa()
        pos = 0
        reader = self._stream()
        for planned in (b for b in self._batches if not b.dictionary):
            if pos >= stop:
                return
            try:
                b = reader.read_next_batch()
            except (pa.ArrowException, OSError, StopIteration) as e:
                raise InputError(f"{self.path} is damaged ({first_line(e, 160)}); write it again") from None
            if b.num_rows != planned.rows:
                raise InputError(
                    f"{self.path} is damaged (a batch of {b.num_rows} rows where its header says "
                    f"{planned.rows}); write it again"
                )
            lo, hi = max(start, pos), min(stop, pos + b.num_rows)
            if lo < hi:
                picked = b.select(columns)
                # an IPC file's buffers are mapped as written: a list offset pointing past its
                # values aborts the whole process (a C++ check failure) when the column is sliced or
                # flattened, so the columns read are validated first (full: offsets, not just sizes)
                try:
                    picked.validate(full=True)
                except pa.ArrowInvalid as e:
                    raise InputError(
                        f"{self.path} is damaged ({first_line(e, 160)}); write it again"
                    ) from None
                for s in range(lo, hi, cells):
                    yield picked.slice(s - pos, min(hi, s + cells) - s)
            pos += b.num_rows


def _batches_of(batches, skip: int, count: int, cells: int):
    """Rows [skip, skip + count) of a stream of record batches as tables of ``cells`` rows (the last
    fewer), cut at skip + k x cells whatever sizes the stream comes in."""
    pa = _pa()
    pending, have = [], 0
    for b in batches:
        if skip >= b.num_rows:
            skip -= b.num_rows
            continue
        pending.append(b.slice(skip))
        have, skip = have + b.num_rows - skip, 0
        while count > 0 and have >= min(cells, count):
            table = pa.Table.from_batches(pending)
            take = min(cells, count)
            yield table.slice(0, take)
            pending, have, count = table.slice(take).to_batches(), have - take, count - take
        if count <= 0:
            return
    if have and count > 0:  # the file ends early: the reader counts what came
        yield pa.Table.from_batches(pending).slice(0, count)


def _list_shape(pa, typ):
    """(nesting depth, width or None when variable, leaf type) of a list-like column type; depth 0
    when the type is not a list of numbers. Extension types (datasets' Array2D) by their storage."""
    depth, width = 0, None
    while True:
        if isinstance(typ, pa.ExtensionType):
            typ = typ.storage_type
        if pa.types.is_fixed_size_list(typ):
            depth, width, typ = depth + 1, typ.list_size, typ.value_type
        elif pa.types.is_list(typ) or pa.types.is_large_list(typ):
            depth, width, typ = depth + 1, None, typ.value_type
        else:
            break
    numeric = pa.types.is_floating(typ) or pa.types.is_integer(typ)
    return (depth if numeric and depth in (1, 2) else 0), width, typ


def _flatten_cells(pa, arr, depth: int, path: str, name: str) -> np.ndarray:
    """A chunk of a vector (depth 1) or matrix (depth 2) column as an (m, D) array; DataError (one
    line) for a null or ragged cell."""
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    width = None
    for _ in range(depth):
        if isinstance(arr, pa.ExtensionArray):
            arr = arr.storage
        if arr.null_count:
            raise DataError(f"{path}: column {name!r} has a null cell; every cell must hold numbers")
        lengths = pc.list_value_length(arr)
        lo, hi = pc.min_max(lengths).values()
        if lo.as_py() != hi.as_py():
            raise DataError(
                f"{path}: column {name!r} has cells of different lengths ({lo} to {hi}); "
                "every row must be a vector of the layer's width"
            )
        width = hi.as_py()
        arr = arr.flatten()
    if arr.null_count:  # (to_numpy would make it a NaN, and the row would be dropped as non-finite)
        raise DataError(
            f"{path}: column {name!r} has a null value inside a cell; every cell must hold numbers"
        )
    vals = arr.to_numpy(zero_copy_only=False)
    return vals.reshape(-1, width or 0)


def _arrow_describe(path: Path, fmt: str, columns, block_rows: int, memory_mb: float | None) -> Layout:
    """The layout of an Arrow/Parquet file or directory: its vector (or matrix) columns as layers,
    their widths, its files as parts; one line for what cannot be read as rows."""
    pa = _pa()
    files = [_ArrowFile(f, fmt) for f in _arrow_files(path, fmt)]
    schema = _common_schema(path, files)
    found = {fld.name: fld.type for fld in schema}
    shapes = {n: _list_shape(pa, t) for n, t in _pick(path, found, columns, "column").items()}
    for n, (depth, _, _leaf) in shapes.items():
        if columns and depth == 0:
            raise InputError(
                f"{path}: column {n!r} holds {found[n]}, not a vector of numbers per row (or a matrix, "
                "as datasets' Array2D); name a 2-D float column with --column"
            )
    shapes = {n: s for n, s in shapes.items() if s[0] and n not in EXPORT_META_COLUMNS}
    depths = {d for d, _, _ in shapes.values()}
    if len(depths) > 1:
        raise InputError(
            f"{path}: some columns hold one vector per row and others a matrix per row; "
            "pick columns of one kind with --column"
        )
    for f in files:  # before the first cell is decoded below
        f.check_decoded([*shapes, *(c for c in META_COLUMNS if c in found)], memory_mb)
    # widths (and the rows per matrix cell) come from the first cell where the type leaves them open
    layers, cell_rows = _probe_cells(pa, path, files, shapes)
    if len(set(cell_rows.values())) > 1:  # the rows of the layers would not be the same tokens
        listing = ", ".join(f"{k} {r}" for k, r in cell_rows.items())
        raise InputError(
            f"{path}: the matrix columns hold different numbers of rows per cell ({listing}); "
            "pick those that match with --column"
        )
    per_cell = next(iter(cell_rows.values()), 1)
    n_cells = sum(f.num_rows for f in files)
    n_rows = n_cells * per_cell
    layers = {k: (n_rows, d, t) for k, (_, d, t) in layers.items()}
    meta = tuple(
        c
        for c in META_COLUMNS
        if c in found
        and depths == {1}
        and (pa.types.is_integer(found[c]) if c == "doc_id" else pa.types.is_boolean(found[c]))
    )
    parts, offset = [], 0
    for f in files:
        parts.append(FilePart(str(f.path), 0, f.num_rows * per_cell, offset))
        offset += f.num_rows * per_cell
    return Layout(fmt, layers, parts, meta=meta, files=len(files), indices=_layer_indices(schema, layers))


def _common_schema(path: Path, files: list):
    """The schema of the first file, which every other file must share (metadata aside); an
    InputError for no record batches or different columns."""
    schema = files[0].schema
    if schema is None:
        raise InputError(f"{path} holds no record batches")
    for f in files[1:]:
        if f.schema is not None and not f.schema.equals(schema, check_metadata=False):
            raise InputError(
                f"{f.path} has different columns from {files[0].path}; they cannot be read together"
            )
    return schema


def _probe_cells(pa, path: Path, files: list, shapes: dict) -> tuple[dict, dict]:
    """(layer -> (0, width, leaf type), matrix layer -> rows per cell), from the first cell of each
    column where its type leaves them open."""
    layers, cell_rows = {}, {}
    first = next((f for f in files if f.num_rows), None)
    for n, (depth, width, leaf) in shapes.items():
        probe = None
        if first is not None:
            b = next(first.batches([n], 0, 1, 1))
            probe = _flatten_cells(pa, b.column(0), depth, str(path), n)
            if depth == 2:
                cell_rows[n] = probe.shape[0]
        d = probe.shape[1] if probe is not None else (width or 0)
        layers[n] = (0, d, str(leaf))
    return layers, cell_rows


def _layer_indices(schema, layers) -> dict[str, int]:
    """layer -> its index in the model, as ``geomscope export`` records it in the field metadata."""
    out = {}
    for n in layers:
        raw = (schema.field(n).metadata or {}).get(LAYER_INDEX_KEY)
        try:
            out[n] = int(raw.decode("ascii"))
        except (AttributeError, UnicodeDecodeError, ValueError):  # none recorded, or not a number
            continue
    return out


def _arrow_rows(part: FilePart, names: list[str], block_rows: int, fmt: str, meta) -> Iterator[Rows]:
    pa = _pa()
    f = _ArrowFile(Path(part.path), fmt)
    depth = {n: _list_shape(pa, f.schema.field(n).type)[0] for n in names}
    # the rows per matrix cell that describe() planned this file's rows with (its parts are whole
    # files): every cell must hold as many, or the rows (and their jackknife groups) are miscounted
    per_cell = max(1, (part.stop - part.start) // f.num_rows) if f.num_rows else 1
    cells = max(1, block_rows // per_cell)
    pos = part.offset
    cols = list(names) + list(meta)
    for b in f.batches(cols, part.start // per_cell, -(-part.stop // per_cell), cells):
        out = {n: _flatten_cells(pa, b.column(n), depth[n], part.path, n) for n in names}
        for n, x in out.items():
            if x.shape[0] != b.num_rows * per_cell:
                raise DataError(
                    f"{part.path}: column {n!r} has cells of {x.shape[0] // max(1, b.num_rows)} rows here "
                    f"but {per_cell} in the first cell read; every cell of a matrix column must hold "
                    "the same number of rows"
                )
        m = b.num_rows * per_cell
        rows = Rows(pos, out)
        if "doc_id" in meta:
            doc = b.column("doc_id")
            if doc.null_count:  # (it would become INT64_MIN, a document of its own)
                raise DataError(
                    f"{part.path}: column 'doc_id' has a null cell; give every row its document id, "
                    "or drop the column"
                )
            rows.doc_id = doc.to_numpy(zero_copy_only=False).astype(np.int64)
        if "special" in meta:
            rows.special = b.column("special").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
        pos += m
        yield rows
    if pos - part.offset != part.stop - part.start:
        raise DataError(
            f"{part.path} holds {pos - part.offset} rows, {part.stop - part.start} when the score began; "
            "was it changed meanwhile?"
        )


# ------------------------------------------------------------------------------------ reading
def read_rows(fmt: str, part: FilePart, names: list[str], block_rows: int, meta=()) -> Iterator[Rows]:
    """Stream ``part`` in blocks of at most ``block_rows`` rows (whole matrix cells for Array2D)."""
    if fmt == "npz":
        yield from _npz_rows(part, names, block_rows)
    elif fmt == "safetensors":
        yield from _st_rows(part, names, block_rows)
    elif fmt == "pt":
        yield from _pt_rows(part, names, block_rows)
    else:
        yield from _arrow_rows(part, names, block_rows, fmt, meta)
