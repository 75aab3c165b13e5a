"""dedup_rows: hashing finds the candidate duplicates, byte comparison decides; collisions are safe."""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geomscope.metrics.twonn import dedup_rows

tw = importlib.import_module("geomscope.metrics.twonn")  # the module (the package exports a function)


def reference(X):
    """First occurrences of the distinct rows, compared as canonical bytes (-0.0 == 0.0, NaNs equal)."""
    dt = np.float64 if X.dtype.kind != "f" or X.dtype.itemsize > 4 else np.float32
    c = np.asarray(X, dtype=dt) + dt(0.0)
    c[np.isnan(c)] = np.nan
    seen = {}
    for i, row in enumerate(c):
        seen.setdefault(row.tobytes(), i)
    return np.array(sorted(seen.values()), dtype=np.int64)


def with_duplicates(rng, n, d, dtype):
    X = rng.normal(size=(n, d)).astype(dtype)
    X[rng.integers(0, n, n // 3)] = X[rng.integers(0, n, n // 3)]
    X[: n // 10] *= 0.0  # -0.0 for negative entries: equal to the +0.0 rows
    X[n // 10 : n // 10 + 3, 0] = np.nan
    return X


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 3, 8])
def test_dedup_matches_the_byte_reference(dtype, d):
    X = with_duplicates(np.random.default_rng(d), 300, d, dtype)
    U, removed, idx = dedup_rows(np.asfortranarray(X))
    np.testing.assert_array_equal(idx, reference(X))
    assert removed == 300 - idx.size
    np.testing.assert_array_equal(U, X[idx])


@pytest.mark.parametrize("keys", ["constant", "three"])
def test_hash_collisions_cost_time_never_a_wrong_answer(monkeypatch, keys):
    # every row (or every third) gets the same key: the byte comparison alone must decide
    def colliding(c):
        k = np.zeros(c.shape[0], dtype=np.uint64)
        return k if keys == "constant" else k + (np.arange(c.shape[0]) % 3).astype(np.uint64)

    monkeypatch.setattr(tw, "_row_keys", colliding)
    X = with_duplicates(np.random.default_rng(7), 400, 5, np.float64)
    U, removed, idx = dedup_rows(X)
    np.testing.assert_array_equal(idx, reference(X))
    assert removed == 400 - idx.size


def test_integer_rows_and_all_equal_rows():
    X = np.random.default_rng(8).integers(0, 3, size=(200, 3))
    np.testing.assert_array_equal(dedup_rows(X)[2], reference(X))
    U, removed, idx = dedup_rows(np.ones((5, 4)))
    assert removed == 4 and list(idx) == [0]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    d=st.integers(1, 6),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_dedup_property(n, d, levels, seed):
    # few distinct values per entry: many exact duplicates, signed zeros
    rng = np.random.default_rng(seed)
    X = rng.integers(-levels // 2, levels, size=(n, d)).astype(np.float64) * 0.5
    X[X == 0] *= -1.0 if seed % 2 else 1.0
    np.testing.assert_array_equal(dedup_rows(X)[2], reference(X))


def test_nothing_removed_returns_the_rows_themselves():
    # no duplicates: no copy of what may be gigabytes, and the same answer
    X = np.random.default_rng(3).standard_normal((500, 64))
    U, removed, idx = dedup_rows(X)
    assert U is X and removed == 0
    np.testing.assert_array_equal(idx, np.arange(500))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_count_nonfinite_rows_fast_path_is_exact(dtype):
    from geomscope.metrics.validate import count_nonfinite_rows

    rng = np.random.default_rng(4)
    X = rng.standard_normal((200, 8)).astype(dtype)
    assert count_nonfinite_rows(X) == 0
    X[3, 1], X[7, 0], X[7, 5] = np.nan, np.inf, -np.inf  # +inf and -inf in one row: the sum is NaN
    X[9, 2] = -np.inf
    assert count_nonfinite_rows(X) == 3
    # every value finite but the float64 sum overflows: the full check runs and finds nothing
    big = np.full((4, 3), np.finfo(np.float64).max)
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no numpy warning on valid input
        assert count_nonfinite_rows(big) == 0
        assert count_nonfinite_rows(X) == 3
    assert count_nonfinite_rows(np.zeros((0, 3))) == 0


def test_read_only_rows_are_read_without_a_warning_or_a_copy(tmp_path):
    # a memory-mapped .npy (read-only) goes through dedup uncopied and into the search as is
    from geomscope.metrics.twonn import twonn

    X = np.random.default_rng(5).standard_normal((400, 12))
    np.save(tmp_path / "x.npy", X)
    m = np.load(tmp_path / "x.npy", mmap_mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = twonn(m).dimension
    assert got == twonn(X).dimension
