"""What every command shares: the typer option of a declared option, comma lists, and the options
that must read the same everywhere (``--json``, ``--quiet/-q``, ``--out/-o``).

A declared option (:mod:`geomscope.options`) gives its typer option its default, flags, help and
metavar; the value is checked by the library, so a value given on the command line and one given
to the library function meet the same rule and the same one-line error.
"""

from __future__ import annotations

import inspect
import typing
from typing import List, Optional

import typer
from typer.models import ArgumentInfo

from geomscope.options import REQUIRED, Flag, Interval, declared, default_of


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


def out_option(metavar: str, help: str, *, required: bool = True):
    """``--out/-o``: where a command writes (required unless the command has a default place)."""
    return typer.Option(... if required else None, "--out", "-o", metavar=metavar, help=help)


def declared_option(cls, name: str, complete=None, *, repeated: bool = False):
    """The ``typer.Option`` of field ``name`` of the declared options ``cls``: its default, flags,
    help and metavar come from the declaration, and its value is checked by the library
    (:func:`geomscope.options.check`) with the same words as a library call. A tuple default is
    given as its comma list (the command line's form); a ``REQUIRED`` option must be given.
    ``repeated``: a list option given as often as wanted, each time a comma list (typer takes its
    default as a list: the one comma list, or none). A ``negated`` flag (``--no-verify``) sets its
    field, True by default, to False."""
    opt = declared(cls)[name]
    flags = [f"{opt.flag}/{opt.off}" if opt.off else opt.flag] + ([opt.short] if opt.short else [])
    default = default_of(cls, name)
    if opt.negated:  # the flag given: False; left out: the default, True
        return typer.Option(False, opt.flag, help=opt.help, hidden=opt.hidden, callback=_negated)
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


def _negated(given: bool) -> bool:
    """The value of a ``negated`` flag's field: False where the flag is given."""
    return not given


def option_type(cls, name: str, *, repeated: bool = False):
    """The Python type typer reads the declared option ``name`` of ``cls`` as: a list of strings for
    a repeated option, bool for a :class:`~geomscope.options.Flag`, int or float for an
    :class:`~geomscope.options.Interval`, else str (the library reads and checks the text);
    ``Optional`` where the default is None."""
    constraint = declared(cls)[name].constraint
    if repeated:
        kind = List[str]
    elif isinstance(constraint, Flag):
        kind = bool
    elif isinstance(constraint, Interval):
        kind = int if constraint.whole else float
    else:
        kind = str
    return Optional[kind] if default_of(cls, name) is None else kind


def options_from(cls, *, complete: dict | None = None, repeated: tuple[str, ...] = ()):
    """Decorate a command function: one typer option per declared option of ``cls``, built by
    :func:`declared_option` with the type of :func:`option_type` and passed to the function in its
    ``**chosen`` by field name, unless the function declares a parameter of that name itself (a
    grid's comma list read as text), which then takes the declaration's place.

    ``--help`` lists the function's arguments, ``--out`` and required options, then the declared
    options in declaration order, then the function's other options. ``complete``: field name -> shell
    completion (:mod:`geomscope.cli._complete`); ``repeated``: the list options that may be given
    more than once."""
    complete = complete or {}

    def decorate(func):
        signature = inspect.signature(func)
        hints = typing.get_type_hints(func)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
            for p in signature.parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        mine = {p.name: p for p in own}
        at_declaration = [
            mine.get(name)
            or inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=declared_option(cls, name, complete.get(name), repeated=name in repeated),
                annotation=option_type(cls, name, repeated=name in repeated),
            )
            for name in declared(cls)
        ]
        first = [p for p in own if _comes_first(p) and p.name not in declared(cls)]
        rest = [p for p in own if p not in first and p.name not in declared(cls)]
        params = first + at_declaration + rest
        func.__signature__ = signature.replace(parameters=params, return_annotation=None)
        func.__annotations__ = {p.name: p.annotation for p in params}
        return func

    return decorate


def _comes_first(param: inspect.Parameter) -> bool:
    """An argument, ``--out`` or a required option: what a command's ``--help`` lists first."""
    info = param.default
    return isinstance(info, ArgumentInfo) or param.name == "out" or getattr(info, "default", None) is ...
