"""Seeded, order-independent row selection: hashes, bottom-k thresholds, a bottom-k reservoir.

Every row has a stable 64-bit *key* (run: ``doc_id << 24 | position``, the token's identity,
so that a sample does not depend on how the run was cut into shards or by how many processes it
was written; array: the row number).  ``row_hash(keys, seed, stream)`` maps keys to uniform 64-bit
values (splitmix64).  A uniform sample of exactly k rows without replacement is "the k rows with
the smallest hash" (bottom-k sampling): it depends only on the keys, the seed and the stream --
never on the order in which shards are read or on how they are spread over worker processes.

- ``--max-rows k``: a cheap metadata pre-pass finds, per layer, the k-th smallest hash among the
  eligible rows (:class:`BottomK`); the streaming pass then keeps rows whose hash is <= it.
- Intrinsic-dimension sample: :class:`Reservoir` keeps the rows with the smallest hashes of a
  second stream while streaming (memory bounded by ~2k rows per layer); partial reservoirs from
  workers merge exactly.
- ``extract --keep sample:N`` keeps, per shard, the N rows with the smallest hashes of that same
  stream (extract/keep.py), so the run's keys, hashes and streams live here, with the store that
  keeps the sample, and ``score`` draws from a kept sample what it would draw from every row.
"""

from __future__ import annotations

import numpy as np

STREAM_MAX_ROWS = 1
STREAM_ID_SAMPLE = 2
#: score --metrics contextuality: the token types measured, their occurrences, the sentences, the
#: pool of the MEV baseline (each its own stream, so the draws are independent)
STREAM_CONTEXT_TYPES = 3
STREAM_CONTEXT_ROWS = 4
STREAM_CONTEXT_DOCS = 5
STREAM_CONTEXT_POOL = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def row_hash(keys, seed: int, stream: int) -> np.ndarray:
    """splitmix64 of ``keys`` salted by (seed, stream): uniform uint64 values, one per key."""
    with np.errstate(over="ignore"):
        salt = _mix(np.array([(int(seed) * 0x100000001B3 + int(stream)) % (1 << 64)], dtype=np.uint64))[0]
        z = np.asarray(keys, dtype=np.uint64) ^ salt
        return _mix(z + _GOLDEN)


POSITION_BITS = 24  # tokens per document up to 16.7 M; document ids up to 2^40


def run_keys(doc_id, position) -> np.ndarray:
    """Stable keys of run rows: their (document id, position), whatever shard holds them."""
    d = np.asarray(doc_id, dtype=np.uint64)
    p = np.asarray(position, dtype=np.uint64)
    return (d << np.uint64(POSITION_BITS)) | p


class BottomK:
    """The k smallest uint64 values seen (``add``, ``merge``); ``threshold`` = the k-th smallest,
    or the largest uint64 when fewer than k values were seen (then every value qualifies)."""

    def __init__(self, k: int):
        self.k = int(k)
        self.values = np.empty(0, dtype=np.uint64)
        self.seen = 0

    def add(self, values: np.ndarray) -> BottomK:
        self.seen += int(values.size)
        v = np.concatenate([self.values, np.asarray(values, dtype=np.uint64)])
        if v.size > self.k:
            v = np.partition(v, self.k - 1)[: self.k]
        self.values = v
        return self

    def merge(self, other: BottomK) -> BottomK:
        seen = self.seen + other.seen
        self.add(other.values)
        self.seen = seen
        return self

    @property
    def threshold(self) -> int:
        if self.values.size < self.k:
            return int(np.iinfo(np.uint64).max)
        return int(self.values.max())


class Reservoir:
    """Rows with the k smallest hashes seen so far (bounded memory: at most 2k rows held).

    ``add(hashes, rows, meta=None)`` with rows (m, D) in any dtype (kept as given, e.g. float16
    storage) and ``meta`` a dict of per-row arrays (m,) kept beside them (the rows' keys, jackknife
    groups, token ids: every add of one reservoir gives the same names); ``merge(other)``;
    ``sample()`` -> the selected rows sorted by hash (deterministic order); :meth:`sample_with_meta`
    -> (hashes, rows, meta) in that order.
    """

    def __init__(self, k: int):
        self.k = int(k)
        self._h: list[np.ndarray] = []
        self._x: list[np.ndarray] = []
        self._m: list[dict] = []
        self._n = 0
        self._bound: int | None = None  # k-th smallest hash once k rows are held: larger ones never qualify

    def add(self, hashes: np.ndarray, rows: np.ndarray, meta: dict | None = None) -> Reservoir:
        if self.k <= 0 or len(hashes) == 0:
            return self
        hashes = np.asarray(hashes, dtype=np.uint64)
        meta = meta or {}
        if self._bound is not None:
            m = hashes <= np.uint64(self._bound)
            if not m.any():
                return self
            hashes, rows = hashes[m], rows[m]
            meta = {key: v[m] for key, v in meta.items()}
        self._h.append(hashes)
        self._x.append(np.array(rows, copy=True))
        self._m.append({key: np.array(v, copy=True) for key, v in meta.items()})
        self._n += len(hashes)
        if self._n > 2 * self.k:
            self._shrink()
        return self

    def _shrink(self) -> None:
        h = np.concatenate(self._h)
        x = np.concatenate(self._x)
        meta = {key: np.concatenate([m[key] for m in self._m]) for key in self._m[0]}
        if h.size > self.k:
            keep = np.argpartition(h, self.k - 1)[: self.k]
            h, x = h[keep], x[keep]
            meta = {key: v[keep] for key, v in meta.items()}
        self._h, self._x, self._m, self._n = [h], [x], [meta], h.size
        if h.size >= self.k:
            self._bound = int(h.max())

    def merge(self, other: Reservoir) -> Reservoir:
        for h, x, m in zip(other._h, other._x, other._m, strict=True):
            self.add(h, x, m)
        return self

    def sample(self) -> np.ndarray | None:
        """The selected rows (<= k, sorted by hash), or None when nothing was added."""
        got = self.sample_with_meta()
        return None if got is None else got[1]

    def sample_with_meta(self) -> tuple[np.ndarray, np.ndarray, dict] | None:
        """(hashes, rows, meta) of the selected rows, sorted by hash; None when nothing was added."""
        if not self._h:
            return None
        self._shrink()
        order = np.argsort(self._h[0], kind="stable")
        return self._h[0][order], self._x[0][order], {key: v[order] for key, v in self._m[0].items()}
