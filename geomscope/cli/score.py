"""``geomscope score``: per-layer geometry of a run directory or an (N, D) array -> JSON + CSV report.

Thin wrapper over :func:`geomscope.score.score` and :mod:`geomscope.report`; numpy, h5py and the
metrics are imported only inside the command. Click parses and range-checks the numbers; the
library's :class:`~geomscope.score.ScoreOptions` validates what depends on more than one option.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from geomscope import choices
from geomscope.cli import _complete
from geomscope.cli._app import app, state
from geomscope.cli._options import (
    SEED_RANGE_HELP,
    STORED_LAYERS_HELP,
    OutlierRule,
    OutlierStat,
    ProductDtype,
    TwoNNFit,
    json_option,
    layers_option,
    metrics_option,
    quiet_option,
    seed_value,
    split_list,
    value,
    zeta_option,
)
from geomscope.options import choice_metavar

CORE_METRICS = "isoscore,isoscore_star,avgcos,spectrum,outliers,twonn,partition"


def _default_out(source: str) -> str:
    import os
    from pathlib import Path

    from geomscope.fileio import write_denied
    from geomscope.store import MANIFEST_NAME

    p = Path(source)
    if p.is_dir() and (p / MANIFEST_NAME).exists():  # a run: the report lives beside its shards
        return str(p) + os.sep
    p = p.resolve() if p.name in ("", ".", "..") else p
    prefix = p.with_name(p.stem + "_report")
    # beside the source where that folder exists and takes a file -- a real probe: os.access says
    # yes to root, and on a read-only mount -- else the working directory (a URL's source folder is
    # no local folder: the probe would answer for the nearest existing parent, '.')
    here = p.parent.is_dir() and write_denied(p.parent) is None
    return str(prefix) if here else p.stem + "_report"


@app.command("score")
def score_cmd(
    sources: List[str] = typer.Argument(
        ...,
        metavar="SOURCE",
        help="A run directory written by `geomscope extract`; an (N, D) array (.npy, .h5); or one "
        "(N, D) array per layer: .npz, .safetensors, .pt (tensors only), .arrow, .parquet, or a "
        "directory of them (datasets.save_to_disk, SAELens activation cache). Several runs, or a "
        "directory of runs (extract --revisions), are scored one by one and tabled in trajectory.csv.",
    ),
    dataset: Optional[str] = typer.Option(
        None, "--dataset", metavar="PATH", help="Dataset path inside an .h5 array file."
    ),
    column: List[str] = typer.Option(
        [],
        "--column",
        metavar="NAME",
        help="Arrays to score from an .npz, .safetensors, .pt, Arrow or Parquet source "
        "(members, tensors or columns; comma list or repeated; default: every 2-D numeric one).",
    ),
    metrics: List[str] = metrics_option(
        [CORE_METRICS],
        "Comma list of isoscore, isoscore_star, avgcos, spectrum, outliers, twonn, partition and "
        "scikit-dimension estimators (e.g. mle, lpca); 'all' = those seven core metrics (the estimators "
        "only when named).",
        _complete.score_metrics,
    ),
    zeta: float = zeta_option("IsoScore* weight on the shrinkage target (0 = plain IsoScore)."),
    shrinkage_target: str = typer.Option(
        "trace",
        "--shrinkage-target",
        metavar="TARGET",
        help="trace (trace-matched identity), identity, FILE.npy (a D x D covariance), RUN_DIR (that run's "
        "covariance of the same layer) or layer:NAME (this run's layer, the paper's practice).",
    ),
    avgcos_variants: List[str] = typer.Option(
        ["plain,centred,standardised"],
        "--avgcos-variants",
        metavar="LIST",
        help="Average cosine variants: plain, centred, standardised.",
    ),
    outlier_rule: OutlierRule = typer.Option(
        "variance",
        "--outlier-rule",
        metavar=choice_metavar(choices.OUTLIER_RULES),
        help="Rule that flags outlier dimensions.",
    ),
    outlier_threshold: Optional[float] = typer.Option(
        None,
        "--outlier-threshold",
        metavar="FLOAT",
        help="variance: k x mean variance (5); zscore: z (3); quantile: q (0.99); magnitude: |x| (6).",
    ),
    outlier_stat: OutlierStat = typer.Option(
        "variance",
        "--outlier-stat",
        metavar=choice_metavar(choices.OUTLIER_STATS),
        help="Statistic of the zscore rule.",
    ),
    discard_fraction: float = typer.Option(
        0.1,
        "--discard-fraction",
        min=0.0,
        metavar="FLOAT",
        help="TwoNN: fraction of the largest ratios dropped, in [0, 1).",
    ),
    id_sample: int = typer.Option(
        5000, "--id-sample", min=3, metavar="N", help="Rows per layer sampled for intrinsic dimension."
    ),
    id_estimator: List[str] = typer.Option(
        [], "--id-estimator", metavar="LIST", help="More intrinsic-dimension estimators (comma list)."
    ),
    twonn_fit: TwoNNFit = typer.Option(
        "linear",
        "--twonn-fit",
        metavar=choice_metavar(choices.TWONN_FITS),
        help="TwoNN fit: linear (Facco et al.) or maximum likelihood.",
    ),
    id_repeats: Optional[int] = typer.Option(
        None,
        "--id-repeats",
        min=2,
        metavar="N",
        help="Parts of the ID sample for the decimation SE, each of >= 3 rows: at most --id-sample / 3 "
        "(default: 4, fewer where --id-sample is under 12; below 6 the SE is null).",
    ),
    seed: int = typer.Option(
        0,
        "--seed",
        parser=seed_value,
        metavar="N",
        help=f"Seed of every sample (rows, ID sample, decimation): {SEED_RANGE_HELP}.",
    ),
    exclude_special: bool = typer.Option(
        False, "--exclude-special", help="Drop special tokens (CLS/SEP/BOS...) before measuring."
    ),
    layers: List[str] = layers_option([], STORED_LAYERS_HELP, _complete.run_layers),
    max_rows: Optional[int] = typer.Option(
        None, "--max-rows", min=2, metavar="N", help="Seeded uniform sample of rows per layer."
    ),
    workers: int = typer.Option(
        1,
        "--workers",
        "-w",
        min=1,
        metavar="N",
        help="Processes reading shards (and threads finishing layers) in parallel, at most one per "
        "shard and 1024 in all; BLAS runs single-threaded in each. One process already computes on "
        "every usable core (threads over blocks); more pay where reading or many layers are the "
        "limit. Above the core count the processes share the cores (each holds its own "
        "accumulators): that pays only where reading waits on storage.",
    ),
    scheduler: Optional[str] = typer.Option(
        None,
        "--scheduler",
        metavar="local:N|tcp://HOST:PORT|FILE.json",
        help="Run the shard reading as Dask tasks: local:N starts N single-threaded worker processes "
        "here for the call; tcp://HOST:PORT or a scheduler FILE.json uses a running Dask cluster (its "
        "workers must read the run at the same path). Same report as --workers (merged in shard "
        "order); not combined with --workers. Needs pip install 'geomscope[dask]'.",
    ),
    jackknife_groups: int = typer.Option(
        10,
        "--jackknife-groups",
        min=0,
        metavar="N",
        help="Document groups of the jackknife SE (0 = off; otherwise >= 2).",
    ),
    product_dtype: ProductDtype = typer.Option(
        "float64",
        "--product-dtype",
        metavar=choice_metavar(choices.PRODUCT_DTYPES),
        help="Dtype of the covariance's block products. float32: each block, centred in float64, is "
        "multiplied in float32 and added in float64: ~1.5x faster on 2 cores, ~1e-8 relative error in "
        "the covariance (up to ~1e-7 on small samples) and more in metrics near 0 such as IsoScore "
        "(2e-7 measured; the isoscore package: ~1e-6).",
    ),
    memory_mb: float = typer.Option(
        2048, "--memory-mb", min=1.0, metavar="MIB", help="Memory budget of the per-layer accumulators."
    ),
    partial: bool = typer.Option(False, "--partial", help="Score the finished shards of an incomplete run."),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="Skip the shard checksum check (size is still checked)."
    ),
    out: Optional[str] = typer.Option(
        None,
        "--out",
        "-o",
        metavar="DIR|PREFIX",
        help="Directory (report.json + report.csv) or prefix (PREFIX.json + PREFIX.csv). Default: the run "
        "directory; for an array FILE_report.* next to it. With several runs: a directory for "
        "<run>.json/.csv and trajectory.csv (default: each run's own directory, trajectory.csv beside them).",
    ),
    columns: List[str] = typer.Option(
        [],
        "--columns",
        metavar="LIST",
        help="Metrics in the terminal table: a comma list, or all (default: isoscore_star, isoscore, avgcos, "
        "pr, twonn, which fit 80 columns). The JSON and CSV always hold every metric.",
    ),
    basis: Optional[str] = typer.Option(
        None,
        "--basis",
        metavar="ACTRUN",
        help="With a gradient run (extract --capture gradients): the run of activations of the same "
        "model whose top-r covariance eigenvectors U_r are the subspace; reports, per gradient "
        "layer and rank, the captured energy tr(U'SU)/tr(S) against r/D, its maximum, kappa, "
        "random normal controls and the removal test (report key gradient_energy).",
    ),
    rank: str = typer.Option(
        "8,32,128", "--rank", metavar="LIST", help="Ranks r of the --basis subspaces (each below D)."
    ),
    controls: int = typer.Option(
        20,
        "--controls",
        min=0,
        metavar="K",
        help="Random rank-r subspaces of U_r's complement per rank (seeded by --seed) for --basis.",
    ),
    as_json: bool = json_option("the report"),
    quiet: bool = quiet_option("No progress bar and no table (warnings still shown)."),
) -> None:
    """Score per-layer geometry: IsoScore, IsoScore*, average cosine, spectrum, outlier dimensions,
    intrinsic dimension (with standard errors) and partition isotropy of the embedding matrices."""
    import sys

    from rich.console import Console

    from geomscope.report import (
        check_out_given,
        check_report_out,
        gradient_energy_lines,
        report_table,
        save_report,
        shown,
        to_json,
    )
    from geomscope.score import ScoreOptions, score
    from geomscope.score.engine import check_memory_mb
    from geomscope.score.resources import check_workers

    console = Console(stderr=True)

    def log(msg: str) -> None:  # a warning may name layers or files from the data
        console.print(f"[yellow]warning:[/yellow] {shown(msg)}", highlight=False, markup=True)

    if out is not None:
        check_out_given(out)

    opts = ScoreOptions(
        metrics=tuple(split_list(metrics)),
        zeta=zeta,
        shrinkage_target=shrinkage_target,
        avgcos_variants=tuple(split_list(avgcos_variants)),
        outlier_rule=value(outlier_rule),
        outlier_threshold=outlier_threshold,
        outlier_stat=value(outlier_stat),
        discard_fraction=discard_fraction,
        id_sample=id_sample,
        id_estimator=tuple(split_list(id_estimator)),
        twonn_fit=value(twonn_fit),
        id_repeats=id_repeats,
        seed=seed,
        exclude_special=exclude_special,
        layers=tuple(split_list(layers)) if layers else None,  # given but empty: refused, not "all"
        max_rows=max_rows,
        workers=workers,
        scheduler=scheduler,
        partial=partial,
        jackknife_groups=jackknife_groups,
        memory_mb=memory_mb,
        product_dtype=value(product_dtype),
        verify=not no_verify,
        dataset=dataset,
        columns=tuple(split_list(column)) if column else None,
        basis=basis,
        ranks=_ranks(rank),
        controls=controls,
    ).validate()
    check_workers(opts.workers)  # (the library asks again; here before any source is opened)
    check_memory_mb(opts.memory_mb)
    table_columns = _table_columns(columns, opts)
    from geomscope.score.trajectory import runs_in

    expanded = [str(r) for src in sources for r in (runs_in(src) or [src])]
    if len(expanded) > 1:
        _score_many(expanded, sources, opts, out, as_json, quiet, console, log)
        return
    source = expanded[0]
    dest = out if out is not None else _default_out(source)
    check_report_out(dest)  # before the work: a user's file at that name is refused, never replaced
    report = score(source, opts, progress=not quiet and sys.stderr.isatty(), log=log)
    _record_command(report)
    jpath, cpath = save_report(report, dest)
    if not quiet:
        console.print(report_table(report, table_columns))
        for line in gradient_energy_lines(report):
            console.print(line, highlight=False, markup=False)
        console.print(
            f"wrote {shown(jpath, markup=False)}\nwrote {shown(cpath, markup=False)}",
            highlight=False,
            markup=False,
        )
    if as_json:
        sys.stdout.write(to_json(report) + "\n")
        sys.stdout.flush()


def _table_columns(columns: list[str], opts) -> list[str] | None:
    """--columns checked before the work (it was checked against the report after the whole pass,
    and never with -q): the names must be metrics these options compute. The check is the table's
    own (report.table_metrics) on a report that holds every requested metric; a metric requested
    but null in every layer is still refused after the pass."""
    from geomscope.errors import InputError
    from geomscope.report import table_metrics
    from geomscope.score.layer import scalar_keys

    if not columns:
        return None
    names = split_list(columns)
    if not names:
        raise InputError("--columns is empty; give metric names (comma list) or all, or leave it out")
    table_metrics({"layers": [dict.fromkeys(scalar_keys(opts), 0.0)]}, names)
    return names


def _ranks(spec: str) -> tuple:
    """``--rank 8,32,128`` -> (8, 32, 128); a word that is not a whole number is kept for the
    library's one-line error."""
    return tuple(int(x) if x.strip().isdigit() else x for x in split_list([spec]))


def _record_command(report: dict) -> None:
    if state.get("argv"):
        import shlex

        report["command"] = shlex.join(state["argv"])


def _run_name(run: str) -> str:
    """The name a run goes by among several: its folder's (``.`` and ``..`` resolved). Its report
    in --out is ``<name>.json``, and trajectory.csv's ``revision`` is it where the run has no hub
    revision (trajectory.revision_of)."""
    from pathlib import Path

    p = Path(run)
    return (p.resolve() if p.name in ("", ".", "..") else p).name


def _check_distinct(runs: list[str], dests: list[str], trajectory, *, one_folder: bool) -> None:
    """InputError (one line) unless the runs can be told apart: each given once, distinct folder
    names where the reports go into one folder (``one_folder``: --out DIR/<name>.json would replace
    one report by another; without --out each report lies in its own run), no two reports at one
    path (a link to a run) and none at trajectory.csv. Asked before any run is scored."""
    import os

    from geomscope.errors import InputError
    from geomscope.report import report_paths

    seen: dict[str, int] = {}
    for i, run in enumerate(runs):
        j = seen.setdefault(_run_name(run), i)
        if j == i:
            continue
        if os.path.realpath(runs[j]) == os.path.realpath(run):
            also = "" if runs[j] == run else f" (as {runs[j]} and {run})"
            raise InputError(f"the run {run} is given twice{also}; give each run once")
        if not one_folder:
            continue
        raise InputError(
            f"{runs[j]} and {run} are both named {_run_name(run)!r}: runs scored together need distinct "
            "folder names (their reports in --out and their rows in trajectory.csv go by them); rename "
            "one, or score them separately"
        )
    written: dict[str, str | None] = {os.path.realpath(trajectory): None}  # None: the trajectory's
    for run, dest in zip(runs, dests, strict=True):
        for path in report_paths(dest):
            other = written.setdefault(os.path.realpath(path), run)
            if other is None:
                raise InputError(
                    f"the report of {run} would be {path}, where trajectory.csv goes; rename the run's "
                    "folder, or score it separately"
                )
            if other != run:
                raise InputError(
                    f"{run} and {other} would both be written at {path}; give each run once, or "
                    "score them separately"
                )


def _score_many(
    runs: list[str], sources: list[str], opts, out, as_json: bool, quiet: bool, console, log
) -> None:
    """Score each run with the same options; reports in each run (or --out DIR/<run>.*), then
    trajectory.csv beside the runs (or in --out)."""
    import json
    import os
    import sys
    from pathlib import Path

    from geomscope.fileio import ensure_writable, make_dirs
    from geomscope.report import check_report_out, save_report, shown
    from geomscope.score import score
    from geomscope.score.trajectory import TRAJECTORY_NAME, check_trajectory_out, write_trajectory

    dests = [str(Path(out) / _run_name(run)) if out is not None else _default_out(run) for run in runs]
    if out is not None:
        where = Path(out)
    elif len(sources) == 1:
        where = Path(sources[0])
    else:
        where = Path(os.path.commonpath([str(Path(r).resolve().parent) for r in runs]))
    # before the work: clashing names, a user's file at any of these names (refused, never replaced)
    # and a folder that cannot be written are said now, not after every run was scored
    _check_distinct(runs, dests, where / TRAJECTORY_NAME, one_folder=out is not None)
    for dest in dests:
        check_report_out(dest)
    check_trajectory_out(where / TRAJECTORY_NAME)
    ensure_writable(where)
    reports, written = [], []
    for i, (run, dest) in enumerate(zip(runs, dests, strict=True), 1):
        rep = score(run, opts, progress=not quiet and sys.stderr.isatty(), log=log)
        _record_command(rep)
        jpath, _ = save_report(rep, dest)
        reports.append(rep)
        written.append(str(jpath))
        if not quiet:
            console.print(
                f"[{i}/{len(runs)}] {shown(run, markup=False)}: wrote {shown(jpath, markup=False)}",
                highlight=False,
                markup=False,
            )
    make_dirs(where)
    traj = write_trajectory(reports, where / TRAJECTORY_NAME)
    if not quiet:
        console.print(f"wrote {shown(traj, markup=False)}", highlight=False, markup=False)
    if as_json:
        sys.stdout.write(json.dumps({"reports": written, "trajectory": str(traj)}) + "\n")
