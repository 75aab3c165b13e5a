"""Loading a sequence classifier (or, for ``--task qa``, a span-extraction model; for ``--task
causal-lm``, a causal language model) and its tokenizer.

A checkpoint without a sequence-classification head (a plain encoder such as all-MiniLM-L6-v2)
gets a freshly initialised head; a head with a different number of labels is replaced.  Both are
reported through ``note`` (stderr in the CLI), never silently.  :func:`load_qa_model` does the same
for ``AutoModelForQuestionAnswering`` (a base checkpoint gets a new start/end span head), and
:func:`load_causal_lm` for ``AutoModelForCausalLM`` (a base decoder gets a new LM head), refusing a
model whose attention is not causal. :func:`load_lora_adapter` loads a ``finetune --lora``
checkpoint's adapter (and head) weights into the rebuilt peft model on resume.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

from geomscope.errors import InputError, first_line
from geomscope.model.files import check_model_dir, pickled_weights_error
from geomscope.model.names import resolve_model


def quiet_transformers() -> None:
    """Silence transformers' load reports and progress bars (we report what matters ourselves)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # older transformers
        pass


def _checked_config(source: str | Path):
    """(what from_pretrained loads, its config) for a MODEL as the user gives it (resolve_model:
    bundled:minilm, a directory, a hub name, a glob of one checkpoint). A model directory is checked
    first (tokenizer files, safetensors headers); a config that does not load is one line. Never
    runs a model's code."""
    import torch  # noqa: F401  (transformers needs it)
    from transformers import AutoConfig

    quiet_transformers()
    src, info = resolve_model(str(source))
    if info["path"]:
        check_model_dir(Path(src), src)
    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = first_line(e)
        if "custom code" in first or "trust_remote_code" in first:
            raise InputError(
                f"model {src!r} needs its own code to load, and finetune never runs a model's code; "
                "give a checkpoint of an architecture transformers ships"
            ) from None
        raise InputError(f"cannot load model {src!r}: {first}; give a checkpoint directory") from None
    if getattr(config, "is_encoder_decoder", False):  # its classifier's output has no hidden_states
        raise InputError(
            f"{src} is an encoder-decoder model ({config.model_type}); finetune's regularisers and "
            "geometry read one stack's hidden states: give an encoder (BERT-like) or a decoder "
            "(GPT-like) checkpoint"
        )
    return src, config


def check_model_source(source: str | Path):
    """What loading ``source`` checks before any weights are read (how it resolves, its directory,
    its config, its tokenizer), with the same one-line errors; returns its config. A grid and
    ``--dry-run`` check it once for all their points."""
    src, config = _checked_config(source)
    _tokenizer(src)
    return config


def _tokenizer(src: str):
    """The checkpoint's tokenizer (never its own code); a tokenizer that does not load is one line."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load the tokenizer of {src!r}: {first_line(e)}") from None


def _with_head(auto_class, src: str, config, task: str, **head):
    """(model, loading info) of ``auto_class`` (a transformers ``AutoModelFor...``) from ``src``, a
    head of ``head``'s shape replacing one of another shape; the one-line errors for weights that
    need pickle and for an architecture with no ``task`` model class."""
    try:
        return auto_class.from_pretrained(
            src, **head, ignore_mismatched_sizes=True, output_loading_info=True, trust_remote_code=False
        )
    except pickle.UnpicklingError:
        raise pickled_weights_error(str(src)) from None
    except ValueError as e:
        raise InputError(
            f"{src} ({config.model_type}) has no {task} model class in transformers: {first_line(e)}"
        ) from None


def _head_added(info: dict) -> bool:
    """Whether loading initialised a head: weights the checkpoint lacks, or has in another shape."""
    return bool(info.get("missing_keys")) or bool(info.get("mismatched_keys"))


def load_classifier(source: str | Path, label2id: dict[str, int], note: Callable[[str], None]):
    """(model, tokenizer, info) for sequence classification with ``len(label2id)`` labels.

    ``info`` holds ``head_added`` (True when the checkpoint had no usable classification head and
    one was initialised) and ``pad_token_added``.
    """
    from transformers import AutoModelForSequenceClassification

    src, config = _checked_config(source)
    id2label = {i: lab for lab, i in label2id.items()}
    model, info = _with_head(
        AutoModelForSequenceClassification,
        src,
        config,
        "sequence-classification",
        num_labels=len(label2id),
        id2label=id2label,
        label2id=dict(label2id),
    )
    tokenizer = _tokenizer(src)
    head_added = _head_added(info)
    archs = [a for a in (config.architectures or []) if a.endswith("ForSequenceClassification")]
    if info.get("mismatched_keys") and archs:
        note(
            f"note: {src} has a classification head for {config.num_labels} labels; replaced it with a new "
            f"randomly initialised head for {len(label2id)} labels"
        )
    elif head_added:
        note(
            f"note: {src} has no sequence-classification head ({', '.join(config.architectures or ['?'])}); "
            f"added a new randomly initialised head for {len(label2id)} labels"
        )
    pad_added = _ensure_pad(model, tokenizer, src, note)
    return model, tokenizer, {"head_added": head_added, "pad_token_added": pad_added}


def _ensure_pad(model, tokenizer, src: str, note) -> bool:
    """Give a tokenizer without a pad token its eos token (masked out anyway); True when done."""
    pad_added = False
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise InputError(f"the tokenizer of {src} has neither a pad nor an eos token; cannot batch")
        tokenizer.pad_token = tokenizer.eos_token
        pad_added = True
        note("note: the tokenizer has no pad token; padding with its eos token (masked out)")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return pad_added


def load_qa_model(source: str | Path, note: Callable[[str], None]):
    """(model, tokenizer, info) for extractive question answering (``AutoModelForQuestionAnswering``).

    ``info`` as for :func:`load_classifier`: ``head_added`` is True when the checkpoint had no span
    (start/end) head and a new one was randomly initialised (reported through ``note``).
    """
    from transformers import AutoModelForQuestionAnswering

    src, config = _checked_config(source)
    model, info = _with_head(AutoModelForQuestionAnswering, src, config, "question-answering", num_labels=2)
    tokenizer = _tokenizer(src)
    added = "added a new randomly initialised start/end span head"
    return _with_pad(model, tokenizer, info, src, config, "question-answering", added, note)


def load_causal_lm(source: str | Path, note: Callable[[str], None]):
    """(model, tokenizer, info) for next-token training (``AutoModelForCausalLM``).

    ``info`` as for :func:`load_classifier`: ``head_added`` is True when the checkpoint had no LM
    head and a new one was randomly initialised (reported through ``note``). A model whose position
    t sees later positions (an encoder loaded with an LM head, e.g. BERT's) is refused: its
    next-token loss would read the answer."""
    from transformers import AutoModelForCausalLM

    src, config = _checked_config(source)
    model, info = _with_head(AutoModelForCausalLM, src, config, "causal-LM")
    tokenizer = _tokenizer(src)
    _check_causal(model, src)
    added = "added a new randomly initialised one"
    return _with_pad(model, tokenizer, info, src, config, "causal-LM", added, note)


def _with_pad(model, tokenizer, info: dict, src: str, config, head: str, added: str, note):
    """(model, tokenizer, info) of a loader whose head may be new: a note says "``src`` has no
    ``head`` head (its architectures); ``added``" when loading initialised one, and a tokenizer
    without a pad token pads with its eos token (:func:`_ensure_pad`)."""
    head_added = _head_added(info)
    if head_added:
        note(f"note: {src} has no {head} head ({', '.join(config.architectures or ['?'])}); {added}")
    pad_added = _ensure_pad(model, tokenizer, src, note)
    return model, tokenizer, {"head_added": head_added, "pad_token_added": pad_added}


def _check_causal(model, src: str) -> None:
    """InputError unless changing a sequence's last token leaves the logits of every earlier
    position unchanged (causal attention)."""
    import torch

    vocab = int(model.config.vocab_size)
    ids = torch.arange(1, 5).remainder(vocab).repeat(2, 1)
    ids[1, -1] = (ids[0, -1] + 1) % vocab
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    model.train(was_training)
    if not torch.allclose(logits[0, :-1], logits[1, :-1], rtol=1e-4, atol=1e-5):
        raise InputError(
            f"{src} ({model.config.model_type}) attends to later tokens (bidirectional), so a next-token "
            "loss would read the answer; --task causal-lm needs a decoder (GPT-, Pythia-, Llama-like)"
        )


def load_lora_adapter(model, ckdir: Path) -> None:
    """Load the adapter (and head) weights of the checkpoint ``ckdir`` into the rebuilt peft model."""
    from peft import load_peft_weights, set_peft_model_state_dict

    try:
        weights = load_peft_weights(str(ckdir), device="cpu")
    except Exception as e:  # a missing or damaged adapter file
        raise InputError(
            f"cannot read the LoRA adapter in {ckdir} ({first_line(e)}); "
            "start again without --resume into a new --out (or --overwrite)"
        ) from None
    res = set_peft_model_state_dict(model, weights)
    unexpected = getattr(res, "unexpected_keys", None) or []
    if unexpected:
        raise InputError(f"the LoRA adapter in {ckdir} does not fit this model ({unexpected[0]})")
