"""Command-line interface: thin typed wrappers over the library.

Each command lives in its own module and registers itself on :data:`app`. :func:`main` is the one
place where failures become what a user sees: a :class:`~geomscope.errors.GeomscopeError` or a
usage error (bad type, out of range, unknown option, missing argument) becomes one ``error: ...``
line on stderr and a non-zero exit (2 for bad input and usage, 3 for data that cannot give a
number); Ctrl-C says that finished work is kept; an input that ends early (an ``EOFError``, which click
would take for Ctrl-D) and running out of memory are said as such. ``geomscope --debug ...`` shows
the traceback.
"""

from __future__ import annotations

import sys

import typer

from geomscope.cli import compare, export, extract, finetune, inspect, plot, report, score  # noqa: F401
from geomscope.cli._app import app, state
from geomscope.errors import GeomscopeError

INTERRUPTED = "error: interrupted; finished work is kept, rerun the same command to resume"


def _first_line(text: str, fallback: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else fallback


def _usage_error_line(e: Exception) -> str:
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else "geomscope"
    message = _first_line(e.format_message(), type(e).__name__).replace("Value error, ", "")
    return f"error: {message} (see '{where} --help')"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``geomscope`` console script (and ``python -m geomscope``)."""
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]  # bare `geomscope`: the help
    debug = "--debug" in args
    state["argv"] = ["geomscope", *args]  # the provenance of what a command writes (score reports)
    try:
        code = app(args=args, prog_name="geomscope", standalone_mode=False)
    except GeomscopeError as e:
        if debug or state["debug"]:
            raise
        print(f"error: {_first_line(str(e), type(e).__name__)}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort) as e:
        if isinstance(e.__cause__, EOFError):  # click reads an EOFError as Ctrl-D: here, a file cut short
            if debug or state["debug"]:
                raise
            why = _first_line(str(e.__cause__), "it ended early")
            print(
                f"error: an input file ended before its end ({why}); check that it is whole", file=sys.stderr
            )
            sys.exit(2)
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except MemoryError as e:  # what no check before could foresee: one line, not numpy's traceback
        if debug or state["debug"]:
            raise
        why = _first_line(str(e), "an allocation failed")
        print(
            f"error: out of memory ({why}); give the command less data at once or more memory",
            file=sys.stderr,
        )
        sys.exit(1)
    except typer.TyperException as e:  # click's usage errors (bad value, unknown option, missing argument)
        if debug:
            raise
        print(_usage_error_line(e), file=sys.stderr)
        sys.exit(2 if getattr(e, "exit_code", 2) in (1, 2) else e.exit_code)
    if code == 130:  # Typer turns Ctrl-C inside a command into exit code 130
        print(INTERRUPTED, file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main"]
