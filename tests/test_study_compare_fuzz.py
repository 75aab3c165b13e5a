"""Hostile sweeps: a sweep.json, or a point's summary, run.json or trainer state, mutated once and
read by ``compare``. The contract and the clean sweep: helpers_fuzz.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_fuzz import (
    FUZZ,
    JSON_OPS,
    SCALE,
    compare_cmd,
    compare_numbers,
    draw_json_mutation,
    refused_or,
    run_cmd,
    workdir,
)
from hypothesis import given, note, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def sweep(fuzz_sweep):
    """The clean sweep, its comparison and a resumed point (helpers_fuzz.clean_sweep, built once a
    session)."""
    return fuzz_sweep


# ------------------------------------------------------------------------------ a sweep
COMPARE_FILES = ("sweep.json", "summary.json", "run.json", "checkpoint/state.json")


@pytest.mark.parametrize("name", COMPARE_FILES)
@settings(max_examples=2 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_sweep_compares_the_same_or_is_refused(cli, sweep, tmp_path, name, data):
    with workdir(tmp_path) as w:
        copy = Path(shutil.copytree(sweep["sweep"], w / "sweep"))
        points = sorted(p.name for p in copy.iterdir() if p.is_dir())
        where = copy if name == "sweep.json" else copy / data.draw(st.sampled_from(points), label="run")
        op = data.draw(st.sampled_from(JSON_OPS), label="op")
        text, what = draw_json_mutation(data, json.loads((where / name).read_text()), op)
        note(f"{where.name}/{name}: {what}")
        (where / name).write_bytes(text)

        def same_or_strict():
            result = compare_numbers(w / "cmp" / "compare.json")  # strict JSON, parsed
            if name == "sweep.json":  # compare reads the runs, not the grid they were planned from
                assert result == sweep["compare"]

        refused_or(run_cmd(cli, compare_cmd(copy, w / "cmp")), same_or_strict)
