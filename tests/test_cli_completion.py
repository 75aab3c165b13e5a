"""Shell completion through the real entry point (``python -m geomscope`` with the variables a bash
completion script sets): commands, options, a run's layer names from its manifest, report layers,
metric names, and each item of a comma list."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers_models import make_tiny_run
from test_plot_factory import make_report, write_report


def _complete(words: str, *, cwd=None) -> list[str]:
    parts = words.split(" ")
    env = {
        **os.environ,
        "_GEOMSCOPE_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(parts) - 1),
    }
    res = subprocess.run(
        [sys.executable, "-m", "geomscope"], env=env, capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    return [ln for ln in res.stdout.splitlines() if ln]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("complete"), "bert")


def test_commands_and_options():
    assert {"score", "export", "report"} <= set(_complete("geomscope "))
    assert _complete("geomscope ex") == ["export", "extract"]
    assert "--layers" in _complete("geomscope score x --la")


def test_layers_of_a_run_from_its_manifest(run):
    names = [f"layer_{i:02d}" for i in range(3)]  # tiny bert: embeddings + 2 blocks
    assert _complete(f"geomscope score {run} --layers ") == names
    assert _complete(f"geomscope score {run} -q --layers layer_0") == names
    after_first = ["layer_00,layer_01", "layer_00,layer_02"]
    assert _complete(f"geomscope score {run} --layers layer_00,") == after_first
    assert _complete(f"geomscope export {run} --to npy -l layer_02") == ["layer_02"]
    assert _complete("geomscope score /no/such/run --layers ") == []


def test_report_layers_and_metric_names(tmp_path):
    rep = write_report(tmp_path / "r.json", make_report(n_layers=3, hidden=16))
    assert _complete(f"geomscope plot {rep} -l layer_0") == ["layer_00", "layer_01", "layer_02"]
    assert _complete("geomscope score x -m isoscore,avg") == ["isoscore,avgcos"]
    assert "isoscore_star" in _complete("geomscope plot r.json -m iso")
    assert _complete("geomscope extract m t --layers bl") == ["blocks"]
