"""Before any work: one pass over the inputs (validation, counts, hashes), the model loaded, and the
run's plan (:func:`plan_run`: its identity, layers, token cap and token and disk estimates).

The scan reads every record once (stopping after ``max_docs`` non-empty documents), so malformed
input (a missing field, undecodable bytes, bad JSON) is reported before the model is even loaded.
It keeps only counts, a 64-bin histogram of document lengths in characters and the first few
hundred texts; the token estimate tokenizes that sample for the tokens-per-character ratio and
applies it bin by bin, capped at the truncation length. Every input is hashed for the run's
identity, and what each input file was when it was read (:func:`input_signatures`) is kept: the rows
must come from the content the identity records, so a change is refused (:func:`check_unchanged`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geomscope.errors import InputError
from geomscope.extract.layers import describe_layers, describe_modules, in_forward_order
from geomscope.extract.options import ExtractOptions
from geomscope.extract.sources import InputFile, hash_input, iter_all, uses_column, uses_field
from geomscope.formatting import counted
from geomscope.layers import FINAL_NORM_LAYER, gradient_name, model_layers, names_layer, select_layers
from geomscope.progress import Log

SAMPLE_DOCS = 128
SAMPLE_CHARS = 10_000  # characters of each sampled document that are tokenized
META_BYTES_PER_ROW = 3 * 8 + 1  # token_id, doc_id, position (int64) + is_special


@dataclass
class Scan:
    records: int = 0
    docs: int = 0  # non-empty documents (at most max_docs)
    empty: int = 0  # empty / whitespace-only records among those read
    chars: int = 0
    hist_count: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    hist_chars: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    sample: list[str] = field(default_factory=list)
    #: what each input file was when it was counted and hashed (:func:`input_signatures`; empty
    #: until :func:`scan_and_hash`): the run's identity records that content
    signatures: list = field(default_factory=list)


def scan_inputs(inputs: list[InputFile], *, text_field: str, text_column: str, max_docs: int | None) -> Scan:
    s = Scan()
    for _, text in iter_all(inputs, text_field=text_field, text_column=text_column):
        s.records += 1
        if not text.strip():
            s.empty += 1
            continue
        s.docs += 1
        n = len(text)
        b = min(63, n.bit_length())
        s.hist_count[b] += 1
        s.hist_chars[b] += n
        s.chars += n
        if len(s.sample) < SAMPLE_DOCS:
            s.sample.append(text[:SAMPLE_CHARS])  # the ratio needs text, not whole huge documents
        if max_docs is not None and s.docs >= max_docs:
            break
    return s


def estimate_tokens(scan: Scan, tokenizer, max_length: int | None, max_tokens: int | None) -> int:
    """Estimated rows: sample tokens per character, applied per length bin, capped by truncation."""
    if scan.docs == 0:
        return 0
    # (verbose=False: the sample's full lengths are what is counted, truncation is applied per bin
    # below; transformers would warn of "indexing errors" that no forward will meet)
    lens = [len(x) for x in tokenizer(scan.sample, add_special_tokens=True, verbose=False)["input_ids"]]
    specials = len(tokenizer("", add_special_tokens=True, verbose=False)["input_ids"])
    chars = sum(len(t) for t in scan.sample)
    ratio = max(0.0, sum(lens) - specials * len(lens)) / max(1, chars)
    per_bin = scan.hist_count * specials + scan.hist_chars * ratio
    if max_length:
        per_bin = np.minimum(per_bin, scan.hist_count * max_length)
    est = int(np.ceil(per_bin.sum()))
    return min(est, max_tokens) if max_tokens else est


def bytes_per_row(widths: list[int], store_dtype: str) -> int:
    """A row's bytes on disk: each layer's values (``widths``: each layer's) and non-finite flag,
    and the row's index fields."""
    return sum(d * np.dtype(store_dtype).itemsize + 1 for d in widths) + META_BYTES_PER_ROW


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).free)


def _total_bytes(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).total)


def check_disk(out: Path, needed: int) -> int:
    """Refuse (InputError) when the file system of ``out`` has fewer than ``needed`` bytes free."""
    free = free_bytes(out)
    if needed > free and _total_bytes(out) == 0:  # /proc, /sys: no disk at all
        raise InputError(f"--out {out} is on a file system that stores no files; choose another --out")
    if needed > free:
        raise InputError(
            f"not enough disk space for {out}: the run needs about {human_bytes(needed)}, "
            f"{human_bytes(free)} are free; free space, choose another --out, or store less "
            "(--layers, --max-tokens, --max-docs, --store-dtype float16)"
        )
    return free


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def load_for_run(model, opts: ExtractOptions, log: Log | None = None):
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
        log=log,
    )


def scan_and_hash(ins, opts: ExtractOptions) -> Scan:
    """Count the documents (and refuse inputs without text) and hash every input for the identity."""
    before = input_signatures(ins)
    scan = scan_inputs(ins, text_field=opts.text_field, text_column=opts.text_column, max_docs=opts.max_docs)
    if scan.docs == 0:
        names = ", ".join(i.arg for i in ins)
        raise InputError(
            f"no text in {names}: {scan.records} records, all empty; give inputs with text"
            + (" (check --text-field)" if scan.records else "")
        )
    for inp in ins:
        hash_input(inp)
    check_unchanged(ins, before, NOTHING_WRITTEN)
    scan.signatures = before
    return scan


NOTHING_WRITTEN = "nothing was written; rerun once the input is final"


def input_signatures(ins) -> list:
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


def check_unchanged(ins, signatures: list, then: str) -> None:
    """InputError naming the first input that is not what it was when ``signatures`` were taken
    (appended to, rewritten, replaced while extract read it): the identity would record content that
    the rows do not come from. ``then``: what happened to the run, and what to do."""
    for inp, before, now in zip(ins, signatures, input_signatures(ins), strict=True):
        if before != now:
            raise InputError(f"input {inp.arg} changed while geomscope read it; {then}")


@dataclass
class Plan:
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
    signatures: list  # the inputs when they were hashed (input_signatures): the rows must come from that
    modules: list = field(default_factory=list)  # the modules stored (model/modules.py's ModuleCapture)
    notes: list = field(default_factory=list)  # lines extract logs after the plan's own

    def describe(self, lm, out: Path, docs: int) -> str:
        return (
            f"extract: {lm.info['name']} ({lm.info['model_type']}, {lm.stack}, {lm.device}) -> {out}: "
            f"{counted(docs, 'document')} in {counted(self.shards, 'shard')}, "
            f"{counted(len(self.layer_desc), 'layer')} x {_widths_text(self.layer_desc, lm.hidden_size)} "
            f"({self.identity['store_dtype']}); about {self.est_tokens:,} tokens, "
            f"{human_bytes(self.est_bytes)} on disk ({human_bytes(self.free_bytes)} free)"
        )


def plan_run(lm, ins, scan, opts: ExtractOptions, out: Path) -> Plan:
    indices, with_final = _chosen_layers(lm, opts.layers)
    read_layers = describe_layers(indices, lm.n_hidden_states, lm.final_norm, lm.final_norm_name, with_final)
    modules, notes = _module_layers(lm, opts)
    if modules:
        read_layers = in_forward_order(read_layers, describe_modules(modules, lm.hidden_size))
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
    est_bytes = _estimate_bytes(est_tokens, shards, layer_widths(layer_desc, lm.hidden_size), opts)
    already = 0 if opts.overwrite else _existing_finished_bytes(out, identity)
    free = check_disk(out, max(0, est_bytes - already))
    return Plan(
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
        modules,
        notes,
    )


def _module_layers(lm, opts: ExtractOptions) -> tuple[list, list[str]]:
    """(the modules ``--modules`` stores, the lines that say which modules its globs leave out)."""
    if opts.modules is None:
        return [], []
    from geomscope.model.modules import resolve_modules

    captures, skipped = resolve_modules(lm, opts.modules)
    notes = []
    if skipped:
        shown = ", ".join(skipped[:4]) + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else "")
        notes.append(
            f"extract: --modules leaves out {counted(len(skipped), 'module')} that give no "
            f"vector per token: {shown}"
        )
    return captures, notes


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


def _check_labels(lm, ins, opts: ExtractOptions) -> None:
    """Every document's label maps to a class of the model, checked before anything is written."""
    from geomscope.extract.gradients import label_index, label_map
    from geomscope.extract.sources import iter_labels

    label2id, n_labels = label_map(lm)
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
        if opts.products != "float64":  # likewise: the accumulators' covariance is multiplied otherwise
            keep["products"] = opts.products
    if opts.gradients:  # likewise
        keep.update(capture=opts.capture, loss=_loss_settings(lm, opts))
    return {
        "model": lm.info,
        "layers": layer_desc,
        "store_dtype": opts.store_dtype,
        **input_identity(ins, opts),
        "max_docs": opts.max_docs,
        "max_tokens": opts.max_tokens,
        "max_length": eff_len,
        "truncation": eff_len is not None,
        "add_special_tokens": True,
        "padding": "right",
        "shard_docs": opts.shard_docs,
        **keep,
    }


def input_identity(ins, opts: ExtractOptions) -> dict:
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


def _as_the_run_fingerprints(identity: dict, lm, out: Path) -> dict:
    """``identity`` with the weights fingerprinted as the run in ``out`` records them: a run made
    before whole files were hashed holds ``weights_sha256`` (their first and last 64 KiB), and is
    compared, so resumed, on that (else every such run would be refused as made with other weights)."""
    from geomscope.model.fingerprint import WEIGHTS_KEY, legacy_weights_fingerprint
    from geomscope.store.manifest import read_manifest
    from geomscope.store.names import MANIFEST_NAME

    try:
        stored = read_manifest(Path(out) / MANIFEST_NAME)["identity"].get("model")
    except InputError:
        return identity
    path = (lm.source or {}).get("path")
    if not isinstance(stored, dict) or "weights_sha256" not in stored or WEIGHTS_KEY in stored or not path:
        return identity
    model = {k: v for k, v in identity["model"].items() if k != WEIGHTS_KEY}
    model["weights_sha256"] = legacy_weights_fingerprint(Path(path))
    return {**identity, "model": model}


def layer_widths(layer_desc: list[dict], dim: int) -> list[int]:
    """Each stored layer's width: its entry's ``dim`` (a module layer of another width), else D."""
    return [int(la.get("dim", dim)) for la in layer_desc]


def _widths_text(layer_desc: list[dict], dim: int) -> str:
    """The layers' width as the plan's line says it: D, or the range of widths of a run that holds
    several (``extract --modules``)."""
    widths = layer_widths(layer_desc, dim)
    lo, hi = min(widths, default=dim), max(widths, default=dim)
    return str(dim) if lo == hi == dim else f"{lo}..{hi}"


def _estimate_bytes(tokens: int, shards: int, widths: list[int], opts: ExtractOptions) -> int:
    """Bytes on disk: every row, or (``--keep sample:N``) per shard and layer two accumulators and
    up to 2N sampled rows (the N smallest hashes with and without special tokens); ``widths``: each
    layer's."""
    per_row = bytes_per_row(widths, opts.store_dtype)
    if opts.sample_size is None:
        return int(tokens * per_row * 1.02) + 65536
    from geomscope.store.accumulators import bytes_per_part

    rows = min(tokens, shards * 2 * opts.sample_size)
    parts = sum(2 * bytes_per_part(d) for d in widths)
    return int(shards * parts + rows * per_row * 1.02) + 65536 * shards


def _existing_finished_bytes(out: Path, identity: dict) -> int:
    """Bytes of finished shards an earlier run with this identity left in ``out`` (0 if none)."""
    from geomscope.store.manifest import read_manifest, read_parts, with_logged
    from geomscope.store.names import MANIFEST_NAME

    try:
        m = read_manifest(out / MANIFEST_NAME)
    except InputError:
        return 0
    if json.loads(json.dumps(m.get("identity"))) != json.loads(json.dumps(identity)):
        return 0

    listed = [s for s in m.get("shards", []) if isinstance(s, dict) and "index" in s]
    shards = with_logged(listed, read_parts(out, identity)[0])
    return sum(int(s.get("bytes", 0)) for s in shards if (out / s.get("file", "")).exists())
