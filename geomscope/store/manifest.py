"""The run manifest: identity, finished shards, totals; atomic updates, resume and locking."""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import shutil
from pathlib import Path

from geomscope.errors import InputError
from geomscope.fileio import write_text_atomic
from geomscope.store.shard import ShardInfo, ShardWriter

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".geomscope.lock"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.h5"


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


def _short(v) -> str:
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
                f"{key}: {_short(a.get(key, '<absent>'))} in the run, {_short(b.get(key, '<absent>'))} now"
            )
    return diffs


def dumps_manifest(obj: dict) -> str:
    """JSON text of a manifest: indented, except that each ``shards`` entry is one line.

    The manifest is rewritten after every shard; ``json.dump(indent=2)`` runs Python's pure encoder
    over every entry each time (0.7 s per 100 saves of a 100-shard run), while one line per entry uses
    the C encoder and keeps the file readable and diffable.
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


class RunWriter:
    """Owns a run directory while ``extract`` writes it.

    ``identity`` is everything that determines the stored rows and values (model, revision, layers,
    dtypes, inputs and their hashes, truncation, ...), *not* batch size or device.  Opening an
    existing run with the same identity resumes it: finished shards are kept and reported by
    :attr:`finished`.  A different identity is refused with the differences named, unless
    ``overwrite=True``.  An exclusive lock keeps two writers out of one directory.
    """

    def __init__(self, run_dir: Path, identity: dict, *, overwrite: bool = False, extra: dict | None = None):
        self.dir = Path(run_dir)
        self.identity = identity
        self.path = self.dir / MANIFEST_NAME
        if self.dir.exists() and not self.dir.is_dir():
            raise InputError(f"--out {self.dir} is a file; give a directory for the run")
        existing = self._read_existing()
        if (
            existing is None
            and self.dir.exists()
            and any(p.name not in (LOCK_NAME,) for p in self.dir.iterdir())
        ):
            raise InputError(
                f"--out {self.dir} is not empty and holds no geomscope run; choose a new or empty directory"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.dir / LOCK_NAME, "w")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.close()
            raise InputError(
                f"another geomscope process is writing {self.dir}; wait for it or choose another --out"
            ) from None
        if existing is not None and overwrite:
            self._wipe()
            existing = None
        elif existing is not None:
            diffs = identity_differences(existing.get("identity", {}), identity)
            if diffs:
                self.release()
                raise InputError(
                    f"{self.dir} holds a run made with different options ({'; '.join(diffs[:3])}"
                    f"{'; ...' if len(diffs) > 3 else ''}); "
                    "rerun with --overwrite to start over or choose another --out"
                )
        # leftovers of an interrupted shard are never trusted
        for tmp in self.dir.glob(".shard-*.h5.tmp"):
            tmp.unlink()
        if existing is None:
            now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            self.manifest = {
                "format": "geomscope-run",
                "format_version": FORMAT_VERSION,
                "created": now,
                "identity": identity,
                "shards": [],
                "totals": {},
                "complete": False,
            }
            self.manifest.update(extra or {})
            self._save()
        else:
            self.manifest = existing
            if extra:
                self.manifest.update({k: v for k, v in extra.items() if k not in self.manifest})
            # keep only shards whose files are present and of the recorded size
            kept = []
            for s in self.manifest.get("shards", []):
                p = self.dir / s["file"]
                if p.exists() and p.stat().st_size == s["bytes"]:
                    kept.append(s)
            self.manifest["shards"] = kept
            self.manifest["complete"] = False
            self._save()

    # -- reading -------------------------------------------------------------------------------------
    def _read_existing(self) -> dict | None:
        if not self.path.exists():
            return None
        try:
            with open(self.path) as f:
                m = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"{self.path} is unreadable ({e}); rerun with --overwrite to start over") from e
        if m.get("format") != "geomscope-run":
            raise InputError(f"{self.path} is not a geomscope manifest; choose another --out")
        return m

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
        doc_start=0,
        doc_stop=0,
        expected_rows: int | None = None,
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
        )

    def add_shard(self, info: ShardInfo, stats: dict | None = None) -> None:
        """Record a published shard; the manifest is replaced atomically.

        ``stats`` (optional, JSON-able) is kept in the shard's entry under ``"stats"`` -- counts that
        only the writer knows (e.g. documents skipped, rows with NaN per layer) and that a resumed run
        must be able to total without re-reading the shard.
        """
        shards = [s for s in self.manifest["shards"] if s["index"] != info.index]
        entry = info.to_dict()
        if stats:
            entry["stats"] = stats
        shards.append(entry)
        shards.sort(key=lambda s: s["index"])
        self.manifest["shards"] = shards
        self._save()

    def update(self, **fields) -> None:
        """Set top-level manifest fields (e.g. ``totals``, ``planned_shards``) and save."""
        self.manifest.update(fields)
        self._save()

    def finalize(self, totals: dict) -> dict:
        """Mark the run complete with its totals."""
        shards = self.manifest["shards"]
        totals = dict(totals)
        totals.setdefault("rows", sum(s["rows"] for s in shards))
        totals.setdefault("shards", len(shards))
        totals.setdefault("nonfinite_rows", sum(s["nonfinite_rows"] for s in shards))
        totals.setdefault("bytes", sum(s["bytes"] for s in shards))
        self.manifest["totals"] = totals
        self.manifest["complete"] = True
        self.manifest["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._save()
        return self.manifest

    def _save(self) -> None:
        write_json_atomic(self.path, self.manifest)

    def _wipe(self) -> None:
        for p in self.dir.iterdir():
            if p.name == LOCK_NAME:
                continue
            if p.name == MANIFEST_NAME or p.name.startswith(("shard-", ".shard-", ".manifest")):
                p.unlink()
            elif p.is_dir() and p.name.startswith("shard"):
                shutil.rmtree(p)

    def release(self) -> None:
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
