"""The run manifest: identity, finished shards, totals; atomic updates, resume and locking.

A finished shard is recorded first in its process's shard log (:class:`ShardLog`: one line
appended and fsynced, whatever the number of shards before it), and the manifest -- every shard, in
one atomic rewrite -- is brought up to date only when that costs little beside the time gone since
its last rewrite (:data:`REWRITE_RATIO`), and whenever the run stops, fails or is finalized.
Rewriting it for every shard made recording a shard O(shards): 158 ms at 30,000 shards, 40
minutes over such a run, on the publisher thread. Readers, resume and ``--overwrite`` take the
logs into account (:func:`read_parts`), so no finished shard is ever lost or left behind.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

from geomscope.choices import MAX_SEED, MAX_SEED_TEXT
from geomscope.errors import DataError, InputError, first_line
from geomscope.fileio import (
    MAX_JSON_BYTES,
    TEMP_PREFIX,
    fsync_dir,
    loads_json,
    make_dirs,
    read_json,
    read_regular_text,
    write_all,
    write_text_atomic,
)
from geomscope.store import checksum, remote
from geomscope.store.integrity import shard_task, verify_shard_task
from geomscope.store.names import (
    FORMAT_VERSION,
    LOCK_NAME,
    MANIFEST_NAME,
    PART_RE,
    RUN_FORMAT,
    SHARD_FILE_RE,
    SHARD_TEMP_RE,
    part_name,
    shard_name,
)
from geomscope.store.shard import ShardInfo, ShardWriter

#: a layer name a manifest may hold: a shard keeps each layer as an HDF5 dataset of that name, and
#: reports print it, so no "/" (a path inside the shard), no control character (a terminal escape),
#: no surrogate, nothing empty or leading dot; what geomscope writes is far narrower (layer_06,
#: final_norm, ...)
LAYER_NAME_RE = re.compile(r"[^\W][^/\x00-\x1f\x7f-\x9f\ud800-\udfff]{0,199}")
#: process 0 rewrites the manifest for a newly recorded shard only when at least this many times
#: the last rewrite's duration has gone by since it: rewriting costs at most ~1/REWRITE_RATIO of
#: the publisher's time however many shards there are, and a reader of the manifest alone lags by
#: that much at most (the log has every shard at once)
REWRITE_RATIO = 20.0


_SHARD_FIELDS = {
    "index": int,
    "file": str,
    "rows": int,
    "docs": int,
    "doc_start": int,
    "doc_stop": int,
    "nonfinite_rows": int,
    "bytes": int,
}  # and the checksums (store/checksum.py)


def damaged(path: Path, why: str) -> InputError:
    return InputError(
        f"{path} is damaged ({why}); rerun `geomscope extract` with --overwrite, or into a new --out"
    )


def _check_shard_entry(s, i: int, path: Path) -> None:
    if not isinstance(s, dict):
        raise damaged(path, f"shards[{i}] is not an object")
    for key, kind in _SHARD_FIELDS.items():
        v = s.get(key)
        if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0):
            raise damaged(
                path,
                f"shards[{i}].{key} is {short(v)}, not a{'n' if kind is int else ''} "
                f"{'non-negative integer' if kind is int else 'string'}",
            )
    for algorithm in (checksum.SLOW, checksum.FAST):  # xxh3_128: runs written since it existed
        v = s.get(algorithm)
        if (v is not None or algorithm == checksum.SLOW) and not checksum.well_formed(algorithm, v):
            raise damaged(path, f"shards[{i}].{algorithm} is {short(v)}, not {checksum.describe(algorithm)}")
    tokens = s.get("tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise damaged(path, f"shards[{i}].tokens is {short(tokens)}, not a non-negative integer")
    stats = s.get("stats", {})
    counts = stats.get("nonfinite_by_layer", {}) if isinstance(stats, dict) else None
    if not isinstance(counts, dict) or not all(
        isinstance(k, str) and _count(v) for k, v in counts.items()
    ):  # what a --keep sample shard's accumulators are held to (integrity.check_shard)
        raise damaged(path, f"shards[{i}].stats.nonfinite_by_layer is {short(counts)}, not rows per layer")
    if not SHARD_FILE_RE.fullmatch(s["file"]):  # never a path: nothing outside the run is read or deleted
        raise damaged(path, f"shards[{i}].file {s['file']!r} is not a shard name geomscope writes")


def _count(v) -> bool:
    """A whole number >= 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_manifest(m, path: Path) -> dict:
    """The manifest's structure, checked before anything trusts it (a run may come from someone else).

    One InputError line names what is wrong: not an object, another format or a newer version, a
    missing or mistyped identity, layer list, shard entry or total, or a shard ``file`` that is not
    a plain shard name (a path could make resume delete, or score read, outside the run).
    """
    if not isinstance(m, dict) or m.get("format") != RUN_FORMAT:
        raise InputError(
            f"{path} is not a geomscope manifest; choose a run directory made by `geomscope extract`"
        )
    version = m.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise damaged(path, f"format_version is {version!r}")
    if version > FORMAT_VERSION:
        raise InputError(f"{path} has run format_version {version}; upgrade geomscope to read it")
    ident = m.get("identity")
    if not isinstance(ident, dict):
        raise damaged(path, "no identity object")
    layers = ident.get("layers")
    named = isinstance(layers, list) and all(
        isinstance(x, dict) and isinstance(x.get("name"), str) for x in layers
    )
    if not named:
        raise damaged(path, "identity.layers is not a list of named layers")
    names = [x["name"] for x in layers]
    for name in names:
        if not LAYER_NAME_RE.fullmatch(name):
            raise damaged(path, f"identity.layers names a layer {name!r}, not a name geomscope writes")
    if len(set(names)) != len(names):
        raise damaged(path, "identity.layers names a layer twice")
    for i, x in enumerate(layers):  # a layer's own width, where it is not the run's (its rows are held to it)
        d = x.get("dim")
        if d is not None and not (_count(d) and d > 0):
            raise damaged(path, f"identity.layers[{i}].dim is {short(d)}, not a positive integer")
    model = ident.get("model", {})
    if not isinstance(model, dict):
        raise damaged(path, "identity.model is not an object")
    width = model.get("hidden_size")
    if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
        raise damaged(path, f"identity.model.hidden_size is {short(width)}, not a positive integer")
    vocab = m.get("vocab_size")
    if vocab is not None and not (_count(vocab) and vocab > 0):  # token ids are held below it
        raise damaged(path, f"vocab_size is {short(vocab)}, not a positive integer")
    seed = ident.get("sample_seed")
    if seed is not None and not (_count(seed) and seed <= MAX_SEED):  # said back as --seed advice
        raise damaged(
            path, f"identity.sample_seed is {short(seed)}, not a whole number from 0 to {MAX_SEED_TEXT}"
        )
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise damaged(path, "shards is not a list")
    for i, s in enumerate(shards):
        _check_shard_entry(s, i, path)
    if not isinstance(m.get("totals", {}), dict) or not isinstance(m.get("complete", False), bool):
        raise damaged(path, "totals or complete has the wrong type")
    return m


def _names_itself_ours(path: Path) -> bool:
    """A JSON object that says it is a geomscope manifest (damaged or not): --overwrite may remove it."""
    try:
        m = read_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("format") == RUN_FORMAT


def read_manifest(path: Path | str) -> dict:
    """Read and check a manifest (InputError, one line, for anything unreadable or malformed): a
    local file (fileio.read_json: a regular file, never waited on, bounded in size and depth), or a
    URL's JSON text read through fsspec, which goes through the same checks (a shard ``file`` must be
    a plain shard name). Every reader of a manifest reads it here."""
    url = remote.is_url(path)
    try:
        m = loads_json(remote.read_text(path)) if url else read_json(path)
    except (OSError, ValueError) as e:
        why = first_line(e)
        hint = (
            "check the run at that URL, or extract it again"
            if url
            else "move it out of the way, or extract into a new --out"
        )
        raise InputError(f"{path} is unreadable ({why}); {hint}") from e
    return check_manifest(m, path)


def open_lock(run_dir: Path, *, create: bool):
    """The run's lock file as an fd: never through a link, never truncated (None: absent, not created)."""
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(run_dir / LOCK_NAME, flags, 0o644)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(
            f"{run_dir / LOCK_NAME} is not a plain file ({e.strerror}); remove it and rerun"
        ) from None


def being_written(run_dir: Path) -> bool:
    """Whether another process holds the run's lock right now (it is extracting into it)."""
    fd = open_lock(Path(run_dir), create=False)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def identity_digest(identity: dict) -> str:
    """sha256 of an identity's canonical JSON: a shard log belongs to the run whose digest it holds."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def read_logs(run_dir: Path) -> list[tuple[Path, str | None, list[dict]]]:
    """Every shard log (and ``.json`` part file) of ``run_dir``, links and other non-files left out:
    (path, the identity digest it was written for -- None when its header is damaged --, its
    well-formed shard entries). A damaged line of a log (the last one, torn by a crash) loses only
    its own shard; a damaged ``.json`` part file, all of its."""
    out = []
    for p in sorted(Path(run_dir).iterdir()):
        if not PART_RE.fullmatch(p.name) or p.is_symlink() or not p.is_file():
            continue
        try:
            text = read_regular_text(p, max_bytes=MAX_JSON_BYTES)
            digest, entries = _log_entries(text, p) if p.suffix == ".jsonl" else _part_entries(text, p)
        except (OSError, ValueError, AttributeError, TypeError, InputError):
            digest, entries = None, []
        out.append((p, digest, entries))
    return out


def read_parts(run_dir: Path, identity: dict) -> tuple[list[dict], list[Path]]:
    """(shard entries, files) of the shard logs of ``run_dir``: the entries of those written for
    ``identity``; every log is listed (another identity's, a damaged one) so that it is removed."""
    digest = identity_digest(identity)
    logs = read_logs(run_dir)
    return [e for _, d, entries in logs if d == digest for e in entries], [p for p, _, _ in logs]


def with_logged(shards: list[dict], logged: list[dict]) -> list[dict]:
    """The manifest's ``shards`` with the logged entries of shards it lacks, by index (a run being
    written or stopped: its logs run ahead of its manifest)."""
    by_index = {s["index"]: s for s in shards}
    for e in logged:
        by_index.setdefault(e["index"], e)
    return shards if len(by_index) == len(shards) else [by_index[k] for k in sorted(by_index)]


def _log_entries(text: str, path: Path) -> tuple[str, list[dict]]:
    lines = text.split("\n")
    digest = loads_json(lines[0])["identity_sha256"]
    out = []
    for i, line in enumerate(lines[1:], 1):
        try:
            e = loads_json(line)
            _check_shard_entry(e, i, path)
        except (ValueError, InputError):
            continue
        out.append(e)
    return digest, out


def _part_entries(text: str, path: Path) -> tuple[str, list[dict]]:
    """A part file of geomscope before the logs: one JSON document, checked whole."""
    part = loads_json(text)
    shards = part.get("shards")
    for i, e in enumerate(shards):
        _check_shard_entry(e, i, path)
    return part.get("identity_sha256"), shards


class ShardLog:
    """The append-only record of the shards one process finished (``part_name(rank)`` in the run
    directory): a header line naming the run's identity digest, then one JSON line per shard,
    fsynced before the shard counts as done. Recording a shard costs the same however many came
    before; a line torn by a crash is skipped by :func:`read_parts` (its shard is redone)."""

    def __init__(self, path: Path, identity: dict):
        self.path = Path(path)
        self.digest = identity_digest(identity)
        self._fd: int | None = None

    def append(self, entry: dict) -> None:
        if self._fd is None:
            self._open()
        write_all(self._fd, (json.dumps(entry) + "\n").encode("utf-8"))
        os.fsync(self._fd)
        if os.fstat(self._fd).st_nlink == 0:  # folded and removed by a run that took the directory over
            raise InputError(
                f"{self.path} was removed while this process was writing {self.path.parent}: "
                "another geomscope run took it over; let that run finish it"
            )

    def _open(self) -> None:
        # never through a planted link, never blocked on a FIFO; read and write for the last byte
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            raise InputError(f"cannot record a finished shard in {self.path} ({e.strerror})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise InputError(f"{self.path} is not a plain file; move it out of {self.path.parent}")
        if st.st_size == 0:
            write_all(fd, (json.dumps({"identity_sha256": self.digest}) + "\n").encode())
        elif os.pread(fd, 1, st.st_size - 1) != b"\n":  # a torn last line must not swallow the next
            write_all(fd, b"\n")
        os.fsync(fd)
        fsync_dir(self.path.parent)
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        """Close and delete the log: its shards are all in the manifest now."""
        self.close()
        self.path.unlink(missing_ok=True)


def _flatten(d, prefix=""):
    """Nested dicts and lists of dicts -> ``{"a.b": v, "layers.1.index": v}`` (other lists stay whole)."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        out[prefix + "count"] = len(d)
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out


def short(v) -> str:
    r = repr(v)
    return r if len(r) <= 70 else r[:67] + "..."


def identity_differences(old: dict, new: dict) -> list[str]:
    """Human-readable differences between two identity dicts (``key: old in the run, new now``).

    Lists of dicts are compared entry by entry (``layers.count: 7 in the run, 2 now``,
    ``layers.1.index: 1 in the run, 6 now``); long values are shortened.
    """
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for key in sorted(set(a) | set(b), key=lambda k: (k.split(".")[0], not k.endswith(".count"), k)):
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(
                f"{key}: {short(a.get(key, '<absent>'))} in the run, {short(b.get(key, '<absent>'))} now"
            )
    return diffs


def dumps_manifest(obj: dict) -> str:
    """JSON text of a manifest: indented, except that each ``shards`` entry is one line.

    The manifest is rewritten whole (when due: module docstring); ``json.dump(indent=2)`` runs
    Python's pure encoder over every entry each time (0.7 s per 100 saves of a 100-shard run), while
    one line per entry uses the C encoder and keeps the file readable and diffable.
    """
    parts = []
    for k, v in obj.items():
        if k == "shards" and isinstance(v, list):
            body = ",\n    ".join(json.dumps(e) for e in v)
            parts.append(f"  {json.dumps(k)}: " + (f"[\n    {body}\n  ]" if v else "[]"))
        else:
            parts.append(f"  {json.dumps(k)}: " + json.dumps(v, indent=2).replace("\n", "\n  "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_json_atomic(path: Path, obj: dict) -> None:
    """The manifest in its own layout (:func:`dumps_manifest`), any other JSON indented."""
    write_text_atomic(
        path, dumps_manifest(obj) if path.name == MANIFEST_NAME else json.dumps(obj, indent=2) + "\n"
    )


class RankWriter:
    """Process ``rank`` > 0 of a multi-process extract: it writes its shards into the run directory
    that process 0 has opened (and locked) and records them in its own shard log, which process 0
    folds into the manifest (:meth:`RunWriter.fold_parts`). Same interface as RunWriter for
    ``extract``'s shard loop."""

    def __init__(self, run_dir: Path, rank: int):
        self.dir = Path(run_dir)
        self.path = self.dir / MANIFEST_NAME
        self.manifest = read_manifest(self.path)
        self.identity = self.manifest["identity"]
        self.log = ShardLog(self.dir / part_name(rank), self.identity)

    @property
    def finished(self) -> dict[int, ShardInfo]:
        return {s["index"]: ShardInfo.from_dict(s) for s in self.manifest["shards"]}

    def shard_writer(self, index: int, **kw) -> ShardWriter:
        return ShardWriter(self.dir / shard_name(index), index=index, **kw)

    def add_shard(self, info: ShardInfo, stats: dict | None = None) -> None:
        self.log.append(_entry(info, stats))

    def release(self) -> None:
        self.log.close()


def _entry(info: ShardInfo, stats: dict | None) -> dict:
    entry = info.to_dict()
    if stats:
        entry["stats"] = stats
    return entry


class RunWriter:
    """Owns a run directory while ``extract`` writes it.

    ``identity`` is everything that determines the stored rows and values (model, revision, layers,
    dtypes, inputs and their hashes, truncation, ...), *not* batch size or device.  Opening an
    existing run with the same identity resumes it: finished shards are kept and reported by
    :attr:`finished`.  A different identity is refused with the differences named, unless
    ``overwrite=True``.  An exclusive lock keeps two writers out of one directory.
    """

    def __init__(self, run_dir: Path, identity: dict, *, overwrite: bool = False, extra: dict | None = None):
        self._lock_fd = None
        self.dir = Path(run_dir)
        self.identity = identity
        self.path = self.dir / MANIFEST_NAME
        self.log = ShardLog(self.dir / part_name(0), identity)
        # when the manifest was last rewritten and how long that took (REWRITE_RATIO); whether it
        # lacks shards that the log has; the publisher thread records shards while the main thread
        # may save or release (a second Ctrl-C does not wait for the publisher)
        self._saved_at, self._save_cost, self._unsaved = 0.0, 0.0, False
        self._guard = threading.RLock()
        self._released = False
        if self.dir.exists() and not self.dir.is_dir():
            raise InputError(f"--out {self.dir} is a file; give a directory for the run")
        existing = self._read_existing(overwrite)
        if (
            existing is None
            and self.dir.exists()
            and any(p.name not in (LOCK_NAME,) for p in self.dir.iterdir())
        ):
            raise InputError(
                f"--out {self.dir} is not empty and holds no geomscope run; choose a new or empty directory"
            )
        make_dirs(self.dir)
        self._lock()
        existing = self._take_over(existing, identity, overwrite)
        # leftovers of an interrupted shard are never trusted (only geomscope's own temporary names)
        for tmp in self.dir.glob(".shard-*.tmp"):
            if SHARD_TEMP_RE.fullmatch(tmp.name) and (tmp.is_symlink() or tmp.is_file()):
                tmp.unlink()
        if existing is None:
            self._start_manifest(identity, extra)
        else:
            self._resume_manifest(existing, extra)

    def _lock(self) -> None:
        """Take the run directory's exclusive lock, or refuse: another process is writing it."""
        self._lock_fd = open_lock(self.dir, create=True)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise InputError(
                f"another geomscope process is writing {self.dir}; wait for it or choose another --out"
            ) from None

    def _take_over(self, existing: dict | None, identity: dict, overwrite: bool) -> dict | None:
        """With the lock held, before anything is written: the shard logs' names cleared, and the run
        already there removed (``overwrite``) or held to ``identity`` (a different one is refused with
        the differences named); return the run to resume (None: a new one). A refusal or a failure
        of these steps releases the lock first."""
        try:
            self._clear_log_names()
            self._refuse_folders_at_shard_names()
        except BaseException:
            self.release()
            raise
        if existing is not None and overwrite:
            try:
                self._wipe(existing)
            except BaseException:
                self.release()
                raise
            return None
        if existing is not None:
            diffs = identity_differences(existing.get("identity", {}), identity)
            if diffs:
                self.release()
                raise InputError(
                    f"{self.dir} holds a run made with different options ({'; '.join(diffs[:3])}"
                    f"{'; ...' if len(diffs) > 3 else ''}); "
                    "rerun with --overwrite to start over or choose another --out"
                )
        return existing

    def _start_manifest(self, identity: dict, extra: dict | None) -> None:
        """A new run's manifest (no shard yet, not complete, with the ``extra`` fields), saved."""
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.manifest = {
            "format": RUN_FORMAT,
            "format_version": FORMAT_VERSION,
            "created": now,
            "identity": identity,
            "shards": [],
            "totals": {},
            "complete": False,
        }
        self.manifest.update(extra or {})
        self._save()

    def _resume_manifest(self, existing: dict, extra: dict | None) -> None:
        """The manifest of the run being resumed: the ``extra`` fields it lacks added, its intact
        shards kept (and those its shard logs recorded folded in), marked not complete."""
        self.manifest = existing
        if extra:
            self.manifest.update({k: v for k, v in extra.items() if k not in self.manifest})
        # keep only shards whose files match their size and checksum: the rest are redone
        self.manifest["shards"] = [s for s in self.manifest["shards"] if self._intact(s)]
        self.manifest["complete"] = False
        self.fold_parts()

    def _clear_log_names(self) -> None:
        """Before anything is removed or written: a link at a shard log's name is removed (it is
        replaced by the log, never written through); anything else that is not a plain file there
        is refused."""
        logs = [p for p in self.dir.iterdir() if PART_RE.fullmatch(p.name)]
        for p in logs:
            if not p.is_symlink() and not p.is_file():
                raise InputError(f"{p} is not a file geomscope wrote; move it out of {self.dir} and rerun")
        for p in logs:
            if p.is_symlink():
                p.unlink()

    def _refuse_folders_at_shard_names(self) -> None:
        """A folder at a shard's name, listed or still to be written, is refused before any work: a
        shard is put in place by a rename, which cannot replace a folder, and geomscope removes only
        what it wrote."""
        for p in self.dir.iterdir():
            if SHARD_FILE_RE.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
                raise InputError(
                    f"{p} is a directory, not a file geomscope wrote; move it out of {self.dir} and rerun"
                )

    # -- reading -------------------------------------------------------------------------------------
    def _read_existing(self, overwrite: bool) -> dict | None:
        if not self.path.exists() and not self.path.is_symlink():
            return None
        if self.path.is_symlink() or not self.path.is_file():
            raise InputError(f"{self.path} is not a plain file; choose another --out")
        try:
            return read_manifest(self.path)
        except InputError:
            if overwrite and _names_itself_ours(self.path):
                return {"shards": []}  # ours but damaged: --overwrite removes it and temporaries, starts over
            raise

    def _intact(self, entry: dict) -> bool:
        """A finished shard is kept on resume only if it is a plain file that passes what every read
        holds it to (integrity.verify_shard_task: the recorded size and checksum -- xxh3_128, or the
        sha256 of an entry without it: store/checksum.py --, its structure, documents and flags,
        a sample's accumulators, size and seed); any other is redone."""
        p = self.dir / entry["file"]
        if p.is_symlink() or not p.is_file():
            return False
        width = (self.identity.get("model") or {}).get("hidden_size") or 0
        vocab = self.manifest.get("vocab_size")
        task = shard_task(
            p, ShardInfo.from_dict(entry), self.identity, width, entry.get("stats"), vocab=vocab
        )
        try:
            verify_shard_task(task, [layer["name"] for layer in self.identity.get("layers", [])])
        except DataError:
            return False
        return True

    @property
    def finished(self) -> dict[int, ShardInfo]:
        """Finished shards by index."""
        return {s["index"]: ShardInfo.from_dict(s) for s in self.manifest["shards"]}

    # -- writing -------------------------------------------------------------------------------------
    def shard_writer(
        self,
        index: int,
        *,
        layer_names,
        dim,
        store_dtype,
        doc_start: int = 0,
        doc_stop: int = 0,
        expected_rows: int | None = None,
        row_flags: tuple[str, ...] = (),
        dims: dict[str, int] | None = None,
    ) -> ShardWriter:
        return ShardWriter(
            self.dir / shard_name(index),
            index=index,
            layer_names=layer_names,
            dim=dim,
            store_dtype=store_dtype,
            doc_start=doc_start,
            doc_stop=doc_stop,
            expected_rows=expected_rows,
            row_flags=row_flags,
            dims=dims,
        )

    def add_shard(self, info: ShardInfo, stats: dict | None = None) -> None:
        """Record a published shard: a line in the shard log at once (durable), the manifest when
        a rewrite is due (module docstring).

        ``stats`` (optional, JSON-able) is kept in the shard's entry under ``"stats"`` -- counts that
        only the writer knows (e.g. documents skipped, rows with NaN per layer) and that a resumed run
        must be able to total without re-reading the shard.
        """
        entry = _entry(info, stats)
        with self._guard:
            if self._released:
                raise InputError(
                    f"{self.dir} was closed before shard {info.index} was recorded; rerun to redo it"
                )
            self.log.append(entry)
            shards = self.manifest["shards"]
            if shards and shards[-1]["index"] >= info.index:  # a gap a resumed run fills: rare
                shards = [s for s in shards if s["index"] != info.index]
                shards.append(entry)
                shards.sort(key=lambda s: s["index"])
                self.manifest["shards"] = shards
            else:  # shards are published in order: appending keeps the list sorted
                shards.append(entry)
            self._unsaved = True
            if time.monotonic() - self._saved_at >= REWRITE_RATIO * self._save_cost:
                self._save()

    def fold_parts(self) -> None:
        """Move the intact shards that the processes recorded in their shard logs (this one's
        included) into the manifest, save it, then remove the logs (the end of a multi-process
        extract, see ranks.py; and a resumed run)."""
        entries, files = read_parts(self.dir, self.identity)
        have = {s["index"] for s in self.manifest["shards"]}
        for e in entries:
            if e["index"] not in have and self._intact(e):
                self.manifest["shards"].append(e)
                have.add(e["index"])
        self.manifest["shards"].sort(key=lambda s: s["index"])
        self._save()
        self.log.close()
        for p in files:
            p.unlink(missing_ok=True)

    def update(self, **fields) -> None:
        """Set top-level manifest fields (e.g. ``totals``, ``planned_shards``) and save."""
        self.manifest.update(fields)
        self._save()

    def finalize(self, totals: dict) -> dict:
        """Mark the run complete with its totals."""
        shards = self.manifest["shards"]
        totals = dict(totals)
        # the rows measured (a --keep sample shard stores fewer: its tokens), as manifest_problems counts
        totals.setdefault("rows", sum(s.get("tokens", s["rows"]) for s in shards))
        totals.setdefault("shards", len(shards))
        totals.setdefault("nonfinite_rows", sum(s["nonfinite_rows"] for s in shards))
        totals.setdefault("bytes", sum(s["bytes"] for s in shards))
        self.manifest["totals"] = totals
        self.manifest["complete"] = True
        self.manifest["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._save()
        self.log.remove()
        return self.manifest

    def _save(self) -> None:
        with self._guard:
            start = time.monotonic()
            write_json_atomic(self.path, self.manifest)
            self._saved_at = time.monotonic()
            self._save_cost = self._saved_at - start
            self._unsaved = False

    def _wipe(self, existing: dict) -> None:
        """--overwrite: remove exactly what the manifest lists and geomscope's own temporary files.

        Everything is checked before anything is removed: a listed name that is a directory (not a
        shard geomscope wrote) is refused, so a failed --overwrite leaves the run as it was.
        """
        listed = [self.dir / s["file"] for s in existing["shards"]]
        in_parts, parts = read_parts(self.dir, existing.get("identity", {}))
        listed += [self.dir / s["file"] for s in in_parts]
        temps = [
            p
            for p in self.dir.iterdir()
            if SHARD_TEMP_RE.fullmatch(p.name) or p.name.startswith(TEMP_PREFIX) or p in parts
        ]
        for p in (*listed, *temps):
            if p.is_dir() and not p.is_symlink():
                raise InputError(
                    f"{p} is a directory, not a file geomscope wrote; move it out of {self.dir} "
                    "and rerun with --overwrite"
                )
        for p in (*listed, *temps):
            p.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Bring the manifest up to date with the log (a run that stopped or failed) and unlock."""
        if self._lock_fd is None:
            return
        with self._guard:  # after a shard being recorded; none is recorded after this
            self._released = True
            if self._unsaved:
                try:
                    self._save()
                except OSError:
                    pass  # the log has every shard: resume and readers fold it in
            self.log.close()
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
