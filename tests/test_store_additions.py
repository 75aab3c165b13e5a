"""Store additions used by extract: the fast float16 NaN/Inf check, per-layer counts, per-shard stats."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from geomscope.store import Run, RunWriter, ShardWriter, iter_shard, nonfinite_rows

IDENT = {
    "model": {"name": "toy", "hidden_size": 4},
    "layers": [{"name": "a", "index": 0}, {"name": "b", "index": 1}],
}


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


def test_identity_differences_name_the_entry():
    from geomscope.store import identity_differences

    old = {
        "layers": [{"name": "layer_00", "index": 0}, {"name": "layer_06", "index": 6}],
        "x": {"y": "a" * 200},
    }
    new = {"layers": [{"name": "layer_00", "index": 0}], "x": {"y": "b"}}
    d = identity_differences(old, new)
    assert d[0] == "layers.count: 2 in the run, 1 now"
    assert "layers.1.index: 6 in the run, '<absent>' now" in d
    assert any(x.startswith("x.y: 'aaa") and "... in the run, 'b' now" in x and len(x) < 120 for x in d)
    assert identity_differences(old, old) == []


def test_manifest_text_round_trips_one_line_per_shard(tmp_path):
    from geomscope.store.manifest import dumps_manifest

    m = {
        "format": "geomscope-run",
        "identity": {"a": [1, {"b": None}], "c": "é"},
        "shards": [],
        "totals": {},
        "complete": False,
    }
    assert json.loads(dumps_manifest(m)) == m
    m["shards"] = [{"index": i, "file": f"shard-{i:05d}.h5", "stats": {"x": {"y": i}}} for i in range(3)]
    text = dumps_manifest(m)
    assert json.loads(text) == m
    assert sum(1 for line in text.splitlines() if '"index":' in line) == 3  # one line per shard entry


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
