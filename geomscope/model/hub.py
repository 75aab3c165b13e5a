"""The Hugging Face hub and its local cache, as model loading and ``extract --revisions`` see them.

- :func:`offline_mode`: whether the hub is switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE);
- :func:`check_hub_model`: one request without retries that refuses, in one line within seconds, a
  hub name that cannot be loaded (a typo, a revision it lacks, no network);
- the cache: a repository's folder (:func:`repo_cache_dir`), the snapshot a revision resolves to
  (:func:`cached_snapshot`), the refs it holds (:func:`cached_revisions`), the commit the weights
  came from (:func:`commit_of`), and deleting a snapshot with the blobs only it links to
  (:func:`drop_snapshot`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from geomscope.errors import InputError

#: seconds the hub may take per phase (connect, answer) of the one request that checks a hub name
HUB_CHECK_SECONDS = 3.0
_HUB_CHECKED: set[tuple[str, str | None, str | None]] = set()


def check_hub_model(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | None = None,
    log: Callable[[str], None] | None = None,
) -> None:
    """Refuse, in one line and within seconds, a hub model that cannot be loaded: a name the hub
    does not know, a revision or config.json it lacks, or no network.

    Nothing is asked when offline mode is on (the load reads the cache and says what it lacks);
    otherwise one HEAD request for its config.json, at the hub address huggingface_hub uses, without
    retries (huggingface_hub's loads retry a failed connection five times over about 25 s). When the
    hub cannot be reached but the local cache holds the revision, the rest of the process reads the
    cache only (:func:`_cache_only`, which says so to ``log``). A name checked once is not asked
    again in this process.
    """
    key = (repo_id, revision or None, cache_dir)
    if key in _HUB_CHECKED or offline_mode():
        return
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        url = hf_hub_url(repo_id, "config.json", revision=revision or None)
        get_hf_file_metadata(url, timeout=HUB_CHECK_SECONDS, retry_on_errors=False)
    except Exception as e:  # noqa: BLE001 -- each kind is said in words below
        if cached_snapshot(repo_id, revision, cache_dir) is None:
            raise _hub_error(e, repo_id, revision) from None
        if not isinstance(e, HfHubHTTPError):  # no network: what the cache holds, without retries
            _cache_only(f"{repo_id}@{revision}" if revision else repo_id, e, log)
    _HUB_CHECKED.add(key)


def _cache_only(at: str, exc: Exception, log: Callable[[str], None] | None) -> None:
    """The hub cannot be reached and the local cache holds the model: offline mode for the rest of
    this process, as HF_HUB_OFFLINE=1 would set it (else every optional file transformers asks for,
    absent from the cache, is retried five times over ~25 s), said to ``log`` (None: unsaid)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    why = " ".join(str(exc).split())[:120] or type(exc).__name__
    if log is None:
        return
    log(
        f"note: the Hugging Face hub cannot be reached ({why}); loading {at} from the local cache "
        "(set HF_HUB_OFFLINE=1 to skip asking)"
    )


def _hub_error(exc: Exception, repo_id: str, revision: str | None) -> InputError:
    """The one line for a failed hub check (see check_hub_model), naming both ways round it."""
    from huggingface_hub import errors as hf

    at = f"{repo_id}@{revision}" if revision else repo_id
    alternatives = (
        "give a local model directory, or set HF_HUB_OFFLINE=1 to load a model the local cache holds"
    )
    if isinstance(exc, hf.GatedRepoError):
        return InputError(
            f"model {repo_id} is gated on the Hugging Face hub: accept its terms there and log in "
            f"(hf auth login); or {alternatives}"
        )
    if isinstance(exc, hf.RepositoryNotFoundError):
        return InputError(
            f"unknown model {repo_id}: no such repository on the Hugging Face hub (or it is private: "
            f"log in with hf auth login); check the name, {alternatives}"
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return InputError(
            f"model {repo_id} has no revision {revision!r} on the hub; give a tag, "
            f"branch or commit it has, {alternatives}"
        )
    if isinstance(exc, hf.EntryNotFoundError):
        return InputError(
            f"model {at} on the Hugging Face hub has no config.json, so transformers cannot load it; "
            f"{alternatives}"
        )
    why = " ".join(str(exc).split())[:160] or type(exc).__name__
    if isinstance(exc, hf.HfHubHTTPError):
        return InputError(f"the Hugging Face hub refused model {at} ({why}); retry later, or {alternatives}")
    return InputError(
        f"cannot reach the Hugging Face hub to load model {at} ({why}); check the network, or {alternatives}"
    )


def offline_mode() -> bool:
    """Whether the Hugging Face hub is switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return False


def repo_cache_dir(repo_id: str, cache_dir: str | None = None) -> Path:
    """The hub cache's folder of ``repo_id`` (``models--org--name``; it may not exist)."""
    from huggingface_hub import constants

    base = cache_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # env: set after import
    return Path(base) / ("models--" + repo_id.replace("/", "--"))


COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The local snapshot directory of ``repo_id@revision`` in the hub cache (None when not cached)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        got = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision or None)
    except Exception:
        return None
    if isinstance(got, str):
        return Path(got).parent
    return _snapshot_by_ref(repo_id, revision, cache_dir)


def _snapshot_by_ref(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The snapshot a ref file names once stripped. try_to_load_from_cache matches the file's bytes
    exactly, so for a ref written by hand with a trailing newline it finds nothing while the load
    (which strips it) reads that snapshot: without this the run would record no commit, path or
    weights, and a moved ref would go unnoticed. Only a commit-shaped name of a plain directory under
    snapshots/ is taken (a ref is data in the cache, never a path to follow)."""
    rev = revision or "main"
    if rev.startswith("/") or "\\" in rev or any(part in ("", ".", "..") for part in rev.split("/")):
        return None
    try:
        repo = repo_cache_dir(repo_id, cache_dir)
        ref = repo / "refs" / rev
        if ref.is_symlink() or not ref.is_file():
            return None
        with open(ref, "rb") as f:
            commit = f.read(256).decode("ascii").strip()
        snap = repo / "snapshots" / commit
        if not COMMIT_RE.fullmatch(commit) or snap.is_symlink() or not snap.is_dir():
            return None
        return snap if (snap / "config.json").is_file() else None
    except (OSError, UnicodeDecodeError, ImportError, ValueError):
        return None


def cached_revisions(repo_id: str, cache_dir: str | None = None) -> list[str]:
    """The refs (branches, tags, ``stepN`` revisions) the local hub cache holds for ``repo_id``."""
    try:
        root = repo_cache_dir(repo_id, cache_dir) / "refs"
        return sorted((str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()), key=natural_key)
    except (OSError, ImportError, ValueError):
        return []


def natural_key(s: str):
    """A sort key that orders the numbers in a name by value (step5 before step10)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def commit_of(info: dict, revision: str | None) -> str | None:
    """The hub commit the weights came from: the snapshot directory's name, or a commit-hash revision."""
    if info.get("path"):
        m = re.search(r"/snapshots/([0-9a-f]{40})/?$", info["path"])
        if m:
            return m.group(1)
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    return None


def snapshot_names(repo_id: str, cache_dir: str | None) -> set[str] | None:
    """The names under the repository's ``snapshots/`` in the hub cache now (None for a cache that
    cannot be listed)."""
    try:
        folder = repo_cache_dir(repo_id, cache_dir) / "snapshots"
        return {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    except (OSError, ImportError, ValueError):
        return None


def drop_snapshot(snap: Path) -> int:
    """Delete one hub-cache snapshot directory and the blobs that no other snapshot of the repository
    links to; return the bytes freed. Anything that does not look like a hub cache entry
    (``models--*/snapshots/<commit>``) is left alone and 0 returned."""
    snap = Path(snap)
    repo = snap.parent.parent
    if snap.parent.name != "snapshots" or not repo.name.startswith("models--") or snap.is_symlink():
        return 0
    blobs = (repo / "blobs").resolve()

    def targets(root: Path) -> set[Path]:
        out = set()
        for f in root.rglob("*"):
            if f.is_symlink():
                t = Path(os.path.realpath(f))
                if t.parent == blobs:
                    out.add(t)
        return out

    mine = targets(snap)
    others: set[Path] = set()
    for other in (repo / "snapshots").iterdir():
        if other != snap and other.is_dir() and not other.is_symlink():
            others |= targets(other)
    freed = 0
    for t in mine - others:
        if t.is_file():
            freed += t.stat().st_size
            t.unlink()
    for f in snap.rglob("*"):  # files stored in the snapshot itself (no blob)
        if f.is_file() and not f.is_symlink():
            freed += f.stat().st_size
    shutil.rmtree(snap)
    return freed
