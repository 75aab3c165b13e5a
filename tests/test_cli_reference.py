"""The docs' command reference equals what --help prints (regenerate with `make docs`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from geomscope.cli.reference import BEGIN, COMMANDS, END, PAGE, command_help, main, reference

ROOT = Path(__file__).resolve().parents[1]


def test_cli_page_reference_matches_help():
    text = (ROOT / PAGE).read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    assert 0 <= start < end, f"{PAGE} lost its CLI reference markers"
    assert text[start : end + len(END)] == reference(), f"{PAGE} is stale: run `make docs`"


def test_readme_has_no_generated_reference():
    assert BEGIN not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_write_replaces_only_the_block(tmp_path):
    page = tmp_path / "cli.md"
    page.write_text(f"# Title\n\nintro\n\n{BEGIN}\nstale\n{END}\n\ntail\n", encoding="utf-8")
    main(["--write", str(page)])
    text = page.read_text(encoding="utf-8")
    assert text == f"# Title\n\nintro\n\n{reference()}\n\ntail\n"


def test_write_refuses_a_file_without_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# a front page\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="^error: .* has no"):
        main(["--write", str(readme)])
    assert readme.read_text(encoding="utf-8") == "# a front page\n"


def test_every_command_is_in_the_reference():
    from geomscope.cli import app

    registered = {c.name for c in app.registered_commands}
    assert registered == set(COMMANDS)


def test_help_uses_conventional_metavars():
    for command in (None, *COMMANDS):
        text = command_help(command)
        assert "<bool>" not in text and "list[" not in text and "<str>" not in text, command
        assert "{" not in text.split("\n", 1)[0], command  # the usage line names arguments plainly
