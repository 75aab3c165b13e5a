"""Training-log figures for ``geomscope finetune`` runs.

A training log is a finetune output directory (holding ``steps.jsonl``, and ``eval.jsonl`` /
``run.json`` when present) or a ``steps.jsonl`` file itself (its siblings are read too).  The
figure has four panels against the optimizer step: task loss (cross-entropy), the regulariser's raw
penalty R (I-STAR: 1 - IsoScore*; CosReg: Gao et al.'s R), the batch IsoScore* (with the eval-set
IsoScore* per epoch as markers), and eval accuracy / macro-F1 per epoch (F1 / exact match for
``--task qa`` runs, perplexity for ``--task causal-lm`` runs).  Several runs overlay,
each labelled with its directory name, regulariser and lambda.

The IsoScore* panel's labels name each series' shrinkage target: an I-STAR run's batch IsoScore* is
the penalty's own, shrunk towards C0 (the epoch's training covariance), and its eval marks are
``isoscore_star_c0_pooled``, the same quantity on the eval set; other runs' batch and eval values
shrink towards the trace-matched identity (eval ``isoscore_star``, :mod:`geomscope.train.evaluate`).
An I-STAR log without ``isoscore_star_c0_pooled`` marks its trace-target eval value, so labelled.

Logs written with ``finetune --log-geometry`` (step records with a ``geometry`` entry,
:mod:`geomscope.train.geometry`) get a third row: the captured gradient energy
E = tr(U_r^T S U_r) / tr(S) in each layer's own top-r activation subspace against the step, one line
per layer (coloured by depth) at the log's largest rank -- or, when every log has a single chosen
layer, one line per rank -- with the mean of its normal controls dotted (logs that record them) and
the r/D baselines dashed; and the per-layer batch IsoScore*.  Logs without geometry draw the four panels
alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from geomscope.errors import InputError, first_line
from geomscope.fileio import loads_json, read_json
from geomscope.plot._reports import is_number

_STEP_KEYS = {"step", "task_loss"}


def _steps_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / "steps.jsonl" if p.is_dir() else p


def is_training_log(path: str | os.PathLike) -> bool:
    """True for a finetune output directory (has steps.jsonl) or a finetune steps.jsonl file."""
    f = _steps_file(path)
    if not f.is_file() or f.suffix != ".jsonl":
        return False
    if f.name == "steps.jsonl":
        return True
    try:
        with open(f, encoding="utf-8") as fh:
            first = next((ln for ln in fh if ln.strip()), "")
        rec = loads_json(first) if first else {}
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return False
    return isinstance(rec, dict) and _STEP_KEYS <= set(rec)


def _read_jsonl(path: Path) -> list[dict]:
    """A finetune log's records, each checked to be what the plot reads (:func:`_record_defect`)."""
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for i, ln in enumerate(fh, 1):
                if not ln.strip():
                    continue
                try:
                    rec = loads_json(ln)
                except ValueError as e:
                    raise InputError(
                        f"{path} line {i} is not valid JSON ({first_line(e)}); is the file complete?"
                    ) from None
                why = _record_defect(rec)
                if why:
                    raise InputError(f"{path} line {i} is not a finetune record ({why})")
                out.append(rec)
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8 text; give the logs geomscope finetune wrote") from None
    return out


def _number(v) -> bool:
    """A number a curve can take: any float (a diverged loss is logged as NaN), an integer within
    float range (:func:`~geomscope.plot._reports.is_number`)."""
    return isinstance(v, float) or is_number(v)


#: a rank key of a geometry record's ``energy``: ASCII digits (str.isdigit is true for '²', which
#: int() refuses)
_RANK_KEY = re.compile(r"[0-9]+")


#: the record fields the curves read (the rest of a record is left as it is)
_PLOTTED = (
    "task_loss",
    "penalty",
    "isoscore_star",
    "isoscore_star_c0_pooled",
    "f1",
    "exact_match",
    "accuracy",
    "macro_f1",
    "perplexity",
)


def _record_defect(rec) -> str | None:
    """Why a steps.jsonl / eval.jsonl record is not what the plot reads, or None: an object with an
    integer ``step``, numbers (or null) where the curves read them, and a ``geometry`` of layers whose
    ``energy`` and ``baseline`` are keyed by rank."""
    if not isinstance(rec, dict):
        return "not an object"
    if not isinstance(rec.get("step"), int) or not is_number(rec["step"]):
        return "no integer step"
    for key in _PLOTTED:
        if not (rec.get(key) is None or _number(rec[key])):
            return f"{key} is not a number"
    geometry = rec.get("geometry")
    if geometry is None:
        return None
    if not isinstance(geometry, dict) or not all(isinstance(g, dict) for g in geometry.values()):
        return "geometry is not an object of layers"
    for g in geometry.values():
        for key in ("energy", "baseline", "control_energy_mean"):
            by_rank = g.get(key)
            if by_rank is not None and not (
                isinstance(by_rank, dict)
                and all(_RANK_KEY.fullmatch(k) and (v is None or _number(v)) for k, v in by_rank.items())
            ):
                return f"geometry {key} is not keyed by rank"
        if not (g.get("isoscore_star") is None or _number(g["isoscore_star"])):
            return "geometry isoscore_star is not a number"
    return None


def read_training_log(path: str | os.PathLike) -> dict:
    """{"label", "steps": [...], "evals": [...], "run": {...}} of one finetune log."""
    f = _steps_file(path)
    if not is_training_log(path):
        raise InputError(
            f"{path} is not a finetune training log (expected a finetune --out directory or steps.jsonl)"
        )
    steps = _read_jsonl(f)
    if not steps:
        raise InputError(f"{f} has no logged steps yet; plot it after the first step")
    evals = _read_jsonl(f.parent / "eval.jsonl") if (f.parent / "eval.jsonl").is_file() else []
    run = {}
    if (f.parent / "run.json").is_file():
        try:
            run = read_json(f.parent / "run.json").get("config", {})
        except (OSError, ValueError, AttributeError):  # (UnicodeDecodeError is a ValueError)
            run = {}
        if (
            not isinstance(run, dict)
            or not isinstance(run.get("reg", ""), str)
            or not is_number(run.get("lam", 0))
            or not (run.get("zeta") is None or is_number(run["zeta"]))
        ):
            run = {}  # only the legend reads it: a damaged one is left out
    name = f.parent.name if f.name == "steps.jsonl" else f.stem
    if run.get("reg"):
        name += f" ({run['reg']}" + (f", λ={run['lam']:g})" if run["reg"] != "none" else ")")
    return {"label": name, "steps": steps, "evals": evals, "run": run}


def _series(recs: list[dict], key: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in recs:
        v = r.get(key)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _geometry_layers(recs: list[dict]) -> list[str]:
    """The layer names of a log's geometry records, in first-seen order."""
    names: list[str] = []
    for r in recs:
        for name in r.get("geometry") or {}:
            if name not in names:
                names.append(name)
    return names


def _geometry_ranks(recs: list[dict]) -> list[str]:
    """The ranks (JSON keys) of a log's geometry records, ascending."""
    ranks: set[str] = set()
    for r in recs:
        for layer in (r.get("geometry") or {}).values():
            ranks.update((layer.get("energy") or {}).keys())
    return sorted(ranks, key=int)


def _geometry_series(recs: list[dict], layer: str, key: str, rank: str | None = None) -> tuple[list, list]:
    xs, ys = [], []
    for r in recs:
        v = ((r.get("geometry") or {}).get(layer) or {}).get(key)
        if rank is not None:
            v = (v or {}).get(rank)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _plot_geometry(ax_e, ax_i, logs: list[dict]) -> None:
    """The --log-geometry row: captured energy (with the r/D baselines dashed) and per-layer IsoScore*."""
    from geomscope.plot._style import LINESTYLES, PALETTE, depth_cmap, plain_text

    cmap = depth_cmap()
    per_rank = all(len(_geometry_layers(log["steps"])) <= 1 for log in logs)
    baselines: dict[str, float] = {}
    shown_ranks: set[str] = set()
    controls_named = False
    for i, log in enumerate(logs):
        recs = log["steps"]
        names = _geometry_layers(recs)
        ranks = _geometry_ranks(recs)
        if not names or not ranks:
            continue
        ls = LINESTYLES[i % len(LINESTYLES)] if len(logs) > 1 else "-"
        tag = f"{plain_text(log['label'])}: " if len(logs) > 1 else ""
        for j, name in enumerate(names):
            colour = cmap(j / max(len(names) - 1, 1))
            for k, rank in enumerate(ranks if per_rank else ranks[-1:]):
                c = PALETTE[k % len(PALETTE)] if per_rank else colour
                xs, ys = _geometry_series(recs, name, "energy", rank)
                if xs:
                    ax_e.plot(
                        xs,
                        ys,
                        color=c,
                        linestyle=ls,
                        linewidth=1.0,
                        label=f"{tag}{plain_text(name)}, r={rank}",
                    )
                    shown_ranks.add(rank)
                xs, ys = _geometry_series(recs, name, "control_energy_mean", rank)
                if xs:
                    label = "_nolegend_" if controls_named else "mean of the normal controls (dotted)"
                    ax_e.plot(xs, ys, color=c, linestyle=":", linewidth=0.8, label=label)
                    controls_named = True
                for r in recs:
                    b = (((r.get("geometry") or {}).get(name) or {}).get("baseline") or {}).get(rank)
                    if b is not None:
                        baselines.setdefault(rank, b)
                        break
            xs, ys = _geometry_series(recs, name, "isoscore_star")
            if xs:
                ax_i.plot(xs, ys, color=colour, linestyle=ls, linewidth=1.0, label=f"{tag}{plain_text(name)}")
    _finish_geometry_axes(ax_e, ax_i, baselines, shown_ranks, per_rank)


def _finish_geometry_axes(ax_e, ax_i, baselines: dict, shown_ranks: set, per_rank: bool) -> None:
    """The geometry row's r/D baselines (dashed, for the ranks drawn), titles, axis labels and legends."""
    from geomscope.plot._style import PALETTE

    for k, rank in enumerate(sorted(shown_ranks, key=int)):
        if rank in baselines:
            ax_e.axhline(
                baselines[rank],
                color=PALETTE[k % len(PALETTE)] if per_rank else "0.4",
                linestyle="--",
                linewidth=0.8,
                label=f"r/D = {baselines[rank]:.3g} (r={rank})",
            )
    ax_e.set_title("gradient energy in top-r subspace" + ("" if per_rank else " (largest r)"))
    ax_e.set_ylabel("tr(UᵀSU)/tr(S)")
    ax_i.set_title("batch IsoScore* per layer")
    for ax in (ax_e, ax_i):
        ax.set_xlabel("optimizer step")
        if ax.has_data():
            ax.legend(fontsize=6, loc="best")


_CLASSIFY = (("accuracy", "accuracy"), ("macro_f1", "macro-F1"))
_QA = (("f1", "F1 %"), ("exact_match", "exact match %"))
_LM = (("perplexity", "perplexity"),)


def _eval_kind(log: dict) -> str:
    """The task of a log's eval records: ``qa`` (SQuAD scores), ``causal-lm`` (perplexity) or
    ``classification``."""
    if any("exact_match" in e for e in log["evals"]):
        return "qa"
    return "causal-lm" if any("perplexity" in e for e in log["evals"]) else "classification"


def _isoscore_targets(log: dict) -> tuple[str, str, str]:
    """(batch label suffix, eval key, eval label suffix) of one log's IsoScore* series: C0 target for
    an I-STAR run (the penalty's; its eval marks too where the log records them), trace otherwise; no
    target named where run.json does not say the regulariser."""
    reg = log["run"].get("reg")
    if reg == "istar":
        if any(e.get("isoscore_star_c0_pooled") is not None for e in log["evals"]):
            return ", C0 target", "isoscore_star_c0_pooled", ", C0 target"
        return ", C0 target", "isoscore_star", ", trace target"
    suffix = ", trace target" if reg else ""
    return suffix, "isoscore_star", suffix


def plot_training_log(log_paths, out: str | os.PathLike | None = None):
    """Figure (matplotlib Figure) of one or more training logs; saved to ``out`` when given."""
    from geomscope.plot._style import new_figure

    paths = [log_paths] if isinstance(log_paths, (str, os.PathLike)) else list(log_paths)
    if not paths:
        raise InputError("no training logs given; pass a finetune --out directory or its steps.jsonl")
    logs = [read_training_log(p) for p in paths]
    geometry = any(any(r.get("geometry") for r in log["steps"]) for log in logs)
    fig = new_figure(9.0, 9.0 if geometry else 6.0)
    axes = fig.subplots(3 if geometry else 2, 2, sharex=True)
    for i, log in enumerate(logs):
        _draw_log(axes[:2], log, i)
    _label_panels(fig, axes[:2], logs)
    if geometry:
        _plot_geometry(*axes[2], logs)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    return fig


def _draw_log(main_axes, log: dict, i: int) -> None:
    """The i-th log's curves, in the i-th series style, on the four panels ``main_axes``, ``((loss,
    penalty), (IsoScore*, eval scores))``: task loss, penalty (when logged), batch IsoScore* with its
    eval marks, and the eval scores (accuracy and macro-F1, or F1 and exact match for a QA run)."""
    from geomscope.plot._style import plain_text, series_style

    (ax_loss, ax_pen), (ax_iso, ax_acc) = main_axes
    st = series_style(i)
    line = {"color": st["color"], "linestyle": st["linestyle"], "linewidth": 1.0}
    mark = {"color": st["color"], "marker": st["marker"], "markersize": 4}
    label = plain_text(log["label"])  # a directory name: drawn as it is
    ax_loss.plot(*_series(log["steps"], "task_loss"), label=label, **line)
    xs, ys = _series(log["steps"], "penalty")
    if xs:
        ax_pen.plot(xs, ys, label=label, **line)
    batch_target, eval_key, eval_target = _isoscore_targets(log)
    ax_iso.plot(
        *_series(log["steps"], "isoscore_star"), label=f"{label}: batch{batch_target}", alpha=0.8, **line
    )
    xs, ys = _series(log["evals"], eval_key)
    if xs:
        ax_iso.plot(xs, ys, linestyle="none", label=f"{label}: eval{eval_target}", **mark)
    scores = {"qa": _QA, "causal-lm": _LM}.get(_eval_kind(log), _CLASSIFY)
    first = scores[0]
    xs, ys = _series(log["evals"], first[0])
    if not xs:
        return
    ax_acc.plot(xs, ys, label=f"{label}: {first[1]}", linestyle=st["linestyle"], **mark)
    for second in scores[1:]:
        ax_acc.plot(
            *_series(log["evals"], second[0]),
            label=f"{label}: {second[1]}",
            linestyle=":",
            color=st["color"],
            marker=st["marker"],
            markersize=3,
            alpha=0.6,
        )


def _label_panels(fig, main_axes, logs: list[dict]) -> None:
    """The four panels ``main_axes``' titles (the first log's zeta in IsoScore*'s; the eval panel's
    named for the logs' tasks), the figure's note on shrinkage targets, step labels, legends, and a
    note on an empty penalty panel."""
    (ax_loss, ax_pen), (ax_iso, ax_acc) = main_axes
    zeta = logs[0]["run"].get("zeta")
    ax_loss.set_title("task loss (cross-entropy)")
    ax_pen.set_title("penalty R (I-STAR: 1 − IsoScore*; CosReg)")
    ax_iso.set_title(
        "IsoScore*" + (f" (ζ={zeta:g})" if zeta is not None else "") + ": line batch, marks eval"
    )
    fig.suptitle(
        "IsoScore* shrinkage target as labelled: C0 = the epoch's training covariance "
        "(the I-STAR penalty's), trace = the trace-matched identity",
        fontsize=7,
    )
    kinds = {_eval_kind(log) for log in logs}
    ax_acc.set_title(
        {
            frozenset({"classification"}): "eval accuracy / macro-F1 (per epoch)",
            frozenset({"qa"}): "eval F1 / exact match, % (per epoch)",
            frozenset({"classification", "qa"}): "eval accuracy, macro-F1 (0-1) / QA F1, exact match (%)",
            frozenset({"causal-lm"}): "eval perplexity (per epoch)",
        }.get(frozenset(kinds), "eval scores per task (accuracy 0-1, QA %, perplexity)")
    )
    for ax in (ax_iso, ax_acc):
        ax.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_pen, ax_iso, ax_acc):
        if ax.has_data():
            ax.legend(fontsize=7, loc="best")
    if not ax_pen.has_data():
        ax_pen.text(
            0.5, 0.5, "no regulariser (--reg none)", ha="center", va="center", transform=ax_pen.transAxes
        )
