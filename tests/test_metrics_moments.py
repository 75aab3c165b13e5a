"""Moments / UnitSum (metrics/moments.py): agreement with direct numpy, exact merging (its waiting
rank-one corrections included), precision, bad input; and OrderedWork, the threads that compute
blocks and merge them in submission order."""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomscope.errors import DataError, InputError
from geomscope.metrics import Moments, UnitSum, moments
from geomscope.metrics.moments import OrderedWork, update_groups


def _data(n=300, d=12, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.uniform(0.1, 4.0, d)
    x[:, min(3, d - 1)] *= 8.0  # an outlier-ish dimension (|x| >= 6 often)
    return x + offset


def _direct_extras(x, thr=6.0):
    norms = np.linalg.norm(x, axis=1)
    nz = norms > 0
    u = x[nz] / norms[nz, None]
    a = np.abs(x)
    return dict(
        sum_unit=u.sum(0),
        sum_unit_sq=(u**2).sum(0),
        n_zero_norm=int((~nz).sum()),
        abs_sum=a.sum(0),
        abs_max=a.max(0),
        count_abs_ge=(a >= thr).sum(0),
        sum_sq_norm=float((norms**2).sum()),
    )


def _assert_matches(m, x, rtol=1e-10):
    assert m.n == len(x) and m.dim == x.shape[1]
    np.testing.assert_allclose(m.mean, x.mean(0), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(m.covariance(), np.cov(x.T), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(m.covariance(ddof=0), np.cov(x.T, ddof=0), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(m.variance(), x.var(0, ddof=1), rtol=rtol)
    ref = _direct_extras(x, m.abs_threshold)
    for k, v in ref.items():
        np.testing.assert_allclose(getattr(m, k), v, rtol=rtol, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(m.mean_abs(), np.abs(x).mean(0), rtol=rtol)
    np.testing.assert_allclose(m.frac_abs_ge(), (np.abs(x) >= m.abs_threshold).mean(0), rtol=rtol)


@pytest.mark.parametrize("block_rows", [1, 7, 64, 4096])
def test_matches_numpy_one_update(block_rows):
    x = _data()
    x[5] = 0.0  # a zero-norm row
    m = Moments(abs_threshold=6.0, block_rows=block_rows).update(x)
    _assert_matches(m, x)
    assert m.n_zero_norm == 1 and m.n_unit() == len(x) - 1


def test_many_updates_and_symmetric_m2():
    x = _data(n=513, d=9, seed=1)
    m = Moments(9, block_rows=50)
    for i in range(0, len(x), 37):
        m.update(x[i : i + 37])
    _assert_matches(m, x)
    np.testing.assert_array_equal(m.M2, m.M2.T)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_input_dtypes_are_converted_exactly(dtype):
    x = _data(n=200, d=6, seed=2).astype(dtype)
    m = Moments().update(x)
    _assert_matches(m, x.astype(np.float64))


@pytest.mark.parametrize("tdtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_torch_input(tdtype):
    t = torch.tensor(_data(n=150, d=5, seed=3)).to(tdtype).requires_grad_(tdtype != torch.float64)
    m = Moments().update(t)
    _assert_matches(m, t.detach().double().numpy())


def test_large_common_offset_loses_nothing():
    x = _data(n=4000, d=8, seed=4, offset=1e4)
    exact = np.cov((x - 1e4).T)  # subtracting the (exactly representable) offset first
    m = Moments(block_rows=512).update(x)
    err = np.max(np.abs(m.covariance() - exact)) / np.max(np.abs(exact))
    assert err < 1e-12
    # the naive one-pass formula (sum xx^T - n mean mean^T) loses ~8 digits here: the test can fail
    naive = (x.T @ x - len(x) * np.outer(x.mean(0), x.mean(0))) / (len(x) - 1)
    assert np.max(np.abs(naive - exact)) / np.max(np.abs(exact)) > 1e3 * err


def test_merge_is_exact_and_tree_order_free():
    x = _data(n=1000, d=10, seed=5)
    parts = [Moments().update(x[i : i + 130]) for i in range(0, 1000, 130)]
    tree = parts[0]
    for p in parts[1:]:
        tree.merge(p)
    _assert_matches(tree, x)
    pair = Moments().merge(Moments().update(x[:1])).merge(Moments().update(x[1:]))
    _assert_matches(pair, x)


def test_merge_with_empty_and_pickle_roundtrip():
    x = _data(n=100, d=4, seed=6)
    m = Moments().update(x)
    m.merge(Moments(4))
    m2 = pickle.loads(pickle.dumps(m))
    _assert_matches(m2, x)
    e = Moments().merge(m2)
    _assert_matches(e, x)


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 120), max_size=6), block=st.integers(1, 40), seed=st.integers(0, 99))
def test_any_chunking_equals_one_pass(cuts, block, seed):
    x = _data(n=120, d=5, seed=seed)
    edges = [0, *sorted(cuts), 120]
    m = Moments(block_rows=block)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        m.update(x[a:b])
    ref = Moments().update(x)
    np.testing.assert_allclose(m.covariance(), ref.covariance(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(m.sum_unit, ref.sum_unit, rtol=1e-10, atol=1e-12)


def test_extras_false_keeps_only_core():
    x = _data(n=90, d=7, seed=7)
    m = Moments(extras=False).update(x)
    np.testing.assert_allclose(m.covariance(), np.cov(x.T), rtol=1e-10)
    assert m.sum_unit is None
    with pytest.raises(InputError):
        m.mean_abs()
    with pytest.raises(InputError):
        Moments().update(x).merge(m)


def test_nonfinite_rows_raise_and_leave_state_unchanged():
    x = _data(n=50, d=4, seed=8)
    m = Moments(block_rows=8).update(x)
    bad = _data(n=40, d=4, seed=9)
    bad[[3, 30]] = np.nan
    bad[35, 1] = np.inf
    with pytest.raises(DataError, match="3 of 40 rows") as e:
        m.update(bad)
    assert "drop or flag" in str(e.value) and "\n" not in str(e.value)
    _assert_matches(m, x)


def test_bad_shapes_and_too_few_rows():
    m = Moments(4)
    with pytest.raises(DataError, match="2-D"):
        m.update(np.zeros(4))
    with pytest.raises(DataError, match="columns"):
        m.update(np.zeros((3, 5)))
    m.update(np.ones((1, 4)))
    with pytest.raises(DataError, match="at least 2"):
        m.covariance()
    with pytest.raises(DataError, match="2-D|numeric"):
        Moments().update(np.array([["a", "b"]]))
    with pytest.raises(DataError):
        Moments(3).merge(Moments().update(np.ones((2, 4))))


def test_zero_variance_detected_despite_rounding():
    x = np.full((1001, 6), 0.1)  # mean of 0.1s is not exactly 0.1 in float64
    m = Moments().update(x)
    with pytest.raises(DataError, match="zero total variance"):
        m.check_variance()
    Moments().update(_data(n=10, d=3)).check_variance()  # fine


def test_unitsum_centred_and_standardised():
    x = _data(n=400, d=6, seed=10, offset=3.0)
    x[:, 2] = 5.0  # constant column: zero std
    m = Moments().update(x)
    sd = np.sqrt(m.variance())
    u = UnitSum(m.mean, sd)
    for i in range(0, 400, 99):
        u.update(x[i : i + 99])
    z = (x - x.mean(0)) / np.where(x.std(0, ddof=1) > 1e-12, x.std(0, ddof=1), 1.0)
    ref = _direct_extras(z)
    np.testing.assert_allclose(u.sum_unit, ref["sum_unit"], rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(u.sum_unit_sq, ref["sum_unit_sq"], rtol=1e-8, atol=1e-9)
    c = UnitSum(m.mean).update(x[:200]).merge(UnitSum(m.mean).update(x[200:]))
    np.testing.assert_allclose(c.sum_unit, _direct_extras(x - x.mean(0))["sum_unit"], rtol=1e-8, atol=1e-9)
    assert c.n == 400 and c.n_unit() == 400


def test_unitsum_zero_rows_and_bad_input():
    x = np.array([[1.0, 2.0], [1.0, 2.0], [3.0, 0.0]])
    u = UnitSum(np.array([1.0, 2.0])).update(x)
    assert u.n_zero_norm == 2 and u.n_unit() == 1
    np.testing.assert_allclose(u.sum_unit, [1.0, -1.0] / np.sqrt(2))
    with pytest.raises(InputError):
        u.merge(UnitSum(np.zeros(2)))
    with pytest.raises(DataError, match="NaN"):
        u.update(np.array([[np.nan, 1.0]]))
    with pytest.raises(InputError):
        UnitSum(np.zeros(2), np.array([1.0, -1.0]))


# ------------------------------------------------------------------ merging: corrections kept as rows
# Moments.merge's rank-one corrections, kept as rows and added together (R^T R) once MAX_PENDING wait
# or when M2 is read, give the float64 scatter of all rows across many merges, through pickling,
# copies and variance(); they also serve an M2 that is not C-contiguous.
D = 7


@pytest.mark.parametrize("layout", ["fortran", "strided"])
def test_merge_rank_one_update_on_a_non_contiguous_m2(layout):
    rng = np.random.default_rng(8)
    a = rng.normal(size=(400, D)) * 3 + 100.0
    b = rng.normal(size=(300, D)) - 50.0
    m = Moments.from_rows(a)
    full = m.M2.copy()
    if layout == "fortran":
        m._m2 = np.asfortranarray(full)
    else:  # a view with row strides of a larger array
        big = np.zeros((D, 2 * D))
        big[:, ::2] = full
        m._m2 = big[:, ::2]
    m.merge(Moments.from_rows(b))
    ref = np.vstack([a, b])
    y = ref - ref.mean(0)
    np.testing.assert_allclose(m.M2, y.T @ y, rtol=1e-12)
    np.testing.assert_allclose(m.mean, ref.mean(0), rtol=1e-14)


def _scatter64(x):
    y = x - x.mean(0)
    return y.T @ y


@pytest.mark.parametrize("block_rows", [7, 64])
def test_many_merges_with_an_offset_match_the_float64_scatter(block_rows):
    """More blocks than MAX_PENDING (the corrections are added in several batches), a 1e4 offset
    and a drifting mean: M2, variance and the mean against float64 numpy at 1e-10."""
    from geomscope.metrics.moments import MAX_PENDING

    rng = np.random.default_rng(11)
    n = block_rows * (2 * MAX_PENDING + 5)
    x = rng.normal(size=(n, D)) * rng.uniform(0.5, 3, D) + 1e4
    x += np.linspace(0, 50, n)[:, None]  # every block's mean differs: every correction matters
    m = Moments(D, block_rows=block_rows).update(x)
    assert 0 < len(m._pending) < MAX_PENDING  # added in batches: the waiting rows stay bounded
    ref = _scatter64(x)
    np.testing.assert_allclose(m.M2, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())
    np.testing.assert_allclose(m.variance(), np.diag(ref) / (n - 1), rtol=1e-10)
    np.testing.assert_allclose(m.mean, x.mean(0), rtol=1e-13)


def test_waiting_corrections_travel_with_pickles_copies_and_merges():
    import pickle

    rng = np.random.default_rng(12)
    parts = [rng.normal(size=(20, D)) + k for k in range(9)]
    a = Moments(D, block_rows=5)
    for p in parts[:5]:
        a.update(p)
    assert a._pending  # corrections still waiting: what follows must carry them
    b = pickle.loads(pickle.dumps(a))
    c = Moments(D, block_rows=5)
    c.merge(a)  # an empty accumulator copies a, waiting rows included
    rest = Moments(D, block_rows=5)
    for p in parts[5:]:
        rest.update(p)
    b.merge(rest)
    c.merge(rest)
    ref = _scatter64(np.vstack(parts))
    for m in (b, c):
        np.testing.assert_allclose(m.M2, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(a.M2, _scatter64(np.vstack(parts[:5])), rtol=1e-12, atol=1e-9)


# ------------------------------------------------------------------ OrderedWork
# Work computed in threads, merged in submission order across calls. The scorer queues each block's
# statistics on one OrderedWork for a whole pass, so its threads go on to the next shard's blocks
# while the last of this shard's are still computing. What must hold: merges in submission order
# whatever finishes first; at most ``threads + 1`` items in flight and ``threads`` scratch spaces;
# later items start before an earlier slow one is merged; an error at its turn; and the Moments it
# builds equal to those built one call at a time.


def _scratch(made: list):
    def make():
        made.append(object())
        return made[-1]

    return ("test", make, lambda s: True)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_merges_follow_submission_order_and_in_flight_is_bounded(threads):
    merged, made, state = [], [], {"in_flight": 0, "most": 0}
    lock = threading.Lock()
    scratch = _scratch(made)

    def compute(i):
        def run(_s):
            time.sleep(0.001 * ((7 * i) % 5))  # finishing out of order
            return i

        return run

    def merge(i):
        with lock:
            state["in_flight"] -= 1
        merged.append(i)

    with OrderedWork(threads) as work:
        for i in range(40):
            with lock:
                state["in_flight"] += 1
            work.submit(compute(i), merge, scratch)
            with lock:  # submitted and not yet merged, this one included
                state["most"] = max(state["most"], state["in_flight"])
            if i == 19:
                work.then(lambda: merged.append("then"))
        work.drain()
    assert merged == [*range(20), "then", *range(20, 40)]
    assert state["most"] == (threads + 1 if threads > 1 else 0)  # bounded, and queued ahead
    assert 1 <= len(made) <= threads


def test_a_later_item_starts_before_an_earlier_slow_one_is_merged():
    """Two calls' worth of items: the second's start while the first's slow item still computes (the
    old per-call pool made every thread wait for a call's last item)."""
    later_started = threading.Event()
    seen = []

    def slow(_s):
        return later_started.wait(timeout=10)

    def quick(_s):
        later_started.set()
        return True

    with OrderedWork(2) as work:
        work.submit(slow, seen.append, _scratch([]))  # the end of one call
        work.submit(quick, seen.append, _scratch([]))  # the start of the next
        work.drain()
    assert seen == [True, True]


def test_an_error_comes_at_its_turn_and_later_items_are_dropped():
    merged, started = [], []

    def ok(i):
        def run(_s):
            started.append(i)
            time.sleep(0.01)
            return i

        return run

    def bad(_s):
        raise DataError("block 2 is bad")

    work = OrderedWork(2)
    work.submit(ok(0), merged.append, _scratch([]))
    work.submit(ok(1), merged.append, _scratch([]))
    work.submit(bad, merged.append, _scratch([]))
    with pytest.raises(DataError, match="block 2 is bad"):
        for i in range(3, 20):
            work.submit(ok(i), merged.append, _scratch([]))
        work.drain()
    work.close()
    assert merged == [0, 1]  # merged up to the error, nothing after it
    assert len(started) < 19


def _groups_case(seed, n=9000, d=6, groups=4):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.1, 3, d) + 1e4).astype(np.float32)
    g = rng.integers(0, groups, n)
    return x, g


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["threaded", "large-D-path"])
def test_update_groups_queued_across_calls_equals_one_call_at_a_time(monkeypatch, threads, one_at_a_time):
    """The scorer's use: several calls (a shard each) queued on one OrderedWork, merged by the next
    calls and the drain. The Moments equal those of calls that each waited for their own blocks, bit
    for bit; also where D x D scatters are too large to hold several (blocks then one at a time)."""
    if one_at_a_time:
        monkeypatch.setattr(moments, "MAX_THREADED_M2_BYTES", 8)
    x, g = _groups_case(threads)
    cuts = [0, 1000, 1001, 4000, 9000]

    def new():
        return [Moments(block_rows=700) for _ in range(4)]

    waited, queued = new(), new()
    for a, b in zip(cuts, cuts[1:], strict=False):
        update_groups(waited, x[a:b], g[a:b], threads=threads)
    with OrderedWork(threads) as work:
        for a, b in zip(cuts, cuts[1:], strict=False):
            update_groups(queued, x[a:b], g[a:b], work=work)
        work.drain()
    for w, q in zip(waited, queued, strict=True):
        assert w.n == q.n
        np.testing.assert_array_equal(w.mean, q.mean)
        np.testing.assert_array_equal(w.M2, q.M2)
        np.testing.assert_array_equal(w.sum_unit, q.sum_unit)


def test_scratch_spaces_stay_bounded_when_block_sizes_vary():
    """A pass over shards that each end in a block of another size (a few rows to a full block):
    a spare scratch space too small is replaced, so at most ``threads`` are kept, not one per size."""
    rng = np.random.default_rng(5)
    accs = [Moments(block_rows=64) for _ in range(3)]
    sizes = [*range(1, 60), *range(59, 0, -7), 200]
    with OrderedWork(2) as work:
        for n in sizes:
            update_groups(accs, rng.standard_normal((n, 5)), rng.integers(0, 3, n), work=work)
        work.drain()
        kept = [s for spare in work._spare.values() for s in spare]
    assert 1 <= len(kept) <= 2
    assert all(s.buf.shape[0] <= 64 for s in kept)
    assert sum(m.n for m in accs) == sum(sizes)
