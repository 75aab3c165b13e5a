"""``score GRADRUN --basis ACTRUN``: how much of each layer's gradient energy lies in the top-r
activation subspace of the same layer (docs/metrics.md, "Gradient energy in the activation subspace").

The gradient run's moments pass already merges, per layer, the float64 count, mean and centred
scatter of the rows g_t; the uncentred second moment the measure needs is S = M2 + n g-bar g-bar^T,
so no pass is added over the gradients.  The basis run's covariance of the matching activation layer
(``layer_06.grad`` -> ``layer_06``) takes one moments pass over that run.  The arithmetic lives in
geomscope.metrics.subspace; this module pairs the layers, checks the runs and builds the report's
``gradient_energy`` section.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geomscope.errors import InputError
from geomscope.layers import activation_name, is_gradient
from geomscope.score.sources import SourceInfo, open_source


@dataclass
class Basis:
    """The basis run and, for each gradient layer scored, its activation layer there."""

    src: SourceInfo
    pairs: dict[str, str]  # gradient layer -> activation layer of the basis run
    path: str  # the basis run: --basis, or the run of a directory of runs that --basis names


def _model_identity(src: SourceInfo) -> dict:
    from geomscope.model.fingerprint import WEIGHTS_KEY

    m = src.run_obj.identity.get("model") or {}
    # (an identity without WEIGHTS_KEY has none: the model's name is compared instead)
    return {"name": m.get("name"), "weights": m.get(WEIGHTS_KEY), "hidden_size": m.get("hidden_size")}


def open_basis(src: SourceInfo, path: str, ranks, partial: bool, memory_mb: float | None = None) -> Basis:
    """Open and check ``--basis`` (``memory_mb``: --memory-mb, what one decompressed read of it may
    hold); InputError (one line) when it cannot serve the gradient run."""
    grads = [n for n in src.layers if is_gradient(n)]
    if src.kind != "run" or not grads:
        raise InputError(
            f"--basis measures gradients in an activation subspace, but {src.path} holds no gradient "
            "layers (<layer>.grad); give a run of extract --capture gradients"
        )
    path = basis_run_for(src, path)
    basis = open_source(path, partial=partial, memory_mb=memory_mb)
    if basis.kind != "run":
        raise InputError(
            f"--basis {path} is not a run directory; give a run of activations of the same model"
        )
    if basis.dim != src.dim:
        raise InputError(
            f"--basis run {path} has hidden size D = {basis.dim}, the gradients D = {src.dim}; "
            "give activations of the same model"
        )
    ours, theirs = _model_identity(src), _model_identity(basis)
    same = ours["weights"] == theirs["weights"] if ours["weights"] and theirs["weights"] else None
    if same is False or (same is None and ours["name"] != theirs["name"]):
        raise InputError(
            f"--basis run {path} is of model {theirs['name']}, the gradients of {ours['name']} "
            "(other weights); extract the basis from the same checkpoint"
        )
    pairs = {g: activation_name(g) for g in grads}
    have = [n for n in basis.layers if not is_gradient(n)]
    missing = [a for a in pairs.values() if a not in have]
    if missing:
        raise InputError(
            f"--basis run {path} has no activation layer {missing[0]} (it has {', '.join(have) or 'none'}); "
            f"extract that layer into it"
        )
    for g, a in pairs.items():  # the subspace and the gradients live in one space: of one width
        if basis.width(a) != src.width(g):
            raise InputError(
                f"--basis run {path} has layer {a} {basis.width(a)} wide, the gradients {g} "
                f"{src.width(g)}; give activations of the same modules"
            )
    _check_ranks(src, grads, ranks)
    return Basis(basis, pairs, path)


def basis_run_for(src: SourceInfo, path: str) -> str:
    """``--basis`` as the run to read for the gradient run ``src`` (:func:`paired_run`)."""
    return paired_run(src.path, src.run_obj.identity.get("model") or {}, path)


def paired_run(run: str, model: dict, path: str) -> str:
    """``--basis`` as the run to read for the gradient run ``run`` of model identity ``model`` (its
    manifest's ``identity.model``): ``path`` itself, unless it is a directory of runs (``extract
    --revisions``, or one such directory per model), where it is the run there of the gradient
    run's own checkpoint: the same weights by their fingerprint where both runs record it, else the
    same model name and revision. Among several, the gradient run itself, else the one of the same
    folder name; InputError (one line) when none is, or several are."""
    import os

    from geomscope.score.trajectory import runs_under
    from geomscope.store.manifest import MANIFEST_NAME, read_manifest

    runs = runs_under(path)
    if not runs:
        return path
    same = [
        r
        for r in runs
        if _same_checkpoint(model, read_manifest(r / MANIFEST_NAME)["identity"].get("model") or {})
    ]
    if len(same) > 1:
        itself = [r for r in same if os.path.realpath(r) == os.path.realpath(run)]
        namesake = [r for r in same if r.name == os.path.basename(os.path.normpath(run))]
        same = itself or namesake or same
    label = f"{model.get('name')}" + (f"@{model['revision']}" if model.get("revision") else "")
    if not same:
        raise InputError(
            f"--basis {path} holds no run of the checkpoint of {run} ({label}); extract that "
            "revision's activations into it, or give --basis the run"
        )
    if len(same) > 1:
        raise InputError(
            f"--basis {path} holds {len(same)} runs of the checkpoint of {run} ({same[0]}, "
            f"{same[1]}); give --basis the run to use"
        )
    return str(same[0])


def _same_checkpoint(ours: dict, theirs: dict) -> bool:
    """Two runs' model identities name one checkpoint: the same weights' fingerprint where both
    record one, else the same model name and revision."""
    from geomscope.model.fingerprint import WEIGHTS_KEY

    if ours.get(WEIGHTS_KEY) and theirs.get(WEIGHTS_KEY):
        return ours[WEIGHTS_KEY] == theirs[WEIGHTS_KEY]
    return (ours.get("name"), ours.get("revision")) == (theirs.get("name"), theirs.get("revision"))


def _check_ranks(src: SourceInfo, grads: list[str], ranks) -> None:
    """Every rank below the width of every gradient layer scored (one line otherwise)."""
    narrowest = min(grads, key=src.width)
    d = src.width(narrowest)
    too_big = [r for r in ranks if r >= d]
    if not too_big:
        return
    if d == src.dim:
        raise InputError(
            f"--rank {too_big[0]} is not below the hidden size D = {d}; use ranks from 1 to {d - 1}"
        )
    raise InputError(
        f"--rank {too_big[0]} is not below the width D = {d} of layer {narrowest}; use ranks from 1 "
        f"to {d - 1}, or leave that layer out with --layers"
    )


def second_moment(full) -> tuple[np.ndarray, np.ndarray]:
    """(S = sum_t g_t g_t^T, g-bar) from a merged Moments of the gradient rows (float64)."""
    mean = np.asarray(full.mean, dtype=np.float64)
    return full.M2 + full.n * np.outer(mean, mean), mean


def energy_se(groups: list, live: list[int], U: np.ndarray, ranks) -> list[float | None]:
    """Per rank, the delete-one-group jackknife SE of E over the gradient run's groups, the basis
    U (top eigenvectors of the activation covariance, descending) held fixed: its own sampling
    error is not included; the report says so."""
    from geomscope.metrics.subspace import captured_energy
    from geomscope.score.compute import jackknife_se, merged

    if len(live) < 2:
        return [None] * len(ranks)
    reps = []
    for g in live:
        m = merged(groups, skip=g)
        S, _ = second_moment(m)
        reps.append(captured_energy(S, U) if np.trace(S) > 0 else None)
    return [jackknife_se([None if e is None else float(e[r - 1]) for e in reps]) for r in ranks]


def removal_target(target) -> str:
    """The removal test's IsoScore* target: the report's trace/identity; a covariance given for the
    gradient layers does not describe the activations, so those fall back to trace (recorded)."""
    return target if target in ("trace", "identity") else "trace"


def section(basis: Basis, opts, by_layer: dict[str, list | None], notes: dict[str, str]) -> dict:
    """The report's top-level ``gradient_energy``; ``basis`` the run read (of a directory of runs,
    the one paired with the gradient run)."""
    return {
        "basis": basis.path,
        "basis_model": _model_identity(basis.src)["name"],
        "pairs": dict(basis.pairs),
        "ranks": list(opts.ranks),
        "controls": opts.controls,
        "seed": opts.seed,
        "removal_zeta": opts.zeta,
        "removal_target": removal_target(opts.shrinkage_target),
        "S": "sum over the gradient rows of g g^T (uncentred), float64",
        "energy_se": (
            "delete-one-group jackknife over the gradient run's groups, the basis subspace held fixed"
        ),
        "basis_covariance": (
            "covariance (ddof=1) of the basis run's activation layer; U_r its top-r eigenvectors"
        ),
        "layers": by_layer,
        "notes": notes,
    }
