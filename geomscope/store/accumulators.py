"""A shard's per-layer accumulators (``extract --keep sample:N``): a ``Moments`` in an HDF5 group.

Layout, per layer and part (``regular``: the layer's finite rows of ordinary tokens; ``special``:
its finite rows of special tokens, written only when there are some), under
``/accumulators/<layer>/<part>``: attributes ``n``, ``n_zero_norm``, ``sum_sq_norm``,
``abs_threshold``; float64 datasets ``mean``, ``sum_unit``, ``sum_unit_sq``, ``abs_sum``,
``abs_max``; int64 ``count_abs_ge``; and ``m2_upper``, the centred scatter's upper triangle packed
row by row (D(D+1)/2 values: half the bytes of the full matrix).

The largest |x| entries and the |x| histogram of the same rows (metrics/massive.py's ``TopAbs``, of
at most :data:`MASSIVE_KEPT` entries) lie under ``/massive/<layer>/<part>``: attributes ``k``,
``n`` (entries seen: rows x D), ``zeros``; datasets ``value`` (float64), ``dim``, ``key``,
``token_id`` (int64; key uint64), ``special`` (bool), and the histogram's non-empty ``bins`` with
their ``counts`` (int64).
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError

GROUP = "accumulators"
MASSIVE_GROUP = "massive"
#: the largest |x| entries a shard keeps per layer and part: score --massive-k at most this
MASSIVE_KEPT = 100
ABS_THRESHOLD = 6.0  # |x| >= this is counted per dimension: score's magnitude-outlier default
PARTS = ("regular", "special")
_VECTORS = ("mean", "sum_unit", "sum_unit_sq", "abs_sum", "abs_max")


def write_moments(parent, name: str, m) -> None:
    """Store Moments ``m`` (extras on) as group ``name`` of the h5py group ``parent``."""
    g = parent.create_group(name)
    g.attrs["n"] = int(m.n)
    g.attrs["n_zero_norm"] = int(m.n_zero_norm)
    g.attrs["sum_sq_norm"] = float(m.sum_sq_norm)
    g.attrs["abs_threshold"] = float(m.abs_threshold)
    for key in _VECTORS:
        g.create_dataset(key, data=np.asarray(getattr(m, key), np.float64))
    g.create_dataset("count_abs_ge", data=np.asarray(m.count_abs_ge, np.int64))
    g.create_dataset("m2_upper", data=m.M2[np.triu_indices(m.dim)])


#: the relative difference allowed between an accumulator's two sides of an identity that holds
#: exactly for the rows it summarises (sum of the unit vectors' squared entries = rows of non-zero
#: norm; sum of squared norms = trace of the scatter + n |mean|^2): float64 sums of float16/32 rows
#: meet them to ~1e-13, a count off by one row in 10^8 does not
IDENTITY_RTOL = 1e-8


def read_moments(g, *, dim: int, most: int, extras: bool = True):
    """The Moments stored in h5py group ``g`` (``extras=False`` drops the cosine and |x| parts).

    A shard may come from anyone, so what it holds is checked before it is trusted or read: every
    array stored in the shard itself with the shape that the layer's width ``dim`` gives it (a crafted
    shape cannot make the read allocate more), a count n between 0 and ``most`` (the rows the shard
    measured), finite values, variances >= 0, |x| counts within n, and n the count of the rows the
    sums hold (:func:`_check_count`). DataError (one line, naming the group) otherwise."""
    from geomscope.metrics import Moments

    try:
        if _number(g, "abs_threshold", float) != ABS_THRESHOLD:  # what score's merges assume
            raise _bad(
                g, f"counted |x| >= {g.attrs['abs_threshold']}, not the {ABS_THRESHOLD:g} extract counts"
            )
        m = Moments(dim, ABS_THRESHOLD, extras=True)
        m.n = _number(g, "n", int, most)
        if m.n == 0:
            return m if extras else Moments(dim, ABS_THRESHOLD, extras=False)
        m.mean = _vector(g, "mean", (dim,))
        packed = _vector(g, "m2_upper", (dim * (dim + 1) // 2,))
        full = np.zeros((dim, dim))
        full[np.triu_indices(dim)] = packed
        if (np.diagonal(full) < 0).any():
            raise _bad(g, "holds a negative variance")
        m._m2 = full + np.triu(full, 1).T
        for key in _VECTORS[1:]:
            setattr(m, key, _vector(g, key, (dim,)))
        m.count_abs_ge = _vector(g, "count_abs_ge", (dim,), np.int64)
        if m.count_abs_ge.min() < 0 or m.count_abs_ge.max() > m.n:
            raise _bad(g, f"counts |x| beyond its {m.n} rows")
        m.n_zero_norm = _number(g, "n_zero_norm", int, m.n)
        m.sum_sq_norm = _number(g, "sum_sq_norm", float)
        _check_count(g, m)
    except KeyError as e:
        raise _bad(g, f"is incomplete ({e})") from e
    if extras:
        return m
    plain = Moments(dim, ABS_THRESHOLD, extras=False)
    plain.n, plain.mean, plain._m2 = m.n, m.mean, m._m2
    return plain


def _check_count(g, m) -> None:
    """The count n against what the sums say of it (:data:`IDENTITY_RTOL`): each row of non-zero norm
    adds 1 to the sum of ``sum_unit_sq``, and the squared norms add up to the scatter's trace plus
    n |mean|^2. A count edited on its own (rows said to be NaN that the run does not have, a mean
    and scatter divided by the wrong n) breaks them."""
    unit_rows = float(m.sum_unit_sq.sum())
    if not _close(unit_rows, m.n - m.n_zero_norm):
        raise _bad(
            g, f"has n = {m.n} with {m.n_zero_norm} zero rows, but its unit sums hold {unit_rows:.6g} rows"
        )
    squares = float(np.trace(m._m2)) + m.n * float(m.mean @ m.mean)
    if not _close(squares, m.sum_sq_norm):
        raise _bad(
            g,
            f"has n = {m.n}, but its mean and scatter give sum |x|^2 = {squares:.6g}, "
            f"not {m.sum_sq_norm:.6g}",
        )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= IDENTITY_RTOL * max(abs(a), abs(b))


def _bad(g, why: str) -> DataError:
    return DataError(f"accumulator {g.name} {why}; the shard is damaged")


def _number(g, key: str, kind, most: int | None = None):
    """Attribute ``key`` of ``g``: a finite number (``kind`` int: a whole number in [0, most])."""
    v = g.attrs[key]
    if kind is int:
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
        if not ok or not 0 <= int(v) <= (most if most is not None else int(v)):
            raise _bad(g, f"has {key} = {str(v)[:40]}, not a whole number from 0 to {most}")
        return int(v)
    if not isinstance(v, (float, int, np.floating, np.integer)) or not np.isfinite(v) or v < 0:
        raise _bad(g, f"has {key} = {str(v)[:40]}, not a finite number >= 0")
    return float(v)


def _vector(g, key: str, shape: tuple, dtype=np.float64) -> np.ndarray:
    """Dataset ``key`` of ``g``, stored in the shard itself with ``shape`` and finite values."""
    import h5py

    if not isinstance(g.get(key, getlink=True), h5py.HardLink):
        raise _bad(g, f"has no {key} of its own")
    ds = g[key]
    if not isinstance(ds, h5py.Dataset) or ds.external or ds.is_virtual:
        raise _bad(g, f"keeps {key} outside the shard")
    if ds.shape != shape or ds.dtype.kind not in "fiu":
        raise _bad(g, f"holds {key} of shape {ds.shape} and type {ds.dtype}; the layer's width needs {shape}")
    a = ds[()].astype(dtype)
    if not np.isfinite(a).all():
        raise _bad(g, f"holds NaN or Inf in {key}")
    return a


def write_top_abs(parent, name: str, top) -> None:
    """Store TopAbs ``top`` as group ``name`` of the h5py group ``parent``."""
    g = parent.create_group(name)
    g.attrs["k"] = int(top.k)
    g.attrs["n"] = int(top.n)
    g.attrs["zeros"] = int(top.zeros)
    for key in ("value", "dim", "key", "token_id"):
        g.create_dataset(key, data=getattr(top, key))
    g.create_dataset("special", data=top.special.astype(np.uint8))
    bins = np.flatnonzero(top.counts)
    g.create_dataset("bins", data=bins.astype(np.int64))
    g.create_dataset("counts", data=top.counts[bins].astype(np.int64))


def read_top_abs(g, *, dim: int, most: int):
    """The TopAbs stored in h5py group ``g``, checked before it is trusted: its entries within k and
    the run's width ``dim``, finite, largest |x| first; at most ``most`` entries seen (the rows the
    shard measured times D), all of them in the histogram; bins in range and increasing. DataError
    (one line, naming the group) otherwise."""
    from geomscope.metrics.massive import BINS, TopAbs

    try:
        k = _number(g, "k", int, MASSIVE_KEPT)
        if k < 1:
            raise _bad(g, "keeps no entry")
        top = TopAbs(k)
        top.n = _number(g, "n", int, most)
        top.zeros = _number(g, "zeros", int, top.n)
        size = _length(g, "value", k)
        top.value = _vector(g, "value", (size,))
        for key, dtype in (("dim", np.int64), ("key", np.uint64), ("token_id", np.int64)):
            setattr(top, key, _vector(g, key, (size,), dtype))
        special = _vector(g, "special", (size,), np.int64)
        if size and (special.min() < 0 or special.max() > 1):
            raise _bad(g, "holds special flags other than 0 and 1")
        top.special = special.astype(bool)
        if size and (top.dim.min() < 0 or top.dim.max() >= dim):
            raise _bad(g, f"lists a dimension outside the run's {dim}")
        if (np.diff(np.abs(top.value)) > 0).any():
            raise _bad(g, "lists its entries out of order")
        n_bins = _length(g, "bins", BINS)
        bins = _vector(g, "bins", (n_bins,), np.int64)
        counts = _vector(g, "counts", (n_bins,), np.int64)
        if n_bins and (
            bins.min() < 0 or bins.max() >= BINS or (np.diff(bins) <= 0).any() or counts.min() < 1
        ):
            raise _bad(g, "holds a histogram no writer makes")
        if int(counts.sum()) + top.zeros != top.n:
            raise _bad(g, f"counts {int(counts.sum()) + top.zeros} entries in its histogram, not its {top.n}")
        top.counts[bins] = counts
    except KeyError as e:
        raise _bad(g, f"is incomplete ({e})") from e
    return top


def _length(g, key: str, most: int) -> int:
    """The length of ``g``'s one-dimensional dataset ``key``, at most ``most``."""
    import h5py

    ds = g.get(key)
    if not isinstance(ds, h5py.Dataset) or len(ds.shape) != 1 or ds.shape[0] > most:
        raise _bad(g, f"holds no {key} list of at most {most} entries")
    return int(ds.shape[0])


def bytes_per_part(dim: int) -> int:
    """Bytes one stored accumulator takes (the packed scatter, five float64 and one int64 vector)."""
    return 8 * (dim * (dim + 1) // 2 + 6 * dim)
