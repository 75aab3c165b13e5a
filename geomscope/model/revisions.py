"""The checkpoints ``extract MODEL INPUT --revisions SPEC`` names, one run each.

``SPEC`` is a comma list of hub revisions (``step0,step7000``), a preset (:data:`PRESETS`), a text
file with one revision per line, or local checkpoint directories (a glob such as
``ft_out/checkpoints/*``, or a comma list of directories). Each becomes a :class:`Revision`: the
model to load, its hub revision, and the name of its run directory (the revision, or the checkpoint
directory's name). The extraction of each is :func:`geomscope.extract.revisions.extract_revisions`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from geomscope.errors import InputError
from geomscope.model.names import checkpoint_dirs, is_glob, resolve_model

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
    """A run directory's name for a revision label: runs of other characters than ``A-Za-z0-9._-``
    become ``_``."""
    name = _SAFE.sub("_", label).strip("._") or "revision"
    return name


def _is_hub_id(model: str) -> bool:
    """Whether a revision of ``model`` is a hub revision, as :func:`resolve_model` reads the pair (a
    local directory and bundled:minilm have none; an alias of the bundled model at a revision is its
    hub repository). A name that cannot be a model is not one: extract reports it."""
    try:
        return resolve_model(model, "any-revision", reach_hub=False)[1]["source"] == "hub"
    except InputError:
        return False


def _is_bare(item: str) -> bool:
    """A name with no path in it (``step1000``): of a hub model, a revision, whatever the cwd holds."""
    return "/" not in item and "\\" not in item and not item.startswith((".", "~"))


def _refuse_control_characters(item: str) -> None:
    """InputError (one line) for a revision holding a control character: a newline in a --revisions
    value is no separator (a comma is; a file takes one per line), and such a name, cut at its
    first line in a message, would read as the part before it."""
    bad = next((c for c in item if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise InputError(
            f"--revisions {item!r} holds the control character {bad!r}; give a comma list (step0,step1000) "
            "or a file with one revision per line"
        )


def resolve_revisions(model: str, spec: str) -> list[Revision]:
    """The checkpoints ``spec`` names (see the module docstring); InputError (one line) for an empty
    list, a glob that matches no directory, a revision holding a control character, or two revisions
    that would share a run directory.

    Of a hub model, a bare name (no ``/``, not starting with ``.`` or ``~``) is a revision, never a
    folder of that name in the current directory; when such a folder exists, the ambiguity is
    refused (``./step1000`` names the folder)."""
    spec = (spec or "").strip()
    if spec in PRESETS:
        items = list(PRESETS[spec])
    elif spec and not is_glob(spec) and "," not in spec and Path(spec).is_file():
        try:
            lines = Path(spec).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(
                f"--revisions file {spec} cannot be read as UTF-8 text ({e}); one revision per line"
            ) from None
        items = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    else:
        items = [s.strip() for s in spec.split(",") if s.strip()]
    for item in items:
        _refuse_control_characters(item)
    out: list[Revision] = []
    hub = _is_hub_id(model)
    for item in items:
        if is_glob(item):
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
