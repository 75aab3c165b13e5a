"""Shell completion (``geomscope --install-completion``): layer names from a run's manifest or from
reports, metric names, and the ``--layers`` keywords -- each item of a comma list completes on its
own (``--layers layer_00,la<TAB>``). Completion must never fail loudly: anything unreadable gives
no candidates."""

from __future__ import annotations

from pathlib import Path

from geomscope.fileio import read_json
from geomscope.layers import LAYER_KEYWORDS


def complete_items(candidates, incomplete: str) -> list[str]:
    """Complete the last item of a comma list, keeping the items before it."""
    head, _, last = (incomplete or "").rpartition(",")
    prefix = head + "," if head else ""
    done = set(head.split(",")) if head else set()
    return [prefix + c for c in dict.fromkeys(candidates) if c.startswith(last) and c not in done]


def _run_layers(path) -> list[str]:
    from geomscope.errors import InputError
    from geomscope.store.manifest import read_manifest
    from geomscope.store.names import MANIFEST_NAME

    try:
        layers = read_manifest(Path(str(path)) / MANIFEST_NAME)["identity"]["layers"]
    except InputError:
        return []
    return [x["name"] for x in layers]


def _report_layers(path) -> list[str]:
    p = Path(str(path))
    p = p / "report.json" if p.is_dir() else p
    try:
        return [str(e["layer"]) for e in read_json(p)["layers"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _param(ctx, name: str) -> list[str]:
    """The positional value(s) typed so far. While an option still waits for its value, click's
    resilient parse leaves the positionals unassigned in ``ctx.args``: take them from there."""
    if ctx is None:
        return []
    v = ctx.params.get(name)
    if v:
        return [str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)]
    return [a for a in getattr(ctx, "args", []) if not str(a).startswith("-")]


def run_layers(ctx, incomplete: str) -> list[str]:
    """``--layers`` of score/export: the layers the run's manifest names."""
    src = _param(ctx, "source") or _param(ctx, "run_dir")
    return complete_items(_run_layers(src[0]) if src else [], incomplete)


def report_layers(ctx, incomplete: str) -> list[str]:
    """``--layers`` of plot: the layers of the reports named so far."""
    names: list[str] = []
    for p in _param(ctx, "inputs"):
        names += _report_layers(p)
    return complete_items(names, incomplete)


def model_layers(incomplete: str) -> list[str]:
    """``--layers`` of extract/finetune: the keywords (indices depend on the model)."""
    return complete_items(LAYER_KEYWORDS, incomplete)


def score_metrics(incomplete: str) -> list[str]:
    from geomscope.score.options import CORE_METRICS, id_estimator_names

    return complete_items([*CORE_METRICS, *id_estimator_names()], incomplete)


def plot_metrics(incomplete: str) -> list[str]:
    from geomscope.schema import SCALAR_METRIC_NAMES

    return complete_items(SCALAR_METRIC_NAMES, incomplete)
