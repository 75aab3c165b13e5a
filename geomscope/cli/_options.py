"""What every command shares: the typer option of a declared option, comma lists, and the options
that must read the same everywhere (``--json``, ``--quiet/-q``).

A declared option (:mod:`geomscope.options`) gives its typer option its default, flags, help and
metavar; the value is checked by the library, so a value given on the command line and one given
to the library function meet the same rule and the same one-line error.
"""

from __future__ import annotations

import typer

from geomscope.options import REQUIRED, declared, default_of


def split_list(values) -> list[str]:
    """Repeated options and comma-separated lists alike -> one flat list of non-empty items."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [v.strip() for item in values for v in str(item).split(",") if v.strip()]


def selection(values: list[str] | None) -> str | None:
    """A repeated ``--layers`` as the one comma list its values make (its grammar refuses an empty
    item, ``-l ""`` too); None where it is not given (every layer)."""
    return ",".join(values) if values else None


def json_option(what: str = "the result"):
    return typer.Option(
        False, "--json", help=f"Print {what} as one JSON object on stdout (nothing else there)."
    )


def quiet_option(what: str = "No progress bar or messages."):
    return typer.Option(False, "--quiet", "-q", help=what)


def declared_option(cls, name: str, complete=None, *, repeated: bool = False):
    """The ``typer.Option`` of field ``name`` of the declared options ``cls``: its default, flags,
    help and metavar come from the declaration, and its value is checked by the library
    (:func:`geomscope.options.check`) with the same words as a library call. A tuple default is
    given as its comma list (the command line's form); a ``REQUIRED`` option must be given.
    ``repeated``: a list option given as often as wanted, each time a comma list (typer takes its
    default as a list: the one comma list, or none)."""
    opt = declared(cls)[name]
    flags = [f"{opt.flag}/{opt.off}" if opt.off else opt.flag] + ([opt.short] if opt.short else [])
    default = default_of(cls, name)
    if default is REQUIRED:
        default = ...
    elif isinstance(default, tuple):
        default = ",".join(map(str, default))
    if repeated and isinstance(default, str):
        default = [default] if default else []
    return typer.Option(
        default,
        *flags,
        metavar=opt.metavar,
        help=opt.help,
        hidden=opt.hidden,
        autocompletion=complete,
    )
