"""What each kept hidden state is: the identity's description of every stored layer (the
``--layers`` selection that chooses them is :mod:`geomscope.layers`).

Index ``i`` counts the residual stream: 0 is the embedding output, ``i >= 1`` the output of block
``i`` (the positions of the tuple ``output_hidden_states=True`` returns). Models with a final norm
(GPT-2's ``ln_f``, GPT-NeoX's and T5's ``final_layer_norm``, Llama/Mistral/Qwen's ``norm``) put the
norm's *output* in that tuple's last entry; geomscope stores the last block's raw output there
instead (``layer_N``, read at the norm's input) and the norm's output as a layer of its own,
``final_norm`` (index N + 1), so the two can be compared (Machina & Mercer 2024). BERT-style post-LN
models have no final norm: their ``layer_N`` is the model's output and there is no ``final_norm``.
When a model's final norm cannot be found by name, ``layer_N`` is the tuple's last entry (the
norm's output, if there is a norm), flagged ``final_norm: true``.

A module's layer (``extract --modules``, :func:`describe_modules`) is named by its path and sits at
its block's index (block k's modules at k + 1, beside ``layer_{k+1}``); :func:`in_forward_order`
puts the hidden states and the modules in one list in the order the forward pass computes them.
"""

from __future__ import annotations

from geomscope.layers import FINAL_NORM_LAYER, layer_name, module_layer_name

LAYER_NOTE = (
    "index = position in the residual stream (0 = embedding output, i = output of block i, before "
    "any final norm); the layer named final_norm (index N + 1) is the output of the model's final "
    "norm; final_norm = true marks a layer that went through it; tensor says what each layer is"
)


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


def describe_modules(captures, dim: int) -> list[dict]:
    """The identity's entries of the modules ``extract --modules`` stores (model/modules.py's
    ModuleCapture each): ``name`` (:func:`~geomscope.layers.module_layer_name`), ``index`` (its
    block's output's), ``kind`` = ``module``, ``module`` (its path in the base model), ``side``
    (``out`` or ``in``), ``block`` (its block's position, None outside the blocks), ``type`` (its
    class), ``tensor``; a module not ``dim`` (the run's D) wide adds its width ``dim``, a part of a
    fused projection ``part``, ``fused`` and ``heads``, a norm ``norm``, an alias ``alias``."""
    out = []
    for c in captures:
        entry = {
            "name": module_layer_name(c.path, c.side, c.part),
            "index": int(c.index),
            "kind": "module",
            "final_norm": False,
            "tensor": _module_tensor(c),
            "module": c.path,
            "side": c.side,
            "block": c.block,
            "type": c.type,
        }
        if c.width != dim:  # (a layer without ``dim`` is D wide)
            entry["dim"] = int(c.width)
        if c.part:
            entry.update(part=c.part, fused=c.fused, heads=c.heads)
        if c.norm:
            entry["norm"] = True
        if c.alias:
            entry["alias"] = c.alias
        out.append(entry)
    return out


def _module_tensor(c) -> str:
    """What a module's layer holds, in words."""
    if c.side == "in":
        return f"input of module {c.path} ({c.type})"
    if c.part:
        cut = "its [q | k | v] thirds" if c.fused == "thirds" else "each head's [q | k | v] slice"
        return (
            f"{c.part} of the fused projection {c.path} ({c.type}): {cut}, concatenated over heads "
            "(D = n_heads x d_head), before any rotary embedding"
        )
    tail = "; the first element of the tuple it returns" if c.tuple_output else ""
    heads = " (concatenated over heads, before any rotary embedding)" if c.alias in ("q", "k", "v") else ""
    return f"output of module {c.path} ({c.type}){heads}{tail}"


def in_forward_order(hidden: list[dict], modules: list[dict]) -> list[dict]:
    """Hidden-state and module layers in one list by index, each module before the hidden state of
    its index (block k's modules run before block k's output, ``layer_{k+1}``, is complete); the
    modules keep their forward order, the hidden states theirs."""
    tagged = [(la["index"], 1, i, la) for i, la in enumerate(hidden)]
    tagged += [(la["index"], 0, i, la) for i, la in enumerate(modules)]
    return [la for *_, la in sorted(tagged, key=lambda t: t[:3])]
