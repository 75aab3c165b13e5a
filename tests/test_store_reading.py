"""Reading a shard's rows: the direct chunk reads of ``store/reader.py`` against h5py's own reads.

A dataset stored as geomscope writes it is read chunk by chunk with ``readinto`` (h5py holds the GIL
for a whole read); everything else goes through h5py. Both must give exactly ``ds[start:stop]``. Shards
that geomscope wrote, read in steps of every size: tests/test_store_writing.py.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from geomscope.errors import DataError
from geomscope.store.chunks import row_spans
from geomscope.store.reader import _RowReader


def _datasets(path):
    """Datasets that h5py must read: compressed, contiguous, big-endian, with a chunk never written."""
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    with h5py.File(path, "w") as f:
        f.create_dataset("gzip", data=x, chunks=(8, 3), compression="gzip")
        f.create_dataset("contiguous", data=x)
        f.create_dataset("big_endian", data=x.astype(">f4"), chunks=(8, 3))
        f.create_dataset("part_of_a_row", data=x, chunks=(8, 2))
        holes = f.create_dataset("unwritten", shape=(20, 3), dtype=np.float32, chunks=(8, 3), fillvalue=-7)
        holes[:8] = x[:8]
        plain = f.create_dataset("plain", data=x, chunks=(8, 3))
        assert plain.id.get_create_plist().get_layout() == h5py.h5d.CHUNKED
    return x


def test_other_layouts_are_read_by_h5py_with_the_same_rows(tmp_path):
    path = tmp_path / "f.h5"
    x = _datasets(path)
    reader = _RowReader(path)
    try:
        with h5py.File(path, "r") as f:
            for name in ("gzip", "contiguous", "big_endian", "part_of_a_row", "unwritten", "plain"):
                ds = f[name]
                direct = row_spans(ds, 3, 17) is not None
                assert direct == (name == "plain"), name
                for start, stop in ((0, 20), (3, 17), (8, 16), (19, 20)):
                    got = reader.rows(ds, start, stop)
                    np.testing.assert_array_equal(got, ds[start:stop])
                    if name != "unwritten":
                        np.testing.assert_array_equal(got, x[start:stop])
            assert (reader.rows(f["unwritten"], 6, 12)[2:] == -7).all()  # h5py's fill value
    finally:
        reader.close()


def test_a_chunk_past_the_end_of_the_file_is_a_corrupt_shard(tmp_path):
    """Rows whose chunk the file no longer holds (a copy cut short) are refused, not read as zeros."""
    path = tmp_path / "f.h5"
    x = _datasets(path)
    with h5py.File(path, "r") as f:
        ds = f["plain"]
        last_offset, size = ds.id.get_chunk_info_by_coord((16, 0))[2:4]
        cut = tmp_path / "cut.h5"
        cut.write_bytes(path.read_bytes()[: last_offset + size // 4])  # 2 of its 4 rows in use
        reader = _RowReader(cut)
        try:
            np.testing.assert_array_equal(reader.rows(ds, 0, 16), x[:16])  # chunks still whole
            with pytest.raises(DataError, match="cut.h5 is corrupt or truncated .*past the end of the file"):
                reader.rows(ds, 10, 20)
        finally:
            reader.close()


def test_without_hdf5s_chunk_index_query_h5py_reads_the_rows(tmp_path):
    """h5py built on an HDF5 older than 1.10.5 has no ``get_chunk_info_by_coord``: h5py reads."""

    class OldID:
        def __init__(self, real):
            self.get_create_plist = real.get_create_plist

    class OldDataset:
        def __init__(self, real):
            self.real, self.id = real, OldID(real.id)
            self.ndim, self.chunks, self.shape, self.dtype = real.ndim, real.chunks, real.shape, real.dtype

        def __getitem__(self, key):
            return self.real[key]

    path = tmp_path / "f.h5"
    x = _datasets(path)
    reader = _RowReader(path)
    try:
        with h5py.File(path, "r") as f:
            old = OldDataset(f["plain"])
            assert row_spans(f["plain"], 0, 20) is not None
            assert row_spans(old, 0, 20) is None
            np.testing.assert_array_equal(reader.rows(old, 2, 19), x[2:19])
    finally:
        reader.close()
