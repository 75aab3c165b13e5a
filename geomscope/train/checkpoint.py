"""Epoch checkpoints and atomic output writing for ``finetune``.

``DIR/checkpoint/`` holds the model and tokenizer after the last finished epoch
(``save_pretrained``, so it is itself a loadable checkpoint), ``trainer.pt`` (optimizer and
grad-scaler state), ``rng.pt`` (Python, NumPy, torch CPU and CUDA generator states of every rank)
and ``state.json`` (epochs done, global step, the run fingerprint).  A new checkpoint is written to
``DIR/.checkpoint.tmp`` and swapped in by renames, so a crash leaves the previous one intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from geomscope.errors import InputError
from geomscope.fileio import write_text_atomic

CKPT = "checkpoint"


def rng_state() -> dict:
    import numpy as np
    import torch

    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    import numpy as np
    import torch

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _replace_dir(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def save_checkpoint(out: Path, model, tokenizer, optimizer, scaler, state: dict, rng_states: list) -> Path:
    """Write the epoch checkpoint atomically (call on the main rank only)."""
    import torch

    tmp = out / ".checkpoint.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None},
        tmp / "trainer.pt",
    )
    torch.save(rng_states, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    _replace_dir(tmp, out / CKPT)
    return out / CKPT


def read_state(out: Path) -> dict | None:
    """The checkpoint's state.json, or None when there is no finished checkpoint."""
    p = out / CKPT / "state.json"
    if not p.exists():
        return None
    return json.loads(p.read_text())


def load_trainer_state(out: Path, optimizer, scaler, rank: int) -> None:
    """Restore optimizer, grad scaler and this rank's RNG states from the checkpoint."""
    import torch

    ck = out / CKPT
    tr = torch.load(ck / "trainer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(tr["optimizer"])
    if scaler is not None and tr.get("scaler") is not None:
        scaler.load_state_dict(tr["scaler"])
    rngs = torch.load(ck / "rng.pt", map_location="cpu", weights_only=False)
    if rank >= len(rngs):
        raise InputError(f"{ck} was written by {len(rngs)} processes; resume with the same number")
    set_rng_state(rngs[rank])


def export_model(out: Path, model, tokenizer, extra: dict[str, dict]) -> None:
    """save_pretrained the final model and tokenizer into ``out`` (file by file, via renames).

    ``extra`` maps file names to JSON objects written alongside (label map ...).
    """
    tmp = out / ".export.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, obj in extra.items():
        (tmp / name).write_text(json.dumps(obj, indent=2))
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            dest = out / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)
    shutil.rmtree(tmp)


def truncate_jsonl(path: Path, keep) -> None:
    """Keep only the JSON lines for which ``keep(record)`` is true (used when resuming)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and keep(json.loads(ln))]
    write_text_atomic(path, "".join(ln + "\n" for ln in lines))
