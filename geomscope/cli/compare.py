"""``geomscope compare DIR...``: isotropy against accuracy (F1, perplexity) across finetune runs. A
thin wrapper over :func:`geomscope.study.compare`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geomscope.cli._app import app
from geomscope.cli._options import json_option, options_from, out_option, quiet_option
from geomscope.study.options import CompareOptions


@app.command("compare")
@options_from(CompareOptions)
def compare_cmd(
    dirs: List[Path] = typer.Argument(
        ..., metavar="DIR", help="Finetune outputs: runs, sweeps, or folders of runs."
    ),
    out: Optional[Path] = out_option(
        "DIR",
        "Where compare.json, compare.csv and compare.png go (default: the one DIR given).",
        required=False,
    ),
    as_json: bool = json_option("the comparison"),
    quiet: bool = quiet_option("No table on stderr."),
    **chosen,
) -> None:
    """Does isotropy go with accuracy? Per-configuration means ± SD over seeds, the Spearman and Pearson
    correlation of eval IsoScore* with accuracy (F1 for --task qa runs, perplexity for --task causal-lm
    runs, where lower is better; intervals that resample whole configurations, given from 3
    configurations of 3 seeds), paired differences against lambda = 0 with n (t intervals from 3
    pairs), a figure and one plain sentence."""
    import json

    from geomscope.errors import InputError
    from geomscope.study.compare import compare

    options = CompareOptions(**chosen).validate()
    if out is None and len(dirs) != 1:
        raise InputError("several DIRs were given: name where the comparison goes with --out DIR")
    dest = out if out is not None else dirs[0]
    _check_outputs(dest)  # where the outputs go, and whether they may, is settled before the bootstraps
    result = compare([str(d) for d in dirs], options)
    _write(dest, result, quiet)
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))


def _check_outputs(dest: Path) -> None:
    """A user's file at any of compare's output names is refused before anything is written."""
    from geomscope.fileio import ensure_writable
    from geomscope.outputs import HEAD_BYTES, ensure_replaceable, json_format_is, starts_with
    from geomscope.plot.figures import FIGURE_HINT, is_figure
    from geomscope.schema import COMPARE_FORMAT

    ensure_replaceable(dest / "compare.json", json_format_is(COMPARE_FORMAT), head=HEAD_BYTES)
    ensure_replaceable(dest / "compare.csv", starts_with(b"reg,lambda,n"), head=HEAD_BYTES)
    ensure_replaceable(dest / "compare.png", is_figure, hint=FIGURE_HINT)
    ensure_writable(dest)


def _write(dest: Path, result: dict, quiet: bool) -> None:
    """compare.json, compare.csv and compare.png, every one made before any is written: a figure
    that cannot be drawn leaves no new compare.json beside an old compare.png. allow_nan=False:
    Infinity or NaN is not JSON (the statistics give None for what a float cannot hold, so this
    only guards against a bug)."""
    import json

    from geomscope.fileio import make_dirs, write_bytes_atomic, write_text_atomic
    from geomscope.formatting import shown
    from geomscope.plot.study import study_png
    from geomscope.study.compare import to_csv

    document = json.dumps(result, indent=1, allow_nan=False) + "\n"
    png = study_png(result)
    make_dirs(dest)
    write_text_atomic(dest / "compare.json", document)
    write_text_atomic(dest / "compare.csv", to_csv(result))
    write_bytes_atomic(dest / "compare.png", png)
    if not quiet:
        _print_table(result)
        typer.echo(f"wrote {shown(dest / 'compare.json', markup=False)}, compare.csv, compare.png", err=True)


def _fmt(mean, sd, sep: str = " ± ") -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f}" + ("" if sd is None else f"{sep}{sd:.3f}")


def _num(v) -> str:
    return "-" if v is None else f"{v:.3f}" if abs(v) < 1e4 else f"{v:.3g}"


def _interval(iv: dict) -> str:
    """An interval as a cell: its ends, or why there is none (the reason's first clause: the JSON
    holds the whole of it)."""
    if iv["low"] is None:
        return (iv.get("reason") or "no interval").split(":")[0]
    return f"{iv['level']:.0%}: {_num(iv['low'])} to {_num(iv['high'])}"


def _header(label: str) -> dict:
    """A column that is never narrower than the longest word of its header ("IsoScore*" whole):
    a header wraps between words, never inside one."""
    return {"min_width": max(map(len, label.split())), "overflow": "fold"}


def _table_cells(result: dict, width: int) -> list[list[str]]:
    """The table's rows as text: mean ± SD on one line where the table fits in ``width`` so, else
    the SD under its mean (rich, made to shrink a table, cuts headers short: "IsoScor…")."""
    from geomscope.formatting import shown
    from geomscope.study.compare import LABELS
    from geomscope.study.sweep import lambda_text

    metrics = result["metrics"]
    headers = ["reg", "lambda", "n", *(LABELS[m] for m in metrics)]
    for sep in (" ± ", "\n± "):
        cells = [
            [shown(r["reg"]), lambda_text(r["lambda"]), str(r["n"])]
            + [_fmt(r[f"{m}_mean"], r[f"{m}_sd"], sep) for m in metrics]
            for r in result["table"]
        ]
        lines = [[max(map(len, c.split("\n"))) for c in row] for row in cells]
        if 1 + sum(3 + max(len(h), *(ln[i] for ln in lines)) for i, h in enumerate(headers)) <= width:
            break
    return cells


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from geomscope.formatting import shown
    from geomscope.study.compare import LABELS

    console = Console(stderr=True)
    cells = _table_cells(result, console.width)
    # the regulariser comes from each run's config: shown() keeps its markup and escapes inert
    t = Table(title="geomscope compare", caption=shown(result["sentence"]), header_style="bold")
    t.add_column("reg", justify="left")
    # lambda as the runs' folders name it (1e-06 and 1.000001e-06 differ), never cut short
    t.add_column("lambda", justify="right", min_width=max((len(c[1]) for c in cells), default=None))
    t.add_column("n", justify="right")
    for label in (LABELS[m] for m in result["metrics"]):
        t.add_column(label, justify="right", **_header(label))
    for row in cells:
        t.add_row(*row)
    console.print(t)
    console.print(_association_table(result))
    if result["paired_vs_lambda_0"]:
        console.print(_paired_table(result))


def _association_table(result: dict):
    """Both correlations with their intervals, and the design they rest on."""
    from rich.table import Table

    from geomscope.study.compare import LABELS

    a = result["association"]
    seeds = a["seeds_per_configuration"]
    seeds = str(seeds["min"]) if seeds["min"] == seeds["max"] else f"{seeds['min']}-{seeds['max']}"
    t = Table(
        title=f"eval IsoScore* and eval {LABELS[result['outcome']]} across runs",
        caption=(
            f"{a['configurations']} configurations, {a['distinct_lambdas']} distinct lambda values, "
            f"{seeds} seeds each; intervals resample whole configurations (from 3 configurations "
            "of 3 seeds)"
        ),
        header_style="bold",
    )
    for c in ("correlation", "estimate", "interval"):
        t.add_column(c, justify="left" if c == "correlation" else "right", **_header(c))
    for name, key in (("Spearman rho", "spearman"), ("Pearson r", "pearson")):
        t.add_row(name, _num(a[key]["estimate"]), _interval(a[key]))
    return t


def _paired_table(result: dict):
    """Each lambda minus lambda = 0 of the same regulariser, seed by seed: mean, n and interval."""
    from rich.table import Table

    from geomscope.formatting import shown
    from geomscope.study.compare import LABELS
    from geomscope.study.sweep import lambda_text

    outcome = result["outcome"]
    t = Table(title="paired differences against lambda = 0 (same seed)", header_style="bold")
    t.add_column("reg", justify="left")
    t.add_column("lambda", justify="right")
    t.add_column("n", justify="right")
    for label in (f"Δ {LABELS[outcome]}", "Δ IsoScore*"):
        t.add_column(label, justify="right", **_header(label))
    for p in result["paired_vs_lambda_0"]:
        cells = [f"{_num(p[m]['estimate'])}\n{_interval(p[m])}" for m in (outcome, "isoscore_star")]
        t.add_row(shown(p["reg"]), lambda_text(p["lambda"]), str(p["n_pairs"]), *cells)
    return t
