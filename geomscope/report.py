"""The score report: JSON (the full record) and CSV (one row per layer), plus a rich table.

JSON (``format: "geomscope-report"``, ``format_version: 1``), top-level keys :data:`REPORT_KEYS`:

- ``source``: ``{kind: "run"|"array", path, dataset}``, arrays also ``format`` (npy, h5, npz,
  safetensors, pt, arrow, parquet), ``layers`` (the arrays read) and ``files``; ``model`` (runs):
  ``{name, revision, commit, hidden_size}``; ``run`` (runs): ``{dir, complete, partial, rows, docs}``.
- ``params``: metrics, zeta, target ("trace" | "identity" | "file:<path>" | "run:<dir>" |
  "layer:<name>"), avgcos_variants, outlier_rule, outlier_threshold, id_estimator (comma list of the
  ID estimators that ran), twonn_fit, discard_fraction, id_sample, seed, exclude_special, max_rows,
  layers, duplicates_removed {layer: n}, uncertainty {moments, twonn, id_<name>: method},
  jackknife_groups, product_dtype (score --product-dtype), workers, scheduler (score --scheduler, or
  null), layer_batch_size, rows_total.
- ``layers``: one entry per layer in depth order with the keys :data:`LAYER_KEYS` -- layer, index,
  n_rows (rows the metrics saw); the scalar metrics isoscore, isoscore_star, avgcos,
  avgcos_centred, avgcos_standardised, pr, erank, top1_share, top5_share, top10_share, twonn
  (null when not requested or undefined, the reason in ``notes``); outliers (dimensions under
  params.outlier_rule); se {metric: standard error}; eigenvalues (descending, of the covariance);
  outlier_statistic (per dimension, the statistic the rule thresholds); outlier_support (per
  reported dimension, the fraction of jackknife replicates that flag it too); twonn_n_used,
  twonn_duplicates_removed; dropped {nonfinite, special, not_sampled}; flags (e.g. rank_limited,
  maybe_transposed, nonfinite_rows_dropped, zero_norm_rows); notes {key: why}. Extra
  intrinsic-dimension estimators add ``id_<name>`` keys after these.
- ``final_norm``: for a run holding ``layer_N`` and ``final_norm``, the final norm's effect
  (geomscope.score.finalnorm): ``{before, after, metrics {metric: {before, after, change}}, gain
  {module, type, spearman_abs_gain_variance, median_abs_gain}, bias {spearman_abs_bias_variance},
  outliers [{dim, variance_ratio, gain_ratio, effect}]}``; null with the reason in
  ``notes.final_norm`` otherwise.
- ``norms`` (only for a run that stores norm modules, ``extract --modules norms``): one entry per
  norm scored at its input and its output, ``final_norm``'s keys plus ``module``, ``type``,
  ``block``, ``measured_gain {spearman_gain_variance, median_gain}`` and per outlier row
  ``measured_gain_ratio`` and ``measured_effect``; null with the reason in ``notes.norms``.
- ``gradient_energy``: with ``score --basis ACTRUN`` (a gradient run), per gradient layer and rank
  the captured energy of the gradients in the activation subspace, its baseline, maximum, kappa,
  the normal controls and the removal test (geomscope.score.gradenergy, docs/metrics.md):
  ``{basis, basis_model, pairs, ranks, controls, seed, removal_zeta, removal_target, layers {layer:
  [{rank, energy, ...}]}, notes}``; null without --basis.
- ``command``: the ``geomscope score ...`` command line that wrote the report (null from the library).
- ``embeddings``: partition isotropy I(W) of the checkpoint's matrices, ``{input: {raw, centred},
  output: {raw, centred} | null, tied, checkpoint, input_key, output_key, note}``, or null with the
  reason in ``notes.embeddings``.

CSV columns: ``layer,index,n_rows``, one column per scalar metric
(:data:`geomscope.schema.SCALAR_METRICS`, then
``id_<name>``), ``outliers`` (space-separated dimensions), then ``se_<metric>`` for every scalar
metric. Missing numbers are empty cells. Non-finite floats are written as JSON null.

Files are written to a temporary name and renamed, so a crash never leaves half a report and an
old report is replaced only by a complete new one.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

from geomscope.errors import InputError, first_line
from geomscope.fileio import ensure_writable, read_json, write_text_atomic
from geomscope.formatting import counted, shown, shown_name, value_and_se
from geomscope.outputs import HEAD_BYTES, ensure_replaceable, json_format_is, starts_with
from geomscope.schema import (
    LAYER_KEYS,
    METRIC_LABELS,
    NORMS_KEY,
    REPORT_FORMAT,
    REPORT_FORMAT_VERSION,
    REPORT_KEYS,
    TABLE_METRICS,
    csv_columns,
    csv_metric_columns,
    metric_label,
    report_defect,
)

__all__ = [
    "LAYER_KEYS",
    "REPORT_FORMAT",
    "REPORT_KEYS",
    "Report",
    "csv_columns",
    "layer_rows",
    "load_report",
    "report_paths",
    "report_table",
    "save_report",
    "shown",
    "to_csv",
    "to_json",
]


def _plain(v):
    """JSON-safe: numpy scalars/arrays to Python, non-finite floats to None."""
    import numpy as np

    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, np.ndarray):
        return _plain(v.tolist())
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def to_json(report: dict) -> str:
    return json.dumps(_plain(report), indent=1, allow_nan=False)


def layer_rows(report: dict) -> list[dict]:
    """One dict per layer with the CSV columns (:func:`csv_columns`) as keys; outliers as a list of
    dimensions, missing numbers as None."""
    cols = csv_columns(report)
    rows = []
    for e in report.get("layers", []):
        se = e.get("se") or {}
        row = {}
        for c in cols:
            if c == "outliers":
                row[c] = [int(d) for d in e.get("outliers") or []]
            else:
                row[c] = _plain(se.get(c[3:]) if c.startswith("se_") else e.get(c))
        rows.append(row)
    return rows


def to_csv(report: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_columns(report))
    for row in layer_rows(report):
        out = []
        for c, v in row.items():
            if c == "outliers":
                v = " ".join(map(str, v))
            out.append("" if v is None else (repr(v) if isinstance(v, float) else v))
        w.writerow(out)
    return buf.getvalue()


class Report(dict):
    """A score report as :func:`load_report` returns it: the JSON's dict (every key of
    :data:`REPORT_KEYS`), plus :meth:`to_frame` for pandas and a table for Jupyter."""

    def to_frame(self, long: bool = False):
        """A pandas DataFrame. Wide (default): one row per layer, the CSV's columns (``layer``,
        ``index``, ``n_rows``, one per scalar metric, ``outliers`` as lists, ``se_<metric>``).
        ``long=True``: the tidy form, one row per (layer, metric) with ``value`` and ``se``, only
        metrics with a value in some layer. Needs pandas (not one of geomscope's dependencies)."""
        try:
            import pandas as pd
        except ImportError:
            raise InputError("Report.to_frame needs pandas; install it with `pip install pandas`") from None

        rows = layer_rows(self)
        wide = pd.DataFrame(rows, columns=csv_columns(self))
        if not long:
            return wide
        metrics = [m for m in csv_metric_columns(self) if any(r[m] is not None for r in rows)]
        tidy = [
            {
                "layer": r["layer"],
                "index": r["index"],
                "n_rows": r["n_rows"],
                "metric": m,
                "value": r[m],
                "se": r[f"se_{m}"],
            }
            for r in rows
            for m in metrics
        ]
        return pd.DataFrame(tidy, columns=["layer", "index", "n_rows", "metric", "value", "se"])

    def _repr_html_(self) -> str:
        from geomscope.htmltable import report_table_html

        return report_table_html(self)


def report_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """(json, csv) paths for ``out``: a directory (existing, or written with a trailing slash) gets
    report.json + report.csv; anything else is a prefix (a .json/.csv suffix is dropped)."""
    s = os.fspath(out)
    p = Path(s)
    if p.is_dir() or s.endswith(("/", os.sep)):
        return p / "report.json", p / "report.csv"
    if p.suffix.lower() in (".json", ".csv"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".csv")


def check_out_given(out: str | os.PathLike) -> None:
    """InputError (one line) for an empty ``--out`` (or one of spaces): ``Path("")`` is ``.``, and
    the report would land in the working directory unasked."""
    if not os.fspath(out).strip():
        raise InputError("--out is empty; give a directory or a prefix (or omit --out for the default)")


def check_report_out(out: str | os.PathLike) -> tuple[Path, Path]:
    """The (json, csv) paths of ``out`` (:func:`report_paths`) if a report may be written there: a
    non-empty directory or prefix in a directory that can be written (a real probe:
    fileio.ensure_writable), nothing at either name but an earlier report's file (which is
    replaced), and no name a run directory keeps for its own files; InputError (one line)
    otherwise. ``score`` asks before it computes."""
    check_out_given(out)
    jpath, cpath = report_paths(out)
    parent = jpath.parent
    if parent.exists() and not parent.is_dir():
        raise InputError(f"--out {out}: {parent} is a file; give a directory or a prefix in a directory")
    ensure_replaceable(jpath, json_format_is(REPORT_FORMAT), head=HEAD_BYTES)
    ensure_replaceable(cpath, starts_with(b"layer,index,n_rows"), head=HEAD_BYTES)
    ensure_writable(parent)
    return jpath, cpath


def save_report(report: dict, out: str | os.PathLike) -> tuple[Path, Path]:
    """Write the report as JSON and CSV; return (json_path, csv_path). See :func:`report_paths`;
    files already there are replaced only if they are a report's (:func:`check_report_out`)."""
    jpath, cpath = check_report_out(out)
    parent = jpath.parent
    jtext, ctext = to_json(report), to_csv(report)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(jpath, jtext + "\n")
        write_text_atomic(cpath, ctext)
    except OSError as e:  # permissions, a full disk, a read-only file system ...
        raise InputError(
            f"cannot write the report to {parent} ({e.strerror or e}); choose another --out"
        ) from e
    return jpath, cpath


def load_report(path: str | os.PathLike) -> Report:
    """Read a report JSON written by ``geomscope score`` (or a directory holding ``report.json``)
    as a :class:`Report`; InputError (one line) otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.exists():
        raise InputError(f"report not found: {p}")
    try:
        rep = read_json(p)
    except ValueError as e:  # bad JSON, a huge integer, not UTF-8, too large or too deeply nested
        raise InputError(
            f"{p} is not valid JSON ({first_line(e, 160)}); give a report written by `geomscope score`"
        ) from None
    except OSError as e:
        raise InputError(f"cannot read {p} ({e.strerror or e})") from None
    if not isinstance(rep, dict) or rep.get("format") != REPORT_FORMAT:
        raise InputError(f'{p} is not a geomscope report (no "format": "{REPORT_FORMAT}")')
    version = rep.get("format_version", 0)
    if isinstance(version, int) and not isinstance(version, bool) and version > REPORT_FORMAT_VERSION:
        raise InputError(f"{p} has report format_version {version}; upgrade geomscope to read it")
    why = report_defect(rep)  # (a newer version's shape is not this one's: checked after the version)
    if why:
        raise InputError(f"{p} is a damaged report ({why}); score the source again")
    return Report(rep)


def _fmt(v, se=None) -> str:
    """A table cell: the value, over ``±SE`` where the SE is a number (formatting.value_and_se)."""
    value_text, se_text = value_and_se(v, se)
    return value_text if se_text is None else f"{value_text}\n±{se_text}"


def table_metrics(report: dict, columns=None) -> tuple[list[str], list[str]]:
    """(metrics to show, all metrics with values): ``columns`` None = the default subset
    (:data:`geomscope.schema.TABLE_METRICS`, which fits 80 columns), ``["all"]`` = every metric with a
    value, else the named ones (InputError, one line, for a name without values)."""
    layers = report.get("layers", [])
    present = [m for m in csv_metric_columns(report) if any(e.get(m) is not None for e in layers)]
    if not columns:
        return [m for m in TABLE_METRICS if m in present] or present[:5], present
    if list(columns) == ["all"]:
        return present, present
    unknown = [c for c in columns if c not in present]
    if unknown:
        raise InputError(
            f"--columns {unknown[0]!r} has no values in this report; choose among {', '.join(present)} or all"
        )
    return list(dict.fromkeys(columns)), present


def _notes_table(notes: list[str]):
    """A rich Table class whose tables are followed by ``notes`` (plain-text lines), each wrapped on
    words to the console's width (a rich caption wraps to the table's width, and cuts every word
    wider than a narrow table). Only a word wider than the console is folded."""
    from rich.table import Table
    from rich.text import Text

    class NotedTable(Table):
        def __rich_console__(self, console, options):
            yield from super().__rich_console__(console, options)
            for line in notes:
                yield Text(shown(line, markup=False), style="table.caption", overflow="fold")

    return NotedTable


def report_table(report: dict, columns=None):
    """A rich Table: one row per layer, the chosen metrics (:func:`table_metrics`) as value over
    ±standard error, then the notes (:func:`_caption`, and what is hidden), each wrapped on words
    to the console's width."""
    layers = report.get("layers", [])
    metrics, present = table_metrics(report, columns)
    hidden = [m for m in present if m not in metrics]
    src = report.get("source", {})
    model = report.get("model") or {}
    title = shown_name(model.get("name") or Path(str(src.get("path", ""))).name)
    if model.get("revision"):
        title += f"@{shown_name(model['revision'])}"
    lines = _caption(report)
    if hidden:
        lines.append(
            f"{counted(len(hidden), 'more metric')} in the report ({', '.join(hidden)}): "
            "--columns all, or name them"
        )
    t = _notes_table(lines)(  # every string from the report goes through shown(): rich reads markup
        title=f"geomscope score: {shown(title)}",
        header_style="bold",
        pad_edge=False,
        padding=(0, 1),
    )
    t.add_column("layer", no_wrap=True)
    t.add_column("rows", justify="right", no_wrap=True)
    for m in metrics:
        t.add_column(shown(metric_label(m)), justify="right", no_wrap=True)
    show_out = any(e.get("outliers") for e in layers) and (bool(columns) or not hidden)
    if show_out:
        t.add_column("outliers")
    for e in layers:
        se = e.get("se") or {}
        row = [shown(shown_name(e.get("layer"))), f"{e.get('n_rows', 0):,}"]
        row += [_fmt(e.get(m), se.get(m)) for m in metrics]
        if show_out:
            dims = e.get("outliers") or []
            row.append(" ".join(map(str, dims[:6])) + (" ..." if len(dims) > 6 else ""))
        t.add_row(*row)
    return t


def _caption(report: dict) -> list[str]:
    """The caption's lines, as plain text (report_table escapes each)."""
    params = report.get("params", {})
    bits = []
    if "isoscore_star" in params.get("metrics", []):
        bits.append(f"IsoScore* zeta={params.get('zeta')} target={params.get('target')}")
    if "avgcos" in params.get("metrics", []):
        bits.append("cos(c)/cos(z): centred/standardised")
    if params.get("outlier_rule") and "outliers" in params.get("metrics", []):
        bits.append(f"outliers: {params['outlier_rule']} rule, threshold {params.get('outlier_threshold')}")
    unc = params.get("uncertainty", {}).get("moments")
    if unc:
        bits.append(f"±: SE, {unc}")
    if params.get("product_dtype") == "float32":
        bits.append("covariance from float32 block products (~1e-8 to 1e-7 relative error)")
    emb = report.get("embeddings")
    if emb:
        line = f"I(W) input raw {emb['input']['raw']:.3g} centred {emb['input']['centred']:.3g}"
        if emb.get("output") and not emb.get("tied"):
            line += f"; output raw {emb['output']['raw']:.3g} centred {emb['output']['centred']:.3g}"
        elif emb.get("tied"):
            line += " (output tied)"
        bits.append(line)
    fn = report.get("final_norm")
    if fn:
        bits.append(final_norm_line(fn))
    if report.get(NORMS_KEY):
        bits.append(norms_line(report[NORMS_KEY]))
    return bits


def gradient_energy_lines(report: dict) -> list[str]:
    """Terminal lines of ``gradient_energy``: per layer and rank, E against r/D and the controls;
    names from the report through :func:`shown` (print them with markup off)."""
    ge = report.get("gradient_energy")
    if not ge:
        return []
    lines = [
        f"gradient energy in the top-r activation subspace of {shown(ge['basis'], markup=False)} "
        "(E vs r/D; controls: mean, p)"
    ]
    for layer, ranks in (ge.get("layers") or {}).items():
        for r in ranks or []:
            mean, ratio, p = r.get("control_energy_mean"), r.get("energy_ratio"), r.get("p_value")
            ctrl = f"control {_fmt(mean)}, x{_fmt(ratio)}, p {_fmt(p)}" if mean is not None else "no controls"
            name = shown(shown_name(layer), markup=False)
            lines.append(
                f"  {name} r={r['rank']}: E {_with_se(r['energy'], r.get('energy_se'))} "
                f"(r/D {_fmt(r['baseline'])}, max {_fmt(r['energy_max'])}, kappa {_fmt(r['kappa'])}); {ctrl}"
            )
    return lines


def _with_se(v, se) -> str:
    """``value ±SE`` on one line (formatting.value_and_se), the value alone without an SE."""
    value_text, se_text = value_and_se(v, se)
    return value_text if se_text is None else f"{value_text} ±{se_text}"


def norms_line(norms: list[dict]) -> str:
    """One line on every norm module's effect (the table caption): how many, the spread of the
    Spearman correlation of the measured gain with the input variance, and the outlier dimensions
    the measured gain damps."""
    rhos = sorted(
        n["measured_gain"]["spearman_gain_variance"]
        for n in norms
        if (n.get("measured_gain") or {}).get("spearman_gain_variance") is not None
    )
    line = f"norms: {counted(len(norms), 'norm')} scored at input and output"
    if rhos:
        mid = rhos[len(rhos) // 2] if len(rhos) % 2 else (rhos[len(rhos) // 2 - 1] + rhos[len(rhos) // 2]) / 2
        line += (
            f"; Spearman(measured gain, variance in) median {mid:.2f}, from {rhos[0]:.2f} to {rhos[-1]:.2f}"
        )
    judged = [o for n in norms for o in n.get("outliers") or [] if o.get("measured_effect") is not None]
    if judged:
        damped = sum(o["measured_effect"] == "damped" for o in judged)
        line += f"; outlier dims damped {damped}/{len(judged)} (measured gain)"
    return line


def norm_line(norm: dict) -> str:
    """One line on one norm module's effect (the HTML page): :func:`final_norm_line`'s, named by
    the module, with the measured gain's Spearman correlation and damped outlier dimensions."""
    line = _norm_effect_line(norm["module"], norm)
    measured = norm.get("measured_gain") or {}
    if measured.get("spearman_gain_variance") is not None:
        line += f"; Spearman(measured gain, variance in) {measured['spearman_gain_variance']:.2f}"
    judged = [o for o in norm.get("outliers") or [] if o.get("measured_effect") is not None]
    if judged:
        line += f"; measured: damped {sum(o['measured_effect'] == 'damped' for o in judged)}/{len(judged)}"
    return line


def final_norm_line(fn: dict) -> str:
    """One line on the final norm's effect (the table caption and the HTML page)."""
    return _norm_effect_line("final norm", fn)


def _norm_effect_line(label: str, fn: dict) -> str:
    """A norm's effect in one line: the metrics before and after it, the Spearman correlation of
    its gain with the input variance, and the outlier dimensions its gain damps."""
    parts = []
    for m in ("isoscore_star", "isoscore", "avgcos"):
        v = (fn.get("metrics") or {}).get(m)
        if v and v.get("before") is not None and v.get("after") is not None:
            parts.append(f"{METRIC_LABELS.get(m, m)} {v['before']:.3g} -> {v['after']:.3g}")
    line = f"{label} ({fn['before']} -> {fn['after']}): " + (", ".join(parts) or "no metric on both sides")
    gain = fn.get("gain") or {}
    if gain.get("spearman_abs_gain_variance") is not None:
        line += f"; Spearman(|gain|, variance before) {gain['spearman_abs_gain_variance']:.2f}"
    outs = fn.get("outliers") or []
    if outs:
        judged = [o for o in outs if o.get("effect") is not None]  # None: no median gain to judge by
        damped = sum(o["effect"] == "damped" for o in judged)
        line += f"; outlier dims damped {damped}/{len(judged)}" if judged else "; outlier dims not judged"
    return line
