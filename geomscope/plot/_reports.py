"""Reading score reports for plotting: loading, labels, training steps, metrics and layers.

A *report* here is the dict of a score report JSON (:mod:`geomscope.schema`, format
``geomscope-report``).  Everything in this module is read-only over those dicts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from geomscope import layers as grammar
from geomscope.errors import InputError
from geomscope.formatting import shown_name
from geomscope.layers import activation_name, is_gradient, listed_layers
from geomscope.plot.options import DEFAULT_METRICS
from geomscope.report import load_report
from geomscope.schema import NON_METRIC_LAYER_KEYS, STEP_RE, is_metric_key, is_number

_STEP_RE = STEP_RE


def read_report(path: str | os.PathLike) -> dict:
    """Load one score report with :func:`geomscope.report.load_report` (a report JSON, or a directory
    holding ``report.json``) and check that it has named layers to plot.

    Raises :class:`InputError` with one line for a missing file, corrupt JSON, a JSON document that
    is not a geomscope report, or a report without layers.  The path is kept under ``"_path"``.
    """
    p = os.fspath(path)
    rep = load_report(p)
    if not isinstance(rep.get("layers"), list) or not rep["layers"]:
        raise InputError(f"{p} is a geomscope report without layers; rescore the run")
    for i, lay in enumerate(rep["layers"]):
        if not isinstance(lay, dict) or "layer" not in lay:
            raise InputError(f'{p}: layers[{i}] has no "layer" name; the report is damaged, rescore the run')
    rep.setdefault("_path", p)
    return rep


def report_name(rep: dict) -> str:
    """Where the report came from, for messages: its file path, else its model label."""
    return rep.get("_path") or base_label(rep)


def base_label(rep: dict) -> str:
    """Legend label: ``model.name`` + ``@revision`` (if any); for array reports the source file stem."""
    model = rep.get("model") or {}
    name = model.get("name")
    if name:
        rev = model.get("revision")
        return f"{shown_name(name)}@{shown_name(rev)}" if rev else shown_name(name)
    src = (rep.get("source") or {}).get("path")
    if src:
        return shown_name(os.path.splitext(os.path.basename(os.path.normpath(src)))[0] or src)
    if rep.get("_path"):
        return shown_name(os.path.splitext(os.path.basename(rep["_path"]))[0])
    return "report"


def report_labels(reports: Sequence[dict]) -> list[str]:
    """One distinct legend label per report (dataset, then a counter, added to repeated labels), as
    plain text: a figure escapes it where it draws it (:func:`geomscope.plot._style.plain_text`)."""
    labels = [base_label(r) for r in reports]
    if len(set(labels)) < len(labels):
        labels = [
            f"{lab} [{shown_name((r.get('source') or {}).get('dataset'))}]"
            if (r.get("source") or {}).get("dataset")
            else lab
            for lab, r in zip(labels, reports, strict=True)
        ]
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if labels.count(lab) == 1 else f"{lab} ({seen[lab]})")
    return out


def parse_step(rep: dict) -> int | None:
    """Training step of a report: from a revision ``stepN`` (Pythia) or ``checkpoint-N`` (HF Trainer),
    else from a ``step`` key at the top level, in ``model`` or in ``run``; None when there is none."""
    model = rep.get("model") or {}
    rev = model.get("revision")
    if isinstance(rev, str):
        m = _STEP_RE.match(rev.strip())
        if m:
            return int(m.group(1))
    for holder in (rep, model, rep.get("run") or {}):
        step = holder.get("step")
        if (
            isinstance(step, (int, float))
            and not isinstance(step, bool)
            and step >= 0
            and float(step).is_integer()
        ):
            return int(step)
    return None


def available_metrics(reports: Sequence[dict]) -> list[str]:
    """Scalar per-layer metrics with at least one finite value in some report, in first-seen order."""
    seen: list[str] = []
    for rep in reports:
        for lay in rep["layers"]:
            for k, v in lay.items():
                if (
                    k not in NON_METRIC_LAYER_KEYS
                    and not k.startswith("_")
                    and is_number(v)
                    and k not in seen
                ):
                    seen.append(k)
    return seen


def choose_metrics(reports: Sequence[dict], metrics: Sequence[str] | None) -> list[str]:
    """The metrics to draw: the user's (checked against the reports) or the defaults present."""
    avail = available_metrics(reports)
    if not metrics:
        chosen = [m for m in DEFAULT_METRICS if m in avail]
        if not chosen:
            chosen = avail[:4]
        if not chosen:
            raise InputError("the reports hold no metric values to plot; rescore with --metrics")
        return chosen
    out = []
    for m in metrics:
        if m not in avail:
            names = ", ".join(avail) or "none"
            if is_metric_key(m):
                raise InputError(
                    f"metric '{m}' has no values in these reports (rescore with it in --metrics); "
                    f"available: {names}"
                )
            raise InputError(f"unknown metric '{m}'; available: {names}")
        if m not in out:
            out.append(m)
    return out


def layer_key(lay: dict, pos: int) -> int:
    """x position of a layer: its ``index`` if given, else its position in the report."""
    idx = lay.get("index")
    return int(idx) if is_number(idx) else pos


def select_layers(reports: Sequence[dict], layers: Sequence[str] | None) -> list[dict]:
    """Copies of the reports keeping the layers a ``--layers`` selection picks in each (the grammar
    of :mod:`geomscope.layers`: names, indices, negative indices, ranges, ``all``, ``blocks``), an
    index being :func:`layer_key`'s; a report that lacks a selected layer is an InputError."""
    if not layers:
        return list(reports)
    out = []
    for rep in reports:
        entries = rep["layers"]
        things = listed_layers(
            [lay["layer"] for lay in entries],
            [layer_key(lay, pos) for pos, lay in enumerate(entries)],
            report_name(rep),
        )
        keep = [entries[la.position] for la in grammar.select_layers(layers, things)]
        out.append({**rep, "layers": keep})
    return out


def check_common_layers(reports: Sequence[dict]) -> None:
    """Refuse reports that share no layer name (they cannot be drawn on one layer axis)."""
    if len(reports) < 2:
        return
    common = set.intersection(*({lay["layer"] for lay in r["layers"]} for r in reports))
    if not common:
        desc = "; ".join(f"{report_name(r)}: {_span(r)}" for r in reports[:3])
        raise InputError(
            f"the reports share no layer ({desc}); draw them in separate figures (one plot or report each)"
        )


def layer_positions(reports: Sequence[dict]) -> dict[str, int] | None:
    """The x of each layer on a layer axis shared by ``reports`` when their ``index`` cannot place
    them, else None (draw at the index).

    An array report's ``index`` is the position among the columns scored, so one layer name can
    sit at different indices in two reports (``score b.npz`` and ``score b.npz --column l2,l0``),
    or one report can give one index to two layers.  Then the axis is categorical: every layer by
    name, in the order the reports first list them, a gradient layer at its activation layer's
    place (the two share an index in a gradient run).
    """
    index_of: dict[str, int] = {}
    consistent = True
    order: list[str] = []
    for rep in reports:
        holder: dict[tuple[bool, int], str] = {}
        keyed = sorted(
            ((layer_key(lay, pos), lay["layer"]) for pos, lay in enumerate(rep["layers"])),
            key=lambda t: t[0],
        )
        for key, name in keyed:
            base = activation_name(name)
            if (
                index_of.setdefault(base, key) != key
                or holder.setdefault((is_gradient(name), key), name) != name
            ):
                consistent = False
            if base not in order:
                order.append(base)
    if consistent:
        return None
    return {
        name: order.index(activation_name(name))
        for rep in reports
        for name in (lay["layer"] for lay in rep["layers"])
    }


def _span(rep: dict) -> str:
    names = [lay["layer"] for lay in rep["layers"]]
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
