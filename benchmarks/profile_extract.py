"""Where an ``extract`` call spends its time, thread by thread, and -- on a GPU -- what the host was
doing while the GPU waited.

    python benchmarks/profile_extract.py [--model bundled:minilm] [--sentences 10000] [--layers all]
                                         [--batch-tokens N] [--shard-docs 1000] [--device auto]
                                         [--stub-forward] [--repeats 2] [--json F] [--trace F]

Not a benchmark (nothing is compared): a timeline, for finding the host work that keeps a fast GPU
waiting. ``make bench`` does not run it; ``--device cpu`` runs it anywhere.

- **Stages.** For the length of one ``extract()`` call, the pipeline's own functions are wrapped
  with timers: on the main thread tokenizing (when it is not done ahead on the tokenizer thread),
  padding, the uploads of ids and masks, the model's forward, the cast and gather of the kept
  layers (what is left of ``device_rows``), the row metadata, queueing the copies to the host, the
  waits for a batch's rows and for the store thread, and handing a batch over; on the store thread
  the appends to the shard and each shard's finish; on the publisher thread each shard's
  publishing (checksums, fsync, rename) and its record. Each stage's SELF time is its time less
  that of the stages it called on the same thread; the main thread's "(loop)" is the rest of the
  call: the extraction loop's own Python, progress, planning, loading the run's identity; "scan
  input" is the first pass over the input (counting and hashing), "wait for the last shards" the
  end, while the store and publisher threads finish. The wrappers are removed afterwards
  and change nothing that is written (tested).
- **On a GPU** the same call runs under ``torch.profiler`` with CUDA activity: the union of the
  kernels' and copies' intervals is the GPU's busy time, and every idle gap is split by what the
  main thread was doing at that moment (its innermost stage). A forward whose kernels are queued
  faster than the GPU runs them leaves no gap; an idle gap inside "forward" is the forward's own
  queueing (or a read-back inside it), one inside "wait for the store thread" is the store thread
  holding the main thread back. ``--trace F`` writes the profiler's Chrome trace, in which every
  stage is a ``geomscope.*`` range on its thread.
- ``--stub-forward`` replaces the forward by a stand-in that returns hidden states of the right
  shape at once (benchmarks/bench_extract.py's): the host's own work with an infinitely fast model.
- ``--repeats N`` runs the call N times and profiles the last (the first warms the allocator, the
  kernels' autotuning and the page cache). torch.profiler records every op the main thread runs,
  which slows the host: on a GPU the warm-up calls run with the stage timers alone, and the report
  gives the last one's time beside the profiled call's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

LOOP = "(loop)"  # the main thread's time inside extract() outside every stage


class Timeline:
    """Intervals ``(thread, stage, t0, t1, self_seconds)`` recorded by :meth:`timed` wrappers, from any
    thread. A stage called inside another on the same thread is subtracted from the outer one's
    self time."""

    def __init__(self):
        self.records: list[tuple[str, str, float, float, float]] = []
        self._lock = threading.Lock()
        self._stack = threading.local()

    def timed(self, stage: str, fn):
        """``fn`` timed as ``stage`` (and a ``geomscope.<stage>`` range where torch.profiler runs)."""
        from torch.profiler import record_function

        timeline = self

        def wrapper(*args, **kwargs):
            stack = getattr(timeline._stack, "frames", None)
            if stack is None:
                stack = timeline._stack.frames = []
            stack.append(0.0)  # the time of the stages this one calls
            t0 = time.perf_counter()
            try:
                with record_function(f"geomscope.{stage}"):
                    return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                inner = stack.pop()
                if stack:
                    stack[-1] += t1 - t0
                with timeline._lock:
                    timeline.records.append((threading.current_thread().name, stage, t0, t1, t1 - t0 - inner))

        wrapper.__wrapped__ = fn
        return wrapper

    def by_thread(self) -> dict[str, dict[str, dict]]:
        """thread -> stage -> {"calls", "self_s"}."""
        out: dict[str, dict[str, dict]] = {}
        for thread, stage, _t0, _t1, own in self.records:
            s = out.setdefault(thread, {}).setdefault(stage, {"calls": 0, "self_s": 0.0})
            s["calls"] += 1
            s["self_s"] += own
        return out

    def thread_intervals(self, thread: str) -> list[tuple[float, float, str]]:
        return [(t0, t1, stage) for th, stage, t0, t1, _ in self.records if th == thread]


# (module, attribute path, stage): what is timed. Module attributes are patched where they are
# looked up (capture.py calls its own ``pad_right``). The batch plan is a generator, consumed by the
# loop: its time is the loop's.
STAGES = [
    ("geomscope.extract.run", "_scan", "scan input"),
    ("geomscope.extract.run", "_ShardRun._tokenize", "tokenize"),
    ("geomscope.extract.capture", "Capture.launch", "launch"),
    ("geomscope.extract.capture", "Capture.device_rows", "cast and gather"),
    ("geomscope.extract.capture", "pad_right", "pad"),
    ("geomscope.extract.capture", "_to_device", "upload"),
    ("geomscope.extract.models", "LoadedModel.hidden_states", "forward"),
    ("geomscope.extract.capture", "row_meta", "row metadata"),
    ("geomscope.extract.capture", "start_host_copies", "queue host copies"),
    ("geomscope.extract.capture", "HostCopies.result", "wait for rows"),
    ("geomscope.extract.run", "_ShardRun._hand_over", "hand over"),
    ("geomscope.extract.storing", "StoreThread.wait_idle", "wait for the store thread"),
    ("geomscope.extract.storing", "StoreThread.drain", "wait for the last shards"),
    ("geomscope.extract.capture", "HeapTrim._trim", "heap trim"),
    ("geomscope.store.shard", "ShardWriter.append", "append"),
    ("geomscope.store.shard", "ShardWriter.finish", "finish shard"),
    ("geomscope.store.shard", "ShardWriter.publish", "publish shard"),
    ("geomscope.store.manifest", "RunWriter.add_shard", "record shard"),
]


@contextmanager
def instrumented(timeline: Timeline, stages=STAGES, lm=None):
    """Every stage of ``stages`` wrapped for the duration; the originals put back afterwards. A
    forward set on the model itself (``--stub-forward``'s stand-in) is timed as the forward too."""
    import importlib

    undo = []
    try:
        if lm is not None and "hidden_states" in vars(lm):
            undo.append((lm, "hidden_states", lm.hidden_states))
            lm.hidden_states = timeline.timed("forward", lm.hidden_states)
        for module_name, path, stage in stages:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            original = owner.__dict__[attr]  # the function itself, not a bound method
            setattr(owner, attr, timeline.timed(stage, original))
            undo.append((owner, attr, original))
        yield timeline
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


# ------------------------------------------------------------------ interval arithmetic (pure)
def union(intervals) -> list[tuple[float, float]]:
    """The union of ``(t0, t1)`` intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for t0, t1 in sorted((a, b) for a, b in intervals if b > a):
        if out and t0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t1)
        else:
            out.append([t0, t1])
    return [(a, b) for a, b in out]


def gaps(busy: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    """The parts of ``[start, stop]`` that the disjoint sorted ``busy`` intervals leave free."""
    out, at = [], start
    for t0, t1 in busy:
        if t1 <= at:
            continue
        if t0 >= stop:
            break
        if t0 > at:
            out.append((at, min(t0, stop)))
        at = max(at, t1)
    if at < stop:
        out.append((at, stop))
    return out


def innermost(intervals: list[tuple[float, float, str]], start: float, stop: float, outside: str = LOOP):
    """``[start, stop]`` cut into ``(t0, t1, label)`` pieces, each labelled by the innermost of the
    properly nested ``intervals`` (one thread's stages) covering it, ``outside`` where none does.
    One sweep: the intervals in order of start (the outer first at a tie), a stack of those open."""
    pieces: list[tuple[float, float, str]] = []

    def emit(a: float, b: float, label: str) -> None:
        a, b = max(a, start), min(b, stop)
        if b <= a:
            return
        if pieces and pieces[-1][2] == label and pieces[-1][1] == a:
            pieces[-1] = (pieces[-1][0], b, label)
        else:
            pieces.append((a, b, label))

    open_: list[tuple[float, str]] = []  # (end, label), innermost last
    at = start
    for t0, t1, label in sorted(intervals, key=lambda iv: (iv[0], -iv[1])):
        while open_ and open_[-1][0] <= t0:
            end, name = open_.pop()
            emit(at, end, name)
            at = max(at, end)
        emit(at, t0, open_[-1][1] if open_ else outside)
        at = max(at, t0)
        open_.append((t1, label))
    while open_:
        end, name = open_.pop()
        emit(at, end, name)
        at = max(at, end)
    emit(at, stop, outside)
    return pieces


def overlap_by_label(pieces, windows) -> dict[str, float]:
    """Seconds of the ``windows`` that fall in each label's ``pieces`` (both sorted, disjoint)."""
    out: dict[str, float] = {}
    i = 0
    for w0, w1 in windows:
        while i < len(pieces) and pieces[i][1] <= w0:
            i += 1
        j = i
        while j < len(pieces) and pieces[j][0] < w1:
            a, b, label = pieces[j]
            out[label] = out.get(label, 0.0) + max(0.0, min(b, w1) - max(a, w0))
            j += 1
    return out


# ------------------------------------------------------------------ the profiled call
def _gpu_intervals(prof, anchor_perf: float) -> list[tuple[float, float]]:
    """The CUDA kernels' and copies' intervals on the perf_counter clock, aligned by the
    ``geomscope.anchor`` range opened at ``anchor_perf``."""
    from torch.autograd import DeviceType

    events = prof.events()
    anchor = next(e for e in events if e.name == "geomscope.anchor")
    shift = anchor_perf - anchor.time_range.start / 1e6
    return [
        (e.time_range.start / 1e6 + shift, e.time_range.end / 1e6 + shift)
        for e in events
        if e.device_type == DeviceType.CUDA
    ]


def profile_call(
    lm, corpus: Path, out: Path, options: dict, trace: Path | None = None, gpu_timeline: bool = True
) -> dict:
    """One ``extract()`` of ``corpus`` into ``out`` (removed first), timed by stage; on a GPU (and
    ``gpu_timeline``) under torch.profiler. Returns the report dict (see :func:`summarise`)."""
    import torch

    from geomscope.extract.run import extract

    shutil.rmtree(out, ignore_errors=True)
    timeline = Timeline()
    cuda = lm.device.type == "cuda" and gpu_timeline
    if cuda:
        from torch.profiler import ProfilerActivity, profile, record_function

        prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    else:
        prof_ctx = nullcontext()
    with ExitStack() as stack:
        prof = stack.enter_context(prof_ctx)
        stack.enter_context(instrumented(timeline, lm=lm))
        anchor_perf = time.perf_counter()
        if cuda:
            with record_function("geomscope.anchor"):
                pass
        main = threading.current_thread().name
        t0 = time.perf_counter()
        summary = extract(lm, [corpus], out, **options)
        if cuda:
            torch.cuda.synchronize(lm.device)
        t1 = time.perf_counter()
    report = summarise(timeline, main, t0, t1, summary)
    if cuda:
        busy = union(_gpu_intervals(prof, anchor_perf))
        first = min((a for a, _b, s in timeline.thread_intervals(main) if s == "launch"), default=t0)
        report["gpu"] = gpu_summary(timeline, main, busy, first, t1, report["batches"])
        if trace is not None:
            prof.export_chrome_trace(str(trace))
    return report


def summarise(timeline: Timeline, main: str, t0: float, t1: float, summary: dict) -> dict:
    wall = t1 - t0
    threads = timeline.by_thread()
    if main in threads:
        top = union((a, b) for a, b, _ in timeline.thread_intervals(main))
        threads[main][LOOP] = {"calls": 1, "self_s": wall - sum(b - a for a, b in top)}
    batches = threads.get(main, {}).get("launch", {}).get("calls", 0)
    return {
        "wall_s": wall,
        "rows": summary["rows"],
        "batches": batches,
        "shards": summary.get("shards_written", summary.get("shards")),
        "threads": threads,
        "main_thread": main,
    }


def gpu_summary(timeline: Timeline, main: str, busy, start: float, stop: float, batches: int) -> dict:
    """The GPU's busy share of ``[start, stop]`` (first launch to the end) and its idle time split
    by the main thread's innermost stage."""
    idle = gaps(busy, start, stop)
    pieces = innermost(timeline.thread_intervals(main), start, stop)
    window, n = stop - start, max(batches, 1)
    idle_s = sum(b - a for a, b in idle)
    return {
        "window_s": window,
        "busy_s": window - idle_s,
        "idle_s": idle_s,
        "idle_by_main_stage_s": dict(sorted(overlap_by_label(pieces, idle).items(), key=lambda kv: -kv[1])),
        "per_batch_ms": {"busy": 1e3 * (window - idle_s) / n, "idle": 1e3 * idle_s / n},
    }


def markdown(report: dict) -> str:
    from _common import markdown_table

    wall, n = report["wall_s"], max(report["batches"], 1)
    main = report["main_thread"]
    stage_rows = [
        {
            "thread": thread,
            "stage": stage,
            "calls": s["calls"],
            "self s": f"{s['self_s']:.3f}",
            "ms per batch": f"{1e3 * s['self_s'] / n:.2f}",
            "share of the call": f"{s['self_s'] / wall:.1%}",
        }
        for thread in sorted(report["threads"], key=lambda t: (t != main, t))
        for stage, s in sorted(report["threads"][thread].items(), key=lambda kv: -kv[1]["self_s"])
    ]
    parts = [
        f"extract: {report['rows']:,} rows, {report['batches']} batches, {report['shards']} shards, "
        f"{wall:.3f} s ({report['rows'] / wall:,.0f} rows/s)",
        markdown_table(stage_rows),
    ]
    gpu = report.get("gpu")
    if gpu:
        if "wall_s_without_profiler" in report:
            parts.append(f"(the same call without torch.profiler: {report['wall_s_without_profiler']:.3f} s)")
        parts.append(
            f"GPU, first launch to the end ({gpu['window_s']:.3f} s): busy {gpu['busy_s']:.3f} s "
            f"({gpu['busy_s'] / gpu['window_s']:.1%}), idle {gpu['idle_s']:.3f} s; per batch "
            f"{gpu['per_batch_ms']['busy']:.2f} ms busy, {gpu['per_batch_ms']['idle']:.2f} ms idle"
        )
        idle_rows = [
            {"the main thread was in": stage, "GPU idle s": f"{s:.3f}", "ms per batch": f"{1e3 * s / n:.2f}"}
            for stage, s in gpu["idle_by_main_stage_s"].items()
        ]
        parts.append(markdown_table(idle_rows))
    return "\n\n".join(parts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled:minilm")
    ap.add_argument("--sentences", type=int, default=10_000)
    ap.add_argument("--layers", default="all")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: extract's for the device")
    ap.add_argument("--shard-docs", type=int, default=1000)
    ap.add_argument("--store-dtype", default="float16")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: extract's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--stub-forward", action="store_true", help="a forward that returns at once")
    ap.add_argument("--repeats", type=int, default=2, help="calls made; the last is profiled")
    ap.add_argument("--workdir", default=None, help="where the corpus and the run go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, help="a GPU run's Chrome trace")
    args = ap.parse_args(argv)

    from bench_extract import forward_stubbed, make_corpus

    from geomscope.extract.models import load_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="geomscope-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.sentences, work / "corpus.txt")
    load = {"device": args.device} | ({"dtype": args.dtype} if args.dtype else {})
    lm = load_model(args.model, **load)
    options = {"layers": args.layers, "shard_docs": args.shard_docs, "store_dtype": args.store_dtype}
    if args.batch_tokens:
        options["batch_tokens"] = args.batch_tokens
    with forward_stubbed(lm) if args.stub_forward else nullcontext():
        host_only = None
        for _ in range(max(0, args.repeats - 1)):  # the stage timers alone, no torch.profiler
            host_only = profile_call(lm, corpus, work / "run", options, gpu_timeline=False)
        report = profile_call(lm, corpus, work / "run", options, Path(args.trace) if args.trace else None)
    if host_only is not None and "gpu" in report:
        # torch.profiler records every op of the main thread, which slows the host: the call's
        # time without it, from the last warm-up call, says by how much
        report["wall_s_without_profiler"] = host_only["wall_s"]
    report["setup"] = {
        **vars(args),
        "device": str(lm.device),
        "model_dtype": str(next(lm.model.parameters()).dtype),
    }
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
