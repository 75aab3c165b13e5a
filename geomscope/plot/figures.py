"""Choosing figure kinds, building them and writing them: what ``geomscope plot`` runs.

Kinds: ``layers`` (metric against layer), ``spectrum`` (eigenspectra), ``outliers`` (outlier
dimension heat map), ``trajectory`` (metric against training step), ``training`` (training logs,
drawn by :mod:`geomscope.plot.training`), ``energy`` (gradient energy in the activation subspace,
from ``score GRADRUN --basis ACTRUN``).  ``auto`` picks: for one output file the main kind
(``trajectory`` for >= 2 checkpoints of each model, ``energy`` when every report has a
``gradient_energy`` section, else ``layers``; ``training`` for training logs); for an output
directory every kind the inputs support (``energy`` for the reports that have the section). The
diagnostics' ``similarity`` (linear CKA and RSA between layers, from ``score --metrics similarity``)
is drawn when named, and by ``auto`` for a directory when every report has the section;
``diagnostics`` (each diagnostic family's metrics against layer) when named, and by ``auto`` for a
directory when a report holds some.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from matplotlib.figure import Figure

from geomscope.choices import FIGURE_FORMATS, PLOT_KINDS
from geomscope.errors import InputError
from geomscope.fileio import make_dirs, write_bytes_atomic
from geomscope.outputs import ensure_replaceable
from geomscope.plot._reports import check_common_layers, read_report, select_layers
from geomscope.plot.diagnostics import has_diagnostics, plot_diagnostics
from geomscope.plot.energy import has_energy, plot_energy
from geomscope.plot.layers import plot_layers
from geomscope.plot.options import DEFAULT_DPI, DEFAULT_FORMAT, DEFAULT_TOP_K, PlotOptions
from geomscope.plot.outliers import has_outlier_statistic, plot_outliers
from geomscope.plot.similarity import (
    has_similarity,
    is_similarity_file,
    plot_run_similarity,
    plot_similarity,
    read_similarity,
)
from geomscope.plot.spectrum import has_spectrum, plot_spectrum
from geomscope.plot.trajectory import is_trajectory, plot_trajectory
from geomscope.schema import FIGURE_CREATOR

#: the figure kinds a name picks (``auto`` picks among them)
KINDS = tuple(k for k in PLOT_KINDS if k != "auto")


def auto_kinds(reports: Sequence[dict], single: bool) -> list[str]:
    """The kinds ``auto`` means for these reports: one main kind, or every supported kind."""
    traj = is_trajectory(reports)
    if single:
        if reports and all(has_energy(r) for r in reports):
            return ["energy"]
        return ["trajectory" if traj else "layers"]
    kinds = ["layers"]
    if all(has_spectrum(r) for r in reports):
        kinds.append("spectrum")
    if all(has_outlier_statistic(r) for r in reports):
        kinds.append("outliers")
    if traj:
        kinds.append("trajectory")
    if any(has_energy(r) for r in reports):
        kinds.append("energy")
    if reports and all(has_similarity(r) for r in reports):
        kinds.append("similarity")
    if any(has_diagnostics(r) for r in reports):
        kinds.append("diagnostics")
    return kinds


def resolve_kinds(reports: Sequence[dict], kinds: Sequence[str], single: bool) -> list[str]:
    """Expand ``auto`` and check the names; at most one kind for a single output file."""
    wanted: list[str] = []
    for k in kinds or ["auto"]:
        if k not in PLOT_KINDS:
            raise InputError(f"unknown figure kind '{k}'; choose from {', '.join(PLOT_KINDS)}")
        if k == "training":
            raise InputError(
                "--kind training needs training logs (a finetune output directory or its "
                "steps.jsonl), not score reports"
            )
        for kk in auto_kinds(reports, single) if k == "auto" else [k]:
            if kk not in wanted:
                wanted.append(kk)
    if single and len(wanted) > 1:
        raise InputError(
            f"--out FILE takes one figure kind, got {', '.join(wanted)}; "
            "give a directory (ending in /) to write one file per kind"
        )
    return wanted


def make_figures(
    reports: Sequence[dict],
    kinds: Sequence[str] = ("auto",),
    *,
    single: bool = False,
    metrics: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    log_x: bool | None = None,
    normalise: bool = False,
    top_k: int | None = DEFAULT_TOP_K,
) -> dict[str, Figure]:
    """Build the figures of the requested kinds for loaded reports, ``{kind: Figure}`` in order.

    All figures are built before any is returned, so bad input fails before anything is written.
    """
    if not reports:
        raise InputError("no reports given; pass one or more report JSON files from `geomscope score`")
    select_layers(reports, layers)  # names an unknown layer before anything is drawn
    check_common_layers(reports)
    figs: dict[str, Figure] = {}
    for kind in resolve_kinds(reports, kinds, single):
        if kind == "energy":
            # named: every report must have the section; from auto: the reports that have it
            chosen = reports if "energy" in kinds else [r for r in reports if has_energy(r, layers)]
            if chosen:
                figs[kind] = plot_energy(chosen, layers=layers)
        elif kind == "layers":
            figs[kind] = plot_layers(reports, metrics, layers=layers)
        elif kind == "similarity":
            figs[kind] = plot_similarity(reports, layers=layers)
        elif kind == "diagnostics":
            chosen = reports if "diagnostics" in kinds else [r for r in reports if has_diagnostics(r)]
            figs[kind] = plot_diagnostics(chosen, layers=layers)
        elif kind == "spectrum":
            figs[kind] = plot_spectrum(reports, layers=layers, normalise=normalise)
        elif kind == "outliers":
            figs[kind] = plot_outliers(reports, layers=layers, top_k=top_k)
        else:
            figs[kind] = plot_trajectory(reports, metrics, layers=layers, log_x=log_x)
    return figs


_CREATOR_KEY = {"png": "Software", "svg": "Creator", "pdf": "Creator"}


#: a figure without its recorded creator cannot be told from a user's, even one an older geomscope
#: wrote: the refusal says so
FIGURE_HINT = " (or a figure of an older geomscope, which did not mark its figures)"


def is_figure(data: bytes) -> bool:
    """Whether a file's bytes are a figure geomscope wrote (its recorded creator)."""
    return FIGURE_CREATOR.encode() in data


def save_figure(fig: Figure, path: str | os.PathLike, *, dpi: int = DEFAULT_DPI) -> Path:
    """Write ``fig`` to ``path`` (format from the extension) atomically: a temporary file in the same
    directory, renamed over the target only once complete.  Closes the figure afterwards. A file
    already at ``path`` is replaced only if it is a figure geomscope wrote."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        raise InputError(f"unsupported extension '{path.suffix}' for {path}; use .png, .svg or .pdf")
    buf = io.BytesIO()
    try:
        ensure_replaceable(path, is_figure, hint=FIGURE_HINT)
        fig.savefig(buf, format=fmt, dpi=dpi, metadata={_CREATOR_KEY[fmt]: FIGURE_CREATOR})
        write_bytes_atomic(path, buf.getvalue())
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}; check the --out location") from None
    finally:
        close_figure(fig)
    return path


def close_figure(fig: Figure) -> None:
    """Release a figure; also drops it from pyplot's registry if it was made through pyplot."""
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close(fig)


def looks_like_training_log(path: str | os.PathLike) -> bool:
    """A finetune output directory or its ``steps.jsonl``."""
    from geomscope.plot import training

    return bool(training.is_training_log(path))


def _out_paths(out: str | os.PathLike, fmt: str | None) -> tuple[bool, Path, str]:
    """(directory mode?, path, format) for ``--out``."""
    s = os.fspath(out)
    if s.endswith(("/", os.sep)) or Path(s).is_dir():
        return True, Path(s), fmt or DEFAULT_FORMAT
    suffix = Path(s).suffix.lower().lstrip(".")
    if suffix not in FIGURE_FORMATS:
        raise InputError(
            f"unsupported extension '{Path(s).suffix}' for --out {s}; use .png, .svg or .pdf, "
            "or a directory ending in /"
        )
    if fmt is not None and fmt != suffix:
        raise InputError(f"--format {fmt} contradicts --out {s}; drop one of them")
    return False, Path(s), suffix


def plot_files(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    options: PlotOptions | None = None,
    **overrides,
) -> list[dict]:
    """Read reports (or training logs), draw the requested kinds and write them.

    ``out`` is a file (``.png``/``.svg``/``.pdf``: one kind) or a directory (ends in ``/`` or
    exists: one ``<kind>.<fmt>`` per kind, created if missing). ``options``: a
    :class:`~geomscope.plot.options.PlotOptions`; keyword ``overrides`` replace its fields
    (``plot_files([r], "f.png", dpi=40)``). Returns ``[{"kind", "path"}]``.
    """
    opts = replace(options or PlotOptions(), **overrides).validate()
    if not inputs:
        raise InputError("no inputs given; pass report JSON files from `geomscope score`")
    to_dir, out_path, fmt = _out_paths(out, opts.fmt)
    for p in inputs:
        if not os.path.exists(p):
            raise InputError(f"input not found: {p}")
    logs = [looks_like_training_log(p) for p in inputs]
    similar = [is_similarity_file(p) for p in inputs]
    if any(logs):
        figs = _training_figures(inputs, logs, opts.kinds)
    elif any(similar):
        figs = _run_similarity_figures(inputs, similar, opts)
    else:
        reports = []
        for p in inputs:
            if str(p).lower().endswith(".csv"):  # trajectory.csv of `score DIR`: one report per revision
                from geomscope.score.trajectory import read_trajectory

                reports += read_trajectory(p)
            else:
                reports.append(read_report(p))
        figs = make_figures(
            reports,
            opts.kinds,
            single=not to_dir,
            metrics=opts.metrics,
            layers=opts.layers,
            log_x=opts.log_x,
            normalise=opts.normalise,
            top_k=opts.top_k,
        )
    make_dirs(out_path if to_dir else out_path.parent)
    targets = {kind: out_path / f"{kind}.{fmt}" if to_dir else out_path for kind in figs}
    written = []
    try:
        for target in targets.values():  # every one before the first is written
            ensure_replaceable(target, is_figure, hint=FIGURE_HINT)
        for kind in list(figs):
            written.append(
                {"kind": kind, "path": str(save_figure(figs.pop(kind), targets[kind], dpi=opts.dpi))}
            )
    finally:  # a refusal or a failed write: the figures not written are closed too
        for fig in figs.values():
            close_figure(fig)
    return written


def _run_similarity_figures(inputs, similar, opts: PlotOptions) -> dict[str, Figure]:
    """The ``similarity`` figure of ``similarity.json`` files (each layer across runs), drawn alone."""
    if not all(similar):
        first = next(p for p, s in zip(inputs, similar, strict=True) if not s)
        raise InputError(f"{first} is not a similarity.json; plot similarity.json files on their own")
    if any(k not in ("auto", "similarity") for k in opts.kinds):
        raise InputError("a similarity.json draws --kind similarity only")
    return {"similarity": plot_run_similarity([read_similarity(p) for p in inputs], layers=opts.layers)}


def _training_figures(inputs, logs, kinds) -> dict[str, Figure]:
    if not all(logs):
        first = next(p for p, is_log in zip(inputs, logs, strict=True) if not is_log)
        raise InputError(
            f"cannot mix training logs and score reports in one plot ({first} is not a training "
            "log); plot them separately"
        )
    bad = [k for k in kinds if k not in ("auto", "training")]
    if bad:
        raise InputError(f"--kind {bad[0]} needs score reports; training logs take --kind training (or auto)")
    from geomscope.plot import training

    # out=None: the figure comes back and is written here, atomically, like every other kind
    return {"training": training.plot_training_log([str(p) for p in inputs], None)}
