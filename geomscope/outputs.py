"""What an output a user names may replace: only geomscope's own earlier output of that kind.

:func:`ensure_replaceable` refuses any other file, a link or a directory at that name, and inside a
run directory the names the run keeps for its own files (store.names.run_reserved). Each kind says
how it recognises its own bytes (a report's ``"format"``, a CSV's header, the ``geomscope`` a figure
or page records as its creator): :func:`json_format_is`, :func:`starts_with`, or its own test.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path


def _in_run_reserved(path: Path) -> Path | None:
    """``path``, or the folder on its way, that takes a name its run directory keeps for its own
    files (store.names.run_reserved); None where none does."""
    # each name's home is the store (imported here: importing it reads h5py)
    from geomscope.store.names import MANIFEST_NAME, run_reserved

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
    directory, a name a run directory keeps for its own files (store.names.run_reserved) inside one -- is
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
