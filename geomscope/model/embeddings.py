"""Reading a checkpoint's input and output embedding matrices, without loading the model.

Only the two matrices are read: the parameter names come from the model class built on the meta
device (no weights allocated), the tensors from the weight files (safetensors ``safe_open`` reads
just those tensors; a ``.bin`` checkpoint is memory-mapped). The checkpoint is a local directory
or a cached Hugging Face snapshot of the recorded name and revision (offline).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geomscope.errors import DataError
from geomscope.fileio import read_json
from geomscope.model.files import pickled_weights_error


def find_checkpoint(model: dict | None, identity: dict | None = None) -> Path | None:
    """A local checkpoint directory (with config.json) for the run's model, or None."""
    cands = []
    for holder in (model or {}, (identity or {}).get("model") or {}):
        for key in ("path", "local_path", "checkpoint", "name_or_path", "source", "name"):
            v = holder.get(key)
            if isinstance(v, str) and v:
                cands.append(v)
    for c in cands:
        p = Path(c).expanduser()
        if (p / "config.json").exists():
            return p
    name = (model or {}).get("name")
    if isinstance(name, str) and name.count("/") == 1 and not Path(name).exists():
        try:
            from huggingface_hub import snapshot_download

            p = Path(snapshot_download(name, revision=(model or {}).get("revision"), local_files_only=True))
            if (p / "config.json").exists():
                return p
        except Exception:  # not cached / offline: the checkpoint is not at hand
            return None
    return None


OUTPUT_ALIASES = (
    "lm_head.weight",
    "embed_out.weight",
    "cls.predictions.decoder.weight",
    "output.weight",
    "decoder.weight",
    "proj_out.weight",
)


def _param_names(ckpt: Path):
    """(input names, output names, tied, base prefix, shapes) from the model class on the meta device."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(ckpt, trust_remote_code=False)  # never run its code
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(config, trust_remote_code=False)
    else:
        with torch.device("meta"):
            model = cls(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    emb_in = model.get_input_embeddings()
    emb_out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_names = [n for n, p in params.items() if p is emb_in.weight]
    out_names = [] if emb_out is None else [n for n, p in params.items() if p is emb_out.weight]
    tied = emb_out is not None and emb_out.weight is emb_in.weight
    prefix = getattr(model, "base_model_prefix", "") or ""
    shapes = {
        "input": tuple(emb_in.weight.shape),
        "output": None if emb_out is None else tuple(emb_out.weight.shape),
    }
    return in_names, out_names, tied, prefix, shapes


class _Weights:
    """Read single tensors from a checkpoint's weight files (safetensors preferred)."""

    def __init__(self, ckpt: Path):
        """Index the tensors of ``ckpt``'s weight files by name (a .bin checkpoint is memory-mapped)."""
        self.ckpt = ckpt
        self.files: dict[str, Path] = {}
        idx = ckpt / "model.safetensors.index.json"
        if idx.exists():
            wm = read_json(idx)["weight_map"]
            self.files = {k: ckpt / f for k, f in wm.items()}
        elif (ckpt / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(ckpt / "model.safetensors", framework="pt") as f:
                self.files = {k: ckpt / "model.safetensors" for k in f.keys()}
        elif (ckpt / "pytorch_model.bin").exists():
            import torch

            path = ckpt / "pytorch_model.bin"
            try:
                try:
                    self._bin = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                except RuntimeError as e:  # the legacy (not zip) format cannot be memory-mapped
                    if "mmap" not in str(e):
                        raise
                    self._bin = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:  # objects besides tensors: refused, never unpickled
                raise pickled_weights_error(str(ckpt)) from None
            self.files = {k: ckpt / "pytorch_model.bin" for k in self._bin}
        else:
            raise DataError(f"{ckpt} holds no model.safetensors or pytorch_model.bin")

    def find(self, names: list[str], prefix: str, shape=None, aliases=(), exclude=None) -> str | None:
        """The checkpoint key of a parameter: its name (with or without the base-model prefix), else
        a known alias with the same shape (checkpoints may name it differently, e.g. Pythia's
        ``embed_out.weight`` for ``lm_head.weight``)."""
        for n in names:
            cands = [n]
            if prefix and n.startswith(prefix + "."):
                cands.append(n[len(prefix) + 1 :])
            elif prefix:
                cands.append(f"{prefix}.{n}")
            for c in cands:
                if c in self.files:
                    return c
        hits = [
            k
            for k in self.files
            if k != exclude
            and any(k == a or k.endswith("." + a) for a in aliases)
            and (shape is None or self.shape(k) == tuple(shape))
        ]
        return hits[0] if len(hits) == 1 else None

    def shape(self, key: str) -> tuple:
        """The shape of tensor ``key``, read from the file's header."""
        f = self.files[key]
        if f.suffix == ".bin":
            return tuple(self._bin[key].shape)
        from safetensors import safe_open

        with safe_open(f, framework="pt") as fh:
            return tuple(fh.get_slice(key).get_shape())

    def get(self, key: str) -> np.ndarray:
        """Tensor ``key`` as a float32 array."""
        f = self.files[key]
        if f.suffix == ".bin":
            t = self._bin[key]
        else:
            from safetensors import safe_open

            with safe_open(f, framework="pt") as fh:
                t = fh.get_tensor(key)
        return t.float().numpy()


@dataclass
class EmbeddingMatrices:
    """The input embedding matrix, and the output (LM head) one unless tied or absent."""

    input: np.ndarray
    output: np.ndarray | None
    tied: bool
    input_key: str
    output_key: str | None
    note: str


def read_embedding_matrices(ckpt: Path) -> EmbeddingMatrices | None:
    """The embedding matrices of the checkpoint directory ``ckpt`` (None: no input matrix found)."""
    in_names, out_names, tied, prefix, shapes = _param_names(ckpt)
    weights = _Weights(ckpt)
    k_in = weights.find(in_names, prefix)
    if k_in is None:
        return None
    w_in = weights.get(k_in)
    k_out = (
        weights.find(out_names, prefix, shapes["output"], OUTPUT_ALIASES, exclude=k_in) if out_names else None
    )
    if tied or k_out == k_in:
        return EmbeddingMatrices(
            w_in, None, True, k_in, k_in, "output embedding is tied to the input embedding (one matrix)"
        )
    if k_out is not None:
        return EmbeddingMatrices(w_in, weights.get(k_out), False, k_in, k_out, "")
    return EmbeddingMatrices(
        w_in, None, False, k_in, None, "the checkpoint has no output (LM head) embedding matrix"
    )
