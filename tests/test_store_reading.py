"""Reading a shard's rows: the direct chunk reads of ``store/reader.py`` against h5py's own reads.

A dataset stored as geomscope writes it is read chunk by chunk with ``os.preadv`` from the file h5py
opened (h5py holds the GIL for a whole read); everything else goes through h5py. Both must give
exactly ``ds[start:stop]``. Shards that geomscope wrote, read in steps of every size:
tests/test_store_writing.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

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
    with h5py.File(path, "r") as f:
        reader = _RowReader(path, f)
        try:
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
        # (HDF5 itself refuses to open the cut file: the reader reads it with the intact file's layout)
        fd = os.open(cut, os.O_RDONLY)
        reader = _RowReader(
            cut, SimpleNamespace(driver="sec2", id=SimpleNamespace(get_vfd_handle=lambda: fd))
        )
        os.close(fd)  # the reader holds its own duplicate
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
    with h5py.File(path, "r") as f:
        reader = _RowReader(path, f)
        try:
            old = OldDataset(f["plain"])
            assert row_spans(f["plain"], 0, 20) is not None
            assert row_spans(old, 0, 20) is None
            np.testing.assert_array_equal(reader.rows(old, 2, 19), x[2:19])
        finally:
            reader.close()


def test_a_file_is_held_to_its_identity_on_this_machine_only(tmp_path):
    """``identity`` tells a file from one put in its place (a new inode) or changed (size, mtime); one
    taken on another machine (a Dask worker reading a shared filesystem with device and inode numbers
    of its own) is not compared."""
    from geomscope.store.integrity import check_same_file, identity, open_regular

    path = tmp_path / "f.h5"
    _datasets(path)
    planned = identity(path)
    with open_regular(path) as f:
        check_same_file(path, f.fileno(), planned)
        check_same_file(path, f.fileno(), None)
        check_same_file(path, f.fileno(), ("another-machine", 1, 2, 3, 4))
    spare = tmp_path / "spare.h5"
    spare.write_bytes(path.read_bytes())
    os.replace(spare, path)  # the same bytes, another file
    assert identity(path) != planned
    with open_regular(path) as f, pytest.raises(DataError, match="f.h5 was replaced or changed"):
        check_same_file(path, f.fileno(), planned)
    link = tmp_path / "link.h5"
    link.symlink_to(path)
    assert identity(link) is None  # not a regular file: the checks before any read say what it is
    with pytest.raises(DataError, match="symbolic link"):
        open_regular(link)
    os.mkfifo(tmp_path / "fifo.h5")
    with pytest.raises(DataError, match="not a regular file"):
        open_regular(tmp_path / "fifo.h5")  # at once: the open does not wait for a writer
    with pytest.raises(DataError, match="missing"):
        open_regular(tmp_path / "absent.h5")


@pytest.mark.parametrize("dim", [2, 64])
def test_a_read_step_counts_the_rows_fields_as_well_as_their_values(tmp_path, monkeypatch, dim):
    """The default read step stays within its byte budget for narrow layers too: a row's index fields
    and flags (about 26 bytes) outweigh two float16 values."""
    from geomscope.store import RunWriter, iter_shard
    from geomscope.store import reader as store_reader

    budget = 64 * 1024
    monkeypatch.setattr(store_reader, "READ_CHUNK_BYTES", budget)
    rows = 20_000
    ident = {"model": {"name": "narrow", "hidden_size": dim}, "layers": [{"name": "layer_00", "index": 0}]}
    with RunWriter(tmp_path / "run", ident) as w:
        sw = w.shard_writer(0, layer_names=["layer_00"], dim=dim, store_dtype="float16", expected_rows=rows)
        sw.append(
            {"layer_00": np.ones((rows, dim), np.float32)},
            token_id=np.arange(rows),
            doc_id=np.arange(rows) // 10,
            position=np.arange(rows) % 10,
            is_special=np.zeros(rows, bool),
        )
        info = sw.close()
        w.add_shard(info)
        w.finalize({"docs": rows // 10})
    per_row = store_reader.row_bytes(dim, 2, 1)
    seen = 0
    for ch in iter_shard(tmp_path / "run" / info.file, ["layer_00"]):
        step = len(ch)
        assert step * per_row <= max(budget, 1024 * per_row)
        meta = sum(a.nbytes for a in (ch.token_id, ch.doc_id, ch.position, ch.is_special))
        assert step * dim * 2 + meta + ch.nonfinite["layer_00"].nbytes == step * per_row
        seen += step
    assert seen == rows


def test_under_another_hdf5_driver_h5py_reads_and_the_path_is_checked(tmp_path, monkeypatch):
    """Where h5py does not read through a plain descriptor (another HDF5 driver), the rows come from
    h5py and the identity is checked on the path opened again."""
    from geomscope.store import integrity
    from geomscope.store import reader as store_reader
    from geomscope.store.integrity import identity

    path = tmp_path / "f.h5"
    x = _datasets(path)
    with h5py.File(path, "r+") as f:  # what open_checked asks of a shard
        f.attrs["format"] = "geomscope-shard"
        f.create_group("layers")
    monkeypatch.setattr(store_reader, "h5_descriptor", lambda f: None)
    monkeypatch.setattr(integrity, "h5_descriptor", lambda f: None)
    planned = identity(path)
    with integrity.open_checked(path, planned) as f:
        reader = _RowReader(path, f)
        try:
            assert reader._fd is None
            np.testing.assert_array_equal(reader.rows(f["plain"], 2, 19), x[2:19])
        finally:
            reader.close()
    spare = tmp_path / "spare.h5"
    spare.write_bytes(path.read_bytes())
    os.replace(spare, path)
    with pytest.raises(DataError, match="replaced or changed"):
        integrity.open_checked(path, planned)
