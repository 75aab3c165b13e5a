"""Where a shard's rows lie in its file, for reading and writing them without h5py in between.

A (rows, D) dataset stored as geomscope writes it -- chunks of whole rows, no filter, numbers in this
machine's byte order -- holds rows ``first:first + chunk`` as one block of bytes, row after row. h5py
holds the GIL for the whole of a read or a write, so a thread that reads the next shard (``score``) or
stores the last batch's rows (``extract``) stops every other thread's Python meanwhile; ``readinto``
and ``os.pwrite`` on those byte ranges release it (and skip HDF5's selection machinery).
"""

from __future__ import annotations

import h5py


def stored_as_rows(ds: h5py.Dataset) -> bool:
    """Whether ``ds`` keeps its rows as plain bytes in chunks of whole rows: two dimensions, chunked
    by rows, no filter, numbers in this machine's byte order, and an HDF5 (1.10.5 or later) that says
    where each chunk is."""
    if ds.ndim != 2 or ds.chunks is None or ds.chunks[1] != ds.shape[1]:
        return False
    if not ds.dtype.isnative or ds.dtype.kind not in "fiub":
        return False
    if not hasattr(ds.id, "get_chunk_info_by_coord"):  # h5py built on HDF5 before 1.10.5
        return False
    plist = ds.id.get_create_plist()
    return plist.get_layout() == h5py.h5d.CHUNKED and plist.get_nfilters() == 0


def chunk_spans(ds: h5py.Dataset, start: int, stop: int) -> list[tuple[int, int]] | None:
    """(file offset, bytes) of rows ``start:stop`` (``stop > start``) of a dataset
    :func:`stored_as_rows`, in each chunk they fall in, in row order; None when a chunk has no file
    space yet (h5py gives its fill value) or is not stored as plain rows. ValueError for a chunk of
    another size: HDF5 stores every chunk of an unfiltered dataset whole, so that is damage (h5py would
    return memory it never filled for the missing part)."""
    per_chunk, row_bytes = ds.chunks[0], ds.shape[1] * ds.dtype.itemsize
    spans = []
    for first in range(start - start % per_chunk, stop, per_chunk):
        info = ds.id.get_chunk_info_by_coord((first, 0))
        if info.byte_offset is None or info.filter_mask != 0:
            return None
        if info.size != per_chunk * row_bytes:
            raise ValueError(f"the chunk at row {first} holds {info.size} bytes, not {per_chunk * row_bytes}")
        lo, hi = max(start, first) - first, min(stop, first + per_chunk) - first
        spans.append((info.byte_offset + lo * row_bytes, (hi - lo) * row_bytes))
    return spans


def row_spans(ds: h5py.Dataset, start: int, stop: int) -> list[tuple[int, int]] | None:
    """:func:`chunk_spans` of rows ``start:stop`` of ``ds``; None when the rows cannot be reached
    that way (not :func:`stored_as_rows`, no rows, or a chunk without file space: h5py must)."""
    if stop <= start or not stored_as_rows(ds):
        return None
    return chunk_spans(ds, start, stop)
