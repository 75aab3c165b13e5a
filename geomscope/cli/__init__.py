"""Command-line interface: thin wrappers over the library.

Each command lives in its own module and registers itself on :data:`app`.  :func:`main` turns a
:class:`~geomscope.errors.GeomscopeError` into one ``error: ...`` line on stderr and a non-zero
exit code (a traceback only with ``geomscope --debug ...``).
"""

from __future__ import annotations

import sys

from geomscope.cli._app import app, state
from geomscope.errors import GeomscopeError

# command modules: importing them registers the commands (they import nothing heavy at top level)
for _mod in ("extract", "inspect", "score", "plot", "finetune"):
    try:
        __import__(f"geomscope.cli.{_mod}")
    except ModuleNotFoundError as _e:  # a command module not written yet must not break the others
        if _e.name != f"geomscope.cli.{_mod}":
            raise


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``geomscope`` console script (and ``python -m geomscope``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        app(args=args, prog_name="geomscope", standalone_mode=True)
    except SystemExit:
        raise
    except GeomscopeError as e:
        if state["debug"] or "--debug" in args:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted; finished work is kept, rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


__all__ = ["app", "main"]
