"""``extract --keep sample:N``: keep per-shard accumulators and a seeded sample instead of every row.

Every metric but the nearest-neighbour ones is a function of mergeable per-layer statistics
(``Moments``: count, mean, scatter, unit-vector sums, |x| statistics), and TwoNN and the other
intrinsic-dimension estimators work on a seeded sample. So a shard of a ``sample:N`` run holds, per
layer:

- the ``Moments`` of its finite rows of ordinary tokens (``regular``) and, where there are some, of
  special tokens (``special``), accumulated in float64 on the model's device during the forward
  pass (moments_torch.py) from the rows cast to the store dtype -- the values a full run stores, so
  ``score`` gives the full run's moment metrics to float64 rounding;
- the largest |x| entries and the |x| histogram of the same rows (metrics/massive.py: the top
  :data:`~geomscope.store.accumulators.MASSIVE_KEPT` entries, candidates found on the device, so
  only they and the counts are copied off it), for ``score --metrics massive``;
- the rows of the sample: for every layer and for both ``--exclude-special`` settings, the N rows
  with the smallest ``row_hash(run_keys(doc_id, position), seed, STREAM_ID_SAMPLE)`` among those
  the layer's metrics may use. That is exactly what ``score --id-sample k`` draws from a full run:
  its k rows (k <= N) with the smallest hashes over the run are among the N smallest of each shard,
  whatever the sharding, the batch size or the number of processes.

Only the sampled rows are copied off the device: candidates are chosen on the host from the hashes
and flags of the batch, and a shard's candidates are pruned to the final set as they accumulate
(memory: about 4N rows of every layer).
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import InputError
from geomscope.store.accumulators import ABS_THRESHOLD, MASSIVE_KEPT
from geomscope.store.sample import STREAM_ID_SAMPLE, BottomK, row_hash, run_keys

DEFAULT_SAMPLE = 5000  # score --id-sample's default: `--keep sample` serves a default score
_META = ("token_id", "doc_id", "position", "is_special")


def parse_keep(spec: str) -> int | None:
    """``all`` -> None (every row); ``sample`` -> DEFAULT_SAMPLE; ``sample:N`` -> N >= 1."""
    s = str(spec).strip().lower()
    if s == "all":
        return None
    if s == "sample":
        return DEFAULT_SAMPLE
    head, _, n = s.partition(":")
    if head == "sample" and n.strip().isdigit():
        if int(n) < 1:
            raise InputError(f"--keep {spec}: the sample needs at least 1 row; e.g. --keep sample:5000")
        return int(n)
    raise InputError(f"--keep must be all, sample or sample:N (N rows per shard); got {spec!r}")


def _finite_rows(x):
    """(m,) bool tensor: rows of ``x`` without NaN/Inf. float16 is checked on its bits (exponent all
    ones), 2.5x faster than ``torch.isfinite`` on the CPU's emulated half floats."""
    import torch

    if x.dtype == torch.float16:
        return ((x.view(torch.int16) & 0x7C00) != 0x7C00).all(1)
    return torch.isfinite(x).all(1)


class SampleKeeper:
    """One shard's accumulators and sample candidates; ``add`` each batch, then ``result``.

    The rows' finiteness flags of every layer come to the host in one copy, queued with the batch;
    on an accelerator a batch is folded in at the next ``add`` (or at ``result``), once the next
    batch's forward is queued behind it. The accumulators and the selections wait for nothing (rows
    are picked with indices the host knows); the sample candidates' rows are copied to the host
    without waiting (capture.start_host_copies) and read when the buffer is pruned or the shard
    ends. The largest-|x| candidates (``_top``, metrics/massive.py) are read back per layer and part.
    """

    def __init__(
        self,
        names: list[str],
        dim: int,
        device,
        sample: int,
        seed: int,
        dims: dict[str, int] | None = None,
        products: str = "float64",
    ):
        from geomscope.metrics.moments_torch import device_moments

        self.names, self.dim, self.device = list(names), int(dim), device
        # each layer's width: ``dims``'s where it gives one (a module layer of another width), else D
        self.dims = {n: int((dims or {}).get(n, self.dim)) for n in self.names}
        self.k, self.seed = int(sample), int(seed)
        self.make = lambda name: device_moments(self.dims[name], device, ABS_THRESHOLD, products)
        self.acc: dict[str, dict] = {n: {"regular": self.make(n)} for n in self.names}
        self.tops: dict[str, dict] = {n: {} for n in self.names}  # layer -> part -> TopAbs
        # (layer, excluding special tokens) -> the k smallest hashes of the rows that layer may use
        self.bottom = {(n, ex): BottomK(self.k) for n in self.names for ex in (False, True)}
        self.buf: list[dict] = []
        self.buf_rows = 0
        self.tokens = 0
        self.docs: set[int] = set()
        self.nonfinite_rows = 0
        self.nonfinite_by_layer: dict[str, int] = {}
        self.defer = getattr(device, "type", str(device)) != "cpu"
        self.pending: tuple | None = None  # a batch whose flags are on their way (accelerators)

    def add(self, rows: dict, meta: dict[str, np.ndarray]) -> None:
        """Fold a batch (``rows[name]``: (m, D) tensors on the device, store dtype) in."""
        import torch

        from geomscope.extract.capture import start_host_copies

        if len(meta["is_special"]) == 0:
            return
        flags = start_host_copies([torch.stack([_finite_rows(rows[n]) for n in self.names])])
        batch = (rows, meta, flags)
        if self.defer:
            batch, self.pending = self.pending, batch
        if batch is not None:
            self._fold(*batch)

    def _fold(self, rows: dict, meta: dict[str, np.ndarray], flags) -> None:
        from geomscope.extract.capture import start_host_copies, to_device

        special = np.asarray(meta["is_special"], bool)
        self.tokens += len(special)
        self.docs.update(np.unique(meta["doc_id"]).tolist())
        by_layer = flags.result()[0]
        finite = dict(zip(self.names, by_layer, strict=True))
        any_bad = ~by_layer.all(0)
        for name in self.names:
            bad = int((~finite[name]).sum())
            if bad:
                self.nonfinite_by_layer[name] = self.nonfinite_by_layer.get(name, 0) + bad
        uploaded: dict[bytes, object] = {}  # one upload per distinct row selection

        def select(x, keep: np.ndarray):
            if keep.all():
                return x
            key = np.packbits(keep).tobytes()
            if key not in uploaded:
                uploaded[key] = to_device(np.flatnonzero(keep), self.device)
            return x.index_select(0, uploaded[key])

        for name in self.names:
            x, ok = rows[name], finite[name]
            self.acc[name]["regular"].update(select(x, ok & ~special))
            self._top(name, "regular", x, ok & ~special, meta)
            if special.any():
                if "special" not in self.acc[name]:
                    self.acc[name]["special"] = self.make(name)
                self.acc[name]["special"].update(select(x, ok & special))
                self._top(name, "special", x, ok & special, meta)
        self.nonfinite_rows += int(any_bad.sum())
        hashes = row_hash(run_keys(meta["doc_id"], meta["position"]), self.seed, STREAM_ID_SAMPLE)
        for (name, ex), bk in self.bottom.items():
            bk.add(hashes[self._eligible(finite[name], special, ex)])
        take = np.flatnonzero(self._wanted(hashes, finite, special))
        if take.size == 0:
            return
        idx = to_device(take, self.device)
        self.buf.append(
            {
                "hash": hashes[take],
                **{key: np.asarray(meta[key])[take] for key in _META},
                **{"F:" + n: finite[n][take] for n in self.names},
                "rows": start_host_copies([rows[n].index_select(0, idx) for n in self.names]),
            }
        )
        self.buf_rows += take.size
        if self.buf_rows > 4 * self.k:
            self._prune()

    def _top(self, name: str, part: str, x, rows: np.ndarray, meta: dict) -> None:
        """The largest |x| entries and the |x| histogram of ``x[rows]`` into layer ``name``'s ``part``."""
        import torch

        from geomscope.metrics.massive import TopAbs, device_piece

        picked = np.flatnonzero(rows)
        if picked.size == 0:
            return
        sel = x if picked.size == len(rows) else x.index_select(0, torch.from_numpy(picked).to(x.device))
        cand, values, counts, zeros = device_piece(sel, MASSIVE_KEPT)
        at, dims = np.divmod(cand, self.dims[name])
        at = picked[at]
        keys = run_keys(np.asarray(meta["doc_id"])[at], np.asarray(meta["position"])[at])
        top = self.tops[name].setdefault(part, TopAbs(MASSIVE_KEPT))
        top.add(
            values,
            dims,
            keys,
            np.asarray(meta["token_id"])[at],
            np.asarray(meta["is_special"], bool)[at],
            counts=counts,
            zeros=zeros,
            n=picked.size * self.dims[name],
        )

    def _rows_arrived(self) -> None:
        """The buffered candidates' rows, waited for and named per layer."""
        for part in self.buf:
            if "rows" in part:
                part.update(zip(("L:" + n for n in self.names), part.pop("rows").result(), strict=True))

    @staticmethod
    def _eligible(finite: np.ndarray, special: np.ndarray, exclude_special: bool) -> np.ndarray:
        return finite & ~special if exclude_special else finite

    def _wanted(self, hashes, finite: dict, special) -> np.ndarray:
        """Rows that are, so far, among the k smallest hashes of some (layer, special setting)."""
        want = np.zeros(len(hashes), bool)
        for (name, ex), bk in self.bottom.items():
            want |= self._eligible(finite[name], special, ex) & (hashes <= np.uint64(bk.threshold))
        return want

    def _prune(self) -> None:
        self._rows_arrived()
        b = {key: np.concatenate([p[key] for p in self.buf]) for key in self.buf[0]}
        keep = self._wanted(b["hash"], {n: b["F:" + n] for n in self.names}, b["is_special"])
        self.buf = [{key: v[keep] for key, v in b.items()}]
        self.buf_rows = int(keep.sum())

    def result(self) -> tuple[dict, dict, dict]:
        """(accumulators {layer: {part: Moments}}, sample rows {layer: (s, D)}, sample meta),
        the sample in (doc_id, position) order."""
        if self.pending is not None:
            self._fold(*self.pending)
            self.pending = None
        acc = {n: {part: tm.to_moments() for part, tm in parts.items()} for n, parts in self.acc.items()}
        if not self.buf:
            empty = {n: np.zeros((0, self.dims[n]), np.float16) for n in self.names}
            return acc, empty, {key: np.zeros(0, np.int64) for key in _META}
        self._prune()
        b = self.buf[0]
        order = np.lexsort((b["position"], b["doc_id"]))
        rows = {n: b["L:" + n][order] for n in self.names}
        meta = {key: b[key][order] for key in _META}
        return acc, rows, meta
