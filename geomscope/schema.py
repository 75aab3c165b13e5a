"""The score report's schema: the one home of its metric names, layer-entry keys and CSV columns;
and the format tags of every file geomscope writes beside a run directory.

``score`` builds entries with these keys, :mod:`geomscope.report` writes and reads them, ``plot``
chooses what to draw from them, and the tests check reports against them. Scripts rely on the
names and their order (docs/reference/report-format.md), so change them only with ``REPORT_FORMAT_VERSION``.

A format tag is how geomscope knows a file for its own: a JSON file's first key ``"format"``
(outputs.json_format_is), a marker file's name, a figure's creator, a page's generator. A file at
an output path is replaced only when it bears its tag; so a tag never changes. The run directory's
own tags (manifest, shards) live with the store (store/names.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

REPORT_FORMAT = "geomscope-report"
REPORT_FORMAT_VERSION = 1
#: ``compare``'s compare.json
COMPARE_FORMAT = "geomscope-compare"
#: ``score DIR --metrics similarity``'s similarity.json: each layer's similarity across the runs
SIMILARITY_FORMAT = "geomscope-similarity"
SIMILARITY_FORMAT_VERSION = 1
#: a sweep's sweep.json: the grid of finetune runs it holds
SWEEP_FORMAT = "geomscope-sweep"
#: the marker that makes a directory a finetune output (train/checkpoint.py), its format and the
#: version of its record (2: complete, every path a run wrote; markers without it list exported files)
FINETUNE_MARKER = ".geomscope-finetune.json"
FINETUNE_FORMAT = "geomscope-finetune"
FINETUNE_MARKER_VERSION = 2
#: the summary ``export`` writes into the directory it exports
EXPORT_MARKER = "geomscope-export.json"
#: the field metadata key of an exported arrow/parquet layer column that holds the layer's index in
#: the model (score reads it back, so a layer exported alone is reported at its index)
LAYER_INDEX_KEY = b"geomscope.layer_index"
#: the creator a figure records (PNG "Software", SVG and PDF "Creator"): how a later plot knows a
#: file at its --out for its own earlier figure, which it replaces (outputs.ensure_replaceable)
FIGURE_CREATOR = "geomscope plot, with Matplotlib"  # no parentheses: PDF strings escape them
#: what a ``report --html`` page records as its generator: how a later ``report --html`` knows a file
#: at its path for its own earlier page, which it replaces
HTML_GENERATOR = "<meta name='generator' content='geomscope'>"

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

#: the report key of every norm module's effect (score/finalnorm.py), written after ``final_norm``
#: only in a report of a run that stores norm modules (``extract --modules norms``)
NORMS_KEY = "norms"


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

#: the scalar metrics of the diagnostic families (docs/metrics.md, "Diagnostics"): a layer entry
#: carries them only where their family is requested, after every key above and its ``id_<name>``
#: keys, each with its ``se`` entry (so a report without them keeps its keys, columns and bytes).
#: All-but-the-top's keys depend on its k (:func:`abtt_key`) and are not listed here.
DIAGNOSTIC_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("whitened_isoscore", "IsoScore(w)", "whitened"),
    MetricSpec("whitened_isoscore_star", "IsoScore*(w)", "whitened"),
    MetricSpec("whitened_avgcos", "cos(w)", "whitened"),
    MetricSpec("rogue_top1_share", "rogue1", "rogue"),
    MetricSpec("rogue_top3_share", "rogue3", "rogue"),
    MetricSpec("massive_max_abs", "max|x|", "massive"),
    MetricSpec("massive_ratio", "max/med", "massive"),
    MetricSpec("cka_prev", "CKA-1", "similarity"),
    MetricSpec("rsa_prev", "RSA-1", "similarity"),
    MetricSpec("selfsim", "self", "contextuality"),
    MetricSpec("selfsim_adj", "self-b", "contextuality"),
    MetricSpec("intrasim", "intra", "contextuality"),
    MetricSpec("intrasim_adj", "intra-b", "contextuality"),
    MetricSpec("mev", "MEV", "contextuality"),
    MetricSpec("mev_adj", "MEV-b", "contextuality"),
    MetricSpec("local_isoscore", "IsoScore(loc)", "local"),
    MetricSpec("local_avgcos", "cos(loc)", "local"),
    MetricSpec("local_avgcos_centred", "cos(loc,c)", "local"),
    MetricSpec("local_twonn", "TwoNN(loc)", "local"),
)
#: all-but-the-top's keys: ``abtt<k>_<metric>`` for each k of ``score --abtt-k``
ABTT_METRICS = ("isoscore", "isoscore_star", "avgcos")
_ABTT_KEY = re.compile(r"^abtt([1-9][0-9]*)_(isoscore|isoscore_star|avgcos)$")
_ABTT_LABELS = {"isoscore": "IsoScore", "isoscore_star": "IsoScore*", "avgcos": "cos"}
#: the strata's keys: ``freq<b>_<metric>``, ``pos<b>_<metric>`` for each bin b (score --metrics stratified)
_STRATUM_KEY = re.compile(r"^(freq|pos)([1-9][0-9]*)_(isoscore|isoscore_star|avgcos)$")

METRIC_LABELS: dict[str, str] = {m.name: m.label for m in (*SCALAR_METRICS, *DIAGNOSTIC_METRICS)}


def abtt_key(k: int, metric: str) -> str:
    """The key of ``metric`` after removing the top ``k`` principal directions (all-but-the-top)."""
    return f"abtt{int(k)}_{metric}"


def is_diagnostic_key(key: str) -> bool:
    """A scalar metric of a diagnostic family (:data:`DIAGNOSTIC_METRICS`, :func:`abtt_key`)."""
    return key in _DIAGNOSTIC_NAMES or _ABTT_KEY.match(key) is not None or _STRATUM_KEY.match(key) is not None


def metric_label(key: str) -> str:
    """The short header of a metric in terminal and HTML tables (the key itself where it has none)."""
    m = _ABTT_KEY.match(key)
    if m:
        return f"{_ABTT_LABELS[m.group(2)]}-{m.group(1)}"
    m = _STRATUM_KEY.match(key)
    if m:
        return f"{_ABTT_LABELS[m.group(3)]}@{m.group(1)[0]}{m.group(2)}"
    return METRIC_LABELS.get(key, key)


def diagnostic_keys(layers: list[dict]) -> list[str]:
    """The diagnostic families' scalar keys present in any layer entry, in the order entries hold them."""
    seen: dict[str, None] = {}
    for e in layers:
        for k in e:
            if isinstance(k, str) and is_diagnostic_key(k):
                seen.setdefault(k)
    return list(seen)


_DIAGNOSTIC_NAMES = frozenset(m.name for m in DIAGNOSTIC_METRICS)

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
    """A scalar metric of the schema, an extra intrinsic-dimension estimator's ``id_<name>``, or a
    diagnostic family's metric."""
    return key in METRIC_LABELS or key.startswith(EXTRA_ID_PREFIX) or is_diagnostic_key(key)


def extra_id_keys(layers: list[dict]) -> list[str]:
    """The ``id_<name>`` keys present in any layer entry, sorted."""
    return sorted({k for e in layers for k in e if k.startswith(EXTRA_ID_PREFIX)})


def csv_metric_columns(report: dict) -> list[str]:
    """The scalar metrics of the CSV: every schema metric, then the report's extra estimators, then
    the diagnostic metrics it holds."""
    layers = report.get("layers", [])
    return [*SCALAR_METRIC_NAMES, *extra_id_keys(layers), *diagnostic_keys(layers)]


def csv_columns(report: dict) -> list[str]:
    """``layer,index,n_rows``, one column per scalar metric, ``outliers``, then ``se_<metric>``."""
    metrics = csv_metric_columns(report)
    return ["layer", "index", "n_rows", *metrics, "outliers", *[f"se_{m}" for m in metrics]]


# ------------------------------------------------------------------------------ reading reports
def is_number(v) -> bool:
    """A finite JSON number. An integer beyond float range (a 400-digit one, which ``json`` reads as
    an int) is not one: every reader converts to float, where it overflows."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # math.isfinite converts an int to float first
        return False


def _optional_number(v) -> bool:
    return v is None or is_number(v)


def _integer(v) -> bool:
    return isinstance(v, int) and is_number(v)


def _dict_of(v, ok) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and ok(x) for k, x in v.items())


def _optional_text(v) -> bool:
    return v is None or isinstance(v, str)


#: the fields of the report's objects that titles, labels and captions read, and the type they read
#: them as (a name drawn as text, a number formatted with :g, a rule compared and looked up)
_FIELD_TYPES = {
    "model": {"name": (_optional_text, "a text"), "revision": (_optional_text, "a text")},
    "source": {"path": (_optional_text, "a text")},
    "params": {
        "zeta": (_optional_number, "a number"),
        "discard_fraction": (_optional_number, "a number"),
        "outlier_threshold": (_optional_number, "a number"),
        "outlier_rule": (_optional_text, "a text"),
        "uncertainty": (lambda v: v is None or _dict_of(v, _optional_text), "an object of texts"),
    },
}


def report_defect(rep: dict) -> str | None:
    """Where a loaded report JSON is not shaped as ``score`` writes it (``"layers[2].se is not ..."``),
    or None: the fields that ``report``, ``plot`` and :class:`~geomscope.report.Report` read, each of
    the type they read it as, so that a damaged or hand-made report is one line, not a traceback
    wherever it is first used."""
    if "format_version" in rep and not _integer(rep["format_version"]):
        return "format_version is not an integer"
    for key in ("source", "model", "run", "params", "final_norm", "gradient_energy", "embeddings"):
        if rep.get(key) is not None and not isinstance(rep[key], dict):
            return f"{key} is not an object"
    for key, fields in _FIELD_TYPES.items():
        part = rep.get(key) or {}
        for field, (ok, what) in fields.items():
            if not ok(part.get(field)):
                return f"{key}.{field} is not {what}"
    if rep.get("notes") is not None and not _dict_of(rep["notes"], lambda x: isinstance(x, str)):
        return "notes is not an object of texts"
    layers = rep.get("layers")
    if not isinstance(layers, list):
        return "layers is not a list"
    for i, entry in enumerate(layers):
        why = _layer_defect(entry)
        if why:
            return f"layers[{i}]{why}"
    return (
        _final_norm_defect(rep.get("final_norm"))
        or _norms_defect(rep.get(NORMS_KEY))
        or _gradient_energy_defect(rep.get("gradient_energy"))
        or _similarity_defect(rep.get("similarity"))
    )


def _local_shaped(v) -> bool:
    """A layer's ``local`` section as score writes it: ``k`` and a list of clusters of numbers."""
    return v is None or (
        isinstance(v, dict)
        and _integer(v.get("k"))
        and isinstance(v.get("clusters"), list)
        and all(isinstance(c, dict) and all(_optional_number(x) for x in c.values()) for c in v["clusters"])
    )


def _contextuality_shaped(v) -> bool:
    """A layer's ``contextuality`` section as score writes it: its numbers and frequency bins."""
    return v is None or (
        isinstance(v, dict)
        and all(_optional_number(v.get(k)) for k in ("types", "sentences", "baseline_cos", "baseline_mev"))
        and isinstance(v.get("by_frequency", []), list)
        and all(
            isinstance(b, dict) and all(_optional_number(x) for x in b.values())
            for b in v.get("by_frequency", [])
        )
    )


def _strata_shaped(v) -> bool:
    """A layer's ``strata`` section as score writes it: per stratum, a list of integer bins."""
    return _dict_of(
        v,
        lambda bins: (
            isinstance(bins, list)
            and all(isinstance(b, dict) and _integer(b.get("bin")) and _integer(b.get("rows")) for b in bins)
        ),
    )


def _rogue_dims_shaped(v) -> bool:
    """A layer's ``rogue_dims`` section as score writes it: dimensions with their shares."""
    return isinstance(v, list) and all(
        isinstance(x, dict)
        and _integer(x.get("dim"))
        and _optional_number(x.get("share"))
        and _optional_number(x.get("share_se"))
        for x in v
    )


# A layer's optional sections, each with the test of its shape as score writes it.
_LAYER_SECTION_CHECKS = {
    "se": lambda v: _dict_of(v, _optional_number),
    "outliers": lambda v: isinstance(v, list) and all(_integer(x) for x in v),
    "outlier_statistic": lambda v: isinstance(v, list) and all(_optional_number(x) for x in v),
    "outlier_support": lambda v: isinstance(v, list) and all(_optional_number(x) for x in v),
    "dropped": lambda v: _dict_of(v, _integer),
    "flags": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "notes": lambda v: _dict_of(v, lambda x: isinstance(x, str)),
    "massive": lambda v: v is None or _massive_shaped(v),
    "local": _local_shaped,
    "contextuality": _contextuality_shaped,
    "strata": _strata_shaped,
    "rogue_dims": _rogue_dims_shaped,
}


def _layer_defect(e) -> str | None:
    """Where one ``layers`` entry is not shaped as score writes it (``".se is not ..."``), or None."""
    if not isinstance(e, dict):
        return " is not an object"
    if not isinstance(e.get("layer"), str):
        return ' has no "layer" name'
    for key in ("index", "n_rows", "twonn_n_used", "twonn_duplicates_removed"):
        if e.get(key) is not None and not _integer(e[key]):
            return f".{key} is not an integer"
    for key, v in e.items():
        if is_metric_key(key) and not _optional_number(v):
            return f".{key} is not a number"
    for key, ok in _LAYER_SECTION_CHECKS.items():
        if e.get(key) is not None and not ok(e[key]):
            return f".{key} is not what score writes"
    return _eigenvalues_defect(e.get("eigenvalues"))


def _eigenvalues_defect(eig) -> str | None:
    """Where a layer's ``eigenvalues`` are not a list of non-negative numbers, or None."""
    if eig is not None:
        if not isinstance(eig, list) or not all(_optional_number(x) for x in eig):  # (null: overflowed)
            return ".eigenvalues is not a list of numbers"
        known = [x for x in eig if x is not None]
        if known and min(known) < -1e-9 * max(1e-300, max(abs(x) for x in known)):  # a covariance's: >= 0
            return ".eigenvalues has negative values (a covariance's are >= 0)"
    return None


def _massive_shaped(v) -> bool:
    """A layer's ``massive`` section as score writes it (the fields the table and page read)."""
    if not isinstance(v, dict) or not isinstance(v.get("entries"), list):
        return False
    fields = ("value", "dim", "position", "doc_id")
    entries_ok = all(
        isinstance(e, dict)
        and all(_optional_number(e.get(f)) for f in fields)
        and (e.get("token_id") is None or _integer(e.get("token_id")))
        for e in v["entries"]
    )
    bounds = [v.get("median_abs_bounds"), v.get("ratio_bounds")]
    bounds_ok = all(b is None or (isinstance(b, list) and all(is_number(x) for x in b)) for b in bounds)
    return entries_ok and bounds_ok and _optional_number(v.get("median_abs"))


def _final_norm_defect(fn) -> str | None:
    if fn is None:
        return None
    if not isinstance(fn.get("before"), str) or not isinstance(fn.get("after"), str):
        return "final_norm.before/after are not layer names"
    metrics = fn.get("metrics")
    if metrics is not None and not _dict_of(
        metrics, lambda m: isinstance(m, dict) and all(_optional_number(x) for x in m.values())
    ):
        return "final_norm.metrics is not what score writes"
    if fn.get("gain") is not None and not _dict_of(
        fn["gain"], lambda x: _optional_number(x) or isinstance(x, str)
    ):
        return "final_norm.gain is not what score writes"
    if not _optional_number((fn.get("gain") or {}).get("spearman_abs_gain_variance")):
        return "final_norm.gain.spearman_abs_gain_variance is not a number"
    outs = fn.get("outliers")
    if outs is not None and not (
        isinstance(outs, list)
        and all(isinstance(o, dict) and isinstance(o.get("effect"), (str, type(None))) for o in outs)
    ):
        return "final_norm.outliers is not what score writes"
    return None


def _norms_defect(norms) -> str | None:
    """Where a report's ``norms`` is not what score writes: a list of ``final_norm``-shaped entries
    that name their module and hold a ``measured_gain`` of numbers."""
    if norms is None:
        return None
    if not isinstance(norms, list):
        return f"{NORMS_KEY} is not a list"
    for i, n in enumerate(norms):
        if not isinstance(n, dict) or not isinstance(n.get("module"), str):
            return f"{NORMS_KEY}[{i}] is not what score writes"
        why = _final_norm_defect(n)
        if why:
            return f"{NORMS_KEY}[{i}]" + why[len("final_norm") :]
        measured = n.get("measured_gain")
        if measured is not None and not _dict_of(measured, _optional_number):
            return f"{NORMS_KEY}[{i}].measured_gain is not what score writes"
    return None


def _similarity_defect(sec) -> str | None:
    """Where a ``similarity`` section (score --metrics similarity) is not shaped as score writes it."""
    if sec is None:
        return None
    if not isinstance(sec, dict):
        return "similarity is not an object"
    names = sec.get("layers")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return "similarity.layers is not a list of layer names"
    for key in ("cka", "cka_se", "rsa", "rsa_se"):
        m = sec.get(key)
        if m is not None and not _square(m, len(names)):
            return f"similarity.{key} is not a {len(names)} x {len(names)} matrix of numbers"
    return None


def _square(m, n: int) -> bool:
    """An n x n list of lists of numbers (or nulls)."""
    return (
        isinstance(m, list)
        and len(m) == n
        and all(isinstance(r, list) and len(r) == n and all(map(_optional_number, r)) for r in m)
    )


def similarity_file_defect(data) -> str | None:
    """Where a ``similarity.json`` (score DIR --metrics similarity) is not shaped as score writes it."""
    if not isinstance(data, dict) or data.get("format") != SIMILARITY_FORMAT:
        return f'it has no "format": "{SIMILARITY_FORMAT}"'
    runs = data.get("names")
    if not isinstance(runs, list) or not all(isinstance(n, str) for n in runs):
        return "names is not a list of run names"
    revisions = data.get("revisions")
    if revisions is not None and not (isinstance(revisions, list) and len(revisions) == len(runs)):
        return "revisions is not a list of one name per run"
    layers = data.get("layers")
    if not isinstance(layers, dict):
        return "layers is not an object"
    for name, sec in layers.items():
        if sec is None:
            continue
        if not isinstance(sec, dict):
            return f"layers.{name} is not an object"
        for key in ("cka", "cka_se", "rsa", "rsa_se"):
            if sec.get(key) is not None and not _square(sec[key], len(runs)):
                return f"layers.{name}.{key} is not a {len(runs)} x {len(runs)} matrix of numbers"
    return None


def _gradient_energy_defect(ge) -> str | None:
    if ge is None:
        return None
    layers = ge.get("layers")
    if layers is not None and not _dict_of(
        layers,
        lambda rows: (  # (a layer without usable gradient rows: null)
            rows is None
            or isinstance(rows, list)
            and all(
                isinstance(r, dict) and all(_optional_number(x) or isinstance(x, str) for x in r.values())
                for r in rows
            )
        ),
    ):
        return "gradient_energy.layers is not what score writes"
    return None
