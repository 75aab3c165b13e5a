"""geomscope/errors.py: the line an error quotes of an exception."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("exc", "limit", "expected"),
    [
        (ValueError("bad header\nTraceback detail"), None, "bad header"),
        (ValueError("  \n padded line\nmore"), None, "padded line"),
        (ValueError("x" * 300), 160, "x" * 160),
        (OSError(), None, "OSError"),
        (RuntimeError("   "), 10, "RuntimeError"),
    ],
)
def test_first_line_quotes_one_line_of_an_exception(exc, limit, expected):
    from geomscope.errors import first_line

    assert first_line(exc, limit) == expected
