"""Contextuality (Ethayarajh, *How Contextual are Contextualized Word Representations? Comparing the
Geometry of BERT, ELMo, and GPT-2 Embeddings*, EMNLP 2019): how much a token type's representation
depends on its context.

For a type w with occurrences x_1..x_n (its representations in n contexts), a sentence s with token
representations y_1..y_m:

- self-similarity: SelfSim(w) = mean of cos(x_i, x_j) over the n(n - 1) ordered pairs i != j;
- maximum explainable variance: MEV(w) = sigma_1^2 / sum_k sigma_k^2, the singular values of the
  (uncentred) n x D matrix of the x_i: the share of their variance the first principal direction
  explains;
- intra-sentence similarity: IntraSim(s) = (1/m) sum_i cos(y_i, s_bar), s_bar = mean of the y_i.

Ethayarajh subtracts the anisotropy baseline: the same quantity for uniformly random tokens (the
average cosine of random pairs for SelfSim and IntraSim; the MEV of random tokens for MEV).

Accumulators (mergeable, bounded memory; hashes given by the caller, so that what is kept does not
depend on the order rows arrive or pieces merge):

- :class:`TypeSample`: for each chosen type, the ``per_type`` occurrences of smallest hash;
- :class:`DocSums`: for the ``k`` documents of smallest hash, the sums of their rows and unit rows.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError


def unit_rows(x: np.ndarray) -> np.ndarray:
    """The rows of ``x`` (float64) scaled to unit length; a zero row stays 0."""
    a = np.asarray(x, np.float64)
    n = np.linalg.norm(a, axis=1, keepdims=True)
    return np.divide(a, n, out=np.zeros_like(a), where=n > 0)


def self_similarity(x: np.ndarray) -> float:
    """The mean cosine over the distinct ordered pairs of rows of ``x`` (at least 2 rows)."""
    u = unit_rows(x)
    n = len(u)
    if n < 2:
        raise DataError(f"{n} occurrence(s): self-similarity needs at least 2")
    s = u.sum(axis=0)
    return float((s @ s - (u * u).sum()) / (n * (n - 1)))


def explainable_variance(x: np.ndarray) -> float:
    """sigma_1^2 / sum sigma^2 of the uncentred rows ``x``: the first principal direction's share."""
    a = np.asarray(x, np.float64)
    s = np.linalg.svd(a, compute_uv=False)
    total = float((s * s).sum())
    if not total > 0:
        raise DataError("the occurrences are all zero: no variance to explain")
    return float(s[0] ** 2 / total)


def intra_similarity(sum_x: np.ndarray, sum_unit: np.ndarray, n: int) -> float:
    """IntraSim of a sentence from the sums of its rows and of its unit rows: (1/n) sum_i cos(y_i,
    s_bar) = <sum_unit, s_bar / ||s_bar||> / n (zero rows add 0 to sum_unit and count in n)."""
    norm = float(np.linalg.norm(sum_x))
    if n < 1 or norm == 0:
        raise DataError("a sentence without rows, or whose mean row is 0, has no intra-sentence similarity")
    return float(np.dot(sum_unit, sum_x) / norm / n)


class TypeSample:
    """For each of the token ``types`` (ids), the ``per_type`` occurrences with the smallest hashes:
    their rows (as given), hashes and jackknife groups. ``add``, ``merge``, :meth:`occurrences`."""

    def __init__(self, types, per_type: int):
        self.types = np.unique(np.asarray(types, np.int64))
        self.per_type = int(per_type)
        self._t: list[np.ndarray] = []
        self._h: list[np.ndarray] = []
        self._x: list[np.ndarray] = []
        self._g: list[np.ndarray] = []
        self._n = 0

    def add(self, token_ids, hashes, rows, groups) -> TypeSample:
        t = np.asarray(token_ids, np.int64)
        pick = np.isin(t, self.types)
        if not pick.any():
            return self
        self._t.append(t[pick])
        self._h.append(np.asarray(hashes, np.uint64)[pick])
        self._x.append(np.array(np.asarray(rows)[pick], copy=True))
        self._g.append(np.asarray(groups, np.int64)[pick])
        self._n += int(pick.sum())
        if self._n > 2 * self.per_type * max(1, self.types.size):
            self._prune()
        return self

    def _prune(self) -> None:
        t, h = np.concatenate(self._t), np.concatenate(self._h)
        x, g = np.concatenate(self._x), np.concatenate(self._g)
        order = np.lexsort((h, t))  # by type, then hash
        t, h, x, g = t[order], h[order], x[order], g[order]
        starts = np.searchsorted(t, t, side="left")
        keep = (np.arange(t.size) - starts) < self.per_type
        self._t, self._h, self._x, self._g = [t[keep]], [h[keep]], [x[keep]], [g[keep]]
        self._n = int(keep.sum())

    def merge(self, other: TypeSample) -> TypeSample:
        for parts in zip(other._t, other._h, other._x, other._g, strict=True):
            self.add(*parts)
        return self

    def occurrences(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{type: (rows, groups)} of the kept occurrences, each type's in hash order."""
        if not self._t:
            return {}
        self._prune()
        t, x, g = self._t[0], self._x[0], self._g[0]
        bounds = np.flatnonzero(np.r_[True, t[1:] != t[:-1], True])
        return {int(t[a]): (x[a:b], g[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)}


class DocSums:
    """For the ``k`` documents of smallest hash: the sum of their rows, of their unit rows, their row
    count and jackknife group. ``add``, ``merge``, :meth:`documents`."""

    def __init__(self, k: int, dim: int):
        self.k, self.dim = int(k), int(dim)
        self.sums: dict[int, list] = {}  # doc -> [hash, group, n, sum_x, sum_unit]
        self._bound: int | None = None

    def add(self, doc_ids, doc_hashes, rows, groups) -> DocSums:
        d = np.asarray(doc_ids, np.int64)
        h = np.asarray(doc_hashes, np.uint64)
        if d.size == 0:
            return self
        keep = np.ones(d.size, bool) if self._bound is None else h <= np.uint64(self._bound)
        if not keep.any():
            return self
        d, h, x, g = d[keep], h[keep], np.asarray(rows, np.float64)[keep], np.asarray(groups)[keep]
        u = unit_rows(x)
        uniq, first, inverse = np.unique(d, return_index=True, return_inverse=True)
        sx = np.zeros((uniq.size, self.dim))
        su = np.zeros((uniq.size, self.dim))
        np.add.at(sx, inverse, x)
        np.add.at(su, inverse, u)
        counts = np.bincount(inverse, minlength=uniq.size)
        for i, doc in enumerate(uniq.tolist()):
            self._add_doc(doc, int(h[first[i]]), int(g[first[i]]), int(counts[i]), sx[i], su[i])
        if len(self.sums) > 2 * self.k:
            self._prune()
        return self

    def _add_doc(self, doc: int, h: int, group: int, n: int, sum_x, sum_unit) -> None:
        held = self.sums.get(doc)
        if held is None:
            self.sums[doc] = [h, group, n, np.array(sum_x, np.float64), np.array(sum_unit, np.float64)]
        else:
            held[2] += n
            held[3] += sum_x
            held[4] += sum_unit

    def _prune(self) -> None:
        order = sorted(self.sums, key=lambda doc: (self.sums[doc][0], doc))[: self.k]
        self.sums = {doc: self.sums[doc] for doc in order}
        if len(self.sums) >= self.k:
            self._bound = max(v[0] for v in self.sums.values())

    def merge(self, other: DocSums) -> DocSums:
        for doc, (h, group, n, sx, su) in other.sums.items():
            if self._bound is None or h <= self._bound:
                self._add_doc(doc, h, group, n, sx, su)
        if len(self.sums) > 2 * self.k:
            self._prune()
        return self

    def documents(self) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
        """(doc, group, rows, sum_x, sum_unit) of the kept documents, by hash."""
        self._prune()
        return [
            (doc, v[1], v[2], v[3], v[4])
            for doc, v in sorted(self.sums.items(), key=lambda kv: (kv[1][0], kv[0]))
        ]


class Contexts:
    """One layer's contextuality accumulators: the chosen ``types``' occurrences (``per_type`` each),
    the ``docs`` sentences' sums, a ``pool`` of rows for the MEV baseline (a TypeSample of one type),
    and the unit sums and counts of every row per jackknife group (the cosine baseline). Rows are
    ordinary tokens; the caller gives every hash (which rows are kept depends on them alone)."""

    def __init__(self, types, per_type: int, docs: int, pool: int, groups: int, dim: int | None = None):
        self.types = TypeSample(types, per_type)
        self.n_docs, self.groups = int(docs), int(groups)
        self.pool = TypeSample([0], pool) if pool else None
        self.docs = self.unit_sum = None  # sized by the first rows (``dim``: now)
        self.unit_n = np.zeros(self.groups, np.int64)
        if dim is not None:
            self._alloc(dim)

    def _alloc(self, dim: int) -> None:
        self.docs = DocSums(self.n_docs, dim)
        self.unit_sum = np.zeros((self.groups, dim))

    def update(self, x, *, token_ids, type_hashes, doc_ids, doc_hashes, pool_hashes, groups) -> Contexts:
        x = np.asarray(x)
        if self.docs is None:
            self._alloc(x.shape[1])
        g = np.asarray(groups, np.int64)
        if token_ids is not None:
            self.types.add(token_ids, type_hashes, x, g)
        self.docs.add(doc_ids, doc_hashes, x, g)
        u = unit_rows(x)
        np.add.at(self.unit_sum, g, u)
        nonzero = (u != 0).any(axis=1)
        self.unit_n += np.bincount(g[nonzero], minlength=self.unit_n.size)
        if self.pool is not None:
            self.pool.add(np.zeros(len(g), np.int64), pool_hashes, x, g)
        return self

    def merge(self, other: Contexts) -> Contexts:
        if other.docs is None:  # (it saw no rows)
            return self
        if self.docs is None:
            self._alloc(other.unit_sum.shape[1])
        self.types.merge(other.types)
        self.docs.merge(other.docs)
        if self.pool is not None:
            self.pool.merge(other.pool)
        self.unit_sum += other.unit_sum
        self.unit_n += other.unit_n
        return self

    def pool_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, groups) of the pool, in hash order (None: no pool, or an empty one)."""
        if self.pool is None:
            return None
        got = self.pool.occurrences().get(0)
        return None if got is None else (np.asarray(got[0], np.float64), got[1])
