"""The README's command reference equals what --help prints (regenerate with `make docs`)."""

from __future__ import annotations

from pathlib import Path

from geomscope.cli.reference import BEGIN, COMMANDS, END, command_help, reference

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_reference_matches_help():
    text = README.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    assert 0 <= start < end, "README.md lost its CLI reference markers"
    assert text[start : end + len(END)] == reference(), "README's command reference is stale: run `make docs`"


def test_every_command_is_in_the_reference():
    from geomscope.cli import app

    registered = {c.name for c in app.registered_commands}
    assert registered == set(COMMANDS)


def test_help_uses_conventional_metavars():
    for command in (None, *COMMANDS):
        text = command_help(command)
        assert "<bool>" not in text and "list[" not in text and "<str>" not in text, command
        assert "{" not in text.split("\n", 1)[0], command  # the usage line names arguments plainly
