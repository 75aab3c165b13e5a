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

The steps live beside this module: extract/plan.py scans and hashes the inputs, loads the model and
plans the run (identity, layers, estimates); extract/shards.py opens the run directory and writes
the shards; extract/ranks.py runs the same steps as several processes.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from geomscope.extract.options import ExtractOptions
from geomscope.extract.plan import (
    NOTHING_WRITTEN,
    check_unchanged,
    input_identity,
    load_for_run,
    plan_run,
    scan_and_hash,
)
from geomscope.extract.shards import ShardRun, done_line, open_run, refuse_nonfinite
from geomscope.extract.sources import check_out_outside_inputs, close_inputs, open_inputs
from geomscope.progress import Log, log_to


def extract(
    model,
    inputs,
    out,
    options: ExtractOptions | None = None,
    *,
    progress: bool = False,
    log: Log | None = None,
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

    opts = replace(options or ExtractOptions(), **overrides).validate()
    say = log_to(log)
    out = Path(out)
    args = [str(i) for i in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    if world_from_env()[1] > 1:  # torchrun / accelerate launch / srun: extract/ranks.py
        from geomscope.extract.ranks import check_options, extract_ranks

        check_options(opts, args)
        return extract_ranks(model, args, out, opts, progress=progress, log=log, stdin=stdin)
    t_start = time.perf_counter()
    ins = open_inputs(args, stdin=stdin)
    try:
        summary, plan = _run_opened(model, ins, out, opts, progress, say)
    finally:
        close_inputs(ins)
    summary["seconds_total"] = round(time.perf_counter() - t_start, 3)
    summary["estimate"] = {"tokens": plan.est_tokens, "bytes": plan.est_bytes}
    say(done_line(summary))
    refuse_nonfinite(summary, opts, out)
    return summary


def _run_opened(model, ins, out: Path, opts: ExtractOptions, progress: bool, say):
    """The run over opened inputs in this process: scan and hash them, load and plan, write the
    shards; (the summary, the plan)."""
    check_out_outside_inputs(ins, out)
    scan = scan_and_hash(ins, opts)
    # before the load: what extract --revisions computes, without loading, to skip a finished run
    request = run_request(model, ins, opts)
    lm = load_for_run(model, opts, say)
    if request is not None and request["model"]["source"] == "hub":
        request["model"]["commit"] = lm.info.get("commit")  # the commit the rows come from
    plan = plan_run(lm, ins, scan, opts, out)
    # a change while the model loaded (often the longest wait) is found before the run is made
    check_unchanged(ins, scan.signatures, NOTHING_WRITTEN)
    say(plan.describe(lm, out, scan.docs))
    for note in plan.notes:
        say(note)
    # the manifest is saved with the first shard (one fsync pair less per call; nothing depends on
    # it earlier). The request is this call's: the run's identity is the same as before
    # (RunWriter refuses another), so any request that reached it asked for the same rows.
    with open_run(out, plan, lm, opts, scan.docs, request=request) as writer:
        summary = ShardRun(writer, lm, ins, plan, opts, progress).run()
    return summary, plan


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
    # no hub request: a revision missing from the cache is compared by name (request_differences)
    rec = model_request(str(model), opts.revision, opts.cache_dir)
    if rec is None:
        return None
    asked = {k: v for k, v in opts.to_dict().items() if k not in _NOT_REQUESTED}
    if asked.get("modules") is None:  # a run that stores no module records no modules key
        asked.pop("modules", None)
    # as JSON holds it (tuples are lists), so that a stored request compares equal
    return json.loads(json.dumps({"model": rec, **input_identity(ins, opts), "options": asked}))


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
