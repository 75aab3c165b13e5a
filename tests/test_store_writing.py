"""Writing a shard's rows: ``os.pwrite`` into the chunks HDF5 allocated (store/shard.py ``_DirectRows``)
against h5py's own writes. Either way the file must hold exactly the rows appended, as h5py reads them;
the round trip through the direct reads of ``store/reader.py`` is checked here too. The writer's
other duties: the fast float16 NaN/Inf check and per-layer counts of non-finite rows, small shards
kept small, and appends from a buffer the caller reuses."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from contextlib import contextmanager

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import geomscope.store.shard as shard_mod
from geomscope.store import Run, RunWriter, ShardWriter, checksum, iter_shard, nonfinite_rows
from geomscope.store.chunks import row_spans

IDENT = {
    "model": {"name": "toy", "hidden_size": 4},
    "layers": [{"name": "a", "index": 0}, {"name": "b", "index": 1}],
}


def _write(path, sizes, dim, dtype="float16", expected=None, layers=("a", "b")):
    """A shard of ``sizes`` appends; returns the rows appended per layer, in the store dtype."""
    sw = ShardWriter(
        path, index=0, layer_names=list(layers), dim=dim, store_dtype=dtype, expected_rows=expected
    )
    rng = np.random.default_rng(sum(sizes) * 31 + dim)
    parts, start = [], 0
    for n in sizes:
        x = rng.standard_normal((n, dim)).astype(np.float32)
        ids = np.arange(start, start + n)
        sw.append({name: x * (k + 1) for k, name in enumerate(layers)}, ids, ids, ids, np.zeros(n, bool))
        parts.append(x)
        start += n
    sw.close()
    x = np.concatenate(parts)
    return {name: (x * (k + 1)).astype(dtype) for k, name in enumerate(layers)}


def _assert_holds(path, want):
    with h5py.File(path, "r") as f:
        for name, rows in want.items():
            np.testing.assert_array_equal(f["layers"][name][:], rows)  # h5py's own read
    got = list(iter_shard(path, list(want), chunk_rows=37))
    for name, rows in want.items():
        read = np.concatenate([c.layers[name] for c in got]) if got else rows[:0]
        np.testing.assert_array_equal(read, rows)


@contextmanager
def _direct_writes():
    """Every ``_DirectRows.write`` answer while inside, in order (True: written with os.pwrite)."""
    calls = []
    real = shard_mod._DirectRows.write

    def spy(self, ds, start, rows):
        calls.append(real(self, ds, start, rows))
        return calls[-1]

    shard_mod._DirectRows.write = spy
    try:
        yield calls
    finally:
        shard_mod._DirectRows.write = real


@pytest.fixture
def direct_calls():
    with _direct_writes() as calls:
        yield calls


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=6),
    expected=st.integers(1, 90),
    dim=st.integers(1, 9),
    dtype=st.sampled_from(["float16", "float32"]),
    step=st.integers(1, 100),
)
def test_rows_written_and_read_in_place_are_h5pys(tmp_path_factory, sizes, expected, dim, dtype, step):
    """Shards of many chunk sizes (``expected_rows``) with a partly filled last chunk: every layer's
    rows are written with os.pwrite (none by h5py); read back in steps that start and end anywhere
    in a chunk, the reader takes its direct path too, and every read equals h5py's and the rows
    appended."""
    path = tmp_path_factory.mktemp("shard") / "s.h5"
    with _direct_writes() as calls:
        want = _write(path, sizes, dim, dtype, expected)
    n = sum(sizes)
    assert (len(calls) > 0) == (n > 0) and all(calls)
    got = list(iter_shard(path, ["a", "b"], chunk_rows=step))
    assert sum(len(ch) for ch in got) == n
    with h5py.File(path, "r") as f:
        for name in ("a", "b"):
            ds = f["layers"][name]
            assert ds.shape == (n, dim)
            np.testing.assert_array_equal(ds[:], want[name])
            if n:
                assert row_spans(ds, 0, n) is not None  # the reader's direct path, not h5py's
            for ch in got:
                assert ch.layers[name].dtype == np.dtype(dtype)
                np.testing.assert_array_equal(ch.layers[name], ds[ch.start : ch.stop])


def test_where_rows_cannot_be_placed_h5py_writes_them(tmp_path, monkeypatch, direct_calls):
    """Rows not stored as plain rows (an HDF5 before 1.10.5, say): h5py writes them."""
    monkeypatch.setattr(shard_mod, "stored_as_rows", lambda ds: False)
    want = _write(tmp_path / "s.h5", [40, 7, 90], dim=5, expected=64)
    assert direct_calls and not any(direct_calls)
    _assert_holds(tmp_path / "s.h5", want)


def test_once_h5py_writes_a_layer_it_writes_the_rest_of_it(tmp_path, monkeypatch, direct_calls):
    """A layer whose rows could not be placed once is written by h5py from then on (h5py may hold
    its chunks in its cache); the other layer goes on in place; the file holds every row."""
    real = shard_mod.chunk_spans
    asked = {"a": 0}

    def fails_once_for_a(ds, start, stop):
        if ds.name.endswith("/a"):
            asked["a"] += 1
            if asked["a"] == 2:
                return None
        return real(ds, start, stop)

    monkeypatch.setattr(shard_mod, "chunk_spans", fails_once_for_a)
    want = _write(tmp_path / "s.h5", [64, 64, 64, 64, 10], dim=3, expected=64)
    assert asked["a"] == 2  # asked twice, then never again
    assert direct_calls.count(False) == 4  # "a"'s second write and the three after it
    _assert_holds(tmp_path / "s.h5", want)


def test_without_pwrite_h5py_writes_every_row(tmp_path, monkeypatch, direct_calls):
    monkeypatch.delattr(shard_mod.os, "pwrite")
    want = _write(tmp_path / "s.h5", [100, 3], dim=4, expected=32)
    assert direct_calls and not any(direct_calls)
    _assert_holds(tmp_path / "s.h5", want)


def test_a_short_write_is_continued(tmp_path, monkeypatch):
    """os.pwrite may write fewer bytes than asked: the rest is written after them."""
    real = shard_mod.os.pwrite

    def short(fd, data, offset):
        return real(fd, data[: max(1, len(data) // 3)], offset)

    monkeypatch.setattr(shard_mod.os, "pwrite", short)
    want = _write(tmp_path / "s.h5", [70, 70], dim=6, expected=64)
    _assert_holds(tmp_path / "s.h5", want)


def test_an_aborted_shard_leaves_no_file_and_no_handle(tmp_path):
    sw = ShardWriter(tmp_path / "s.h5", index=0, layer_names=["a"], dim=3, expected_rows=10)
    ids = np.arange(12)
    sw.append({"a": np.ones((12, 3), np.float32)}, ids, ids, ids, np.zeros(12, bool))
    sw.abort()
    assert sw._direct._fd is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("block", [7, 50, 1 << 16])
def test_per_row_fields_written_in_blocks_hold_every_row(tmp_path, monkeypatch, block):
    """The ids, positions and flags are kept and written ``META_BLOCK_ROWS`` at a time (a block
    smaller than a chunk, a few chunks, the whole shard): each field holds every row appended, in
    order, beside its layer rows."""
    monkeypatch.setattr(shard_mod, "META_BLOCK_ROWS", block)
    sw = ShardWriter(
        tmp_path / "s.h5", index=0, layer_names=["a"], dim=2, expected_rows=16, row_flags=("loss_target",)
    )
    rng = np.random.default_rng(5)
    want = {k: [] for k in ("a", "token_id", "doc_id", "position", "is_special", "loss_target", "bad")}
    start = 0
    for n in (5, 30, 1, 64, 17):
        x = rng.standard_normal((n, 2)).astype(np.float16)
        x[rng.random(n) < 0.2, 1] = np.inf
        ids = np.arange(start, start + n)
        special, target = rng.random(n) < 0.3, rng.random(n) < 0.5
        sw.append({"a": x}, ids * 3, ids // 4, ids % 11, special, loss_target=target)
        new = (x, ids * 3, ids // 4, ids % 11, special, target, ~np.isfinite(x).all(1))
        for k, v in zip(want, new, strict=True):
            want[k].append(v)
        start += n
    info = sw.close()
    want = {k: np.concatenate(v) for k, v in want.items()}
    assert info.rows == start == 117 and info.nonfinite_rows == int(want["bad"].sum()) > 0
    with h5py.File(tmp_path / "s.h5", "r") as f:
        np.testing.assert_array_equal(f["layers/a"][:], want["a"])
        np.testing.assert_array_equal(f["nonfinite/a"][:], want["bad"])
        for k in ("token_id", "doc_id", "position", "is_special", "loss_target"):
            np.testing.assert_array_equal(f[k][:], want[k], err_msg=k)


# ---------------------------------------------------------------- checksums of finished shards


def _finished(path, n=50):
    sw = ShardWriter(path, index=0, layer_names=["a"], dim=3, expected_rows=n)
    ids = np.arange(n)
    sw.append({"a": np.ones((n, 3), np.float32)}, ids, ids, ids, np.zeros(n, bool))
    sw.finish()
    return sw


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: one checksum thread")
def test_shards_finished_back_to_back_are_checksummed_side_by_side(tmp_path, monkeypatch):
    """A shard's checksums start when it is finished, in a shared pool: the second shard's start
    while the first's still run (each waits here until both have started), and each shard is
    published with its own file's digests."""
    both = threading.Barrier(2, timeout=20)
    real = shard_mod.checksum.digests

    def meeting(path):
        both.wait()  # raises BrokenBarrierError if the other never starts
        return real(path)

    monkeypatch.setattr(shard_mod.checksum, "digests", meeting)
    first, second = _finished(tmp_path / "shard-00000.h5"), _finished(tmp_path / "shard-00001.h5", 70)
    infos = [first.publish(), second.publish()]
    for info in infos:
        want = real(tmp_path / info.file)
        assert (info.sha256, info.xxh3_128) == (want[checksum.SLOW], want[checksum.FAST])
    assert infos[0].sha256 != infos[1].sha256


def _publish_in_child(path, out):
    out.put(_finished(path).publish().rows)


def test_a_forked_child_checksums_with_threads_of_its_own(tmp_path):
    """The pool's threads are not the child's after a fork: a shard finished in a forked child is
    still checksummed and published (not left waiting on threads that do not exist there)."""
    _finished(tmp_path / "shard-00000.h5").publish()  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_publish_in_child, args=(tmp_path / "shard-00001.h5", out))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    assert out.get(timeout=5) == 50


def test_publish_checksums_a_shard_whose_checksums_were_not_started(tmp_path):
    """A writer published without finish() having started its checksums computes them then."""
    sw = _finished(tmp_path / "shard-00000.h5")
    sw._digests = None
    info = sw.publish()
    want = checksum.digests(tmp_path / info.file)
    assert (info.sha256, info.xxh3_128) == (want[checksum.SLOW], want[checksum.FAST])


# ----------------------------------------------------- non-finite rows, sizes, reused buffers


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        np.float16,
        st.tuples(st.integers(1, 9), st.integers(1, 6)),
        elements=st.floats(width=16, allow_nan=True, allow_infinity=True),
    )
)
def test_float16_bit_check_equals_isfinite(a):
    np.testing.assert_array_equal(nonfinite_rows(a), ~np.isfinite(a).all(axis=1))


def test_overflow_to_store_dtype_is_flagged_per_layer(tmp_path):
    a = np.zeros((5, 4), np.float32)
    b = np.zeros((5, 4), np.float32)
    a[1, 2] = 1e6  # finite in float32, Inf in float16
    b[3, 0] = np.nan
    b[1, 1] = -np.inf
    with RunWriter(tmp_path / "run", IDENT) as w:
        sw = w.shard_writer(0, layer_names=["a", "b"], dim=4, store_dtype="float16")
        sw.append({"a": a, "b": b}, np.arange(5), np.zeros(5), np.arange(5), np.zeros(5, bool))
        assert sw.nonfinite_by_layer == {"a": 1, "b": 2}
        info = sw.close()
        assert info.nonfinite_rows == 2  # rows 1 and 3
        w.add_shard(info, stats={"nonfinite_by_layer": sw.nonfinite_by_layer, "docs_empty": 3})
    entry = json.loads((tmp_path / "run" / "manifest.json").read_text())["shards"][0]
    assert entry["stats"] == {"nonfinite_by_layer": {"a": 1, "b": 2}, "docs_empty": 3}
    assert Run(tmp_path / "run").shards[0].nonfinite_rows == 2  # extra keys do not break ShardInfo


def test_float32_store_keeps_large_values(tmp_path):
    sw = ShardWriter(tmp_path / "s.h5", index=0, layer_names=["a"], dim=2, store_dtype="float32")
    sw.append({"a": np.array([[1e30, 0], [np.inf, 1]], np.float32)}, [0, 1], [0, 0], [0, 1], [False, False])
    assert sw.nonfinite_by_layer == {"a": 1}
    assert sw.close().nonfinite_rows == 1


def test_expected_rows_keeps_small_shards_small(tmp_path):
    sizes = {}
    for expected in (None, 10):
        sw = ShardWriter(
            tmp_path / f"s{expected}.h5", index=0, layer_names=["a", "b"], dim=32, expected_rows=expected
        )
        x = np.arange(320, dtype=np.float32).reshape(10, 32)
        sw.append({"a": x, "b": -x}, np.arange(10), np.zeros(10), np.arange(10), np.zeros(10, bool))
        sizes[expected] = sw.close().bytes
    assert sizes[10] < 50_000 < 2 * 1024 * 1024 < sizes[None]
    chunks = [c.layers["b"] for c in iter_shard(tmp_path / "s10.h5")]
    np.testing.assert_array_equal(
        np.concatenate(chunks), (-np.arange(320).reshape(10, 32)).astype(np.float16)
    )


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 16))
def test_uneven_appends_round_trip_with_reused_buffers(tmp_path_factory, sizes, chunk):
    path = tmp_path_factory.mktemp("shard") / "s.h5"
    sw = ShardWriter(path, index=0, layer_names=["a"], dim=3, store_dtype="float32", expected_rows=chunk)
    buf = np.empty((64, 3), np.float32)  # one caller-owned buffer, overwritten before every append
    ids = np.empty(64, np.int64)
    expect, start = [], 0
    for n in sizes:
        buf[:n] = np.arange(start, start + n)[:, None] * [1, 2, 3]
        ids[:n] = np.arange(start, start + n)
        sw.append({"a": buf[:n]}, ids[:n], ids[:n], ids[:n], np.zeros(n, bool))
        expect.append(buf[:n].copy())
        buf[:] = -1
        ids[:] = -1
        start += n
    info = sw.close()
    assert info.rows == start
    got = [c for c in iter_shard(path)]
    a = np.concatenate([c.layers["a"] for c in got]) if got else np.zeros((0, 3))
    np.testing.assert_array_equal(a, np.concatenate(expect))
    np.testing.assert_array_equal(np.concatenate([c.token_id for c in got]) if got else [], np.arange(start))
