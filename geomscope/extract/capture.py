"""Running one batch and keeping the real-token rows of the requested hidden states, and of the
modules ``extract --modules`` names (their hooks: extract/modules.py).

Rows are the positions where the attention mask is 1, in row-major (document, position) order --
never chosen by comparing token ids (GPT-2's pad token is its eos; a pad id may be 0; a document may
contain the pad token as text).  A model's final norm is hooked when its input (the last block's
raw output, ``layer_N``) or its output (``final_norm``) is kept: ``output_hidden_states`` gives
only one of the two, and which one differs by family.  Each kept hidden state is cast to the store
dtype and gathered by torch where it lives (7x faster than numpy's float32 -> float16 cast on the
CPU); on an accelerator only the gathered rows, in the store dtype, are copied to the host,
through page-locked memory (:func:`start_host_copies`) -- or none of them, when ``extract --keep
sample:N`` measures them where they are (keep.py).

Host memory (:class:`HeapTrim`): on the CPU, torch takes every activation from glibc's malloc, whose
mmap threshold rises to the largest block freed (up to 32 MiB), so activations come from the heap,
and batches of varying shapes fragment it: a batch's blocks land on fresh pages, the more so the
more batches ran before, so without trims the peak within a shard grows with the number of shards
(the resident set after a trim stays flat). The heap's free pages are handed back (malloc_trim) at
every shard boundary (on the store thread, once the shard's last rows are stored) and after any
batch that left the resident set more than 1/4 above where the last trim left it (about one batch in
three on MiniLM): a trim costs the refaulting of the pages it hands back, so trimming only when the
heap has spread keeps most of the flattening of a trim after every batch at a part of its cost. With
this, the peak over ten times the text stays within about 1.1x of the peak over the text once, for
1-2 % more time. The alternatives cost more for no flatter peak: a smaller slack trims more often
for the same peak; a trim after every batch refaults more pages; a fixed mmap threshold either slows
every allocation (small thresholds) or leaves the spread (large ones); handing the shard writer
whole chunks from a buffer outside the heap leaves the spread, which comes from the forward's own
blocks (the kept hidden states among them); padding to fixed widths adds compute on short sentences.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

from geomscope.extract.batching import Doc, pad_right, row_meta
from geomscope.extract.modules import ModuleTaps

_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: not glibc


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (malloc_trim exists), else None."""
    global _libc
    if _libc is False:
        _libc = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(None)  # the symbols already loaded: the C library in use
                if not hasattr(lib, "gnu_get_libc_version"):  # musl, say
                    return None
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = lib
            except (OSError, AttributeError):
                pass
    return _libc


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc; elsewhere nothing); when: :class:`HeapTrim`."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


#: a batch that leaves the resident set this fraction above where the last trim left it is followed
#: by a trim (module docstring: 1/4 is as flat as 1/8 at less than half its cost)
BATCH_SLACK = 1 / 4


def resident_bytes() -> int | None:
    """The process's resident set now (Linux ``/proc/self/statm``, a few microseconds; else None)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrim:
    """When extract hands the heap's free pages back (:func:`trim_heap`): at every shard boundary,
    and after a batch that left the resident set more than ``slack`` (default :data:`BATCH_SLACK`)
    above where the last trim left it -- only when the heap has spread, not after every batch."""

    def __init__(self, slack: float | None = None):
        self.slack = BATCH_SLACK if slack is None else float(slack)
        self.base: int | None = None  # the resident set just after the last trim (or the first batch)
        self.trims = 0

    def _trim(self) -> None:
        trim_heap()
        self.trims += 1
        self.base = resident_bytes()

    def shard_done(self) -> None:
        """The shard's buffers are gone: always trim, so each shard starts from the same footprint."""
        self._trim()

    def batch_done(self) -> None:
        """The batch's activations are gone: trim if they left the heap spread over fresh pages."""
        now = resident_bytes()
        if now is None:
            return
        if self.base is None:
            self.base = now
        elif now > self.base * (1 + self.slack):
            self._trim()


class HostCopies:
    """Arrays on their way to the host: ``in_flight`` while a GPU still writes them (an event per
    device marks the end of its copies); ``result()`` waits for them and returns ``value``."""

    def __init__(self, value, events: list | None = None):
        self.value = value
        self._events = list(events or ())

    @property
    def in_flight(self) -> bool:
        return bool(self._events)

    def result(self):
        for event in self._events:
            event.synchronize()
        self._events = []
        return self.value

    def carrying(self, value) -> HostCopies:
        """The same copies, with ``value`` (built from the arrays) as their result."""
        return HostCopies(value, self._events)


def start_host_copies(tensors: list) -> HostCopies:
    """numpy copies of ``tensors``, wherever they live, queued without waiting (``HostCopies.value``:
    the list of arrays, complete once ``result()`` returns). From a GPU each goes into page-locked
    host memory, which the GPU writes at the link's speed (tens of GB/s, against a few GB/s into
    ordinary pageable memory: docs/explanation/performance.md), every copy queued on the device's
    current stream, after the work that computes it. Where no page-locked memory can be had, the
    ordinary copy (which waits). A page-locked block goes back to torch's cache of them when its
    array is freed and is reused for a later batch of its size class (torch rounds a block up to a
    power of two, and keeps the cache for the process's life: at most about twice the rows of the
    batches in flight)."""
    import torch

    out, devices = [], []
    for t in tensors:
        host = None
        if t.device.type == "cuda":
            try:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # pragma: no cover - page-locked memory refused
                host = None
        if host is None:
            out.append(t.cpu())
            continue
        host.copy_(t, non_blocking=True)  # on the device's current stream, after the gather
        if t.device not in devices:
            devices.append(t.device)
        out.append(host)
    events = []
    for dev in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        events.append(event)
    return HostCopies([h.numpy() for h in out], events)


def to_device(a: np.ndarray, dev):
    """``a`` as a tensor on ``dev``, the copy queued without waiting. To a GPU it goes through
    page-locked memory: a copy from ordinary (pageable) memory first waits for everything already
    queued on the stream, which is the previous batch's forward, so the next batch could not be
    queued while the GPU runs it (extract's pipeline, shards.py). torch keeps the page-locked block
    until the copy has read it."""
    import torch

    t = torch.from_numpy(a)
    if dev.type == "cuda":  # dev: a torch.device
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


class Capture:
    """``capture(docs) -> (layers, meta)``: ``layers[name]`` (rows, D) in the store dtype,
    ``meta`` per row."""

    def __init__(self, lm, layers: list[dict], store_dtype: str):
        import torch

        self.lm = lm
        n = lm.n_hidden_states
        split = bool(lm.final_norm and lm.final_norm_name)
        # where each kept layer comes from: ("hs", i) the hidden-states tuple, ("pre"/"post", _) the
        # final norm's input / output
        self.sources = []
        for la in layers:
            i = int(la["index"])
            if la.get("kind") == "module":  # a module's output or input (extract/modules.py)
                self.sources.append(("module", i))
            elif la.get("kind") == "final_norm":
                self.sources.append(("post", i))
            elif split and i == n - 1 and i != 0:
                self.sources.append(("pre", i))
            else:
                self.sources.append(("hs", i))
        self.hook_norm = any(src in ("pre", "post") for src, _ in self.sources)
        self.taps = ModuleTaps(lm, layers)
        self.indices = sorted({i for src, i in self.sources if src == "hs"})
        self.names = [la["name"] for la in layers]
        self.np_dtype = np.dtype(store_dtype)
        self.torch_dtype = getattr(torch, store_dtype)
        tok = lm.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0  # masked out: its value never matters
        self.on_cpu = lm.device.type == "cpu"
        # an "all layers" selection is cheaper as a flag than as a list
        self.wanted = None if self.indices == list(range(lm.n_hidden_states)) else (self.indices or [0])
        self.batches = 0

    def __call__(self, docs: list[Doc]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return self.launch(docs).result()

    def launch(self, docs: list[Doc]) -> HostCopies:
        """The capture of ``docs``, queued: ``result()`` gives ``(layers, meta)`` as calling the
        capture does. On the CPU it is complete at once; on a GPU the forward, the gathers and the
        copies to the host are queued, and ``result()`` waits for them (extract queues the next
        batch first: shards.py)."""
        rows, meta = self.device_rows(docs)
        if self.on_cpu:
            return HostCopies(({k: v.numpy() for k, v in rows.items()}, meta))
        import torch

        # on a GPU the NaN/Inf check of the stored values is nearly free, and it spares the store
        # thread a pass over every row (about a quarter of its appending time with every layer kept);
        # ShardWriter.append takes it when the rows are already in the store dtype
        names = list(rows)
        bad = [~torch.isfinite(rows[k]).all(dim=1) for k in names]
        copies = start_host_copies([rows[k] for k in names] + bad)
        host = copies.value
        flags = dict(zip(names, host[len(names) :], strict=True))
        layers = dict(zip(names, host[: len(names)], strict=True))
        return copies.carrying((layers, {**meta, "nonfinite": flags}))

    def _module_rows(self, key, tensor, gather) -> dict:
        """The rows of every module layer tapped at ``key`` (a module and side) from its tensor."""
        return {name: gather(self.taps.part(name, tensor)) for name in self.taps.taps[key]}

    def device_rows(self, docs: list[Doc]) -> tuple[dict, dict[str, np.ndarray]]:
        """Like calling the capture, but each layer's rows stay a tensor on the model's device."""
        import torch

        ids, mask = pad_right(docs, self.pad_id)
        flat = np.flatnonzero(mask.reshape(-1))
        dev = self.lm.device
        with torch.inference_mode():
            # a batch without padding goes without a mask: given one, transformers' SDPA mask reads
            # a value back from the GPU to find it all ones (a stall before every forward), then
            # takes the path it takes without one
            t_ids = to_device(ids, dev)
            t_mask = None if len(flat) == mask.size else to_device(mask, dev)
            idx = {dev: to_device(flat, dev)}  # per device: --device-map spreads the layers

            def gather(h):
                if h.device not in idx:
                    idx[h.device] = idx[dev].to(h.device)
                # cast first (padding is a few %, and the gather then moves 2-byte values), then gather
                rows = h.reshape(-1, h.shape[-1]).to(self.torch_dtype).index_select(0, idx[h.device])
                return rows if rows.device == dev else rows.to(dev)

            grabbed: dict = {}
            handle = None
            if self.hook_norm:

                def grab(_module, args, output):
                    grabbed["pre"] = args[0]
                    grabbed["post"] = output[0] if isinstance(output, (tuple, list)) else output

                handle = self.lm.final_norm_module().register_forward_hook(grab)
            tapped: dict = {}  # a module layer's rows, gathered as soon as its module has run
            detach = self.taps.attach(lambda key, t: tapped.update(self._module_rows(key, t, gather)))
            try:
                hs = self.lm.hidden_states(t_ids, t_mask, self.wanted)
            finally:
                if handle is not None:
                    handle.remove()
                detach()
            by_index = dict(enumerate(hs)) if self.wanted is None else dict(zip(self.wanted, hs, strict=True))
            out = {}
            for name, (src, i) in zip(self.names, self.sources, strict=True):
                out[name] = (
                    tapped[name] if src == "module" else gather(by_index[i] if src == "hs" else grabbed[src])
                )
        self.batches += 1
        start = self.lm.decoder_start_token_id if self.lm.stack == "decoder" else None
        return out, row_meta(docs, decoder_start=start)
