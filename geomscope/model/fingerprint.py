"""Fingerprints of a model directory's files, as a run's identity records them.

:func:`weights_fingerprint` (:data:`WEIGHTS_KEY`): xxh3_128 over the names, sizes and whole contents
of config.json (and adapter_config.json), every weight file and any model code;
:func:`legacy_weights_fingerprint`: what a run whose identity has no :data:`WEIGHTS_KEY` records
(``weights_sha256``, of each file's first and last 64 KiB), only to resume such runs;
:func:`tokenizer_fingerprint`: sha256 of the tokenizer files.
"""

from __future__ import annotations

from pathlib import Path

from geomscope.fileio import files_digest
from geomscope.model.files import TOKENIZER_FILES, WEIGHT_SUFFIXES


def legacy_weights_fingerprint(model_dir: Path) -> str | None:
    """What a run whose identity has no :data:`WEIGHTS_KEY` records as ``weights_sha256``: sha256 of
    config.json and, for every weight file, its name, size and first and last 64 KiB. Only to resume
    such a run (a change mid-file escapes it: that is why a run records :func:`weights_fingerprint`
    of the whole files)."""
    d = Path(model_dir)
    files = [
        p
        for p in d.iterdir()
        if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    ]
    return files_digest(files, "sha256", head_tail=64 * 1024)


#: files of a Trainer's checkpoint folder beside the weights (optimizer.pt, often twice the model's
#: size, rng_state.pth ...): they do not change the rows, so the fingerprint does not read them
TRAINER_STATE_PREFIXES = ("optimizer", "scheduler", "rng_state", "scaler", "training_args")

#: the identity's key for :func:`weights_fingerprint` (an identity without it has ``weights_sha256``,
#: of each file's first and last 64 KiB only: :func:`legacy_weights_fingerprint`)
WEIGHTS_KEY = "weights_xxh3_128"


#: files beside the weights that change what the loaded model computes: transformers (with peft
#: installed) applies an adapter it finds in the model directory, scaled by adapter_config.json's
#: lora_alpha and r (its weights, adapter_model.*, end with a weight suffix); only present files
#: count, so the fingerprint of a directory without them is what it was
FINGERPRINTED_CONFIGS = ("config.json", "adapter_config.json")


def weights_fingerprint(model_dir: Path) -> str | None:
    """xxh3_128 over ``config.json`` (and ``adapter_config.json``), every weight file (an adapter's
    too) and any code of the model (``*.py``): names, sizes and whole contents.

    Whole contents: a checkpoint re-saved with other values in the middle of a file (encoder layers
    tuned with the embeddings frozen, a LoRA merged, finetune --overwrite into the same folder) keeps
    its size and often its first and last 64 KiB, so a fingerprint of those alone would let a resume
    mix rows of two models. xxh3 reads at memory speed (~10 GB/s a core), far below the cost of loading the
    model, which reads the same bytes.

    A sharded checkpoint's ``*.index.json`` is left out: it only says which shard holds which
    tensor, the shards themselves are fingerprinted, and a shard it leaves out makes tensors missing,
    which loading refuses (:func:`refuse_random_weights`).
    """
    d = Path(model_dir)
    files = sorted(
        p
        for p in d.iterdir()
        if p.is_file()
        and (p.name in FINGERPRINTED_CONFIGS or p.name.endswith((*WEIGHT_SUFFIXES, ".py")))
        and not p.name.startswith(TRAINER_STATE_PREFIXES)
    )
    # extract asks twice (what a rerun of --revisions compares, before the load; the identity, after):
    # the same files, unchanged since (device, inode, size, mtime), are not read again
    key = tuple((str(p), *_stat_key(p)) for p in files)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS.clear()  # one model's at a time: a sweep over checkpoints keeps nothing
        _FINGERPRINTS[key] = files_digest(files, "xxh3_128", nested=True)
    return _FINGERPRINTS[key]


_FINGERPRINTS: dict[tuple, str | None] = {}


def _stat_key(p: Path) -> tuple:
    """What changes when a file is replaced or written: device, inode, size and mtime."""
    st = p.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def tokenizer_fingerprint(model_dir: Path) -> str | None:
    """sha256 of the tokenizer files of a model directory (full contents)."""
    d = Path(model_dir)
    return files_digest([d / n for n in TOKENIZER_FILES if (d / n).is_file()], "sha256")
