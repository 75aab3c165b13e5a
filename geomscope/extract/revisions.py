"""Many checkpoints of one model, one run each: ``extract MODEL INPUT --revisions SPEC --out DIR``.

``SPEC`` names the checkpoints (:func:`geomscope.model.revisions.resolve_revisions`). Each revision
is extracted with the same options into ``DIR/<name>/`` (the revision, or the checkpoint directory's
name), one after another, each model freed before the next. A finished run is skipped on rerun when
it was asked for exactly as now (:func:`_skip`: the model's files or commit, the inputs' hashes and
the options, compared without loading the model); otherwise the revision is extracted as a single
extract would: an unfinished run resumes, a finished one is found complete, one made differently
is refused naming the differences (``--overwrite`` redoes them all). A revision that fails is
reported and the others go on; the call then fails naming every failed revision, with the finished
runs intact.
"""

from __future__ import annotations

import gc
from pathlib import Path

from geomscope.errors import GeomscopeError, InputError, first_line
from geomscope.fileio import make_dirs
from geomscope.model.hub import cached_snapshot, drop_snapshot, snapshot_names
from geomscope.model.revisions import Revision
from geomscope.progress import Log, log_to


def _snapshots_present(rev: Revision, cache_dir: str | None) -> set[str] | None:
    """The names under the repository's ``snapshots/`` in the hub cache now (None for a local
    checkpoint directory, or a cache that cannot be listed)."""
    if rev.revision is None:
        return None
    return snapshot_names(rev.model, cache_dir)


def _drop(rev: Revision, cache_dir: str | None, present_before: set[str] | None, say, label: str) -> int:
    """--drop-weights after a complete run: delete the snapshot this call downloaded, that is one
    whose folder was not in the cache before the call (never a local checkpoint directory).

    Decided by the folder, not by whether the revision's ref resolved before: a download of a ref
    the cache lacked (Pythia's main) whose commit another ref already held (step143000) writes only
    the ref, and the snapshot that was there before is not this call's to delete."""
    if rev.revision is None:
        say(f"  {label}: a local checkpoint directory, kept (--drop-weights removes downloads only)")
        return 0
    snap = _snapshot(rev, cache_dir)
    if snap is None:
        say(f"  {label}: no snapshot of it found in the cache, nothing dropped")
        return 0
    if present_before is None or snap.name in present_before:
        say(f"  {label}: its snapshot was in the cache before this run, kept")
        return 0
    freed = drop_snapshot(snap)
    say(f"  {label}: dropped its downloaded snapshot ({freed / 2**20:.1f} MiB)")
    return freed


class _Hashed:
    """The inputs, opened and hashed once for every revision's request, and again only when a file
    changed since (plan.input_signatures): one read of the inputs per call, not one per revision."""

    def __init__(self, args: list[str]):
        self.args, self.ins, self.signatures = args, None, None

    def __call__(self):
        from geomscope.extract.plan import input_signatures
        from geomscope.extract.sources import hash_input, open_inputs

        if self.ins is None:
            self.ins = open_inputs(self.args)
        now = input_signatures(self.ins)  # before the hash: a change while hashing is seen next time
        if now != self.signatures:
            for inp in self.ins:
                hash_input(inp)
            self.signatures = now
        return self.ins

    def close(self) -> None:
        from geomscope.extract.sources import close_inputs

        close_inputs(self.ins or [])


def _skip(run_dir: Path, rev: Revision, hashed: _Hashed, options, streams: list[str]) -> tuple[bool, str]:
    """(whether the run in ``run_dir`` is complete and was asked for as now, why not or why so).

    Only then is loading the model again needless: what was asked is compared with the run's stored
    request (run.py's run_request), never assumed; a run that records none is extracted
    again, which finds it complete at the cost of a load."""
    from dataclasses import replace

    from geomscope.extract.run import request_differences, run_request
    from geomscope.store.manifest import MANIFEST_NAME, read_manifest

    path = run_dir / MANIFEST_NAME
    if not path.exists():
        return False, ""
    try:
        m = read_manifest(path)
    except GeomscopeError:
        return False, "its manifest is unreadable"
    if not m.get("complete"):
        return False, "unfinished"
    if streams:
        return False, f"complete, but {streams[0]} can be compared only by reading it"
    nonfinite = (m.get("totals") or {}).get("nonfinite_rows")
    if nonfinite and not options.allow_nonfinite:
        return False, f"complete, with {nonfinite} NaN/Inf rows and no --allow-nonfinite"
    try:
        opts = replace(options, revision=rev.revision).validate()  # as extract() makes them
        now = run_request(rev.model, hashed(), opts)
    except GeomscopeError as e:  # extract reports it
        return False, f"complete, but what is asked cannot be checked ({first_line(e, 120)})"
    if now is None:
        return False, "complete, but its model's files cannot be read to compare"
    diffs = request_differences(m.get("request"), now)
    if diffs:
        shown = "; ".join(diffs[:3]) + ("; ..." if len(diffs) > 3 else "")
        return False, f"complete, but asked differently: {shown}"
    by_name = now["model"].get("source") == "hub" and now["model"].get("commit") is None
    return True, "complete and asked for as now" + (
        " (its revision, not in the local cache, compared by name)" if by_name else ""
    )


def _free() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _snapshot(rev: Revision, cache_dir: str | None) -> Path | None:
    """The hub-cache snapshot of a hub revision (None for a local directory, or one not cached)."""
    if rev.revision is None:
        return None
    return cached_snapshot(rev.model, rev.revision, cache_dir)


def check_revisions_request(options, *, revisions: bool, drop_weights: bool) -> None:
    """The rules between ``--revision``, ``--revisions`` and ``--drop-weights``: one checkpoint's
    revision is not given with many, and only a run per revision drops its snapshot. InputError (one
    line) otherwise; :func:`extract_revisions` and the CLI (before it resolves ``--revisions``) ask."""
    if not revisions and drop_weights:
        raise InputError("--drop-weights applies to --revisions runs")
    if revisions and getattr(options, "revision", None) is not None:  # (None: the defaults)
        raise InputError("give either --revision (one checkpoint) or --revisions (many), not both")


def extract_revisions(
    model,
    inputs,
    out,
    revisions: list[Revision],
    options,
    *,
    drop_weights: bool = False,
    progress: bool = False,
    log: Log | None = None,
    stdin=None,
):
    """Extract every revision into ``out/<name>/`` with the same ``options``; return
    ``{"runs": [{revision, dir, status: done|skipped|failed, error?, rows?}], "failed": n}``.
    Raises the first failure's kind of error (one line naming every failed revision) after trying
    them all, with ``.summary`` set; InputError before any of it where ``options`` names a
    ``revision`` (:func:`check_revisions_request`)."""
    check_revisions_request(options, revisions=True, drop_weights=drop_weights)
    say = log_to(log)
    args = [str(i) for i in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    streams = _streams(args, len(revisions))
    out = Path(out)
    make_dirs(out)
    runs, failures = [], []
    hashed = _Hashed(args)
    try:
        for i, rev in enumerate(revisions, 1):
            run_dir = out / rev.name
            label = rev.revision or rev.model
            step = f"[{i}/{len(revisions)}]"
            entry = {"revision": label, "dir": str(run_dir)}
            skip, why = (False, "") if options.overwrite else _skip(run_dir, rev, hashed, options, streams)
            if skip:
                say(f"{step} {label}: {why} in {run_dir}, skipped")
                runs.append({**entry, "status": "skipped"})
                continue
            say(f"{step} {label} -> {run_dir}" + (f" ({why})" if why else ""))
            error = _extract_revision(
                rev,
                run_dir,
                inputs,
                options,
                entry,
                runs,
                step=step,
                drop_weights=drop_weights,
                progress=progress,
                log=log,
                stdin=stdin,
            )
            if error is not None:
                failures.append((label, error))
    finally:
        hashed.close()
    result = {"runs": runs, "failed": len(failures), "out": str(out)}
    if failures:
        raise _failed_revisions(failures, len(revisions), out, result)
    return result


def _streams(args: list[str], n_revisions: int) -> list[str]:
    """The inputs that can be read only once (stdin, a pipe); an InputError when there are several
    revisions to read them for."""
    from geomscope.extract.sources import is_stream

    streams = [i for i in args if is_stream(i)]
    if n_revisions > 1 and streams:
        raise InputError(
            f"{streams[0]} can be read once (stdin or a pipe); save the text to a file to extract "
            "several revisions"
        )
    return streams


def _extract_revision(
    rev: Revision,
    run_dir: Path,
    inputs,
    options,
    entry: dict,
    runs: list[dict],
    *,
    step: str,
    drop_weights: bool,
    progress: bool,
    log: Log | None,
    stdin,
) -> GeomscopeError | None:
    """Extract one revision into ``run_dir`` as a single extract would, appending its outcome to
    ``runs`` (done, with its rows and, under ``drop_weights``, the bytes its dropped download freed;
    or failed, with the error's first line); return the error it failed with (None: done). The model
    is freed afterwards either way."""
    from geomscope.extract.run import extract

    say = log_to(log)
    label = entry["revision"]
    present_before = _snapshots_present(rev, options.cache_dir) if drop_weights else None
    try:
        summary = extract(
            rev.model,
            inputs,
            run_dir,
            options,
            revision=rev.revision,
            progress=progress,
            log=log,
            stdin=stdin,
        )
        runs.append({**entry, "status": "done", "rows": summary.get("rows")})
        if drop_weights:
            runs[-1]["dropped_bytes"] = _drop(rev, options.cache_dir, present_before, say, label)
    except GeomscopeError as e:
        first = first_line(e)
        say(f"{step} {label} failed: {first}")
        runs.append({**entry, "status": "failed", "error": first})
        return e
    finally:
        _free()
    return None


def _failed_revisions(
    failures: list[tuple[str, GeomscopeError]], n_revisions: int, out: Path, result: dict
) -> GeomscopeError:
    """The error that ends a call in which some revisions failed: of the first failure's kind, one
    line naming the first three (and how many more), with ``.summary`` = ``result``."""
    _, first = failures[0]
    names = ", ".join(f"{lab} ({first_line(e, 400)})" for lab, e in failures[:3])
    more = f" and {len(failures) - 3} more" if len(failures) > 3 else ""
    err = type(first)(
        f"{len(failures)} of {n_revisions} revisions failed: {names}{more}; the finished runs in "
        f"{out} are kept -- fix the cause and rerun the same command to do the rest"
    )
    err.summary = result
    return err
