"""Epoch checkpoints, the output directory's ownership, and atomic output writing for ``finetune``.

``DIR/checkpoint/`` holds the model and tokenizer after the last finished epoch
(``save_pretrained``, so it is itself a loadable checkpoint; with ``--lora`` the adapter, see
:mod:`geomscope.train.lora`), ``trainer.safetensors`` (the optimizer's tensors and every rank's
torch/CUDA generator states), ``trainer.json`` (the rest of the optimizer, learning-rate scheduler and
grad-scaler state, and the Python/NumPy generator states) and ``state.json`` (epochs done, global
step, the run fingerprint). Nothing is pickled, so loading a checkpoint someone else
made cannot run code; a ``trainer.pt`` (a pickle) is refused. A new checkpoint is written to
``DIR/.checkpoint.tmp`` and swapped in by renames, so a crash leaves the previous one intact.

``DIR/.geomscope-finetune.json`` marks a directory as a finetune output and records what geomscope
wrote into it (``files``: the paths it claimed; ``dirs``: directories it made to hold its own
entries, such as ``checkpoints/``, removed only once empty; ``sha256``: the digest of every file it
wrote whole and never appends to -- the exported model, the adapter, the snapshots, a tracker's
files). A name is claimed before it is first written, and only when nothing is there yet. A marker
is a file anyone can write, so a claim alone removes nothing: ``--overwrite`` (and a resume's clean-up
of stale working directories) removes a claimed entry only when geomscope can recognise it as its
own -- a fixed name of its working state and logs (:data:`RUN_FILES`, :data:`INTERNAL`, a snapshot's
temporary ``checkpoints/.step<N>.tmp``) or content whose recorded digest matches
(:mod:`geomscope.train.proofs`) -- and leaves anything else, even inside ``checkpoints/``. An
unrecorded entry where the new run would write, and a recorded one that is not as geomscope wrote
it, are refused, with one line, before anything is removed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from geomscope.errors import InputError, first_line
from geomscope.fileio import (
    fresh_dir,
    loads_json,
    make_dirs,
    read_json,
    read_regular_text,
    remove_tree,
    replace_dir,
    restore_aside,
    write_json_atomic,
    write_text_atomic,
)
from geomscope.schema import FINETUNE_FORMAT, FINETUNE_MARKER, FINETUNE_MARKER_VERSION
from geomscope.train.proofs import digests, inside, proven, recorded_digests, remove_proven
from geomscope.train.resume_checks import StateMismatch, check_counters, check_label_map, check_trainer_state

CKPT = "checkpoint"
#: --lora: the final adapter (``DIR/adapter/``), written first to its working directory
ADAPTER, ADAPTER_TEMP = "adapter", ".adapter.tmp"
#: what a finetune run writes besides the exported model files
RUN_FILES = ("run.json", "steps.jsonl", "eval.jsonl", "summary.json", "label_map.json")
#: geomscope's working directories in DIR: every run may write them
INTERNAL = (CKPT, ".checkpoint.tmp", ".export.tmp", CKPT + ".old", ADAPTER_TEMP)
_TEMPORARY = (".checkpoint.tmp", ".export.tmp", ADAPTER_TEMP)
SNAPSHOTS = "checkpoints"  # --save-every: checkpoints/step<N>/, each a save_pretrained directory
_SNAPSHOT_NAME = re.compile(r"^\.?step(\d+)(\.tmp)?$")
_SNAPSHOT_TEMP = re.compile(rf"^{SNAPSHOTS}/\.step\d+\.tmp$")
_TENSORS, _STATE = "trainer.safetensors", "trainer.json"


# ---------------------------------------------------------------------------------- ownership
def read_marker(out: Path) -> dict | None:
    p = out / FINETUNE_MARKER
    if not p.is_file() or p.is_symlink():
        return None
    try:
        m = read_json(p)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FINETUNE_FORMAT else None


def planned_outputs(*, lora: bool, tracker_dir: str | None, snapshots: bool) -> tuple[list[str], list[str]]:
    """(the paths a run writes whole, the directories it writes its own entries into)."""
    whole = [*RUN_FILES, *INTERNAL, *([ADAPTER] if lora else []), *([tracker_dir] if tracker_dir else [])]
    return whole, [SNAPSHOTS] if snapshots else []


def _names(values) -> list[str]:
    """The relative paths of a marker list that stay inside DIR (a crafted '../x' is dropped)."""
    out = []
    for v in values if isinstance(values, list) else []:
        if not isinstance(v, str) or not v or "\\" in v or v.startswith("/"):
            continue
        parts = v.split("/")
        if all(p not in ("", ".", "..") for p in parts) and v != FINETUNE_MARKER:
            out.append(v)
    return out


def _recorded(marker: dict) -> tuple[set[str], set[str]]:
    """(paths removed whole, directories removed once empty) that ``marker`` proves geomscope wrote.

    A marker of another version (not :data:`FINETUNE_MARKER_VERSION`) lists only the exported files
    (``adapter`` among them, with --lora): of the rest, only the run's own logs and working directories
    (fixed names no user picks) count as ours; ``checkpoints/`` and the trackers' folders cannot be told
    apart from a user's and are left alone."""
    files, dirs = set(_names(marker.get("files"))), set(_names(marker.get("dirs")))
    if marker.get("version") != FINETUNE_MARKER_VERSION:
        files = {n for n in files if "/" not in n} | set(RUN_FILES) | set(INTERNAL)
        dirs = set()
    return files, dirs


def _digests(marker: dict) -> dict[str, str]:
    """The digests ``marker`` records (:mod:`geomscope.train.proofs`); none in a marker of another version."""
    if marker.get("version") != FINETUNE_MARKER_VERSION:
        return {}
    return recorded_digests(marker.get("sha256"), lambda rel: _names([rel]) == [rel])


def _by_name(rel: str) -> bool:
    """Whether ``rel`` is a name only geomscope uses for its own working state and logs, so that being
    claimed is enough to remove it (everything else takes a matching digest)."""
    return rel in RUN_FILES or rel in INTERNAL or _SNAPSHOT_TEMP.match(rel) is not None


def _ours(out: Path, rel: str, marker: dict) -> bool:
    """Whether the claimed entry ``rel`` may be removed or replaced: a fixed name, or proven."""
    return _by_name(rel) or proven(out, rel, _digests(marker))


def _present(p: Path) -> bool:
    return p.is_symlink() or p.exists()


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def check_output(
    out: Path,
    *,
    resume: bool,
    overwrite: bool,
    writes: tuple | list = (),
    writes_into: tuple | list = (),
    from_step: int = 0,
) -> None:
    """Refuse, with one line, an ``out`` this run may not write (nothing is changed here).

    An absent or empty directory is fine; so is one that a previous finetune wrote (it has the
    marker) with ``resume`` or ``overwrite``; anything else -- a model directory, a data directory,
    a user's files -- is refused, whatever the flags. In a previous run's directory, an entry the run
    will write (``writes``: paths written whole; ``writes_into``: directories it adds ``step<N>``
    snapshots to, past ``from_step`` when resuming) that the marker does not record is refused too:
    it is a user's, and would be replaced or mixed with this run's.
    """
    if out.is_symlink():
        raise InputError(
            f"--out {out} is a link (to {os.readlink(out)}); finetune writes into a directory itself, "
            "never through a link: give the directory itself, or a new or empty one"
        )
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory; give a new or empty directory")
    entries = [p.name for p in out.iterdir()] if out.exists() else []
    marker = read_marker(out)
    if entries and marker is None:
        raise InputError(
            f"--out {out} holds files geomscope did not write ({', '.join(sorted(entries)[:4])}"
            f"{', ...' if len(entries) > 4 else ''}); choose a new or empty directory"
        )
    if marker is None:
        return
    if not resume and not overwrite:
        raise InputError(
            f"{out} already holds a finetune run; pass --resume to continue it, --overwrite to "
            "replace it, or choose another --out"
        )
    files, dirs = _recorded(marker)
    legacy = marker.get("version") != FINETUNE_MARKER_VERSION
    for rel in writes:
        p = inside(out, rel)
        if p is not None and _present(p) and rel not in files and not (legacy and resume):
            _refuse_unrecorded(out, rel)
    _check_writes_into(out, writes_into, marker, files, legacy, resume, from_step)
    _check_claims(out, marker, files)


def _check_writes_into(
    out: Path, writes_into, marker: dict, files: set[str], legacy: bool, resume: bool, from_step: int
) -> None:
    """Refuse, in a previous run's ``out``, a directory of ``writes_into`` that is a link or a file,
    and a ``step<N>`` snapshot in it that this run writes (past ``from_step`` when resuming) which
    the marker does not record or cannot prove the run's."""
    for rel in writes_into:
        p = inside(out, rel)
        if p is None or not _present(p):
            continue
        if p.is_symlink() or not p.is_dir():
            _refuse_unrecorded(out, rel)
        if legacy and resume:  # snapshots under a marker of another version: kept, never removed later
            continue
        for e in sorted(p.iterdir()):
            m, snap = _SNAPSHOT_NAME.match(e.name), f"{rel}/{e.name}"
            if m and (not resume or int(m.group(1)) > from_step):
                if snap not in files:
                    _refuse_unrecorded(out, snap)
                if not _ours(out, snap, marker):
                    _refuse_unproven(out, snap, marker)


def _check_claims(out: Path, marker: dict, files: set[str]) -> None:
    """Refuse a claimed entry that --overwrite would leave and the new run's export would meet: one
    whose recorded digests no longer match (a user edited it), or any unproven one when the marker
    records no digests at all (a marker of another version: its exported files cannot be told from
    claims).
    A claim with no digest in a marker that records them is a claim only: left alone. Snapshots are
    checked where the run writes them, and a tracker's folder is written into, never replaced."""
    from geomscope.train.tracking import DIRS

    recorded = _digests(marker)
    for rel in sorted(files):
        p = inside(out, rel)
        if _by_name(rel) or rel.split("/")[0] in (SNAPSHOTS, *DIRS) or p is None or not _present(p):
            continue
        digested = not recorded or any(k == rel or k.startswith(rel + "/") for k in recorded)
        if digested and not proven(out, rel, recorded):
            _refuse_unproven(out, rel, marker)


def _refuse_unrecorded(out: Path, rel: str) -> None:
    raise InputError(
        f"{out / rel} is not recorded in {out / FINETUNE_MARKER} as written by geomscope, and this run would "
        f"write there; move it out of {out} (or choose another --out)"
    )


def _refuse_unproven(out: Path, rel: str, marker: dict) -> None:
    why = (
        "is not what geomscope wrote there (its recorded sha256 does not match)"
        if _digests(marker)
        else "has no recorded sha256 to prove geomscope wrote it"
    )
    raise InputError(
        f"{out / rel} is claimed in {out / FINETUNE_MARKER} but {why}, so geomscope neither removes nor "
        f"replaces it; move it out of {out} (or choose another --out)"
    )


def take_output(out: Path, *, resume: bool, writes=(), writes_into=()) -> None:
    """After every input has been checked (:func:`check_output`): make ``out`` this run's (a previous
    run it replaces is removed -- only what that run recorded; a resumed run's stale working
    directories are removed) and record what this run will write, before it writes it."""
    marker = read_marker(out)
    if marker is not None and not resume:
        _remove_previous_output(out, marker)
        marker = None
    make_dirs(out)
    files, dirs = _recorded(marker) if marker is not None else (set(), set())
    if marker is not None:
        _remove_stale(out, files)
    # a name is claimed only while nothing is there (or it is ours already): never a user's entry
    files |= {r for r in writes if r in files or not _present(out / r)}
    dirs |= {r for r in writes_into if r in dirs or not _present(out / r)}
    _write_marker(out, files, dirs, _digests(marker) if marker is not None else {})


def _write_marker(out: Path, files, dirs, sha256: dict[str, str]) -> None:
    write_json_atomic(
        out / FINETUNE_MARKER,
        {
            "format": FINETUNE_FORMAT,
            "version": FINETUNE_MARKER_VERSION,
            "files": sorted(files),
            "dirs": sorted(dirs),
            "sha256": dict(sorted(sha256.items())),
        },
    )


def _remove_stale(out: Path, files: set[str]) -> None:
    """A resumed run's leftovers of an interrupted one: its working directories (``.checkpoint.tmp``
    ..., a half-written snapshot), removed when they are claimed and have those fixed names (a link is
    removed, never followed)."""
    for rel in sorted(files):
        p = inside(out, rel)
        stale = rel in _TEMPORARY or rel == CKPT + ".old" or _SNAPSHOT_TEMP.match(rel) is not None
        if p is not None and stale and _present(p):
            _remove(p)


def recover_checkpoint(out: Path) -> None:
    """Put back ``checkpoint/`` from ``checkpoint.old`` when a crash came between the two renames
    that replace it (the previous epoch's checkpoint is then the last whole one)."""
    if read_marker(out) is None:
        return
    old = out / (CKPT + ".old")
    if not old.is_symlink() and (old / "state.json").is_file():
        restore_aside(out / CKPT, old)


def _remove_previous_output(out: Path, marker: dict) -> None:
    """Remove what a previous finetune claimed and geomscope recognises as its own (deepest first): a
    fixed name whole, anything else as far as its recorded digests prove it (:func:`_ours`); then the
    directories it made for its own entries if they are empty now. Nothing else is touched."""
    files, dirs = _recorded(marker)
    recorded = _digests(marker)
    for rel in sorted(files, key=lambda r: -r.count("/")):
        p = inside(out, rel)
        if p is not None and _by_name(rel):
            _remove(p)
        elif p is not None:
            remove_proven(out, rel, recorded)
    for rel in sorted(dirs, key=lambda r: -r.count("/")):
        p = inside(out, rel)
        if p is not None and p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
            p.rmdir()


def record_outputs(out: Path, names: list[str], sha256: dict[str, str] | None = None) -> None:
    """Add paths this run is about to write to the marker, with the digests of the files among them
    (``sha256``: path -> hex digest), so that --overwrite removes them and nothing else."""
    marker = read_marker(out) or {"format": FINETUNE_FORMAT, "version": FINETUNE_MARKER_VERSION}
    files, dirs = _recorded(marker)
    _write_marker(out, files | set(names), dirs, {**_digests(marker), **(sha256 or {})})


# ---------------------------------------------------------------------------------- RNG state
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


def _split_rng(rank: int, st: dict, tensors: dict) -> dict:
    """This rank's generator states: tensors into ``tensors``, the rest as JSON."""
    version, mt, gauss = st["python"]
    kind, keys, pos, has_gauss, cached = st["numpy"]
    tensors[f"rng.{rank}.torch"] = st["torch"]
    for i, t in enumerate(st.get("cuda", [])):
        tensors[f"rng.{rank}.cuda.{i}"] = t
    return {
        "python": [version, list(mt), gauss],
        "numpy": [kind, [int(k) for k in keys], pos, has_gauss, cached],
        "cuda": len(st.get("cuda", [])),
    }


def _join_rng(rank: int, st: dict, tensors: dict) -> dict:
    import numpy as np

    version, mt, gauss = st["python"]
    kind, keys, pos, has_gauss, cached = st["numpy"]
    out = {
        "python": (version, tuple(mt), gauss),
        "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        "torch": tensors[f"rng.{rank}.torch"],
    }
    if st["cuda"]:
        out["cuda"] = [tensors[f"rng.{rank}.cuda.{i}"] for i in range(st["cuda"])]
    return out


# ------------------------------------------------------------------------------ trainer state
def _split_optimizer(sd: dict, tensors: dict) -> dict:
    """An optimizer state_dict: its tensors into ``tensors`` (``opt.<param>.<name>``), the rest JSON."""
    import torch

    state = {}
    for pid, slots in sd["state"].items():
        state[str(pid)] = {}
        for name, v in slots.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{pid}.{name}"] = v.detach().contiguous()
                state[str(pid)][name] = {"tensor": f"opt.{pid}.{name}"}
            else:
                state[str(pid)][name] = {"value": v}
    return {"state": state, "param_groups": sd["param_groups"]}


def _join_optimizer(js: dict, tensors: dict) -> dict:
    state = {}
    for pid, slots in js["state"].items():
        state[int(pid)] = {
            name: tensors[v["tensor"]] if "tensor" in v else v["value"] for name, v in slots.items()
        }
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in js["param_groups"]]
    return {"state": state, "param_groups": groups}


@contextmanager
def written_into(tmp: Path) -> Iterator[Path]:
    """The writes of a checkpoint, snapshot, adapter or export into geomscope's working directory
    ``tmp`` (renamed into place afterwards): on any failure ``tmp`` is removed, so what stood in place
    before (the previous epoch's checkpoint) stays as it was and nothing half-written is left; the
    error of safetensors' writer for a failed write (a full disk) is raised as the OSError it wraps,
    which the CLI says in one line."""
    try:
        yield tmp
        for f in sorted(tmp.rglob("*.safetensors")):
            check_written_safetensors(f)
    except BaseException as e:
        remove_tree(tmp)
        os_error = _os_error_in(e, tmp)
        if os_error is None:
            raise
        raise os_error from None


#: the most bytes of a safetensors header read back (safetensors' own limit on what it parses)
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000


def check_written_safetensors(path: Path) -> None:
    """A .safetensors file just written holds every byte its header declares: its size is 8 + the
    header's length + the end of its last tensor's data. safetensors' writer may return without an
    error from a write a full device cut short; such a file would take the previous checkpoint's
    place with weights no one can load. OSError (ENOSPC, naming the file and the bytes found)
    otherwise, which the caller turns into one line."""
    size = path.stat().st_size
    declared = None
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if 0 < n <= min(SAFETENSORS_HEADER_MAX_BYTES, size - 8):
                header = loads_json(f.read(n))
                ends = [
                    v["data_offsets"][1]
                    for k, v in header.items()
                    if k != "__metadata__" and isinstance(v, dict)
                ]
                declared = 8 + n + max(ends, default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):  # a header cut short or garbled
        declared = None
    if declared != size:
        wanted = "" if declared is None else f" of the {declared} its header declares"
        raise OSError(errno.ENOSPC, f"cut short, {size} bytes on disk{wanted} (a full disk?)", str(path))


def _os_error_in(e: BaseException, where: Path) -> OSError | None:
    """The OSError a SafetensorError reports (its text carries the errno: ``Os { code: 28, ...``)."""
    found = re.search(r"\bcode: (\d+)", str(e)) if type(e).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(where))


def save_checkpoint(
    out: Path,
    model,
    tokenizer,
    optimizer,
    scaler,
    state: dict,
    rng_states: list,
    scheduler=None,
    weights: dict | None = None,
) -> Path:
    """Write the epoch checkpoint atomically (call on the main rank only).

    ``weights``: the model's full state dict when it is sharded (FSDP, DeepSpeed; gathered by every
    process beforehand); ``optimizer`` None then: the sharded optimizer state is not kept, the model
    alone is, and ``state.json`` says ``"resumable": false``."""
    from safetensors.torch import save_file

    with written_into(fresh_dir(out / ".checkpoint.tmp")) as tmp:
        _save_model(model, tmp, weights)
        tokenizer.save_pretrained(tmp)
        if optimizer is None:
            state = {**state, "resumable": False}
        else:
            tensors: dict = {}
            trainer = {
                "optimizer": _split_optimizer(optimizer.state_dict(), tensors),
                "scaler": scaler.state_dict() if scaler is not None else None,
                **({"scheduler": scheduler_state(scheduler)} if scheduler is not None else {}),
                "rng": [_split_rng(r, st, tensors) for r, st in enumerate(rng_states)],
            }
            save_file(tensors, str(tmp / _TENSORS))
            (tmp / _STATE).write_text(json.dumps(trainer))
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
    replace_dir(tmp, out / CKPT, aside=out / (CKPT + ".old"))  # put back by a resume after a crash
    return out / CKPT


def _save_model(model, where: Path, weights: dict | None) -> None:
    """``save_pretrained``, from ``weights`` when the model is sharded (its own tensors are shards)."""
    model.save_pretrained(where, **({"state_dict": weights} if weights is not None else {}))


def check_checkpoint_dir(out: Path) -> None:
    """InputError (one line) unless ``out/checkpoint`` (when there) is a real directory of regular
    files, as :func:`save_checkpoint` writes it: a checkpoint that is a link would be read from
    elsewhere (and the renames that replace it would move the link), and a file that is a link, a
    FIFO or a device would be read from elsewhere, block, or never end."""
    ckpt = out / CKPT
    if ckpt.is_symlink():
        raise InputError(
            f"{ckpt} is a link (to {os.readlink(ckpt)}); a resume reads only the checkpoint directory "
            "geomscope wrote: put that directory in its place, or start again without --resume into a "
            "new --out (or --overwrite)"
        )
    for p in sorted(ckpt.iterdir()) if ckpt.is_dir() else ():
        if not stat.S_ISREG(os.lstat(p).st_mode):
            raise InputError(
                f"{p} is not a regular file (a link, a pipe, a device or a folder), which a checkpoint "
                "geomscope wrote never holds; start again without --resume into a new --out (or --overwrite)"
            )


def read_state(out: Path) -> dict | None:
    """The checkpoint's state.json, or None when there is no finished checkpoint; InputError (one
    line) for one that is not a regular file, not JSON, or whose fields are mistyped, whose counters
    are out of order or whose label map is not one class id per label
    (:func:`geomscope.train.resume_checks.check_counters`, :func:`~.resume_checks.check_label_map`)."""
    check_checkpoint_dir(out)
    p = out / CKPT / "state.json"
    if not p.exists():
        return None
    try:
        st = read_json(p)
    except (OSError, ValueError) as e:
        raise InputError(
            f"{p} is damaged ({first_line(e)}); rerun without --resume into a new --out (or --overwrite)"
        ) from None
    need = {"epochs_done": int, "global_step": int, "fingerprint": dict, "label2id": dict}
    if not isinstance(st, dict) or any(not isinstance(st.get(k), t) for k, t in need.items()):
        raise InputError(
            f"{p} is damaged (missing or mistyped fields); rerun without --resume into a new --out "
            "(or --overwrite)"
        )
    try:
        check_counters(st)
        check_label_map(st)
    except StateMismatch as e:
        raise InputError(
            f"{p} is damaged ({e}); rerun without --resume into a new --out (or --overwrite)"
        ) from None
    return st


def scheduler_state(scheduler) -> dict:
    """A ``LambdaLR``'s state as JSON: its counters and learning rates (the lambdas are code, rebuilt
    from the options on resume)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def load_trainer_state(out: Path, optimizer, scaler, rank: int, scheduler=None) -> None:
    """Restore optimizer, LR scheduler, grad scaler and this rank's RNG states from the checkpoint (no
    unpickling)."""
    ck, state = out / CKPT, read_state(out)
    if state.get("resumable", True) is False:
        raise InputError(
            f"{ck} was written by a sharded run (FSDP or DeepSpeed) and holds the model only, not the "
            f"optimizer state; start a new --out with --model {ck} instead of --resume"
        )
    if (ck / "trainer.pt").exists():
        raise InputError(
            f"{ck} holds trainer.pt, a pickle, which geomscope never loads (it could run code); "
            "start again without --resume into a new --out (or --overwrite)"
        )
    tensors, trainer = _read_trainer_files(out)  # (read_state checked that they are regular files)
    try:
        check_trainer_state(
            trainer,
            tensors,
            optimizer=optimizer,
            scaler=scaler,
            scheduler=scheduler,
            schedule_now=scheduler_state(scheduler) if scheduler is not None else None,
            rank=rank,
            step=state["global_step"],
        )
    except StateMismatch as e:
        raise InputError(
            f"the trainer state in {ck} is damaged or of another run ({e}); start again without "
            "--resume into a new --out (or --overwrite)"
        ) from None
    try:
        optimizer.load_state_dict(_join_optimizer(trainer["optimizer"], tensors))
        if scaler is not None and trainer.get("scaler") is not None:
            scaler.load_state_dict(trainer["scaler"])
        if scheduler is not None:
            scheduler.load_state_dict({**scheduler.state_dict(), **trainer["scheduler"]})
        set_rng_state(_join_rng(rank, trainer["rng"][rank], tensors))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise InputError(
            f"the trainer state in {ck} is damaged ({type(e).__name__}: {e}); start again without "
            "--resume into a new --out (or --overwrite)"
        ) from None


def _read_trainer_files(out: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    ck = out / CKPT
    try:
        tensors = load_file(str(ck / _TENSORS))
        trainer = read_json(ck / _STATE)
    except Exception as e:  # missing or truncated files: SafetensorError, OSError, JSONDecodeError
        raise InputError(
            f"the trainer state in {ck} is missing or damaged ({first_line(e)}); start again without "
            "--resume into a new --out (or --overwrite)"
        ) from None
    if not isinstance(trainer, dict):
        raise InputError(f"the trainer state in {ck} is damaged; start again without --resume")
    return tensors, trainer


# ------------------------------------------------------------------------------------ export
def export_model(out: Path, model, tokenizer, extra: dict[str, dict], weights: dict | None = None) -> None:
    """save_pretrained the final model and tokenizer into ``out`` (file by file, via renames).

    ``extra`` maps file names to JSON objects written alongside (label map ...). Every exported
    name is recorded in the marker first, so --overwrite can remove exactly these later; a name
    already taken by an entry the marker does not record is refused, never replaced.
    ``weights``: the gathered state dict of a sharded model (see :func:`save_checkpoint`).
    """
    with written_into(fresh_dir(out / ".export.tmp")) as tmp:
        _save_model(model, tmp, weights)
        tokenizer.save_pretrained(tmp)
        for name, obj in extra.items():
            (tmp / name).write_text(json.dumps(obj, indent=2))
    files = [f for f in sorted(tmp.rglob("*")) if f.is_file()]
    names = sorted({f.relative_to(tmp).parts[0] for f in files})
    marker = read_marker(out) or {"version": FINETUNE_MARKER_VERSION}
    recorded, _ = _recorded(marker)
    for name in names:  # a user's file of that name (put there during the run, or claimed): kept
        if _present(out / name) and not (name in recorded and _ours(out, name, marker)):
            shutil.rmtree(tmp)
            raise InputError(
                f"{out / name} is not recorded in {out / FINETUNE_MARKER} as written by geomscope (or is "
                f"not as geomscope wrote it), and the export would replace it; move it out of {out} and "
                "rerun with --resume"
            )
    record_outputs(out, names, digests(tmp))
    for f in files:
        dest = out / f.relative_to(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, dest)
    shutil.rmtree(tmp)


def save_snapshot(out: Path, model, tokenizer, step: int, weights: dict | None = None) -> Path:
    """``out/checkpoints/step<step>/``: the model and tokenizer as ``save_pretrained`` writes them
    (so ``extract --revisions 'out/checkpoints/*'`` reads them), written to a temporary name and
    renamed whole. An existing snapshot of that step (a resumed run) is kept."""
    dest = out / SNAPSHOTS / f"step{step}"
    if dest.is_dir():
        return dest
    record_outputs(out, [f"{SNAPSHOTS}/step{step}", f"{SNAPSHOTS}/.step{step}.tmp"])
    with written_into(fresh_dir(out / SNAPSHOTS / f".step{step}.tmp")) as tmp:
        _save_model(model, tmp, weights)
        tokenizer.save_pretrained(tmp)
    record_outputs(out, [], digests(tmp, f"{SNAPSHOTS}/step{step}"))
    replace_dir(tmp, dest)
    return dest


def truncate_jsonl(path: Path, keep) -> None:
    """Keep only the JSON lines for which ``keep(record)`` is true (used when resuming)."""
    if not path.exists():
        return
    kept = []
    try:
        text = read_regular_text(path, errors="replace")
    except OSError as e:
        raise InputError(
            f"{path} cannot be read ({e.strerror or e}); start again without --resume into a new --out "
            "(or --overwrite)"
        ) from None
    for i, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            record = loads_json(ln)
        except ValueError as e:
            raise InputError(
                f"{path} line {i} is not JSON geomscope reads ({e}; the log is damaged); start again "
                "without --resume into a new --out (or --overwrite)"
            ) from None
        if isinstance(record, dict) and keep(record):
            kept.append(ln)
    write_text_atomic(path, "".join(ln + "\n" for ln in kept))
