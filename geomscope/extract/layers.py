"""Which hidden states to keep: parsing ``--layers`` and describing each kept layer.

Index ``i`` is the position in the tuple ``output_hidden_states=True`` returns: 0 is the embedding
output, ``i >= 1`` the output of block ``i``.  The last entry may have gone through the model's
final norm (GPT-2's ``ln_f``, Pythia's ``final_layer_norm``, T5's ``final_layer_norm``), so it can
differ from the last block's raw output; BERT-style post-LN models have no final norm.
"""

from __future__ import annotations

import re

from geomscope.errors import InputError

LAYER_NOTE = (
    "index = position in output_hidden_states (0 = embedding output, i = output of block i); "
    "final_norm = true means that entry went through the model's final norm, so it differs from the "
    "last block's raw output"
)


def layer_name(index: int, n_hidden_states: int) -> str:
    width = max(2, len(str(n_hidden_states - 1)))
    return f"layer_{index:0{width}d}"


def parse_layers(spec: str | list | tuple | None, n_hidden_states: int) -> list[int]:
    """Parse a ``--layers`` spec into sorted unique hidden-state indices (extract, score and finetune).

    Index 0 is the embedding output and ``i`` the output of block ``i`` (the positions of the
    ``output_hidden_states`` tuple). ``all`` (or None) = every hidden state; ``blocks`` = every block
    (embedding output excluded: finetune's I-STAR default); otherwise a comma list of indices, stored
    names (``layer_06``) and ranges ``a-b`` (both ends included; negative ends written ``-3--1``),
    negative indices counting from the end (``-1`` = the last hidden state). Raises InputError for
    anything out of ``[0, n)``.
    """
    n = int(n_hidden_states)
    last = n - 1
    hint = (
        f"this model has {n} hidden states: 0 = embeddings, 1..{last} = blocks (negative indices count "
        f"from the end); use e.g. --layers all, blocks, 0,{last} or 1-{last}"
    )
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "all")):
        return list(range(n))
    if isinstance(spec, str) and spec.strip().lower() == "blocks":
        return list(range(1, n))
    parts = [str(p) for p in spec] if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out: set[int] = set()

    def one(tok: str) -> int:
        try:
            i = int(tok)
        except ValueError:
            raise InputError(f"--layers: {tok!r} is not a layer index; {hint}") from None
        if not -n <= i <= last:
            raise InputError(f"--layers: layer {i} is out of range; {hint}")
        return i % n

    for raw in parts:
        tok = re.sub(r"(?i)layer_0*(\d+)", r"\1", raw.strip())  # stored names: layer_06 -> 6
        if not tok:
            continue
        m = re.fullmatch(r"(-?\d+)\s*-\s*(-?\d+)", tok)
        if m:
            a, b = one(m.group(1)), one(m.group(2))
            if a > b:
                raise InputError(f"--layers: range {tok} runs backwards; write it low-high, e.g. {b}-{a}")
            out.update(range(a, b + 1))
        else:
            out.add(one(tok))
    if not out:
        raise InputError(f"--layers {spec!r} selects no layer; {hint}")
    return sorted(out)


def describe_layers(indices: list[int], n_hidden_states: int, final_norm: bool) -> list[dict]:
    """The identity's layer list: ``{"name", "index", "kind", "final_norm"}`` for each kept index."""
    last = n_hidden_states - 1
    return [
        {
            "name": layer_name(i, n_hidden_states),
            "index": int(i),
            "kind": "embeddings" if i == 0 else "block",
            "final_norm": bool(final_norm and i == last and i != 0),
        }
        for i in indices
    ]
