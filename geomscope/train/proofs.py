"""What proves that geomscope wrote an entry of a finetune output: the sha256 it recorded.

A finetune output's marker (:mod:`geomscope.train.checkpoint`) lists the paths a run claimed; a
marker is a file anyone can write, so a claim alone never lets geomscope delete or replace an
entry. What does is a name only geomscope uses for its own working state (the caller decides that)
or, for everything else, content it can verify: when a run writes a file whole and never appends to
it (the exported model, the LoRA adapter, the ``checkpoints/step<N>`` snapshots, the files a tracker
wrote), the sha256 of its bytes goes into the marker's ``sha256`` map under its path, and
:func:`proven` holds an entry geomscope's only while every regular file in it still hashes to what was
recorded. A user's file (a name the marker claims but whose bytes geomscope never wrote) is never
proven; a link, a FIFO or a device is never followed or read.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from geomscope.fileio import file_digests

#: the form of a recorded digest (anything else in a marker's map is ignored)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: digests already taken this process, by (path, size, modification time, inode): a check before the
#: run and the removal after it read each file once
_taken: dict[tuple, str] = {}


def inside(out: Path, rel: str) -> Path | None:
    """``out/rel`` when every folder on the way is a real directory (a link is never followed)."""
    p = out
    for part in rel.split("/")[:-1]:
        p = p / part
        if p.is_symlink() or not p.is_dir():
            return None
    return p / rel.split("/")[-1]


def sha256_of(path: Path) -> str:
    """The sha256 of the regular file ``path`` (its bytes read once per version of the file)."""
    st = os.stat(path, follow_symlinks=False)
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _taken:
        with open(path, "rb") as f:
            _taken[key] = file_digests(f, ("sha256",))["sha256"]
    return _taken[key]


def digests(folder: Path, prefix: str = "") -> dict[str, str]:
    """``{prefix/relative path: sha256}`` of every regular file under ``folder`` (a working directory
    geomscope has just written, before it is renamed to ``prefix``, or moved file by file into the
    output's top level: ``prefix`` empty)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            p = Path(root) / name
            if stat.S_ISREG(os.lstat(p).st_mode):
                rel = p.relative_to(folder).as_posix()
                out[f"{prefix}/{rel}" if prefix else rel] = sha256_of(p)
    return out


def file_states(folder: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, modification time in ns)}`` of the regular files under ``folder``
    (none when it is not there): what was there before a tracker wrote into it."""
    states = {}
    if folder.is_dir() and not folder.is_symlink():
        for root, _, names in os.walk(folder):
            for name in names:
                st = os.lstat(Path(root) / name)
                if stat.S_ISREG(st.st_mode):
                    rel = (Path(root) / name).relative_to(folder).as_posix()
                    states[rel] = (st.st_size, st.st_mtime_ns)
    return states


def new_file_digests(out: Path, rel: str, before: dict[str, tuple[int, int]]) -> dict[str, str]:
    """The digests (as :func:`digests`) of the files under ``out/rel`` that are new or changed since
    ``before`` (:func:`file_states`): what this run wrote there, never a file it found."""
    now = file_states(out / rel)
    return {
        f"{rel}/{name}": sha256_of(out / rel / name) for name, st in now.items() if before.get(name) != st
    }


def recorded_digests(values, keep) -> dict[str, str]:
    """The ``{path: sha256}`` items of a marker's map whose path ``keep`` accepts and whose digest has
    the form of one."""
    if not isinstance(values, dict):
        return {}
    return {k: v for k, v in values.items() if keep(k) and isinstance(v, str) and _SHA256.match(v)}


def proven(out: Path, rel: str, recorded: dict[str, str]) -> bool:
    """Whether ``out/rel`` is geomscope's by content: a regular file whose sha256 is the one recorded
    for ``rel``, or a real directory all of whose entries are such files (or such directories)."""
    p = inside(out, rel)
    if p is None:
        return False
    mode = os.lstat(p).st_mode if os.path.lexists(p) else 0
    if stat.S_ISREG(mode):
        return recorded.get(rel) == sha256_of(p)
    if not stat.S_ISDIR(mode):
        return False
    return all(proven(out, f"{rel}/{e.name}", recorded) for e in os.scandir(p))


def remove_proven(out: Path, rel: str, recorded: dict[str, str]) -> bool:
    """Remove what of ``out/rel`` is proven geomscope's (:func:`proven`): its files whose sha256 is the
    one recorded, then the directories they leave empty; anything else stays, with the folders
    holding it. Whether anything was removed."""
    p = inside(out, rel)
    mode = os.lstat(p).st_mode if p is not None and os.path.lexists(p) else 0
    if stat.S_ISREG(mode) and recorded.get(rel) == sha256_of(p):
        p.unlink()
        return True
    if not stat.S_ISDIR(mode):
        return False
    removed = [remove_proven(out, f"{rel}/{e.name}", recorded) for e in list(os.scandir(p))]
    if any(removed) and not any(p.iterdir()):
        p.rmdir()
    return any(removed)
