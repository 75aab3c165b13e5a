"""The units in which rows are read: a :class:`Task` (one shard of a run, or a row range of another
input), streamed as :class:`Block` s of bounded size.

A task is picklable (paths, sizes, checksums, a file's identity; never an open file), so that a
process pool or a Dask worker reads it on its own. A block carries, per row, a stable key (seeded
selection: sample.py), a jackknife group, the special-token flag and, per layer, the activations and
a non-finite flag.

Jackknife groups of a run's rows go by document, ``doc_id % G`` (so do rows of a file with a
``doc_id`` column, as ``geomscope export`` writes): the rows of one text move together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

READ_BYTES = 32 * 1024 * 1024  # bytes of activations read per block (all layers of a task together)


@dataclass(frozen=True)
class KeptSample:
    """What a ``--keep sample:N`` run says one of its shards kept: N (``size``) rows of each layer's
    sample under ``seed``, the run's number of layers, and the rows of each layer holding NaN or Inf
    (``nonfinite``: its entry's ``stats.nonfinite_by_layer``, as (layer, rows) pairs)."""

    size: int
    seed: int
    layers: int
    nonfinite: tuple[tuple[str, int], ...] = ()

    def nonfinite_rows(self, layer: str) -> int:
        return dict(self.nonfinite).get(layer, 0)

    @property
    def most_rows(self) -> int:
        """The rows such a shard can store: the union of each layer's two samples (with and without
        special tokens) of ``size`` rows each."""
        return 2 * self.layers * self.size


@dataclass(frozen=True)
class Task:
    """One independent unit of reading: a shard of a run (``kind == "shard"``: run.Run.shard_tasks),
    or a row range of another input (score/sources.py)."""

    kind: str  # "shard" | "npy" | "h5" | one of formats.FORMATS
    path: str
    index: int  # shard index, or block number of an array
    start: int = 0  # array rows [start, stop) of this file
    stop: int = 0
    n_total: int = 0  # array: total rows (for the contiguous jackknife groups)
    dataset: str | None = None
    rows: int = 0
    nbytes: int = -1  # shard: recorded size (checked before reading)
    digest: tuple[str, str] | None = None  # shard: (algorithm, hex) of its checksum (store/checksum.py)
    identity: tuple | None = None  # local shard: integrity.identity when planned; every open must match
    offset: int = 0  # formats: the source's global row number of row ``start``
    meta: tuple[str, ...] = ()  # formats: the optional per-row columns present (doc_id, special)
    dim: int = 0  # formats: the layers' width (sizes the read blocks); shard: the run's, checked
    dims: tuple[tuple[str, int], ...] = ()  # shard: (layer, width) of each layer not ``dim`` wide, checked
    kept: KeptSample | None = None  # shard of a --keep sample run: accumulators and a sample, not every row
    docs: tuple[int, int] | None = None  # shard: the documents [start, stop) its entry assigns it, checked
    tokens: int = 0  # shard: the token rows its entry says it measured (a --keep sample shard's accumulators)
    positions: int = 0  # shard: its rows' positions lie in [0, positions) (0: what a row key holds)
    vocab: int = 0  # shard: its token ids lie in [0, vocab), the model's vocabulary (0: not recorded)

    def width(self, layer: str) -> int:
        """The width ``layer``'s rows are held to: its own where the run records one, else ``dim``
        (0: not checked)."""
        return dict(self.dims).get(layer, self.dim)

    @property
    def accumulated(self) -> bool:
        """A shard of a ``--keep sample`` run: its accumulators and sample are read, not every row."""
        return self.kept is not None


@dataclass
class Block:
    """Rows of a task: their keys, jackknife groups, special flags, token ids where known and, per
    layer, values and flags."""

    keys: np.ndarray  # (m,) uint64
    group: np.ndarray  # (m,) int64 in [0, G)
    special: np.ndarray  # (m,) bool
    layers: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (m, D)
    nonfinite: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (m,) bool
    token_id: np.ndarray | None = None  # (m,) int64 where the source records them (a run's shards)


def row_bytes(dim: int, itemsize: int, n_layers: int) -> int:
    """Bytes one row of a read step takes: its layers' values, its index fields (token_id, doc_id,
    position: int64; is_special) and a non-finite flag per layer. Counting the fields keeps a step
    bounded for narrow layers too (D = 2 in float16 would otherwise read 16M rows, 0.4 GB of fields)."""
    return dim * itemsize * n_layers + 3 * 8 + 1 + n_layers


def rows_per_block(dim: int, itemsize: int, n_layers: int) -> int:
    """Rows of a block of about READ_BYTES: the layers' values, what the source reads beside them
    (:func:`row_bytes`) and the block's own keys, group (8 bytes each) and special flag."""
    return max(256, READ_BYTES // (row_bytes(dim, itemsize, max(1, n_layers)) + 17))


def groups_of_docs(doc_id: np.ndarray, n_groups: int) -> np.ndarray:
    """Jackknife group ``doc_id % G`` of each row."""
    return np.mod(np.asarray(doc_id, dtype=np.int64), max(1, n_groups))
