"""``extract()``: a checkpoint over texts -> a resumable run directory of HDF5 shards.

Shard ``k`` holds documents ``k*shard_docs .. (k+1)*shard_docs - 1`` of the non-empty documents in
input order (after ``max_docs``), so the plan depends only on the inputs and options: a rerun of the
same command skips the shards the manifest lists as finished and redoes the rest, and the result
equals an uninterrupted run.  Within a shard, documents are processed and stored by descending
length (ties by doc id), in batches cut by a token budget; each batch is moved to the CPU and
appended to the shard before the next one runs, so memory is bounded by one shard's token ids and
one batch's activations, whatever the size of the input.

``max_tokens`` caps the number of rows: documents are taken in input order and the one that reaches
the cap is cut to the tokens that remain (its first positions are kept).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path

from geomscope.errors import DataError, InputError
from geomscope.extract.batching import Doc, length_order, plan_batches, tokenize
from geomscope.extract.layers import LAYER_NOTE, describe_layers, parse_layers
from geomscope.extract.plan import bytes_per_row, check_disk, estimate_tokens, human_bytes, scan_inputs
from geomscope.extract.sources import close_inputs, hash_input, iter_all, open_inputs, uses_column, uses_field
from geomscope.progress import Progress
from geomscope.provenance import package_versions

ROW_ORDER = ("shard k = non-empty documents k*shard_docs .. (k+1)*shard_docs-1 in input order; within a shard, "
             "documents by descending token length (ties by doc_id), positions ascending")


def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be a positive whole number, not {value!r}")


def _groups(inputs, text_field, text_column, shard_docs, max_docs, counts):
    """Lists of ``(doc_id, text)``: consecutive runs of ``shard_docs`` non-empty documents."""
    group: list[tuple[int, str]] = []
    n = 0
    for doc_id, text in iter_all(inputs, text_field=text_field, text_column=text_column):
        counts["records"] += 1
        if not text.strip():
            counts["docs_empty"] += 1
            continue
        group.append((doc_id, text))
        n += 1
        if len(group) == shard_docs:
            yield group
            group = []
        if max_docs is not None and n >= max_docs:
            break
    if group:
        yield group


def _existing_finished_bytes(out: Path, identity: dict) -> int:
    """Bytes of finished shards an earlier run with this identity left in ``out`` (0 if none)."""
    try:
        m = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return 0
    if json.loads(json.dumps(m.get("identity"))) != json.loads(json.dumps(identity)):
        return 0
    return sum(int(s.get("bytes", 0)) for s in m.get("shards", []) if (out / s.get("file", "")).exists())


def extract(
    model,
    inputs: list[str] | str,
    out,
    *,
    layers: str | list = "all",
    revision: str | None = None,
    dtype: str = "float32",
    store_dtype: str = "float16",
    device: str = "auto",
    trust_remote_code: bool = False,
    stack: str | None = None,
    text_field: str = "text",
    text_column: str = "text",
    max_docs: int | None = None,
    max_tokens: int | None = None,
    max_length: int | None = None,
    batch_tokens: int = 8192,
    shard_docs: int = 1000,
    overwrite: bool = False,
    cache_dir: str | None = None,
    progress: bool = False,
    allow_nonfinite: bool = False,
    log=None,
    stdin=None,
) -> dict:
    """Run ``model`` over ``inputs`` and store the requested layers' token rows in the run directory ``out``.

    ``model``: a local directory, a hub name (at ``revision``), ``bundled:minilm``, or a
    :class:`~geomscope.extract.models.LoadedModel` (then ``revision``, ``dtype``, ``device``, ``stack``
    and ``trust_remote_code`` are the ones it was loaded with).  ``layers``: ``all`` | ``0,6,12`` |
    ``4-8`` | ``-1`` (indices into ``output_hidden_states``).  Returns the summary dict that
    ``geomscope extract --json`` prints.  Raises InputError for bad input (nothing written), and
    DataError -- after the run is complete, with the summary as ``.summary`` -- when some activations
    are NaN/Inf, unless ``allow_nonfinite``.
    """
    from geomscope.extract.models import LoadedModel, load_model
    from geomscope.store import RunWriter

    say = log or (lambda msg: None)
    out = Path(out)
    for name, v in (("--max-docs", max_docs), ("--max-tokens", max_tokens), ("--max-length", max_length)):
        _positive(name, v)
    _positive("--batch-tokens", batch_tokens, False)
    _positive("--shard-docs", shard_docs, False)
    if store_dtype not in ("float16", "float32"):
        raise InputError(f"--store-dtype {store_dtype} is not float16 or float32")
    t_start = time.perf_counter()
    if isinstance(inputs, (str, Path)):  # one input given bare
        inputs = [inputs]
    ins = open_inputs([str(i) for i in inputs], stdin=stdin)
    try:
        scan = scan_inputs(ins, text_field=text_field, text_column=text_column, max_docs=max_docs)
        if scan.docs == 0:
            names = ", ".join(i.arg for i in ins)
            raise InputError(f"no text in {names}: {scan.records} records, all empty; give inputs with text"
                             + (" (check --text-field / --text-column)" if scan.records else ""))
        for inp in ins:
            hash_input(inp)
        lm = model if isinstance(model, LoadedModel) else load_model(
            str(model), revision=revision, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
            stack=stack, cache_dir=cache_dir)
        indices = parse_layers(layers, lm.n_hidden_states)
        layer_desc = describe_layers(indices, lm.n_hidden_states, lm.final_norm)
        eff_len = lm.max_length
        if max_length is not None:
            if lm.max_length is not None and max_length > lm.max_length:
                raise InputError(f"--max-length {max_length} exceeds what {lm.info['name']} can read "
                                 f"({lm.max_length} tokens); use at most {lm.max_length}")
            eff_len = max_length
        identity = {
            "model": lm.info,
            "layers": layer_desc,
            "store_dtype": store_dtype,
            "inputs": [i.identity() for i in ins],
            "dataset": "+".join("stdin" if i.kind == "stdin" else Path(i.arg).name for i in ins),
            "text_field": text_field if uses_field(ins) else None,
            "text_column": text_column if uses_column(ins) else None,
            "max_docs": max_docs,
            "max_tokens": max_tokens,
            "max_length": eff_len,
            "truncation": eff_len is not None,
            "add_special_tokens": True,
            "padding": "right",
            "shard_docs": shard_docs,
        }
        try:
            est_tokens = estimate_tokens(scan, lm.tokenizer, eff_len, max_tokens)
        except Exception as e:  # a tokenizer that rejects the options (e.g. max_length below its specials)
            raise InputError(f"the tokenizer of {lm.info['name']} rejects these options ({e}); check --max-length") from e
        est_bytes = int(est_tokens * bytes_per_row(len(indices), lm.hidden_size, store_dtype) * 1.02) + 65536
        already = 0 if overwrite else _existing_finished_bytes(out, identity)
        free = check_disk(out, max(0, est_bytes - already))
        planned = -(-scan.docs // shard_docs)
        say(f"extract: {lm.info['name']} ({lm.info['model_type']}, {lm.stack}, {lm.device}) -> {out}: "
            f"{scan.docs:,} documents in {planned} shards, {len(indices)} layers x {lm.hidden_size} ({store_dtype}); "
            f"about {est_tokens:,} tokens, {human_bytes(est_bytes)} on disk ({human_bytes(free)} free)")
        extra = {"model_source": lm.source, "versions": package_versions(), "layer_note": LAYER_NOTE, "row_order": ROW_ORDER,
                 "max_length_source": ("option" if max_length is not None else ("model" if eff_len else None))}
        with RunWriter(out, identity, overwrite=overwrite, extra=extra) as writer:
            # saved with the first shard (one fsync pair less per call; nothing depends on it earlier)
            writer.manifest.update(
                planned_shards=planned, planned_docs=scan.docs,
                estimate={"tokens": est_tokens, "bytes": est_bytes},
                last_invocation={"device": str(lm.device), "batch_tokens": batch_tokens,
                                 "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
            )
            summary = _run_shards(writer, lm, ins, layer_desc, identity, scan.docs, text_field, text_column,
                                  batch_tokens, progress, say)
    finally:
        close_inputs(ins)
    summary["seconds_total"] = round(time.perf_counter() - t_start, 3)
    summary["estimate"] = {"tokens": est_tokens, "bytes": est_bytes}
    say(f"done: {summary['rows']:,} rows of {summary['docs']:,} documents in {summary['shards']} shards "
        f"({summary['shards_resumed']} kept from an earlier run), {human_bytes(summary['bytes'])}, "
        f"{summary['tokens_per_second']:,.0f} tokens/s")
    if summary["nonfinite_rows"] and not allow_nonfinite:
        by = ", ".join(f"{k}: {v}" for k, v in summary["nonfinite_by_layer"].items())
        err = DataError(f"{summary['nonfinite_rows']} of {summary['rows']} rows hold NaN/Inf activations ({by}); "
                        f"they are stored and flagged in /nonfinite/<layer> of {out}; check the model and --dtype "
                        "(float16 overflows), or pass --allow-nonfinite to accept them")
        err.summary = summary
        raise err
    return summary


def _cut(d: Doc, n: int) -> Doc:
    return Doc(d.doc_id, d.ids[:n], d.special[:n])


def _run_shards(writer, lm, ins, layer_desc, identity, total_docs, text_field, text_column, batch_tokens,
                progress, say) -> dict:
    from geomscope.extract.capture import Capture

    capture = Capture(lm, layer_desc, identity["store_dtype"])
    names = [la["name"] for la in layer_desc]
    shard_docs, max_docs = identity["shard_docs"], identity["max_docs"]
    max_tokens, eff_len = identity["max_tokens"], identity["max_length"]
    finished = writer.finished
    entries = {s["index"]: s for s in writer.manifest["shards"]}
    counts = {"records": 0, "docs_empty": 0}
    agg = {"docs_zero_tokens": 0, "docs_at_max_length": 0, "docs_cut_by_max_tokens": 0}
    nonfinite_by_layer: dict[str, int] = {}
    total_rows = new_rows = written = resumed = 0
    t0 = time.perf_counter()
    with Progress(progress) as bar:
        prog = bar.add("extract", total_docs, unit="docs", rate_unit="tok")
        for k, group in enumerate(_groups(ins, text_field, text_column, shard_docs, max_docs, counts)):
            if max_tokens is not None and total_rows >= max_tokens:
                break
            doc_start, doc_stop = group[0][0], group[-1][0] + 1
            done = finished.get(k)
            if done is not None and (done.doc_start, done.doc_stop) == (doc_start, doc_stop):
                stats = entries[k].get("stats", {})
                total_rows += done.rows
                resumed += 1
                for key in agg:
                    agg[key] += int(stats.get(key, 0))
                for key, v in (stats.get("nonfinite_by_layer") or {}).items():
                    nonfinite_by_layer[key] = nonfinite_by_layer.get(key, 0) + int(v)
                prog.skip(len(group))
                continue
            try:
                docs = tokenize(lm.tokenizer, group, eff_len)
            except Exception as e:
                raise InputError(f"the tokenizer of {lm.info['name']} failed on documents {doc_start}.."
                                 f"{doc_stop - 1} ({type(e).__name__}: {e}); check --max-length") from e
            stats = {"docs_zero_tokens": 0, "docs_at_max_length": 0, "docs_cut_by_max_tokens": 0}
            kept, rows, budget_hit = [], 0, False
            for d in docs:
                if len(d) == 0:
                    stats["docs_zero_tokens"] += 1
                    continue
                if eff_len is not None and len(d) >= eff_len:
                    stats["docs_at_max_length"] += 1
                if max_tokens is not None:
                    left = max_tokens - total_rows - rows
                    if left <= 0:
                        budget_hit = True
                        break
                    if len(d) > left:
                        d = _cut(d, left)
                        stats["docs_cut_by_max_tokens"] += 1
                kept.append(d)
                rows += len(d)
            sw = writer.shard_writer(k, layer_names=names, dim=lm.hidden_size, store_dtype=identity["store_dtype"],
                                     doc_start=doc_start, doc_stop=doc_stop, expected_rows=max(1, rows))
            try:
                for batch in plan_batches(length_order(kept), batch_tokens):
                    arrays, meta = capture(batch)
                    sw.append(arrays, **meta)
                    prog.advance(len(batch), work=len(meta["token_id"]))
                info = sw.close()
            except BaseException:
                sw.abort()
                raise
            if sw.nonfinite_by_layer:
                stats["nonfinite_by_layer"] = dict(sw.nonfinite_by_layer)
            writer.add_shard(info, stats=stats)
            prog.skip(len(group) - len(kept))
            for key in agg:
                agg[key] += stats[key]
            for key, v in sw.nonfinite_by_layer.items():
                nonfinite_by_layer[key] = nonfinite_by_layer.get(key, 0) + v
            total_rows += info.rows
            new_rows += info.rows
            written += 1
            if budget_hit or (max_tokens is not None and total_rows >= max_tokens):
                break
    seconds = time.perf_counter() - t0
    shards = writer.manifest["shards"]
    totals = {"rows": sum(s["rows"] for s in shards), "docs": sum(s["docs"] for s in shards),
              "records_read": counts["records"], "docs_empty": counts["docs_empty"], **agg,
              "nonfinite_by_layer": nonfinite_by_layer}
    writer.finalize(totals)
    t = writer.manifest["totals"]
    return {
        "run_dir": str(writer.dir),
        "complete": True,
        "model": lm.info["name"],
        "revision": lm.info["revision"],
        "commit": lm.info["commit"],
        "device": str(lm.device),
        "layers": [la["name"] for la in layer_desc],
        "hidden_size": lm.hidden_size,
        "store_dtype": identity["store_dtype"],
        "rows": t["rows"],
        "docs": t["docs"],
        "records_read": counts["records"],
        "docs_empty": counts["docs_empty"],
        **agg,
        "shards": t["shards"],
        "shards_written": written,
        "shards_resumed": resumed,
        "bytes": t["bytes"],
        "nonfinite_rows": t["nonfinite_rows"],
        "nonfinite_by_layer": nonfinite_by_layer,
        "rows_this_run": new_rows,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(new_rows / seconds, 1) if seconds > 0 else 0.0,
        "batch_tokens": batch_tokens,
    }
