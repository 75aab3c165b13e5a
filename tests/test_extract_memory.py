"""Host memory of extract: the heap is trimmed (capture.trim_heap) at every shard boundary and after
a batch that left the resident set more than BATCH_SLACK above the last trim's (capture.HeapTrim);
the trims change no stored row; off glibc the trim is a no-op."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from helpers_models import SAMPLE_TEXTS, make_tiny_model

import geomscope.extract.capture as capture
from geomscope.extract.run import extract
from geomscope.model.load import load_model
from geomscope.store import Run, iter_shard

TEXTS = [t for t in SAMPLE_TEXTS if t.strip()] * 3  # enough documents for several shards


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: load_model(str(make_tiny_model(k, root))) for k in ("bert", "gpt2")}


def stored(run_dir) -> dict[str, np.ndarray]:
    """Every stored array of a run, in stored order (compared bitwise)."""
    run = Run(run_dir)
    parts = [ch for info in run.shards for ch in iter_shard(run.shard_path(info))]
    out = {k: np.concatenate([getattr(c, k) for c in parts]) for k in ("token_id", "doc_id", "position")}
    out |= {"L:" + n: np.concatenate([c.layers[n] for c in parts]) for n in run.layer_names}
    return out


def count_trims(monkeypatch, real: bool) -> list[int]:
    calls: list[int] = []
    trim_heap = capture.trim_heap

    def trim():
        calls.append(1)
        if real:
            trim_heap()

    monkeypatch.setattr(capture, "trim_heap", trim)
    return calls


def count_batches(monkeypatch) -> list[int]:
    calls: list[int] = []
    call = capture.Capture.launch

    def counted(self, docs):
        calls.append(len(docs))
        return call(self, docs)

    monkeypatch.setattr(capture.Capture, "launch", counted)
    return calls


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_trim_once_per_written_shard_and_rows_unchanged(models, kind, tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    shard_docs = 4
    n_shards = -(-len(TEXTS) // shard_docs)
    monkeypatch.setattr(capture, "BATCH_SLACK", float("inf"))  # shard boundaries only
    calls = count_trims(monkeypatch, real=True)
    extract(models[kind], [src], tmp_path / "trim", shard_docs=shard_docs, batch_tokens=64)
    assert len(calls) == n_shards
    count_trims(monkeypatch, real=False)  # the trim replaced by nothing: the rows before this change
    extract(models[kind], [src], tmp_path / "plain", shard_docs=shard_docs, batch_tokens=64)
    a, b = stored(tmp_path / "trim"), stored(tmp_path / "plain")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_trim_after_every_spreading_batch_keeps_rows(models, kind, tmp_path, monkeypatch):
    """A slack below zero makes every batch "spread the heap": a trim follows each batch (after its
    rows are appended) and each shard, and the stored rows are those of a run that never trims."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    shard_docs = 4
    n_shards = -(-len(TEXTS) // shard_docs)
    monkeypatch.setattr(capture, "BATCH_SLACK", -1.0)
    batches = count_batches(monkeypatch)
    calls = count_trims(monkeypatch, real=True)
    extract(models[kind], [src], tmp_path / "every", shard_docs=shard_docs, batch_tokens=32)
    assert len(batches) > n_shards  # several batches per shard, so the batch trims are seen
    # the first batch of the run only records where the heap stands
    assert len(calls) == n_shards + len(batches) - 1
    count_trims(monkeypatch, real=False)
    extract(models[kind], [src], tmp_path / "never", shard_docs=shard_docs, batch_tokens=32)
    a, b = stored(tmp_path / "every"), stored(tmp_path / "never")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_heap_trim_policy(monkeypatch):
    """Trim at every shard end; after a batch only when the resident set rose more than the slack
    above the footprint the last trim left (the first batch only sets that footprint)."""
    rss = iter([1000, 1100, 1300, 1000, 1200, 1260, 1000, 900])
    monkeypatch.setattr(capture, "resident_bytes", lambda: next(rss))
    calls = count_trims(monkeypatch, real=False)
    h = capture.HeapTrim(slack=0.25)
    h.batch_done()  # 1000: the footprint
    h.batch_done()  # 1100: within 1.25 x 1000
    assert calls == [] and h.base == 1000
    h.batch_done()  # 1300 > 1250: trim, then 1000 is the footprint
    assert len(calls) == 1 and h.base == 1000
    h.batch_done()  # 1200: within
    h.batch_done()  # 1260 > 1250: trim
    assert len(calls) == 2 and h.base == 1000
    h.shard_done()  # always, whatever the heap
    assert len(calls) == 3 and h.base == 900 and h.trims == 3


def test_heap_trim_without_proc(monkeypatch):
    """Where the resident set cannot be read, batches never trim; shard ends still do."""
    monkeypatch.setattr(capture, "resident_bytes", lambda: None)
    calls = count_trims(monkeypatch, real=False)
    h = capture.HeapTrim(slack=-1.0)
    for _ in range(3):
        h.batch_done()
    assert calls == []
    h.shard_done()
    assert len(calls) == 1


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/statm")
def test_resident_bytes_follows_touched_memory():
    before = capture.resident_bytes()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page written
    during = capture.resident_bytes()
    assert before is not None and during is not None
    assert during - before >= 48 << 20, (before, during)
    del block


def test_resumed_shards_are_not_trimmed(models, tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    extract(models["bert"], [src], tmp_path / "run", shard_docs=4)
    calls = count_trims(monkeypatch, real=False)
    s = extract(models["bert"], [src], tmp_path / "run", shard_docs=4)
    assert s["shards_resumed"] == s["shards"] and calls == []


def test_trim_is_a_no_op_off_glibc(monkeypatch):
    monkeypatch.setattr(capture, "_libc", False)
    monkeypatch.setattr(capture.sys, "platform", "darwin")
    assert capture._glibc() is None
    capture.trim_heap()  # nothing to call, nothing raised
    assert capture._libc is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_trim_is_found_and_runs(monkeypatch):
    monkeypatch.setattr(capture, "_libc", False)
    lib = capture._glibc()
    assert lib is not None and hasattr(lib, "malloc_trim")
    assert capture._glibc() is lib  # looked up once
    capture.trim_heap()
