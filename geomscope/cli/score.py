"""``geomscope score``: per-layer geometry of a run directory or an (N, D) array -> JSON + CSV report.

Thin wrapper over :func:`geomscope.score.score` and :mod:`geomscope.report`; numpy, h5py and the
metrics are imported only inside the command. Each option of :class:`~geomscope.score.ScoreOptions`
is built from its declaration (:mod:`geomscope.options`) and checked by the library; the options
that only the command has (where the report goes, what the terminal shows) are declared here.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from geomscope.cli import _complete
from geomscope.cli._app import app, state
from geomscope.cli._options import (
    json_option,
    options_from,
    out_option,
    quiet_option,
    selection,
)
from geomscope.options import comma_items
from geomscope.score.options import ScoreOptions

SOURCES_HELP = (
    "A run directory written by `geomscope extract`; an (N, D) array (.npy, .h5); or one "
    "(N, D) array per layer: .npz, .safetensors, .pt (tensors only), .arrow, .parquet, or a "
    "directory of them (datasets.save_to_disk, SAELens activation cache). Several runs, a "
    "directory of runs (extract --revisions), or a directory of such directories (one per model) "
    "are scored one by one and tabled in trajectory.csv."
)
OUT_HELP = (
    "Directory (report.json + report.csv) or prefix (PREFIX.json + PREFIX.csv). Default: the run "
    "directory; for an array FILE_report.* next to it. With several runs: a directory for "
    "<run>.json/.csv and trajectory.csv (default: each run's own directory, trajectory.csv beside them)."
)
COLUMNS_HELP = (
    "Metrics in the terminal table: a comma list, or all (default: isoscore_star, isoscore, avgcos, "
    "pr, twonn, which fit 80 columns). The JSON and CSV always hold every metric."
)


def _default_out(source: str) -> str:
    import os

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
@options_from(
    ScoreOptions,
    complete={"metrics": _complete.score_metrics, "layers": _complete.run_layers},
    repeated=("columns", "metrics", "avgcos_variants", "id_estimator", "layers"),
)
def score_cmd(
    sources: List[str] = typer.Argument(..., metavar="SOURCE", help=SOURCES_HELP),
    out: Optional[str] = out_option("DIR|PREFIX", OUT_HELP, required=False),
    table_columns: List[str] = typer.Option([], "--columns", metavar="LIST", help=COLUMNS_HELP),
    as_json: bool = json_option("the report"),
    quiet: bool = quiet_option("No progress bar and no table (warnings still shown)."),
    **chosen,
) -> None:
    """Score per-layer geometry: IsoScore, IsoScore*, average cosine, spectrum, outlier dimensions,
    intrinsic dimension (with standard errors) and partition isotropy of the embedding matrices."""
    # left out: every layer (array); given but empty: refused by the library; --layers is one
    # comma list (its grammar refuses an empty item) however often it is given
    layers = selection(chosen["layers"])  # (--layers "" is given: refused, not all)
    chosen.update(layers=layers, columns=chosen["columns"] or None)
    _score_sources(sources, chosen, out, table_columns, as_json, quiet)


def _score_sources(sources: list[str], chosen: dict, out, table_columns, as_json: bool, quiet: bool) -> None:
    """Check what can be checked before the work (--out, the options, --columns, the report's
    path), then score one source, or each run of several (:func:`_score_many`)."""
    import sys

    from rich.console import Console

    from geomscope.progress import command_output
    from geomscope.report import check_out_given, check_report_out, save_report, to_json
    from geomscope.score import score
    from geomscope.score.trajectory import runs_under

    console = Console(stderr=True)
    progress, log = command_output(quiet, warns=True, prefix="warning:")
    if out is not None:
        check_out_given(out)
    opts = ScoreOptions(**chosen).validate()
    shown_columns = _table_columns(table_columns, opts)
    expanded = [str(r) for src in sources for r in (runs_under(src) or [src])]
    if len(expanded) > 1:
        _score_many(expanded, sources, opts, out, as_json, quiet, console, progress, log)
        return
    source = expanded[0]
    dest = out if out is not None else _default_out(source)
    check_report_out(dest)  # before the work: a user's file at that name is refused, never replaced
    report = score(source, opts, progress=progress, log=log)
    _record_command(report)
    jpath, cpath = save_report(report, dest)
    if not quiet:
        _print_report(console, report, shown_columns, jpath, cpath)
    if as_json:
        sys.stdout.write(to_json(report) + "\n")
        sys.stdout.flush()


def _print_report(console, report: dict, columns, jpath, cpath) -> None:
    """The table, the gradient-energy lines and the paths written, on stderr."""
    from geomscope.formatting import shown
    from geomscope.report import gradient_energy_lines, report_table

    console.print(report_table(report, columns))
    for line in gradient_energy_lines(report):
        console.print(line, highlight=False, markup=False)
    console.print(
        f"wrote {shown(jpath, markup=False)}\nwrote {shown(cpath, markup=False)}",
        highlight=False,
        markup=False,
    )


def _table_columns(columns: list[str], opts) -> list[str] | None:
    """--columns checked before the work (so that a typo costs no pass, with or without -q): the
    names must be metrics these options compute. The check is the table's
    own (report.table_metrics) on a report that holds every requested metric; a metric requested
    but null in every layer is still refused after the pass."""
    from geomscope.errors import InputError
    from geomscope.report import table_metrics
    from geomscope.score.layer import scalar_keys

    if not columns:
        return None
    names = comma_items(columns)
    if not names:
        raise InputError("--columns is empty; give metric names (comma list) or all, or leave it out")
    table_metrics({"layers": [dict.fromkeys(scalar_keys(opts), 0.0)]}, names)
    return names


def _record_command(report: dict) -> None:
    if state.get("argv"):
        import shlex

        report["command"] = shlex.join(state["argv"])


def _run_name(run: str) -> str:
    """The name a run goes by among several: its folder's (``.`` and ``..`` resolved). Its report
    in --out is ``<name>.json``, and trajectory.csv's ``revision`` is it where the run has no hub
    revision (trajectory.revision_of)."""

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


def _check_pairs(runs: list[str], basis: str | None) -> None:
    """With --basis a directory of runs, every run's partner there, before any run is scored: one
    that has none, or two, is said now (gradenergy.paired_run), not after the runs before it."""

    from geomscope.score.gradenergy import paired_run
    from geomscope.score.trajectory import runs_under
    from geomscope.store.manifest import MANIFEST_NAME, read_manifest

    if basis is None or not runs_under(basis):
        return
    for run in runs:
        manifest = Path(run) / MANIFEST_NAME
        if manifest.exists():  # (a run that is not one is refused as score opens it)
            paired_run(run, read_manifest(manifest)["identity"].get("model") or {}, basis)


def _many_destinations(runs: list[str], sources: list[str], out) -> tuple[list[str], Path]:
    """(each run's report path, the folder of trajectory.csv): ``--out DIR/<run>`` or each run's own
    folder; the trajectory in ``--out``, the one source folder given, or the runs' common parent."""
    import os

    dests = [str(Path(out) / _run_name(run)) if out is not None else _default_out(run) for run in runs]
    if out is not None:
        return dests, Path(out)
    if len(sources) == 1:
        return dests, Path(sources[0])
    return dests, Path(os.path.commonpath([str(Path(r).resolve().parent) for r in runs]))


def _score_many(
    runs: list[str], sources: list[str], opts, out, as_json: bool, quiet: bool, console, progress, log
) -> None:
    """Score each run with the same options; reports in each run (or --out DIR/<run>.*), then
    trajectory.csv beside the runs (or in --out)."""
    import json
    import sys

    from geomscope.fileio import ensure_writable, make_dirs
    from geomscope.formatting import shown
    from geomscope.report import check_report_out, save_report
    from geomscope.score import score
    from geomscope.score.trajectory import TRAJECTORY_NAME, check_trajectory_out, write_trajectory

    dests, where = _many_destinations(runs, sources, out)
    # before the work: clashing names, a user's file at any of these names (refused, never replaced)
    # and a folder that cannot be written are said now, not after every run was scored
    _check_distinct(runs, dests, where / TRAJECTORY_NAME, one_folder=out is not None)
    for dest in dests:
        check_report_out(dest)
    check_trajectory_out(where / TRAJECTORY_NAME)
    across = opts.wants("similarity") and len(runs) > 1
    if across:
        from geomscope.score.crossrun import SIMILARITY_NAME, check_similarity_out

        check_similarity_out(where / SIMILARITY_NAME)
    _check_pairs(runs, opts.basis)
    ensure_writable(where)
    reports, written = [], []
    for i, (run, dest) in enumerate(zip(runs, dests, strict=True), 1):
        rep = score(run, opts, progress=progress, log=log)
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
    summary = {"reports": written, "trajectory": str(traj)}
    if not quiet:
        console.print(f"wrote {shown(traj, markup=False)}", highlight=False, markup=False)
    if across:  # each layer across the runs (score/crossrun.py)
        from geomscope.score.crossrun import revision_similarity, write_similarity

        path = write_similarity(revision_similarity(runs, opts), where / SIMILARITY_NAME)
        summary["similarity"] = str(path)
        if not quiet:
            console.print(f"wrote {shown(path, markup=False)}", highlight=False, markup=False)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
