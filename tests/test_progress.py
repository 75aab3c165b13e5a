"""The progress display (geomscope/progress.py)."""

from __future__ import annotations


def test_progress_descriptions_are_shown_as_text():
    from rich.text import Text

    from geomscope.progress import _as_text

    # rendered with markup, it reads as written, the ESC as a visible escape
    assert Text.from_markup(_as_text("layer [bold red]x[/] \x1b[2J")).plain == "layer [bold red]x[/] \\x1b[2J"
