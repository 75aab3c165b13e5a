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
    assert got["per_batch_ms"] == {"busy": 3000.0, "idle": 2000.0}
    report = {"wall_s": 10.0, "rows": 5, "batches": 2, "shards": 1, "main_thread": "MainThread"}
    report |= {"threads": timeline.by_thread(), "gpu": got, "wall_s_without_profiler": 9.0}
    text = pe.markdown(report)
    assert "| wait for rows | 1.000 | 500.00 |" in text and "without torch.profiler: 9.000 s" in text


# ---------------------------------------------------------------- a profiled extract on the CPU
@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_model("bert", tmp_path_factory.mktemp("profile"))


def _rows(run_dir: Path) -> np.ndarray:
    from geomscope.store import Run, iter_shard

    run = Run(run_dir)
    chunks = [c for s in run.shards for c in iter_shard(run.shard_path(s))]
    return np.concatenate([c.layers[name] for c in chunks for name in sorted(c.layers)])


def test_profiled_extract_times_every_stage_where_it_runs(tiny_bert, tmp_path):
    from bench_extract import make_corpus

    from geomscope.extract.capture import Capture
    from geomscope.extract.models import load_model
    from geomscope.extract.run import extract

    lm = load_model(str(tiny_bert), device="cpu")
    corpus = make_corpus(120, tmp_path / "corpus.txt")
    options = {"layers": "all", "shard_docs": 40, "batch_tokens": 256, "store_dtype": "float16"}
    launch = Capture.__dict__["launch"]

    report = pe.profile_call(lm, corpus, tmp_path / "run", options)

    assert Capture.__dict__["launch"] is launch  # the wrappers are gone
    threads, main = report["threads"], report["main_thread"]
    batches = report["batches"]
    assert batches > 3 and report["shards"] == 3
    assert threads[main]["upload"]["calls"] == 3 * batches  # ids, mask and the rows kept
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


def test_script_with_the_forward_stubbed(tiny_bert, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["--model", str(tiny_bert), "--device", "cpu", "--sentences", "60", "--shard-docs", "30"]
    args += ["--batch-tokens", "256", "--stub-forward", "--repeats", "2", "--workdir", str(tmp_path)]
    report = pe.main([*args, "--json", str(out)])
    main = report["main_thread"]
    assert report["threads"][main]["forward"]["calls"] == report["batches"] > 1
    assert json.loads(out.read_text())["rows"] == report["rows"] > 0
    assert "| forward |" in capsys.readouterr().out
