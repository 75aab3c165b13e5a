"""User-facing errors.

Anything a user can cause (a missing file, an unknown model, a layer out of range, too few
points, a corrupt shard ...) raises :class:`GeomscopeError` with ONE line that says what is
wrong and what to do.  The CLI prints it as ``error: <message>`` on stderr and exits non-zero,
without a traceback unless ``--debug`` is given.  Library callers catch it like any exception.
"""

from __future__ import annotations


class GeomscopeError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InputError(GeomscopeError):
    """Bad or missing input (files, options, data)."""

    exit_code = 2


class DataError(GeomscopeError):
    """The data cannot give a meaningful number (too few points, zero variance, NaN ...)."""

    exit_code = 3


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's text, cut to ``limit`` characters (the name of its type when
    the text is blank): what a one-line error quotes of the exception behind it."""
    return first_line_of(str(e), type(e).__name__, limit)


def first_line_of(text: str, fallback: str = "", limit: int | None = None) -> str:
    """The first non-blank line of ``text``, stripped and cut to ``limit`` characters; ``fallback``
    when every line is blank."""
    text = text.strip()
    return text.splitlines()[0].strip()[:limit] if text else fallback
