"""What ``score`` reads: a run directory (HDF5 shards, read through store.Run), one (N, D) array
(.npy / .h5 dataset), or named (N, D) arrays, one per layer, in another tool's format (formats.py:
.npz, .safetensors, .pt, Arrow / ``datasets.save_to_disk`` / SAELens caches, Parquet).

A source is cut into picklable store.blocks.Task s (one per shard: store.Run.shard_tasks; row
blocks of an array) so that a process pool can read them independently (files are opened inside
the task). :func:`iter_blocks` streams a task in bounded row blocks as store.blocks.Block s carrying,
per row, a stable key (for seeded selection), a jackknife group, the special-token flag and, per
layer, the activations and a non-finite flag; a shard's blocks come from store.reader.

Jackknife groups: run rows by document, ``doc_id % G`` (so are rows of a file with a ``doc_id``
column, as ``geomscope export`` writes); array rows (no documents) by contiguous blocks,
``row * G // N`` (neighbouring rows of an array usually come from the same text); the shards of a
``--keep sample`` run, which keeps one accumulator per shard, by ``shard index % G``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geomscope.errors import DataError, InputError, first_line
from geomscope.formatting import counted
from geomscope.store.blocks import READ_BYTES, Block, Task, groups_of_docs, rows_per_block

ARRAY_LAYER = "array"


def _array_groups(start: int, stop: int, n_total: int, n_groups: int) -> np.ndarray:
    g = max(1, n_groups)
    return (np.arange(start, stop, dtype=np.int64) * g) // max(1, n_total)


# -------------------------------------------------------------------------------------- arrays
def npy_error(path, e: Exception, what: str = "") -> str:
    """One line for a .npy numpy cannot load: what it is, never a hint to load it unsafely."""
    first = first_line(e)
    if "allow_pickle" in first or "pickle" in first or "magic string is not correct" in first:
        why = "it holds pickled objects, or is not a .npy file at all; geomscope never unpickles"
    elif isinstance(e, EOFError) or "No data left" in first or first.startswith("EOF"):
        why = "it is empty or cut short"
    else:
        why = first[:160]
    return f"{what}{path} is not a readable numeric .npy array ({why}); save one with numpy.save"


def open_array(path: str, dataset: str | None):
    """(array-like (N, D), closer) for a .npy (memory-mapped) or an .h5 dataset."""
    p = Path(path)
    if p.suffix.lower() == ".npy":  # as _is_array_path decides (X.NPY is a .npy file too)
        from geomscope.score.formats import npy_header

        try:
            with open(p, "rb") as f:
                npy_header(f)  # a shape numpy would map wrongly is refused first
            a = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(npy_error(p, e)) from e
        return a, (lambda: None)
    import h5py

    try:
        f = h5py.File(p, "r")
    except OSError as e:
        raise InputError(f"{p} is not a readable HDF5 file ({str(e).split('(')[0].strip()})") from e
    if dataset is None:
        found = []
        f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
        two_d = [n for n in found if f[n].ndim == 2]
        if len(two_d) != 1:
            f.close()
            raise InputError(
                f"{p} holds {len(two_d)} 2-D datasets ({', '.join(two_d[:6]) or 'none'}); "
                "name one with --dataset PATH"
            )
        dataset = two_d[0]
    try:
        ds = _in_file(f, p, dataset)
        if not isinstance(ds, h5py.Dataset):
            raise InputError(f"{p} has no dataset {dataset!r}; name an existing one with --dataset PATH")
        why = _not_stored_in_file(ds)
        if why:
            raise InputError(f"{p}: dataset {dataset!r} {why}")
    except BaseException:
        f.close()
        raise
    return ds, f.close


def _in_file(f, p: Path, name: str, hops: int = 0):
    """The object at ``name`` in the open .h5 file ``f``, reached through its hard and soft links
    only (None where there is none). An external link would read another file -- whatever it names,
    a FIFO included, where the read blocks for ever -- so one on the way is refused, as are soft
    links that loop. (``name in f`` and ``f[name]`` follow every kind of link.)"""
    import posixpath

    import h5py

    node = f["/"]
    for part in (x for x in name.split("/") if x and x != "."):
        if not isinstance(node, h5py.Group):
            return None
        link = node.get(part, getlink=True)
        if link is None:
            return None
        if isinstance(link, h5py.SoftLink):
            if hops >= 32:
                raise InputError(
                    f"{p}: dataset {name!r} is behind soft links that loop; name the data itself"
                )
            node = _in_file(f, p, posixpath.join(node.name, link.path), hops + 1)
            if node is None:
                return None
        elif isinstance(link, h5py.HardLink):
            node = node[part]
        else:  # an external (or user-defined) link: the data is in another file
            raise InputError(
                f"{p}: dataset {name!r} is a link into another file; copy the data into the file, or "
                "score that file"
            )
    return node


def _not_stored_in_file(ds) -> str | None:
    """Why an .h5 dataset's rows are not all in its file, or None. Data kept in other files (external
    storage, a virtual dataset) would be read from wherever they point; a shape whose chunks or bytes
    were never written (10^12 declared rows in a 1 KB file) would be read as its fill value, for as
    long as that takes."""
    import h5py

    if ds.external or ds.is_virtual:
        return "keeps its data in other files (external storage or a virtual dataset); copy it into the file"
    if ds.size == 0:
        return None
    layout = ds.id.get_create_plist().get_layout()
    if layout == h5py.h5d.CHUNKED:
        needed = math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks, strict=True))
        stored = ds.id.get_num_chunks()
        if stored < needed:
            return f"declares shape {ds.shape} but stores {stored} of its {needed} chunks; write every row"
    elif layout == h5py.h5d.CONTIGUOUS and (stored := ds.id.get_storage_size()) < ds.size * ds.dtype.itemsize:
        return f"declares shape {ds.shape} but stores {stored} bytes of its data; write every row"
    return None


def compressed_band_rows(a) -> int | None:
    """The rows of one band of an .h5 dataset's compressed chunks (its chunks' first dimension);
    None for a .npy or a dataset stored uncompressed. HDF5 decompresses a chunk whole for any read
    of it, so each read of fewer rows than a band decompresses the band again (a 1M-row chunk read
    in blocks of 16,384 rows: 62 times)."""
    chunks = getattr(a, "chunks", None)
    if not chunks or a.id.get_create_plist().get_nfilters() == 0:
        return None
    return int(chunks[0])


def _check_band_fits(p: Path, a, name: str, memory_mb: float) -> None:
    """InputError (one line) when reading one band of ``a``'s compressed chunks holds more than
    ``memory_mb`` MiB: the band decompressed across the whole width, twice (HDF5's decompressed
    chunks and the rows copied out of them: a 2 GiB band peaks at about 4 GB)."""
    band = compressed_band_rows(a)
    if band is None:
        return
    d = a.shape[1]
    held = 2 * band * (-(-d // a.chunks[1]) * a.chunks[1]) * a.dtype.itemsize
    if held > memory_mb * 2**20:
        rows = max(1, READ_BYTES // (d * a.dtype.itemsize))
        raise InputError(
            f"{p}: dataset {name!r} is compressed in chunks of {band} x {a.chunks[1]} (rows x columns); "
            f"reading them holds {held / 2**20:.0f} MiB at once, more than --memory-mb {memory_mb:g}; "
            f"rechunk it (e.g. h5repack -l {name}:CHUNK={rows}x{d} {p.name} rechunked.h5) or raise "
            "--memory-mb"
        )


def _array_blocks(task: Task, n_groups: int, block_rows: int | None, with_data: bool) -> Iterator[Block]:
    a, close = open_array(task.path, task.dataset)
    try:
        d = a.shape[1]
        step = block_rows or rows_per_block(d, a.dtype.itemsize, 1)
        band = compressed_band_rows(a)
        first, rows = 0, a
        if band is not None and band > step:  # the task is one band: its chunks decompressed once
            first, rows = task.start, np.asarray(a[task.start : task.stop])
        for s in range(task.start, task.stop, step):
            e = min(task.stop, s + step)
            x = np.asarray(rows[s - first : e - first])
            if x.dtype.kind != "f":
                x = x.astype(np.float64)
            bad = ~np.isfinite(x).all(axis=1)
            yield Block(
                keys=np.arange(s, e, dtype=np.uint64),
                group=_array_groups(s, e, task.n_total, n_groups),
                special=np.zeros(e - s, bool),
                layers={ARRAY_LAYER: x} if with_data else {},
                nonfinite={ARRAY_LAYER: bad},
            )
    finally:
        close()


def _guarded(rows: Iterator, path: str) -> Iterator:
    """A file that breaks while it is read (truncated, changed, corrupt) ends in one line."""
    from geomscope.errors import GeomscopeError

    try:
        yield from rows
    except GeomscopeError:
        raise
    except Exception as e:  # numpy, zipfile, zlib, safetensors and pyarrow each raise their own
        raise DataError(
            f"{path} cannot be read to the end ({first_line(e, 160)}); is it truncated or still being "
            "written?"
        ) from e


def _format_blocks(
    task: Task, layers: list[str], n_groups: int, block_rows: int | None, with_data: bool
) -> Iterator[Block]:
    from geomscope.score.formats import FilePart, read_rows

    part = FilePart(task.path, task.start, task.stop, task.offset)
    mean = -(-sum(task.width(n) for n in layers) // max(1, len(layers)))  # the layers' mean width
    step = block_rows or rows_per_block(mean, 4, len(layers))
    for r in _guarded(read_rows(task.kind, part, layers, step, task.meta), task.path):
        x = {n: (a if a.dtype.kind == "f" else a.astype(np.float64)) for n, a in r.layers.items()}
        for n, a in x.items():  # a layer's width as planned (Parquet row groups may each differ)
            if task.width(n) and a.shape[1] != task.width(n):
                raise DataError(
                    f"{task.path}: {n!r} has rows of {a.shape[1]} numbers here but {task.width(n)} in "
                    "its first rows; every row of a layer must have the same width"
                )
        m = next(iter(x.values())).shape[0]
        groups = (
            groups_of_docs(r.doc_id, n_groups)
            if r.doc_id is not None
            else _array_groups(r.start, r.start + m, task.n_total, n_groups)
        )
        yield Block(
            keys=np.arange(r.start, r.start + m, dtype=np.uint64),
            group=groups,
            special=r.special if r.special is not None else np.zeros(m, bool),
            layers=x if with_data else {},
            nonfinite={n: ~np.isfinite(a).all(axis=1) for n, a in x.items()},
        )


def iter_blocks(
    task: Task, layers: list[str], n_groups: int, block_rows: int | None = None
) -> Iterator[Block]:
    """Stream a task's rows with activations of ``layers``."""
    if task.kind == "shard":
        from geomscope.store.reader import iter_shard_blocks

        yield from iter_shard_blocks(task, layers, n_groups, block_rows)
    elif task.kind in ("npy", "h5"):  # (a corrupt .h5 chunk is an OSError of h5py's: one line)
        yield from _guarded(_array_blocks(task, n_groups, block_rows, with_data=True), task.path)
    else:
        yield from _format_blocks(task, layers, n_groups, block_rows, with_data=True)


def iter_meta(task: Task, layers: list[str], n_groups: int) -> Iterator[Block]:
    """Stream a task's row metadata (keys, groups, special, non-finite flags) without keeping data.

    Runs read only the index and the stored non-finite flags; arrays must read the values to know
    which rows are finite.
    """
    if task.kind == "shard":
        from geomscope.store.reader import iter_shard_meta

        yield from iter_shard_meta(task, layers, n_groups)
    elif task.kind in ("npy", "h5"):
        yield from _guarded(_array_blocks(task, n_groups, None, with_data=False), task.path)
    else:
        yield from _format_blocks(task, layers, n_groups, None, with_data=False)


# ----------------------------------------------------------------------------------- sources
@dataclass
class SourceInfo:
    """What the orchestration needs to know about a source."""

    kind: str  # "run" | "array"
    path: str
    layers: list[str]  # stored names, depth order
    indices: dict[str, int | None]
    dim: int  # the layers' width D (a run: the model's hidden size)
    tasks: list[Task]
    dataset: str | None = None
    model: dict | None = None
    run: dict | None = None
    warnings: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    run_obj: object = None
    format: str | None = None  # arrays: "npy" | "h5" | one of formats.FORMATS
    groups: str = "contiguous"  # jackknife groups: "documents" (doc_id % G) | "contiguous" | "shards"
    files: int = 1
    sample: int | None = None  # a --keep sample:N run: N, the rows each shard sampled
    sample_seed: int = 0
    dims: dict[str, int] = field(default_factory=dict)  # the layers not ``dim`` wide -> their width

    def width(self, layer: str) -> int:
        """Layer ``layer``'s width: its own (a run's module layer of another width), else ``dim``."""
        return self.dims.get(layer, self.dim)

    @property
    def widths(self) -> list[int]:
        """The distinct widths of the layers, ascending."""
        return sorted({self.width(n) for n in self.layers})

    def describe(self) -> dict:
        """The report's ``source``: what was read."""
        out = {"kind": self.kind, "path": self.path, "dataset": self.dataset}
        if self.kind == "array":
            out.update(format=self.format, layers=list(self.layers), files=self.files)
        if self.sample is not None:
            out.update(keep=f"sample:{self.sample}", sample_seed=self.sample_seed)
        return out


def _is_array_path(p: Path) -> bool:
    return p.suffix.lower() in (".npy", ".h5", ".hdf5")


ACCEPTED = (
    "a run directory made by `geomscope extract`, an (N, D) array (.npy, .h5), or named (N, D) arrays "
    "(.npz, .safetensors, .pt, .arrow, .parquet, a datasets.save_to_disk or SAELens cache directory)"
)


def open_source(
    path,
    *,
    dataset: str | None = None,
    layers: list[str] | None = None,
    columns: list[str] | None = None,
    partial: bool = False,
    block_rows: int | None = None,
    memory_mb: float | None = None,
) -> SourceInfo:
    """Validate ``path`` and describe it as tasks. Raises InputError/DataError with one line.

    ``path``: a local path, or an fsspec URL (``scheme://...``) of a run directory, read through
    fsspec (arrays and other formats are read from local paths only). ``memory_mb`` (score passes
    --memory-mb) bounds what one read may hold: an .h5 dataset whose compressed chunks must be
    decompressed in larger bands, and a compressed Arrow batch or Parquet page that decompresses to
    more, are refused; None sets no bound (callers that take runs only).
    """
    from geomscope.score.formats import format_of
    from geomscope.store import MANIFEST_NAME, remote

    if remote.is_url(path):
        return _open_url(path, dataset=dataset, layers=layers, columns=columns, partial=partial)
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p} does not exist; give {ACCEPTED}")
    if not p.is_dir() and not p.is_file():  # a FIFO or a device: a read that blocks or never ends
        raise InputError(
            f"{p} is a pipe or a device, not a file (reading it could block); save the rows to a file"
        )
    fmt = None if (p / MANIFEST_NAME).exists() else format_of(p)
    if dataset is not None and not (fmt is None and p.is_file() and p.suffix.lower() in (".h5", ".hdf5")):
        raise InputError("--dataset names a dataset inside an .h5 array file; use --column for other files")
    if columns and (fmt is None):
        raise InputError(
            "--column picks arrays of .npz, .safetensors, .pt, Arrow or Parquet sources; "
            + ("a run takes --layers" if p.is_dir() else "this file holds one array")
        )
    if layers and (fmt is not None or not p.is_dir()):
        raise InputError("--layers applies to run directories; name the arrays of a file with --column")
    if fmt is not None:
        return _open_format(p, fmt, columns, block_rows, memory_mb)
    if p.is_dir():
        return _open_run(p, layers, partial)
    if not _is_array_path(p):
        raise InputError(f"{p} is not a format score reads; give {ACCEPTED}")
    return _open_array(p, dataset, block_rows, memory_mb)


def _open_url(url: str, *, dataset, layers, columns, partial: bool) -> SourceInfo:
    """A run directory given as a URL: its manifest and shards are read through fsspec."""
    from geomscope.store import MANIFEST_NAME, remote

    if not remote.exists(remote.join(url, MANIFEST_NAME)):
        if not remote.exists(url):
            raise InputError(f"{url} does not exist; give {ACCEPTED}")
        raise InputError(
            f"{url} is not a geomscope run directory (no {MANIFEST_NAME}); from a URL score reads run "
            "directories made by `geomscope extract` -- copy array files to a local path"
        )
    if dataset is not None:
        raise InputError("--dataset names a dataset inside an .h5 array file; use --column for other files")
    if columns:
        raise InputError(
            "--column picks arrays of .npz, .safetensors, .pt, Arrow or Parquet sources; a run takes --layers"
        )
    return _open_run(url, layers, partial)


def _open_format(
    p: Path, fmt: str, columns: list[str] | None, block_rows: int | None, memory_mb: float | None
) -> SourceInfo:
    from geomscope.score.formats import describe

    # a bounded first guess of the width sizes the read units; describe() reads headers only
    probe = describe(p, fmt, columns, block_rows or 1 << 62, memory_mb)
    n, d, dtype = next(iter(probe.layers.values()))
    # the layers not as wide as the first (an export of a run of extract --modules) -> their width
    dims = {k: w for k, (_, w, _) in probe.layers.items() if w != d}
    mean = -(-sum(w for _, w, _ in probe.layers.values()) // len(probe.layers))
    itemsize = 2 if "16" in dtype else 8 if "64" in dtype else 4
    step = max(block_rows or 0, rows_per_block(mean, itemsize, len(probe.layers)))
    lay = describe(p, fmt, columns, step) if fmt in ("npz", "safetensors", "pt") else probe
    names = list(lay.layers)
    tasks = [
        Task(
            kind=fmt,
            path=part.path,
            index=i,
            start=part.start,
            stop=part.stop,
            n_total=n,
            rows=part.stop - part.start,
            offset=part.offset,
            meta=lay.meta,
            dim=d,
            dims=tuple(dims.items()),
        )
        for i, part in enumerate(lay.parts)
    ]
    warnings, flags = _shape_warnings(p, n, d, "they are")
    # the layers' indices in the model where the source records them (an export of `-l 2` holds
    # layer_02 alone: its position, 0, misplaced it in plots and `plot --layers`); else positions
    recorded = [lay.indices.get(name) for name in names]
    if None in recorded or len(set(recorded)) != len(recorded):
        recorded = list(range(len(names)))
    return SourceInfo(
        kind="array",
        path=str(p),
        layers=names,
        indices=dict(zip(names, recorded, strict=True)),
        dim=int(d),
        tasks=tasks,
        warnings=warnings,
        flags=flags,
        format=fmt,
        groups="documents" if "doc_id" in lay.meta else "contiguous",
        files=lay.files,
        dims=dims,
    )


def _shape_warnings(p: Path, n: int, d: int, they: str) -> tuple[list[str], list[str]]:
    """(warnings, flags) of an input of ``n`` rows of ``d`` numbers: fewer rows than columns are
    probably a transposed array (``they``: how the message names the source's arrays)."""
    if n >= d:
        return [], []
    return [
        f"{p.name} has fewer rows than columns ({n} x {d}); rows must be points (N, D) -- "
        f"if {they} transposed, save X.T instead; covariance metrics are rank-limited"
    ], ["maybe_transposed"]


def _open_run(p: Path | str, layers: list[str] | None, partial: bool) -> SourceInfo:
    from geomscope.store import Run

    run = Run(p)
    shards = run.shards
    if not run.complete and not partial:
        planned = run.manifest.get("planned_shards")
        have = f"{len(shards)} of {counted(planned, 'shard')}" if planned else counted(len(shards), "shard")
        raise InputError(
            f"{p} is an incomplete run ({have} finished); finish it by rerunning the "
            "same `geomscope extract` command, or score the finished shards with --partial"
        )
    if not shards:
        raise InputError(f"{p} has no finished shards yet; run `geomscope extract` to fill it")
    run.check_consistent(p)
    names = run.resolve_layers(layers)
    order = {n: i for i, n in enumerate(run.layer_names)}
    names = sorted(dict.fromkeys(names), key=order.__getitem__)
    if not names:
        raise InputError(f"{p} records no layers; it is not a usable run")
    indices = run.layer_indices(names)
    dim = run.dim
    if dim is None:
        from geomscope.store import shard_dim

        dim = shard_dim(run.shard_path(shards[0]), names[0])
    ident = run.identity
    sample = run.kept_sample
    # every shard's layers are checked to be dim wide (or as wide as the run records them) before
    # they are read
    tasks = run.shard_tasks(dim)
    own = run.layer_dims
    warnings = []
    if not run.complete:
        warnings.append(
            f"scoring the {counted(len(shards), 'finished shard')} of an incomplete run (--partial)"
        )
    return SourceInfo(
        kind="run",
        path=str(p),
        layers=names,
        indices=indices,
        dim=int(dim),
        tasks=tasks,
        dataset=_run_dataset(ident),
        model=_run_model(ident, dim),
        run=_run_info(run, p, shards),
        warnings=warnings,
        run_obj=run,
        groups="documents" if sample is None else "shards",
        sample=sample,
        sample_seed=int(ident.get("sample_seed", 0) or 0),
        dims={n: own[n] for n in names if own.get(n, dim) != dim},
    )


def _run_model(ident: dict, dim: int) -> dict:
    """The report's ``source.model``: the model the run records."""
    m = ident.get("model", {}) if isinstance(ident.get("model"), dict) else {}
    return {
        "name": m.get("name") or m.get("path"),
        "revision": m.get("revision"),
        "commit": m.get("commit") or m.get("commit_hash"),
        "hidden_size": m.get("hidden_size", dim),
    }


def _run_info(run, p, shards) -> dict:
    """The report's ``source.run``: where the run is, how complete, what its read shards hold."""
    info = {
        "dir": str(p),
        "complete": run.complete,
        "partial": not run.complete,
        "rows": sum(s.n_tokens for s in shards),
        "docs": sum(s.docs for s in shards),
    }
    if run.identity.get("capture"):  # a gradient run (extract --capture gradients): what was measured
        info.update(capture=run.identity["capture"], loss=run.identity.get("loss"))
    return info


def _run_dataset(ident: dict) -> str | None:
    for key in ("input", "source", "data", "dataset"):
        v = ident.get(key)
        if isinstance(v, str):
            return v
        if isinstance(v, dict):
            for k2 in ("name", "dataset", "path", "source"):
                if isinstance(v.get(k2), str):
                    return v[k2]
    return None


def _open_array(p: Path, dataset: str | None, block_rows: int | None, memory_mb: float | None) -> SourceInfo:
    if p.suffix.lower() == ".npy" and dataset is not None:
        raise InputError("--dataset names a dataset inside an .h5 file; a .npy file holds one array")
    a, close = open_array(str(p), dataset)
    try:
        shape, dtype = tuple(a.shape), a.dtype
        if dataset is None and p.suffix.lower() != ".npy":
            dataset = a.name.lstrip("/")
        band = compressed_band_rows(a) if len(shape) == 2 else None
        if band is not None and memory_mb is not None:
            _check_band_fits(p, a, dataset, memory_mb)
    finally:
        close()
    if len(shape) != 2:  # the wrong kind of input (exit 2), not data that cannot give a number
        raise InputError(
            f"{p} holds an array of shape {shape}; score expects a 2-D (N, D) array "
            "(rows = token vectors); reshape it, e.g. X.reshape(-1, X.shape[-1])"
        )
    if dtype.kind not in "fiu":
        raise InputError(f"{p} holds dtype {dtype}; score expects real numbers (float or int)")
    n, d = shape
    if n < 2 or d < 2:
        raise DataError(f"{p} is {n} x {d}; at least 2 rows (points) and 2 columns (dimensions) are needed")
    warnings, flags = _shape_warnings(p, n, d, "it is")
    # one task = one read block (~32 MiB): each task maps the file afresh, so the pages of a
    # memory-mapped .npy that count as resident stay bounded by a block, not the whole array; or
    # one band of compressed chunks taller than that, each decompressed once (_array_blocks)
    step = max(block_rows or 0, rows_per_block(d, dtype.itemsize, 1))
    if band is not None and band > step:
        step = band
    tasks = [
        Task(
            kind="npy" if p.suffix.lower() == ".npy" else "h5",
            path=str(p),
            index=i,
            start=s,
            stop=min(n, s + step),
            n_total=n,
            dataset=dataset,
            rows=min(n, s + step) - s,
        )
        for i, s in enumerate(range(0, n, step))
    ]
    return SourceInfo(
        kind="array",
        path=str(p),
        layers=[ARRAY_LAYER],
        indices={ARRAY_LAYER: 0},
        dim=int(d),
        tasks=tasks,
        dataset=dataset,
        warnings=warnings,
        flags=flags,
        format="npy" if p.suffix.lower() == ".npy" else "h5",
    )
