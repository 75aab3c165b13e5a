"""Writing files safely: the one home of geomscope's atomic writes.

A file is written to a fresh temporary name in its own directory, created exclusively and never
through a link (``O_CREAT | O_EXCL | O_NOFOLLOW``), flushed and fsynced, then renamed over the
destination, and the directory is fsynced so that the rename survives a crash. A reader sees the
old file or the new one, never half of one; a link planted at the temporary or the final name is
never written through (``os.replace`` replaces the link itself).
"""

from __future__ import annotations

import json
import os
import secrets
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
