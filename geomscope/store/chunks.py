"""Where a shard's rows lie in its file, for reading and writing them without h5py in between.

A (rows, D) dataset stored as geomscope writes it -- chunks of whole rows, no filter, numbers in this
machine's byte order -- holds rows ``first:first + chunk`` as one block of bytes, row after row. h5py
holds the GIL for the whole of a read or a write, so a thread that reads the next shard (``score``) or
stores the last batch's rows (``extract``) stops every other thread's Python meanwhile; ``readinto``
and ``os.pwrite`` on those byte ranges release it (and skip HDF5's selection machinery).
"""

from __future__ import annotations

import h5py


def row_spans(ds: h5py.Dataset, start: int, stop: int) -> list[tuple[int, int]] | None:
    """(file offset, bytes) of rows ``start:stop`` of ``ds`` in each chunk they fall in, in row order;
    None when the rows cannot be reached that way (another layout, a filter, a byte order not this
    machine's, an HDF5 before 1.10.5, or a chunk with no file space yet: h5py must do it)."""
    if ds.ndim != 2 or ds.chunks is None or ds.chunks[1] != ds.shape[1] or stop <= start:
        return None
    if not ds.dtype.isnative or ds.dtype.kind not in "fiub":
        return None
    if not hasattr(ds.id, "get_chunk_info_by_coord"):  # h5py built on HDF5 before 1.10.5
        return None
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CHUNKED or plist.get_nfilters() != 0:
        return None
    per_chunk, row_bytes = ds.chunks[0], ds.shape[1] * ds.dtype.itemsize
    spans = []
    for first in range(start - start % per_chunk, stop, per_chunk):
        info = ds.id.get_chunk_info_by_coord((first, 0))
        if info.byte_offset is None or info.filter_mask != 0 or info.size != per_chunk * row_bytes:
            return None  # no file space (h5py gives its fill value), or not stored as plain rows
        lo, hi = max(start, first) - first, min(stop, first + per_chunk) - first
        spans.append((info.byte_offset + lo * row_bytes, (hi - lo) * row_bytes))
    return spans
