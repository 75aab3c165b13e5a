"""Many runs of one model (checkpoints), scored together: ``score DIR`` on a directory of runs, or
``score RUN...``, writes beside the per-run reports one tidy table, ``trajectory.csv``.

Columns (:func:`trajectory_columns`): ``model, revision, step, layer, index, n_rows``, every scalar
metric, its ``se_<metric>``, and the partition isotropy of the checkpoint's embedding matrices
``iw_input_raw, iw_input_centred, iw_output_raw, iw_output_centred`` (the same on every layer row
of a revision), then ``uncertainty_<key>``: how the standard errors were computed. One row per
(revision, layer), ordered by step; pandas reads it directly (``pd.read_csv``). ``revision`` is the
hub revision, or the run directory's name for a local checkpoint; ``step`` is parsed from it
(``stepN``, ``checkpoint-N``), empty when it has none.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from geomscope.schema import STEP_RE, csv_metric_columns

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
    metrics: list[str] = []
    for r in reports:
        metrics += [m for m in csv_metric_columns(r) if m not in metrics]
    head = ["model", "revision", "step", "layer", "index", "n_rows"]
    methods = [f"uncertainty_{k}" for k in _uncertainty_keys(reports)]
    return [*head, *metrics, *[f"se_{m}" for m in metrics], *IW_COLUMNS, *methods]


def _iw(report: dict) -> dict:
    emb = report.get("embeddings") or {}
    out = {}
    for side in ("input", "output"):
        part = emb.get(side) if isinstance(emb, dict) else None
        for kind in ("raw", "centred"):
            out[f"iw_{side}_{kind}"] = part.get(kind) if isinstance(part, dict) else None
    if isinstance(emb, dict) and emb.get("tied"):
        out["iw_output_raw"], out["iw_output_centred"] = out["iw_input_raw"], out["iw_input_centred"]
    return out


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
    """One dict per (report, layer), reports ordered by step (those without one last)."""
    order = sorted(reports, key=lambda r: (step_of(r) is None, step_of(r) or 0, revision_of(r)))
    rows = []
    for rep in order:
        head = {
            "model": model_of(rep),
            "revision": revision_of(rep),
            "step": step_of(rep),
        }
        iw = _iw(rep)
        methods = {
            f"uncertainty_{k}": v for k, v in ((rep.get("params") or {}).get("uncertainty") or {}).items()
        }
        for e in rep.get("layers", []):
            se = e.get("se") or {}
            row = {**head, "layer": e.get("layer"), "index": e.get("index"), "n_rows": e.get("n_rows")}
            for k, v in e.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in row:
                    row[k] = v
            row.update({f"se_{k}": v for k, v in se.items()})
            row.update(iw)
            row.update(methods)
            rows.append(row)
    return rows


def to_trajectory_csv(reports: list[dict]) -> str:
    cols = trajectory_columns(reports)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for row in trajectory_rows(reports):
        w.writerow(
            [
                "" if row.get(c) is None else (repr(row[c]) if isinstance(row[c], float) else row[c])
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
        if k in ("model", "revision", "step", "layer") or k.startswith(("iw_", "uncertainty_")) or v is None:
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
    with metrics and ``se``), the form the trajectory figure takes.

    A trajectory follows one model: a file holding the rows of several models, or one layer of a
    checkpoint twice (two datasets or runs at one revision), is an InputError, not one report
    named after the first.
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
    models = list(dict.fromkeys(model for model, _, _ in reports))
    if len(models) > 1:
        raise InputError(
            f"{path} holds the rows of {len(models)} models ({', '.join(repr(m) for m in models[:3])}"
            f"{', …' if len(models) > 3 else ''}); a trajectory follows one model: plot each model's "
            "report files separately"
        )
    return list(reports.values())
