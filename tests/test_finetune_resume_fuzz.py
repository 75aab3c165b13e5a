"""Hostile trainer states: a finetune output's checkpoint file or marker mutated once, read by
``finetune --resume`` (with and without ``--dry-run``). The contract and the clean sweep:
helpers_fuzz.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_fuzz import (
    FUZZ,
    JSON_OPS,
    SCALE,
    draw_json_mutation,
    finetune_cmd,
    refused_or,
    resumed_numbers,
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


# ------------------------------------------------------------------------------ a trainer state
def mutated_safetensors(data, blob: bytes) -> tuple[bytes, str]:
    """A safetensors file with its length field, its JSON header or its bytes changed."""
    n = int.from_bytes(blob[:8], "little")
    how = data.draw(st.sampled_from(["header", "length", "truncate"]), label="how")
    if how == "truncate":
        k = data.draw(st.integers(0, len(blob) - 1), label="offset")
        return blob[:k], f"truncated at {k}"
    if how == "length":
        value = data.draw(st.sampled_from([0, n - 1, n + 1, len(blob), 2**63, 2**64 - 1]), label="length")
        return value.to_bytes(8, "little") + blob[8:], f"header length {value}"
    op = data.draw(st.sampled_from(JSON_OPS), label="op")
    header, what = draw_json_mutation(data, json.loads(blob[8 : 8 + n]), op)
    return len(header).to_bytes(8, "little") + header + blob[8 + n :], f"header: {what}"


TRAINER_FILES = (
    "checkpoint/state.json",
    "checkpoint/trainer.json",
    "checkpoint/trainer.safetensors",
    ".geomscope-finetune.json",
)


@pytest.mark.parametrize("name", TRAINER_FILES)
@settings(max_examples=6 * SCALE, **FUZZ)
@given(data=st.data())
def test_a_mutated_trainer_state_resumes_the_same_or_is_refused(cli, sweep, tmp_path, name, data):
    with workdir(tmp_path) as w:
        out = Path(shutil.copytree(sweep["point"], w / "run"))
        beside = w / "notes.txt"  # a user's file next to the run: never touched
        beside.write_text("mine")
        blob = (out / name).read_bytes()
        if name.endswith(".safetensors"):
            text, what = mutated_safetensors(data, blob)
        else:
            text, what = draw_json_mutation(
                data, json.loads(blob), data.draw(st.sampled_from(JSON_OPS), label="op")
            )
        note(what)
        (out / name).write_bytes(text)
        args = [*finetune_cmd(sweep["data"], out, "0", "0", epochs=2), "--resume"]
        dry = run_cmd(cli, [*args, "--dry-run"])
        refused_or(dry, lambda: None)
        resumed = run_cmd(cli, args)
        refused_or(resumed, lambda: resumed_numbers(out) == sweep["resumed"])
        assert dry[0] == 0 or resumed[0] != 0, "the dry run refused what the run accepts"
        assert beside.read_text() == "mine"
