"""``geomscope compare DIR...``: isotropy against accuracy across finetune runs. A thin wrapper over
:func:`geomscope.study.compare`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geomscope.cli._app import app
from geomscope.cli._options import json_option, quiet_option


@app.command("compare")
def compare_cmd(
    dirs: List[Path] = typer.Argument(
        ..., metavar="DIR", help="Finetune outputs: runs, sweeps, or folders of runs."
    ),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-o",
        metavar="DIR",
        help="Where compare.json, compare.csv and compare.png go (default: the one DIR given).",
    ),
    allow_mixed: bool = typer.Option(
        False, "--allow-mixed", help="Compare runs of different models or eval sets."
    ),
    # (each interval: the correlations', the paired differences' and the figure's fit band)
    n_boot: int = typer.Option(
        2000, "--bootstrap", min=100, metavar="N", help="Bootstrap resamples of each interval."
    ),
    seed: int = typer.Option(0, "--seed", min=0, metavar="N", help="Seed of the bootstrap."),
    as_json: bool = json_option("the comparison"),
    quiet: bool = quiet_option("No table on stderr."),
) -> None:
    """Does isotropy go with accuracy? Per-configuration means ± SD over seeds, the Spearman and Pearson
    correlation of eval IsoScore* with accuracy (F1 for --task qa runs; bootstrap intervals resampling
    seeds within configurations, or runs where a configuration has a single run), paired differences
    against lambda = 0, a figure and one plain sentence."""
    import json

    from geomscope.errors import InputError
    from geomscope.fileio import (
        HEAD_BYTES,
        ensure_replaceable,
        ensure_writable,
        json_format_is,
        make_dirs,
        starts_with,
        write_bytes_atomic,
        write_text_atomic,
    )
    from geomscope.plot.figures import FIGURE_HINT, is_figure
    from geomscope.plot.study import study_png
    from geomscope.report import shown
    from geomscope.study.compare import compare, to_csv

    # where the outputs go, and whether they may, is settled before the bootstraps run
    if out is None and len(dirs) != 1:
        raise InputError("several DIRs were given: name where the comparison goes with --out DIR")
    dest = out if out is not None else dirs[0]
    # a user's file at any of these names is refused before anything is written, never replaced
    ensure_replaceable(dest / "compare.json", json_format_is("geomscope-compare"), head=HEAD_BYTES)
    ensure_replaceable(dest / "compare.csv", starts_with(b"reg,lambda,n"), head=HEAD_BYTES)
    ensure_replaceable(dest / "compare.png", is_figure, hint=FIGURE_HINT)
    ensure_writable(dest)
    result = compare([str(d) for d in dirs], allow_mixed=allow_mixed, n_boot=n_boot, seed=seed)
    # every output is made before any is written: a figure that cannot be drawn leaves no new
    # compare.json beside an old compare.png. allow_nan=False: Infinity or NaN is not JSON (the
    # statistics give None for what a float cannot hold, so this only guards against a bug)
    document = json.dumps(result, indent=1, allow_nan=False) + "\n"
    png = study_png(result)
    make_dirs(dest)
    write_text_atomic(dest / "compare.json", document)
    write_text_atomic(dest / "compare.csv", to_csv(result))
    write_bytes_atomic(dest / "compare.png", png)
    if not quiet:
        _print_table(result)
        typer.echo(f"wrote {shown(dest / 'compare.json', markup=False)}, compare.csv, compare.png", err=True)
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))


def _fmt(mean, sd) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f}" + ("" if sd is None else f" ± {sd:.3f}")


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from geomscope.report import shown
    from geomscope.study.compare import LABELS
    from geomscope.study.sweep import _number

    # the regulariser comes from each run's config: shown() keeps its markup and escapes inert
    t = Table(title="geomscope compare", caption=shown(result["sentence"]), header_style="bold")
    metrics = result["metrics"]
    # lambda as the runs' folders name it (1e-06 and 1.000001e-06 differ), never cut short
    lams = [_number(r["lambda"]) for r in result["table"]]
    for c in ("reg", "lambda", "n", *(LABELS[m] for m in metrics)):
        t.add_column(
            c,
            justify="right" if c not in ("reg",) else "left",
            min_width=max(map(len, lams), default=None) if c == "lambda" else None,
        )
    for r, lam in zip(result["table"], lams, strict=True):
        t.add_row(
            shown(r["reg"]),
            lam,
            str(r["n"]),
            *[_fmt(r[f"{m}_mean"], r[f"{m}_sd"]) for m in metrics],
        )
    Console(stderr=True).print(t)
