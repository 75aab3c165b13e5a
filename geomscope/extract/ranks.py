"""``extract`` as many processes: ``torchrun --nproc-per-node N -m geomscope extract ...``,
``accelerate launch -m geomscope extract ...`` or ``srun`` (geomscope.distributed reads the rank).

Shards are defined as in one process (shard k = the k-th run of ``--shard-docs`` non-empty
documents), so they do not depend on the number of processes: shard k is written by process
k mod N, which makes every document's process a function of its document id and the inputs. Every
process reads the inputs (cheap next to the model) and skips the shards that are not its own.

Process 0 opens the run directory as one process would (identity check, ``--overwrite``, resume,
the lock that keeps other commands out), then the others join it. Each process > 0 records its
finished shards in its own shard log (``.geomscope-rank-<r>.jsonl``); process 0 writes the manifest,
and when every process is done it folds the parts in and finalizes the run with the same totals a
single process would have written. A process killed mid-run loses only its unfinished shard: the
shard logs outlive it, and rerunning the command -- with any number of processes -- folds them in
and writes only what is missing.

The processes meet at four points (plan, open, shards written, run finalized); at each, a failure
of any process becomes every process's error (geomscope.distributed.agree), so all exit non-zero
with the one line, and a process that died makes the others fail after GEOMSCOPE_DIST_TIMEOUT
instead of waiting for ever.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from geomscope import distributed as dd
from geomscope.errors import InputError
from geomscope.extract.plan import load_for_run, plan_run, scan_and_hash
from geomscope.extract.shards import ShardRun, done_line, open_run, refuse_nonfinite
from geomscope.formatting import counted
from geomscope.progress import Log, log_to, silent


def _together(d, fn):
    """Run ``fn`` here, then learn whether every process succeeded (a failure anywhere raises)."""
    result, failure = None, None
    try:
        result = fn()
    except Exception as e:  # passed to the others, then raised here
        failure = e
    dd.agree(d, failure)
    return result


def _share_json(d, obj):
    """Process 0's JSON-able ``obj`` on every process (as bytes in tensors: nothing is unpickled)."""
    import torch
    import torch.distributed as dist

    raw = json.dumps(obj).encode() if d.rank == 0 else b""
    size = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=d.reg_group)
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if d.rank == 0:
        buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=d.reg_group)
    return json.loads(bytes(buf.tolist()).decode())


def check_options(opts, inputs) -> None:
    """What a run of several processes cannot do, refused before anything starts."""
    from geomscope.extract.sources import is_stream

    if opts.max_tokens is not None:
        raise InputError(
            "--max-tokens cuts the run where the running total of rows reaches it, which depends on "
            "every earlier shard; use --max-docs with several processes, or run one process"
        )
    streams = [i for i in inputs if is_stream(i)]
    if streams:
        raise InputError(
            f"several processes cannot share {streams[0]} (stdin or a pipe); give the input as a file"
        )


def extract_ranks(model, inputs, out: Path, opts, *, progress: bool, log: Log | None, stdin) -> dict:
    """The multi-process ``extract`` (see the module docstring); every process returns the summary."""
    from geomscope.extract.sources import close_inputs, open_inputs
    from geomscope.store.manifest import RankWriter

    d = dd.setup(opts.device, backend="gloo")  # coordination only: small CPU tensors
    writer = None
    try:
        is_main = d.rank == 0
        say = log_to(log) if is_main else silent
        t_start = time.perf_counter()
        ins = open_inputs([str(i) for i in inputs], stdin=stdin)
        try:
            local = _device_of(opts, d)

            def plan():
                from geomscope.extract.sources import check_out_outside_inputs

                check_out_outside_inputs(ins, out)
                scan = scan_and_hash(ins, local)
                lm = load_for_run(model, local, say)
                return scan, lm, plan_run(lm, ins, scan, local, out)

            scan, lm, p = _together(d, plan)
            _together(d, lambda: _check_same_request(d, p.identity))
            say(p.describe(lm, out, scan.docs) + f"; {counted(d.world_size, 'process', 'processes')}")
            for note in p.notes:
                say(note)
            # process 0 opens (or resumes) the run; then the others join it
            opened = _together(d, lambda: _open_main(out, p, lm, local, scan, d) if is_main else None)
            writer = _together(d, lambda: opened if is_main else RankWriter(out, d.rank))
            shard_run = ShardRun(writer, lm, ins, p, local, progress and is_main)
            shard_run.rank, shard_run.world = d.rank, d.world_size
            seconds = _together(d, shard_run.write_shards)
            new_rows, written, seconds = _run_totals(d, shard_run, seconds)

            def finish():
                if not is_main:
                    return None
                writer.fold_parts()
                summary = shard_run.finish(seconds, new_rows, written)
                summary["processes"] = d.world_size
                summary["seconds_total"] = round(time.perf_counter() - t_start, 3)
                summary["estimate"] = {"tokens": p.est_tokens, "bytes": p.est_bytes}
                return summary

            summary = _together(d, finish)
            summary = _share_json(d, summary)
        finally:
            close_inputs(ins)
    finally:
        if writer is not None:
            writer.release()
        dd.teardown(d)
    say(done_line(summary))
    refuse_nonfinite(summary, opts, out)
    return summary


def _comparable(identity: dict) -> dict:
    """What of a process's identity must equal process 0's: everything but where the files lie
    (each node may mount the model and the inputs at its own paths)."""
    out = {k: v for k, v in identity.items() if k != "dataset"}
    out["model"] = {k: v for k, v in (identity.get("model") or {}).items() if k != "name"}
    out["inputs"] = [{k: v for k, v in i.items() if k != "path"} for i in identity.get("inputs", [])]
    return out


def _check_same_request(d, identity: dict) -> None:
    """Only process 0's identity meets the run's manifest, so every other process proves here that it
    would extract the same rows: the same input bytes, model, layers and options. On several nodes a
    node with other local files (another copy of the corpus, another checkpoint at the same path)
    mixed its rows into the run."""
    from geomscope.store.manifest import identity_differences

    mine = _comparable(identity)
    first = _share_json(d, mine)
    if d.rank != 0 and first != mine:
        diffs = identity_differences(first, mine)
        raise InputError(
            f"process {d.rank} would extract other rows than process 0 ({'; '.join(diffs[:2])}; "
            "'in the run' is process 0's); give every process the same inputs, model and options"
        )


def _device_of(opts, d):
    """``--device auto``: this process's own GPU (its local rank) where there are GPUs; a
    ``--device-map`` places the model itself."""
    from dataclasses import replace

    if str(opts.device) != "auto" or opts.device_map is not None:
        return opts
    return replace(opts, device=str(d.device))


def _run_totals(d, shard_run, seconds: float) -> tuple[int, int, float]:
    """(rows written, shards written) summed over the processes, and the slowest one's seconds:
    the run took as long as its slowest process."""
    import torch
    import torch.distributed as dist

    counts = dd.all_reduce_sum(torch.tensor([shard_run.new_rows, shard_run.written], dtype=torch.float64), d)
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=d.reg_group)
    return int(counts[0]), int(counts[1]), float(slowest[0])


def _open_main(out: Path, p, lm, opts, scan, d):
    """Process 0 opens (or resumes) the run and saves its manifest at once: the others join it."""
    writer = open_run(out, p, lm, opts, scan.docs, processes=d.world_size)
    writer.update()
    return writer
