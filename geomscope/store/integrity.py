"""The checks that stand between a run's files and what is read from them.

- A shard file: a regular file of the run (never a link, a FIFO or a device), opened without
  following a link or waiting on a FIFO; its *identity* (machine, device, inode, size, modification
  time) taken when a read is planned and held on every open, so that the bytes checked and the rows
  read come from one file; its size and checksum against its manifest entry (:func:`verify_shard`,
  and :func:`check_shard_file`, which hashes in a background thread while the shard is streamed).
- The manifest against itself (:func:`manifest_problems`): every shard listed once, every document
  in one shard, totals that are the sums of the entries. ``score``, ``export`` and
  ``inspect --verify`` all ask these questions here.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from geomscope.errors import DataError, first_line
from geomscope.store import checksum as shard_checksum
from geomscope.store import remote
from geomscope.store.blocks import Task
from geomscope.store.names import shard_name
from geomscope.store.shard import ShardInfo


def corrupt(path, why: str) -> DataError:
    """The one line for a shard that is not what its manifest entry says (``why``)."""
    return DataError(
        f"shard {path} is corrupt or truncated ({why}); rerun the same `geomscope extract` command to redo it"
    )


def missing(path) -> DataError:
    """The one line for a shard its manifest lists that is not there."""
    return DataError(f"shard {path} is missing; rerun the same `geomscope extract` command to redo it")


def absent(path) -> bool:
    """Whether nothing is at a shard's location: a local path that holds nothing -- a link is there,
    even one that loops or leads nowhere, and :func:`check_regular_file` refuses it as a link, not
    as a missing shard --, or a URL its filesystem does not find."""
    return not remote.exists(path) if remote.is_url(path) else not os.path.lexists(path)


def check_regular_file(path) -> None:
    """A local shard must be a regular file in its run: not a symbolic link (its bytes would come
    from elsewhere, unchecked by where the run lies), a FIFO or a device (a read that blocks or never
    ends). DataError (one line) otherwise. A ``file://`` URL is checked at its local path (it names
    the same file); another URL is left to its filesystem."""
    if remote.is_url(path):
        local = remote.local_path(path)
        if local is None:
            return
        path = local
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError as e:
        raise missing(path) from e
    except OSError as e:
        raise corrupt(path, f"cannot read it: {e}") from e
    if stat.S_ISLNK(mode):
        raise DataError(
            f"shard {path} is a symbolic link; geomscope reads only the files extract wrote into the "
            "run: put the shard itself there"
        )
    if not stat.S_ISREG(mode):
        raise corrupt(path, "not a regular file")


def open_regular(path):
    """A local shard opened for reading (an unbuffered binary file), checked as
    :func:`check_regular_file` checks it but on the open file itself: a link is refused by the open
    (``O_NOFOLLOW``), a FIFO does not block it (``O_NONBLOCK``), and what is not a regular file is
    refused by its ``fstat`` -- nothing can be put in its place between the check and the reads."""
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise missing(path) from e
    except OSError as e:
        check_regular_file(path)  # a link (ELOOP) or what else it is, said as such
        raise corrupt(path, f"cannot read it: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # (before open(): a directory would raise there)
        os.close(fd)
        raise corrupt(path, "not a regular file")
    return open(fd, "rb", buffering=0)  # noqa: SIM115 -- the caller closes it


def identity(path) -> tuple | None:
    """What tells this local file from one put in its place or changed: (this machine's name, device,
    inode, size, modification time in ns). None for a URL, or a path that is not a regular file now
    (the checks before any read say what it is)."""
    if remote.is_url(path):
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return file_identity(st) if stat.S_ISREG(st.st_mode) else None


def file_identity(st: os.stat_result) -> tuple:
    """:func:`identity` of a file's ``os.stat`` / ``os.fstat`` result."""
    return (socket.gethostname(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_same_file(path, fd: int, expected: tuple | None) -> None:
    """DataError unless the open file ``fd`` is the file ``expected`` (:func:`identity`) describes:
    the shard was replaced or changed since, and the bytes checked and the rows read could otherwise
    come from different files. An identity taken on another machine (a Dask worker elsewhere, reading
    a shared filesystem whose device and inode numbers are its own) is not compared."""
    if expected is None:
        return
    now = file_identity(os.fstat(fd))
    if expected[0] == now[0] and tuple(expected) != now:
        raise DataError(
            f"shard {path} was replaced or changed while geomscope read it (another `geomscope extract` "
            "writing into this run?); score it again once that is done"
        )


def verify_shard(path: Path, info: ShardInfo) -> None:
    """Check size and checksum of a shard (a path, or a URL whose bytes are streamed through fsspec)
    against its manifest entry (DataError if they differ)."""
    path = remote.location(path)
    if absent(path):
        raise missing(path)
    check_regular_file(path)
    try:
        size = remote.size(path)
        if size != info.bytes:
            raise corrupt(path, f"{size} bytes on disk, {info.bytes} recorded")
        digest = info.digest
        same = digest is not None and shard_checksum.matches(path, digest)
    except FileNotFoundError as e:
        raise missing(path) from e
    except OSError as e:
        raise corrupt(path, f"cannot read it: {e}") from e
    if not same:
        raise corrupt(path, "checksum differs from the manifest")


def _open_as_planned(p, task):
    """A local shard opened for reading (checked a regular file on the open file: a FIFO or a device
    would block the size check and the hash) and still the file it was when the score was planned;
    None for a URL, after its own checks."""
    if remote.is_url(p):
        check_regular_file(p)
        return None
    opened = open_regular(p)
    try:
        check_same_file(p, opened.fileno(), task.identity)
    except BaseException:
        opened.close()
        raise
    return opened


def check_shard_file(task: Task, *, checksum: bool) -> tuple[Callable[[], None], Task]:
    """Size of a shard against the manifest now; its checksum (``checksum``: ``task.digest``) in a
    background thread while the shard is streamed. Returns ``(finish, task)``: ``finish()`` waits for
    the hash and raises DataError naming the shard if it differs; ``task`` is the task to read,
    holding the identity of the file checked (so the reads must come from it). Missing/short files
    raise at once. ``task.path`` is a path or a URL (its bytes are then streamed through fsspec). A
    local shard is opened once for the size and the hash, and must still be the file of
    ``task.identity`` (the file as planned)."""
    p = remote.location(task.path)
    if absent(p):
        raise missing(p)
    opened = _open_as_planned(p, task)  # None for a URL
    st = None if opened is None else os.fstat(opened.fileno())
    try:
        size = remote.size(p) if st is None else st.st_size
        if task.nbytes >= 0 and size != task.nbytes:
            raise corrupt(p, f"{size} bytes on disk, {task.nbytes} recorded")
        if checksum and task.digest is None:  # a shard task always has one (checked manifest)
            raise DataError(f"shard {p} has no usable checksum in its manifest; rerun `geomscope extract`")
    except BaseException:
        if opened is not None:
            opened.close()
        raise
    if st is not None:
        task = replace(task, identity=file_identity(st))
    if not checksum:
        if opened is not None:
            opened.close()
        return (lambda: None), task
    return _hash_in_background(p, opened, task.digest), task


def _hash_in_background(p, opened, digest: tuple[str, str]) -> Callable[[], None]:
    """Start hashing the shard at ``p`` (``opened``: the file open already, closed here; None: a
    URL, opened here) in a thread; the ``finish()`` that waits for it and raises DataError naming the
    shard when its checksum differs from ``digest`` or it cannot be read."""
    result: dict = {}

    def run() -> None:
        try:
            with opened if opened is not None else remote.open_binary(p) as f:
                result["same"] = shard_checksum.file_matches(f, digest)
        except Exception as e:  # OSError, or whatever a remote filesystem raises
            result["error"] = e

    th = threading.Thread(target=run, daemon=True)
    try:
        th.start()
    except BaseException:  # (no thread: the file it would have closed is closed here)
        if opened is not None:
            opened.close()
        raise

    def finish() -> None:
        th.join()
        if "error" in result or not result.get("same"):
            err = result.get("error")
            why = (
                f"cannot read it: {first_line(err)}"
                if err is not None
                else "checksum differs from the manifest"
            )
            raise corrupt(p, why)

    return finish


def manifest_problems(run) -> list[str]:
    """What makes a run's manifest disagree with itself, from the manifest alone (no shard is read):
    a shard index or file listed twice, two shards claiming the same documents, a complete run with
    a shard missing, a total that is not the sum of its shards, or shards that measured more rows
    than they store in a run that keeps every row (its ``keep`` removed: the samples would be scored
    as whole layers). ``score`` refuses a run with any; ``inspect --verify`` lists them."""
    shards = run.shards
    problems = [
        f"shard {s.index} is recorded as file {s.file}, not {shard_name(s.index)}"
        for s in shards
        if s.file != shard_name(s.index)
    ][:1]
    for what, values in (("index", [s.index for s in shards]), ("file", [s.file for s in shards])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            problems.append(f"shard {what} {twice[0]} is listed more than once")
    documents = coverage(shards, run.complete)
    if documents["problem"]:
        problems.append(documents["problem"])
    totals = run.manifest.get("totals") or {}
    for key, actual in (
        ("rows", sum(s.n_tokens for s in shards)),
        ("rows_stored", sum(s.rows for s in shards)),
        ("docs", sum(s.docs for s in shards)),
        ("shards", len(shards)),
    ):
        if key in totals and totals[key] != actual:
            problems.append(f"totals.{key} is {totals[key]!r}, the shards hold {actual}")
    if run.identity.get("keep") is None:
        sampled = [s.file for s in shards if s.n_tokens != s.rows]
        if sampled:
            problems.append(
                f"shard {sampled[0]} measured more rows than it stores, but the run records no --keep sample"
            )
    return problems


def coverage(shards, complete: bool) -> dict:
    """Each document id in exactly one shard: the shards' document ranges are disjoint and in
    order (only empty records lie between them), each shard's documents lie in its range (checked
    per shard), and a complete run has every shard index from 0 -- whatever the number of processes
    that wrote it."""
    ordered = sorted(shards, key=lambda s: s.index)
    problem = None
    ranged = [s for s in ordered if s.documents is not None]  # (0..0: a shard that records none)
    for a, b in zip(ranged, ranged[1:], strict=False):
        if b.doc_start < a.doc_stop:
            problem = f"shards {a.file} and {b.file} both claim documents {b.doc_start}..{a.doc_stop - 1}"
            break
    indices = [s.index for s in ordered]
    missing = sorted(set(range(max(indices) + 1)) - set(indices)) if indices else []
    if problem is None and complete and missing:
        problem = f"the run is marked complete but shard(s) {missing[:5]} are missing"
    return {
        "shards": len(ordered),
        "docs": sum(s.docs for s in ordered),
        "first_doc": ordered[0].doc_start if ordered else None,
        "last_doc": ordered[-1].doc_stop - 1 if ordered else None,
        "missing_shards": missing,
        "each_document_once": problem is None,
        "problem": problem,
    }
