"""Layer discovery: how many hidden states a model returns, their width, its blocks and final norm.

:func:`probe` runs a loaded model on a short text and a copy of it whose last token differs, and
records: the number of hidden states (the embeddings, then one per block) and their width; whether
the last one went through a final norm (it differs from the last block's output, caught by a hook
on that block, else a norm module among the stack's children); whether the changed last token
changes earlier rows (bidirectional attention) or not (causal); and whether
``output_hidden_states=[i, ...]`` keeps exactly the asked ones. :func:`n_blocks` reads the number
of blocks from a config alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from geomscope.errors import InputError

if TYPE_CHECKING:
    from geomscope.model.loaded import LoadedModel


_PROBE_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs home."


def find_blocks(module, count: int):
    """The module's first ``ModuleList`` of ``count`` entries (its blocks), or None."""
    import torch

    for _, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == count and count > 0:
            return m
    return None


#: the final norm's attribute name on the stack, by family: GPT-2 ``ln_f``, GPT-NeoX and T5
#: ``final_layer_norm``, Llama/Mistral/Qwen ``norm``, Phi ``final_layernorm``
FINAL_NORM_NAMES = ("ln_f", "norm", "final_layer_norm", "final_layernorm", "ln_final", "final_norm")


def has_final_norm_child(module) -> bool:
    """Whether one of the module's children is a final norm, by its attribute name or class name."""
    for name, child in module.named_children():
        is_norm = type(child).__name__.lower().endswith("norm") and "embed" not in name
        if name in FINAL_NORM_NAMES or is_norm:
            return True
    return False


def final_norm_module_name(lm: LoadedModel) -> str | None:
    """The qualified name (in ``lm.model``) of the stack's final norm, found by its attribute name."""
    stack = lm.stack_module()
    child = next((c for n, c in stack.named_children() if n in FINAL_NORM_NAMES), None)
    if child is None:
        return None
    return next((q for q, m in lm.model.named_modules() if m is child), None)


def probe(lm: LoadedModel) -> None:
    """Fill n_hidden_states, hidden_size, final_norm, attention and selective from two tiny forwards."""
    import torch

    x = probe_batch(lm)
    mask = torch.ones_like(x)
    with torch.inference_mode():
        hs = lm.run_stack(x, mask, True)
        if not hs:
            raise InputError(f"model {lm.info['name']} returns no hidden states; it cannot be extracted")
        n = len(hs)
        hs, block_out = _states_and_last_block(lm, x, mask, n)
        lm.final_norm = _final_norm_applied(lm, hs[-1], block_out)
        if lm.final_norm:
            lm.final_norm_name = final_norm_module_name(lm)
        lm.attention = _attention_kind(hs[-1])
        lm.n_hidden_states = n
        lm.hidden_size = int(hs[0].shape[-1])
        lm.selective = _keeps_selected_states(lm, x, mask, hs)


def probe_batch(lm: LoadedModel):
    """A (2, T) batch on the model's device, T >= 2: the probe text's token ids (cut to the model's
    length) and a copy whose last token is the next id of the vocabulary."""
    import torch

    tok = lm.tokenizer
    ids = tok(_PROBE_TEXT, add_special_tokens=True)["input_ids"]
    if lm.max_length:
        ids = ids[: lm.max_length]
    if len(ids) < 2:
        ids = (ids * 2)[:2] if ids else [0, 0]
    vocab = int(getattr(lm.model.config, "vocab_size", 0) or len(tok))
    alt = list(ids)
    alt[-1] = (alt[-1] + 1) % max(2, vocab)
    return torch.tensor([ids, alt], device=lm.device)


def _states_and_last_block(lm: LoadedModel, x, mask, n: int):
    """(the ``n`` hidden states of ``x``, the last block's own output caught by a forward hook): the
    output is None where no ``ModuleList`` of ``n - 1`` blocks is found."""
    captured = {}
    blocks = find_blocks(lm.stack_module(), n - 1)
    handle = None
    if blocks is not None:

        def hook(_m, _a, out):
            captured["last"] = out[0] if isinstance(out, (tuple, list)) else out

        handle = blocks[n - 2].register_forward_hook(hook)
    try:
        hs = lm.run_stack(x, mask, True)
    finally:
        if handle is not None:
            handle.remove()
    return hs, captured.get("last")


def _final_norm_applied(lm: LoadedModel, final, block_out) -> bool:
    """Whether the last hidden state ``final`` went through a final norm: it differs from the last
    block's output ``block_out`` where that is a tensor of its shape, else the stack has a norm child."""
    import torch

    if torch.is_tensor(block_out) and block_out.shape == final.shape:
        return not torch.equal(block_out, final)
    return has_final_norm_child(lm.stack_module())


def _attention_kind(final) -> str:
    """ "causal" when the changed last token leaves the earlier rows of the last hidden state ``final``
    as they are (within 1e-5 of their largest magnitude), else "bidirectional"."""
    last = final.float()
    scale = float(last[:, :-1].abs().max()) or 1.0
    diff = float((last[0, :-1] - last[1, :-1]).abs().max())
    return "causal" if diff <= 1e-5 * scale else "bidirectional"


def _keeps_selected_states(lm: LoadedModel, x, mask, hs) -> bool:
    """Whether ``output_hidden_states=[0, n - 1]`` gives the first and last of the states ``hs`` as
    they are, in a tuple of the same length (False where the model refuses the list)."""
    import torch

    n = len(hs)
    try:
        sel = lm.run_stack(x, mask, [0, n - 1])
        return (
            len(sel) == n
            and sel[0] is not None
            and sel[-1] is not None
            and torch.equal(sel[0], hs[0])
            and torch.equal(sel[-1], hs[-1])
        )
    except Exception:
        return False


def n_blocks(model) -> int:
    """Number of transformer blocks (hidden-state tuple length minus one)."""
    cfg = model.config
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    raise InputError(f"cannot tell how many layers {type(model).__name__} has; pass --layers explicitly")
