"""The head a loss needs (``extract --capture gradients``): the transformers auto class that loads
it, the loss a checkpoint's own head gives, and the refusal of a head that would be random."""

from __future__ import annotations

from geomscope.choices import LOSSES
from geomscope.errors import InputError

#: the transformers auto class that loads each loss's head
HEAD_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
}
#: checkpoint architecture names (config.architectures) -> the loss their head gives
_ARCHITECTURE_LOSS = (
    ("ForSequenceClassification", "classification"),
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForPreTraining", "masked-lm"),
)


def loss_of_architectures(architectures) -> str | None:
    """The loss a checkpoint's own head gives (from ``config.architectures``), or None (no head)."""
    for arch in architectures or ():
        for suffix, loss in _ARCHITECTURE_LOSS:
            if str(arch).endswith(suffix):
                return loss
    return None


def resolve_loss(asked: str, config, name: str) -> str:
    """The loss to use: the asked one, or (``auto``) the one the checkpoint's head gives."""
    if asked not in LOSSES:
        raise InputError(f"--loss {asked} is not one of {', '.join(LOSSES)}")
    if getattr(config, "is_encoder_decoder", False):
        raise InputError(
            f"--capture gradients reads one-stack models (encoder or decoder); {name} is an "
            "encoder-decoder model, whose gradients are not captured yet"
        )
    if asked != "auto":
        return asked
    found = loss_of_architectures(getattr(config, "architectures", None))
    if found is None:
        archs = ", ".join(getattr(config, "architectures", None) or ["none recorded"])
        raise InputError(
            f"{name} ({archs}) has no head for a loss: gradients need one of --loss causal-lm, "
            "masked-lm or classification on a checkpoint with that head (e.g. a classifier that "
            "geomscope finetune wrote)"
        )
    return found


def check_head(loss: str, loading_info: dict, name: str) -> None:
    """Refuse a head that from_pretrained initialised at random (its weights are not in the checkpoint)."""
    missing = [k for k in (loading_info or {}).get("missing_keys", []) if k]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise InputError(
            f"{name} has no trained {loss} head ({shown} not in its weights; they would be random); "
            f"choose the --loss its head gives, or fine-tune a head first"
        )
