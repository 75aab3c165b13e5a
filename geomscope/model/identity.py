"""What a run records of its model: :func:`model_request` before loading it (what ``extract
--revisions`` compares to skip a finished run), :func:`loaded_identity` once loaded (the run's
``identity.model``, which a resume must match)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from geomscope.model.fingerprint import WEIGHTS_KEY, tokenizer_fingerprint, weights_fingerprint
from geomscope.model.hub import cached_snapshot, commit_of
from geomscope.model.names import resolve_model

if TYPE_CHECKING:
    from geomscope.model.loaded import LoadedModel


def model_request(name: str, revision: str | None, cache_dir: str | None) -> dict | None:
    """The model a run asks for, found without loading it and without a hub request: the canonical
    name, source, revision and package (:func:`~geomscope.model.names.resolve_model`); for a local
    directory or the bundled model the fingerprints of its weights (and config) and tokenizer; for
    a hub name the commit the local cache resolves the revision to (None when it is not cached).
    None when the model's files cannot be read."""
    target, info = resolve_model(str(name), revision, reach_hub=False)
    rec = {k: info.get(k) for k in ("name", "source", "revision", "package")}
    try:
        if info.get("path"):
            path = Path(info["path"])
            rec.update(weights=weights_fingerprint(path), tokenizer=tokenizer_fingerprint(path))
        else:
            snap = cached_snapshot(target, revision, cache_dir)
            rec["commit"] = commit_of({"path": str(snap)} if snap else {}, revision)
    except OSError:
        return None
    return rec


def loaded_identity(lm: LoadedModel, info: dict, config, tok, revision: str | None, dtype: str) -> dict:
    """What a run records of the model it loaded (``identity.model``): its name, revision and
    commit, architecture, width, number of hidden states, stack, attention, dtype, and the
    fingerprints of its weights and tokenizer (None for a model with no local files)."""
    path = Path(info["path"]) if info.get("path") else None
    return {
        "name": info["name"],
        "revision": revision or None,
        "commit": commit_of(info, revision),
        "model_type": config.model_type,
        "architecture": type(lm.model).__name__,
        "hidden_size": lm.hidden_size,
        "num_hidden_states": lm.n_hidden_states,
        "stack": lm.stack,
        "attention": lm.attention,
        "dtype": dtype,
        WEIGHTS_KEY: weights_fingerprint(path) if path else None,
        "tokenizer_sha256": tokenizer_fingerprint(path) if path else None,
        "tokenizer_class": type(tok).__name__,
    }
