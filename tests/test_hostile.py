"""Hostile and broken inputs, as an adversary would try them: run directories, checkpoints and model
directories someone else made, huge inputs, interrupted commands. Each case: nothing lost, nothing
run, nothing written outside what was asked, and one `error:` line where the input is bad."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_models import make_tiny_model
from test_train_helpers import make_checkpoint, synthetic_rows, words_of, write_csv

TEXT = "\n".join(f"the quick brown fox number {i} jumps over the lazy dog" for i in range(12)) + "\n"


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_tiny_model("bert", tmp_path_factory.mktemp("models") / "bert")


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    return p


def _extract(cli, model, text, run, *extra):
    return cli(["extract", model, text, "--out", run, "--quiet", "--shard-docs", "4", *extra])


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ data loss


def _finetune(cli, tmp_path, out, *extra):
    model = tmp_path / "m"
    if not model.exists():
        make_checkpoint(model, words_of([]))
    train = tmp_path / "train.csv"
    if not train.exists():
        write_csv(train, synthetic_rows(16, 0))
    args = ["--epochs", "1", "--batch-size", "8", "--device", "cpu", "--quiet", "--reg", "cosreg"]
    return cli(["finetune", model, "--train", train, "--eval", train, "--out", out, *args, *extra])


# ------------------------------------------------------------------------------ security
class _Planted:
    """A pickle that runs a command when loaded: it must never be loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------------------------ silent wrong results


# ------------------------------------------------------------------------------ resources and leftovers


# ------------------------------------------------------------------------------ one line, not a traceback


# ------------------------------------------------------------------------------ smaller


@pytest.mark.parametrize(
    "edit",
    [
        lambda row: row.update(step="abc"),
        lambda row: row.update(isoscore="high"),
        lambda row: row.update(n_rows="inf"),
        lambda row: row.update(n_rows="2.5"),
        "extra_cell",
    ],
)
def test_a_damaged_trajectory_is_one_line_for_plot(cli, tmp_path, edit):
    import csv

    from test_plot_factory import make_report

    from geomscope.score.trajectory import to_trajectory_csv

    reps = []
    for step in (0, 1000):
        rep = make_report(n_layers=3, hidden=16)
        rep["model"]["revision"] = f"step{step}"
        reps.append(rep)
    path = tmp_path / "trajectory.csv"
    path.write_text(to_trajectory_csv(reps))
    assert cli(["plot", path, "--out", f"{tmp_path}/ok/", "--quiet"])[0] == 0
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for i, row in enumerate(rows):
            if i == 2 and edit != "extra_cell":
                edit(row)
            w.writerow(row)
    if edit == "extra_cell":
        with path.open("a") as f:
            f.write(",".join(["x"] * (len(rows[0]) + 3)) + "\n")
    code, out, err = cli(["plot", path, "--out", f"{tmp_path}/figs/", "--quiet"])
    assert_one_line_error(code, out, err, "trajectory.csv line", exit_code=2)
