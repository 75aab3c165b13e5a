"""Hostile score reports: a report.json mutated once, read by ``plot`` and ``report --html``. The
contract and the clean report: helpers_fuzz.py."""

from __future__ import annotations

import json

import pytest
from helpers_fuzz import FUZZ, JSON_OPS, SCALE, draw_json_mutation, paths_of, refused_or, run_cmd, workdir
from hypothesis import given, note, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def runs(fuzz_runs):
    """The clean runs and their numbers (helpers_fuzz.clean_runs, built once a session)."""
    return fuzz_runs


# ------------------------------------------------------------------------------ a report
def report_paths(doc) -> list[tuple]:
    """Every place in a report but the second and later items of its lists (eigenvalues, outlier
    statistics: one place each is enough)."""
    return [p for p in paths_of(doc) if all(not isinstance(k, int) or k < 2 for k in p)]


@pytest.mark.parametrize("command", ["plot", "report --html"])
@settings(max_examples=4 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_report_is_drawn_or_refused(cli, runs, tmp_path, command, data):
    op = data.draw(st.sampled_from(JSON_OPS), label="op")
    doc = json.loads(runs["report"].read_text())
    with workdir(tmp_path) as w:
        text, what = draw_json_mutation(data, doc, op, report_paths(doc))
        note(what)
        (w / "report.json").write_bytes(text)
        drawn = w / ("figure.png" if command == "plot" else "page.html")
        args = (
            ["plot", w / "report.json", "--out", drawn]
            if command == "plot"
            else ["report", w / "report.json", "--html", drawn]
        )
        refused_or(run_cmd(cli, [*args, "--quiet"]), lambda: drawn.is_file())
