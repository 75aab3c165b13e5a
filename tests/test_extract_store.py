"""extract's store thread (extract/storing.py): batches are appended and shards published in one
background thread, in order, while the next forward runs. The shard files are the ones a synchronous
store writes, byte for byte; a failure of the store surfaces in the caller with its own exception, removes
the unfinished shard's temporary file and leaves the published shards resumable; a failure of the
main thread still publishes what was captured before it."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest
from helpers_models import SAMPLE_TEXTS, make_tiny_model

import geomscope.extract.shards as shards_mod
import geomscope.extract.storing as storing
from geomscope.extract import capture as cap
from geomscope.extract.run import extract
from geomscope.model.load import load_model
from geomscope.store import Run, iter_shard
from geomscope.store.shard import ShardWriter

TEXTS = [t for t in SAMPLE_TEXTS if t.strip()] * 3  # several shards of several batches


class FakeWriter:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


class SyncStore:
    """The store thread's interface, every job run at once in the caller: the synchronous store."""

    def __init__(self, depth=1):
        pass

    def submit(self, writer, job):
        try:
            then = job()
            if callable(then):  # a shard's publishing
                then()
        except BaseException:
            writer.abort()
            raise

    def wait_idle(self):
        pass

    drain = drain_quietly = wait_idle


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return load_model(str(make_tiny_model("bert", tmp_path_factory.mktemp("models"))))


@pytest.fixture
def src(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("\n".join(TEXTS) + "\n")
    return p


def stored(run_dir) -> dict[str, np.ndarray]:
    run = Run(run_dir)
    parts = [ch for info in run.shards for ch in iter_shard(run.shard_path(info))]
    out = {k: np.concatenate([getattr(c, k) for c in parts]) for k in ("token_id", "doc_id", "position")}
    return out | {"L:" + n: np.concatenate([c.layers[n] for c in parts]) for n in run.layer_names}


def assert_same_rows(a_dir, b_dir):
    a, b = stored(a_dir), stored(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def no_temp_files(run_dir) -> bool:
    return not list(run_dir.glob(".*.tmp"))


def store_threads() -> list:
    """Store and publisher threads still running: none once extract has returned or raised."""
    names = ("geomscope-store", "geomscope-publish")
    return [t for t in threading.enumerate() if t.name in names and t.is_alive()]


KW = {"shard_docs": 4, "batch_tokens": 48}


# ------------------------------------------------------------------------------ the thread itself
def test_jobs_run_in_order_in_one_background_thread():
    store = storing.StoreThread()
    seen, threads = [], set()

    def job(i):
        time.sleep(0.002 * (i % 3))  # uneven jobs: order must not follow duration
        seen.append(i)
        threads.add(threading.get_ident())

    for i in range(20):
        store.submit(FakeWriter(), lambda i=i: job(i))
    store.wait_idle()
    assert seen == list(range(20))
    store.drain()
    assert threads and threading.get_ident() not in threads and len(threads) == 1
    with pytest.raises(RuntimeError, match="ended"):
        store.submit(FakeWriter(), lambda: None)


def test_at_most_one_batch_waits_besides_the_one_being_stored():
    store = storing.StoreThread(depth=1)
    gate, waiting = threading.Event(), []
    store.submit(FakeWriter(), gate.wait)  # the thread is busy until the gate opens
    store.submit(FakeWriter(), lambda: None)  # queued

    def third():
        store.submit(FakeWriter(), lambda: None)
        waiting.append("submitted")

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.2)
    assert waiting == []  # blocked: the queue holds one job already
    gate.set()
    t.join(5)
    assert waiting == ["submitted"]
    store.drain()


def test_a_failure_surfaces_once_later_jobs_skipped_and_their_writers_aborted():
    store = storing.StoreThread()
    ran, writers = [], [FakeWriter() for _ in range(4)]
    gate = threading.Event()
    store.submit(writers[0], gate.wait)

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")

    store.submit(writers[1], fail)
    gate.set()
    with pytest.raises(OSError, match="No space"):
        for w in writers[2:]:
            store.submit(w, lambda: ran.append(1))
            store.wait_idle()
    with pytest.raises(OSError, match="No space"):
        store.drain()
    store.drain_quietly()  # a caller already raising: nothing more
    assert ran == []
    assert writers[0].aborted == 0 and writers[1].aborted == 1
    assert all(w.aborted <= 1 for w in writers[2:])


def test_publishings_run_in_order_beside_the_next_jobs():
    """A job's returned callable (a shard's publishing) runs on the publisher thread, in order; the
    store thread goes on with the next jobs meanwhile, and drain waits for every publishing."""
    store = storing.StoreThread()
    gate, log, threads = threading.Event(), [], {}

    def job(i):
        log.append(f"job{i}")
        threads.setdefault("store", threading.get_ident())

        def publish():
            if i == 0:
                gate.wait(5)  # the first publishing is slow: the store thread must not wait for it
            log.append(f"pub{i}")
            threads.setdefault("publish", threading.get_ident())

        return publish

    for i in range(3):
        store.submit(FakeWriter(), lambda i=i: job(i))
    store.wait_idle()  # every job ran while the first publishing still waits
    assert log == ["job0", "job1", "job2"]
    gate.set()
    store.drain()
    assert log[3:] == ["pub0", "pub1", "pub2"]
    assert threads["store"] != threads["publish"] and threading.get_ident() not in threads.values()
    assert store_threads() == []


def test_a_publishing_failure_surfaces_and_later_ones_are_skipped_and_aborted():
    store = storing.StoreThread()
    writers, published, gate = [FakeWriter() for _ in range(2)], [], threading.Event()

    def fail():
        gate.wait(5)  # not before both jobs are submitted
        raise OSError(errno.EIO, "Input/output error")

    store.submit(writers[0], lambda: fail)
    store.submit(writers[1], lambda: lambda: published.append(1))
    gate.set()
    with pytest.raises(OSError, match="Input/output"):  # surfaces at a wait once it happened
        for _ in range(250):
            store.wait_idle()
            time.sleep(0.02)
    with pytest.raises(OSError, match="Input/output"):
        store.submit(FakeWriter(), lambda: None)  # and at the next submit
    with pytest.raises(OSError, match="Input/output"):
        store.drain()
    assert published == [] and writers[0].aborted == 1 and writers[1].aborted == 1


def test_a_finished_shard_is_published_though_a_later_append_failed():
    """A full disk while shard k+1 is appended: shard k, whose rows were all written, is still
    published (resume keeps it); the later store jobs are skipped."""
    store = storing.StoreThread()
    gate, published, later = threading.Event(), [], []
    shard_k, shard_k1 = FakeWriter(), FakeWriter()

    def publish_k():
        gate.wait(5)  # still queued when the next shard's append fails
        published.append("k")

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    store.submit(shard_k, lambda: publish_k)
    store.submit(shard_k1, full_disk)
    with pytest.raises(OSError, match="No space"):
        store.wait_idle()
    with pytest.raises(OSError, match="No space"):
        store.submit(shard_k1, lambda: later.append(1))
    gate.set()
    with pytest.raises(OSError, match="No space"):
        store.drain()
    assert published == ["k"] and shard_k.aborted == 0 and shard_k1.aborted == 1 and later == []


# ------------------------------------------------------------------------------ inside extract
def test_rows_equal_a_synchronous_store(bert, src, tmp_path, monkeypatch):
    a = extract(bert, [src], tmp_path / "thread", **KW)
    assert store_threads() == []
    monkeypatch.setattr(shards_mod, "StoreThread", SyncStore)
    b = extract(bert, [src], tmp_path / "sync", **KW)
    assert a["shards_written"] == b["shards_written"] >= 3 and a["rows"] == b["rows"]
    assert_same_rows(tmp_path / "thread", tmp_path / "sync")
    # the shard files themselves are byte for byte the synchronous store's
    sha = [[s["sha256"] for s in Run(d).manifest["shards"]] for d in (tmp_path / "thread", tmp_path / "sync")]
    assert sha[0] == sha[1]


def test_a_store_failure_is_raised_and_the_run_resumes(bert, src, tmp_path, monkeypatch):
    extract(bert, [src], tmp_path / "clean", **KW)
    real, calls = ShardWriter.append, {"n": 0}

    def full_disk(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 7:  # inside the second or a later shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(ShardWriter, "append", full_disk)
    with pytest.raises(OSError, match="No space left"):
        extract(bert, [src], tmp_path / "run", **KW)
    assert store_threads() == []
    monkeypatch.setattr(ShardWriter, "append", real)
    partial = Run(tmp_path / "run")
    assert not partial.complete and 0 < len(partial.shards) < partial.manifest["planned_shards"]
    assert no_temp_files(tmp_path / "run")  # the failed shard's temporary file is gone
    for info in partial.shards:  # what was published is whole: its checksum holds
        assert (tmp_path / "run" / info.file).is_file()
    s = extract(bert, [src], tmp_path / "run", **KW)
    assert s["shards_resumed"] == len(partial.shards) and Run(tmp_path / "run").complete
    assert_same_rows(tmp_path / "clean", tmp_path / "run")


def test_a_failure_in_the_forward_still_publishes_the_shard_before_it(bert, src, tmp_path, monkeypatch):
    real, calls = cap.Capture.launch, {"n": 0}

    def count(self, docs):
        calls["n"] += 1
        return real(self, docs)

    monkeypatch.setattr(cap.Capture, "launch", count)
    first = extract(bert, [src], tmp_path / "count", **KW)
    assert first["shards_written"] >= 3
    n_fail = calls["n"] // 2 + 1  # a batch well inside the run
    calls["n"] = 0

    def flaky(self, docs):
        calls["n"] += 1
        if calls["n"] == n_fail:
            raise KeyboardInterrupt
        return real(self, docs)

    write, handed_over = shards_mod.ShardRun._write, []

    def counted_write(self, k, group, prog, *rest):
        out = write(self, k, group, prog, *rest)
        handed_over.append(k)  # all of shard k's batches ran; its publishing is queued
        return out

    monkeypatch.setattr(cap.Capture, "launch", flaky)
    monkeypatch.setattr(shards_mod.ShardRun, "_write", counted_write)
    with pytest.raises(KeyboardInterrupt):
        extract(bert, [src], tmp_path / "run", **KW)
    assert store_threads() == []  # nothing goes on writing after extract raised
    monkeypatch.setattr(cap.Capture, "launch", real)
    partial = Run(tmp_path / "run")
    # every shard whose batches all ran before the failure is published, the last one's publishing
    # still queued when the failure came among them
    assert handed_over and [i.index for i in partial.shards] == handed_over
    assert no_temp_files(tmp_path / "run")
    s = extract(bert, [src], tmp_path / "run", **KW)
    assert s["shards_resumed"] == len(partial.shards)
    assert_same_rows(tmp_path / "count", tmp_path / "run")


def test_a_writer_whose_abort_fails_does_not_stop_the_thread():
    """A failed append whose clean-up fails too (read-only disk): the first failure is raised; the
    thread lives on, so nobody waits for ever."""

    class BadAbort(FakeWriter):
        def abort(self):
            super().abort()
            raise OSError(errno.EROFS, "Read-only file system")

    store = storing.StoreThread()
    w = BadAbort()

    def fail():
        raise OSError(errno.EIO, "Input/output error")

    store.submit(w, fail)
    store.submit(w, lambda: None)  # skipped: abort fails again
    with pytest.raises(OSError, match="Input/output"):
        store.wait_idle()
    assert w.aborted == 2 and store._thread.is_alive()
    with pytest.raises(OSError, match="Input/output"):
        store.drain()


def test_waiting_on_a_thread_that_ended_raises_instead_of_hanging():
    store = storing.StoreThread()
    store.drain()
    store._jobs.put((FakeWriter(), lambda: None))  # a job nobody will take
    with pytest.raises(RuntimeError, match="ended"):
        store.wait_idle()
    with pytest.raises(RuntimeError, match="ended"):
        store.submit(FakeWriter(), lambda: None)  # the queue is full: would block for ever


def test_at_most_one_stored_batch_alive_when_the_heap_is_measured(bert, src, tmp_path, monkeypatch):
    """The rows of every batch but the one just captured are freed (the store thread drops a job
    before it counts as done) when extract measures the heap."""
    import gc
    import weakref

    real, alive, seen = cap.Capture.launch, [], []

    def tracked(self, docs):
        captured = real(self, docs)
        arrays, _ = captured.value
        alive.append([weakref.ref(a) for a in arrays.values()])
        return captured

    def measure(self):
        gc.collect()
        seen.append(sum(any(r() is not None for r in refs) for refs in alive))

    monkeypatch.setattr(cap.Capture, "launch", tracked)
    monkeypatch.setattr(cap.HeapTrim, "batch_done", measure)
    extract(bert, [src], tmp_path / "run", **KW)
    assert len(seen) > 10 and max(seen) == 1


def test_one_sample_keeper_at_a_time(bert, src, tmp_path, monkeypatch):
    """--keep sample: a shard's keeper (device accumulators of every layer) is published and freed
    before the next shard's is made."""
    import gc
    import weakref

    from geomscope.extract import keep

    made, alive_at_start = weakref.WeakSet(), []
    init = keep.SampleKeeper.__init__

    def tracked(self, *a, **k):
        gc.collect()
        alive_at_start.append(len(made))
        init(self, *a, **k)
        made.add(self)

    monkeypatch.setattr(keep.SampleKeeper, "__init__", tracked)
    s = extract(bert, [src], tmp_path / "run", keep="sample:8", **KW)
    assert s["shards_written"] >= 3 and alive_at_start == [0] * s["shards_written"]


# ------------------------------------------------------------------------------ tokenizing ahead
def _tokenize_threads(monkeypatch) -> list[tuple[int, str]]:
    """(first doc id, thread name) of every tokenize call extract makes."""
    real, seen, inside, lock = shards_mod.tokenize, [], [0], threading.Lock()

    def spy(tok, group, max_length):
        seen.append((group[0][0], threading.current_thread().name))
        with lock:
            inside[0] += 1
            assert inside[0] == 1, "two threads in the tokenizer at once"
        try:
            time.sleep(0.01)  # widen the window an overlap would need
            return real(tok, group, max_length)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(shards_mod, "tokenize", spy)
    return seen


def test_the_next_shard_is_tokenized_in_a_thread_with_the_same_rows(bert, src, tmp_path, monkeypatch):
    monkeypatch.setattr(shards_mod, "StoreThread", SyncStore)
    ref = extract(bert, [src], tmp_path / "ref", **KW, max_tokens=10**9)  # --max-tokens: nothing ahead
    seen = _tokenize_threads(monkeypatch)
    s = extract(bert, [src], tmp_path / "ahead", **KW)
    assert s["shards_written"] == ref["shards_written"] >= 3 and s["rows"] == ref["rows"]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # each shard once, in order
    assert seen[0][1] == "MainThread"
    assert all(name.startswith("geomscope-tokenize") for _, name in seen[1:])
    assert_same_rows(tmp_path / "ref", tmp_path / "ahead")
    assert not [t for t in threading.enumerate() if t.name.startswith("geomscope-tokenize")]
    seen.clear()
    extract(bert, [src], tmp_path / "budget", **KW, max_tokens=10**9)
    assert {name for _, name in seen} == {"MainThread"}


def test_lookahead_gives_the_item_depth_places_on():
    items = list(range(7))
    assert list(shards_mod._lookahead(items)) == [(i, i + 1 if i < 6 else None) for i in items]
    assert list(shards_mod._lookahead(items, depth=3)) == [(i, i + 3 if i < 4 else None) for i in items]
    assert list(shards_mod._lookahead([], depth=2)) == []
    assert list(shards_mod._lookahead([5], depth=2)) == [(5, None)]


def test_a_process_of_several_tokenizes_its_own_next_shard_ahead(bert, src, tmp_path, monkeypatch):
    # process 1 of 2 writes shards 1, 3, 5...: the one read ahead is two places on, never the
    # other process's (which it would have tokenized for nothing)
    monkeypatch.setattr(shards_mod, "StoreThread", SyncStore)
    init = shards_mod.ShardRun.__init__

    def second_of_two(self, *a, **k):
        init(self, *a, **k)
        self.rank, self.world = 1, 2

    monkeypatch.setattr(shards_mod.ShardRun, "__init__", second_of_two)
    seen = _tokenize_threads(monkeypatch)
    s = extract(bert, [src], tmp_path / "odd", **KW)
    planned = Run(tmp_path / "odd").manifest["planned_shards"]
    ours = [k * KW["shard_docs"] for k in range(1, planned, 2)]
    assert s["shards_written"] == len(ours) >= 2
    assert [d for d, _ in seen] == ours
    assert seen[0][1] == "MainThread"
    assert all(name.startswith("geomscope-tokenize") for _, name in seen[1:])


def test_a_tokenizer_failure_ahead_is_one_line_and_the_shards_before_it_stay(
    bert, src, tmp_path, monkeypatch
):
    real = shards_mod.tokenize

    def fails_on_the_third_shard(tok, group, max_length):
        if group[0][0] >= 2 * KW["shard_docs"]:
            raise RuntimeError("Already borrowed")
        return real(tok, group, max_length)

    monkeypatch.setattr(shards_mod, "tokenize", fails_on_the_third_shard)
    with pytest.raises(
        shards_mod.InputError, match=r"failed on documents 8\.\.11 \(RuntimeError: Already borrowed\)"
    ):
        extract(bert, [src], tmp_path / "run", **KW)
    assert store_threads() == []
    assert [i.index for i in Run(tmp_path / "run").shards] == [0, 1]
    monkeypatch.setattr(shards_mod, "tokenize", real)
    s = extract(bert, [src], tmp_path / "run", **KW)
    assert s["shards_resumed"] == 2 and Run(tmp_path / "run").complete
