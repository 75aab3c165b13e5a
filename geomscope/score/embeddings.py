"""Partition isotropy I(W) of the run's checkpoint: its input and output embedding matrices.

The matrices are read by :func:`geomscope.extract.embeddings.read_embedding_matrices` (model
loading's side of the work); this module finds the checkpoint the manifest records and scores
them. Tied input/output embeddings are reported once and marked ``"tied": true``; a checkpoint
without an output matrix (e.g. a bare encoder) reports ``"output": null`` with the reason.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError
from geomscope.extract.embeddings import find_checkpoint, read_embedding_matrices
from geomscope.score.sources import SourceInfo


def _iso(w: np.ndarray) -> dict:
    from geomscope.metrics import partition_isotropy

    return {
        "raw": partition_isotropy(w, centred=False)["I"],
        "centred": partition_isotropy(w, centred=True)["I"],
    }


def embedding_isotropy(src: SourceInfo) -> tuple[dict | None, str]:
    """(embeddings section of the report, "") or (None, why it is null)."""
    if src.kind != "run":
        return None, "an array has no model checkpoint"
    ident = dict(getattr(src.run_obj, "identity", {}) or {})
    manifest = getattr(src.run_obj, "manifest", {}) or {}
    source = manifest.get("model_source") if isinstance(manifest.get("model_source"), dict) else {}
    ckpt = find_checkpoint(
        {**(ident.get("model") or {}), **{k: v for k, v in source.items() if k == "path"}}, ident
    )
    if ckpt is None:
        return (
            None,
            "the model checkpoint recorded in the manifest is not at hand (no local directory or cache)",
        )
    try:
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
    except (OSError, ValueError, KeyError, DataError) as e:
        return None, f"could not read the embedding matrices from {ckpt}: {str(e).splitlines()[0]}"
