"""Writing a run: the run directory opened with what its manifest records beside the identity
(:func:`open_run`), its shards written in order (:class:`ShardRun`), and the summary and the line
that end an extract (:func:`done_line`, :func:`refuse_nonfinite`).

One process writes every shard, or (extract/ranks.py) each of ``world`` processes writes shard ``k``
where ``k % world`` is its rank; the shards an earlier run finished with the same documents are kept.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path

from geomscope.errors import DataError, InputError
from geomscope.extract.batching import Doc, length_order, plan_batches, tokenize
from geomscope.extract.capture import HeapTrim
from geomscope.extract.layers import LAYER_NOTE
from geomscope.extract.options import ExtractOptions
from geomscope.extract.plan import Plan, check_unchanged, human_bytes
from geomscope.extract.sources import iter_all
from geomscope.extract.storing import StoreThread
from geomscope.formatting import counted
from geomscope.progress import Progress
from geomscope.provenance import package_versions

ROW_ORDER = (
    "shard k = non-empty documents k*shard_docs .. (k+1)*shard_docs-1 in input order; within a shard, "
    "documents by descending token length (ties by doc_id), positions ascending"
)


def open_run(out: Path, plan: Plan, lm, opts: ExtractOptions, docs: int, processes: int = 1, **recorded):
    """The run directory ``out`` opened, or resumed, for ``plan`` (a RunWriter: it checks the
    identity against a run already there, applies ``--overwrite`` and holds the lock that keeps other
    commands out), its manifest holding the model's final norm, sources and versions, what was
    planned, how this invocation runs, and ``recorded`` (the request of a one-process run). The
    manifest is saved with the first shard, or by the caller."""
    from geomscope.store import RunWriter

    writer = RunWriter(out, plan.identity, overwrite=opts.overwrite, extra=_manifest_extra(lm, opts, plan))
    try:
        writer.manifest.update(
            planned_shards=plan.shards,
            planned_docs=docs,
            estimate={"tokens": plan.est_tokens, "bytes": plan.est_bytes},
            last_invocation=_invocation(lm, opts, processes),
            **recorded,
        )
    except BaseException:
        writer.release()  # the lock is never left held
        raise
    return writer


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


def _manifest_extra(lm, opts: ExtractOptions, plan: Plan) -> dict:
    norms = _module_norm_params(lm, plan.modules)
    return {
        "final_norm": _final_norm_params(lm),
        **({"module_norms": norms} if norms else {}),
        "model_source": lm.source,
        "vocab_size": _vocab_size(lm),
        "versions": package_versions(),
        "layer_note": LAYER_NOTE,
        "row_order": ROW_ORDER,
        "max_length_source": (
            "option" if opts.max_length is not None else ("model" if lm.max_length else None)
        ),
    }


def _vocab_size(lm) -> int | None:
    """The token ids the model reads lie below this: the most of its input embedding's rows, its
    tokenizer's ids and its config's ``vocab_size`` (a run's token ids are held below it when it is
    read back); None when none of them is known."""
    try:
        emb = lm.model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        emb = None
    weight = getattr(emb, "weight", None)
    sizes = [
        getattr(emb, "num_embeddings", None),
        weight.shape[0] if getattr(weight, "ndim", 0) == 2 else None,
        len(lm.tokenizer) if lm.tokenizer is not None else None,
        getattr(lm.model.config, "vocab_size", None),
    ]
    known = [int(n) for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return max(known) if known else None


def _final_norm_params(lm) -> dict | None:
    """The final norm's module, gain and bias (per dimension), recorded with the run so that score
    can relate them to the per-dimension variance before the norm without the checkpoint."""
    from geomscope.model.norms import norm_params

    mod = lm.final_norm_module() if lm.final_norm_name else None
    if mod is None:
        return None
    return norm_params(mod, lm.final_norm_name, lm.hidden_size)


def _module_norm_params(lm, modules) -> dict:
    """``{path: parameters}`` (model/norms.py's norm_params) of every norm module ``extract
    --modules`` stores, so that score relates each norm's gain to the variance of its input."""
    from geomscope.model.modules import base_module
    from geomscope.model.norms import norm_params

    base = base_module(lm)
    return {c.path: norm_params(base.get_submodule(c.path), c.path, c.width) for c in modules if c.norm}


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


class ShardRun:
    """Writes the run's shards in order: keeps the finished ones an earlier run left, writes the rest."""

    def __init__(self, writer, lm, ins, plan: Plan, opts: ExtractOptions, progress: bool):
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
        # the layers not D wide (extract --modules: grouped-query keys, MLP intermediates) -> width
        self.dims = {la["name"]: la["dim"] for la in plan.layer_desc if "dim" in la}
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
        check_unchanged(
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
        # a thread while this shard's batches run (the tokenizer releases the GIL): on a GPU,
        # tokenizing MiniLM's sentences costs about two thirds of their forward on 16 cores, and
        # three times it on one. Only where the next shard is surely read: without --max-tokens,
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
        from geomscope.extract.gradients import label_index, label_map

        label2id, n_labels = label_map(self.lm)
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
        kept, rows, budget_hit, stats = self._select(docs)
        sw = self._shard_writer(k, group, rows)
        try:
            keeper = self._sample_keeper() if self.opts.sample_size is not None else None
            measured = self._run_batches(sw, kept, keeper, prog)
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

    def _shard_writer(self, k: int, group, rows: int):
        """The writer of shard ``k``, for the documents of ``group`` and ``rows`` kept rows."""
        doc_start, doc_stop = group[0][0], group[-1][0] + 1
        sample = self.opts.sample_size
        return self.writer.shard_writer(
            k,
            layer_names=self.names,
            dim=self.lm.hidden_size,
            store_dtype=self.opts.store_dtype,
            doc_start=doc_start,
            doc_stop=doc_stop,
            expected_rows=max(1, rows if sample is None else min(rows, 2 * sample)),
            row_flags=("loss_target",) if self.opts.gradients else (),
            dims=self.dims,
        )

    def _sample_keeper(self):
        """A --keep shard's keeper of the sample and the accumulators, made once the previous
        shard's is stored."""
        from geomscope.extract.keep import SampleKeeper

        # the previous shard's keeper (device accumulators of every layer) is written into
        # its shard and freed before this one is made: one keeper at a time, as without the
        # store thread
        self.store.wait_idle()
        return SampleKeeper(
            self.names,
            self.lm.hidden_size,
            self.lm.device,
            self.opts.sample_size,
            self.opts.seed,
            dims=self.dims,
            products=self.opts.products,
        )

    def _run_batches(self, sw, kept: list, keeper, prog) -> int:
        """Forward the kept documents batch by batch, their rows handed to the store thread (or, with
        a ``keeper``, added to it); the number of rows measured."""
        measured = 0
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
        return measured

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


def refuse_nonfinite(summary: dict, opts: ExtractOptions, out: Path) -> None:
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
