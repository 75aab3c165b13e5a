"""Writing files safely: the one home of geomscope's atomic writes, directory swaps and file digests.

A file is written to a fresh temporary name in its own directory, created exclusively and never
through a link (``O_CREAT | O_EXCL | O_NOFOLLOW``), flushed and fsynced, then renamed over the
destination, and the directory is fsynced so that the rename survives a crash. A reader sees the
old file or the new one, never half of one; a link planted at the temporary or the final name is
never written through (``os.replace`` replaces the link itself). A directory is built under a
temporary name and put in place by renames (:func:`replace_dir`; :func:`restore_aside` undoes one
cut off by a crash). :func:`ensure_writable` asks,
with a real file, whether an output's folder can be written before the work that produces it.
What an output a user names may replace is outputs.py's. Files are hashed by one read loop
(:func:`hash_into`); a set of named files by :func:`files_digest`; an input's content by
:func:`input_digest`.

Reading back is bounded the same way everywhere: :func:`open_regular` opens a regular file only (a
FIFO would block the read until a writer comes, a device such as /dev/zero never ends, a folder or a
link loop is an OSError), and every JSON document geomscope reads -- a manifest, a report, a trainer
state, a finetune summary, a sweep's or a log's records -- comes through :func:`read_json` or
:func:`loads_json`: at most :data:`MAX_JSON_BYTES` bytes, nested at most :data:`MAX_JSON_DEPTH`
deep. What breaks a bound is an OSError (:class:`NotRegularFileError`) or a ValueError
(:class:`JSONLimitError`), which each reader already turns into its own one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

TEMP_PREFIX = ".geomscope-tmp-"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames inside ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_exclusive(path: str | os.PathLike, mode: int = 0o644) -> int:
    """Open a new file for writing; fails if anything (a file, a link) already has that name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, mode)


def temp_path(dest: str | os.PathLike) -> Path:
    """A fresh temporary name next to ``dest`` (same directory, so the final rename is atomic)."""
    dest = Path(dest)
    return dest.with_name(f"{TEMP_PREFIX}{secrets.token_hex(6)}-{dest.name}")


def make_dirs(path: str | os.PathLike, *, option: str = "--out") -> Path:
    """``path`` and its parents created where missing; InputError (one line naming ``option``) where
    that cannot be (a file on the way, no permission, a read-only or full disk)."""
    from geomscope.errors import InputError

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # something that is not a folder is on the way: say what, not "File exists"
        on_way = next((q for q in (p, *p.parents) if os.path.lexists(q) and not q.is_dir()), p)
        what = "a link to nothing" if on_way.is_symlink() and not on_way.exists() else "not a folder"
        raise InputError(
            f"cannot create the output folder {p}: {on_way} is {what}; choose another {option}"
        ) from None
    except OSError as e:
        raise InputError(
            f"cannot create the output folder {p} ({e.strerror or e}); choose another {option}"
        ) from None
    return p


def write_denied(folder: str | os.PathLike) -> str | None:
    """None if a file can be created in ``folder`` -- or, where it does not exist yet, in its
    nearest existing parent, where :func:`make_dirs` would create it; else why not (one phrase).

    A real probe: an empty file of a fresh temporary name is created there exclusively and removed
    at once. ``os.access`` answers for root as if every permission bit allowed it and knows nothing
    of read-only mounts or of /sys, so it would let a report be refused only after the whole
    computation. The
    probe removes nothing but the file it has just created; nothing is left behind."""
    p = Path(folder)
    while not os.path.lexists(p) and p.parent != p:  # (a dangling link counts as there: mkdir fails)
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a folder"
    probe = p / f"{TEMP_PREFIX}{secrets.token_hex(6)}-probe"
    try:
        os.close(create_exclusive(probe))
    except OSError as e:
        return e.strerror or str(e)
    try:
        os.unlink(probe)
    except OSError:  # pragma: no cover - created a moment ago by this process
        pass
    return None


def ensure_writable(folder: str | os.PathLike, *, option: str = "--out") -> None:
    """InputError (one line naming ``option``) where no file can be written in ``folder``
    (:func:`write_denied`): asked before the work, so that it is not lost at the end."""
    from geomscope.errors import InputError

    why = write_denied(folder)
    if why is not None:
        raise InputError(f"cannot write in {folder} ({why}); choose another {option}")


def write_all(fd: int, data) -> None:
    """Write every byte of ``data`` (bytes or a buffer) to ``fd``: a short write, as on a nearly
    full disk, is followed by the rest or by the error that stopped it."""
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view) :]


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = temp_path(path)
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj, *, indent: int | None = 2) -> None:
    """``obj`` as JSON (non-JSON values through ``str``) with a trailing newline."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=str) + "\n")


def remove_tree(path: str | os.PathLike) -> None:
    """Remove what is at ``path``: a directory with everything in it; a link or a file itself (a
    link is never followed); nothing there, nothing done."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()


def fresh_dir(path: str | os.PathLike) -> Path:
    """An empty working directory at ``path``, a name of geomscope's own: whatever is there is
    removed first (a link planted there is removed, never followed)."""
    p = Path(path)
    remove_tree(p)
    p.mkdir(parents=True)
    return p


def replace_dir(
    tmp: str | os.PathLike, final: str | os.PathLike, *, aside: str | os.PathLike | None = None
) -> None:
    """Put the finished directory ``tmp`` at ``final`` (its sibling: renames are atomic there),
    replacing whatever is at that name, then fsync the parent so that the renames survive a crash.

    What is at ``final`` is first renamed to ``aside`` and removed only once ``tmp`` stands in its
    place: a crash between the two renames leaves the old directory at ``aside``, never nothing.
    ``aside``: a name the caller recognises and puts back after a crash; by default a fresh
    temporary name (:func:`temp_path`), which no one else's file can have.
    """
    final = Path(final)
    aside = temp_path(final) if aside is None else Path(aside)
    remove_tree(aside)
    if os.path.lexists(final):
        os.replace(final, aside)
    os.replace(tmp, final)
    remove_tree(aside)
    fsync_dir(final.parent)


def restore_aside(final: str | os.PathLike, aside: str | os.PathLike) -> bool:
    """Undo a :func:`replace_dir` cut off between its two renames: the old directory, left at the
    caller's ``aside`` name, put back at ``final`` when nothing stands there (a link at ``aside`` is
    never followed), and the parent fsynced; whether it was put back. The caller knows ``aside`` for
    its own (a file only it writes)."""
    final, aside = Path(final), Path(aside)
    if os.path.lexists(final) or aside.is_symlink() or not aside.is_dir():
        return False
    os.replace(aside, final)
    fsync_dir(final.parent)
    return True


#: bytes of one read of a file being hashed, into one reused buffer: a fresh bytes object per read
#: (``f.read``) of a few MiB is mapped and page-faulted anew each time, which costs a shard's check
#: several times the hashing itself, CPU time taken from the scorer's threads
HASH_READ_BYTES = 1024 * 1024


def hasher(algorithm: str):
    """A new hash object of ``algorithm``: ``"sha256"`` (hashlib) or ``"xxh3_128"`` (xxhash)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def hash_into(f, hashers: Iterable) -> int:
    """Feed what an open binary file holds, from where it stands to its end, to every one of
    ``hashers`` (objects with ``update``) in one read; the bytes read. The file stays open."""
    hashers = list(hashers)
    buf = memoryview(bytearray(HASH_READ_BYTES))
    total = 0
    while n := _read_into(f, buf):
        chunk = buf[:n]
        for h in hashers:
            h.update(chunk)
        total += n
    return total


def file_digests(f, algorithms: tuple[str, ...]) -> dict[str, str]:
    """Hex digests of what an open binary file holds from where it stands to its end, one per
    algorithm (:func:`hasher`), in one read."""
    hashers = {a: hasher(a) for a in algorithms}
    hash_into(f, hashers.values())
    return {a: h.hexdigest() for a, h in hashers.items()}


def files_digest(
    paths: Iterable[Path], algorithm: str, *, head_tail: int | None = None, nested: bool = False
) -> str | None:
    """A digest (:func:`hasher`'s ``algorithm``) over files in the order of their names, each as its
    name, NUL, its size, NUL, then its contents: whole, or of a file longer than ``2 * head_tail``
    bytes its first and last ``head_tail`` only; ``nested``: the raw bytes of the contents' own
    digest instead of the contents. None for no files. A model's fingerprints
    (model/fingerprint.py) are these."""
    paths = sorted(paths, key=lambda q: q.name)
    if not paths:
        return None
    h = hasher(algorithm)
    for p in paths:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{p.name}\0{size}\0".encode())
            if nested:
                h.update(bytes.fromhex(file_digests(f, (algorithm,))[algorithm]))
            elif head_tail is None or size <= 2 * head_tail:
                hash_into(f, [h])
            else:
                h.update(f.read(head_tail))
                f.seek(size - head_tail)
                h.update(f.read(head_tail))
    return h.hexdigest()


def input_digest(path: Path, name: str, directory: bool = False) -> tuple[str, int]:
    """(sha256 hex digest, bytes) of an input's content: the file ``path``, or every file below the
    directory ``path`` (a ``datasets.save_to_disk`` folder) in sorted order, each after its path
    relative to ``path`` and a NUL. What a run records of its inputs (extract's identity, finetune's
    resume fingerprint); InputError naming the input ``name`` when a file cannot be read."""
    from geomscope.errors import InputError

    h = hasher("sha256")
    total = 0
    files = regular_files_below(path, name) if directory else [path]
    for p in files:
        if directory:
            h.update(str(p.relative_to(path)).encode() + b"\0")
        try:
            with open_regular(p) as f:
                total += hash_into(f, [h])
        except OSError as e:
            raise InputError(f"input {name} cannot be read ({e.strerror or e}); check the file") from e
    return h.hexdigest(), total


def regular_files_below(folder: Path, name: str) -> list[Path]:
    """Every regular file below ``folder`` (an input folder: a ``datasets.save_to_disk`` directory),
    in sorted order: links to files followed, links to folders not walked, links to nothing left
    out. InputError naming the input ``name`` for a named pipe, a device or a socket below it: the
    readers of such a folder (datasets, pyarrow) open every data file it lists, and would block on a
    pipe or never finish a device."""
    from geomscope.errors import InputError

    files = []
    for p in sorted(folder.rglob("*")):
        try:
            mode = p.stat().st_mode
        except OSError:  # a link to nothing, or a loop: no reader can open it either
            continue
        if stat.S_ISREG(mode):
            files.append(p)
        elif not stat.S_ISDIR(mode):
            raise InputError(
                f"input {name} holds {p.relative_to(folder)}, {_kind_of_file(mode)}, not a regular file; "
                f"move it out of {folder}"
            )
    return files


def _read_into(f, buf: memoryview) -> int:
    """Fill ``buf`` from ``f`` (``readinto``, or ``read`` for a file object without it); bytes read."""
    if hasattr(f, "readinto"):
        return f.readinto(buf) or 0
    chunk = f.read(len(buf))
    buf[: len(chunk)] = chunk
    return len(chunk)


# ------------------------------------------------------------------------------ reading back
#: the most bytes of a JSON document read whole: what geomscope writes is far smaller (a manifest
#: entry is ~0.4 KB, so 100,000 shards take 40 MiB; a report, a trainer state, a summary take KB to
#: a few MB), and a parsed document takes several times its text in memory, so a file at a
#: manifest's or a report's name cannot make a reader hold more than a few GiB
MAX_JSON_BYTES = 256 * 2**20

#: the deepest nesting of arrays and objects in a JSON document read back: what geomscope writes
#: nests a few levels deep (a report, a manifest: 4). Python's parser,
#: ``json.dumps``, ``copy.deepcopy`` and the readers' own walks recurse once per level, within the
#: interpreter's limit of 1,000 frames shared with the caller's stack: a document nested a few
#: hundred deep is a RecursionError somewhere. 100 leaves every one of them far from that limit
MAX_JSON_DEPTH = 100


class NotRegularFileError(OSError):
    """A path to be read is not a regular file (a named pipe, a device, a folder, a socket)."""


class JSONLimitError(ValueError):
    """A JSON document is larger or nested deeper than geomscope reads (:data:`MAX_JSON_BYTES`,
    :data:`MAX_JSON_DEPTH`)."""


def _kind_of_file(mode: int) -> str:
    """What a file that is not a regular file is, in a few words."""
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "something else"


def open_regular(path: str | os.PathLike):
    """``path`` opened for reading as an unbuffered binary file, if it is a regular file (a link to
    one is followed). Opened without waiting (``O_NONBLOCK``: a FIFO would block ``open`` until a
    writer comes) and checked on the open file (``fstat``), so nothing can take its place between
    the check and the reads: :class:`NotRegularFileError` for a named pipe, a device, a folder or a
    socket; the OSError of ``open`` for a missing file, a link loop (ELOOP), no permission."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFileError(f"{_kind_of_file(mode)}, not a regular file")
    return open(fd, "rb", buffering=0)  # noqa: SIM115 -- the caller closes it


def read_regular_bytes(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`); JSONLimitError where it holds
    more than ``max_bytes`` (None: no bound), found before they are read."""
    with open_regular(path) as f:
        if max_bytes is None:
            return f.readall()
        if os.fstat(f.fileno()).st_size > max_bytes:
            raise _too_large(max_bytes)
        data = f.read(max_bytes + 1)  # (the file may have grown since fstat)
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def read_regular_text(
    path: str | os.PathLike, *, encoding: str = "utf-8", errors: str = "strict", max_bytes: int | None = None
) -> str:
    """The text of the regular file ``path`` (:func:`read_regular_bytes`), decoded."""
    return read_regular_bytes(path, max_bytes).decode(encoding, errors)


def _too_large(max_bytes: int) -> JSONLimitError:
    size = f"{max_bytes // 2**20} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"
    return JSONLimitError(f"larger than {size}")


def loads_json(text: str | bytes):
    """``json.loads(text)``, nested at most :data:`MAX_JSON_DEPTH` deep (JSONLimitError otherwise);
    every other defect is json's own ValueError. Nesting deeper than the interpreter's recursion
    limit ends the parse itself (a RecursionError, said as the same JSONLimitError); what parses is
    then measured without recursion (:func:`json_depth`)."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise JSONLimitError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if json_depth(obj, stop=MAX_JSON_DEPTH + 1) > MAX_JSON_DEPTH:
        raise JSONLimitError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return obj


_CONTAINERS = (dict, list)


def json_depth(obj, *, stop: int | None = None) -> int:
    """The nesting depth of a parsed JSON value (0 for a scalar, 1 for ``[]`` or ``{"a": 1}``),
    measured level by level without recursion; the walk ends at depth ``stop`` when given. About a
    quarter of the parse's time on a manifest of 100,000 shards."""
    level = [obj] if type(obj) in _CONTAINERS else []
    depth = 0
    while level and (stop is None or depth < stop):
        depth += 1
        below = []
        for value in level:
            below += [c for c in (value.values() if type(value) is dict else value) if type(c) in _CONTAINERS]
        level = below
    return depth


def read_json(path: str | os.PathLike, *, encoding: str = "utf-8", max_bytes: int | None = MAX_JSON_BYTES):
    """The JSON document in the regular file ``path``: at most ``max_bytes`` (:data:`MAX_JSON_BYTES`;
    None: a user's data file, held whole by its reader whatever its size) and :data:`MAX_JSON_DEPTH`
    deep (:func:`loads_json`). The one reader of every JSON file geomscope
    reads back. OSError where the file cannot be read or is not a regular file
    (:class:`NotRegularFileError`); ValueError where it is no such JSON (json's JSONDecodeError,
    UnicodeDecodeError, :class:`JSONLimitError`): the caller says what the file should have been."""
    return loads_json(read_regular_text(path, encoding=encoding, max_bytes=max_bytes))
