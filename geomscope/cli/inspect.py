"""``geomscope inspect RUN_DIR``: what a run holds (model, layers, rows, shards, size, completeness)."""

from __future__ import annotations

import typer

from geomscope.cli._app import app
from geomscope.cli._options import json_option, options_from
from geomscope.formatting import counted
from geomscope.layers import FINAL_NORM_LAYER
from geomscope.store.options import InspectOptions


@app.command("inspect")
@options_from(InspectOptions)
def inspect_cmd(
    run_dir: str = typer.Argument(
        ...,
        metavar="RUN_DIR",
        help="A run directory written by `geomscope extract`, or its fsspec URL (file://, s3://, gcs://, "
        "hf://, ...; read through fsspec, the filesystem's package installed).",
    ),
    json_out: bool = json_option("the description"),
    **chosen,
) -> None:
    """Show a run's model, revision, layers, rows, documents, shards, dtype, size on disk and completeness."""
    import json

    from rich.console import Console
    from rich.table import Table

    from geomscope.formatting import shown
    from geomscope.store import describe_run

    options = InspectOptions(**chosen)
    d = describe_run(run_dir, options)
    if json_out:
        typer.echo(json.dumps(d))
    else:
        t = Table(show_header=False, box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        for k, v in _rows(d):  # every value holds names from the run (model, layers, files, inputs)
            t.add_row(k, shown(v))
        Console().print(t)  # the report is the output: stdout, like --json
    if options.verify:
        _refuse_damage(d["verify"], run_dir)


def _rows(d: dict) -> list[tuple[str, str]]:
    """The table's rows: what the run is, holds and asked for."""
    m = d["model"]
    rev = m.get("revision") or "-"
    if m.get("commit"):
        rev += f" (commit {m['commit'][:12]})"
    planned = d.get("planned_shards")
    nonfinite = ", ".join(f"{k}: {v}" for k, v in d["nonfinite_by_layer"].items())
    rows = [
        ("run", d["run_dir"]),
        ("status", _status(d, planned)),
        (
            "model",
            f"{m.get('name')} ({m.get('model_type')}, {m.get('architecture')}, {m.get('stack')} stack, "
            f"{m.get('attention')})",
        ),
        ("revision", rev),
        ("layers", f"{len(d['layers'])}: {', '.join(d['layers'])}" + _norm_note(d)),
        ("dim", str(d["dim"]) + _widths_note(d)),
        *([("capture", _capture_note(d))] if d.get("capture", "activations") != "activations" else []),
        ("dtype", f"model {m.get('dtype')}, stored {d['store_dtype']}"),
        ("rows", f"{d['rows']:,}" + _keep_note(d)),
        ("documents", f"{d['docs']:,}"),
        ("shards", f"{d['shards']}" + (f" of {planned}" if planned and not d["complete"] else "")),
        ("size on disk", _human(d["bytes_on_disk"])),
        ("nonfinite rows", f"{d['nonfinite_rows']:,}" + (f" ({nonfinite})" if nonfinite else "")),
        ("inputs", ", ".join(f"{i.get('path')} ({i.get('kind')})" for i in d["inputs"]) or "-"),
        ("options", ", ".join(f"{k}={v}" for k, v in d["options"].items())),
    ]
    if d["interrupted_shard_files"]:
        rows.append(("interrupted", ", ".join(d["interrupted_shard_files"]) + " (redone on resume)"))
    if "verify" in d:
        rows.append(("verify", _verify_line(d["verify"])))
    return rows


def _widths_note(d: dict) -> str:
    """The layers of another width than ``dim``, after it (``extract --modules``), or nothing."""
    other = d.get("layer_dims") or {}
    if not other:
        return ""
    shown = ", ".join(f"{name}: {w}" for name, w in list(other.items())[:6])
    more = f" and {len(other) - 6} more" if len(other) > 6 else ""
    return f" ({counted(len(other), 'layer')} of another width: {shown}{more})"


def _verify_line(v: dict) -> str:
    """What ``--verify`` found, in one line."""
    if v["ok"]:
        return (
            "all shards match their checksums; every document id is in exactly one shard "
            f"({counted(v['documents']['docs'], 'document')} in {counted(v['documents']['shards'], 'shard')})"
        )
    found = [f"the manifest disagrees with itself: {why}" for why in v["manifest"]]
    if v["bad"]:
        found.append(
            f"{len(v['bad'])} of {v['checked']} shards damaged: " + ", ".join(b["file"] for b in v["bad"])
        )
    return "; ".join(found)


def _refuse_damage(v: dict, run_dir: str) -> None:
    """DataError when ``--verify`` found the manifest or a shard damaged, saying how to mend it."""
    from geomscope.errors import DataError

    if v["manifest"]:  # deleting shards would not mend it
        also = f", and {len(v['bad'])} of {v['checked']} shards are damaged" if v["bad"] else ""
        raise DataError(
            f"the manifest of {run_dir} disagrees with itself ({v['manifest'][0]}){also}; rerun "
            "`geomscope extract` with --overwrite, or into a new --out"
        )
    if not v["ok"]:
        bad = v["bad"]
        raise DataError(
            f"{len(bad)} of {v['checked']} shards of {run_dir} are damaged "
            f"({', '.join(b['file'] for b in bad[:5])}); delete them and rerun the same "
            "`geomscope extract` command to redo them"
        )


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _status(d: dict, planned) -> str:
    if d["complete"]:
        return "complete"
    if d.get("in_progress"):
        return f"IN PROGRESS ({d['shards']} of {planned} shards so far; another process is writing it)"
    return (
        f"INCOMPLETE ({d['shards']} of {planned} shards); "
        "rerun the same `geomscope extract` command to resume"
    )


def _norm_note(d: dict) -> str:
    """Which stored layer is on which side of the model's final norm."""
    name = d.get("final_norm_layer")
    if not name:
        return ""
    before = [n for n, t in (d.get("layer_tensors") or {}).items() if "input of the final norm" in (t or "")]
    if name == FINAL_NORM_LAYER:
        return "  (final_norm: the final norm's output" + (f"; {before[0]}: its input)" if before else ")")
    return f"  ({name} is after the final norm)"


def _capture_note(d: dict) -> str:
    loss = d.get("loss") or {}
    extra = ""
    if loss.get("kind") == "masked-lm":
        extra = f", mask probability {loss.get('mlm_probability')}, seed {loss.get('mask_seed')}"
    elif loss.get("kind") == "classification":
        extra = f", labels from {loss.get('label_field')!r}"
    return f"{d['capture']} of the {loss.get('kind')} loss (per-document mean{extra}); layers <name>.grad"


def _keep_note(d: dict) -> str:
    keep = d.get("keep") or "all"
    if keep == "all":
        return ""
    n = keep.partition(":")[2]
    return (
        f" measured; kept per shard: each layer's accumulators and a seeded sample of {n} rows "
        f"({counted(d['rows_stored'], 'row')} stored, --keep {keep}, "
        f"seed {d['options'].get('sample_seed', 0)})"
    )
