"""``export_run``: a finished run in other tools' formats, streamed shard by shard.

- ``npy``: ``DIR/<layer>.npy`` (rows, D) in the run's stored dtype, one per layer, and the per-row
  ``doc_id.npy`` (int64), ``position.npy`` (int64), ``token_id.npy`` (int64), ``special.npy`` (bool),
  all in the same row order (shard by shard). ``np.load(..., mmap_mode="r")`` reads them without
  loading, and ``geomscope score DIR/<layer>.npy`` scores one layer.
- ``arrow``: a ``datasets.save_to_disk`` directory (``datasets.load_from_disk(DIR)`` opens it;
  pyarrow and polars read its ``data-*.arrow`` Arrow IPC stream files directly): one data file per
  shard with the columns ``doc_id, position, token_id, special`` and one fixed-size-list column per
  layer, whose field metadata ``geomscope.layer_index`` is the layer's index in the model.
  ``geomscope score DIR`` reads it back, by document groups, as it reads the run.

The run is read as ``score`` reads it: a manifest that disagrees with itself is refused, and each
shard is held to its recorded size and checksum (``--no-verify``: the size only) and documents.

The export is written into a temporary sibling directory and renamed into place when complete, so
an interrupted export leaves no half-written ``DIR``; an existing non-empty ``DIR`` is refused, never
overwritten. ``geomscope-export.json`` records what was exported from where (and each layer's index).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.export_options import ExportOptions
from geomscope.fileio import create_exclusive, replace_dir, temp_path, write_all
from geomscope.formatting import counted
from geomscope.progress import Log, Progress, log_to
from geomscope.schema import EXPORT_MARKER, LAYER_INDEX_KEY

META = (("doc_id", np.int64), ("position", np.int64), ("token_id", np.int64), ("special", np.bool_))


def export_run(
    run_dir,
    out_dir,
    options: ExportOptions | None = None,
    *,
    progress: bool = False,
    log: Log | None = None,
    **overrides,
) -> dict:
    """Write the run ``run_dir`` as ``options.to`` ("arrow" | "npy") into ``out_dir``; return the
    summary recorded in ``out_dir/geomscope-export.json``. ``options``: an
    :class:`~geomscope.export_options.ExportOptions`; keyword ``overrides`` replace its fields, or
    make it (``export_run(run, out, to="npy", layers=["2"])``). ``progress`` and ``log`` follow
    :mod:`geomscope.progress`: a bar over the rows, and the line that says what was written.

    The run is read as ``score`` reads it: a manifest that disagrees with itself is refused, each
    shard's size is checked against the manifest before it is read and its checksum while it is read
    (``verify=False``: the size only), and its rows are held to the documents its entry assigns it.
    """
    opts = (ExportOptions(**overrides) if options is None else replace(options, **overrides)).validate()
    run, shards = _open_run(run_dir)
    names = run.resolve_layers(opts.layers)
    out = Path(out_dir)
    _check_out_free(out)
    tasks = run.shard_tasks(run.dim or 0)  # each shard's identity now: the reads come from it
    indices = run.layer_indices(names)
    tmp = _temp_dir_beside(out)
    try:
        with Progress(enabled=progress) as bar:
            rows_done = bar.add("exporting", run.total_rows, unit="rows", rate_unit="rows").advance
            if opts.to == "npy":
                files = _npy(run, tasks, names, tmp, rows_done, opts.verify)
            else:
                files = _arrow(run, tasks, names, indices, tmp, rows_done, opts.verify)
        summary = {
            "format": opts.to,
            "source_run": str(Path(run_dir).resolve()),
            "model": (run.identity.get("model") or {}).get("name"),
            "layers": names,
            "layer_indices": indices,  # each layer's index in the model (its hidden state)
            "rows": sum(s.rows for s in shards),
            "columns": [m for m, _ in META] + names,
            "files": files,
        }
        (tmp / EXPORT_MARKER).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty (checked above; never a tree of files put there since)
        replace_dir(tmp, out)
    except OSError as e:  # a full disk, permissions ...: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)  # ours alone: made above under a fresh name
        raise InputError(
            f"cannot write the export to {out} ({e.strerror or e}); free space or choose another --out"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rows, layers = counted(summary["rows"], "row"), counted(len(names), "layer")
    log_to(log)(f"exported {rows} x {layers} to {out} ({opts.to})")
    return summary


def _check_out_free(out: Path) -> None:
    """An InputError unless ``out`` is a new path or an empty directory (never a link)."""
    if out.is_symlink():  # the export is renamed into place: over the link, never into its target
        raise InputError(
            f"--out {out} is a link (to {os.readlink(out)}); export writes a new directory in its place, "
            "never through a link: give a new path, or the empty directory itself"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not an empty directory; choose a new --out directory")


def _temp_dir_beside(out: Path) -> Path:
    """A new, empty directory under a fresh temporary name next to ``out`` (its parents made first),
    into which the export is written before it is renamed to ``out``; one line when it cannot be made."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(out)
        tmp.mkdir()
    except OSError as e:
        raise InputError(
            f"cannot write into {out.parent} ({e.strerror or e}); choose another --out"
        ) from None
    return tmp


def _open_run(run_dir):
    """(the run, its shards in index order), read as ``score`` reads a run: refused unless complete,
    of every row (not a ``--keep sample``), with a manifest that agrees with itself, and shards."""
    from geomscope.store import Run

    run = Run(Path(run_dir))
    if not run.complete:
        raise InputError(
            f"{run_dir} is an incomplete run; finish it by rerunning the same `geomscope extract` command"
        )
    if run.identity.get("keep"):
        raise InputError(
            f"{run_dir} kept accumulators and a seeded sample (--keep {run.identity['keep']}), not its "
            "rows; export needs a run of every row: extract again with --keep all"
        )
    run.check_consistent(run_dir)  # a shard listed twice would be exported twice
    shards = sorted(run.shards, key=lambda s: s.index)
    if not shards:
        raise InputError(f"{run_dir} has no finished shards; run `geomscope extract` to fill it")
    return run, shards


def _meta(ch) -> dict[str, np.ndarray]:
    return {
        "doc_id": np.asarray(ch.doc_id, np.int64),
        "position": np.asarray(ch.position, np.int64),
        "token_id": np.asarray(ch.token_id, np.int64),
        "special": np.asarray(ch.is_special, bool),
    }


class _NpyFile:
    """One .npy written front to back by plain writes: its header (the shape is known in advance),
    then the rows as they come, not a memory map of the whole file (open_memmap): a map makes the
    file sparse, and a full disk then comes as SIGBUS on a page write, which kills the process with
    no error line and leaves its temporary directory; a write says ENOSPC, which export_run turns
    into one line."""

    def __init__(self, path: Path, dtype, shape: tuple):
        self.path, self.dtype, self.shape, self.rows = path, np.dtype(dtype), tuple(shape), 0
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": self.shape,
        }
        buf = io.BytesIO()
        try:
            np.lib.format.write_array_header_1_0(buf, header)
        except ValueError:  # a header over 64 KiB needs version 2.0
            buf = io.BytesIO()
            np.lib.format.write_array_header_2_0(buf, header)
        self.fd = create_exclusive(path)
        try:
            write_all(self.fd, buf.getvalue())
        except BaseException:
            self.close()
            raise

    def append(self, x: np.ndarray, shard) -> None:
        x = np.ascontiguousarray(x, dtype=self.dtype)
        if x.shape[1:] != self.shape[1:] or self.rows + len(x) > self.shape[0]:
            raise DataError(
                f"shard {shard} holds {self.path.stem} rows of shape {x.shape[1:]} beyond the "
                f"{self.shape} the manifest and the first shard give; rerun `geomscope extract` with "
                "--overwrite, or into a new --out"
            )
        write_all(self.fd, memoryview(x.reshape(-1).view(np.uint8)))
        self.rows += len(x)

    def finish(self) -> None:
        if self.rows != self.shape[0]:  # (iter_shard holds each shard to its recorded rows)
            raise DataError(
                f"{self.path.stem}: {self.rows} rows read, {self.shape[0]} recorded; the run is damaged"
            )
        try:  # (a write error the disk reports late, on a flush, comes here: it is raised)
            os.fsync(self.fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem without fsync
                raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _npy(run, tasks, names, tmp: Path, rows_done, verify: bool) -> list[str]:
    from geomscope.store.reader import shard_dim, shard_dtype

    n = sum(t.rows for t in tasks)
    with contextlib.ExitStack() as stack:
        files = {m: stack.enter_context(_NpyFile(tmp / f"{m}.npy", dt, (n,))) for m, dt in META}
        for t in tasks:
            for ch in run.checked_chunks(t, names, verify):
                for name in names:
                    x = ch.layers[name]
                    if name not in files:  # the stored dtype and width, from the first rows
                        files[name] = stack.enter_context(
                            _NpyFile(tmp / f"{name}.npy", x.dtype, (n, x.shape[1]))
                        )
                    files[name].append(x, t.path)
                for m, v in _meta(ch).items():
                    files[m].append(v, t.path)
                rows_done(ch.stop - ch.start)
        for name in names:  # a run without rows: the dtype and width of its first shard
            if name not in files:
                first = tasks[0].path
                shape = (n, shard_dim(first, name))
                files[name] = stack.enter_context(
                    _NpyFile(tmp / f"{name}.npy", shard_dtype(first, name), shape)
                )
        for f in files.values():
            f.finish()
    return sorted(p.name for p in tmp.iterdir())


def _arrow(run, tasks, names, indices, tmp: Path, rows_done, verify: bool) -> list[str]:
    try:
        import pyarrow as pa
    except ImportError:
        raise InputError("--to arrow needs pyarrow: pip install pyarrow (or 'geomscope[formats]')") from None
    # each layer's index in the model travels with its column (score reads it back: a layer
    # exported alone is reported, and plotted, at its index, not at its position among the columns)
    field_meta = {n: {LAYER_INDEX_KEY: str(i).encode()} for n, i in indices.items() if i is not None}
    files = []
    for i, t in enumerate(tasks):
        fname = f"data-{i:05d}-of-{len(tasks):05d}.arrow"
        writer = None
        with pa.OSFile(str(tmp / fname), "wb") as sink:
            for ch in run.checked_chunks(t, names, verify):
                cols = {m: pa.array(v) for m, v in _meta(ch).items()}
                for name in names:
                    x = np.ascontiguousarray(ch.layers[name])
                    cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
                schema = pa.schema([pa.field(k, v.type, metadata=field_meta.get(k)) for k, v in cols.items()])
                batch = pa.record_batch(list(cols.values()), schema=schema)
                if writer is None:
                    writer = pa.ipc.new_stream(sink, batch.schema)
                writer.write_batch(batch)
                rows_done(ch.stop - ch.start)
            if writer is not None:
                writer.close()
        files.append(fname)
    state = {
        "_data_files": [{"filename": f} for f in files],
        "_fingerprint": f"geomscope-{Path(run.dir).name}",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    (tmp / "dataset_info.json").write_text(
        json.dumps({"description": "geomscope export"}) + "\n", encoding="utf-8"
    )
    return files + ["state.json", "dataset_info.json"]
