"""``geomscope score``: per-layer geometry of a run directory or an (N, D) array -> JSON + CSV report.

Thin wrapper over :func:`geomscope.score.score` and :mod:`geomscope.report`; numpy, h5py and the
metrics are imported only inside the command. Numeric options are parsed here (not by click) so
that a bad value gets the same one-line ``error: ...`` as every other bad input.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from geomscope.cli._app import app

_DEFAULT_METRICS = "isoscore,isoscore_star,avgcos,spectrum,outliers,twonn,partition"


def _split(values) -> list[str]:
    return [v.strip() for item in values or [] for v in str(item).split(",") if v.strip()]


def _num(option: str, value, kind=float, allow_none: bool = False):
    from geomscope.errors import InputError

    if value is None or (allow_none and str(value).strip().lower() in ("", "none", "all")):
        return None
    try:
        return kind(str(value).strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise InputError(f"{option} must be {what}; got {value!r}") from None


def _default_out(source: str) -> str:
    import os
    from pathlib import Path

    p = Path(source)
    if p.is_dir():
        return str(p) + os.sep
    prefix = p.with_name(p.stem + "_report")
    return str(prefix) if os.access(p.parent, os.W_OK) else p.stem + "_report"


@app.command("score")
def score_cmd(
    source: str = typer.Argument(..., metavar="RUN_DIR|FILE.npy|FILE.h5",
                                 help="A run directory written by `geomscope extract`, or an (N, D) array."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Dataset path inside an .h5 array file."),
    metrics: List[str] = typer.Option(
        [_DEFAULT_METRICS], "--metrics", "-m",
        help="Comma list: isoscore, isoscore_star, avgcos, spectrum, outliers, twonn, partition, "
             "and intrinsic-dimension estimators (e.g. mle, lpca); 'all' = the first seven."),
    zeta: str = typer.Option("0.2", "--zeta", metavar="FLOAT", help="IsoScore* weight on the shrinkage target, in [0, 1]."),
    shrinkage_target: str = typer.Option(
        "trace", "--shrinkage-target",
        help="trace (trace-matched identity), identity, FILE.npy (a D x D covariance), RUN_DIR (that run's "
             "covariance of the same layer) or layer:NAME (this run's layer, the paper's practice)."),
    avgcos_variants: List[str] = typer.Option(["plain,centred,standardised"], "--avgcos-variants",
                                              help="Average cosine variants (comma list)."),
    outlier_rule: str = typer.Option("variance", "--outlier-rule", help="variance | zscore | quantile | magnitude."),
    outlier_threshold: Optional[str] = typer.Option(
        None, "--outlier-threshold", metavar="FLOAT",
        help="variance: k x mean variance (5); zscore: z (3); quantile: q (0.99); magnitude: |x| (6)."),
    outlier_stat: str = typer.Option("variance", "--outlier-stat", help="zscore rule statistic: variance | mean_abs."),
    discard_fraction: str = typer.Option("0.1", "--discard-fraction", metavar="FLOAT", help="TwoNN: fraction of largest ratios dropped."),
    id_sample: str = typer.Option("5000", "--id-sample", metavar="INT", help="Rows per layer sampled for intrinsic dimension."),
    id_estimator: List[str] = typer.Option([], "--id-estimator",
                                           help="More intrinsic-dimension estimators (comma list)."),
    twonn_fit: str = typer.Option("linear", "--twonn-fit", help="TwoNN fit: linear (Facco) | mle."),
    id_repeats: str = typer.Option("4", "--id-repeats", metavar="INT", help="Parts of the ID sample for the decimation SE."),
    seed: str = typer.Option("0", "--seed", metavar="INT", help="Seed of every sample (rows, ID sample, decimation)."),
    exclude_special: bool = typer.Option(False, "--exclude-special",
                                         help="Drop special tokens (CLS/SEP/BOS...) before measuring."),
    layers: List[str] = typer.Option([], "--layers", "-l", help="Only these layers (names or indices, comma list)."),
    max_rows: Optional[str] = typer.Option(None, "--max-rows", metavar="INT", help="Seeded uniform sample of rows per layer."),
    workers: str = typer.Option("1", "--workers", "-w", metavar="INT",
                                help="Processes reading shards (and threads finishing layers) in parallel; "
                                     "BLAS runs single-threaded in each."),
    jackknife_groups: str = typer.Option("10", "--jackknife-groups", metavar="INT",
                                         help="Document groups of the jackknife SE (0 = off)."),
    memory_mb: str = typer.Option("2048", "--memory-mb", metavar="MIB", help="Memory budget of the per-layer accumulators."),
    partial: bool = typer.Option(False, "--partial", help="Score the finished shards of an incomplete run."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the shard checksum check (size is still checked)."),
    out: Optional[str] = typer.Option(
        None, "--out", "-o",
        help="Directory (report.json + report.csv) or prefix (PREFIX.json + PREFIX.csv). Default: the run "
             "directory; for an array FILE_report.* next to it."),
    as_json: bool = typer.Option(False, "--json", help="Print the report JSON to stdout (nothing else on stdout)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no table (warnings still shown)."),
) -> None:
    """Score per-layer geometry: IsoScore, IsoScore*, average cosine, spectrum, outlier dimensions,
    intrinsic dimension (with standard errors) and partition isotropy of the embedding matrices."""
    import sys

    from rich.console import Console

    from geomscope.report import report_table, save_report, to_json
    from geomscope.score import ScoreOptions, score

    console = Console(stderr=True)

    def log(msg: str) -> None:
        console.print(f"[yellow]warning:[/yellow] {msg}", highlight=False, markup=True)

    opts = ScoreOptions(
        metrics=tuple(_split(metrics)), zeta=zeta, shrinkage_target=shrinkage_target,
        avgcos_variants=tuple(_split(avgcos_variants)), outlier_rule=outlier_rule,
        outlier_threshold=_num("--outlier-threshold", outlier_threshold, allow_none=True),
        outlier_stat=outlier_stat, discard_fraction=_num("--discard-fraction", discard_fraction),
        id_sample=_num("--id-sample", id_sample, int), id_estimator=tuple(_split(id_estimator)),
        twonn_fit=twonn_fit, id_repeats=_num("--id-repeats", id_repeats, int), seed=_num("--seed", seed, int),
        exclude_special=exclude_special, layers=tuple(_split(layers)) or None,
        max_rows=_num("--max-rows", max_rows, int, allow_none=True), workers=_num("--workers", workers, int),
        partial=partial, jackknife_groups=_num("--jackknife-groups", jackknife_groups, int),
        memory_mb=_num("--memory-mb", memory_mb), verify=not no_verify, dataset=dataset,
    ).validate()
    report = score(source, opts, progress=not quiet and sys.stderr.isatty(), log=log)
    jpath, cpath = save_report(report, out if out is not None else _default_out(source))
    if not quiet:
        console.print(report_table(report))
        console.print(f"wrote {jpath}\nwrote {cpath}", highlight=False)
    if as_json:
        sys.stdout.write(to_json(report) + "\n")
        sys.stdout.flush()
