"""What every command shares: choice types, comma lists and the options that must read the same
everywhere (``--json``, ``--quiet/-q``, ``--layers/-l``, ``--out/-o``, ``--metrics/-m``).

Choices are Enums built from :mod:`geomscope.choices`, so the CLI and the library's validation use
one list; ``--help`` shows them as ``[a|b|c]``.
"""

from __future__ import annotations

import enum

import typer

from geomscope import choices
from geomscope.layers import STORED_LAYERS_HELP  # noqa: F401 (export, plot)
from geomscope.options import declared, default_of


def choice_enum(name: str, values: tuple[str, ...]) -> type[enum.Enum]:
    """A str Enum of ``values``: Typer shows and checks them as the option's choices."""
    return enum.Enum(name, {v: v for v in values}, type=str)


ComputeDtype = choice_enum("ComputeDtype", choices.COMPUTE_DTYPES)
StoreDtype = choice_enum("StoreDtype", choices.STORE_DTYPES)
Stack = choice_enum("Stack", choices.STACKS)
FigureFormat = choice_enum("FigureFormat", choices.FIGURE_FORMATS)


def value(choice) -> str | None:
    """The plain string of an Enum choice (None stays None)."""
    return None if choice is None else getattr(choice, "value", choice)


def split_list(values) -> list[str]:
    """Repeated options and comma-separated lists alike -> one flat list of non-empty items."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [v.strip() for item in values for v in str(item).split(",") if v.strip()]


def json_option(what: str = "the result"):
    return typer.Option(
        False, "--json", help=f"Print {what} as one JSON object on stdout (nothing else there)."
    )


def quiet_option(what: str = "No progress bar or messages."):
    return typer.Option(False, "--quiet", "-q", help=what)


def declared_option(cls, name: str, complete=None):
    """The ``typer.Option`` of field ``name`` of the declared options ``cls``: its default, flag,
    help and metavar come from the declaration, and its value is checked by the library
    (:func:`geomscope.options.check`) with the same words as a library call. A tuple default is
    given as its comma list (the command line's form)."""
    opt = declared(cls)[name]
    flags = [opt.flag] + ([opt.short] if opt.short else [])
    default = default_of(cls, name)
    return typer.Option(
        ",".join(map(str, default)) if isinstance(default, tuple) else default,
        *flags,
        metavar=opt.metavar,
        help=opt.help,
        hidden=opt.hidden,
        autocompletion=complete,
    )


def layers_option(default, help: str, complete=None):
    """``--layers/-l``; ``complete`` (geomscope.cli._complete) supplies shell-completion candidates."""
    return typer.Option(default, "--layers", "-l", metavar="LIST", help=help, autocompletion=complete)


def metrics_option(default, help: str, complete=None):
    return typer.Option(default, "--metrics", "-m", metavar="LIST", help=help, autocompletion=complete)
