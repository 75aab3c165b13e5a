"""What a checkpoint directory holds, and the checks of it that come before any load.

The kinds of files (weights, tokenizer files); :func:`check_model_dir` (tokenizer files present,
safetensors headers readable); the errors of a damaged checkpoint: :func:`damage_errors` (what
transformers, huggingface_hub, safetensors and torch raise on one) and :func:`pickled_weights_error`
(weights that need unpickling, which geomscope never does).
"""

from __future__ import annotations

from pathlib import Path

from geomscope.errors import InputError, first_line

#: endings of weight files, of every framework transformers saves for
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
#: the files a tokenizer is saved as (the tokenizer's fingerprint reads those present)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
#: files that carry a tokenizer's vocabulary; a directory with none of them would get an empty tokenizer
TOKENIZER_VOCAB_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def check_model_dir(path: Path, name: str) -> None:
    """Refuse a model directory that transformers would load wrongly or with a traceback.

    Without tokenizer files transformers builds a tokenizer from the config alone, whose vocabulary
    is empty, so every token would be read as unknown with exit 0; a damaged safetensors file fails
    deep inside loading. Both get one line naming the file (used by extract and finetune alike).
    """
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_VOCAB_FILES):
        raise InputError(
            f"{name} has no tokenizer files (none of {', '.join(TOKENIZER_VOCAB_FILES)}); copy the "
            "checkpoint's tokenizer into it (tokenizer.save_pretrained) and rerun"
        )
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights, name)


def _check_safetensors(path: Path, name: str) -> None:
    """Read only the header (the tensor table) of a safetensors file; InputError if it is damaged."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError, OSError: the header does not parse or the file is short
        raise InputError(
            f"{path.name} of {name} is damaged ({first_line(e)}); re-download or re-save the checkpoint"
        ) from None


def pickled_weights_error(name: str) -> InputError:
    """A checkpoint whose weights file needs pickle for more than tensors (torch.load with
    ``weights_only=True`` refuses it): said as such, never loaded the unsafe way."""
    return InputError(
        f"model {name}: its weights file (pytorch_model.bin) cannot be read without unpickling (it holds "
        "objects besides tensors, or is damaged), and geomscope never unpickles; save the model as "
        "safetensors (save_pretrained(dir, safe_serialization=True)) where you trust it, and give that "
        "directory"
    )


def damage_errors() -> tuple[type[BaseException], ...]:
    """What transformers, huggingface_hub, safetensors and torch raise, besides OSError and
    ValueError, on a damaged or hand-edited checkpoint: a truncated or garbage pytorch_model.bin
    (RuntimeError "PytorchStreamReader", EOFError), weights of other shapes (RuntimeError), an index
    without its "metadata" (KeyError), a config field of the wrong type (huggingface_hub's strict
    dataclass errors, TypeError). The one home of that list: extract and score's I(W) both use it."""
    errors: list[type[BaseException]] = [RuntimeError, EOFError, TypeError, KeyError]
    try:
        from huggingface_hub.errors import StrictDataclassError

        errors.append(StrictDataclassError)
    except ImportError:  # an older huggingface_hub, without strict dataclasses
        pass
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - transformers depends on safetensors
        pass
    return tuple(errors)


def weight_files(load_from: str) -> list[str]:
    """The weight files (and shard index) of a local model directory, by name; [] for a hub id."""
    d = Path(load_from)
    try:
        return sorted(
            p.name
            for p in d.iterdir()
            if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json"))
        )
    except OSError:
        return []
