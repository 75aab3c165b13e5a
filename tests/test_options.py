"""Options as data (geomscope.options): every declared option is fed each invalid value its
constraint names, in the library and on the command line, and must give the one-line error that
names the flag; the defaults pass. The cases are generated from the declarations, so an option
added to a declaration is tested without a line here."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from conftest import assert_one_line_error

from geomscope.errors import InputError
from geomscope.export_options import ExportOptions
from geomscope.extract.options import ExtractOptions
from geomscope.htmlreport import ReportOptions
from geomscope.options import (
    POSITIVE_INT,
    PROBABILITY,
    SEED,
    Choice,
    CommaList,
    Device,
    Flag,
    Interval,
    Layers,
    OptionError,
    Parsed,
    Text,
    check,
    declared,
    invalid_settings,
)
from geomscope.plot.options import PlotOptions
from geomscope.score.options import ScoreOptions
from geomscope.store.options import InspectOptions
from geomscope.study.options import CompareOptions
from geomscope.train.config import FinetuneConfig

DECLARED = [
    CompareOptions,
    ExportOptions,
    ExtractOptions,
    FinetuneConfig,
    InspectOptions,
    PlotOptions,
    ReportOptions,
    ScoreOptions,
]
CASES = [(cls, *case) for cls in DECLARED for case in invalid_settings(cls)]
#: the fields a declaration needs besides its options (a run's inputs and output), and the options
#: that have no default
REQUIRED = {
    ExportOptions: {"to": "npy"},
    FinetuneConfig: {"model": "m", "train": "t.csv", "eval": "t.csv", "out": "o"},
}


def _example(cls):
    """``cls`` at its defaults (with its required fields filled in)."""
    return cls(**REQUIRED.get(cls, {}))


def _id(case) -> str:
    cls, _name, flag, value = case
    return f"{cls.__name__}{flag}={value!r}"


def test_the_defaults_pass_their_own_constraints():
    for cls in DECLARED:
        check(_example(cls))
        assert declared(cls), cls


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_invalid_value_is_refused_naming_its_option(case):
    cls, name, flag, value = case
    with pytest.raises(OptionError) as err:
        replace(_example(cls), **{name: value}).validate()
    message = str(err.value)
    assert "\n" not in message and flag in message, message


def _on_the_command_line(constraint, value) -> str | None:
    """How an invalid value is written as an argument, or None where the command line cannot
    carry it (a type the shell has no word for, or a string that the CLI reads as valid)."""
    if isinstance(constraint, Flag) or isinstance(value, bool) or value is None:
        return None
    if isinstance(constraint, Interval):
        return (
            None if isinstance(value, str) or (isinstance(value, float) and math.isnan(value)) else str(value)
        )
    return value if isinstance(value, str) else None


def _cli_cases(cls) -> list[tuple[str, str, str]]:
    """(field, flag, argument) of every invalid value of ``cls`` the command line can carry; a
    hidden option (a deprecated spelling the CLI maps itself) is left out."""
    options = declared(cls)
    return [
        (name, flag, arg)
        for owner, name, flag, value in CASES
        if owner is cls
        and not options[name].hidden
        and (arg := _on_the_command_line(options[name].constraint, value)) is not None
    ]


EXTRACT_CLI = _cli_cases(ExtractOptions)


@pytest.mark.parametrize("name, flag, arg", EXTRACT_CLI, ids=[f"{f}={a!r}" for _, f, a in EXTRACT_CLI])
def test_extract_refuses_every_invalid_value_in_one_line(cli, tmp_path, name, flag, arg):
    text = tmp_path / "t.txt"
    text.write_text("a few words\n")
    code, out, err = cli(["extract", "bundled:minilm", text, "--out", tmp_path / "run", f"{flag}={arg}"])
    line = assert_one_line_error(code, out, err, flag, exit_code=2)
    assert "--help" in line
    assert not (tmp_path / "run").exists()


FINETUNE_CLI = _cli_cases(FinetuneConfig)


@pytest.mark.parametrize("name, flag, arg", FINETUNE_CLI, ids=[f"{f}={a!r}" for _, f, a in FINETUNE_CLI])
def test_finetune_refuses_every_invalid_value_in_one_line(cli, tmp_path, name, flag, arg):
    """Refused before the model loads: the files need not exist."""
    args = ["finetune", "bundled:minilm", "--train", "t.csv", "--eval", "t.csv", "--out", tmp_path / "run"]
    code, out, err = cli([*args, f"{flag}={arg}"])
    line = assert_one_line_error(code, out, err, flag, exit_code=2)
    assert "--help" in line
    assert not (tmp_path / "run").exists()


SCORE_CLI = _cli_cases(ScoreOptions)


@pytest.mark.parametrize("name, flag, arg", SCORE_CLI, ids=[f"{f}={a!r}" for _, f, a in SCORE_CLI])
def test_score_refuses_every_invalid_value_in_one_line(cli, tmp_path, name, flag, arg):
    """Refused before the array is read: nothing is written beside it."""
    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(50, 4)))
    code, out, err = cli(["score", tmp_path / "x.npy", "--out", tmp_path / "r", f"{flag}={arg}"])
    line = assert_one_line_error(code, out, err, flag, exit_code=2)
    assert "--help" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


#: each of the other commands around one option's value: its inputs need not exist, since the
#: options are checked before anything is read or written
INVOCATIONS = {
    CompareOptions: lambda tmp: ["compare", tmp / "runs", "--out", tmp / "out"],
    ExportOptions: lambda tmp: ["export", tmp / "run", "--to", "npy", "--out", tmp / "out"],
    InspectOptions: lambda tmp: ["inspect", tmp / "run"],
    PlotOptions: lambda tmp: ["plot", tmp / "r.json", "--out", tmp / "out" / "f.png"],
    ReportOptions: lambda tmp: ["report", tmp / "r.json", "--html", tmp / "out" / "p.html"],
}
OTHER_CLI = [(cls, *case) for cls in INVOCATIONS for case in _cli_cases(cls)]


@pytest.mark.parametrize(
    "cls, name, flag, arg", OTHER_CLI, ids=[f"{c.__name__}{f}={a!r}" for c, _, f, a in OTHER_CLI]
)
def test_the_other_commands_refuse_every_invalid_value_in_one_line(cli, tmp_path, cls, name, flag, arg):
    code, out, err = cli([*INVOCATIONS[cls](tmp_path), f"{flag}={arg}"])
    line = assert_one_line_error(code, out, err, flag, exit_code=2)
    assert "--help" in line
    assert list(tmp_path.iterdir()) == []


def test_every_declared_command_is_run_on_the_command_line():
    assert set(INVOCATIONS) | {ExtractOptions, FinetuneConfig, ScoreOptions} == set(DECLARED)


def _only_three(spec: str) -> int:
    if spec != "3":
        raise InputError(f"--three must be 3, not {spec!r}")
    return 3


@pytest.mark.parametrize(
    "constraint, good",
    [
        (POSITIVE_INT, (1, 10**12)),
        (PROBABILITY, (1e-9, 0.5, 1 - 1e-9)),
        (SEED, (0, 2**64 - 1)),
        (Choice(("a", "b")), ("a", "b")),
        (Device(), ("auto", "cpu", "cuda", "cuda:3", "mps", "CUDA:0")),
        (Layers(), ("all", "1-3,-1", ["layer_00", 2])),
        (Text(), ("text", "a b")),
        (Flag(), (True, False)),
        (Parsed(_only_three, bad=("x", "4")), ("3",)),
        (CommaList("names"), ("a", "a, b", ["a", "b,c"], "", ",", [])),
        (CommaList("ranks", POSITIVE_INT, int, nonempty=True), ("8", "8,32", (8, 32), ["8", 32])),
    ],
)
def test_each_constraint_accepts_its_values_and_refuses_its_invalid_ones(constraint, good):
    for value in good:
        assert constraint.reason(value) is None, (constraint, value)
    for value in constraint.invalid():
        assert constraint.reason(value) is not None, (constraint, value)


def test_a_list_refuses_what_its_items_refuse():
    names = CommaList("names")
    assert {names.reason(v) for v in (3, (None,), ("a", 3))} == {"must be a comma list of names"}
    ranks = CommaList("ranks", POSITIVE_INT, int, nonempty=True)
    for bad in ("", ",", (), "8,0", "8,x", "1.5", (0,), ("8", True)):
        assert ranks.reason(bad) == "must be a comma list of ranks", bad
    assert ranks.items(["8,32", 128]) == [8, 32, 128]


def test_a_seed_is_bounded_by_one_rule():
    assert SEED.reason(2**64) is not None and SEED.reason(-1) is not None
    with pytest.raises(OptionError, match="--seed must be a whole number from 0 to 2\\^64 - 1"):
        ExtractOptions(seed=2**64).validate()


def test_a_list_option_names_its_refused_word_and_quotes_the_list_as_typed():
    from geomscope.options import OptionError, check_value
    from geomscope.score import ScoreOptions

    with pytest.raises(OptionError) as e:
        check_value(ScoreOptions, "metrics", ["isoscore,nope"])
    line = str(e.value)
    assert line.startswith("--metrics must be a comma list of metric names (")
    assert line.endswith("not 'isoscore,nope' ('nope' is not one)")
    with pytest.raises(OptionError) as e:
        check_value(ScoreOptions, "abtt_k", "0")
    assert str(e.value).endswith("not '0'")  # one word: the value alone says which
