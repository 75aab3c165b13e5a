"""Writing files safely: the one home of geomscope's atomic writes.

A file is written to a fresh temporary name in its own directory, created exclusively and never
through a link (``O_CREAT | O_EXCL | O_NOFOLLOW``), flushed and fsynced, then renamed over the
destination, and the directory is fsynced so that the rename survives a crash. A reader sees the
old file or the new one, never half of one; a link planted at the temporary or the final name is
never written through (``os.replace`` replaces the link itself).

An output a user names (a report, a figure, a page, a comparison) replaces only geomscope's own
earlier output of that kind: :func:`ensure_replaceable` refuses any other file, a link or a directory
at that name, and inside a run directory the names the run keeps for its own files. Each kind says
how it recognises its own bytes (a report's ``"format"``, a CSV's header, the ``geomscope`` a figure
or page records as its creator). :func:`ensure_writable` asks, with a real file, whether an output's
folder can be written before the work that produces it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Callable
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
    of read-only mounts or of /sys, so a report was refused only after the whole computation. The
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


def run_reserved(name: str) -> bool:
    """Whether a run directory keeps ``name`` for its own files: the manifest, the lock, the shard
    logs, the shards and their temporary names, geomscope's temporary files. An output of that name
    inside a run would be read, replaced or deleted by a later ``extract`` (a resume folds and
    removes the shard logs), so :func:`ensure_replaceable` refuses it there."""
    # each name's home is the store (imported here: the store writes through this module)
    from geomscope.store.manifest import LOCK_NAME, MANIFEST_NAME, PART_RE
    from geomscope.store.shard import SHARD_FILE_RE, SHARD_TEMP_RE

    return (
        name in (MANIFEST_NAME, LOCK_NAME)
        or name.startswith(TEMP_PREFIX)
        or any(r.fullmatch(name) for r in (PART_RE, SHARD_FILE_RE, SHARD_TEMP_RE))
    )


def _in_run_reserved(path: Path) -> Path | None:
    """``path``, or the folder on its way, that takes a name its run directory keeps for its own
    files (:func:`run_reserved`); None where none does."""
    from geomscope.store.manifest import MANIFEST_NAME

    for child in (path, *path.parents):
        parent = child.parent
        if parent == child:
            break
        if run_reserved(child.name) and (parent / MANIFEST_NAME).is_file():
            return child
    return None


#: the most bytes of an existing output read to recognise it (geomscope's figures and reports are
#: far smaller; a larger file is not one of them)
MAX_RECOGNISED_BYTES = 256 * 2**20


def ensure_replaceable(
    path: str | os.PathLike,
    ours: Callable[[bytes], bool],
    *,
    option: str = "--out",
    head: int | None = None,
    hint: str = "",
) -> None:
    """Nothing at ``path``, or a regular file whose bytes ``ours`` recognises as geomscope's earlier
    output of this kind (rewritten, as a rerun expects); anything else -- a user's file, a link, a
    directory, a name a run directory keeps for its own files (:func:`run_reserved`) inside one -- is
    an InputError naming ``option``, before anything is written. ``head``: the
    recogniser needs only the file's first ``head`` bytes (a report of any size); ``hint``: added to
    the refusal."""
    from geomscope.errors import InputError

    p = Path(path)
    taken = _in_run_reserved(p)
    if taken is not None:
        raise InputError(
            f"{p}: the run directory {taken.parent} keeps the name {taken.name!r} for its own files "
            f"(a later extract would replace or delete it); choose another {option}"
        )
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise InputError(f"cannot check {p} ({e.strerror or e}); choose another {option}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{p} is a directory; choose another {option}")
    mine = False
    if stat.S_ISREG(st.st_mode) and (head is not None or st.st_size <= MAX_RECOGNISED_BYTES):
        try:
            with open(p, "rb") as f:
                mine = ours(f.read(head) if head is not None else f.read())
        except OSError:
            mine = False
    if not mine:
        what = "a link" if stat.S_ISLNK(st.st_mode) else f"a file geomscope did not write{hint}"
        raise InputError(f"{p} exists and is {what}; choose another {option}, or move it away first")


#: the bytes of an output's start a recogniser reads (``head=``): a JSON output's first key, a CSV's
#: header
HEAD_BYTES = 4096


def json_format_is(expected: str) -> Callable[[bytes], bool]:
    """A recogniser (:func:`ensure_replaceable`, ``head=HEAD_BYTES``) of the JSON objects geomscope
    writes with ``"format": expected`` as their first key."""
    pattern = re.compile(rb'\A\s*\{\s*"format"\s*:\s*"' + re.escape(expected.encode()) + rb'"')
    return lambda data: pattern.match(data) is not None


def starts_with(prefix: bytes) -> Callable[[bytes], bool]:
    """A recogniser (:func:`ensure_replaceable`) of a file beginning with ``prefix`` (a CSV's header)."""
    return lambda data: data.startswith(prefix)


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
