"""An input that changes while ``extract`` reads it (appended to, rewritten) is refused before the
run is marked complete: the manifest's hash (taken before the model loads) would describe content
that the rows do not all come from. Checked: a one-line error, a run left unfinished (never one of
400 documents marked complete with 300 planned and the first file's sha256), and that --overwrite
then redoes it whole."""

from __future__ import annotations

import hashlib
import json

import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, make_tiny_model

from geomscope.extract import plan as plan_mod
from geomscope.extract import run as run_mod
from geomscope.extract import shards as shards_mod

LINES = [SAMPLE_TEXTS[i % 8] for i in range(300)]
MORE = [f"an added line {i} about the sun" for i in range(100)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("bert", tmp_path_factory.mktemp("m"))


def _grow(tmp_path):
    src = tmp_path / "grow.txt"
    src.write_text("\n".join(LINES) + "\n")
    return src


def _append_during_shard(monkeypatch, src, when: int):
    """While shard ``when`` is written (after its documents, and the next shard's, were read), 100
    lines are appended to ``src``: the run's own seam between shards, no timing involved."""
    write = shards_mod.ShardRun._write

    def writing(self, k, *args, **kw):
        if k == when:
            with open(src, "a") as f:
                f.write("\n".join(MORE) + "\n")
        return write(self, k, *args, **kw)

    monkeypatch.setattr(shards_mod.ShardRun, "_write", writing)


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_input_appended_while_extracting_is_refused_then_overwrite_redoes_it(
    model, tmp_path, cli, monkeypatch
):
    src, out = _grow(tmp_path), tmp_path / "rgrow"
    args = ["extract", model, src, "--out", out, "--shard-docs", 50, "--layers", 0, "-q"]
    _append_during_shard(monkeypatch, src, when=0)
    code, o, err = cli(args)
    line = assert_one_line_error(code, o, err, f"input {src} changed while geomscope read it", exit_code=2)
    assert "unfinished run" in line and "--overwrite" in line
    m = _manifest(out)
    assert m["complete"] is False and m["shards"]  # the shards written stay, as an unfinished run
    monkeypatch.undo()
    # a plain rerun: the input is not the one the run hashed, so it is refused with the difference
    code, o, err = cli(args)
    assert_one_line_error(code, o, err, "inputs.0.sha256", "--overwrite", exit_code=2)
    code, o, err = cli([*args, "--overwrite", "--json"])
    assert code == 0, err
    m = _manifest(out)
    assert m["complete"] and m["totals"]["docs"] == 400 and m["planned_docs"] == 400
    assert m["identity"]["inputs"][0]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_input_appended_after_the_last_document_was_read_is_refused(model, tmp_path, cli, monkeypatch):
    """The last shard's documents were all read before the change: the check after the shard loop
    (not the one between shards) refuses to mark the run complete."""
    src, out = _grow(tmp_path), tmp_path / "rlast"
    _append_during_shard(monkeypatch, src, when=5)  # 300 documents, 50 a shard: the last one
    code, o, err = cli(["extract", model, src, "--out", out, "--shard-docs", 50, "--layers", 0, "-q"])
    assert_one_line_error(code, o, err, f"input {src} changed while geomscope read it", exit_code=2)
    m = _manifest(out)
    assert m["complete"] is False and len(m["shards"]) == 6


@pytest.mark.parametrize(
    "module, seam", [(plan_mod, "hash_input"), (run_mod, "load_for_run")], ids=["hash_input", "load"]
)
def test_input_changed_before_the_run_is_made_writes_nothing(model, tmp_path, cli, monkeypatch, module, seam):
    """Changed between counting its documents and hashing it, or while the model loads: refused
    before the run directory is made."""
    src, out = _grow(tmp_path), tmp_path / "rscan"
    real = getattr(module, seam)

    def appending(*args, **kw):
        with open(src, "a") as f:
            f.write("\n".join(MORE) + "\n")
        return real(*args, **kw)

    monkeypatch.setattr(module, seam, appending)
    code, o, err = cli(["extract", model, src, "--out", out, "--layers", 0, "-q"])
    line = assert_one_line_error(code, o, err, f"input {src} changed while geomscope read it", exit_code=2)
    assert "nothing was written" in line and not out.exists()
