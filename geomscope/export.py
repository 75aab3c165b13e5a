"""``export_run``: a finished run in other tools' formats, streamed shard by shard.

- ``npy``: ``DIR/<layer>.npy`` (rows, D) in the run's stored dtype, one per layer, and the per-row
  ``doc_id.npy`` (int64), ``position.npy`` (int64), ``token_id.npy`` (int64), ``special.npy`` (bool),
  all in the same row order (shard by shard). ``np.load(..., mmap_mode="r")`` reads them without
  loading, and ``geomscope score DIR/<layer>.npy`` scores one layer.
- ``arrow``: a ``datasets.save_to_disk`` directory (``datasets.load_from_disk(DIR)`` opens it;
  pyarrow and polars read its ``data-*.arrow`` Arrow IPC stream files directly): one data file per
  shard with the columns ``doc_id, position, token_id, special`` and one fixed-size-list column per
  layer. ``geomscope score DIR`` reads it back, by document groups, as it reads the run.

The export is written into a temporary sibling directory and renamed into place when complete, so
an interrupted export leaves no half-written ``DIR``; an existing non-empty ``DIR`` is refused, never
overwritten. ``geomscope-export.json`` records what was exported from where.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from geomscope.errors import InputError
from geomscope.fileio import fsync_dir, temp_path

EXPORT_FORMATS = ("arrow", "npy")
EXPORT_MARKER = "geomscope-export.json"
META = (("doc_id", np.int64), ("position", np.int64), ("token_id", np.int64), ("special", np.bool_))


def export_run(run_dir, to: str, out_dir, *, layers: list[str] | None = None, progress=None) -> dict:
    """Write the run ``run_dir`` as ``to`` ("arrow" | "npy") into ``out_dir``; return the summary
    recorded in ``out_dir/geomscope-export.json``. ``progress(rows)`` is called per chunk read."""
    from geomscope.store import Run

    if to not in EXPORT_FORMATS:
        raise InputError(
            f"--to {to!r} is not a format export writes; choose one of {', '.join(EXPORT_FORMATS)}"
        )
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
    names = run.resolve_layers(layers)
    out = Path(out_dir)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise InputError(f"{out} exists and is not an empty directory; choose a new --out directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(out)
        tmp.mkdir()
    except OSError as e:
        raise InputError(
            f"cannot write into {out.parent} ({e.strerror or e}); choose another --out"
        ) from None
    try:
        shards = sorted(run.shards, key=lambda s: s.index)
        writer = _npy if to == "npy" else _arrow
        files = writer(run, shards, names, tmp, progress)
        summary = {
            "format": to,
            "source_run": str(Path(run_dir).resolve()),
            "model": (run.identity.get("model") or {}).get("name"),
            "layers": names,
            "rows": sum(s.rows for s in shards),
            "columns": [m for m, _ in META] + names,
            "files": files,
        }
        (tmp / EXPORT_MARKER).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty (checked above): the rename needs the name free
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:  # a full disk, permissions ...: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)  # ours alone: made above under a fresh name
        raise InputError(
            f"cannot write the export to {out} ({e.strerror or e}); free space or choose another --out"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _chunks(run, shard, names):
    from geomscope.store import iter_shard

    yield from iter_shard(run.shard_path(shard), names, rows=shard.rows, dim=run.dim)


def _meta(ch) -> dict[str, np.ndarray]:
    return {
        "doc_id": np.asarray(ch.doc_id, np.int64),
        "position": np.asarray(ch.position, np.int64),
        "token_id": np.asarray(ch.token_id, np.int64),
        "special": np.asarray(ch.is_special, bool),
    }


def _npy(run, shards, names, tmp: Path, progress) -> list[str]:
    from geomscope.store import shard_dim

    n = sum(s.rows for s in shards)
    first = run.shard_path(shards[0])
    arrays = {}
    for name in names:
        d = shard_dim(first, name)
        dtype = np.dtype(_stored_dtype(first, name))
        arrays[name] = np.lib.format.open_memmap(tmp / f"{name}.npy", "w+", dtype, (n, d))
    for m, dt in META:
        arrays[m] = np.lib.format.open_memmap(tmp / f"{m}.npy", "w+", dt, (n,))
    pos = 0
    for s in shards:
        for ch in _chunks(run, s, names):
            k = ch.stop - ch.start
            for name in names:
                arrays[name][pos : pos + k] = ch.layers[name]
            for m, v in _meta(ch).items():
                arrays[m][pos : pos + k] = v
            pos += k
            if progress:
                progress(k)
    for a in arrays.values():
        a.flush()
    del arrays
    return sorted(p.name for p in tmp.iterdir())


def _stored_dtype(shard_path: Path, name: str) -> str:
    import h5py

    with h5py.File(shard_path, "r") as f:
        return f["layers"][name].dtype.str


def _arrow(run, shards, names, tmp: Path, progress) -> list[str]:
    try:
        import pyarrow as pa
    except ImportError:
        raise InputError("--to arrow needs pyarrow: pip install pyarrow (or 'geomscope[formats]')") from None
    files = []
    for i, s in enumerate(shards):
        fname = f"data-{i:05d}-of-{len(shards):05d}.arrow"
        writer = None
        with pa.OSFile(str(tmp / fname), "wb") as sink:
            for ch in _chunks(run, s, names):
                cols = {m: pa.array(v) for m, v in _meta(ch).items()}
                for name in names:
                    x = np.ascontiguousarray(ch.layers[name])
                    cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
                batch = pa.record_batch(cols)
                if writer is None:
                    writer = pa.ipc.new_stream(sink, batch.schema)
                writer.write_batch(batch)
                if progress:
                    progress(ch.stop - ch.start)
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
