"""``extract()``: a checkpoint over texts -> a resumable run directory of HDF5 shards.

Shard ``k`` holds documents ``k*shard_docs .. (k+1)*shard_docs - 1`` of the non-empty documents in
input order (after ``max_docs``), so the plan depends only on the inputs and options: a rerun of the
same command skips the shards the manifest lists as finished and redoes the rest, and the result
equals an uninterrupted run.  Within a shard, documents are processed and stored by descending
length (ties by doc id), in batches cut by a token budget; each batch is moved to the CPU and
appended to the shard while the next one runs (extract/storing.py: one store thread appends, one
publisher thread publishes the finished shards, each in order), and this process's next shard's
documents are tokenized meanwhile, so memory is bounded by two shards' token ids (and, with
``world`` processes, ``world + 1`` shards' texts) and two batches' activations, whatever the size
of the input.

``max_tokens`` caps the number of rows: documents are taken in input order and the one that reaches
the cap is cut to the tokens that remain (its first positions are kept).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path

from geomscope.errors import DataError, InputError
from geomscope.extract.batching import Doc, length_order, plan_batches, tokenize
from geomscope.extract.capture import HeapTrim
from geomscope.extract.layers import LAYER_NOTE, describe_layers
from geomscope.extract.options import ExtractOptions
from geomscope.extract.plan import Scan, bytes_per_row, check_disk, estimate_tokens, human_bytes, scan_inputs
from geomscope.extract.sources import (
    check_out_outside_inputs,
    close_inputs,
    hash_input,
    iter_all,
    open_inputs,
    uses_column,
    uses_field,
)
from geomscope.extract.storing import StoreThread
from geomscope.formatting import counted
from geomscope.layers import FINAL_NORM_LAYER, gradient_name, model_layers, names_layer, select_layers
from geomscope.progress import Progress
from geomscope.provenance import package_versions

ROW_ORDER = (
    "shard k = non-empty documents k*shard_docs .. (k+1)*shard_docs-1 in input order; within a shard, "
    "documents by descending token length (ties by doc_id), positions ascending"
)


def _lookahead(items, depth: int = 1):
    """``(item, the item depth places later or None)`` for each item: ``depth`` items are read ahead
    (a process of ``world`` writes every world-th shard: its next one is ``world`` places on)."""
    window = deque()
    for item in items:
        window.append(item)
        if len(window) > depth:
            yield window.popleft(), item
    while window:
        yield window.popleft(), None


def _no_lookahead(groups):
    """``(item, None)`` for each ``(k, group)``: nothing read ahead."""
    return ((item, None) for item in enumerate(groups))


def _groups(inputs, text_field, text_column, shard_docs, max_docs, counts, labels=None):
    """``(items, labels)``: consecutive runs of ``shard_docs`` non-empty documents as ``(doc_id, text)``,
    and (with a ``labels`` iterator over the same records) ``{doc_id: raw label}``."""
    group: list[tuple[int, str]] = []
    group_labels: dict[int, object] = {}
    n = 0
    for doc_id, text in iter_all(inputs, text_field=text_field, text_column=text_column):
        label = next(labels, None) if labels is not None else None
        counts["records"] += 1
        if not text.strip():
            counts["docs_empty"] += 1
            continue
        group.append((doc_id, text))
        group_labels[doc_id] = label
        n += 1
        if len(group) == shard_docs:
            yield group, group_labels
            group, group_labels = [], {}
        if max_docs is not None and n >= max_docs:
            break
    if group:
        yield group, group_labels


def _existing_finished_bytes(out: Path, identity: dict) -> int:
    """Bytes of finished shards an earlier run with this identity left in ``out`` (0 if none)."""
    try:
        m = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return 0
    if json.loads(json.dumps(m.get("identity"))) != json.loads(json.dumps(identity)):
        return 0
    from geomscope.store.manifest import read_parts, with_logged

    listed = [s for s in m.get("shards", []) if isinstance(s, dict) and "index" in s]
    shards = with_logged(listed, read_parts(out, identity)[0])
    return sum(int(s.get("bytes", 0)) for s in shards if (out / s.get("file", "")).exists())


def extract(
    model,
    inputs,
    out,
    options: ExtractOptions | None = None,
    *,
    progress: bool = False,
    log=None,
    stdin=None,
    **overrides,
) -> dict:
    """Run ``model`` over ``inputs`` and store the requested layers' token rows in the run directory ``out``.

    ``model``: a local directory, a hub name (at ``options.revision``), ``bundled:minilm``, or a
    :class:`~geomscope.model.loaded.LoadedModel` (then revision, dtype, device, stack and
    trust_remote_code are the ones it was loaded with). ``options``: an :class:`ExtractOptions`;
    keyword ``overrides`` replace its fields (``extract(m, [f], out, shard_docs=10)``). Returns the
    summary dict that ``geomscope extract --json`` prints. Raises InputError for bad input (nothing
    written; for an input that changed while it was read, the shards written so far stay an
    unfinished run), and DataError -- after the run is complete, with the summary as ``.summary``
    -- when some activations are NaN/Inf, unless ``allow_nonfinite``.
    """
    from geomscope.distributed import world_from_env
    from geomscope.store import RunWriter

    opts = replace(options or ExtractOptions(), **overrides).validate()
    say = log or (lambda msg: None)
    out = Path(out)
    args = [str(i) for i in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    if world_from_env()[1] > 1:  # torchrun / accelerate launch / srun: extract/ranks.py
        from geomscope.extract.ranks import check_options, extract_ranks

        check_options(opts, args)
        return extract_ranks(model, args, out, opts, progress=progress, log=log, stdin=stdin)
    t_start = time.perf_counter()
    ins = open_inputs(args, stdin=stdin)
    try:
        check_out_outside_inputs(ins, out)
        scan = _scan(ins, opts)
        # before the load: what extract --revisions computes, without loading, to skip a finished run
        request = run_request(model, ins, opts)
        lm = _load(model, opts)
        if request is not None and request["model"]["source"] == "hub":
            request["model"]["commit"] = lm.info.get("commit")  # the commit the rows come from
        plan = _plan(lm, ins, scan, opts, out)
        # a change while the model loaded (often the longest wait) is found before the run is made
        _check_unchanged(ins, scan.signatures, _NOTHING_WRITTEN)
        say(plan.describe(lm, out, scan.docs))
        with RunWriter(
            out, plan.identity, overwrite=opts.overwrite, extra=_manifest_extra(lm, opts)
        ) as writer:
            # saved with the first shard (one fsync pair less per call; nothing depends on it earlier).
            # The request is this call's: the run's identity is the same as before (RunWriter refuses
            # another), so any request that reached it asked for the same rows.
            writer.manifest.update(
                planned_shards=plan.shards,
                planned_docs=scan.docs,
                estimate={"tokens": plan.est_tokens, "bytes": plan.est_bytes},
                last_invocation=_invocation(lm, opts),
                request=request,
            )
            summary = _ShardRun(writer, lm, ins, plan, opts, progress).run()
    finally:
        close_inputs(ins)
    summary["seconds_total"] = round(time.perf_counter() - t_start, 3)
    summary["estimate"] = {"tokens": plan.est_tokens, "bytes": plan.est_bytes}
    say(done_line(summary))
    _refuse_nonfinite(summary, opts, out)
    return summary


def _invocation(lm, opts: ExtractOptions, processes: int = 1) -> dict:
    """How this invocation ran (not part of the identity: it does not change the rows)."""
    placed = sorted({str(v) for v in (getattr(lm.model, "hf_device_map", None) or {}).values()})
    return {
        "device": str(lm.device),
        **(
            {"device_map": opts.device_map, "placed_on": placed or [str(lm.device)]}
            if opts.device_map
            else {}
        ),
        "batch_tokens": opts.batch_tokens,
        "processes": processes,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def done_line(summary: dict) -> str:
    """The line that ends an extract: what the run holds, and what this invocation did. The rate is
    over the rows this invocation measured; a run that an earlier invocation finished says so
    instead of a rate from no work."""
    held = (
        f"{counted(summary['rows'], 'row')} of {counted(summary['docs'], 'document')} in "
        f"{counted(summary['shards'], 'shard')}, {human_bytes(summary['bytes'])}"
    )
    resumed, written = summary["shards_resumed"], summary["shards_written"]
    if not written:
        return f"done: nothing to do, an earlier run finished every shard: {held}"
    rate = _rate_text(summary.get("tokens_per_second"))
    if not resumed:
        return f"done: {held}{rate}"
    return (
        f"done: {held}; {counted(resumed, 'shard')} kept from an earlier run, {written} written now "
        f"({counted(summary['rows_this_run'], 'row')}{rate})"
    )


def _rate_text(tokens_per_second: float | None) -> str:
    """``, N tokens/s`` for a measured rate (two significant digits below 1), empty without one."""
    if not tokens_per_second:
        return ""
    if tokens_per_second >= 1:
        return f", {tokens_per_second:,.0f} tokens/s"
    return f", {tokens_per_second:.2g} tokens/s"


@dataclass
class _Scan(Scan):
    """The documents counted (plan.Scan), and what each input file was (:func:`_signatures`) when it
    was counted and hashed: the run's identity records that content, and the rows must come from it."""

    signatures: list = field(default_factory=list)


def _scan(ins, opts: ExtractOptions) -> _Scan:
    """Count the documents (and refuse inputs without text) and hash every input for the identity."""
    before = _signatures(ins)
    scan = scan_inputs(ins, text_field=opts.text_field, text_column=opts.text_column, max_docs=opts.max_docs)
    if scan.docs == 0:
        names = ", ".join(i.arg for i in ins)
        raise InputError(
            f"no text in {names}: {scan.records} records, all empty; give inputs with text"
            + (" (check --text-field)" if scan.records else "")
        )
    for inp in ins:
        hash_input(inp)
    _check_unchanged(ins, before, _NOTHING_WRITTEN)
    return _Scan(**{f.name: getattr(scan, f.name) for f in fields(scan)}, signatures=before)


_NOTHING_WRITTEN = "nothing was written; rerun once the input is final"


def _signatures(ins) -> list:
    """What tells each input from one changed or put in its place since: store/reader.py's
    file_identity (device, inode, size, modification time) of the file, or of every file of a saved
    dataset; None for a spooled stream (geomscope's own copy, which nothing else writes)."""
    from geomscope.store.integrity import file_identity

    def of(p: Path):
        try:
            return file_identity(os.stat(p))
        except OSError as e:
            return f"unreadable ({e.strerror or e})"  # removed, or its permissions changed

    out = []
    for inp in ins:
        if inp.spooled:
            out.append(None)
        elif inp.kind == "dataset":
            try:
                files = sorted(p for p in inp.path.rglob("*") if p.is_file())  # as hash_input reads them
            except OSError as e:  # the reads that follow say what is wrong, in one line
                out.append(f"unreadable ({e.strerror or e})")
                continue
            out.append([(str(p.relative_to(inp.path)), of(p)) for p in files])
        else:
            out.append(of(inp.path))
    return out


def _check_unchanged(ins, signatures: list, then: str) -> None:
    """InputError naming the first input that is not what it was when ``signatures`` were taken
    (appended to, rewritten, replaced while extract read it): the identity would record content that
    the rows do not come from. ``then``: what happened to the run, and what to do."""
    for inp, before, now in zip(ins, signatures, _signatures(ins), strict=True):
        if before != now:
            raise InputError(f"input {inp.arg} changed while geomscope read it; {then}")


#: ExtractOptions fields that change nothing a run holds, only how and where it ran (the identity
#: leaves them out too), or what the call does with a run (``allow_nonfinite``: revisions.py checks
#: it against the run's NaN/Inf rows). Every other field is part of a run's request, new ones too: a
#: needless reload is safe, a wrong skip is not.
_NOT_REQUESTED = ("device", "device_map", "max_memory", "batch_tokens", "overwrite", "allow_nonfinite")


def run_request(model, ins, opts: ExtractOptions) -> dict | None:
    """What a call asks of a run, computed without loading the model (``extract --revisions`` skips
    a complete run only when its stored ``request`` is this one: :func:`request_differences`).

    ``model``: the name, canonical (resolve_model), and for a local directory or the bundled model
    its files' fingerprints (weights and config, tokenizer); for a hub name its revision and the
    commit the local cache resolves it to (None when not cached; extract records the commit it
    loaded). ``ins``: hashed (hash_input), as the identity records them. None for a model given
    loaded, or files that cannot be read (that run is then never skipped)."""
    from geomscope.model.identity import model_request
    from geomscope.model.loaded import LoadedModel

    if isinstance(model, LoadedModel):
        return None
    # no hub request: a revision the cache no longer holds is compared by name (request_differences)
    rec = model_request(str(model), opts.revision, opts.cache_dir)
    if rec is None:
        return None
    asked = {k: v for k, v in opts.to_dict().items() if k not in _NOT_REQUESTED}
    # as JSON holds it (tuples are lists), so that a stored request compares equal
    return json.loads(json.dumps({"model": rec, **_input_identity(ins, opts), "options": asked}))


def request_differences(stored, now: dict) -> list[str]:
    """How request ``now`` differs from the ``stored`` one (``key: in the run, now``; empty: the same).

    A hub revision that the local cache does not hold now (``--drop-weights`` removed it) is compared
    by name: its commit can be known only by downloading it, and the skip exists to avoid that."""
    from geomscope.store.manifest import identity_differences

    if not isinstance(stored, dict):
        return ["no request recorded (a run from before geomscope recorded it)"]
    if now["model"].get("source") == "hub" and now["model"].get("commit") is None:
        model = stored.get("model")
        if isinstance(model, dict) and model.get("source") == "hub":
            stored = {**stored, "model": {**model, "commit": None}}
    return identity_differences(stored, now)


def _load(model, opts: ExtractOptions):
    from geomscope.model.load import load_model
    from geomscope.model.loaded import LoadedModel

    if isinstance(model, LoadedModel):
        return model
    return load_model(
        str(model),
        revision=opts.revision,
        dtype=opts.dtype,
        device=opts.device,
        trust_remote_code=opts.trust_remote_code,
        stack=opts.stack,
        cache_dir=opts.cache_dir,
        loss=opts.loss if opts.gradients else None,
        device_map=opts.device_map,
        max_memory=opts.max_memory_map,
    )


@dataclass
class _Plan:
    """What will be written: the run's identity, its layers, the token cap and the size estimates."""

    identity: dict
    layer_desc: list[dict]  # the stored layers (gradient layers included)
    read_layers: list[dict]  # the hidden states read from the model (activations or not)
    max_length: int | None
    est_tokens: int
    est_bytes: int
    docs: int
    shards: int
    free_bytes: int
    signatures: list  # the inputs when they were hashed (_signatures): the rows must come from that

    def describe(self, lm, out: Path, docs: int) -> str:
        return (
            f"extract: {lm.info['name']} ({lm.info['model_type']}, {lm.stack}, {lm.device}) -> {out}: "
            f"{counted(docs, 'document')} in {counted(self.shards, 'shard')}, "
            f"{counted(len(self.layer_desc), 'layer')} x {lm.hidden_size} "
            f"({self.identity['store_dtype']}); about {self.est_tokens:,} tokens, "
            f"{human_bytes(self.est_bytes)} on disk ({human_bytes(self.free_bytes)} free)"
        )


def _effective_max_length(lm, opts: ExtractOptions) -> int | None:
    if opts.max_length is None:
        return lm.max_length
    specials = len(lm.tokenizer("", add_special_tokens=True)["input_ids"])
    if opts.max_length <= specials:
        raise InputError(
            f"--max-length {opts.max_length} leaves no room for text: {lm.info['name']} adds "
            f"{specials} special token(s) to every document; use at least {specials + 1}"
        )
    if lm.max_length is not None and opts.max_length > lm.max_length:
        raise InputError(
            f"--max-length {opts.max_length} exceeds what {lm.info['name']} can read "
            f"({lm.max_length} tokens); use at most {lm.max_length}"
        )
    return opts.max_length


def _identity(lm, ins, opts: ExtractOptions, layer_desc: list[dict], eff_len: int | None) -> dict:
    """Everything that determines the stored rows and values (not batch size, not device)."""
    keep = {}
    if opts.sample_size is not None:  # only then: runs of every row keep the identity they always had
        keep = {"keep": f"sample:{opts.sample_size}", "sample_seed": opts.seed}
    if opts.gradients:  # likewise
        keep.update(capture=opts.capture, loss=_loss_settings(lm, opts))
    return {
        "model": lm.info,
        "layers": layer_desc,
        "store_dtype": opts.store_dtype,
        **_input_identity(ins, opts),
        "max_docs": opts.max_docs,
        "max_tokens": opts.max_tokens,
        "max_length": eff_len,
        "truncation": eff_len is not None,
        "add_special_tokens": True,
        "padding": "right",
        "shard_docs": opts.shard_docs,
        **keep,
    }


def _input_identity(ins, opts: ExtractOptions) -> dict:
    """The inputs as a run's identity (and request) records them; ``ins`` hashed (hash_input)."""
    return {
        "inputs": [i.identity() for i in ins],
        "dataset": "+".join("stdin" if i.kind == "stdin" else Path(i.arg).name for i in ins),
        "text_field": opts.text_field if uses_field(ins) else None,
        "text_column": opts.text_column if uses_column(ins) else None,
    }


def _loss_settings(lm, opts: ExtractOptions) -> dict:
    from geomscope.extract.gradients import REDUCTION

    loss = lm.info.get("loss")
    out = {"kind": loss, "reduction": REDUCTION}
    if loss == "masked-lm":
        out.update(mlm_probability=opts.mlm_probability, mask_seed=opts.seed, masking="mask token only")
    if loss == "classification":
        out.update(label_field=opts.label_field, labels=getattr(lm.model.config, "id2label", None))
    return out


def _label_map(lm) -> tuple[dict[str, int], int]:
    config = lm.model.config
    return {str(k): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}, int(
        config.num_labels
    )


def _check_labels(lm, ins, opts: ExtractOptions) -> None:
    """Every document's label maps to a class of the model, checked before anything is written."""
    from geomscope.extract.gradients import label_index
    from geomscope.extract.sources import iter_labels

    label2id, n_labels = _label_map(lm)
    labels = iter_labels(ins, opts.label_field)
    docs = 0
    for doc_id, text in iter_all(ins, text_field=opts.text_field, text_column=opts.text_column):
        raw = next(labels, None)
        if not text.strip():
            continue
        label_index(raw, label2id, n_labels, doc_id)
        docs += 1
        if opts.max_docs is not None and docs >= opts.max_docs:
            break


def _stored_layers(read_layers: list[dict], opts: ExtractOptions) -> list[dict]:
    """The layers a run stores: the activations read, and/or their gradients (``<name>.grad``)."""
    if not opts.gradients:
        return read_layers
    from geomscope.extract.gradients import parse_capture

    grads = [
        {
            **la,
            "name": gradient_name(la["name"]),
            "capture": "gradients",
            "tensor": f"gradient of the loss with respect to the {la['tensor']}",
        }
        for la in read_layers
    ]
    return ([*read_layers] if parse_capture(opts.capture)[0] else []) + grads


def _as_the_run_fingerprints(identity: dict, lm, out: Path) -> dict:
    """``identity`` with the weights fingerprinted as the run in ``out`` records them: a run made
    before whole files were hashed holds ``weights_sha256`` (their first and last 64 KiB), and is
    compared, so resumed, on that (else every such run was refused as made with other weights)."""
    from geomscope.model.fingerprint import WEIGHTS_KEY, legacy_weights_fingerprint
    from geomscope.store.manifest import MANIFEST_NAME

    try:
        stored = json.loads((Path(out) / MANIFEST_NAME).read_text(encoding="utf-8"))["identity"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return identity
    path = (lm.source or {}).get("path")
    if not isinstance(stored, dict) or "weights_sha256" not in stored or WEIGHTS_KEY in stored or not path:
        return identity
    model = {k: v for k, v in identity["model"].items() if k != WEIGHTS_KEY}
    model["weights_sha256"] = legacy_weights_fingerprint(Path(path))
    return {**identity, "model": model}


def _plan(lm, ins, scan, opts: ExtractOptions, out: Path) -> _Plan:
    indices, with_final = _chosen_layers(lm, opts.layers)
    read_layers = describe_layers(indices, lm.n_hidden_states, lm.final_norm, lm.final_norm_name, with_final)
    layer_desc = _stored_layers(read_layers, opts)
    if opts.gradients and lm.info.get("loss") == "classification":
        _check_labels(lm, ins, opts)
    eff_len = _effective_max_length(lm, opts)
    identity = _as_the_run_fingerprints(_identity(lm, ins, opts, layer_desc, eff_len), lm, out)
    try:
        est_tokens = estimate_tokens(scan, lm.tokenizer, eff_len, opts.max_tokens)
    except Exception as e:  # a tokenizer that rejects the options (e.g. max_length below its specials)
        raise InputError(
            f"the tokenizer of {lm.info['name']} rejects these options ({e}); check --max-length"
        ) from e
    if opts.sample_size is not None and opts.sample_size >= est_tokens:
        raise InputError(
            f"--keep {opts.keep}: the run has about {est_tokens:,} token rows, so a sample of "
            f"{opts.sample_size:,} would keep them all; use --keep all, or a smaller sample"
        )
    shards = -(-scan.docs // opts.shard_docs)
    est_bytes = _estimate_bytes(est_tokens, shards, len(layer_desc), lm.hidden_size, opts)
    already = 0 if opts.overwrite else _existing_finished_bytes(out, identity)
    free = check_disk(out, max(0, est_bytes - already))
    return _Plan(
        identity,
        layer_desc,
        read_layers,
        eff_len,
        est_tokens,
        est_bytes,
        scan.docs,
        shards,
        free,
        scan.signatures,
    )


def _estimate_bytes(tokens: int, shards: int, n_layers: int, dim: int, opts: ExtractOptions) -> int:
    """Bytes on disk: every row, or (``--keep sample:N``) per shard and layer two accumulators and
    up to 2N sampled rows (the N smallest hashes with and without special tokens)."""
    per_row = bytes_per_row(n_layers, dim, opts.store_dtype)
    if opts.sample_size is None:
        return int(tokens * per_row * 1.02) + 65536
    from geomscope.store.accumulators import bytes_per_part

    rows = min(tokens, shards * 2 * opts.sample_size)
    return int(shards * n_layers * 2 * bytes_per_part(dim) + rows * per_row * 1.02) + 65536 * shards


def _chosen_layers(lm, spec) -> tuple[list[int], bool]:
    """(residual-stream indices, whether the final norm's output is stored too) for ``--layers``:
    ``all`` (the default) includes ``final_norm`` where the model has one; ``final_norm`` names it."""
    separable = bool(lm.final_norm and lm.final_norm_name)
    if names_layer(spec, FINAL_NORM_LAYER) and not separable:
        why = (
            "a BERT-style post-LN model has none: its last layer is the model's output"
            if not lm.final_norm
            else "its final norm module could not be found by name"
        )
        raise InputError(
            f"--layers final_norm: {lm.info['name']} has no final norm to store separately ({why})"
        )
    chosen = select_layers(spec, model_layers(lm.n_hidden_states, final_norm=separable))
    indices = [la.index for la in chosen if la.name != FINAL_NORM_LAYER]
    return indices, len(indices) < len(chosen)


def _final_norm_params(lm) -> dict | None:
    """The final norm's module, gain and bias (per dimension), recorded with the run so that score
    can relate them to the per-dimension variance before the norm without the checkpoint."""
    mod = lm.final_norm_module() if lm.final_norm_name else None
    if mod is None:
        return None

    def values(name):
        t = getattr(mod, name, None)
        return None if t is None else [float(v) for v in t.detach().float().cpu().reshape(-1)]

    weight = values("weight")
    gain, applied = None, None
    if weight is not None and len(weight) == lm.hidden_size:
        gain, applied = _applied_gain(mod, weight)
    return {
        "module": lm.final_norm_name,
        "type": type(mod).__name__,
        "gain": gain,
        "gain_is": applied,  # "weight", "1 + weight" (Gemma's RMSNorm), or None: not recorded
        "bias": values("bias"),
    }


def _probe_input(dim: int):
    """A vector of mean 0 and root mean square 1 with no zero entry: a LayerNorm and an RMSNorm
    both normalise it to itself (up to their eps)."""
    import numpy as np

    x = np.where(np.arange(dim) % 2 == 0, 1.0, -1.0)
    if dim % 2:  # odd: the last three as (2, -1, -1) keep the mean 0
        x[-3:] = (2.0, -1.0, -1.0)
    return x / np.sqrt(np.mean(x * x))


def _applied_gain(mod, weight: list[float]) -> tuple[list[float] | None, str | None]:
    """The per-dimension factor the norm applies, and what it is made of. Most norms multiply by
    their weight; Gemma's RMSNorm multiplies by 1 + weight (its weight stores the offset from 1),
    and recording the weight as the gain made a damped outlier dimension read as amplified. So the
    factor is measured, not assumed from the class: for a probe x that the norm normalises to x
    itself, y(x) - y(-x) = 2 g x (a bias cancels). The weight, or 1 + weight, is recorded where the
    measure agrees with it; otherwise no gain (None)."""
    import numpy as np
    import torch

    try:
        param = next(mod.parameters())
        x = _probe_input(len(weight))
        t = torch.tensor(x, dtype=param.dtype, device=param.device).reshape(1, 1, -1)
        with torch.no_grad():
            measured = ((mod(t) - mod(-t)).float().cpu().reshape(-1).numpy()) / (2.0 * x)
    except Exception:  # a norm that cannot be called alone: nothing measured, nothing claimed
        return None, None
    w = np.asarray(weight, dtype=np.float64)
    tol = (1e-4 if param.dtype in (torch.float32, torch.float64) else 2e-2) * max(
        1.0, float(np.abs(w).max()) + 1
    )
    for applied, g in (("weight", w), ("1 + weight", w + 1.0)):
        if np.all(np.abs(measured - g) <= tol):
            return [float(v) for v in g], applied
    return None, None


def _manifest_extra(lm, opts: ExtractOptions) -> dict:
    return {
        "final_norm": _final_norm_params(lm),
        "model_source": lm.source,
        "versions": package_versions(),
        "layer_note": LAYER_NOTE,
        "row_order": ROW_ORDER,
        "max_length_source": (
            "option" if opts.max_length is not None else ("model" if lm.max_length else None)
        ),
    }


def _refuse_nonfinite(summary: dict, opts: ExtractOptions, out: Path) -> None:
    if not summary["nonfinite_rows"] or opts.allow_nonfinite:
        return
    by = ", ".join(f"{k}: {v}" for k, v in summary["nonfinite_by_layer"].items())
    err = DataError(
        f"{summary['nonfinite_rows']} of {summary['rows']} rows hold NaN/Inf activations ({by}); "
        f"they are stored and flagged in /nonfinite/<layer> of {out}; check the model and --dtype "
        "(float16 overflows), or pass --allow-nonfinite to accept them"
    )
    err.summary = summary
    raise err


def _cut(d: Doc, n: int) -> Doc:
    return Doc(d.doc_id, d.ids[:n], d.special[:n])


_DOC_STATS = ("docs_zero_tokens", "docs_at_max_length", "docs_cut_by_max_tokens", "docs_without_targets")


def _shard_stats(entries: list[dict]) -> dict:
    """The per-shard counts of the manifest's entries, summed (the whole run's, however many
    invocations and processes wrote it)."""
    out: dict = dict.fromkeys(_DOC_STATS, 0)
    out.update(nonfinite_by_layer={}, loss_sum=0.0, loss_docs=0)
    for e in entries:
        st = e.get("stats") or {}
        for key in _DOC_STATS:
            out[key] += int(st.get(key, 0))
        for key, v in (st.get("nonfinite_by_layer") or {}).items():
            out["nonfinite_by_layer"][key] = out["nonfinite_by_layer"].get(key, 0) + int(v)
        out["loss_sum"] += float(st.get("loss_sum", 0.0))
        out["loss_docs"] += int(st.get("loss_docs", 0))
    return out


class _ShardRun:
    """Writes the run's shards in order: keeps the finished ones an earlier run left, writes the rest."""

    def __init__(self, writer, lm, ins, plan: _Plan, opts: ExtractOptions, progress: bool):
        from geomscope.extract.capture import Capture

        self.writer, self.lm, self.ins, self.plan, self.opts, self.progress = (
            writer,
            lm,
            ins,
            plan,
            opts,
            progress,
        )
        if opts.gradients:
            from geomscope.extract.gradients import GradientCapture, parse_capture

            self.capture = GradientCapture(
                lm,
                plan.read_layers,
                opts.store_dtype,
                loss=lm.info["loss"],
                activations=parse_capture(opts.capture)[0],
                mlm_probability=opts.mlm_probability,
                seed=opts.seed,
            )
        else:
            self.capture = Capture(lm, plan.read_layers, opts.store_dtype)
        self.names = [la["name"] for la in plan.layer_desc]
        self.heap = HeapTrim()  # trims the heap after spreading batches and at shard boundaries
        # what an earlier run finished, read once (rebuilt for every shard, it cost O(shards^2))
        self.resumable = writer.finished
        self.counts = {"records": 0, "docs_empty": 0}
        self.total_rows = self.new_rows = self.written = self.resumed = 0
        self.rank, self.world = 0, 1  # a multi-process run (extract/ranks.py): shard k is rank k % world's

    def _budget_spent(self) -> bool:
        return self.opts.max_tokens is not None and self.total_rows >= self.opts.max_tokens

    def run(self) -> dict:
        return self.finish(self.write_shards())

    def write_shards(self) -> float:
        """Keep the finished shards, write this process's others; the seconds it took."""
        t0 = time.perf_counter()
        labels = None
        self.labelled = self.opts.gradients and self.lm.info.get("loss") == "classification"
        if self.labelled:
            from geomscope.extract.sources import iter_labels

            labels = iter_labels(self.ins, self.opts.label_field)
        groups = _groups(
            self.ins,
            self.opts.text_field,
            self.opts.text_column,
            self.opts.shard_docs,
            self.opts.max_docs,
            self.counts,
            labels,
        )
        self.store = StoreThread()
        try:
            with Progress(self.progress) as bar:
                self._write_groups(groups, bar.add("extract", self.plan.docs, unit="docs", rate_unit="tok"))
        except BaseException:
            self.store.drain_quietly()  # what was captured before the failure is still stored
            raise
        self.store.drain()  # every shard published, in order
        # every document read (or the run cut short): the identity's hashes must still describe the
        # inputs, or the rows came (in part) from other content and the run may not be marked complete
        self._check_inputs()
        return time.perf_counter() - t0

    def _check_inputs(self) -> None:
        _check_unchanged(
            self.ins,
            self.plan.signatures,
            f"its shards in {self.writer.dir} stay an unfinished run; rerun with --overwrite once the "
            "input is final",
        )

    def _is_done(self, k: int, group) -> object | None:
        """The manifest entry of shard ``k`` when an earlier run finished it with the same documents."""
        done = self.resumable.get(k)
        if done is not None and (done.doc_start, done.doc_stop) == (group[0][0], group[-1][0] + 1):
            return done
        return None

    def _write_groups(self, groups, prog) -> None:
        # This process's next shard's documents (world places on: extract/ranks.py) are tokenized in
        # a thread while this shard's batches run (the tokenizer releases the GIL): on an H100 the
        # forward of 10,000 sentences through MiniLM took 0.45 s and their tokenization 0.3 s (16
        # cores; 1.4 s on one). Only where the next shard is surely read: without --max-tokens,
        # which may stop the run inside this one.
        if self.opts.max_tokens is None:
            ahead = _lookahead(enumerate(groups), depth=self.world)
        else:
            ahead = _no_lookahead(groups)
        with ThreadPoolExecutor(1, thread_name_prefix="geomscope-tokenize") as pool:
            tokenized = None  # (k, future): a shard tokenized ahead
            try:
                for (k, (group, group_labels)), upcoming in ahead:
                    self._check_inputs()  # a stat per input and shard: stop early, not after the work
                    if self._budget_spent():
                        break
                    done = self._is_done(k, group)
                    if done is not None:
                        self._keep(k, done)
                        prog.skip(len(group))
                        continue
                    if k % self.world != self.rank:  # another process's shard
                        prog.skip(len(group))
                        continue
                    if self.labelled:
                        self._set_labels(group_labels)
                    # this shard's documents first: the tokenizer is never used by two threads at once
                    ready = tokenized is not None and tokenized[0] == k
                    if tokenized is not None and not ready:  # not expected; never two tokenizers
                        wait([tokenized[1]])
                    docs = tokenized[1].result() if ready else self._tokenize(group)
                    tokenized = None
                    if upcoming is not None:
                        j, (nxt, _) = upcoming
                        if j % self.world == self.rank and self._is_done(j, nxt) is None:
                            tokenized = (j, pool.submit(self._tokenize, nxt))
                    budget_hit = self._write(k, group, prog, docs)
                    if budget_hit or self._budget_spent():
                        break
            finally:
                if tokenized is not None:
                    tokenized[1].cancel()  # a failure or the end of the budget: not needed

    def _set_labels(self, raw: dict) -> None:
        """The shard's class indices for the classification loss (a bad label: one line, before any work)."""
        from geomscope.extract.gradients import label_index

        label2id, n_labels = _label_map(self.lm)
        self.capture.labels = {
            doc_id: label_index(y, label2id, n_labels, doc_id) for doc_id, y in raw.items()
        }

    def _keep(self, k: int, done) -> None:
        """A shard an earlier run finished with the same documents: count it, do not redo it."""
        self.total_rows += done.n_tokens
        self.resumed += 1

    def _select(self, docs) -> tuple[list, int, bool, dict]:
        """The tokenized documents to store (empty ones dropped, the last one cut at --max-tokens)."""
        stats = dict.fromkeys(_DOC_STATS, 0)
        kept, rows, budget_hit = [], 0, False
        eff_len, max_tokens = self.plan.max_length, self.opts.max_tokens
        for d in docs:
            if len(d) == 0:
                stats["docs_zero_tokens"] += 1
                continue
            if eff_len is not None and len(d) >= eff_len:
                stats["docs_at_max_length"] += 1
            if max_tokens is not None:
                left = max_tokens - self.total_rows - rows
                if left <= 0:
                    budget_hit = True
                    break
                if len(d) > left:
                    d = _cut(d, left)
                    stats["docs_cut_by_max_tokens"] += 1
            kept.append(d)
            rows += len(d)
        return kept, rows, budget_hit, stats

    def _tokenize(self, group) -> list:
        """The group's documents tokenized (a tokenizer failure: one line naming the documents)."""
        try:
            return tokenize(self.lm.tokenizer, group, self.plan.max_length)
        except Exception as e:
            raise InputError(
                f"the tokenizer of {self.lm.info['name']} failed on documents {group[0][0]}.."
                f"{group[-1][0]} ({type(e).__name__}: {e}); check --max-length"
            ) from e

    def _write(self, k: int, group, prog, docs: list) -> bool:
        """Run and store shard ``k`` (``docs``: its tokenized documents); return whether
        --max-tokens was reached inside it."""
        doc_start, doc_stop = group[0][0], group[-1][0] + 1
        kept, rows, budget_hit, stats = self._select(docs)
        sample = self.opts.sample_size
        sw = self.writer.shard_writer(
            k,
            layer_names=self.names,
            dim=self.lm.hidden_size,
            store_dtype=self.opts.store_dtype,
            doc_start=doc_start,
            doc_stop=doc_stop,
            expected_rows=max(1, rows if sample is None else min(rows, 2 * sample)),
            row_flags=("loss_target",) if self.opts.gradients else (),
        )
        keeper, measured = None, 0
        try:
            if sample is not None:
                from geomscope.extract.keep import SampleKeeper

                # the previous shard's keeper (device accumulators of every layer) is written into
                # its shard and freed before this one is made: one keeper at a time, as without the
                # store thread
                self.store.wait_idle()
                keeper = SampleKeeper(self.names, self.lm.hidden_size, self.lm.device, sample, self.opts.seed)
            waiting = None  # (batch, its rows still on their way from a GPU)
            for batch in plan_batches(length_order(kept), self.opts.batch_tokens):
                if keeper is None:
                    # on a GPU this batch's forward and copies are queued before the previous batch's
                    # rows are waited for, so the GPU runs it while this thread hands those over and
                    # prepares the next one; on the CPU the rows are complete at once and are handed
                    # over at once, as before (holding them would only hold memory)
                    captured = self.capture.launch(batch)
                    if waiting is not None:
                        measured += self._hand_over(sw, *waiting, prog)
                    waiting = (batch, captured)
                    if not captured.in_flight:
                        measured += self._hand_over(sw, *waiting, prog)
                        waiting = None
                else:
                    arrays, meta = self.capture.device_rows(batch)
                    keeper.add(arrays, meta)
                    del arrays  # measured: free the rows before measuring the heap
                    self.heap.batch_done()
                    measured += len(meta["token_id"])
                    prog.advance(len(batch), work=len(meta["token_id"]))
            if waiting is not None:
                measured += self._hand_over(sw, *waiting, prog)
            if self.opts.gradients:
                loss_sum, loss_docs, without = self.capture.reset_totals()
                stats.update(loss_sum=loss_sum, loss_docs=loss_docs, docs_without_targets=without)
            self.store.submit(sw, partial(self._publish, sw, stats, keeper))
        except BaseException:
            self.store.drain_quietly()  # the store thread is done with sw before it goes
            sw.abort()
            raise
        prog.skip(len(group) - len(kept))
        self.total_rows += measured
        self.new_rows += measured
        self.written += 1
        return budget_hit

    def _hand_over(self, sw, batch, captured, prog) -> int:
        """Give a batch's rows to the store thread (waiting for them first, when a GPU still copies
        them); the number of rows."""
        arrays, meta = captured.result()
        # the batch before was stored during this forward: its rows are free now, and at most one
        # batch's rows are ever waiting to be stored
        self.store.wait_idle()
        self.heap.batch_done()
        self.store.submit(sw, partial(sw.append, arrays, **meta))
        rows = len(meta["token_id"])
        prog.advance(len(batch), work=rows)
        return rows

    def _publish(self, sw, stats: dict, keeper):
        """(Store thread) finish shard ``sw`` -- a --keep sample shard gets its sample and
        accumulators -- and return its publishing, which the publisher thread runs: checksums,
        fsync and rename, then the shard's record in the manifest (storing.py). The shard's rows are
        all stored now: the heap's free pages go back here, beside the next shard's forwards (a trim
        took ~9 ms a shard on the thread that feeds them)."""
        if keeper is not None:
            sw.keep_accumulators(keeper, self.opts.sample_size, self.opts.seed)
        sw.finish()
        self.heap.shard_done()
        if sw.nonfinite_by_layer:
            stats["nonfinite_by_layer"] = dict(sw.nonfinite_by_layer)
        return lambda: self.writer.add_shard(sw.publish(), stats=stats)

    def _gradient_summary(self, stats: dict) -> dict:
        if not self.opts.gradients:
            return {}
        mean = stats["loss_sum"] / stats["loss_docs"] if stats["loss_docs"] else None
        return {"capture": self.opts.capture, "loss": self.lm.info["loss"], "loss_mean": mean}

    def finish(self, seconds: float, new_rows: int | None = None, written: int | None = None) -> dict:
        """Finalize the manifest (every shard is in it) and return the summary; ``new_rows`` and
        ``written``: this invocation's totals over all processes (default: this process's)."""
        new_rows = self.new_rows if new_rows is None else new_rows
        written = self.written if written is None else written
        shards = self.writer.manifest["shards"]
        stats = _shard_stats(shards)
        agg = {k: stats[k] for k in _DOC_STATS}
        stored = sum(s["rows"] for s in shards)
        totals = {
            "rows": sum(s.get("tokens", s["rows"]) for s in shards),
            **({"rows_stored": stored} if self.opts.sample_size is not None else {}),
            "docs": sum(s["docs"] for s in shards),
            "records_read": self.counts["records"],
            "docs_empty": self.counts["docs_empty"],
            **agg,
            "nonfinite_by_layer": stats["nonfinite_by_layer"],
        }
        self.writer.finalize(totals)
        t = self.writer.manifest["totals"]
        lm = self.lm
        return {
            "run_dir": str(self.writer.dir),
            "complete": True,
            "model": lm.info["name"],
            "revision": lm.info["revision"],
            "commit": lm.info["commit"],
            "device": str(lm.device),
            "layers": self.names,
            "hidden_size": lm.hidden_size,
            "store_dtype": self.opts.store_dtype,
            "rows": t["rows"],
            "keep": "all" if self.opts.sample_size is None else f"sample:{self.opts.sample_size}",
            **({"rows_stored": t["rows_stored"]} if "rows_stored" in t else {}),
            "docs": t["docs"],
            "records_read": self.counts["records"],
            "docs_empty": self.counts["docs_empty"],
            **agg,
            "shards": t["shards"],
            "shards_written": written,
            "shards_resumed": self.resumed,
            "bytes": t["bytes"],
            "nonfinite_rows": t["nonfinite_rows"],
            "nonfinite_by_layer": stats["nonfinite_by_layer"],
            **self._gradient_summary(stats),
            "rows_this_run": new_rows,
            "seconds": round(seconds, 3),
            "tokens_per_second": round(new_rows / seconds, 1) if new_rows and seconds > 0 else None,
            "batch_tokens": self.opts.batch_tokens,
        }
