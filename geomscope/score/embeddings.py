"""Partition isotropy I(W) of the run's checkpoint: its input and output embedding matrices.

The matrices are read by :func:`geomscope.model.embeddings.read_embedding_matrices` (the model
room's side of the work); this module finds the checkpoint the manifest records and scores
them. Tied input/output embeddings are reported once and marked ``"tied": true``; a checkpoint
without an output matrix (e.g. a bare encoder) reports ``"output": null`` with the reason.

The checkpoint must be the one the run was extracted from: a hub model is looked up at the commit
the run recorded (not at its revision's name, which may have moved since), and the weights'
fingerprint the run recorded is compared with the checkpoint's as it is now (a folder overwritten
since, by finetune --overwrite or a new download, holds other weights): on a difference I(W) is
null, with the reason, rather than another model's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from geomscope.errors import DataError, first_line
from geomscope.model.embeddings import find_checkpoint, read_embedding_matrices
from geomscope.score.sources import SourceInfo

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def _iso(w: np.ndarray) -> dict:
    from geomscope.metrics import partition_isotropy

    return {
        "raw": partition_isotropy(w, centred=False)["I"],
        "centred": partition_isotropy(w, centred=True)["I"],
    }


def _pinned(model: dict) -> dict:
    """The run's model record with the recorded commit as the revision to look up in the hub cache:
    a ref moved since (a re-download of ``main``) names other weights."""
    commit = model.get("commit")
    if isinstance(commit, str) and _COMMIT_RE.fullmatch(commit):
        return {**model, "revision": commit}
    return model


def _other_weights(ckpt: Path, model: dict) -> str:
    """Why ``ckpt`` is not the checkpoint the run recorded ("" when it is, or when the run recorded
    no fingerprint to compare: a run of a model that was not a local folder or a cached snapshot)."""
    from geomscope.model.fingerprint import WEIGHTS_KEY, legacy_weights_fingerprint, weights_fingerprint

    if isinstance(model.get(WEIGHTS_KEY), str):
        recorded, fingerprint = model[WEIGHTS_KEY], weights_fingerprint
    elif isinstance(model.get("weights_sha256"), str):  # no WEIGHTS_KEY: the head-and-tail hash
        recorded, fingerprint = model["weights_sha256"], legacy_weights_fingerprint
    else:
        return ""
    try:
        now = fingerprint(ckpt)
    except OSError as e:
        return f"the weights in {ckpt} cannot be read to compare with the run's ({e.strerror or e})"
    if now != recorded:
        return (
            f"the checkpoint in {ckpt} holds other weights than the run was extracted from (its "
            "fingerprint differs from the manifest's: overwritten since?); I(W) would describe another model"
        )
    return ""


def embedding_isotropy(src: SourceInfo) -> tuple[dict | None, str]:
    """(embeddings section of the report, "") or (None, why it is null)."""
    from geomscope.model.files import damage_errors

    if src.kind != "run":
        return None, "an array has no model checkpoint"
    ident = dict(getattr(src.run_obj, "identity", {}) or {})
    model = ident.get("model") if isinstance(ident.get("model"), dict) else {}
    manifest = getattr(src.run_obj, "manifest", {}) or {}
    source = manifest.get("model_source") if isinstance(manifest.get("model_source"), dict) else {}
    ckpt = find_checkpoint(
        {**_pinned(model), **{k: v for k, v in source.items() if k == "path"}},
        {**ident, "model": _pinned(model)},
    )
    if ckpt is None:
        return (
            None,
            "the model checkpoint recorded in the manifest is not at hand (no local directory or cache)",
        )
    try:
        why = _other_weights(ckpt, model)
        if why:
            return None, why
        mats = read_embedding_matrices(ckpt)
        if mats is None:
            return None, f"no input embedding matrix found in {ckpt}"
        out = {
            "input": _iso(mats.input),
            "output": None,
            "tied": mats.tied,
            "checkpoint": str(ckpt),
            "input_key": mats.input_key,
            "output_key": mats.output_key,
            "note": mats.note,
        }
        if mats.tied:
            out["output"] = dict(out["input"])
        elif mats.output is not None:
            out["output"] = _iso(mats.output)
        return out, ""
    # a damaged checkpoint (a truncated or garbage pytorch_model.bin: RuntimeError, EOFError; a
    # config of the wrong types ...) is a null I(W) with its reason, not the end of the scoring
    except (OSError, ValueError, DataError, *damage_errors()) as e:
        return None, f"could not read the embedding matrices from {ckpt}: {first_line(e)}"
