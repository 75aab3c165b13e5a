"""benchmarks/profile_extract.py: the interval arithmetic against brute force, and a profiled
``extract()`` on the CPU -- every stage on the thread that runs it, one append and one launch per
batch, the same rows as an unprofiled call, the wrappers gone afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_extract as pe  # noqa: E402
from helpers_models import make_tiny_model  # noqa: E402


# ---------------------------------------------------------------- interval arithmetic
def test_union_and_gaps():
    assert pe.union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert pe.gaps([(0, 2), (3, 4)], -1, 6) == [(-1, 0), (2, 3), (4, 6)]
    assert pe.gaps([(0, 2), (3, 4)], 1, 3.5) == [(2, 3)]
    assert pe.gaps([], 0, 1) == [(0, 1)]


def test_innermost_labels_a_nested_timeline():
    ivs = [(1, 9, "launch"), (2, 3, "pad"), (3, 7, "forward"), (4, 5, "upload"), (10, 12, "wait")]
    assert pe.innermost(ivs, 0, 13) == [
        (0, 1, pe.LOOP),
        (1, 2, "launch"),
        (2, 3, "pad"),
        (3, 4, "forward"),
        (4, 5, "upload"),
        (5, 7, "forward"),
        (7, 9, "launch"),
        (9, 10, pe.LOOP),
        (10, 12, "wait"),
        (12, 13, pe.LOOP),
    ]
    assert pe.innermost(ivs, 4.5, 8) == [(4.5, 5, "upload"), (5, 7, "forward"), (7, 8, "launch")]
    pieces = pe.innermost(ivs, 0, 13)
    assert pe.overlap_by_label(pieces, [(0.5, 2.5), (6, 11)]) == {
        pe.LOOP: 1.5,
        "launch": 3.0,
        "pad": 0.5,
        "forward": 1.0,
        "wait": 1.0,
    }


@st.composite
def nested(draw, depth=0, lo=0, hi=1000):
    """Properly nested integer intervals inside [lo, hi] (one thread's stages)."""
    out, at = [], lo
    for _ in range(draw(st.integers(0, 3 if depth < 3 else 0))):
        if hi - at < 2:
            break
        a = draw(st.integers(at, hi - 2))
        b = draw(st.integers(a + 1, hi))
        out.append((a, b, f"s{depth}.{len(out)}"))
        out += draw(nested(depth + 1, a, b))
        at = b
    return out


def _brute_innermost(ivs, t):
    """The label of the shortest interval holding ``t`` (nested: the innermost); of two with the
    same span, the one listed later (a call inside another is listed after it, as in a timeline
    ordered by start)."""
    holding = [(b - a, -k, name) for k, (a, b, name) in enumerate(ivs) if a < t < b]
    return min(holding)[2] if holding else pe.LOOP


@settings(max_examples=200, deadline=None)
@given(nested(), st.integers(-50, 500), st.integers(1, 1200))
def test_innermost_matches_brute_force(ivs, start, length):
    stop = start + length
    pieces = pe.innermost(ivs, start, stop)
    # the pieces tile [start, stop] in order
    assert pieces[0][0] == start and pieces[-1][1] == stop
    assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:], strict=False))
    for a, b, label in pieces:
        assert a < b
        for t in np.linspace(a, b, 5)[1:-1]:  # (integer ends: never on another interval's end)
            if not any(t in (x, y) for x, y, _ in ivs):
                assert label == _brute_innermost(ivs, t), (t, pieces)
    windows = pe.union([(start + length / 4, start + length / 2), (start + 0.6 * length, stop)])
    got = pe.overlap_by_label(pieces, windows)
    assert sum(got.values()) == pytest.approx(sum(b - a for a, b in windows))


def test_gpu_summary_splits_idle_time_by_the_main_threads_stage():
    """The GPU branch's arithmetic, on a made-up timeline: GPU busy 1-3 and 5-9 of the window 0-10;
    the main thread queued a forward 0-4 (an upload inside it 0-1), waited for rows 4-6, then ran
    its loop."""
    timeline = pe.Timeline()
    timeline.records = [
        ("MainThread", "upload", 0.0, 1.0, 1.0),
        ("MainThread", "forward", 0.0, 4.0, 3.0),
        ("MainThread", "wait for rows", 4.0, 6.0, 2.0),
        ("geomscope-store", "append", 5.0, 8.0, 3.0),  # another thread: not the main thread's stage
    ]
    got = pe.gpu_summary(timeline, "MainThread", [(1.0, 3.0), (5.0, 9.0)], 0.0, 10.0, batches=2)
    assert got["busy_s"] == 6.0 and got["idle_s"] == 4.0
    # idle: 0-1 (upload), 3-4 (forward), 4-5 (wait for rows), 9-10 (the loop)
    assert got["idle_by_main_stage_s"] == {"upload": 1.0, "forward": 1.0, "wait for rows": 1.0, pe.LOOP: 1.0}
    # 1 s before the first GPU work and 1 s after the last: the 2 s between are the batches' idle time
    assert got["head_s"] == 1.0 and got["tail_s"] == 1.0
    assert got["per_batch_ms"] == {"busy": 3000.0, "idle": 1000.0}
    assert got["kernels"] == 2 and got["work_s"] == 6.0 and got["work_inside_window"] == 1.0
    report = {"wall_s": 10.0, "rows": 5, "batches": 2, "shards": 1, "main_thread": "MainThread"}
    report |= {"threads": timeline.by_thread(), "gpu": got, "wall_s_without_profiler": 9.0}
    report["warmup_wall_s"] = [12.0, 9.0]
    text = pe.markdown(report)
    assert "| wait for rows | 1.000 | 500.00 |" in text
    assert "without torch.profiler: 9.000 s; the warm-up calls: 12.000, 9.000 s)" in text
    assert "before the first GPU work 1.000 s, after the last 1.000 s" in text
    # overlapping work on two streams counts once; no work at all is said, not shown as idle
    assert pe.gpu_summary(timeline, "MainThread", [(1.0, 3.0), (2.0, 4.0)], 0.0, 10.0, 2)["busy_s"] == 3.0
    none = pe.gpu_summary(timeline, "MainThread", [], 0.0, 10.0, batches=2)
    assert none["kernels"] == 0 and "no GPU work" in pe.markdown(report | {"gpu": none})


def _event(name, start_us, end_us, device="CPU", **kw):
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(0, name, 1, start_us, end_us, device_type=getattr(DeviceType, device), **kw)


def test_gpu_work_is_kernels_copies_and_memsets_not_annotations_or_waits():
    """The profiler's device-side annotation of a stage spans its first to its last kernel, gaps
    included: counted as busy it would hide the very idle time the script is for."""
    events = [
        _event(
            "geomscope.forward",
            1000,
            10000,
            "CUDA",
            is_user_annotation=True,
            activity_type="gpu_user_annotation",
        ),
        _event("gemm", 1000, 2000, "CUDA", activity_type="kernel"),
        _event("Memcpy HtoD", 2500, 3000, "CUDA", activity_type="gpu_memcpy"),
        _event("Memset", 3000, 3100, "CUDA", activity_type="gpu_memset"),
        _event("Stream Wait Event", 3100, 8000, "CUDA", activity_type="cuda_sync"),
        _event("gemm", 9000, 10000, "CUDA", activity_type="kernel"),
        _event("cudaLaunchKernel", 900, 950, "CPU", activity_type="cuda_runtime"),
        _event("old torch: a kernel without an activity type", 11000, 11500, "CUDA"),
        _event("old torch: an annotation", 11000, 20000, "CUDA", is_user_annotation=True),
    ]
    assert pe.gpu_work(events) == [
        (0.001, 0.002),
        (0.0025, 0.003),
        (0.003, 0.0031),
        (0.009, 0.01),
        (0.011, 0.0115),
    ]


def test_clock_offset_pairs_the_main_threads_stage_calls():
    """The profiler's clock starts at 0 where the timers read 100 s; its ranges open 40 us after the
    timer starts and close 40 us before it stops (nested in the timer's: the midpoints differ by the
    clocks' offset alone), one call of a stage
    is missing from the profiler (that stage is left out), and another thread's stage is not used."""
    timeline = pe.Timeline()
    timeline.records = [
        ("MainThread", "forward", 100.001, 100.004, 0.003),
        ("MainThread", "forward", 100.010, 100.014, 0.004),
        ("MainThread", "pad", 100.000, 100.0005, 0.0005),
        ("MainThread", "upload", 100.0006, 100.0008, 0.0002),
        ("MainThread", "upload", 100.0106, 100.0108, 0.0002),
        ("geomscope-store", "append", 100.005, 100.009, 0.004),
    ]
    events = [
        _event("geomscope.forward", 1040, 3960),
        _event("geomscope.forward", 10040, 13960),
        _event("geomscope.pad", 40, 460),
        _event("geomscope.upload", 640, 760),  # the second upload was not recorded
        _event("geomscope.append", 0, 99999),  # (the store thread: not recorded by default anyway)
        _event("geomscope.forward", 1040, 4040, "CUDA", is_user_annotation=True),
    ]
    clock = pe.clock_offset(events, timeline, "MainThread")
    assert clock["pairs"] == 3 and clock["offset_s"] == pytest.approx(100.0, abs=1e-9)
    assert clock["spread_us"] < 1e-3
    with pytest.raises(RuntimeError, match="none of the main thread's stages"):
        pe.clock_offset([], timeline, "MainThread")


# ---------------------------------------------------------------- a profiled extract on the CPU
@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_model("bert", tmp_path_factory.mktemp("profile"))


def _rows(run_dir: Path) -> np.ndarray:
    from geomscope.store import Run, iter_shard

    run = Run(run_dir)
    chunks = [c for s in run.shards for c in iter_shard(run.shard_path(s))]
    return np.concatenate([c.layers[name] for c in chunks for name in sorted(c.layers)])


def test_profiled_extract_times_every_stage_where_it_runs(tiny_bert, tmp_path, monkeypatch):
    from bench_extract import make_corpus

    from geomscope.extract import capture
    from geomscope.extract.capture import Capture
    from geomscope.extract.run import extract
    from geomscope.model.load import load_model

    lm = load_model(str(tiny_bert), device="cpu")
    corpus = make_corpus(120, tmp_path / "corpus.txt")
    options = {"layers": "all", "shard_docs": 40, "batch_tokens": 256, "store_dtype": "float16"}
    launch = Capture.__dict__["launch"]
    padded = []  # per batch: whether it has padding (then its mask is uploaded too)
    pad_right = capture.pad_right

    def noting_padding(*args, **kwargs):
        ids, mask = pad_right(*args, **kwargs)
        padded.append(not mask.all())
        return ids, mask

    monkeypatch.setattr(capture, "pad_right", noting_padding)
    report = pe.profile_call(lm, corpus, tmp_path / "run", options)

    assert Capture.__dict__["launch"] is launch  # the wrappers are gone
    threads, main = report["threads"], report["main_thread"]
    batches = report["batches"]
    assert batches > 3 and report["shards"] == 3
    assert len(padded) == batches and any(padded)
    # ids and the rows kept, and the mask of a batch with padding
    assert threads[main]["upload"]["calls"] == 2 * batches + sum(padded)
    for stage in ("launch", "forward", "pad", "cast and gather", "row metadata", "hand over"):
        assert threads[main][stage]["calls"] == batches, stage
    store = [t for t in threads if "append" in threads[t]]
    assert len(store) == 1 and store[0] != main  # the appends run on the store thread
    assert threads[store[0]]["append"]["calls"] == batches
    assert threads[store[0]]["finish shard"]["calls"] == 3
    publisher = [t for t in threads if "publish shard" in threads[t]]
    assert publisher and main not in publisher
    assert sum(threads[t]["publish shard"]["calls"] for t in publisher) == 3
    # the main thread's self times (its loop included) add up to the call
    assert sum(s["self_s"] for s in threads[main].values()) == pytest.approx(report["wall_s"], rel=1e-6)
    assert all(s["self_s"] >= -1e-9 for th in threads.values() for s in th.values())
    assert "gpu" not in report  # no profiler on the CPU

    extract(lm, [corpus], tmp_path / "plain", **options)
    np.testing.assert_array_equal(_rows(tmp_path / "run"), _rows(tmp_path / "plain"))
    text = pe.markdown(report)
    assert f"{batches} batches" in text and "| append |" in text


def test_profiled_branch_runs_on_the_cpu(tiny_bert, tmp_path):
    """The GPU branch's code under torch.profiler with CPU activity only: the clocks are aligned on
    the main thread's stage calls, no GPU work is said as such, and the trace is written."""
    from bench_extract import make_corpus

    from geomscope.model.load import load_model

    lm = load_model(str(tiny_bert), device="cpu")
    corpus = make_corpus(60, tmp_path / "corpus.txt")
    options = {"layers": "all", "shard_docs": 30, "batch_tokens": 256, "store_dtype": "float16"}
    trace = tmp_path / "trace.json"
    report = pe.profile_call(lm, corpus, tmp_path / "run", options, trace, profiled=True)
    gpu = report["gpu"]
    assert gpu["kernels"] == 0 and "no GPU work" in gpu["error"]
    assert report["trace"] == str(trace) and "geomscope.forward" in trace.read_text()
    # every main-thread stage call is a profiler range: as many pairs as the main thread's records
    main = report["main_thread"]
    assert gpu["clock"]["pairs"] == sum(
        s["calls"] for k, s in report["threads"][main].items() if k != pe.LOOP
    )
    assert "GPU: torch.profiler recorded no GPU work" in pe.markdown(report)
    bad = pe.profile_call(
        lm, corpus, tmp_path / "run", options, tmp_path / "no" / "dir" / "t.json", profiled=True
    )
    assert bad["trace"].startswith("not written") and bad["rows"] == report["rows"]


def test_script_with_the_forward_stubbed(tiny_bert, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["--model", str(tiny_bert), "--device", "cpu", "--sentences", "60", "--shard-docs", "30"]
    args += ["--batch-tokens", "256", "--stub-forward", "--repeats", "2", "--workdir", str(tmp_path)]
    report = pe.main([*args, "--json", str(out)])
    main = report["main_thread"]
    assert report["threads"][main]["forward"]["calls"] == report["batches"] > 1
    assert json.loads(out.read_text())["rows"] == report["rows"] > 0
    assert "| forward |" in capsys.readouterr().out
