"""Many runs of one model or several (checkpoints), scored together: ``score DIR`` on a directory of
runs (or of such directories, one per model), or ``score RUN...``, writes beside the per-run reports
one tidy table, ``trajectory.csv``: one row per (revision, layer), ordered by step, that pandas
reads directly (``pd.read_csv``).

Columns (:func:`trajectory_columns`), every one generated from the reports' structure:

- ``model, revision, step, layer, index, n_rows``: ``revision`` is the hub revision, or the run
  directory's name for a local checkpoint; ``step`` is parsed from it (``stepN``,
  ``checkpoint-N``), empty when it has none;
- every scalar metric of the layer entry, then its ``se_<metric>``;
- ``iw_<side>_<kind>``: the partition isotropy of the checkpoint's embedding matrices (the report's
  ``embeddings.<side>.<kind>``), the same on every row of a revision;
- ``uncertainty_<key>``: how the standard errors were computed (``params.uncertainty.<key>``);
- the sections of the report that describe one layer, on that layer's row, named by one rule
  (:func:`section_columns`): ``<section>_<key>_<key>...``, the path of the number inside the
  section joined by ``_``. A section entry with ``before`` and ``after`` layers (``final_norm``,
  each of ``norms``) describes its ``after`` layer (``final_norm_gain_spearman_abs_gain_variance``
  on the ``final_norm`` row); a section with ``layers`` keyed by layer (``gradient_energy``)
  describes each of them. A list of rows that carry a ``rank`` gives each rank's numbers under
  ``r<rank>`` (``gradient_energy_r8_energy_ratio`` on the ``layer_06.grad`` row); any other list of
  rows (per-dimension outliers) gives its length ``<list>_n`` and, per one-word text field, the
  count of rows with each value (``final_norm_outliers_effect_damped``). Texts and per-dimension
  numbers stay in report.json, as do the parameters (``params``, the section's ranks and seed).

A column appears when some report has a number there; a cell is empty where a report has none
(a count is 0 where its list is present).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from geomscope.schema import STEP_RE, csv_metric_columns, is_number

TRAJECTORY_NAME = "trajectory.csv"
IW_COLUMNS = ("iw_input_raw", "iw_input_centred", "iw_output_raw", "iw_output_centred")


def runs_in(path) -> list[Path]:
    """The run directories directly inside ``path`` (those holding a manifest), by step then name."""
    from geomscope.store.names import MANIFEST_NAME

    p = Path(path)
    if not p.is_dir() or (p / MANIFEST_NAME).exists():
        return []
    runs = [d for d in p.iterdir() if d.is_dir() and (d / MANIFEST_NAME).exists()]

    def key(d: Path):
        m = STEP_RE.match(d.name)
        return (0, int(m.group(1)), d.name) if m else (1, 0, d.name)

    return sorted(runs, key=key)


def runs_under(path) -> list[Path]:
    """The runs of a directory of runs (:func:`runs_in`: one model's revisions), or else of a
    directory of such directories (one per model: ``runs/70m/step0``, ``runs/160m/step0``), each
    folder's runs by step, the folders by name; [] for a run or anything else."""
    from geomscope.store.names import MANIFEST_NAME

    runs = runs_in(path)
    p = Path(path)
    if runs or not p.is_dir() or (p / MANIFEST_NAME).exists():
        return runs
    return [r for d in sorted(x for x in p.iterdir() if x.is_dir()) for r in runs_in(d)]


def revision_of(report: dict) -> str:
    rev = (report.get("model") or {}).get("revision")
    if rev:
        return str(rev)
    return Path(
        str((report.get("run") or {}).get("dir") or (report.get("source") or {}).get("path") or "")
    ).name


def step_of(report: dict) -> int | None:
    m = STEP_RE.match(revision_of(report).strip())
    if m:
        return int(m.group(1))
    step = report.get("step")
    return int(step) if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _uncertainty_keys(reports: list[dict]) -> list[str]:
    keys: list[str] = []
    for r in reports:
        keys += [k for k in ((r.get("params") or {}).get("uncertainty") or {}) if k not in keys]
    return keys


def trajectory_columns(reports: list[dict]) -> list[str]:
    """The columns of ``trajectory.csv`` for these reports, in order (module docstring)."""
    return _columns(reports, trajectory_rows(reports))


def _columns(reports: list[dict], rows: list[dict]) -> list[str]:
    metrics: list[str] = []
    for r in reports:
        metrics += [m for m in csv_metric_columns(r) if m not in metrics]
    head = ["model", "revision", "step", "layer", "index", "n_rows"]
    methods = [f"uncertainty_{k}" for k in _uncertainty_keys(reports)]
    cols = [*head, *metrics, *[f"se_{m}" for m in metrics], *IW_COLUMNS, *methods]
    known = set(cols)
    extra = {c: None for row in rows for c in row.get(SECTION_KEY, {}) if c not in known}
    return [*cols, *extra]


def revision_columns(report: dict) -> dict:
    """The ``iw_*`` columns of a report: one value per revision (None where the report has none)."""
    emb = report.get("embeddings") or {}
    out = {}
    for side in ("input", "output"):
        part = emb.get(side) if isinstance(emb, dict) else None
        for kind in ("raw", "centred"):
            out[f"iw_{side}_{kind}"] = part.get(kind) if isinstance(part, dict) else None
    if isinstance(emb, dict) and emb.get("tied"):
        out["iw_output_raw"], out["iw_output_centred"] = out["iw_input_raw"], out["iw_input_centred"]
    return out


def is_revision_wide(column: str) -> bool:
    """Whether a trajectory column is one value per revision (repeated on its every row): I(W)."""
    return column.startswith("iw_")


#: the key under which :func:`trajectory_rows` keeps a row's section columns apart from the rest
SECTION_KEY = "_sections"


def section_columns(report: dict, counts: dict | None = None) -> dict[str, dict[str, float | int]]:
    """``{layer: {column: number}}``: the numbers of every report section that describes a layer,
    named by the module docstring's rule (``layers``, ``embeddings`` and ``params`` have columns of
    their own). ``counts``, when given, receives ``{count column: its list's <list>_n column}``, so
    that a count missing where its list is present reads 0."""
    counts = {} if counts is None else counts
    by_layer: dict[str, dict] = {}
    for key, section in report.items():
        if key in ("layers", "embeddings", "params"):
            continue
        for entry in section if isinstance(section, list) else [section]:
            if _describes_a_layer(entry):
                _flatten(entry, key, by_layer.setdefault(entry["after"], {}), counts)
        per_layer = section.get("layers") if isinstance(section, dict) else None
        if isinstance(per_layer, dict):
            for layer, rows in per_layer.items():
                if isinstance(rows, list):
                    _flatten_rows(rows, key, by_layer.setdefault(layer, {}), counts)
    return by_layer


def _describes_a_layer(entry) -> bool:
    """A section entry of a norm's effect: the layers before and after it, by name."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("before"), str)
        and isinstance(entry.get("after"), str)
    )


def _flatten(obj: dict, prefix: str, out: dict, counts: dict) -> None:
    """The numbers of ``obj`` into ``out`` as ``<prefix>_<key>[_<key>...]`` (module docstring)."""
    for key, v in obj.items():
        col = f"{prefix}_{key}"
        if is_number(v):
            out[col] = v
        elif isinstance(v, dict):
            _flatten(v, col, out, counts)
        elif isinstance(v, list) and all(isinstance(row, dict) for row in v):
            _flatten_rows(v, col, out, counts)


def _flatten_rows(rows: list[dict], col: str, out: dict, counts: dict) -> None:
    """A list of rows: each rank's numbers under ``<col>_r<rank>`` where every row has a rank, else
    the list's length ``<col>_n`` and the count of rows per value of each one-word text field."""
    ranks = [row.get("rank") for row in rows]
    if rows and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        for rank, row in zip(ranks, rows, strict=True):
            _flatten({k: v for k, v in row.items() if k != "rank"}, f"{col}_r{rank}", out, counts)
        return
    out[f"{col}_n"] = len(rows)
    for row in rows:
        for field, v in row.items():
            if isinstance(v, str) and v.isidentifier():
                name = f"{col}_{field}_{v}"
                out[name] = out.get(name, 0) + 1
                counts[name] = f"{col}_n"


def model_of(report: dict) -> str | None:
    """The model a revision belongs to: its name, or for a local checkpoint directory named after
    its step (``.../checkpoints/step500``) the directory holding the checkpoints, so that the
    checkpoints of one fine-tuning run form one trajectory."""
    name = (report.get("model") or {}).get("name") or (report.get("source") or {}).get("path")
    if name and not (report.get("model") or {}).get("revision"):
        p = Path(str(name))
        if STEP_RE.match(p.name) and p.name == revision_of(report):
            return str(p.parent)
    return name


def trajectory_rows(reports: list[dict]) -> list[dict]:
    """One dict per (report, layer), reports ordered by step (those without one last); the columns
    of the report's sections (:func:`section_columns`) under :data:`SECTION_KEY`."""
    order = sorted(reports, key=lambda r: (step_of(r) is None, step_of(r) or 0, revision_of(r)))
    rows, counts = [], {}
    for rep in order:
        head = {
            "model": model_of(rep),
            "revision": revision_of(rep),
            "step": step_of(rep),
        }
        iw = revision_columns(rep)
        methods = {
            f"uncertainty_{k}": v for k, v in ((rep.get("params") or {}).get("uncertainty") or {}).items()
        }
        sections = section_columns(rep, counts)
        for e in rep.get("layers", []):
            se = e.get("se") or {}
            row = {**head, "layer": e.get("layer"), "index": e.get("index"), "n_rows": e.get("n_rows")}
            for k, v in e.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in row:
                    row[k] = v
            row.update({f"se_{k}": v for k, v in se.items()})
            row.update(iw)
            row.update(methods)
            row[SECTION_KEY] = dict(sections.get(e.get("layer"), {}))
            rows.append(row)
    for row in rows:  # a count of rows is 0 where its list is present but has no row of that value
        own = row[SECTION_KEY]
        own.update({c: 0 for c, n in counts.items() if c not in own and own.get(n) is not None})
    return rows


def to_trajectory_csv(reports: list[dict]) -> str:
    rows = trajectory_rows(reports)
    cols = _columns(reports, rows)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for row in rows:
        cells = {**row, **row[SECTION_KEY]}
        w.writerow(
            [
                "" if cells.get(c) is None else (repr(cells[c]) if isinstance(cells[c], float) else cells[c])
                for c in cols
            ]
        )
    return buf.getvalue()


TRAJECTORY_HEADER = b"model,revision,step,layer,index,n_rows"


def check_trajectory_out(path) -> Path:
    """``path`` if a trajectory may be written there: nothing, or an earlier trajectory.csv (replaced);
    InputError (one line) for a user's file of that name."""
    from geomscope.outputs import HEAD_BYTES, ensure_replaceable, starts_with

    ensure_replaceable(path, starts_with(TRAJECTORY_HEADER), head=HEAD_BYTES)
    return Path(path)


def write_trajectory(reports: list[dict], path) -> Path:
    from geomscope.fileio import write_text_atomic

    path = check_trajectory_out(path)
    write_text_atomic(path, to_trajectory_csv(reports))
    return path


def _cell_number(key: str, v: str) -> float | None:
    """A trajectory cell as a number (None when empty); ValueError for anything else."""
    if not v.strip():
        return None
    num = float(v)
    if not math.isfinite(num):
        raise ValueError(f"{key} is {v!r}")
    return num


def _checkpoint_key(r: dict) -> tuple[str, str, str]:
    """(model, revision, step) of a trajectory.csv row: the checkpoint whose report it belongs to."""
    return (r.get("model") or "", r.get("revision") or "", (r.get("step") or "").strip())


def _add_trajectory_row(reports: dict[tuple, dict], r: dict) -> None:
    """One trajectory.csv row into its checkpoint's report-like dict (ValueError when malformed)."""
    if None in r:  # csv.DictReader files the cells past the header's under None
        raise ValueError("more cells than the header has columns")
    model, rev, step = _checkpoint_key(r)
    rep = reports.setdefault(
        (model, rev, step),
        {
            "model": {"name": model or None, "revision": rev},
            "step": int(step) if step else None,
            "params": {},
            "layers": [],
        },
    )
    entry: dict = {"layer": r["layer"] or "", "se": {}}
    for k, v in r.items():
        if k.startswith("uncertainty_") and v:
            rep["params"].setdefault("uncertainty", {})[k[len("uncertainty_") :]] = v
            continue
        if k in ("model", "revision", "step", "layer") or k.startswith("uncertainty_") or v is None:
            continue
        num = _cell_number(k, v)
        if k.startswith("se_"):
            entry["se"][k[3:]] = num
        elif k in ("index", "n_rows"):
            if num is not None and num != int(num):
                raise ValueError(f"{k} is {v!r}")
            entry[k] = int(num) if num is not None else None
        else:
            entry[k] = num
    rep["layers"].append(entry)


def read_trajectory(path) -> list[dict]:
    """``trajectory.csv`` back as one report-like dict per checkpoint (``model``, ``step``, ``layers``
    with every number of the row, ``se``), the form the trajectory figure takes; a file may hold the
    checkpoints of several models (its ``model`` column tells them apart).

    One layer of a checkpoint twice (two datasets or runs at one revision) is an InputError, not
    two sets of rows mixed into one report.
    """
    from geomscope.errors import InputError

    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"{path} is not a readable trajectory.csv ({e})") from None
    if not rows or not {"revision", "step", "layer"} <= set(rows[0]):
        raise InputError(
            f"{path} is not a trajectory.csv written by `geomscope score` (no revision/step/layer)"
        )
    reports: dict[tuple, dict] = {}
    seen: set[tuple] = set()
    for line, r in enumerate(rows, 2):
        key = (*_checkpoint_key(r), r.get("layer") or "")
        if key in seen:  # two sets of rows for one checkpoint (two datasets, two runs) would be mixed
            raise InputError(
                f"{path} line {line} repeats layer {key[3]!r} of {key[0] or 'the model'} at revision "
                f"{key[1]!r} (rows of two datasets or runs?); give each set of runs its own trajectory.csv"
            )
        seen.add(key)
        try:
            _add_trajectory_row(reports, r)
        except (ValueError, OverflowError) as e:
            raise InputError(
                f"{path} line {line} is not what `geomscope score` writes ({e}); score the runs again"
            ) from None
    return list(reports.values())
