"""What a failed or partial load is said as: one line naming the model, the file and the way out.

:func:`call_from_pretrained` runs an auto class's ``from_pretrained`` and turns what a damaged,
hand-edited, missing or unreachable checkpoint raises into one InputError (:func:`load_error` words
the hub and file cases); :func:`refuse_random_weights` refuses a model some of whose parameters
``from_pretrained`` initialised at random.
"""

from __future__ import annotations

import pickle
import re

from geomscope.errors import InputError
from geomscope.model.files import damage_errors, pickled_weights_error, weight_files
from geomscope.model.hub import cached_revisions, offline_mode


def load_error(
    exc: Exception, name: str, info: dict, revision: str | None, cache_dir: str | None = None
) -> InputError:
    """The one line for an OSError or ValueError of a load: a revision the cache lacks (naming those
    it holds), offline without the files, an unknown hub name or revision, no weights file, code the
    model needs, else transformers' own words."""
    msg = " ".join(str(exc).split())
    at = f"{name}@{revision}" if revision else name
    if info["source"] == "hub":
        cached = cached_revisions(name, cache_dir) if revision else []
        if cached and revision not in cached:
            shown = ", ".join(cached[:8]) + (f" and {len(cached) - 8} more" if len(cached) > 8 else "")
            todo = (
                " and offline mode is on (HF_HUB_OFFLINE=1); download it where there is internet, or "
                "give one of those"
                if offline_mode()
                else "; give one of those, or check the revision's name"
            )
            return InputError(
                f"model {name} has no revision {revision!r} in the local cache (it has {shown}){todo}"
            )
        if offline_mode():
            if "does not appear to have" in msg or "no file named" in msg:
                return InputError(
                    f"model {at}: the local Hugging Face cache holds its config but not its weights, "
                    "and offline mode is on (HF_HUB_OFFLINE=1); download it where there is internet "
                    "(huggingface-cli download) or give a local directory"
                )
            return InputError(
                f"model {at} is not in the local Hugging Face cache and offline mode is on "
                f"(HF_HUB_OFFLINE=1); download it where there is internet (huggingface-cli download "
                f"{name}) or give a local model directory"
            )
        kind = type(exc).__name__
        if "RepositoryNotFound" in kind or "is not a valid model identifier" in msg or "404" in msg:
            return InputError(
                f"unknown model {name}: no such repository on the Hugging Face hub (or it is "
                "private: log in with huggingface-cli login); check the name"
            )
        if "RevisionNotFound" in kind or "not a valid git identifier" in msg:
            return InputError(
                f"model {name} has no revision {revision!r}; give a tag, branch or commit it has"
            )
    if "does not appear to have" in msg or "no file named" in msg:
        return InputError(
            f"model {at} has no weights file (model.safetensors or pytorch_model.bin); "
            "give a complete checkpoint directory"
        )
    if "trust_remote_code" in msg:
        return InputError(f"model {at} needs its own code; rerun with --trust-remote-code if you trust it")
    return InputError(f"cannot load model {at}: {msg[:300]}")


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's whole text with its lines and runs of white space joined by single spaces, cut
    to ``limit`` with "..." (a KeyError's text is only the quoted key, so it reads "no entry 'key'");
    :func:`geomscope.errors.first_line` quotes the first line alone."""
    text = " ".join(str(e).split())
    if isinstance(e, KeyError):
        text = f"no entry {text}"
    text = text or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_machine_error(e: BaseException) -> bool:
    """A RuntimeError of the machine, not of the checkpoint's files: an allocation failure (the CLI
    says it as such) or a device error, left as they are rather than blamed on the weights."""
    text = str(e).lower()
    return (
        "out of memory" in text
        or "can't allocate memory" in text
        or "outofmemory" in type(e).__name__.lower()
        or "cuda" in text
        or "device-side" in text
    )


def call_from_pretrained(auto, load_from: str, kwargs: dict, info: dict, revision, cache_dir):
    """``auto.from_pretrained(load_from, output_loading_info=True, **kwargs)`` -> (model, loading
    info), its errors as one InputError line; a ValueError "Unrecognized configuration class" (the
    auto class does not know the architecture) is left to the caller."""
    name = info["name"]
    try:
        return auto.from_pretrained(load_from, output_loading_info=True, **kwargs)
    except pickle.UnpicklingError:
        raise pickled_weights_error(name) from None
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise
        raise load_error(e, name, info, revision, cache_dir) from e
    except OSError as e:
        raise load_error(e, name, info, revision, cache_dir) from e
    except damage_errors() as e:
        if is_machine_error(e):
            raise
        at = f"{name}@{revision}" if revision else name
        if isinstance(e, TypeError):  # a config field of a type the model's code cannot take
            raise InputError(
                f"cannot load model {at} ({one_line(e, 160)}); check its config.json, or re-save "
                "the checkpoint"
            ) from None
        if "mismatch" in str(e).lower():
            # transformers 4 names the tensor ("size mismatch for x: copying a param with shape ...");
            # 5 points at its load report, which is silenced here
            m = re.search(r"size mismatch for [^:]+", str(e))
            raise InputError(
                f"model {at}: some of its weights have other shapes than its config.json gives them"
                f"{f' ({m.group(0)})' if m else ''}; the config and the weights are of different "
                "models: give a checkpoint whose config.json and weights were saved together"
            ) from None
        files = weight_files(load_from)
        which = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise InputError(
            f"the weights of model {at}{f' ({which})' if which else ''} are damaged or unreadable "
            f"({one_line(e, 100)}); re-download or re-save the checkpoint"
        ) from None


def adds_no_hidden_state(model, key: str) -> bool:
    """A parameter the hidden states never go through, so that its absence from the weights changes
    none of them: BERT's pooler (a BertModel loaded from a masked-LM checkpoint has none), and a head
    outside the base model (a fallback auto class of a model AutoModel does not know)."""
    if "pooler" in key.split("."):
        return True
    base = getattr(model, "base_model", model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    return base is not model and bool(prefix) and not key.startswith(prefix + ".")


def refuse_random_weights(model, loading: dict | None, at: str, ignore=None) -> None:
    """Refuse a model some of whose parameters from_pretrained initialised at random: tensors the
    checkpoint lacks (``missing_keys``: a block left out, another architecture's weights) or holds
    in another shape (``mismatched_keys``). Hidden (transformers' report is silenced while loading),
    they would make every run of the checkpoint different, and a resume would mix rows of two random
    models.
    Tied weights (an LM head tied to the input embeddings) are not reported missing."""
    loading = loading or {}
    missing = sorted(k for k in loading.get("missing_keys") or () if k and not (ignore and ignore(model, k)))
    mismatched = sorted(
        str(k[0] if isinstance(k, (tuple, list)) else k) for k in loading.get("mismatched_keys") or ()
    )
    if not missing and not mismatched:
        return
    bad = missing or mismatched
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    arch = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    what = "lack" if missing else "have another shape for"
    raise InputError(
        f"model {at}: its weights {what} {len(bad)} tensor(s) of the {arch} architecture ({shown}), "
        "which would be random; the checkpoint is incomplete or holds another architecture's weights: "
        "give a complete checkpoint of this model"
    )
