"""What a run directory holds, as one JSON-able dict (``geomscope inspect``); optional integrity check."""

from __future__ import annotations

import os
from dataclasses import replace
from fnmatch import fnmatchcase
from pathlib import Path

from geomscope.errors import DataError
from geomscope.store import remote
from geomscope.store.integrity import coverage, manifest_problems, verify_shard_task
from geomscope.store.manifest import being_written, damaged, short
from geomscope.store.names import MANIFEST_NAME, PART_RE
from geomscope.store.options import InspectOptions
from geomscope.store.reader import Run

OPTION_KEYS = (
    "store_dtype",
    "max_docs",
    "max_tokens",
    "max_length",
    "truncation",
    "text_field",
    "text_column",
    "shard_docs",
    "sample_seed",
)

#: identity.model's fields that the description shows, in its order
MODEL_KEYS = (
    "name",
    "revision",
    "commit",
    "model_type",
    "architecture",
    "hidden_size",
    "num_hidden_states",
    "stack",
    "attention",
    "dtype",
)


def describe_run(run_dir: Path | str, options: InspectOptions | None = None, **overrides) -> dict:
    """Summarise a run: model, layers, rows, documents, shards, dtype, size on disk, completeness.

    ``run_dir``: a path, or an fsspec URL (read through fsspec; ``in_progress`` is then only known
    for a ``file://`` URL -- the writer's lock is a local file lock -- and is False elsewhere).
    ``options``: an :class:`~geomscope.store.options.InspectOptions`; keyword ``overrides`` replace
    its fields (``describe_run(run, verify=True)``).

    ``verify=True`` also checks every finished shard's size and checksum against the manifest; the
    result's ``verify.bad`` lists the shards that fail (the caller decides whether that is an error).
    """
    opts = replace(options or InspectOptions(), **overrides).validate()
    run = Run(run_dir)
    m = run.manifest
    ident = run.identity
    model = ident.get("model", {}) if isinstance(ident.get("model"), dict) else {}
    why = _field_problem(ident, model)
    if why:
        raise damaged(remote.join(run.dir, MANIFEST_NAME), why)
    shards = run.shards
    nonfinite_by_layer = _nonfinite_by_layer(m)
    listed = {s.file for s in shards}
    names = remote.listdir(run.dir)
    on_disk = [n for n in names if fnmatchcase(n, "shard-*.h5")]
    size = _bytes_on_disk(run.dir, names, on_disk)
    layer_fields = _layer_fields(run.layers)
    out = {
        "run_dir": str(run.dir),
        "complete": run.complete,
        "format_version": m.get("format_version"),
        "created": m.get("created"),
        "finished": m.get("finished"),
        "model": {k: model.get(k) for k in MODEL_KEYS},
        **layer_fields,
        "store_dtype": ident.get("store_dtype"),
        "dim": run.dim,
        **_other_widths(run),
        "rows": sum(s.n_tokens for s in shards),
        "keep": ident.get("keep", "all"),
        "capture": ident.get("capture", "activations"),
        "loss": ident.get("loss"),
        "rows_stored": sum(s.rows for s in shards),
        "docs": sum(s.docs for s in shards),
        "shards": len(shards),
        "planned_shards": m.get("planned_shards"),
        "bytes_on_disk": size,
        "nonfinite_rows": sum(s.nonfinite_rows for s in shards),
        "nonfinite_by_layer": nonfinite_by_layer,
        "docs_empty": (m.get("totals") or {}).get("docs_empty"),
        "inputs": ident.get("inputs", []),
        "options": {k: ident.get(k) for k in OPTION_KEYS if k in ident},
        "unlisted_shard_files": [f for f in on_disk if f not in listed],
        "interrupted_shard_files": [n for n in names if fnmatchcase(n, ".shard-*.tmp")],
    }
    local = remote.local_path(run.dir)
    out["in_progress"] = being_written(local) if local is not None else False
    if opts.verify:
        out["verify"] = _verify(run, shards)
    return out


def _layer_fields(layers: list[dict]) -> dict:
    """The description's fields of the run's stored layers: names, indices in the model, the one
    after the final norm (None if none) and the tensors named per layer."""
    final = [la["name"] for la in layers if la.get("final_norm")]
    return {
        "layers": [la["name"] for la in layers],
        "layer_indices": [la.get("index") for la in layers],
        "final_norm_layer": final[0] if final else None,
        "layer_tensors": {la["name"]: la.get("tensor") for la in layers if la.get("tensor")},
    }


def _other_widths(run: Run) -> dict:
    """``{"layer_dims": {layer: width}}`` of the layers not :attr:`Run.dim` wide (a run of
    ``extract --modules`` that stores grouped-query keys or MLP intermediates), ``{}`` for a run
    whose layers are all D wide."""
    other = {n: d for n, d in run.layer_dims.items() if d != run.dim}
    return {"layer_dims": other} if other else {}


def _nonfinite_by_layer(manifest: dict) -> dict[str, int]:
    """The rows with NaN/Inf per layer, summed over the shards' entries (layers without any absent)."""
    by_layer: dict[str, int] = {}
    for st in [s.get("stats", {}) for s in manifest.get("shards", [])]:
        for k, v in (st.get("nonfinite_by_layer") or {}).items():
            by_layer[k] = by_layer.get(k, 0) + int(v)
    return by_layer


def _bytes_on_disk(run_dir, names: list[str], shard_files: list[str]) -> int:
    """The bytes of the run's files among ``names`` (its directory's listing): the shard files
    ``shard_files``, the manifest and the shard logs."""
    size = sum(_entry_bytes(remote.join(run_dir, f)) for f in shard_files)
    size += _entry_bytes(remote.join(run_dir, MANIFEST_NAME))
    size += sum(_entry_bytes(remote.join(run_dir, n)) for n in names if PART_RE.fullmatch(n))  # shard logs
    return size


def _entry_bytes(loc) -> int:
    """The bytes of one entry of the run directory: a local one as it is (``lstat``: a link counts
    as the link, never followed -- one that loops or leads out of the run is a shard that --verify
    refuses, not a size to read; 0 where the entry went away since the listing), a URL's as its
    filesystem says."""
    local = remote.local_path(loc)
    if local is None:
        return remote.size(loc)
    try:
        return os.lstat(local).st_size
    except FileNotFoundError:
        return 0


#: identity.model's fields that the description shows as text (None: not recorded)
MODEL_TEXT_FIELDS = (
    "name",
    "revision",
    "commit",
    "model_type",
    "architecture",
    "stack",
    "attention",
    "dtype",
)


def _field_problem(ident: dict, model: dict) -> str | None:
    """What in the fields the description shows has a type geomscope never writes (a hand-edited
    manifest: a commit of 12345, inputs of "abc", keep of 5), which made `inspect` a traceback;
    read_manifest checks what reading the shards needs, this what describing the run does."""

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for key in MODEL_TEXT_FIELDS:
        v = model.get(key)
        if v is not None and not isinstance(v, str):
            return f"identity.model.{key} is {short(v)}, not a string"
    v = model.get("num_hidden_states")
    if v is not None and not (is_int(v) and v >= 0):
        return f"identity.model.num_hidden_states is {short(v)}, not a non-negative integer"
    inputs = ident.get("inputs", [])
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        return f"identity.inputs is {short(inputs)}, not a list of objects"
    for key, kind, what in (
        ("keep", str, "a string"),
        ("capture", str, "a string"),
        ("store_dtype", str, "a string"),
        ("loss", dict, "an object"),
    ):
        v = ident.get(key)
        if v is not None and not isinstance(v, kind):
            return f"identity.{key} is {short(v)}, not {what}"
    for i, layer in enumerate(ident.get("layers") or []):  # read_manifest checked they are named objects
        if layer.get("tensor") is not None and not isinstance(layer["tensor"], str):
            return f"identity.layers[{i}].tensor is {short(layer['tensor'])}, not a string"
    return None


def _verify(run: Run, shards) -> dict:
    """Every shard held to what a read holds it to (integrity.verify_shard_task: size, checksum,
    structure, documents, flags, a sample's accumulators, size and seed), its documents against its
    entry, and the manifest's totals against the entries (an edited total is caught, not trusted)."""
    bad = []
    in_order = sorted(shards, key=lambda s: s.index)  # as run.shard_tasks orders them
    for s, task in zip(in_order, run.shard_tasks(run.dim or 0), strict=True):
        try:
            docs = verify_shard_task(task, run.layer_names)
            if s.n_tokens != s.rows:  # a --keep sample shard stores a sample of the documents' rows
                docs = s.docs
            if docs != s.docs:
                raise DataError(
                    f"shard {s.file} stores {s.rows} rows of {docs} documents; the manifest says "
                    f"{s.rows} rows of {s.docs}"
                )
        except DataError as e:
            bad.append({"file": s.file, "error": str(e)})
    problems = manifest_problems(run)
    return {
        "checked": len(shards),
        "bad": bad,  # damaged shards: redone by deleting them and rerunning extract
        "manifest": problems,  # a manifest that disagrees with itself: no shard to delete
        "ok": not bad and not problems,
        "documents": coverage(shards, run.complete),
    }
