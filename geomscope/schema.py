"""The score report's schema: the one home of its metric names, layer-entry keys and CSV columns.

``score`` builds entries with these keys, :mod:`geomscope.report` writes and reads them, ``plot``
chooses what to draw from them, and the tests check reports against them. Scripts rely on the
names and their order (README, "Report format"), so change them only with ``REPORT_FORMAT_VERSION``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REPORT_FORMAT = "geomscope-report"
REPORT_FORMAT_VERSION = 1

#: top-level keys of a report, in the order they are written
#: a training step in a revision or checkpoint name: ``step143000`` (Pythia), ``checkpoint-500`` (HF Trainer)
STEP_RE = re.compile(r"^(?:step|checkpoint)[_-]?(\d+)$", re.IGNORECASE)

REPORT_KEYS = (
    "format",
    "format_version",
    "geomscope_version",
    "created",
    "source",
    "model",
    "run",
    "params",
    "layers",
    "embeddings",
    "final_norm",
    "gradient_energy",
    "notes",
    "command",
)


@dataclass(frozen=True)
class MetricSpec:
    """One scalar per-layer number of the report.

    ``name`` is its key in a layer entry, its CSV column and (as ``se_<name>``) its standard-error
    column; ``label`` is the short header of terminal tables; ``group`` is the ``--metrics`` name
    that produces it.
    """

    name: str
    label: str
    group: str


#: every scalar metric a layer entry carries (null when not requested or undefined), in report order
SCALAR_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("isoscore", "IsoScore", "isoscore"),
    MetricSpec("isoscore_star", "IsoScore*", "isoscore_star"),
    MetricSpec("avgcos", "cos", "avgcos"),
    MetricSpec("avgcos_centred", "cos(c)", "avgcos"),
    MetricSpec("avgcos_standardised", "cos(z)", "avgcos"),
    MetricSpec("pr", "PR", "spectrum"),
    MetricSpec("erank", "erank", "spectrum"),
    MetricSpec("top1_share", "top1", "spectrum"),
    MetricSpec("top5_share", "top5", "spectrum"),
    MetricSpec("top10_share", "top10", "spectrum"),
    MetricSpec("twonn", "TwoNN", "twonn"),
)
SCALAR_METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in SCALAR_METRICS)
METRIC_LABELS: dict[str, str] = {m.name: m.label for m in SCALAR_METRICS}

#: the metrics of the terminal table by default: a readable subset that fits 80 columns
TABLE_METRICS: tuple[str, ...] = ("isoscore_star", "isoscore", "avgcos", "pr", "twonn")

#: prefix of the keys of extra intrinsic-dimension estimators (``id_mle``, ``id_lpca`` ...)
EXTRA_ID_PREFIX = "id_"

#: keys of one ``layers[]`` entry, in the order they are written (extra ``id_<name>`` keys follow)
LAYER_KEYS: tuple[str, ...] = (
    "layer",
    "index",
    "n_rows",
    *SCALAR_METRIC_NAMES,
    "outliers",
    "se",
    "eigenvalues",
    "outlier_statistic",
    "outlier_support",
    "twonn_n_used",
    "twonn_duplicates_removed",
    "dropped",
    "flags",
    "notes",
)

#: layer-entry keys that are not metrics (identity, counts, lists, bookkeeping)
NON_METRIC_LAYER_KEYS = frozenset(LAYER_KEYS) - frozenset(SCALAR_METRIC_NAMES)


def is_metric_key(key: str) -> bool:
    """A scalar metric of the schema, or an extra intrinsic-dimension estimator's ``id_<name>``."""
    return key in METRIC_LABELS or key.startswith(EXTRA_ID_PREFIX)


def extra_id_keys(layers: list[dict]) -> list[str]:
    """The ``id_<name>`` keys present in any layer entry, sorted."""
    return sorted({k for e in layers for k in e if k.startswith(EXTRA_ID_PREFIX)})


def csv_metric_columns(report: dict) -> list[str]:
    """The scalar metrics of the CSV: every schema metric, then the report's extra estimators."""
    return [*SCALAR_METRIC_NAMES, *extra_id_keys(report.get("layers", []))]


def csv_columns(report: dict) -> list[str]:
    """``layer,index,n_rows``, one column per scalar metric, ``outliers``, then ``se_<metric>``."""
    metrics = csv_metric_columns(report)
    return ["layer", "index", "n_rows", *metrics, "outliers", *[f"se_{m}" for m in metrics]]
