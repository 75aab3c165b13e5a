"""A shard's per-layer accumulators (``extract --keep sample:N``): a ``Moments`` in an HDF5 group.

Layout, per layer and part (``regular``: the layer's finite rows of ordinary tokens; ``special``:
its finite rows of special tokens, written only when there are some), under
``/accumulators/<layer>/<part>``: attributes ``n``, ``n_zero_norm``, ``sum_sq_norm``,
``abs_threshold``; float64 datasets ``mean``, ``sum_unit``, ``sum_unit_sq``, ``abs_sum``,
``abs_max``; int64 ``count_abs_ge``; and ``m2_upper``, the centred scatter's upper triangle packed
row by row (D(D+1)/2 values: half the bytes of the full matrix).
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError

GROUP = "accumulators"
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


def read_moments(g, *, extras: bool = True):
    """The Moments stored in h5py group ``g`` (``extras=False`` drops the cosine and |x| parts)."""
    from geomscope.metrics import Moments

    try:
        d = int(g["mean"].shape[0])
        m = Moments(d, float(g.attrs["abs_threshold"]), extras=extras)
        m.n = int(g.attrs["n"])
        if m.n == 0:
            return m
        m.mean = g["mean"][()].astype(np.float64)
        packed = g["m2_upper"][()].astype(np.float64)
        if packed.shape != (d * (d + 1) // 2,):
            raise DataError(f"accumulator {g.name} holds {packed.shape[0]} scatter values for D = {d}")
        full = np.zeros((d, d))
        full[np.triu_indices(d)] = packed
        m._m2 = full + np.triu(full, 1).T
        if extras:
            for key in _VECTORS[1:]:
                setattr(m, key, g[key][()].astype(np.float64))
            m.count_abs_ge = g["count_abs_ge"][()].astype(np.int64)
            m.n_zero_norm = int(g.attrs["n_zero_norm"])
            m.sum_sq_norm = float(g.attrs["sum_sq_norm"])
        return m
    except KeyError as e:
        raise DataError(f"accumulator {g.name} is incomplete ({e}); the shard is damaged") from e


def bytes_per_part(dim: int) -> int:
    """Bytes one stored accumulator takes (the packed scatter, five float64 and one int64 vector)."""
    return 8 * (dim * (dim + 1) // 2 + 6 * dim)
