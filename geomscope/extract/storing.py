"""The store thread: extract's HDF5 appends and shard publishing run beside the forward passes.

Storing a batch (the NaN/Inf check, chunk-aligned HDF5 appends: ~40 ms for 8,192 MiniLM tokens)
and publishing a shard (final flush, fsync, rename, checksums of the file, the manifest's atomic
update: ~0.15 s for 500 sentences) on the main thread between forwards would be time in which no
forward runs -- and an fsync is a wait, not work.  One background thread does them while the main
thread tokenizes and runs the next batch, which brings extract's tokens/s a few percent closer to
a plain forward's on one torch thread; with more torch threads than free cores the store thread
competes for the cores and the gain shrinks.

Publishing a shard has two parts. Its final flush and the closing of its HDF5 file run on the
store thread, and its checksums (a read of the whole file) start then, in a pool shared by the
process's shards (``store/shard.py``); its fsync, rename and manifest update run on a second,
publisher thread, which waits for those checksums, so the store thread goes on appending the next
shard's rows meanwhile, and consecutive shards are hashed side by side.
On a GPU the forward is not what limits extraction: with every layer of MiniLM stored, appending
and publishing each take close to half of the run, which is why they overlap.

Nothing about the run changes: ONE thread does every append, in the order they were submitted,
so a shard's rows are appended in the order they were captured; a shard's file is complete before
its publishing is queued, and ONE publisher publishes the shards in the order they were completed
-- the shard files are byte for byte the ones the main thread alone would have written, and a
crash leaves at most temporary files the next run deletes (a shard whose publishing was still
queued is redone).

Memory: extract waits for the store thread to be idle before it hands over the next batch
(storing a batch takes a small part of a forward, so it rarely waits), so at most one batch's rows
are held besides the one being captured: about 30 MiB more peak RSS for MiniLM (~715 vs ~685
MiB).  It stays flat with the text: the same sentences ten times over peak within about 1.07x of
the single pass.  Ten times as many *different* sentences peak higher, as the forward alone does:
that text holds larger batches (the largest one's attention, batch x length^2, grows with the
longest sentence).  Holding the waiting rows outside the heap (two anonymous maps taking turns,
the rows gathered straight into them) gives no flatter a peak, and a higher one.  The queue itself
holds at most :data:`DEPTH` jobs.

Errors: the first failure of a store job or a publishing is raised in the main thread (its own
exception) at the next submit or wait, or at :meth:`StoreThread.drain`. After it every later store
job is skipped; the publishings go on until one fails (a shard whose rows were all written is
published even when a later shard's append failed, so that resume keeps it). The shard writer of a
failed or skipped job is aborted (its temporary file removed) -- a published shard is never touched.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

#: jobs that may wait in the store thread's queue (a job holds at most one batch's rows)
DEPTH = 1
#: how often a waiting caller checks that the store thread is still alive (seconds)
_POLL_S = 0.1


class StoreThread:
    """``submit(writer, job)`` runs ``job()`` in the background, after every job submitted before it;
    a job that returns a callable (a shard's publishing) has it run on the publisher thread, after
    every publishing queued before it, while the store thread goes on with the next job;
    ``drain()`` waits for all of them and ends both threads (see the module docstring)."""

    def __init__(self, depth: int = DEPTH):
        self._jobs: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._publishing: queue.Queue = queue.Queue()  # unbounded: a publishing holds no rows
        self._error: BaseException | None = None  # the first failure, of either thread
        self._publish_failed = False  # a publishing failed: the later ones are skipped
        self._error_lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="geomscope-store", daemon=True)
        self._publisher = threading.Thread(target=self._publish_work, name="geomscope-publish", daemon=True)
        self._thread.start()
        self._publisher.start()

    def submit(self, writer, job: Callable[[], Callable[[], None] | None]) -> None:
        """Queue ``job`` (it stores into ``writer``, a ShardWriter, aborted if the job fails or is
        skipped); raises the exception of a job that already failed instead."""
        self._raise_failure()
        while True:
            self._check_alive()
            try:
                self._jobs.put((writer, job), timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def wait_idle(self) -> None:
        """Wait until every job submitted so far has run on the store thread (publishings may still
        be running; the threads go on); raise a failure."""
        with self._jobs.all_tasks_done:
            while self._jobs.unfinished_tasks:
                self._check_alive()
                self._jobs.all_tasks_done.wait(_POLL_S)
        self._raise_failure()

    def drain(self) -> None:
        """Wait until every submitted job and publishing has run, end the threads, raise the first
        failure."""
        if self._thread.is_alive():
            self._jobs.put(None)  # the thread takes every job, whatever happens to them: never blocks long
            self._thread.join()
        if self._publisher.is_alive():  # after the store thread: it queues no more publishings
            self._publishing.put(None)
            self._publisher.join()
        self._raise_failure()
        if not self._publishing.empty():  # cannot happen while _run catches everything; never silent
            raise RuntimeError("the publisher thread ended with shards left unpublished")

    def drain_quietly(self) -> None:
        """:meth:`drain` for a caller that is already raising its own exception (which goes on); a
        second Ctrl-C while waiting goes on too (then the thread may still run: nothing is aborted)."""
        try:
            self.drain()
        except Exception:
            pass

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the store thread has ended; no more jobs can run")

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self, writer, job, publishing: bool = False) -> object:
        """Run one job unless it must be skipped; a failed or skipped job's writer is aborted.

        A store job is skipped after any failure. A publishing is skipped only after a failed
        publishing: a shard whose rows were all written is published even when a later shard's
        append failed (a full disk), so that resume keeps it."""
        skip = self._publish_failed if publishing else self._error is not None
        if not skip:
            try:
                return job()
            except BaseException as e:  # handed to the main thread; the first failure is the one raised
                with self._error_lock:
                    if self._error is None:
                        self._error = e
                    self._publish_failed |= publishing
        try:
            writer.abort()
        except Exception:  # the first failure is the one to report; the next run cleans up
            pass
        return None

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                then = self._run(*item)
                if callable(then):
                    self._publishing.put((item[0], then))
            finally:
                # the job (one batch's rows, a shard's keeper) is freed before it counts as done
                item = then = None
                self._jobs.task_done()

    def _publish_work(self) -> None:
        while True:
            item = self._publishing.get()
            if item is None:
                return
            self._run(*item, publishing=True)
            item = None
