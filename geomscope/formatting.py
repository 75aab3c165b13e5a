"""How counts, measured values and names from data read wherever geomscope prints them: messages,
the terminal table and the HTML page. A light module (no numpy or torch; rich only inside
:func:`shown`): every command may import it.

- :func:`counted` -- ``counted(1, "shard")`` is ``1 shard``, ``counted(4, "shard")`` ``4 shards``.
- :func:`value_and_se` -- a value and its standard error as two strings: the SE rounded to two
  significant digits and the value to the same decimal place (``0.4123, 0.0157`` ->
  ``0.412``, ``0.016``), in scientific notation where fixed notation would be very long.
- :func:`shown` -- a name from data as text that prints as itself (control and bidirectional
  characters as escapes, rich markup escaped); :func:`shown_name` -- one cut to a bounded length.
"""

from __future__ import annotations

import math
import numbers
import re

#: fixed notation for an SE whose last kept digit is at 10**-6 or coarser and a value and SE below
#: :data:`FIXED_BELOW`; scientific notation otherwise (fixed would need more than 6 decimals or
#: 7 digits before the point)
FINEST_FIXED_PLACE = -6
FIXED_BELOW = 1e6


#: the most characters of a name from data (a model, revision, layer, dataset or file name) that a
#: table, page or figure shows: a longer one is cut in the middle (:func:`shown_name`), so that a
#: crafted 1 MB model name costs what a real one does (matplotlib lays out a legend of 1 MB in over
#: a minute, and report --html takes as long) while every hub name (at most 96 characters) is shown whole
SHOWN_NAME_CHARS = 120


def shown_name(name, limit: int = SHOWN_NAME_CHARS) -> str:
    """``name`` as text of at most ``limit`` characters: a longer one keeps its head and its tail (a
    path's last parts) around an ellipsis."""
    text = str(name)
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` (with thousands separators) and ``noun`` in the number that agrees with it: the
    singular for exactly one, ``plural`` (default: ``noun + "s"``) otherwise."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def _finite(v) -> bool:
    """A finite real number (NumPy's scalars too); not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def plain_value(v, digits: int = 3) -> str:
    """A value without an SE: ``digits`` significant digits (``g`` format), in scientific notation
    below 1e-3; ``-`` for None, and ``nan``/``inf`` as themselves."""
    if v is None:
        return "-"
    if not _finite(v) or v == 0 or abs(v) >= 1e-3:
        return f"{v:.{digits}g}"
    return f"{v:.{digits - 1}e}"


def value_and_se(v, se, digits: int = 3) -> tuple[str, str | None]:
    """(value text, SE text) for a value measured with a standard error. The SE has two significant
    digits and the value is rounded to the SE's last decimal place. An SE that is None or not finite
    gives ``None`` for the SE text and the value as :func:`plain_value` (``digits`` significant
    digits); an SE of zero gives ``"0"``. Fixed notation where the SE's last digit is at
    10**:data:`FINEST_FIXED_PLACE` or coarser and the value and SE are below :data:`FIXED_BELOW`;
    scientific notation otherwise, the value's mantissa to the SE's last place."""
    if not _finite(v) or not _finite(se):
        return plain_value(v, digits), None
    se = abs(se)
    if se == 0:
        return plain_value(v, digits), "0"
    se_exp = int(f"{se:.1e}".split("e")[1])  # the exponent after rounding to 2 significant digits
    last_place = se_exp - 1  # the SE's second significant digit is at 10**last_place
    if last_place >= FINEST_FIXED_PLACE and max(abs(v), se) < FIXED_BELOW:
        decimals = max(0, -last_place)
        value_text = f"{round(v, -last_place):.{decimals}f}"
        se_text = f"{round(se, -last_place):.{decimals}f}"
    else:
        v_exp = int(f"{v:e}".split("e")[1])
        value_text = f"{v:.{v_exp - last_place}e}" if v_exp >= last_place else "0"
        se_text = f"{se:.1e}"
    return _unsigned_zero(value_text), se_text


def _unsigned_zero(text: str) -> str:
    """``-0.00`` (a small negative value rounded to zero) as ``0.00``."""
    return text[1:] if text.startswith("-") and not text.strip("-0.e+") else text


#: characters never sent to a terminal as they are: the C0 and C1 controls and DEL (ESC opens the
#: ANSI/OSC sequences that clear the screen or retitle the window, BEL closes an OSC), the line and
#: paragraph separators, and the bidirectional embeddings, overrides and isolates (text shown in
#: another order than it is)
_UNSHOWN = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(value, *, markup: bool = True) -> str:
    """``value`` (a layer, model, run or file name from a run, a report or the user) as text that
    prints as itself: every character of :data:`_UNSHOWN` as a visible escape (``\\x1b``,
    ``\\u202e``), and with ``markup`` (rich renders the string with markup on) ``[`` escaped so
    that ``[bold red]`` is shown, not applied. The one home of this: every command passes names from
    data through it before printing them."""
    text = _UNSHOWN.sub(
        lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", str(value)
    )
    if markup:
        from rich.markup import escape

        text = escape(text)
    return text
