"""Loading a checkpoint and its tokenizer for extraction: :func:`load_model`.

The name resolves through :func:`geomscope.model.names.resolve_model` and a local directory is
checked first (:func:`geomscope.model.files.check_model_dir`). The first auto class that knows the
architecture loads the model (``AutoModel``, then the causal-LM, seq2seq and masked-LM ones), or,
for ``extract --capture gradients``, the class of the loss's head (:mod:`geomscope.model.heads`).
The stack to read is chosen (the model itself, or the encoder / decoder of an encoder-decoder model)
and probed once (:func:`geomscope.model.probe.probe`); ``LoadedModel.info`` is what the run's
identity records (name, revision, commit, architecture, width, fingerprints).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from geomscope.choices import COMPUTE_DTYPES, DEVICE_MAPS, STACKS
from geomscope.devices import resolve_device
from geomscope.errors import InputError
from geomscope.model.files import check_model_dir, damage_errors
from geomscope.model.heads import HEAD_CLASSES, check_head, resolve_loss
from geomscope.model.hub import cached_snapshot, offline_mode
from geomscope.model.identity import loaded_identity
from geomscope.model.load_errors import (
    adds_no_hidden_state,
    call_from_pretrained,
    load_error,
    one_line,
    refuse_random_weights,
)
from geomscope.model.loaded import LoadedModel
from geomscope.model.names import resolve_model
from geomscope.model.probe import probe

DTYPES = COMPUTE_DTYPES
#: model types whose learned positions start after the padding index (usable length = table - pad - 1)
_PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "xmod", "longformer")


def torch_dtype(name: str):
    """The torch dtype of a ``--dtype`` name (one of :data:`DTYPES`)."""
    import torch

    if name not in DTYPES:
        raise InputError(f"--dtype {name} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def _transformers_dtype_kw() -> str:
    """The keyword from_pretrained takes the dtype as (``dtype`` from transformers 4.56 on)."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_model(
    name: str,
    *,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    trust_remote_code: bool = False,
    stack: str | None = None,
    cache_dir: str | None = None,
    loss: str | None = None,
    device_map: str | None = None,
    max_memory: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a checkpoint and its tokenizer, choose the stack, probe it (see the module docstring).

    ``loss`` (``extract --capture gradients``): "auto" or one of geomscope.choices.LOSSES; the
    model is then loaded with that loss's head, which must be in the checkpoint (``info["loss"]``
    records the one chosen).

    ``device_map`` ("auto" | "balanced" | "balanced_low_0" | "sequential") and ``max_memory``
    ({device: "20GiB"}): accelerate's big-model loading, for a model larger than one device; the
    layers are spread over the devices (``device`` is then not used) and inputs go where the input
    embeddings are. Weights it would have to leave on disk ("offload") are refused.

    ``stack``: None/"auto" (the model; the encoder of an encoder-decoder model), "encoder", "decoder".
    ``trust_remote_code`` is passed explicitly to every transformers call (False: a model's own code
    never runs, and transformers never asks).
    """
    tdtype = torch_dtype(dtype)
    dev = resolve_device(device) if device_map is None else None
    placement = _placement(device_map, max_memory)
    target, info = resolve_model(name, revision, cache_dir=cache_dir, log=log)
    if info["source"] == "hub":
        snap = cached_snapshot(target, revision, cache_dir)
        if snap is not None and offline_mode():
            info["path"] = str(snap)
    load_from = info["path"] if info.get("path") else target
    if info.get("path"):
        check_model_dir(Path(info["path"]), info["name"])
    kw = {"trust_remote_code": bool(trust_remote_code)}
    if info["source"] == "hub" and not info.get("path"):
        kw.update(revision=revision or None, cache_dir=cache_dir)
    with _quiet_transformers():
        config, tok, model, loss = _load_parts(
            load_from, kw, tdtype, info, revision, loss, placement, cache_dir=cache_dir
        )
    if info["source"] == "hub" and not info.get("path"):
        _record_snapshot(target, info, revision, cache_dir)
    model.eval()
    if device_map is None:
        model.to(dev)
    else:
        dev = _placed_device(model, info["name"])
    lm = _probed(model, tok, config, info, _choose_stack(stack, config, model, info["name"]), dev)
    lm.info = loaded_identity(lm, info, config, tok, revision, dtype)
    if loss is not None:
        lm.info["loss"] = loss
    lm.source = {k: v for k, v in info.items() if k in ("source", "path", "package")}
    return lm


def _record_snapshot(target: str, info: dict, revision: str | None, cache_dir: str | None) -> None:
    """Set ``info["path"]`` to the cache snapshot a hub model loaded from (None when not found)."""
    snap = cached_snapshot(target, revision, cache_dir)
    info["path"] = str(snap) if snap else None
    if snap is None and offline_mode():
        # offline, every file came from the cache, yet no snapshot of it is found: the run could
        # record no commit and no weights fingerprint, and a moved ref would go unnoticed
        ref = revision or "main"
        raise InputError(
            f"model {target}@{ref} loads from the local Hugging Face cache, but its refs/{ref} "
            "names no snapshot folder there, so the weights it read cannot be recorded; repair the "
            f"cache (huggingface-cli download {target} --revision {ref}) or give the snapshot folder"
        )


def _probed(model, tok, config, info: dict, stack: str, dev) -> LoadedModel:
    """The LoadedModel of ``model`` read at ``stack``, with its forward options set and probed."""
    lm = LoadedModel(model=model, tokenizer=tok, info=info, stack=stack, device=dev)
    if stack == "decoder":
        lm.decoder_start_token_id = _decoder_start(config, model, info["name"])
    if "use_cache" in inspect.signature(model.forward).parameters and stack != "encoder":
        lm.forward_kwargs["use_cache"] = False
    lm.max_length = _model_max_length(config, tok)
    probe(lm)
    return lm


@contextmanager
def _quiet_transformers():
    """No download bars or load reports from transformers while loading (restored after)."""
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def _placement(device_map: str | None, max_memory: dict | None) -> dict:
    """from_pretrained's keywords for accelerate's big-model loading (none without a device map)."""
    if device_map is None:
        if max_memory:
            raise InputError("--max-memory applies with --device-map; add --device-map auto")
        return {}
    if device_map not in DEVICE_MAPS:
        raise InputError(f"--device-map {device_map} is not one of {', '.join(DEVICE_MAPS)}")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise InputError("--device-map needs the accelerate package; pip install accelerate") from None
    return {"device_map": device_map, **({"max_memory": max_memory} if max_memory else {})}


def _placed_device(model, name: str):
    """Where a device-mapped model takes its inputs; refuse weights left on disk or on 'meta'."""
    import torch

    where = set((getattr(model, "hf_device_map", None) or {}).values())
    if where & {"disk", "meta"}:
        raise InputError(
            f"{name} does not fit in the --max-memory given (part of it would stay on disk); "
            "raise --max-memory or use more devices"
        )
    return (
        model.get_input_embeddings().weight.device
        if hasattr(model, "get_input_embeddings")
        else torch.device("cpu")
    )


def _load_parts(
    load_from: str,
    kw: dict,
    tdtype,
    info: dict,
    revision: str | None,
    loss: str | None = None,
    placement: dict | None = None,
    *,
    cache_dir: str | None = None,
):
    """(config, tokenizer, model, loss): the first auto class that knows the architecture loads the
    model; with ``loss``, the class of that loss's head (and the loss, resolved from ``auto``).

    Whatever a damaged or hand-edited checkpoint makes transformers raise is one InputError naming
    the file (``extract --revisions`` then reports that revision and goes on to the next)."""
    import transformers

    name = info["name"]
    at = f"{name}@{revision}" if revision else name
    config, tok = _config_and_tokenizer(load_from, kw, info, revision, cache_dir)
    if loss is not None:
        return (
            config,
            tok,
            *_load_head(
                load_from, {**kw, **(placement or {})}, tdtype, info, revision, config, loss, cache_dir
            ),
        )
    for auto in ("AutoModel", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM"):
        kwargs = {"config": config, _transformers_dtype_kw(): tdtype, **kw, **(placement or {})}
        try:
            model, loading = call_from_pretrained(
                getattr(transformers, auto), load_from, kwargs, info, revision, cache_dir
            )
        except ValueError as e:  # this auto class does not know the architecture: try the next one
            if "Unrecognized configuration class" not in str(e):
                raise
            continue
        refuse_random_weights(model, loading, at, ignore=adds_no_hidden_state)
        return config, tok, model, None
    raise InputError(
        f"model {name} ({config.model_type}) has no architecture transformers can "
        "load for its hidden states; give an encoder, decoder or encoder-decoder model"
    )


def _config_and_tokenizer(load_from: str, kw: dict, info: dict, revision: str | None, cache_dir):
    """(config, tokenizer) of a checkpoint; what a damaged or missing one raises, as one InputError."""
    import transformers

    name = info["name"]
    at = f"{name}@{revision}" if revision else name
    try:
        config = transformers.AutoConfig.from_pretrained(load_from, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise load_error(e, name, info, revision, cache_dir) from e
    except damage_errors() as e:  # a field of the wrong type ("hidden_size": "abc") ...
        raise InputError(
            f"config.json of model {at} is malformed ({one_line(e)}); fix it or re-save the checkpoint"
        ) from None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(load_from, **kw)
    except (OSError, ValueError, KeyError) as e:
        if not kw.get("trust_remote_code") and _tokenizer_has_code(load_from):
            # transformers then says only that a backend could not be built (sentencepiece...)
            raise InputError(
                f"the tokenizer of model {name} needs its own code (auto_map in "
                "tokenizer_config.json); rerun with --trust-remote-code if you trust it"
            ) from e
        raise load_error(e, name, info, revision, cache_dir) from e
    except damage_errors() as e:
        raise InputError(
            f"the tokenizer files of model {at} are damaged ({one_line(e)}); re-save the "
            "checkpoint's tokenizer (tokenizer.save_pretrained)"
        ) from None
    return config, tok


def _tokenizer_has_code(load_from: str) -> bool:
    """Whether a local model directory's tokenizer_config.json names a tokenizer class of its own code."""
    from geomscope.fileio import read_json

    try:
        cfg = read_json(Path(load_from) / "tokenizer_config.json")
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("auto_map"), (dict, list)) and bool(cfg["auto_map"])


def _load_head(load_from: str, kw: dict, tdtype, info: dict, revision, config, asked: str, cache_dir=None):
    """The model with the head of the asked loss (``auto``: the checkpoint's own head)."""
    import transformers

    loss = resolve_loss(asked, config, info["name"])
    auto = getattr(transformers, HEAD_CLASSES[loss])
    kwargs = {"config": config, _transformers_dtype_kw(): tdtype, **kw}
    try:
        model, loading = call_from_pretrained(auto, load_from, kwargs, info, revision, cache_dir)
    except ValueError as e:  # only "Unrecognized configuration class" comes back
        raise InputError(
            f"{info['name']} ({config.model_type}) has no {loss} head in transformers; choose another --loss"
        ) from e
    check_head(loss, loading, info["name"])  # a head (or anything) missing: its own message
    refuse_random_weights(model, loading, f"{info['name']}@{revision}" if revision else info["name"])
    if loss == "classification" and int(getattr(config, "num_labels", 0) or 0) < 2:
        raise InputError(
            f"{info['name']} has a regression head (num_labels = 1); --loss classification needs "
            "a classifier with at least two labels"
        )
    return model, loss


def _choose_stack(stack: str | None, config, model, name: str) -> str:
    """ "model" for one-stack models; "encoder" (default) or "decoder" for encoder-decoder ones."""
    st = (stack or "auto").lower()
    if st not in ("auto", *STACKS):
        raise InputError(f"--stack {stack} is not one of {', '.join(STACKS)}")
    if not getattr(config, "is_encoder_decoder", False):
        if st != "auto":
            raise InputError(
                f"--stack {stack} applies to encoder-decoder models; {name} "
                f"({config.model_type}) has one stack (drop --stack)"
            )
        return "model"
    chosen = "decoder" if st == "decoder" else "encoder"
    if chosen == "encoder" and not hasattr(model, "get_encoder"):
        raise InputError(f"model {name} exposes no encoder; try --stack decoder")
    return chosen


def _decoder_start(config, model, name: str) -> int:
    """The token the decoder starts from: the config's, the generation config's, else the pad token."""
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None)
    if start is None:
        raise InputError(f"model {name} names no decoder start token; --stack decoder cannot feed it")
    return int(start)


def _model_max_length(config, tok) -> int | None:
    """The longest sequence the model reads: its position table (less the padding offset of
    RoBERTa-like models) and the tokenizer's model_max_length, the smaller; None when neither says."""
    limits = []
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            if config.model_type in _PADDING_OFFSET_POSITIONS:
                v -= int(getattr(config, "pad_token_id", 1) or 1) + 1
            limits.append(v)
            break
    tl = getattr(tok, "model_max_length", None)
    if isinstance(tl, int) and 0 < tl < 10**7:
        limits.append(tl)
    return min(limits) if limits else None
