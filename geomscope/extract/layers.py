"""Which hidden states to keep: parsing ``--layers`` and describing each kept layer.

Index ``i`` counts the residual stream: 0 is the embedding output, ``i >= 1`` the output of block
``i`` (the positions of the tuple ``output_hidden_states=True`` returns). Models with a final norm
(GPT-2's ``ln_f``, GPT-NeoX's and T5's ``final_layer_norm``, Llama/Mistral/Qwen's ``norm``) put the
norm's *output* in that tuple's last entry; geomscope stores the last block's raw output there
instead (``layer_N``, read at the norm's input) and the norm's output as a layer of its own,
``final_norm`` (index N + 1), so the two can be compared (Machina & Mercer 2024). BERT-style post-LN
models have no final norm: their ``layer_N`` is the model's output and there is no ``final_norm``.
When a model's final norm cannot be found by name, the old meaning stays: ``layer_N`` is the
tuple's last entry, flagged ``final_norm: true``.
"""

from __future__ import annotations

import re

from geomscope.errors import InputError

FINAL_NORM_LAYER = "final_norm"
LAYER_NOTE = (
    "index = position in the residual stream (0 = embedding output, i = output of block i, before "
    "any final norm); the layer named final_norm (index N + 1) is the output of the model's final "
    "norm; final_norm = true marks a layer that went through it; tensor says what each layer is"
)


def split_final_norm(spec) -> tuple[object, bool]:
    """(the --layers spec without a ``final_norm`` item, whether that item was there)."""
    items = [str(p).strip() for p in spec] if isinstance(spec, (list, tuple)) else str(spec or "").split(",")
    wants = any(p.strip().lower() == FINAL_NORM_LAYER for p in items)
    rest = [p.strip() for p in items if p.strip() and p.strip().lower() != FINAL_NORM_LAYER]
    return (",".join(rest) if rest else None), wants


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


def describe_layers(
    indices: list[int],
    n_hidden_states: int,
    final_norm: bool,
    norm_module: str | None = None,
    with_final_norm: bool = False,
) -> list[dict]:
    """The identity's layer list: ``{"name", "index", "kind", "final_norm", "tensor"}`` for each kept
    index, then the ``final_norm`` layer when asked for. ``norm_module``: the final norm's module name
    when it can be hooked (then ``layer_N`` is read at its input)."""
    last = n_hidden_states - 1
    split = final_norm and norm_module is not None
    out = []
    for i in indices:
        through = bool(final_norm and not split and i == last and i != 0)
        if i == 0:
            tensor = "embedding output"
        elif i == last and split:
            tensor = f"output of block {i}, the input of the final norm {norm_module}"
        else:
            tensor = f"output of block {i}" + (" after the final norm" if through else "")
        out.append(
            {
                "name": layer_name(i, n_hidden_states),
                "index": int(i),
                "kind": "embeddings" if i == 0 else "block",
                "final_norm": through,
                "tensor": tensor,
            }
        )
    if with_final_norm and split:
        out.append(
            {
                "name": FINAL_NORM_LAYER,
                "index": n_hidden_states,
                "kind": "final_norm",
                "final_norm": True,
                "tensor": f"output of the final norm {norm_module} (applied to block {last}'s output)",
            }
        )
    return out
