"""The faster paths of the streaming unit-vector sums (score/multiunit.py) give the numbers of the
plain ones.

- multiunit.update_all: the centred and standardised cosine sums of every jackknife replicate
  computed together (one shifted block, products side by side) equal each MultiUnitSum alone and a
  UnitSum per replicate, across several blocks, float16 input, zero-norm rows, constant dimensions
  and sums with different reference shifts.
- the threaded second pass (accumulate._update_units) adds the same blocks in the same order as one
  thread: bitwise equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.metrics import UnitSum
from geomscope.metrics.moments import OrderedWork
from geomscope.score import multiunit
from geomscope.score.accumulate import _update_units
from geomscope.score.multiunit import MultiUnitSum, update_all

D = 7
R = 5  # replicates: groups 0..3 left out, then all rows


def _rows(n, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)) * [1, 2, 0.5, 3, 1, 1, 4] + 5.0
    x[:, 4] = 7.0  # a constant dimension (scale 0 -> divided by 1)
    return x.astype(dtype), rng.integers(0, R - 1, n)


def _shifts_scales(x, seed):
    rng = np.random.default_rng(seed)
    xf = x.astype(np.float64)
    shifts = xf.mean(0) + rng.normal(scale=0.05, size=(R, D))
    shifts[-1] = xf.mean(0)  # the last replicate: all rows, the full mean (the shared reference)
    scales = xf.std(0, ddof=1) * rng.uniform(0.9, 1.1, size=(R, D))
    scales[:, 4] = 0.0
    return shifts, scales


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_variants_together_equal_each_alone_and_unitsums(dtype):
    n = 2 * multiunit.BLOCK_ROWS + 300  # several blocks
    x, g = _rows(n, 0, dtype)
    shifts, scales = _shifts_scales(x, 1)
    x[10] = shifts[2].astype(dtype)  # (close to) replicate 2's shift: zero norm there in float64
    together = [MultiUnitSum(shifts), MultiUnitSum(shifts, scales)]
    update_all(together, x, g)
    for mus, sc in zip(together, (None, scales), strict=True):
        alone = MultiUnitSum(shifts, sc).update(x, g)
        np.testing.assert_allclose(mus.sum_unit, alone.sum_unit, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(mus.n, alone.n)
        np.testing.assert_array_equal(mus.n_zero_norm, alone.n_zero_norm)
        for r in range(R):
            rows = x[g != r] if r < R - 1 else x
            u = UnitSum(shifts[r], None if sc is None else sc[r]).update(rows)
            np.testing.assert_allclose(mus.sum_unit[r], u.sum_unit, rtol=1e-10, atol=1e-10)
            assert mus.n[r] == u.n and mus.n_zero_norm[r] == u.n_zero_norm
        if dtype == np.float64:  # row 10 is exactly replicate 2's shift
            assert mus.n_zero_norm[2] == (1 if g[10] != 2 else 0)


def test_sums_with_different_references_are_kept_apart():
    x, g = _rows(900, 2)
    shifts, scales = _shifts_scales(x, 3)
    other = shifts + 0.5  # another reference shift: its own shifted block
    sums = [MultiUnitSum(shifts), MultiUnitSum(other, scales), MultiUnitSum(shifts, scales)]
    update_all(sums, x, g)
    for mus, (sh, sc) in zip(sums, ((shifts, None), (other, scales), (shifts, scales)), strict=True):
        for r in range(R):
            rows = x[g != r] if r < R - 1 else x
            u = UnitSum(sh[r], None if sc is None else sc[r]).update(rows)
            np.testing.assert_allclose(mus.sum_unit[r], u.sum_unit, rtol=1e-10, atol=1e-10)


def test_threaded_second_pass_is_bitwise_one_thread():
    x, g = _rows(3 * multiunit.BLOCK_ROWS + 77, 4, np.float32)
    shifts, scales = _shifts_scales(x, 5)
    out = []
    cut = 2 * multiunit.BLOCK_ROWS  # a second call's blocks queued behind the first's, still computing
    for threads in (1, 2, 3):
        for calls in ([slice(None)], [slice(0, cut), slice(cut, None)]):
            unit = {"centred": MultiUnitSum(shifts), "standardised": MultiUnitSum(shifts, scales)}
            with OrderedWork(threads) as work:
                for rows in calls:
                    _update_units(unit, x[rows], g[rows], work)
                work.drain()
            out.append(unit)
    for other in out[1:]:
        for v in ("centred", "standardised"):
            np.testing.assert_array_equal(out[0][v].sum_unit, other[v].sum_unit)
            np.testing.assert_array_equal(out[0][v].n_zero_norm, other[v].n_zero_norm)


def test_fresh_shares_the_setup_not_the_sums():
    x, g = _rows(200, 6)
    shifts, scales = _shifts_scales(x, 7)
    base = MultiUnitSum(shifts, scales).update(x, g)
    f = base.fresh()
    assert not f.sum_unit.any() and not f.n.any() and not f.n_zero_norm.any()
    f.update(x, g)
    np.testing.assert_array_equal(f.sum_unit, base.sum_unit)  # same setup, same rows: same numbers
    before = base.sum_unit.copy()
    f.update(x, g)
    np.testing.assert_array_equal(base.sum_unit, before)


def test_batches_of_lays_out_every_replicate_once_and_drops_the_zero_linear_columns():
    x, g = _rows(700, 9)
    shifts, scales = _shifts_scales(x, 10)
    other = shifts + 0.5
    sums = [MultiUnitSum(shifts), MultiUnitSum(other, scales), MultiUnitSum(shifts, scales)]
    batches = multiunit.batches_of(sums)
    assert [b.index for b in batches] == [[0, 2], [1]]  # by reference shift, in order
    first = batches[0]
    assert first.group.tolist() == [0, 1, 2, 3, -1] * 2
    assert first.qcol.tolist() == [0] * R + list(range(1, R + 1))  # ||y||^2, then each w_r
    # the full-data replicate of each sum expands around its own shift: e = 0, no linear column
    assert first.lincol.tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    np.testing.assert_array_equal(first.lin[:, 4:], -2.0 * (sums[2].e * sums[2].w)[: R - 1].T)
    # the layout built once serves fresh copies: the same numbers as one built per call
    a = [s.fresh() for s in sums]
    update_all(a, x, g, batches=batches)
    b = [s.fresh() for s in sums]
    update_all(b, x, g)
    for p, q in zip(a, b, strict=True):
        np.testing.assert_array_equal(p.sum_unit, q.sum_unit)
        np.testing.assert_array_equal(p.n_zero_norm, q.n_zero_norm)


def test_group_labels_of_any_integer_range_or_dtype_count_as_before():
    """Labels outside 0..R-2 leave no replicate out (every replicate takes the row), as the
    comparison with each replicate's group always did; labels need not be int64."""
    x, g = _rows(600, 11)
    shifts, scales = _shifts_scales(x, 12)
    odd = np.where(g == 3, 2**31, g)  # group 3's rows: a label no replicate leaves out
    for labels in (odd, odd.astype(np.float64), odd.astype(np.uint32)):
        mus = MultiUnitSum(shifts, scales).update(x, labels)
        for r in range(R):
            rows = x[(labels != r)] if r < R - 1 else x
            u = UnitSum(shifts[r], scales[r]).update(rows)
            np.testing.assert_allclose(mus.sum_unit[r], u.sum_unit, rtol=1e-10, atol=1e-10)
            assert mus.n[r] == len(rows)
    with pytest.raises(ValueError, match="label >= 0"):
        MultiUnitSum(shifts).update(x, np.where(g == 3, -1, g))
    with pytest.raises(ValueError, match="other sums"):
        sums = [MultiUnitSum(shifts), MultiUnitSum(shifts, scales)]
        update_all(sums[:1], x, g, batches=multiunit.batches_of(sums))


def test_one_replicate_no_jackknife_is_the_unitsum_of_all_rows():
    x, g = _rows(300, 13)
    shifts, scales = _shifts_scales(x, 14)
    mus = MultiUnitSum(shifts[-1:], scales[-1:]).update(x, np.zeros_like(g))
    u = UnitSum(shifts[-1], scales[-1]).update(x)
    np.testing.assert_allclose(mus.sum_unit[0], u.sum_unit, rtol=1e-12)
    assert mus.n.dtype == np.int64 and mus.n.tolist() == [300] and mus.n_zero_norm.tolist() == [0]
