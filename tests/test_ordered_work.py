"""OrderedWork (metrics/moments.py): work computed in threads, merged in submission order across calls.

The scorer queues each block's statistics on one OrderedWork for a whole pass, so its threads go on
to the next shard's blocks while the last of this shard's are still computing. What must hold: merges
in submission order whatever finishes first; at most ``threads + 1`` items in flight and ``threads``
scratch spaces; later items start before an earlier slow one is merged; an error at its turn; and
the Moments it builds equal to those built one call at a time.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from geomscope.errors import DataError
from geomscope.metrics import moments
from geomscope.metrics.moments import Moments, OrderedWork, update_groups


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
