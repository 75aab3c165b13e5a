"""A sweep rerun skips a finished point only when it was trained with the options asked now, and
distinct lambdas never share a directory (a rerun with another --lr and --train is not "skipped";
1e-6 and 1.000001e-6 are two directories)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_one_line_error
from helpers_train import finetune_args, synthetic_rows, tiny_finetune_data, write_csv

import geomscope.study.sweep as sweep
from geomscope.errors import InputError
from geomscope.study import grid

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_finetune_data(tmp_path_factory.mktemp("sweepg"))


def _args(data, out, *extra, train=None):
    return finetune_args(data, out, "--lambda", "-1,0", "--json", *extra, train=train, lr=None)


def _status(stdout):
    return [r["status"] for r in json.loads(stdout)["runs"]]


def _summaries(out):
    return {p: p.read_bytes() for p in sorted(out.glob("*/summary.json"))}


def test_a_rerun_with_other_options_is_refused_naming_the_difference(cli, data, tmp_path):
    out = tmp_path / "sw"
    code, stdout, err = cli(_args(data, out, "--lr", "1e-3"))
    assert code == 0 and _status(stdout) == ["done", "done"], err
    before = _summaries(out)
    code, o, err = cli(_args(data, out, "--lr", "5e-2", "--epochs", "2", train=data["eval"]))
    assert_one_line_error(code, o, err, "none_lambda-1_seed0", "train=", "--overwrite", exit_code=2)
    code, o, err = cli(_args(data, out, "--lr", "5e-2"))
    assert_one_line_error(code, o, err, "lr=0.001, not 0.05", exit_code=2)
    assert _summaries(out) == before
    code, stdout, err = cli(_args(data, out, "--lr", "1e-3"))  # the same options: both skipped
    assert code == 0 and _status(stdout) == ["skipped", "skipped"], err
    code, stdout, err = cli(_args(data, out, "--lr", "5e-2", "--overwrite"))  # redone
    assert code == 0 and _status(stdout) == ["done", "done"], err
    assert all(json.loads(p.read_text())["lr"] == 5e-2 for p in _summaries(out))


def test_more_epochs_resume_and_changed_data_is_refused(cli, data, tmp_path):
    train = write_csv(tmp_path / "train.csv", synthetic_rows(16, 0))
    out = tmp_path / "sw2"
    assert cli(_args(data, out, "--lr", "1e-3", train=train))[0] == 0
    code, stdout, err = cli(_args(data, out, "--lr", "1e-3", "--epochs", "2", train=train))
    assert code == 0 and _status(stdout) == ["done", "done"], err
    for p in _summaries(out):
        assert [e["epoch"] for e in json.loads(p.read_text())["evals"]] == [1, 2]
    code, o, err = cli(_args(data, out, "--lr", "1e-3", train=train))
    assert_one_line_error(code, o, err, "trained for 2 epochs, not 1", exit_code=2)
    write_csv(train, synthetic_rows(16, 5))  # changed in place
    code, o, err = cli(_args(data, out, "--lr", "1e-3", "--epochs", "2", train=train))
    assert_one_line_error(code, o, err, "other contents of", "train.csv", exit_code=2)


# ---------------------------------------------------------------------------------- names
def test_distinct_lambdas_get_distinct_directories():
    for lams in ([1e-6, 1.000001e-6], [-0.1234561, -0.1234564], [0.1, 0.1 + 1e-12]):
        names = [p.name for p in grid(["istar"], lams, [0])]
        assert len(set(names)) == 2, names
        for p in grid(["istar"], lams, [0]):  # the name reads back as the value
            assert float(p.name.split("_lambda")[1].split("_seed")[0]) == p.lam
    # ordinary values keep the names earlier sweeps have (so they still resume)
    names = [p.name for p in grid(["istar"], [-0.1, 0.0, 1.0, 1e-5, -5.0, 0.25], [3])]
    assert names == [
        "istar_lambda-0.1_seed3",
        "istar_lambda0_seed3",
        "istar_lambda1_seed3",
        "istar_lambda1e-05_seed3",
        "istar_lambda-5_seed3",
        "istar_lambda0.25_seed3",
    ]


def test_two_points_that_would_share_a_directory_are_refused(monkeypatch):
    monkeypatch.setattr(sweep, "lambda_text", lambda x: "x")
    with pytest.raises(InputError, match="would both be run in istar_lambdax_seed0"):
        grid(["istar"], [1.0, 2.0], [0])


def test_the_dry_run_lists_distinct_directories(cli, data, tmp_path):
    code, stdout, err = cli(
        ["finetune", data["model"], "--train", data["train"], "--eval", data["eval"], "--out", tmp_path / "g"]
        + ["--lambda", "1e-6,1.000001e-6", "--dry-run"]
    )
    assert code == 0, err
    assert stdout.split() == [
        str(tmp_path / "g" / "istar_lambda1e-06_seed0"),
        str(tmp_path / "g" / "istar_lambda1.000001e-06_seed0"),
    ]
