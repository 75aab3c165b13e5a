"""Command-line interface: thin typed wrappers over the library.

Each command lives in its own module and registers itself on :data:`app`. :func:`main` is the one
place where failures become what a user sees: a :class:`~geomscope.errors.GeomscopeError` or a
usage error (bad type, out of range, unknown option, missing argument) becomes one ``error: ...``
line on stderr and a non-zero exit (2 for bad input and usage, 3 for data that cannot give a
number); Ctrl-C, and a SIGTERM (a scheduler's or a container's stop) alike, say what a rerun does
(:func:`rerun_advice`: extract and finetune resume, the others start again), after the same clean-up
(a spooled stdin removed); an input that ends early (an
``EOFError``, which click would take for Ctrl-D), running out of memory and a full disk are said as
such. ``geomscope --debug ...`` shows the traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

import typer

from geomscope.cli import compare, export, extract, finetune, inspect, plot, report, score  # noqa: F401
from geomscope.cli._app import app, state
from geomscope.errors import GeomscopeError, first_line_of
from geomscope.options import OptionError

#: the commands that continue where an unfinished run of theirs stopped (extract from its last
#: shard, finetune from its last epoch checkpoint, a sweep from its unfinished runs)
RESUMING = ("extract", "finetune")


def rerun_advice(args: list[str]) -> str:
    """What a rerun of the command in ``args`` does with an unfinished run of it: continue it (the
    :data:`RESUMING` commands) or start it again (the others keep nothing to resume from)."""
    command = next((a for a in args if not a.startswith("-")), "geomscope")
    if command in RESUMING:
        return "finished work is kept, rerun the same command to resume"
    return f"{command} does not resume: rerun the same command to start it again"


def _as_text(line: str) -> str:
    """An error line (it names files, layers and models from the data) with control characters shown
    as escapes: a name holding ESC would otherwise drive the terminal."""
    from geomscope.formatting import shown

    return shown(line, markup=False)


def _usage_error_line(e: Exception) -> str:
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else "geomscope"
    message = first_line_of(e.format_message(), type(e).__name__).replace("Value error, ", "")
    return f"error: {message} (see '{where} --help')"


#: the errors of a full disk, an exhausted quota and a file-size limit (ulimit -f)
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _terminated(signum, frame) -> None:
    """SIGTERM as Ctrl-C: the clean-up of every ``finally`` runs (its default ends the process at
    once, leaving a spooled copy of stdin, as large as the corpus, in the temporary folder)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``geomscope`` console script (and ``python -m geomscope``)."""
    # SIGTERM as Ctrl-C while a command runs (worker processes put the default back: executor.py);
    # the previous handler is restored after, for a caller that runs main() in its own process
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main_thread else None
    try:
        _main(argv)
    finally:
        if on_main_thread and previous is not None:  # (None: a handler set from C, not restorable)
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> None:
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]  # bare `geomscope`: the help
    debug = "--debug" in args
    state["argv"] = ["geomscope", *args]  # the provenance of what a command writes (score reports)
    try:
        code = app(args=args, prog_name="geomscope", standalone_mode=False)
    except GeomscopeError as e:
        if debug or state["debug"]:
            raise
        line = _as_text(first_line_of(str(e), type(e).__name__))
        if isinstance(e, OptionError) and len(args) > 0 and not args[0].startswith("-"):
            line += f" (see 'geomscope {args[0]} --help')"
        print(f"error: {line}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort) as e:
        if isinstance(e.__cause__, EOFError):  # click reads an EOFError as Ctrl-D: here, a file cut short
            if debug or state["debug"]:
                raise
            why = first_line_of(str(e.__cause__), "it ended early")
            print(
                f"error: an input file ended before its end ({why}); check that it is whole", file=sys.stderr
            )
            sys.exit(2)
        print(f"error: interrupted; {rerun_advice(args)}", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except OSError as e:
        # a disk that fills up (or a quota, or a file-size limit) while a command writes: what it
        # finished is kept (extract resumes from its last shard), so one line saying what to do
        if e.errno not in SPACE_ERRNOS or debug or state["debug"]:
            raise
        where = f" writing {e.filename}" if e.filename else ""
        print(
            f"error: {os.strerror(e.errno).lower()}{where}; free some space (or choose another --out); "
            f"{rerun_advice(args)}",
            file=sys.stderr,
        )
        sys.exit(1)
    except MemoryError as e:  # what no check before could foresee: one line, not numpy's traceback
        if debug or state["debug"]:
            raise
        why = first_line_of(str(e), "an allocation failed")
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
        print(f"error: interrupted; {rerun_advice(args)}", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main"]
