"""Massive activations (Sun, Chen, Kolter & Liu, *Massive Activations in Large Language Models*,
COLM 2024): the largest |x| entries of a layer, where they sit, and how far above the typical
entry they stand.

:class:`TopAbs` streams rows and keeps, mergeably and in bounded memory,

- the k entries (row, dimension) of largest |x|, each with its value, dimension, row key
  (store.sample.run_keys: document and position), token id and special-token flag. Ties are broken
  by (key, dimension), so the entries kept do not depend on the order rows arrive or pieces merge;
- a histogram of log2 |x| over every entry: :data:`BINS_PER_OCTAVE` bins per power of two (each bin
  [2^(e + j/B), 2^(e + (j + 1)/B)), B = 64: at most 1.09 % wide), exact zeros apart. The median
  |x| over all N x D entries is bracketed by the bin where the cumulative count crosses half:
  :meth:`median_bounds` gives that bin's edges, so the median is known within 1.09 % and the ratio of
  the largest |x| to it within the same, with no sample and no second pass.

Memory: k entries and (2 x :data:`OCTAVES` x B + 1) counts per layer, whatever N.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError

BINS_PER_OCTAVE = 64
#: |x| from 2^-OCTAVES to 2^OCTAVES has its own bins; beyond, the first and last bins (float16 and
#: float32 activations lie far inside: 2^-126 is float32's smallest normal)
OCTAVES = 160
BINS = 2 * OCTAVES * BINS_PER_OCTAVE
#: the edges 2^(j/B), j = 0..B, of the bins within an octave, in float64: a value's bin is found by
#: comparing its mantissa with them (the same comparisons on any device, so a histogram made while
#: extracting equals the one score makes of the stored rows)
EDGES = 2.0 ** (np.arange(BINS_PER_OCTAVE + 1) / BINS_PER_OCTAVE)
#: EDGES rounded up to float32: for a float32 value v, v >= EDGES[j] exactly when v >= EDGES32[j],
#: so a device that compares float32 mantissas with these bins every value as float64 does
EDGES32 = np.where(
    EDGES.astype(np.float32) < EDGES, np.nextafter(EDGES.astype(np.float32), np.inf), EDGES.astype(np.float32)
).astype(np.float32)


def bins_of(a: np.ndarray) -> np.ndarray:
    """The histogram bin of each positive |x| (float64): B bins per octave, clipped to the range."""
    mant, expo = np.frexp(a)  # a = mant * 2^expo, mant in [0.5, 1)
    sub = np.searchsorted(EDGES, 2.0 * mant, side="right") - 1
    idx = (expo.astype(np.int64) - 1 + OCTAVES) * BINS_PER_OCTAVE + sub
    return np.clip(idx, 0, BINS - 1)


def histogram(a: np.ndarray) -> tuple[np.ndarray, int]:
    """(counts per bin, exact zeros) of |x| values ``a`` (float64, >= 0)."""
    pos = a > 0
    return np.bincount(bins_of(a[pos]), minlength=BINS), int(a.size - np.count_nonzero(pos))


def bin_edges(index: int) -> tuple[float, float]:
    """The [low, high) bounds of |x| of histogram bin ``index``."""
    octave, j = divmod(int(index), BINS_PER_OCTAVE)
    scale = 2.0 ** (octave - OCTAVES)
    return float(scale * EDGES[j]), float(scale * EDGES[j + 1])


class TopAbs:
    """The ``k`` largest |x| entries of a stream of rows and the histogram of every |x| (see the
    module docstring). ``update(x, keys, token_ids=None, special=None)``, ``add`` (a piece measured
    elsewhere), ``merge``, :meth:`entries`, :meth:`median_bounds`."""

    def __init__(self, k: int):
        if int(k) < 1:
            raise DataError(f"the top entries kept must be at least 1; got {k}")
        self.k = int(k)
        self.value = np.zeros(0)
        self.dim = np.zeros(0, np.int64)
        self.key = np.zeros(0, np.uint64)
        self.token_id = np.zeros(0, np.int64)
        self.special = np.zeros(0, bool)
        self.counts = np.zeros(BINS, np.int64)
        self.zeros = 0
        self.n = 0  # entries seen (rows x D)

    def update(self, x, keys, token_ids=None, special=None) -> TopAbs:
        """Add rows ``x`` (m, D) with their keys (m,), token ids (m,; None: unknown, -1) and
        special-token flags (m,; None: none)."""
        a = np.abs(np.asarray(x, np.float64))
        m, d = a.shape
        if m == 0:
            return self
        counts, zeros = histogram(a)
        flat = a.ravel()
        take = min(self.k, flat.size)
        floor = np.partition(flat, flat.size - take)[flat.size - take]  # this block's k-th largest
        if self.value.size >= self.k:  # and only entries at least the k-th largest held can enter
            floor = max(floor, float(np.abs(self.value).min()))
        cand = np.flatnonzero(flat >= floor)  # ties included: which of them stay is decided by key
        rows, dims = np.divmod(cand, d)
        return self.add(
            np.asarray(x)[rows, dims],
            dims,
            np.asarray(keys, np.uint64)[rows],
            None if token_ids is None else np.asarray(token_ids, np.int64)[rows],
            None if special is None else np.asarray(special, bool)[rows],
            counts=counts,
            zeros=zeros,
            n=a.size,
        )

    def add(self, value, dim, key, token_id=None, special=None, *, counts, zeros: int, n: int) -> TopAbs:
        """Add a piece measured elsewhere (extracting, on the model's device): its candidate entries
        (every entry that may be among the k largest: at least all ties of its k-th largest) and the
        histogram ``counts``, ``zeros`` and entry count ``n`` of the whole piece."""
        value = np.asarray(value, np.float64)
        size = value.size
        self._keep(
            value,
            np.asarray(dim, np.int64),
            np.asarray(key, np.uint64),
            np.full(size, -1, np.int64) if token_id is None else np.asarray(token_id, np.int64),
            np.zeros(size, bool) if special is None else np.asarray(special, bool),
        )
        self.counts += np.asarray(counts, np.int64)
        self.zeros += int(zeros)
        self.n += int(n)
        return self

    def _keep(self, value, dim, key, token_id, special) -> None:
        """The k largest |value| of what is held and these candidates; ties by (key, dim)."""
        v = np.concatenate([self.value, value])
        dm = np.concatenate([self.dim, dim])
        ky = np.concatenate([self.key, key])
        order = np.lexsort((dm, ky, -np.abs(v)))[: self.k]
        self.value, self.dim, self.key = v[order], dm[order], ky[order]
        self.token_id = np.concatenate([self.token_id, token_id])[order]
        self.special = np.concatenate([self.special, special])[order]

    def merge(self, other: TopAbs) -> TopAbs:
        """Add another's entries and histogram; it must hold at least as many entries as this keeps
        (fewer would leave out entries that belong among the k largest)."""
        if other.k < self.k:
            raise DataError(f"cannot merge the top {other.k} entries into the top {self.k}")
        self._keep(other.value, other.dim, other.key, other.token_id, other.special)
        self.counts += other.counts
        self.zeros += other.zeros
        self.n += other.n
        return self

    def median_bounds(self) -> tuple[float, float]:
        """[low, high] bounds of the median |x| over every entry seen (the lower median of an even
        count): 0 where at least half are exact zeros, else the edges of the histogram bin the
        cumulative count reaches half in. DataError when nothing was seen."""
        if self.n == 0:
            raise DataError("no entries seen: the median |x| is undefined")
        half = (self.n + 1) // 2  # the rank of the lower median
        if self.zeros >= half:
            return 0.0, 0.0
        i = int(np.searchsorted(np.cumsum(self.counts), half - self.zeros))
        return bin_edges(i)

    def entries(self) -> list[dict]:
        """The kept entries, largest |x| first: ``{value, dim, key, token_id, special}``."""
        return [
            {
                "value": float(v),
                "dim": int(d),
                "key": int(k),
                "token_id": int(t),
                "special": bool(s),
            }
            for v, d, k, t, s in zip(self.value, self.dim, self.key, self.token_id, self.special, strict=True)
        ]


def device_piece(x, k: int):
    """(candidates, counts, zeros) of the rows ``x`` (a (m, D) torch tensor on any device, float16,
    bfloat16 or float32): the flat indices of every entry at least its k-th largest |x| (all ties),
    their values, and the |x| histogram -- computed where ``x`` is, in float32 (exact for those
    dtypes), so only the candidates and the counts leave the device. The bins equal
    :func:`bins_of`'s (EDGES32); a device without float32 ``frexp``/``bucketize`` computes them on
    the CPU."""
    import torch

    a = x.abs().to(torch.float32).reshape(-1)
    take = min(int(k), a.numel())
    floor = torch.topk(a, take).values[-1]
    cand = torch.nonzero(a >= floor).reshape(-1)
    values = x.reshape(-1).index_select(0, cand).to(torch.float32)
    pos = a[a > 0]
    try:
        counts = _device_counts(pos)
    except (RuntimeError, NotImplementedError):  # (an accelerator without these kernels)
        counts = _device_counts(pos.cpu())
    zeros = a.numel() - pos.numel()
    return cand.cpu().numpy(), values.cpu().numpy().astype(np.float64), counts.cpu().numpy(), int(zeros)


def _device_counts(pos):
    import torch

    mant, expo = torch.frexp(pos)
    edges = torch.as_tensor(EDGES32, device=pos.device)
    sub = torch.bucketize(mant * 2.0, edges, right=True) - 1
    idx = ((expo.to(torch.int64) - 1 + OCTAVES) * BINS_PER_OCTAVE + sub).clamp(0, BINS - 1)
    return torch.bincount(idx, minlength=BINS)
