"""The same layer across runs (``score DIR --metrics similarity`` on the revisions of a model, or
several runs): linear CKA and RSA between every pair of runs, per layer, written as
``similarity.json`` beside ``trajectory.csv``.

Each run's seeded sample holds the rows with the smallest ``hash(doc_id, position; seed)``, so runs
extracted from the same text hold the same (document, position) rows: the rows every run kept, in
hash order, cut to ``--similarity-rows``, are the same inputs in every run. Each layer present in
every run is compared across the runs with geomscope.metrics.similarity (the jackknife over the
rows' document groups as within a run). The samples are read in one pass per run that keeps
nothing else (engine.layer_samples), layers batched so that every run's samples of a batch fit in
``--memory-mb``.

``similarity.json``: ``{format: "geomscope-similarity", format_version, runs [paths], names,
revisions, layers {layer: {rows, groups, cka, cka_se, rsa, rsa_se} | null}, notes {layer: why},
sample, geomscope_version}``; the matrices R x R in the order of ``runs``.
"""

from __future__ import annotations

from pathlib import Path

from geomscope.errors import DataError
from geomscope.schema import SIMILARITY_FORMAT, SIMILARITY_FORMAT_VERSION
from geomscope.score.options import ScoreOptions

SIMILARITY_NAME = "similarity.json"


def _common_layers(runs: list[str], opts: ScoreOptions) -> list[str]:
    """The layers (of ``--layers``) that every run holds, in the first run's order."""
    from geomscope.store.reader import Run

    names = None
    for run in runs:
        r = Run(run)
        picked = r.resolve_layers(list(opts.layers) if opts.layers else None)
        names = picked if names is None else [n for n in names if n in set(picked)]
    return names or []


def _batches(layers: list[str], runs: int, opts: ScoreOptions, width: int) -> list[list[str]]:
    """Layers in batches whose samples (every run's, float32 at most) fit in ``--memory-mb``."""
    per_layer = runs * opts.similarity_rows * max(1, width) * 4
    size = max(1, int(opts.memory_mb * 2**20) // max(1, per_layer))
    return [layers[i : i + size] for i in range(0, len(layers), size)]


def _revision(run: str) -> str:
    from geomscope.store.reader import Run

    model = Run(run).identity.get("model") or {}
    return str(model.get("revision") or Path(run).name)


def revision_similarity(runs: list, options: ScoreOptions | None = None) -> dict:
    """Linear CKA and RSA between every pair of ``runs`` (two or more run directories), per layer."""
    from geomscope import __version__
    from geomscope.score.engine import layer_samples
    from geomscope.score.similarity import aligned, jackknife_matrices
    from geomscope.store.reader import Run

    opts = (options or ScoreOptions()).validate()
    runs = [str(r) for r in runs]
    layers = _common_layers(runs, opts)
    width = max((Run(r).dim or 1) for r in runs)
    out_layers, notes = {}, {}
    for batch in _batches(layers, len(runs), opts, width):
        samples = [layer_samples(run, opts, rows=opts.similarity_rows, layers=batch) for run in runs]
        for name in batch:
            per_run = {str(i): s[name] for i, s in enumerate(samples)}
            if any(v is None for v in per_run.values()):
                out_layers[name], notes[name] = None, "a run has no sample rows of this layer"
                continue
            keys = list(per_run)
            rows, groups = aligned(per_run, keys, opts.similarity_rows)
            try:
                out_layers[name] = jackknife_matrices(rows, groups, opts)
            except DataError as e:
                out_layers[name], notes[name] = None, str(e)
    return {
        "format": SIMILARITY_FORMAT,
        "format_version": SIMILARITY_FORMAT_VERSION,
        "geomscope_version": __version__,
        "runs": runs,
        "names": [Path(r).name for r in runs],
        "revisions": [_revision(r) for r in runs],
        "layers": out_layers,
        "notes": notes,
        "sample": (
            f"the first {opts.similarity_rows} rows by hash(doc_id, position; seed {opts.seed}) that "
            "every run kept: the same inputs in every run"
        ),
    }


def write_similarity(result: dict, path) -> Path:
    """Write ``result`` as JSON at ``path`` (atomically; a file there is replaced only if it is one)."""
    import json

    from geomscope.fileio import write_text_atomic

    check_similarity_out(path)
    write_text_atomic(Path(path), json.dumps(result, indent=1, allow_nan=False) + "\n")
    return Path(path)


def check_similarity_out(path) -> None:
    """InputError (one line) unless ``path`` is free or holds an earlier similarity.json."""
    from geomscope.outputs import HEAD_BYTES, ensure_replaceable, json_format_is

    ensure_replaceable(Path(path), json_format_is(SIMILARITY_FORMAT), head=HEAD_BYTES)
