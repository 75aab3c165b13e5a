"""The checks that stand between a run's files and what is read from them.

- A shard file: a regular file of the run (never a link, a FIFO or a device), opened without
  following a link or waiting on a FIFO; its *identity* (machine, device, inode, size, modification
  time) taken when a read is planned and held on every open, so that the bytes checked and the rows
  read come from one file; its size and checksum against its manifest entry (:func:`verify_shard`,
  and :func:`check_shard_file`, which hashes in a background thread while the shard is streamed).
- A shard's content (:func:`check_shard`, the one notion of a valid shard): its HDF5 structure
  against its task (:func:`check_layout`: shapes fixed before anything is allocated, data stored in
  the shard itself), its rows' documents and non-finite flags as they stream
  (:func:`check_documents`, :func:`check_flags`), and a ``--keep sample`` shard's accumulators and
  sample against the run (counts, seed, size). ``score``, ``export``, ``inspect --verify`` and
  resume (:func:`verify_shard_task`) hold a shard to the same checks.
- The manifest against itself (:func:`manifest_problems`): every shard listed once, every document
  in one shard, totals that are the sums of the entries. ``score``, ``export`` and
  ``inspect --verify`` all ask these questions here.
"""

from __future__ import annotations

import math
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np

from geomscope.errors import DataError, first_line
from geomscope.store import checksum as shard_checksum
from geomscope.store import remote
from geomscope.store.blocks import KeptSample, Task
from geomscope.store.names import SHARD_FORMAT, shard_name
from geomscope.store.sample import POSITION_BITS, STREAM_ID_SAMPLE, row_hash, run_keys
from geomscope.store.shard import META_FIELDS, ShardInfo, nonfinite_rows


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


def check_task_file(task: Task, *, checksum: bool) -> tuple[Callable[[], None], Task]:
    """:func:`check_shard_file` for a run's shard; any other task (an array file, a dataset's file)
    as it is, with nothing to finish."""
    if task.kind != "shard":
        return (lambda: None), task
    return check_shard_file(task, checksum=checksum)


@contextmanager
def checked_reads(task: Task, *, checksum: bool) -> Iterator[Task]:
    """The reads of one task held to :func:`check_task_file`: yields the task to read; when the reads
    fail its checksum is said first, so that a changed file is said as such, not as what reading
    the damage found (a flipped bit read as an Inf, a chunk index pointing nowhere); when they end,
    the checksum is awaited."""
    finish, task = check_task_file(task, checksum=checksum)
    try:
        yield task
    except Exception:
        finish()  # raises the checksum's DataError when the bytes differ
        raise
    finish()


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


# ------------------------------------------------------------------ a shard's HDF5 file, opened
class _StreamedFile(h5py.File):
    """A shard read through a Python file object (a URL opened with fsspec), closed with the file."""

    def __init__(self, fobj, where: str):
        try:
            super().__init__(fobj, "r")
        except BaseException:
            fobj.close()
            raise
        self._fobj = fobj
        self.location = where

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._fobj.close()


def h5_descriptor(f: h5py.File) -> int | None:
    """The file descriptor through which h5py reads a local shard (HDF5's default "sec2" driver);
    None for a URL's file object or another driver (set by ``HDF5_DRIVER``, say)."""
    if f.driver != "sec2":
        return None
    return f.id.get_vfd_handle()


def open_checked(path, expected: tuple | None = None) -> h5py.File:
    """A shard at a location (a Path, or a URL read through fsspec) opened for reading: a regular
    file, a geomscope shard, and a local one, when ``expected`` is given, still that file
    (:func:`check_same_file`). DataError (one line) otherwise."""
    if absent(path):
        raise missing(path)
    check_regular_file(path)
    try:
        if remote.is_url(path):
            f = _StreamedFile(remote.open_binary(path), path)
        else:
            f = h5py.File(path, "r")
    except FileNotFoundError as e:
        raise missing(path) from e
    except OSError as e:
        raise corrupt(path, str(e).split("(")[0].strip() or "cannot open") from e
    try:
        fd = h5_descriptor(f)
        if fd is not None:
            check_same_file(path, fd, expected)
        elif expected is not None and not remote.is_url(path):  # another HDF5 driver: by path
            with open_regular(path) as again:
                check_same_file(path, again.fileno(), expected)
        if f.attrs.get("format") != SHARD_FORMAT or "layers" not in f:
            raise corrupt(path, "not a geomscope shard")
    except BaseException:
        f.close()
        raise
    return f


def h5_reason(e: BaseException) -> str:
    """The first words of what h5py or numpy said, without HDF5's parenthesised detail and quotes."""
    return str(e).split("(")[0].strip().strip("\"'").strip() or type(e).__name__


#: what a damaged or crafted shard's structure makes h5py or numpy raise while it is read
READ_ERRORS = (
    OSError,
    KeyError,
    ValueError,
    TypeError,
    IndexError,
    AttributeError,
    OverflowError,
    RuntimeError,  # h5py, for a name it cannot look up (a NUL in it)
    UnicodeError,  # a name that is no text (a lone surrogate)
)


def _own_dataset(f: h5py.File, key: str, path) -> h5py.Dataset:
    """``f[key]``, a dataset whose data lie in the shard itself: not a link to another file or place,
    not external raw storage, not a virtual dataset (each would read files outside the run, which the
    shard's checksum does not cover)."""
    link = f.get(key, getlink=True)
    if link is None:
        raise corrupt(path, f"no {key}")
    if not isinstance(link, h5py.HardLink):
        raise corrupt(path, f"{key} is a link to another file or place")
    ds = f[key]
    if not isinstance(ds, h5py.Dataset):
        raise corrupt(path, f"{key} is not a dataset")
    if ds.external or ds.is_virtual:
        raise corrupt(path, f"{key} keeps its data outside the shard")
    return ds


def check_layout(
    f: h5py.File,
    path,
    layers=(),
    *,
    rows: int | None = None,
    dim: int | None = None,
    dims: dict[str, int] | None = None,
) -> int:
    """A shard's structure before anything is read or allocated from it: the row index (token_id,
    doc_id, position, is_special) one-dimensional integer columns of one length n (``rows``: the
    manifest's count, when known), each of ``layers`` an (n, D) float dataset (D: the width the run
    records for the layer in ``dims``, else ``dim``, the run's, when known), its non-finite flags
    (n,) booleans, every one stored in the shard itself. Returns n;
    DataError (one line, naming the shard) for anything else: a crafted shape cannot make a read
    allocate beyond what the manifest announced, nor loop over rows that are not there."""
    n = None
    for key in (*META_FIELDS, "is_special"):
        ds = _own_dataset(f, key, path)
        if ds.ndim != 1 or ds.dtype.kind not in "iub":
            raise corrupt(path, f"{key} is not a column of integers")
        if n is None:
            n = int(ds.shape[0])
        elif ds.shape[0] != n:
            raise corrupt(path, f"{key} has {ds.shape[0]} rows, token_id has {n}")
    if rows is not None and n != rows:
        raise corrupt(path, f"it stores {n} rows, its manifest entry says {rows}")
    if not isinstance(f.get("layers"), h5py.Group):
        raise corrupt(path, "its layers are not a group of datasets")
    for name in layers:
        ds = _own_dataset(f, f"layers/{name}", path)
        if ds.ndim != 2 or ds.dtype.kind != "f":
            raise corrupt(path, f"layer {name} is not a (rows, D) float array")
        if ds.shape[0] != n:
            raise corrupt(path, f"layer {name} has {ds.shape[0]} rows, the index has {n}")
        own = (dims or {}).get(name)
        if own is not None and ds.shape[1] != own:
            raise corrupt(path, f"layer {name} is {ds.shape[1]} wide, the run records it {own} wide")
        if own is None and dim is not None and ds.shape[1] != dim:
            raise corrupt(path, f"layer {name} is {ds.shape[1]} wide, the run's layers {dim}")
        if f.get(f"nonfinite/{name}", getlink=True) is not None:
            flags = _own_dataset(f, f"nonfinite/{name}", path)
            if flags.shape != (n,) or flags.dtype.kind not in "bui":
                raise corrupt(path, f"the non-finite flags of layer {name} are not {n} booleans")
    return n


def check_documents(path, doc_id: np.ndarray, docs: tuple[int, int]) -> None:
    """Every document id of a shard's rows lies in [start, stop), the range its entry assigns it."""
    if doc_id.size and (int(doc_id.min()) < docs[0] or int(doc_id.max()) >= docs[1]):
        raise corrupt(
            path,
            f"it stores rows of documents {int(doc_id.min())}..{int(doc_id.max())}, outside its range "
            f"{docs[0]}..{docs[1] - 1}",
        )


def check_rows(path, task: Task | None, meta: dict) -> None:
    """A chunk of a shard's row index (``meta``: its token_id, doc_id and position columns) within
    what its run allows (``task``: :func:`shard_task`'s; None, a shard read on its own, holds it to
    what any run allows): documents in its entry's range (:func:`check_documents`), positions in
    [0, ``task.positions``) -- a position keys the row's sample hash as ``doc_id << POSITION_BITS |
    position``, so one outside is another row's key --, token ids in [0, ``task.vocab``), the
    model's vocabulary (0: the run records none; ids are never negative)."""
    if task is not None and task.docs is not None:
        check_documents(path, meta["doc_id"], task.docs)
    positions = (task.positions if task is not None else 0) or 1 << POSITION_BITS
    _check_range(path, meta["position"], positions, "position", _positions_are(positions))
    vocab = task.vocab if task is not None else 0
    ids = f"the model's vocabulary of {vocab} ids" if vocab else "the ids a token has (0 and more)"
    _check_range(path, meta["token_id"], vocab or None, "token id", ids)


def _positions_are(limit: int) -> str:
    """What bounds a run's positions, said (``limit``: :func:`check_rows`'s)."""
    if limit == 1 << POSITION_BITS:
        return f"the {limit} a row key holds"
    return f"0..{limit - 1} (the run's max_length {limit})"


def _check_range(path, values: np.ndarray, stop: int | None, what: str, allowed: str) -> None:
    """Every one of ``values`` in [0, ``stop``) (None: at least 0); else DataError naming the first
    value outside and what ``allowed`` them."""
    values = np.asarray(values)
    if not values.size:
        return
    outside = (values < 0) if stop is None else ((values < 0) | (values >= stop))
    if outside.any():
        first = int(values[np.argmax(outside)])
        raise corrupt(path, f"it stores a row at {what} {first}, outside {allowed}")


def check_chunk(path, task: Task | None, meta: dict, values: dict, flags: dict) -> None:
    """A chunk of a shard's rows as it streams, after :func:`check_shard`: its row index
    (:func:`check_rows`) and, for each layer read (``values``: name -> rows) whose non-finite flags
    the shard stores (``flags``: name -> flags), :func:`check_flags`. ``score``, ``export``,
    ``inspect --verify`` and resume hold every row they read to it."""
    check_rows(path, task, meta)
    for name, rows in values.items():
        if name in flags:
            check_flags(path, name, rows, flags[name])


def check_flags(path, layer: str, values: np.ndarray, flagged: np.ndarray) -> None:
    """The rows of ``layer`` its non-finite flags mark are exactly those holding NaN or Inf: the store
    flags every one it writes, in the stored dtype, and nothing else; readers drop the flagged rows.
    An unflagged one means the file changed; a flagged finite one, rows dropped without a cause."""
    found = nonfinite_rows(values)
    flagged = np.asarray(flagged, bool)
    bad = found & ~flagged
    if bad.any():
        raise corrupt(
            path,
            f"{int(bad.sum())} of {len(bad)} rows of layer {layer} hold NaN or Inf that its "
            "non-finite flags do not mark",
        )
    idle = flagged & ~found
    if idle.any():
        raise corrupt(
            path,
            f"its non-finite flags mark {int(idle.sum())} of {len(idle)} rows of layer {layer} that "
            "hold no NaN or Inf",
        )


# ------------------------------------------------------------------ one notion of a valid shard
#: the seed check of a kept sample refuses a k-th smallest hash above (k + SEED_SLACK_SD * sqrt(k)
#: + SEED_SLACK_ROWS) / m of the hash range (m: the eligible rows the shard measured). For the run's
#: seed the hashes are uniform, the k-th smallest exceeds that only if fewer than k of m uniform
#: values fall below it, a binomial of mean mu = k + 8 sqrt(k) + 64; Chernoff's lower tail bounds the
#: chance by exp(-(mu - k)^2 / (2 mu)) < e^-32 for every k. A sample drawn under another seed holds
#: rows whose hashes under this one are uniform over the whole range: refused once m is a few times k.
SEED_SLACK_SD = 8
SEED_SLACK_ROWS = 64


def kept_size(keep) -> int | None:
    """N of a run's ``identity.keep`` (``"sample:N"``), None for a run of every row (no ``keep``);
    ValueError for a ``keep`` geomscope never writes."""
    if keep is None:
        return None
    head, _, n = str(keep).partition(":")
    if head != "sample" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"the manifest's keep {str(keep)[:40]!r} is not one geomscope writes")
    return int(n)


def layer_dims(ident: dict) -> dict[str, int]:
    """The widths a run's identity records layer by layer (``ident["layers"][i]["dim"]``): those of
    its layers that are not the model's hidden size wide (``extract --modules``: grouped-query keys,
    MLP intermediates). A layer without one is as wide as the run (``identity.model.hidden_size``)."""
    out = {}
    for entry in ident.get("layers") or []:
        d = entry.get("dim") if isinstance(entry, dict) else None
        if isinstance(d, int) and not isinstance(d, bool) and d > 0:
            out[entry["name"]] = d
    return out


def shard_task(
    path, entry: ShardInfo, ident: dict, dim: int, stats: dict | None = None, *, vocab: int | None = None
) -> Task:
    """A shard of a run as the task every reader checks it by (:func:`check_shard`): its path, rows,
    recorded size and checksum, documents, the rows it measured, the identity of its file now, the
    run's width ``dim`` (0: not checked) and each layer's own where the identity records one
    (:func:`layer_dims`), the positions its rows may hold (``ident``: the run's
    identity, whose ``max_length`` truncates every document), the model's vocabulary (``vocab``: the
    manifest's ``vocab_size``; None: not recorded) and, in a ``--keep sample`` run, the sample it
    kept (``stats``: its entry's, for the rows of each layer holding NaN or Inf)."""
    size = kept_size(ident.get("keep"))
    kept = None
    if size is not None:
        counts = (stats or {}).get("nonfinite_by_layer") or {}
        kept = KeptSample(
            size=size,
            seed=int(ident.get("sample_seed", 0) or 0),
            layers=len(ident.get("layers") or []),
            nonfinite=tuple(sorted(counts.items())),
        )
    return Task(
        kind="shard",
        path=str(path),
        index=entry.index,
        rows=entry.rows,
        nbytes=entry.bytes,
        digest=entry.digest,
        identity=identity(path),
        dim=dim,
        dims=tuple((n, d) for n, d in layer_dims(ident).items() if d != dim),
        kept=kept,
        docs=entry.documents,
        tokens=entry.n_tokens,
        positions=_positions(ident),
        vocab=vocab or 0,
    )


def _positions(ident: dict) -> int:
    """The positions a run's rows lie below: its ``max_length`` when it truncates every document to
    one (``truncation``), never more than a row key holds (2^POSITION_BITS)."""
    limit = ident.get("max_length")
    whole = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
    if whole and ident.get("truncation", True) is not False:
        return min(limit, 1 << POSITION_BITS)
    return 1 << POSITION_BITS


def check_shard(f: h5py.File, path, task: Task, layers, *, extras: bool = True) -> dict:
    """The one notion of a valid shard, held on the open shard ``f`` by ``score``, ``export``,
    ``inspect --verify`` and resume alike (its checksum is :func:`check_shard_file`'s; its rows'
    documents, positions, token ids and flags are checked as they stream: :func:`check_chunk`).

    Every shard: :func:`check_layout` against its task (rows, each layer's width, ``layers``). A
    ``--keep sample`` shard also: the sample the run records (size, seed, rows it measured) in its
    attributes; at most ``KeptSample.most_rows`` rows; each layer's accumulators checked
    (accumulators.read_moments) and counting, with the rows its entry records as NaN or Inf, every row
    it measured; each layer's stored sample as large as its accumulators' counts require, and drawn
    under the run's seed (:func:`_check_sample`). Returns ``{layer: (regular, special | None)}`` of
    the checked accumulators (``extras``: with their cosine and |x| parts) of a sample shard, ``{}``
    for a shard of every row. DataError (one line, naming the shard) otherwise."""
    try:
        check_layout(f, path, layers, rows=task.rows, dim=task.dim or None, dims=dict(task.dims))
        return {} if task.kept is None else _check_kept(f, path, task, layers, extras)
    except DataError as e:
        if str(path) in str(e):
            raise
        raise corrupt(path, str(e).split(";")[0]) from e
    except READ_ERRORS as e:  # a structure no writer made
        raise corrupt(path, h5_reason(e)) from e


def _check_kept(f: h5py.File, path, task: Task, layers, extras: bool) -> dict:
    """:func:`check_shard`'s checks of a ``--keep sample`` shard beyond its layout."""
    from geomscope.store.accumulators import GROUP, read_moments

    kept = task.kept
    _check_kept_attrs(f, path, task)
    if task.rows > min(task.tokens, kept.most_rows):
        raise corrupt(
            path,
            f"it stores {task.rows} rows, more than samples of {kept.size} rows of {kept.layers} layers hold",
        )
    meta = {key: f[key][()] for key in (*META_FIELDS, "is_special")}
    check_rows(path, task, meta)  # (the sample's keys are made of them)
    hashes = row_hash(run_keys(meta["doc_id"], meta["position"]), kept.seed, STREAM_ID_SAMPLE)
    special = np.asarray(meta["is_special"], bool)
    out = {}
    for name in layers:
        if name not in f[GROUP]:
            raise corrupt(path, f"it has no accumulators of layer {name}")
        lg = f[GROUP][name]
        width = task.width(name) or int(f["layers"][name].shape[1])  # (0: a run that records no width)
        regular = read_moments(lg["regular"], dim=width, most=task.tokens, extras=extras)
        n_special = 0
        other = None
        if "special" in lg:
            other = read_moments(lg["special"], dim=width, most=task.tokens - regular.n, extras=extras)
            n_special = other.n
        bad = kept.nonfinite_rows(name)
        if regular.n + n_special + bad != task.tokens:
            raise corrupt(
                path,
                f"its accumulators of layer {name} count {regular.n + n_special} rows and its entry "
                f"{bad} with NaN or Inf, not the {task.tokens} rows it measured",
            )
        finite = ~_flags(f, name)
        # the rows each --exclude-special setting samples from: stored (a mask), and measured
        eligible = ((finite, regular.n + n_special), (finite & ~special, regular.n))
        _check_sample(path, name, kept, hashes, eligible)
        out[name] = (regular, other)
    return out


def _check_kept_attrs(f: h5py.File, path, task: Task) -> None:
    """A sample shard's attributes say it kept the run's sample: ``keep``, the rows it measured, the
    sample's size and seed."""
    kept = task.kept
    if f.attrs.get("keep") != "sample":
        raise corrupt(path, "it keeps every row, but the run records a --keep sample")
    for key, want, what in (
        ("tokens", task.tokens, "it says it measured {got} rows, its entry {want}"),
        ("sample_size", kept.size, "it kept samples of {got} rows, the run's --keep is sample:{want}"),
        ("sample_seed", kept.seed, "it kept the sample of seed {got}, the run's is seed {want}"),
    ):
        got = f.attrs.get(key)
        whole = isinstance(got, (int, np.integer)) and not isinstance(got, (bool, np.bool_))
        if not whole or int(got) != want:
            raise corrupt(path, what.format(got=str(got)[:40], want=want))


def stored_flags(f: h5py.File, layers) -> list[str]:
    """Those of ``layers`` whose non-finite flags the shard stores (a layer without: its rows are
    found from its values as they are read)."""
    return [name for name in layers if f.get(f"nonfinite/{name}", getlink=True) is not None]


def _flags(f: h5py.File, name: str) -> np.ndarray:
    """A sample shard's non-finite flags of layer ``name`` (found from its stored rows without them)."""
    if f.get(f"nonfinite/{name}", getlink=True) is not None:
        return np.asarray(f["nonfinite"][name][()], bool)
    return nonfinite_rows(f["layers"][name][()])


def _check_sample(path, name: str, kept: KeptSample, hashes: np.ndarray, eligible) -> None:
    """Layer ``name``'s stored sample for each ``--exclude-special`` setting (``eligible``: pairs of
    the stored rows it samples from, a mask, and the rows its accumulators count as such): as many
    rows as a sample of ``kept.size`` of them takes, no more than exist, and, where the sample is a
    fraction of them, the rows of smallest ``hashes`` under the run's seed (:data:`SEED_SLACK_SD`)."""
    for mask, m in eligible:
        have, need = int(mask.sum()), min(kept.size, m)
        if not need <= have <= m:
            raise corrupt(
                path,
                f"its sample of layer {name} holds {have} rows where a sample of {kept.size} of its "
                f"{m} measured rows holds {need}",
            )
        if need == 0 or need == m:
            continue
        kth = int(np.partition(hashes[mask], need - 1)[need - 1])
        bound = (need + SEED_SLACK_SD * math.sqrt(need) + SEED_SLACK_ROWS) / m
        if kth / 2.0**64 > bound:
            raise corrupt(
                path,
                f"its sample of layer {name} is not the rows of smallest hash under seed {kept.seed}: "
                "it was drawn under another seed",
            )


def verify_shard_task(task: Task, layers) -> int:
    """A shard held now to everything a read holds it to, read whole (``inspect --verify``, resume):
    its size and checksum (:func:`check_shard_file`), :func:`check_shard`, and its rows streamed --
    each of the documents its entry assigns it, NaN or Inf only where flagged. Returns the distinct
    documents it stores; DataError (one line, naming the shard) otherwise, its checksum's first."""
    with checked_reads(task, checksum=True) as task:
        path = remote.location(task.path)
        with open_checked(path, task.identity) as f:
            check_shard(f, path, task, layers)
            return _check_rows(f, path, task, layers)


#: bytes of one layer's rows :func:`verify_shard_task` reads at a time
VERIFY_CHUNK_BYTES = 64 * 1024 * 1024


def _check_rows(f: h5py.File, path, task: Task, layers) -> int:
    """Every row of the shard, a bounded chunk of one layer at a time: what :func:`check_chunk`
    checks (:func:`check_rows`, :func:`check_flags`); the distinct documents it stores."""
    n = int(f["doc_id"].shape[0])
    width = max([f["layers"][name].shape[1] * f["layers"][name].dtype.itemsize for name in layers] or [1])
    step = max(1024, VERIFY_CHUNK_BYTES // max(1, width))
    flagged = stored_flags(f, layers)
    docs = []
    try:
        for start in range(0, n, step):
            meta = {key: f[key][start : start + step] for key in META_FIELDS}
            check_rows(path, task, meta)
            docs.append(np.unique(meta["doc_id"]))
            for name in flagged:
                rows = f["layers"][name][start : start + step]
                check_flags(path, name, rows, f["nonfinite"][name][start : start + step])
    except READ_ERRORS as e:
        raise corrupt(path, h5_reason(e)) from e
    return int(np.unique(np.concatenate(docs)).size) if docs else 0
