"""Where an ``extract`` call spends its time, thread by thread, and -- on a GPU -- what the host was
doing while the GPU waited.

    python benchmarks/profile_extract.py [--model bundled:minilm] [--sentences 10000] [--layers all]
                                         [--batch-tokens N] [--shard-docs 1000] [--device auto]
                                         [--stub-forward] [--repeats 3] [--json F] [--trace F]

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
  kernels', copies' and memsets' intervals is the GPU's busy time (not the profiler's GPU-side
  annotation ranges, which span a stage's first to last kernel, gaps included, nor stream waits),
  and every idle gap is split by what the main thread was doing at that moment (its innermost
  stage). A forward whose kernels are queued faster than the GPU runs them leaves no gap; an idle
  gap inside "forward" is the forward's own queueing (or a read-back inside it), one inside "wait
  for the store thread" is the store thread holding the main thread back. The idle time before the
  first GPU work and after the last is reported apart from the idle time between batches. The
  profiler's clock is put on the stage timers' by the main thread's own stage calls, which the
  profiler records as ``geomscope.*`` ranges: the median difference of their midpoints, whose spread
  the report gives. No GPU work recorded (CUPTI unavailable) is said, not reported as 100 % idle.
  ``--trace F`` writes the profiler's Chrome trace, with the main thread's stages as
  ``geomscope.*`` ranges (the profiler records the thread that started it, not the store,
  publisher or tokenizer threads); it is written after the report, and a failed export is said
  in the report.
- ``--stub-forward`` replaces the forward by a stand-in that returns hidden states of the right
  shape at once (benchmarks/bench_extract.py's): the host's own work with an infinitely fast model.
- ``--repeats N`` runs the call N times and profiles the last (the first warms CUDA's libraries and
  lazily loaded kernels, the allocator, autotuning and the page cache). torch.profiler records
  every op the main thread runs, which slows the host: on a GPU the warm-up calls run with the
  stage timers alone, and the report gives each one's time and the fastest after the first (the
  first alone is cold: use at least 3) beside the profiled call's.
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
    ("geomscope.extract.run", "scan_and_hash", "scan input"),
    ("geomscope.extract.shards", "ShardRun._tokenize", "tokenize"),
    ("geomscope.extract.capture", "Capture.launch", "launch"),
    ("geomscope.extract.capture", "Capture.device_rows", "cast and gather"),
    ("geomscope.extract.capture", "pad_right", "pad"),
    ("geomscope.extract.capture", "to_device", "upload"),
    ("geomscope.model.loaded", "LoadedModel.hidden_states", "forward"),
    ("geomscope.extract.capture", "row_meta", "row metadata"),
    ("geomscope.extract.capture", "start_host_copies", "queue host copies"),
    ("geomscope.extract.capture", "HostCopies.result", "wait for rows"),
    ("geomscope.extract.shards", "ShardRun._hand_over", "hand over"),
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
#: kineto's activity types of the GPU's own work (torch's FunctionEvent.activity_type); its other
#: device-side events are annotations (a stage's first to last kernel, gaps included) and waits
GPU_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}


def gpu_work(events) -> list[tuple[float, float]]:
    """``(start, end)`` in seconds on the profiler's clock of every kernel, copy and memset among the
    profiler's ``events``. (Without ``activity_type``, in an older torch: every CUDA event that is not
    a user annotation.)"""
    from torch.autograd import DeviceType

    out = []
    for e in events:
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        kind = getattr(e, "activity_type", None)
        if kind is not None and kind not in GPU_WORK:
            continue
        out.append((e.time_range.start / 1e6, e.time_range.end / 1e6))
    return out


def clock_offset(events, timeline: Timeline, main: str) -> dict:
    """The stage timers' clock less the profiler's: for every stage the main thread ran, its calls
    (the profiler's CPU ``geomscope.<stage>`` ranges and the timeline's records, each in order) are
    paired, and each pair gives the difference of their midpoints (the lags of opening and closing a
    range cancel). Returns {"offset_s": the median, "spread_us": the largest distance of a pair's
    difference from it, "pairs": how many}. Stages whose call counts differ are left out."""
    from torch.autograd import DeviceType

    profiled: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("geomscope."):
            mid = (e.time_range.start + e.time_range.end) / 2e6
            profiled.setdefault(e.name.removeprefix("geomscope."), []).append(mid)
    timed: dict[str, list[float]] = {}
    for t0, t1, stage in timeline.thread_intervals(main):
        timed.setdefault(stage, []).append((t0 + t1) / 2)
    diffs = []
    for stage, mids in timed.items():
        theirs = sorted(profiled.get(stage, []))
        if len(theirs) == len(mids):
            diffs += [ours - t for ours, t in zip(sorted(mids), theirs, strict=True)]
    if not diffs:
        raise RuntimeError("torch.profiler recorded none of the main thread's stages: no clock to align")
    diffs.sort()
    offset = diffs[len(diffs) // 2]
    return {"offset_s": offset, "spread_us": 1e6 * max(abs(d - offset) for d in diffs), "pairs": len(diffs)}


def profile_call(
    lm,
    corpus: Path,
    out: Path,
    options: dict,
    trace: Path | None = None,
    gpu_timeline: bool = True,
    profiled: bool | None = None,
) -> dict:
    """One ``extract()`` of ``corpus`` into ``out`` (removed first), timed by stage; on a GPU (and
    ``gpu_timeline``) under torch.profiler. ``profiled=True`` runs the profiler on the CPU too (its
    CPU activity only: the GPU branch's code without a GPU, for tests). Returns the report dict (see
    :func:`summarise`); a trace that cannot be written is said in ``report["trace"]``."""
    import torch

    from geomscope.extract.run import extract

    shutil.rmtree(out, ignore_errors=True)
    timeline = Timeline()
    cuda = lm.device.type == "cuda"
    if profiled is None:
        profiled = cuda and gpu_timeline
    if profiled:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof_ctx = profile(activities=activities)
    else:
        prof_ctx = nullcontext()
    with ExitStack() as stack:
        prof = stack.enter_context(prof_ctx)
        stack.enter_context(instrumented(timeline, lm=lm))
        main = threading.current_thread().name
        t0 = time.perf_counter()
        summary = extract(lm, [corpus], out, **options)
        if cuda:
            torch.cuda.synchronize(lm.device)
        t1 = time.perf_counter()
    report = summarise(timeline, main, t0, t1, summary)
    if profiled:
        events = prof.events()
        clock = clock_offset(events, timeline, main)
        work = [(a + clock["offset_s"], b + clock["offset_s"]) for a, b in gpu_work(events)]
        first = min((a for a, _b, s in timeline.thread_intervals(main) if s == "launch"), default=t0)
        report["gpu"] = gpu_summary(timeline, main, work, first, t1, report["batches"]) | {"clock": clock}
        if trace is not None:
            trace.unlink(missing_ok=True)
            try:  # (kineto logs a failed write and raises nothing: the file says)
                prof.export_chrome_trace(str(trace))
                report["trace"] = str(trace) if trace.is_file() else f"not written to {trace}"
            except Exception as e:  # the report matters more than the trace
                report["trace"] = f"not written: {type(e).__name__}: {e}"
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


def gpu_summary(timeline: Timeline, main: str, work, start: float, stop: float, batches: int) -> dict:
    """The GPU's busy share of ``[start, stop]`` (first launch to the end) and its idle time split
    by the main thread's innermost stage. ``work``: the GPU's kernels, copies and memsets on the
    stage timers' clock. The idle time before the first work ("head") and after the last ("tail":
    the last shards' storing) is given apart; the per-batch idle time is the rest's, between the
    first and the last work."""
    work = list(work)
    n = max(batches, 1)
    if not work:
        return {
            "error": "torch.profiler recorded no GPU work (is CUPTI available?): no GPU timeline",
            "kernels": 0,
        }
    busy = union(work)
    idle = gaps(busy, start, stop)
    pieces = innermost(timeline.thread_intervals(main), start, stop)
    window = stop - start
    idle_s = sum(b - a for a, b in idle)
    head = max(0.0, min(busy[0][0], stop) - start)
    tail = max(0.0, stop - max(busy[-1][1], start))
    between = idle_s - head - tail
    inside = sum(max(0.0, min(b, stop) - max(a, start)) for a, b in busy)
    return {
        "kernels": len(work),
        "work_s": sum(b - a for a, b in work),
        "work_inside_window": inside / max(sum(b - a for a, b in busy), 1e-300),
        "window_s": window,
        "busy_s": window - idle_s,
        "idle_s": idle_s,
        "head_s": head,
        "tail_s": tail,
        "idle_by_main_stage_s": dict(sorted(overlap_by_label(pieces, idle).items(), key=lambda kv: -kv[1])),
        "per_batch_ms": {"busy": 1e3 * (window - idle_s) / n, "idle": 1e3 * between / n},
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
    if "wall_s_without_profiler" in report:
        warm = ", ".join(f"{t:.3f}" for t in report.get("warmup_wall_s", []))
        parts.append(
            f"(the same call without torch.profiler: {report['wall_s_without_profiler']:.3f} s"
            + (f"; the warm-up calls: {warm} s" if warm else "")
            + (", the first alone: cold" if len(report.get("warmup_wall_s", [])) == 1 else "")
            + ")"
        )
    if gpu and "error" in gpu:
        parts.append(f"GPU: {gpu['error']}")
    elif gpu:
        clock = gpu.get("clock", {})
        parts.append(
            f"GPU, first launch to the end ({gpu['window_s']:.3f} s): busy {gpu['busy_s']:.3f} s "
            f"({gpu['busy_s'] / gpu['window_s']:.1%}), idle {gpu['idle_s']:.3f} s (before the first "
            f"GPU work {gpu['head_s']:.3f} s, after the last {gpu['tail_s']:.3f} s); per batch "
            f"{gpu['per_batch_ms']['busy']:.2f} ms busy, {gpu['per_batch_ms']['idle']:.2f} ms idle "
            f"between. {gpu['kernels']:,} kernels/copies, {gpu['work_s']:.3f} s of GPU work, "
            f"{gpu['work_inside_window']:.1%} of it inside the window; clocks aligned on "
            f"{clock.get('pairs', 0)} stage calls, spread {clock.get('spread_us', float('nan')):.0f} us"
        )
        idle_rows = [
            {"the main thread was in": stage, "GPU idle s": f"{s:.3f}", "ms per batch": f"{1e3 * s / n:.2f}"}
            for stage, s in gpu["idle_by_main_stage_s"].items()
        ]
        parts.append(markdown_table(idle_rows))
    if "trace" in report:
        parts.append(f"trace: {report['trace']}")
    return "\n\n".join(parts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled:minilm")
    ap.add_argument("--sentences", type=int, default=10_000)
    ap.add_argument("--layers", default="all")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: extract's (8192)")
    ap.add_argument("--shard-docs", type=int, default=1000)
    ap.add_argument("--store-dtype", default="float16")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: extract's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--stub-forward", action="store_true", help="a forward that returns at once")
    ap.add_argument("--repeats", type=int, default=3, help="calls made; the last is profiled")
    ap.add_argument("--workdir", default=None, help="where the corpus and the run go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, help="a GPU run's Chrome trace")
    args = ap.parse_args(argv)

    from bench_extract import forward_stubbed, make_corpus

    from geomscope.model.load import load_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="geomscope-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.sentences, work / "corpus.txt")
    load = {"device": args.device} | ({"dtype": args.dtype} if args.dtype else {})
    lm = load_model(args.model, **load)
    options = {"layers": args.layers, "shard_docs": args.shard_docs, "store_dtype": args.store_dtype}
    if args.batch_tokens:
        options["batch_tokens"] = args.batch_tokens
    with forward_stubbed(lm) if args.stub_forward else nullcontext():
        warmups = []
        for _ in range(max(0, args.repeats - 1)):  # the stage timers alone, no torch.profiler
            warmups.append(profile_call(lm, corpus, work / "run", options, gpu_timeline=False)["wall_s"])
        trace = Path(args.trace) if args.trace else None
        # --trace on the CPU: the profiler's CPU activity (the main thread's ops and stages)
        report = profile_call(lm, corpus, work / "run", options, trace, profiled=True if trace else None)
    if warmups and "gpu" in report:
        # torch.profiler records every op of the main thread, which slows the host: the call's
        # time without it says by how much (the fastest warm call: the first is cold)
        report["warmup_wall_s"] = warmups
        report["wall_s_without_profiler"] = min(warmups[1:] or warmups)
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
