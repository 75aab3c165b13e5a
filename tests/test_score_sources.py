"""What ``score`` reads (score/sources.py: one .npy / .h5 array, or another tool's format through
score/formats.py), damaged and crafted: .npz, Arrow / Parquet, .h5, .npy and torch files.

Each file is built here, small. A file that is read wrongly must read right (checked against the
same rows from a plain .npy); one that cannot be read is a one-line error, never a traceback, a
silent wrong number, a hang, an abort of the process, or memory allocated from a crafted shape.
Whatever could hang or abort the process under the code these tests guard against runs in a
subprocess with a timeout.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import Planted, assert_one_line_error

from geomscope.errors import DataError, InputError
from geomscope.score import ScoreOptions, score
from geomscope.score import formats as F

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

METRICS = ("isoscore", "avgcos", "spectrum")


def _opts(**kw) -> ScoreOptions:
    return ScoreOptions(metrics=METRICS, jackknife_groups=4, **kw)


def _numbers(rep: dict) -> list:
    return [[e[k] for k in ("isoscore", "avgcos", "pr", "n_rows")] for e in rep["layers"]]


def _anisotropic(n=300, d=8, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) * np.arange(1, d + 1)).astype(np.float32)


def _reference(tmp_path: Path, x: np.ndarray) -> list:
    np.save(tmp_path / "ref.npy", x)
    return _numbers(score(tmp_path / "ref.npy", _opts()))


def _read_all(path: Path, fmt: str, block_rows: int) -> np.ndarray:
    lay = F.describe(path, fmt, None, block_rows)
    name = next(iter(lay.layers))
    return np.concatenate(
        [r.layers[name] for p in lay.parts for r in F.read_rows(fmt, p, [name], block_rows)]
    )


def _cli(args, timeout=120):
    """The CLI in a subprocess: (returncode, stdout, stderr); a hang is a failure, not a stuck run."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "geomscope", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"geomscope {' '.join(map(str, args))} hung for {timeout} s")
    return r.returncode, r.stdout, r.stderr


# ------------------------------------------------------------------------------------------ npz
def test_compressed_fortran_order_npz_reads_in_row_order(tmp_path):
    """np.savez_compressed of X.T (what the 'fewer rows than columns' warning asks for) stores a
    Fortran-order member: streamed as if in C order, every row would be scrambled silently."""
    x = _anisotropic()
    ref = _reference(tmp_path, x)
    np.savez_compressed(tmp_path / "f.npz", x=np.asfortranarray(x))
    for block_rows in (7, 64, 10_000):
        np.testing.assert_array_equal(_read_all(tmp_path / "f.npz", "npz", block_rows), x)
    rep = score(tmp_path / "f.npz", _opts(block_rows=64))
    np.testing.assert_allclose(_numbers(rep), ref, rtol=1e-10)


def test_compressed_fortran_order_npz_too_big_to_read_whole_is_refused(tmp_path, monkeypatch):
    np.savez_compressed(tmp_path / "f.npz", x=np.asfortranarray(_anisotropic()))
    monkeypatch.setattr(F, "_whole_bytes_limit", lambda: 1000)
    with pytest.raises(InputError, match="Fortran-order .*save them with numpy.savez"):
        score(tmp_path / "f.npz", _opts())


def _npz_with_header(path: Path, shape, data: bytes, compression=zipfile.ZIP_STORED) -> Path:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", compression) as z:
        z.writestr("x.npy", buf.getvalue() + data)
    return path


def test_npz_shape_whose_size_wraps_int64_is_refused(tmp_path):
    """(2**33, 2**31) float32 is 2**66 bytes: a size computed with np.prod wraps to 0, which would
    pass the truncation check and cut the rows into ~2**25 read units (memory) before any read."""
    path = _npz_with_header(tmp_path / "x.npz", (2**33, 2**31), b"\0" * 4096)
    with pytest.raises(InputError, match="truncated"):
        F.describe(path, "npz", None, 2**40)


def test_compressed_npz_member_declaring_more_than_it_holds_is_refused(tmp_path):
    path = _npz_with_header(tmp_path / "x.npz", (10**9, 8), b"\0" * 4096, zipfile.ZIP_DEFLATED)
    with pytest.raises(InputError, match="truncated"):
        F.describe(path, "npz", None, 1000)


def test_crafted_fortran_member_read_whole_is_refused_before_allocating(tmp_path):
    """A compressed Fortran-order member is read whole, allocated from its shape: a shape (and an
    archive record to match) far beyond what its compressed bytes can expand to is refused first."""
    import struct

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": True, "shape": (10**6, 500)})
    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", buf.getvalue() + b"\0" * 4096)
    data = bytearray(path.read_bytes())
    claimed = struct.pack("<I", len(buf.getvalue()) + 4 * 10**6 * 500)  # the archive agrees with the shape
    central = data.index(b"PK\x01\x02")
    data[22:26], data[central + 24 : central + 28] = claimed, claimed
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="more than its compressed bytes can hold"):
        F.describe(path, "npz", None, 1000)


def _patched_npz(tmp_path: Path, name: str, patch) -> Path:
    src = tmp_path / f"{name}-src.npz"
    np.savez(src, x=_anisotropic(50, 4))
    data = bytearray(src.read_bytes())
    patch(data, data.index(b"PK\x03\x04"), data.index(b"PK\x01\x02"))
    out = tmp_path / f"{name}.npz"
    out.write_bytes(bytes(data))
    return out


def _bad_local_magic(data, local, central):
    data[local : local + 4] = b"XXXX"


def _encrypted(data, local, central):
    data[local + 6] |= 1  # general purpose flag bit 0: encrypted
    data[central + 8] |= 1


def _compression_99(data, local, central):
    data[local + 8 : local + 10] = (99).to_bytes(2, "little")
    data[central + 10 : central + 12] = (99).to_bytes(2, "little")


@pytest.mark.parametrize(
    "patch",
    [_bad_local_magic, _encrypted, _compression_99],
    ids=["bad-local-header", "encrypted", "method-99"],
)
def test_damaged_npz_member_is_one_line(tmp_path, cli, patch):
    path = _patched_npz(tmp_path, patch.__name__, patch)
    code, out, err = cli(["score", path, "-q", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "cannot be read", exit_code=2)


# ---------------------------------------------------------------------------------- arrow / parquet
def _table(n=100, d=8, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, d))
    return pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), d)})


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_fifo_in_a_data_directory_is_refused_not_opened(tmp_path, suffix):
    """Opening a FIFO blocks for ever (and pyarrow does not end on SIGTERM there)."""
    d = tmp_path / "d"
    d.mkdir()
    if suffix == ".parquet":
        pq.write_table(_table(), d / "a.parquet")
    else:
        with pa.ipc.new_stream(str(d / "a.arrow"), _table().schema) as w:
            w.write_table(_table())
    os.mkfifo(d / f"b{suffix}")
    code, out, err = _cli(["score", d, "-q", "--out", tmp_path / "r"], timeout=60)
    assert_one_line_error(code, out, err, "not a regular file", exit_code=2)


def test_a_fifo_as_datasets_state_is_refused(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    os.mkfifo(d / "state.json")
    code, out, err = _cli(["score", d, "-q", "--out", tmp_path / "r"], timeout=60)
    assert_one_line_error(code, out, err, "not a regular file", exit_code=2)


def test_ipc_file_with_list_offsets_out_of_range_is_one_line_not_an_abort(tmp_path):
    """A crafted offset past the values would abort the process in C++ (rc 134) when the column is
    sliced; each batch read is validated first."""
    n, d = 100, 8
    x = np.random.default_rng(0).standard_normal((n, d))
    offsets = np.arange(0, n * d + 1, d, dtype="<i4")
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(x.ravel()))
    path = tmp_path / "x.arrow"
    with pa.ipc.new_stream(str(path), pa.schema([("x", col.type)])) as w:
        w.write_batch(pa.record_batch([col], names=["x"]))
    data = path.read_bytes()
    at = data.index(offsets.tobytes())
    bad = offsets.copy()
    bad[1:] += 1 << 28
    path.write_bytes(data[:at] + bad.tobytes() + data[at + len(bad.tobytes()) :])
    code, out, err = _cli(["score", path, "-q", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "is damaged", exit_code=2)


def test_null_inside_a_vector_is_a_one_line_error(tmp_path):
    rows = [list(map(float, r)) for r in np.random.default_rng(0).standard_normal((50, 4))]
    rows[5][2] = None
    pq.write_table(pa.table({"x": pa.array(rows, type=pa.list_(pa.float64()))}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="null value inside a cell"):
        score(tmp_path / "n.parquet", _opts())


def test_null_doc_id_is_a_one_line_error(tmp_path):
    x = np.random.default_rng(0).standard_normal((100, 8))
    doc = pa.array([i // 10 if i != 7 else None for i in range(100)], type=pa.int64())
    t = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8), "doc_id": doc})
    pq.write_table(t, tmp_path / "d.parquet")
    with pytest.raises(DataError, match="'doc_id' has a null cell"):
        score(tmp_path / "d.parquet", _opts())


def _cells(rng, rows, k):
    return [rng.standard_normal((rows, 8)).tolist() for _ in range(k)]


@pytest.mark.parametrize("first,then", [(4, 6), (6, 4)])
def test_matrix_cells_whose_rows_change_between_row_groups(tmp_path, first, then):
    """The rows are counted from every cell, not the first: counted from the first, more rows later
    would give 'group index 12 out of range', fewer would skew the jackknife groups."""
    rng = np.random.default_rng(0)
    cells = _cells(rng, first, 10) + _cells(rng, then, 10)
    t = pa.table({"x": pa.array(cells, type=pa.list_(pa.list_(pa.float64())))})
    pq.write_table(t, tmp_path / "c.parquet", row_group_size=10)
    with pytest.raises(DataError, match="same number of rows"):
        score(tmp_path / "c.parquet", _opts())


def test_matrix_columns_with_different_rows_per_cell_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    t = pa.table(
        {
            "a": pa.array(_cells(rng, 4, 10), type=pa.list_(pa.list_(pa.float64()))),
            "b": pa.array(_cells(rng, 2, 10), type=pa.list_(pa.list_(pa.float64()))),
        }
    )
    pq.write_table(t, tmp_path / "two.parquet")
    with pytest.raises(InputError, match="different numbers of rows per cell"):
        score(tmp_path / "two.parquet", _opts())


def test_a_large_parquet_row_group_is_decoded_a_block_at_a_time(tmp_path):
    """pyarrow's default writer puts up to 1M rows in one row group: 100,000 rows of 64 numbers, few
    of them non-zero, are a 0.9 MB file and 25.6 MB decoded. Reading it in blocks of 1,000 rows holds
    the compressed pages and a few blocks of Arrow memory (2.5 MB; the row group read whole held all
    of it), and the rows are all there, in order."""
    n, d = 100_000, 64
    x = np.zeros((n, d), np.float32)
    x[:, 0] = np.arange(n)
    cells = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), d)
    path = tmp_path / "one_group.parquet"
    pq.write_table(pa.table({"h": cells}), path)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    lay = F.describe(path, "parquet", None, 1000)
    base, peak, firsts = pa.total_allocated_bytes(), 0, []
    for part in lay.parts:
        for r in F.read_rows("parquet", part, ["h"], 1000):
            peak = max(peak, pa.total_allocated_bytes() - base)
            firsts.append(r.layers["h"][:, 0].copy())  # (a view would keep the block's memory)
    np.testing.assert_array_equal(np.concatenate(firsts), np.arange(n))
    assert {len(f) for f in firsts} == {1000} and peak < n * d * 4 / 5, peak


def test_parquet_blocks_are_cut_at_the_same_rows_whatever_the_row_groups(tmp_path):
    """Blocks start at multiples of the block size within each row group, as the rows of a row
    group read whole are cut: row groups of 7 rows and 10 pages of 3, blocks of 4."""
    x = _anisotropic(23, 4)
    cells = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4)
    path = tmp_path / "groups.parquet"
    pq.write_table(pa.table({"h": cells}), path, row_group_size=7, data_page_size=40, write_batch_size=3)
    lay = F.describe(path, "parquet", None, 4)
    blocks = [r for p in lay.parts for r in F.read_rows("parquet", p, ["h"], 4)]
    assert [(b.start, len(b.layers["h"])) for b in blocks] == [
        (0, 4),
        (4, 3),
        (7, 4),
        (11, 3),
        (14, 4),
        (18, 3),
        (21, 2),
    ]
    np.testing.assert_array_equal(np.concatenate([b.layers["h"] for b in blocks]), x)


def _zero_cells(n: int, d: int):
    x = np.zeros((n, d), np.float32)
    x[:, 0] = np.arange(n)  # (rows that differ: a score of them is defined)
    x[:, 1] = np.arange(n) % 7
    return pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), d)


def _ipc(path: Path, table, compression: str | None, *, stream: bool, batch_rows: int) -> Path:
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, table.schema, options=opts) as w:
            w.write_table(table, max_chunksize=batch_rows)
    return path


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_a_compressed_ipc_file_is_decompressed_a_batch_at_a_time(tmp_path, compression, stream):
    """Opening a compressed Arrow IPC file decompressed every batch (20 batches of 2,000 x 256 zeros,
    a 0.1 MB file, held 41 MB from the open on); it reads their headers only, and a batch is
    decompressed when its rows are read. The sizes the headers declare are what pyarrow decodes."""
    from geomscope.score.decoded_sizes import ipc_messages

    n, d = 40_000, 256
    path = _ipc(
        tmp_path / "z.arrow", pa.table({"h": _zero_cells(n, d)}), compression, stream=stream, batch_rows=2000
    )
    assert path.stat().st_size < n * d * 4 / 100
    base = pa.total_allocated_bytes()
    lay = F.describe(path, "arrow", None, 1000, memory_mb=64)
    assert lay.layers["h"][:2] == (n, d) and pa.total_allocated_bytes() - base < 2000 * d * 4 * 1.5
    peak, firsts = 0, []
    for part in lay.parts:
        for r in F.read_rows("arrow", part, ["h"], 1000):
            peak = max(peak, pa.total_allocated_bytes() - base)
            firsts.append(r.layers["h"][:, 0].copy())
    np.testing.assert_array_equal(np.concatenate(firsts), np.arange(n))
    assert peak < n * d * 4 / 5, peak
    with pa.memory_map(str(path)) as src:  # the declared sizes against what pyarrow decodes
        src.seek(0 if stream else 8)
        declared = [b.decoded_bytes for b in ipc_messages(src) if not b.dictionary]
        src.seek(0 if stream else 8)
        decoded = [b.get_total_buffer_size() for b in pa.ipc.open_stream(src)]
    assert declared == decoded and len(declared) == 20


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_a_compressed_ipc_batch_over_the_memory_budget_is_refused_before_decompressing(cli, tmp_path, stream):
    """One zstd batch of 4,000 x 512 zeros: a few KB on disk, 8 MiB once decompressed, refused at
    --memory-mb 4 from its header (nothing decompressed); read at --memory-mb 16."""
    path = _ipc(
        tmp_path / "z.arrow", pa.table({"h": _zero_cells(4000, 512)}), "zstd", stream=stream, batch_rows=4000
    )
    base = pa.total_allocated_bytes()
    with pytest.raises(InputError, match="record batch 0 decompresses to 8 MiB, more than --memory-mb 4"):
        F.describe(path, "arrow", None, 1000, memory_mb=4)
    assert pa.total_allocated_bytes() - base < 1 << 20
    code, out, err = cli(["score", path, "--metrics", "avgcos", "--memory-mb", "4", "--quiet"])
    assert_one_line_error(
        code, out, err, "z.arrow", "more than --memory-mb 4", "smaller batches", exit_code=2
    )
    code, _, err = cli(
        ["score", path, "--metrics", "avgcos", "--memory-mb", "16", "--out", tmp_path / "r", "-q"]
    )
    assert code == 0, err


def test_a_parquet_page_over_the_memory_budget_is_refused_before_decompressing(cli, tmp_path):
    """One zstd page of 4,000 x 512 numbers, nearly all zero: 8 MiB decompressed from a few KB, refused
    at --memory-mb 4 from its page header; the same rows in pages of 1 MiB are read at that budget."""
    table = pa.table({"h": _zero_cells(4000, 512)})
    one = tmp_path / "one_page.parquet"
    pq.write_table(table, one, compression="zstd", use_dictionary=False, data_page_size=1 << 30)
    code, out, err = cli(["score", one, "--metrics", "avgcos", "--memory-mb", "4", "--quiet"])
    assert_one_line_error(
        code,
        out,
        err,
        "one_page.parquet",
        "a page of column",
        "decompresses to 8 MiB",
        "data_page_size",
        exit_code=2,
    )
    paged = tmp_path / "paged.parquet"
    pq.write_table(table, paged, compression="zstd", use_dictionary=False)
    code, _, err = cli(
        ["score", paged, "--metrics", "avgcos", "--memory-mb", "4", "--out", tmp_path / "r", "-q"]
    )
    assert code == 0, err


def test_parquet_page_headers_declare_what_the_metadata_sums(tmp_path):
    """decoded_sizes walks a column chunk's pages as Parquet's reader does: the pages' header and
    uncompressed bytes add up to the chunk's total_uncompressed_size, whatever the page version,
    codec or dictionary."""
    from geomscope.score.decoded_sizes import parquet_pages

    x = _anisotropic(3000, 16)
    table = pa.table(
        {"h": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 16), "doc_id": np.arange(3000) // 7}
    )
    for i, kw in enumerate(
        [
            {"compression": "zstd"},
            {"compression": "snappy", "data_page_version": "2.0"},
            {"compression": "none", "use_dictionary": False, "data_page_size": 4096},
        ]
    ):
        path = tmp_path / f"p{i}.parquet"
        pq.write_table(table, path, row_group_size=1000, **kw)
        md = pq.ParquetFile(path).metadata
        with open(path, "rb") as f:
            for g in range(md.num_row_groups):
                for c in range(md.num_columns):
                    chunk = md.row_group(g).column(c)
                    start = (
                        chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
                    )
                    pages = list(parquet_pages(f, start, chunk.total_compressed_size))
                    assert sum(p.header + p.uncompressed for p in pages) == chunk.total_uncompressed_size


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_garbled_parquet_page_is_one_line(cli, tmp_path, where):
    """A page header of no Thrift type, or compressed bytes that do not decompress: pyarrow's
    OSError becomes one line, not a traceback."""
    path = tmp_path / "g.parquet"
    x = _anisotropic(100, 8)
    cells = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)
    pq.write_table(pa.table({"h": cells}), path, compression="zstd", use_dictionary=False)
    start = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    at = start if where == "header" else start + 60
    data[at : at + 100] = b"\xff" * 100
    path.write_bytes(bytes(data))
    code, out, err = cli(["score", path, "--metrics", "avgcos", "--quiet"])
    assert_one_line_error(code, out, err, "g.parquet", exit_code=2)


def test_vector_width_that_changes_between_row_groups(tmp_path):
    rng = np.random.default_rng(0)
    rows = [list(rng.standard_normal(8)) for _ in range(100)] + [
        list(rng.standard_normal(9)) for _ in range(100)
    ]
    pq.write_table(
        pa.table({"x": pa.array(rows, type=pa.list_(pa.float64()))}),
        tmp_path / "w.parquet",
        row_group_size=100,
    )
    with pytest.raises(DataError, match="same width"):
        score(tmp_path / "w.parquet", _opts())


# ------------------------------------------------------------------------------------------- .h5
def test_h5_dataset_behind_an_external_link_is_refused(tmp_path):
    h5py = pytest.importorskip("h5py")
    x = _anisotropic()
    with h5py.File(tmp_path / "target.h5", "w") as f:
        f["secret"] = x
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f["a"] = h5py.ExternalLink("target.h5", "/secret")
        f.create_group("g")["b"] = h5py.ExternalLink("target.h5", "/secret")
        f["alias"] = h5py.SoftLink("/g/b")  # a soft link within the file, on to an external one
    for name in ("a", "g/b", "/alias"):
        with pytest.raises(InputError, match="link into another file"):
            score(tmp_path / "ext.h5", _opts(dataset=name))


def test_h5_external_link_to_a_fifo_does_not_hang(tmp_path):
    h5py = pytest.importorskip("h5py")
    os.mkfifo(tmp_path / "fifo")
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f["a"] = h5py.ExternalLink("fifo", "/x")
    code, out, err = _cli(["score", tmp_path / "ext.h5", "--dataset", "a", "-q", "--out", tmp_path / "r"], 60)
    assert_one_line_error(code, out, err, "link into another file", exit_code=2)


def test_h5_soft_links_within_the_file_are_followed(tmp_path):
    h5py = pytest.importorskip("h5py")
    x = _anisotropic()
    ref = _reference(tmp_path, x)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_group("g")["real"] = x
        f["alias"] = h5py.SoftLink("/g/real")
        f["g"]["rel"] = h5py.SoftLink("real")  # relative: within its group
        f["loop1"] = h5py.SoftLink("/loop2")
        f["loop2"] = h5py.SoftLink("/loop1")
    for name in ("alias", "/alias", "g/rel"):
        np.testing.assert_allclose(_numbers(score(tmp_path / "s.h5", _opts(dataset=name))), ref, rtol=1e-10)
    with pytest.raises(InputError):
        score(tmp_path / "s.h5", _opts(dataset="loop1"))


def test_h5_corrupt_compressed_chunk_is_one_line(tmp_path, cli):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", data=_anisotropic(2000, 16), chunks=(100, 16), compression="gzip")
        info = ds.id.get_chunk_info(5)
    data = bytearray(path.read_bytes())
    for i in range(info.byte_offset + 8, info.byte_offset + info.size - 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, err = cli(["score", path, "-q", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "cannot be read to the end", exit_code=3)


@pytest.mark.parametrize("case", ["chunked", "contiguous", "external"])
def test_an_h5_array_that_does_not_store_its_rows_is_refused_at_once(cli, tmp_path, case):
    """10^12 declared rows in a kilobyte file would be read as fill values for hours; external raw
    storage would read another file (here /etc/passwd's stand-in) as rows."""
    import h5py

    path = tmp_path / "a.h5"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(160, dtype=np.uint8).tobytes())
    with h5py.File(path, "w") as f:
        if case == "chunked":
            f.create_dataset("x", shape=(10**12, 8), dtype="f4", chunks=(1024, 8))
        elif case == "contiguous":
            f.create_dataset("x", shape=(10**9, 8), dtype="f4")
        else:
            f.create_dataset("x", shape=(5, 8), dtype="f4", external=[(str(secret), 0, 160)])
    code, out, err = cli(["score", path, "--metrics", "avgcos", "--max-rows", "100", "--quiet"])
    needle = "other files" if case == "external" else "declares shape"
    assert_one_line_error(code, out, err, "a.h5", needle, exit_code=2)


def test_an_h5_array_partly_compressed_and_whole_scores(cli, tmp_path):
    import h5py

    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "x", data=np.random.default_rng(0).normal(size=(3000, 8)), chunks=(1000, 8), compression="gzip"
        )
    assert cli(["score", path, "--metrics", "avgcos", "--out", tmp_path / "r", "--quiet"])[0] == 0


def test_an_h5_chunk_band_over_the_memory_budget_is_refused_with_how_to_rechunk(cli, tmp_path):
    """One gzip chunk of 20,000 x 64 zeros (5 MiB, decompressed whole for any read of it) against
    --memory-mb 4: refused before any read, naming a chunk shape that fits."""
    import h5py

    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "x", data=np.zeros((20_000, 64), np.float32), chunks=(20_000, 64), compression="gzip"
        )
    code, out, err = cli(["score", path, "--metrics", "avgcos", "--memory-mb", "4", "--quiet"])
    assert_one_line_error(code, out, err, "a.h5", "chunks of 20000 x 64", "h5repack -l x:CHUNK=", exit_code=2)
    assert (
        cli(["score", path, "--metrics", "avgcos", "--memory-mb", "16", "--out", tmp_path / "r", "-q"])[0]
        == 0
    )


def test_a_compressed_h5_chunk_taller_than_a_block_is_decompressed_once(tmp_path, monkeypatch):
    """Chunks of 1,000 rows, read blocks of 256 rows (the smallest) and --block-rows 16: each task is
    one band of chunks, read once (HDF5 decompressed a band again for each of its 63 blocks), and
    the numbers are the .npy's."""
    import h5py

    from geomscope.score.sources import iter_blocks, open_source
    from geomscope.store import blocks

    x = _anisotropic(3000, 8)
    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(1000, 8), compression="gzip")
    monkeypatch.setattr(blocks, "READ_BYTES", 1)  # a read block of 256 rows
    reads = []
    getitem = h5py.Dataset.__getitem__
    monkeypatch.setattr(h5py.Dataset, "__getitem__", lambda ds, key: reads.append(key) or getitem(ds, key))
    src = open_source(path, block_rows=16)
    assert [(t.start, t.stop) for t in src.tasks] == [(0, 1000), (1000, 2000), (2000, 3000)]
    rows = [b.layers["array"] for t in src.tasks for b in iter_blocks(t, ["array"], 4, 16)]
    assert len(reads) == 3 and {len(r) for r in rows} == {16, 1000 % 16}
    np.testing.assert_array_equal(np.concatenate(rows), x)
    monkeypatch.setattr(h5py.Dataset, "__getitem__", getitem)
    np.testing.assert_allclose(
        _numbers(score(path, _opts(block_rows=16))), _reference(tmp_path, x), rtol=1e-10
    )


# ------------------------------------------------------------------------------------------ .npy
def test_npy_suffix_is_case_insensitive(tmp_path):
    x = _anisotropic()
    ref = _reference(tmp_path, x)
    np.save(tmp_path / "x.npy", x)
    os.rename(tmp_path / "x.npy", tmp_path / "X.NPY")
    np.testing.assert_allclose(_numbers(score(tmp_path / "X.NPY", _opts())), ref, rtol=1e-10)


@pytest.mark.parametrize(
    "array, needle",
    [
        (np.zeros((3, 4, 5)), "shape (3, 4, 5)"),
        (np.array([["a", "b"], ["c", "d"]]), "dtype <U1"),
        (np.zeros((10, 4), complex), "dtype complex128"),
    ],
)
def test_score_wrong_array_shape_or_dtype_exits_2(cli, tmp_path, array, needle):
    np.save(tmp_path / "a.npy", array)
    code, out, err = cli(["score", tmp_path / "a.npy", "--quiet"])
    assert_one_line_error(code, out, err, needle, exit_code=2)


def test_score_never_unpickles_an_object_array(cli, tmp_path):
    marker = tmp_path / "PWNED"
    arr = np.empty((2, 2), dtype=object)
    arr[0, 0] = Planted(marker)
    np.save(tmp_path / "obj.npy", arr, allow_pickle=True)
    code, out, err = cli(["score", tmp_path / "obj.npy", "--quiet"])
    assert_one_line_error(code, out, err, exit_code=2)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "empty or cut short"),
        (b"\x93NUMPY\x01", "empty or cut short"),
        (bytes(range(256)) * 4, "never unpickles"),
    ],
)
def test_a_broken_npy_is_one_line_that_never_suggests_unpickling(cli, tmp_path, content, needle):
    """An empty or cut .npy is not a Ctrl-C (numpy's EOFError reads as one to click), and random bytes
    are not "pickled data you may load unsafely"."""
    bad = tmp_path / "bad.npy"
    bad.write_bytes(content)
    code, out, err = cli(["score", bad, "--quiet"])
    line = assert_one_line_error(code, out, err, "bad.npy", needle, exit_code=2)
    assert "unsafe" not in line and "interrupted" not in line
    ok = tmp_path / "ok.npy"
    np.save(ok, np.random.default_rng(0).normal(size=(50, 4)))
    code, out, err = cli(["score", ok, "--metrics", "isoscore_star", "--shrinkage-target", bad, "--quiet"])
    line = assert_one_line_error(code, out, err, "--shrinkage-target", needle, exit_code=2)
    assert "interrupted" not in line


def _npy_declaring(path: Path, shape, dtype="<f4", data: bytes = b"\0" * 160) -> Path:
    """A .npy file whose header declares ``shape`` (whatever data follows)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    path.write_bytes(buf.getvalue() + data)
    return path


@pytest.mark.parametrize("shape", [(-9, 4), (10, -4), (-5, -8)])
def test_an_npy_header_with_a_negative_dimension_is_one_line(cli, tmp_path, shape):
    """numpy maps (10, -4) as a length that overflows (OverflowError) and refuses (-5, -8) only as a
    whole: every .npy reader checks the header's shape first, an .npz member's too."""
    bad = _npy_declaring(tmp_path / "bad.npy", shape)
    code, out, err = cli(["score", bad, "--quiet"])
    assert_one_line_error(code, out, err, "bad.npy", "negative dimension", exit_code=2)
    np.save(tmp_path / "ok.npy", _anisotropic(50, 4))
    code, out, err = cli(
        ["score", tmp_path / "ok.npy", "--metrics", "isoscore_star", "--shrinkage-target", bad, "--quiet"]
    )
    assert_one_line_error(code, out, err, "--shrinkage-target", "negative dimension", exit_code=2)
    with zipfile.ZipFile(tmp_path / "bad.npz", "w") as z:
        z.writestr("x.npy", bad.read_bytes())
    code, out, err = cli(["score", tmp_path / "bad.npz", "--quiet"])
    assert_one_line_error(code, out, err, "bad.npz", "negative dimension", exit_code=2)


def test_a_shrinkage_target_is_refused_from_its_header(cli, tmp_path):
    """A covariance is read whole: one whose header declares another size than D x D (here 720 GB)
    is refused before any of it is read or allocated."""
    np.save(tmp_path / "ok.npy", _anisotropic(50, 4))
    big = _npy_declaring(tmp_path / "cov.npy", (300_000, 300_000), "<f8")
    code, out, err = cli(
        ["score", tmp_path / "ok.npy", "--metrics", "isoscore_star", "--shrinkage-target", big, "--quiet"]
    )
    assert_one_line_error(code, out, err, "is 300000 x 300000 but the data has D = 4", exit_code=2)


def test_score_refuses_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "rows.npy"
    os.mkfifo(fifo)
    ok = tmp_path / "ok.npy"
    np.save(ok, np.zeros((5, 3)))
    for args in (["score", fifo], ["score", ok, "--metrics", "isoscore_star", "--shrinkage-target", fifo]):
        p = subprocess.run(
            [sys.executable, "-m", "geomscope", *map(str, args), "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,  # a read of the FIFO would block until then
        )
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith("error:") and "rows.npy" in p.stderr


# ------------------------------------------------------------------------------------ torch files
def test_pt_parameter_and_float8_tensors_are_read(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    x = _anisotropic()
    ref = _reference(tmp_path, x)
    t = torch.from_numpy(x)
    torch.save({"emb": torch.nn.Parameter(t.clone())}, tmp_path / "param.pt")  # requires grad
    np.testing.assert_allclose(_numbers(score(tmp_path / "param.pt", _opts())), ref, rtol=1e-10)

    f8 = t.to(torch.float8_e4m3fn)
    np.save(tmp_path / "f8ref.npy", f8.float().numpy())
    want = _numbers(score(tmp_path / "f8ref.npy", _opts()))
    torch.save(f8, tmp_path / "f8.pt")
    save_file({"x": f8.contiguous()}, str(tmp_path / "f8.safetensors"))
    for name in ("f8.pt", "f8.safetensors"):
        np.testing.assert_allclose(_numbers(score(tmp_path / name, _opts())), want, rtol=1e-10, err_msg=name)


def test_legacy_pt_is_one_read_unit(tmp_path):
    """A legacy (non-zip) .pt cannot be memory-mapped: it is loaded once, not again for every part."""
    torch = pytest.importorskip("torch")
    x = _anisotropic()
    ref = _reference(tmp_path, x)
    torch.save({"x": torch.from_numpy(x)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert len(F.describe(tmp_path / "legacy.pt", "pt", None, 16).parts) == 1
    torch.save({"x": torch.from_numpy(x)}, tmp_path / "zip.pt")
    assert len(F.describe(tmp_path / "zip.pt", "pt", None, 16).parts) == -(-len(x) // 16)
    np.testing.assert_allclose(_numbers(score(tmp_path / "legacy.pt", _opts(block_rows=16))), ref, rtol=1e-10)


def test_sparse_pt_tensor_is_refused_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save(torch.from_numpy(_anisotropic()).to_sparse(), tmp_path / "s.pt")
    with pytest.raises(InputError, match="sparse tensor"):
        score(tmp_path / "s.pt", _opts())


def test_an_empty_pt_file_is_one_line(cli, tmp_path):
    (tmp_path / "zero.pt").write_bytes(b"")
    code, out, err = cli(["score", tmp_path / "zero.pt", "--quiet"])
    assert_one_line_error(code, out, err, "zero.pt", exit_code=2)
