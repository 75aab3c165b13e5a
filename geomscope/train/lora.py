"""``--lora R``: low-rank adapters (``peft``) instead of full fine-tuning.

Only the adapters train, plus the task head (the classifier or the QA span head, which is new or
task-specific and would otherwise stay as initialised; peft's ``modules_to_save``).  I-STAR and
CosReg act on the hidden states, so they work unchanged.  LoRA dropout is 0 (the dropout streams stay
those of full fine-tuning).  The epoch checkpoint holds the adapter (``adapter_model.safetensors``,
which includes the head); resuming rebuilds the same adapters on the original model and loads it.
At the end the adapter is saved to ``OUT/adapter/`` and the merged model (``merge_and_unload``) is
exported as an ordinary ``save_pretrained`` checkpoint, so ``geomscope extract OUT`` reads it.

``--lora-target`` names module names (the last dotted part, e.g. ``query,value`` in BERT, ``q_proj``
in LLaMA); ``q``, ``k``, ``v`` and ``o`` also stand for the usual spellings of those projections.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from geomscope.errors import InputError
from geomscope.fileio import fresh_dir, replace_dir
from geomscope.train.checkpoint import ADAPTER, ADAPTER_TEMP, export_model, record_outputs, written_into
from geomscope.train.proofs import digests

ALIASES = {
    "q": ("query", "q_proj", "q_lin", "q"),
    "k": ("key", "k_proj", "k_lin", "k"),
    "v": ("value", "v_proj", "v_lin", "v"),
    "o": ("o_proj", "out_proj", "out_lin", "o"),
}


def check_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise InputError("--lora needs the peft package: pip install 'geomscope[lora]'")


def _linear_names(model, head: list[str]) -> list[str]:
    """Leaf names of the linear-like modules outside the head (what LoRA can adapt)."""
    import torch

    names = []
    for full, mod in model.named_modules():
        if not full or full.split(".")[0] in head:
            continue
        if isinstance(mod, (torch.nn.Linear, torch.nn.Conv1d)) or type(mod).__name__ == "Conv1D":
            leaf = full.split(".")[-1]
            if leaf not in names:
                names.append(leaf)
    return names


def head_modules(model) -> list[str]:
    """Top-level children of the task model that hold parameters and are not the base model."""
    base = getattr(model, "base_model_prefix", None)
    return [n for n, m in model.named_children() if n != base and any(True for _ in m.parameters())]


def resolve_targets(model, names: list[str]) -> list[str]:
    """The ``--lora-target`` names (``['q', 'v']``: :meth:`FinetuneConfig.lora_targets`) -> the
    module leaf names of this model (e.g. ``['query', 'value']``); a name that matches nothing is a
    one-line error naming modules that exist."""
    have = _linear_names(model, head_modules(model))
    targets = []
    for item in names:
        hit = [n for n in ((item,) + ALIASES.get(item.lower(), ())) if n in have]
        if not hit:
            raise InputError(
                f"--lora-target {item!r} matches no linear module of {type(model).__name__}; "
                f"modules there: {', '.join(have[:8])}{', ...' if len(have) > 8 else ''}"
            )
        if hit[0] not in targets:
            targets.append(hit[0])
    return targets


def wrap(model, r: int, alpha: float, targets: list[str]):
    """The peft model: rank-``r`` adapters on ``targets``, the head trained in full, the rest frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        modules_to_save=head_modules(model) or None,
    )
    return get_peft_model(model, config)


def trainable_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def export(out: Path, model, tokenizer, extra: dict) -> None:
    """Save the adapter to ``out/adapter/``, then export the merged model into ``out``."""
    with written_into(fresh_dir(out / ADAPTER_TEMP)) as tmp:
        model.save_pretrained(tmp)
    record_outputs(out, [ADAPTER], digests(tmp, ADAPTER))
    replace_dir(tmp, out / ADAPTER)
    merged = model.merge_and_unload()
    export_model(out, merged, tokenizer, extra)
