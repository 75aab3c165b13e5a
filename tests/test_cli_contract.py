"""The CLI's shared contract: usage errors are one `error:` line (exit 2) on every command, Ctrl-C
keeps finished work and says so, and shared options read the same on every command; what no check
foresaw (an EOFError, a MemoryError) is still one line, names from the user's data reach the
terminal as escapes, and the SIGTERM handler is put back."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from conftest import assert_one_line_error

BAD_USAGE = [
    (["extract", "m", "t.txt", "--out", "r", "--max-docs", "abc"], "'--max-docs'"),
    (["extract", "m", "t.txt", "--out", "r", "--max-docs", "0"], "--max-docs must be"),
    (["extract", "m", "t.txt", "--out", "r", "--store-dtype", "int8"], "--store-dtype must be"),
    (["extract", "m"], "Missing argument 'INPUT'"),
    (["score", "x.npy", "--seed", "abc"], "'--seed'"),
    (["score", "x.npy", "--zeta", "2"], "--zeta must be"),
    (["score", "x.npy", "--twonn-fit", "cubic"], "--twonn-fit must be"),
    (["plot", "r.json", "--out", "f.png", "--dpi", "many"], "'--dpi'"),
    (["plot", "r.json"], "Missing option '--out'"),
    (
        ["finetune", "m", "--train", "a.csv", "--eval", "b.csv", "--out", "o", "--epochs", "0"],
        "--epochs must be",
    ),
    (["finetune", "m", "--train", "a.csv", "--eval", "b.csv", "--out", "o", "--reg", "l2"], "--reg must be"),
    (["inspect"], "Missing argument 'RUN_DIR'"),
    (["score", "x.npy", "--no-such-option"], "No such option"),
    (["extrakt"], "No such command"),
]


@pytest.mark.parametrize("args, needle", BAD_USAGE, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_USAGE])
def test_usage_errors_are_one_line(cli, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(args)
    line = assert_one_line_error(code, out, err, needle, exit_code=2)
    assert "--help" in line  # says where to look


def test_ctrl_c_keeps_work_and_says_so(cli, tmp_path, monkeypatch):
    import geomscope.extract.run as run

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "extract", interrupted)
    code, out, err = cli(["extract", "bundled:minilm", tmp_path / "t.txt", "--out", tmp_path / "r"])
    assert code == 130 and out == ""
    assert err.strip() == "error: interrupted; finished work is kept, rerun the same command to resume"


@pytest.mark.parametrize(
    "command, target",
    [
        ("report", "geomscope.plot.read_report"),
        ("plot", "geomscope.plot.plot_files"),
        ("score", "geomscope.score.score"),
    ],
)
def test_ctrl_c_in_a_command_that_does_not_resume_says_so(cli, tmp_path, monkeypatch, command, target):
    """Only extract and finetune continue an unfinished run; the others are started again."""

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, interrupted)
    report = tmp_path / "r.json"
    report.write_text("{}")
    args = {
        "report": ["report", report, "--html", tmp_path / "r.html"],
        "plot": ["plot", report, "--out", tmp_path / "f.png"],
        "score": ["score", tmp_path / "x.npy"],
    }[command]
    np.save(tmp_path / "x.npy", np.zeros((4, 3), np.float32))
    code, out, err = cli(args)
    line = assert_one_line_error(code, out, err, exit_code=130)
    assert line == f"error: interrupted; {command} does not resume: rerun the same command to start it again"


def _options(command: str) -> dict[str, tuple[str, ...]]:
    """{option name: all its spellings} of one command, from the click command object."""
    import typer.main

    from geomscope.cli import app

    group = typer.main.get_command(app)
    cmd = group.commands[command]
    return {p.name: tuple(sorted(p.opts)) for p in cmd.params if p.opts and p.opts[0].startswith("-")}


@pytest.mark.parametrize(
    "flag, spellings",
    [
        ("json", ("--json",)),
        ("quiet", ("--quiet", "-q")),
        ("layers", ("--layers", "-l")),
    ],
)
def test_shared_options_read_the_same(flag, spellings):
    commands = ("extract", "score", "plot", "finetune", "inspect")
    seen = {c: _options(c) for c in commands}
    for c, opts in seen.items():
        names = {k: v for k, v in opts.items() if flag in v[-1] or flag in "".join(v)}
        if any(s in sum(opts.values(), ()) for s in spellings):
            key = next(k for k, v in opts.items() if spellings[0] in v)
            assert set(opts[key]) == set(spellings), (c, opts[key])
        assert names is not None
    for c in ("extract", "score", "plot", "finetune"):
        assert any(spellings[0] in v for v in seen[c].values()), (c, flag)


def test_text_field_is_one_name():
    for c in ("extract", "finetune"):
        assert any("--text-field" in v for v in _options(c).values())
    import typer.main

    from geomscope.cli import app

    hidden = [p for p in typer.main.get_command(app).commands["extract"].params if "--text-column" in p.opts]
    assert hidden and hidden[0].hidden  # the old spelling still works, but is not advertised


def test_bare_command_prints_help(cli):
    code, out, err = cli([])
    assert code == 0 and out.startswith("Usage: geomscope") and err == ""


def test_the_cli_puts_the_previous_sigterm_handler_back(cli):
    before = signal.getsignal(signal.SIGTERM)
    cli(["--help"])
    assert signal.getsignal(signal.SIGTERM) is before


def test_error_lines_show_control_characters_as_escapes(cli, tmp_path):
    """An error names files from the user's data; ESC in such a name drove the terminal."""
    name = tmp_path / "x\x1b]0;owned\x07.txt"
    code, out, err = cli(["extract", "bundled:minilm", name, "--out", tmp_path / "r"])
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b" in err


@pytest.mark.parametrize(
    "raised, needles, exit_code",
    [
        (
            EOFError("Compressed file ended before the end-of-stream marker was reached"),
            ("ended before its end", "end-of-stream"),
            2,
        ),
        (
            MemoryError("Unable to allocate 74.5 GiB for an array with shape (100000, 100000)"),
            ("out of memory", "74.5 GiB"),
            1,
        ),
    ],
)
def test_what_no_check_foresaw_is_still_one_line(cli, tmp_path, monkeypatch, raised, needles, exit_code):
    """Whatever reader lets an EOFError through (click would call it Ctrl-D: "interrupted"), and a
    MemoryError no check foresaw: main says what each is, in one line."""
    import geomscope.score

    def fail(*a, **k):
        raise raised

    monkeypatch.setattr(geomscope.score, "score", fail)
    ok = tmp_path / "ok.npy"
    np.save(ok, np.zeros((5, 3)))
    code, out, err = cli(["score", ok, "--quiet"])
    line = assert_one_line_error(code, out, err, *needles, exit_code=exit_code)
    assert "interrupted" not in line


def test_a_linked_out_is_named_as_a_link(cli, tiny_bert, twelve_docs, tmp_path):
    """finetune and export write into a directory itself, never through a link: a link given as --out,
    even to an empty directory, is refused as the link it is, naming its target."""
    from conftest import quiet_extract
    from helpers_train import synthetic_rows, write_csv

    target = tmp_path / "empty"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    train = write_csv(tmp_path / "train.csv", synthetic_rows(8, 0))
    finetune = ["finetune", tiny_bert, "--train", train, "--eval", train, "--out", link, "--device", "cpu"]
    assert quiet_extract(cli, tiny_bert, twelve_docs, tmp_path / "run")[0] == 0
    export = ["export", tmp_path / "run", "--out", link, "--to", "npy"]
    for args in (finetune, export):
        code, out, err = cli(args)
        line = assert_one_line_error(code, out, err, f"--out {link} is a link (to {target})", exit_code=2)
        assert "not a directory" not in line and "not an empty directory" not in line
    assert link.is_symlink() and list(target.iterdir()) == []
