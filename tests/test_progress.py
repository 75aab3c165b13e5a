"""The progress display (geomscope/progress.py): silent when off, counts and rates when on, and
descriptions shown as text, never as markup or terminal escapes."""

from __future__ import annotations


def test_progress_descriptions_are_shown_as_text():
    from rich.text import Text

    from geomscope.progress import _as_text

    # rendered with markup, it reads as written, the ESC as a visible escape
    assert Text.from_markup(_as_text("layer [bold red]x[/] \x1b[2J")).plain == "layer [bold red]x[/] \\x1b[2J"


def test_progress_disabled_is_silent(capsys):
    from geomscope.progress import Progress

    with Progress(enabled=False) as bar:
        t = bar.add("x", 10, unit="docs", rate_unit="tok")
        t.advance(3, work=30)
        t.skip(2)
        t.info("i")
        t.describe("d")
        t.complete()
        bar.print("line")
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_enabled_counts(capsys):
    from geomscope.progress import Progress

    with Progress(enabled=True) as bar:
        t = bar.add("x", 10, unit="docs", rate_unit="tok")
        t.skip(4)
        t.advance(3, work=30)
        task = bar._p.tasks[0]
        assert task.completed == 7 and task.fields["rate"].endswith("tok/s")
        t.complete()
        assert task.completed == 10


def test_command_output_is_one_meaning_of_quiet(monkeypatch, capsys):
    """--quiet hides the bar and the notes, never a log of warnings; the bar is drawn on a terminal
    only."""
    import sys

    from geomscope.progress import command_output, silent

    for tty in (True, False):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        assert command_output(False)[0] is tty and command_output(True)[0] is False
        assert command_output(True, warns=True)[0] is False
    assert command_output(True)[1] is silent
    command_output(False)[1]("a note")
    command_output(True, warns=True, prefix="warning:")[1]("a warning")
    err = capsys.readouterr().err
    assert "a note" in err and "warning: a warning" in err
