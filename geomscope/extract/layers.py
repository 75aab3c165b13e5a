"""What each kept hidden state is: the identity's description of every stored layer (the
``--layers`` selection that chooses them is :mod:`geomscope.layers`).

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

from geomscope.layers import FINAL_NORM_LAYER, layer_name

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
