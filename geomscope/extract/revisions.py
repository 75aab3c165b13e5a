"""Many checkpoints of one model, one run each: ``extract MODEL INPUT --revisions SPEC --out DIR``.

``SPEC`` is a comma list of hub revisions (``step0,step7000``), a preset (:data:`PRESETS`), a text
file with one revision per line, or local checkpoint directories (a glob such as
``ft_out/checkpoints/*``, or a comma list of directories). Each revision is extracted with the same
options into ``DIR/<name>/`` (the revision, or the checkpoint directory's name), one after another,
each model freed before the next. A finished run is skipped on rerun when it was asked for exactly
as now (:func:`_skip`: the model's files or commit, the inputs' hashes and the options, compared
without loading the model); otherwise the revision is extracted as a single extract would: an
unfinished run resumes, a finished one is found complete, one made differently is refused naming
the differences (``--overwrite`` redoes them all). A revision that fails is reported and the others
go on; the call then fails naming every failed revision, with the finished runs intact.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from geomscope.errors import GeomscopeError, InputError
from geomscope.fileio import make_dirs

#: Machina & Mercer (NAACL 2024), as their released code lists the Pythia revisions:
#: step0 and step{int(i * 143 / 20)}000 for i = 1..20 (step7000 ... step143000).
PRESETS = {"pythia-mm21": ("step0", *(f"step{int(i * 143 / 20)}000" for i in range(1, 21)))}

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Revision:
    """One checkpoint to extract: ``model`` at hub ``revision`` (None for a local directory), into
    the run directory named ``name``."""

    name: str
    model: str
    revision: str | None


def _safe_name(label: str) -> str:
    name = _SAFE.sub("_", label).strip("._") or "revision"
    return name


def _is_glob(item: str) -> bool:
    from geomscope.extract.models import _is_glob as is_glob

    return is_glob(item)


def _is_hub_id(model: str) -> bool:
    """Whether a revision of ``model`` is a hub revision, as extract's resolver reads the pair (a
    local directory and bundled:minilm have none; an alias of the bundled model at a revision is its
    hub repository). A name that cannot be a model is not one: extract reports it."""
    from geomscope.extract.models import resolve_model

    try:
        return resolve_model(model, "any-revision", reach_hub=False)[1]["source"] == "hub"
    except InputError:
        return False


def _is_bare(item: str) -> bool:
    """A name with no path in it (``step1000``): of a hub model, a revision, whatever the cwd holds."""
    return "/" not in item and "\\" not in item and not item.startswith((".", "~"))


def resolve_revisions(model: str, spec: str) -> list[Revision]:
    """The checkpoints ``spec`` names (see the module docstring); InputError (one line) for an empty
    list, a glob that matches no directory, or two revisions that would share a run directory.

    Of a hub model, a bare name (no ``/``, not starting with ``.`` or ``~``) is a revision: a folder
    of that name in the current directory once replaced ``org/model@step1000`` silently; when one
    exists, the ambiguity is refused (``./step1000`` names the folder)."""
    from geomscope.extract.models import checkpoint_dirs

    spec = (spec or "").strip()
    if spec in PRESETS:
        items = list(PRESETS[spec])
    elif spec and not _is_glob(spec) and "," not in spec and Path(spec).is_file():
        try:
            lines = Path(spec).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(
                f"--revisions file {spec} cannot be read as UTF-8 text ({e}); one revision per line"
            ) from None
        items = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    else:
        items = [s.strip() for s in spec.split(",") if s.strip()]
    out: list[Revision] = []
    hub = _is_hub_id(model)
    for item in items:
        if _is_glob(item):
            dirs = checkpoint_dirs(item)
            if not dirs:
                raise InputError(f"--revisions {item!r} matches no directory; give checkpoint directories")
            out += [Revision(_safe_name(d.name), str(d), None) for d in dirs]
        elif hub and _is_bare(item):
            if Path(item).is_dir():
                raise InputError(
                    f"--revisions {item!r} is both a revision of {model} and a folder here; write "
                    f"./{item} for the folder, or run from another directory for the revision"
                )
            out.append(Revision(_safe_name(item), model, item))
        elif Path(item).is_dir():
            out.append(Revision(_safe_name(Path(item).name), item, None))
        else:
            out.append(Revision(_safe_name(item), model, item))
    if not out:
        presets = ", ".join(PRESETS)
        raise InputError(
            f"--revisions {spec!r} names no revision; give a comma list, a file, a glob of "
            f"checkpoint directories, or a preset ({presets})"
        )
    seen: dict[str, str] = {}
    for r in out:
        label = r.revision or r.model
        if r.name in seen and seen[r.name] != label:
            raise InputError(
                f"--revisions: {seen[r.name]} and {label} would share the run directory {r.name}/; "
                "give them distinct names"
            )
        seen[r.name] = label
    return list({r.name: r for r in out}.values())


def _snapshots_present(rev: Revision, cache_dir: str | None) -> set[str] | None:
    """The names under the repository's ``snapshots/`` in the hub cache now (None for a local
    checkpoint directory, or a cache that cannot be listed)."""
    if rev.revision is None:
        return None
    from geomscope.extract.models import repo_cache_dir

    try:
        folder = repo_cache_dir(rev.model, cache_dir) / "snapshots"
        return {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    except (OSError, ImportError, ValueError):
        return None


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
    changed since (run.py's _signatures): one read of the inputs per call, not one per revision."""

    def __init__(self, args: list[str]):
        self.args, self.ins, self.signatures = args, None, None

    def __call__(self):
        from geomscope.extract.run import _signatures
        from geomscope.extract.sources import hash_input, open_inputs

        if self.ins is None:
            self.ins = open_inputs(self.args)
        now = _signatures(self.ins)  # before the hash: a change while hashing is seen next time
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
    request (run.py's run_request), never assumed; a run without one (from before geomscope recorded
    it) is extracted again, which finds it complete at the cost of a load."""
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
        return False, f"complete, but what is asked cannot be checked ({str(e).splitlines()[0][:120]})"
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
    if rev.revision is None:
        return None
    from geomscope.extract.models import _cached_snapshot

    return _cached_snapshot(rev.model, rev.revision, cache_dir)


def drop_snapshot(snap: Path) -> int:
    """Delete one hub-cache snapshot directory and the blobs that no other snapshot of the repository
    links to; return the bytes freed. Anything that does not look like a hub cache entry
    (``models--*/snapshots/<commit>``) is left alone and 0 returned."""
    snap = Path(snap)
    repo = snap.parent.parent
    if snap.parent.name != "snapshots" or not repo.name.startswith("models--") or snap.is_symlink():
        return 0
    blobs = (repo / "blobs").resolve()

    def targets(root: Path) -> set[Path]:
        out = set()
        for f in root.rglob("*"):
            if f.is_symlink():
                t = Path(os.path.realpath(f))
                if t.parent == blobs:
                    out.add(t)
        return out

    mine = targets(snap)
    others: set[Path] = set()
    for other in (repo / "snapshots").iterdir():
        if other != snap and other.is_dir() and not other.is_symlink():
            others |= targets(other)
    freed = 0
    for t in mine - others:
        if t.is_file():
            freed += t.stat().st_size
            t.unlink()
    for f in snap.rglob("*"):  # files stored in the snapshot itself (no blob)
        if f.is_file() and not f.is_symlink():
            freed += f.stat().st_size
    shutil.rmtree(snap)
    return freed


def extract_revisions(
    model,
    inputs,
    out,
    revisions: list[Revision],
    options,
    *,
    drop_weights: bool = False,
    progress=False,
    log=None,
    stdin=None,
):
    """Extract every revision into ``out/<name>/`` with the same ``options``; return
    ``{"runs": [{revision, dir, status: done|skipped|failed, error?, rows?}], "failed": n}``.
    Raises the first failure's kind of error (one line naming every failed revision) after trying
    them all, with ``.summary`` set."""
    from geomscope.extract.run import extract
    from geomscope.extract.sources import is_stream

    say = log or (lambda msg: None)
    args = [str(i) for i in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    streams = [i for i in args if is_stream(i)]
    if len(revisions) > 1 and streams:
        raise InputError(
            f"{streams[0]} can be read once (stdin or a pipe); save the text to a file to extract "
            "several revisions"
        )
    out = Path(out)
    make_dirs(out)
    runs, failures = [], []
    hashed = _Hashed(args)
    try:
        for i, rev in enumerate(revisions, 1):
            run_dir = out / rev.name
            label = rev.revision or rev.model
            entry = {"revision": label, "dir": str(run_dir)}
            skip, why = (False, "") if options.overwrite else _skip(run_dir, rev, hashed, options, streams)
            if skip:
                say(f"[{i}/{len(revisions)}] {label}: {why} in {run_dir}, skipped")
                runs.append({**entry, "status": "skipped"})
                continue
            say(f"[{i}/{len(revisions)}] {label} -> {run_dir}" + (f" ({why})" if why else ""))
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
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                say(f"[{i}/{len(revisions)}] {label} failed: {first}")
                runs.append({**entry, "status": "failed", "error": first})
                failures.append((label, e))
            finally:
                _free()
    finally:
        hashed.close()
    result = {"runs": runs, "failed": len(failures), "out": str(out)}
    if failures:
        label, first = failures[0]
        names = ", ".join(f"{lab} ({str(e).strip().splitlines()[0][:400]})" for lab, e in failures[:3])
        more = f" and {len(failures) - 3} more" if len(failures) > 3 else ""
        err = type(first)(
            f"{len(failures)} of {len(revisions)} revisions failed: {names}{more}; the finished runs in "
            f"{out} are kept -- fix the cause and rerun the same command to do the rest"
        )
        err.summary = result
        raise err
    return result
