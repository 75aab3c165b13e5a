"""`geomscope extract` on the command line: JSON on stdout, messages on stderr, one-line errors, and resume
after SIGKILL of a real process; --overwrite removes only what the manifest lists, after checking it,
and a resume redoes a shard whose checksum fails; what extract says agrees in number with what it
counts, and a resumed extract says what it did now."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import assert_one_line_error, files_of, quiet_extract
from helpers_models import SAMPLE_TEXTS, make_tiny_model, poison_token

from geomscope.store import Run, iter_shard


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-models")
    return {k: make_tiny_model(k, root) for k in ("bert", "gpt_neox")}


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("\n".join(SAMPLE_TEXTS) + "\n")
    return p


def all_rows(run_dir):
    run = Run(run_dir)
    chunks = [c for s in run.shards for c in iter_shard(run.shard_path(s))]
    meta = np.stack(
        [np.concatenate([getattr(c, k) for c in chunks]) for k in ("doc_id", "position", "token_id")]
    )
    order = np.lexsort((meta[1], meta[0]))
    layers = {n: np.concatenate([c.layers[n] for c in chunks])[order] for n in run.layer_names}
    return meta[:, order], layers


def test_json_on_stdout_messages_on_stderr(cli, models, text, tmp_path):
    code, out, err = cli(
        ["extract", models["bert"], text, "--out", tmp_path / "run", "--layers", "0,-1", "--json"]
    )
    assert code == 0, err
    s = json.loads(out)  # exactly one JSON object, nothing else on stdout
    assert s["layers"] == ["layer_00", "layer_02"] and s["docs"] == len(SAMPLE_TEXTS) and s["complete"]
    assert "extract:" in err and "on disk" in err and "done:" in err
    code, out, err = cli(
        ["extract", models["bert"], text, "--out", tmp_path / "run", "--layers", "0,-1", "--quiet"]
    )
    assert code == 0 and out == "" and err == ""


def test_stdin(cli, models, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the dog\n\nthe cat runs\n")))
    code, out, err = cli(["extract", models["bert"], "-", "--out", tmp_path / "run", "--json", "--quiet"])
    assert code == 0, err
    s = json.loads(out)
    assert (s["docs"], s["docs_empty"]) == (2, 1)


def test_bad_input_one_line_errors(cli, models, text, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "blank.txt").write_text("\n\n")
    cases = [
        (["extract", tmp_path / "no-model", text], 2, "does not exist"),
        (["extract", "acme/not-here", text, "--cache-dir", tmp_path / "hf"], 2, "offline mode is on"),
        (["extract", models["bert"], text, "--layers", "9"], 2, "layer 9 is out of range"),
        (["extract", models["bert"], tmp_path / "a.jsonl"], 2, "has no field 'text'"),
        (["extract", models["bert"], tmp_path / "blank.txt"], 2, "no text in"),
        (["extract", models["bert"], tmp_path / "missing.txt"], 2, "does not exist"),
        (
            ["extract", models["bert"], text, "--dtype", "float8"],
            2,
            "--dtype must be one of float32, float16, bfloat16, not 'float8'",
        ),
        (["extract", models["bert"], text, "--device", "cuda:7"], 2, "--device cuda:7"),
    ]
    for args, exit_code, msg in cases:
        code, out, err = cli([*args, "--out", tmp_path / "run"])
        line = assert_one_line_error(code, None, err, exit_code=exit_code)
        assert msg in line, line
        assert not (tmp_path / "run").exists(), msg


def test_other_options_refused_then_overwrite(cli, models, text, tmp_path):
    base = ["extract", models["bert"], text, "--out", tmp_path / "run", "--quiet"]
    assert cli(base)[0] == 0
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    code, out, err = cli([*base, "--max-length", "8"])
    line = assert_one_line_error(code, None, err, exit_code=2)
    assert (
        "different options" in line and "max_length: 64 in the run, 8 now" in line and "--overwrite" in line
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before and Run(tmp_path / "run").complete
    code, out, err = cli([*base, "--max-length", "8", "--overwrite", "--json"])
    assert code == 0 and json.loads(out)["shards_resumed"] == 0


def test_nonfinite_exit_code_and_summary(cli, tmp_path, text):
    model = poison_token(make_tiny_model("bert", tmp_path, name="poisoned"))
    (tmp_path / "p.txt").write_text("the dog\npoison\n")
    code, out, err = cli(
        ["extract", model, tmp_path / "p.txt", "--out", tmp_path / "run", "--json", "--quiet"]
    )
    line = assert_one_line_error(code, None, err, exit_code=3)
    assert "NaN/Inf" in line and "flagged" in line
    assert json.loads(out)["nonfinite_rows"] == 3 and Run(tmp_path / "run").complete
    code, out, err = cli(
        ["extract", model, tmp_path / "p.txt", "--out", tmp_path / "run", "--allow-nonfinite", "--quiet"]
    )
    assert code == 0


def test_resume_after_sigkill_equals_clean_run(cli, models, tmp_path):
    texts = [f"{t} {i}" for i in range(10) for t in SAMPLE_TEXTS]  # 120 docs -> 40 shards of 3
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    args = [str(models["gpt_neox"]), str(src), "--shard-docs", "3", "--batch-tokens", "32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "geomscope", "extract", *args, "--out", str(run), "--quiet"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if not (run / "shard-00000.h5").exists():
            time.sleep(0.01)  # still importing / loading
        elif json.loads((run / "manifest.json").read_text())["shards"]:
            os.kill(proc.pid, signal.SIGKILL)  # the first shard is published and listed: kill mid-run
            break
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    partial = Run(run)
    done = len(partial.shards)
    assert not partial.complete and 1 <= done < 40
    code, out, err = cli(["extract", *args, "--out", run, "--json", "--quiet"])
    assert code == 0, err
    s = json.loads(out)
    assert s["shards_resumed"] == done and s["shards_written"] == 40 - done and s["shards"] == 40
    assert not list(run.glob(".*.tmp"))
    code, out, err = cli(["extract", *args, "--out", tmp_path / "clean", "--quiet"])
    assert code == 0, err
    (m1, l1), (m2, l2) = all_rows(tmp_path / "clean"), all_rows(run)
    np.testing.assert_array_equal(m1, m2)
    assert m1.shape[1] == Run(run).total_rows == Run(tmp_path / "clean").total_rows
    for n in l1:
        np.testing.assert_allclose(l1[n].astype(np.float32), l2[n].astype(np.float32), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ --overwrite, resume, limits


def test_extract_overwrite_removes_only_what_the_manifest_lists(cli, tiny_bert, twelve_docs, tmp_path):
    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    (run / "shard-notes.txt").write_text("mine")
    (run / "shards_backup").mkdir()
    (run / "shards_backup" / "old.h5").write_text("mine too")
    code, _, err = quiet_extract(cli, tiny_bert, twelve_docs, run, "--overwrite", "--layers", "0")
    assert code == 0, err
    assert (run / "shard-notes.txt").read_text() == "mine"
    assert (run / "shards_backup" / "old.h5").read_text() == "mine too"


def test_extract_overwrite_checks_before_deleting(cli, tiny_bert, twelve_docs, tmp_path):
    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    before = files_of(run)
    (run / "shard-00001.h5").unlink()
    (run / "shard-00001.h5").mkdir()  # a directory where a listed shard should be
    (run / "shard-00001.h5" / "x").write_text("x")
    code, out, err = quiet_extract(cli, tiny_bert, twelve_docs, run, "--overwrite")
    assert_one_line_error(code, out, err, "is a directory, not a file geomscope wrote", exit_code=2)
    after = files_of(run)
    assert all(after[k] == v for k, v in before.items() if k in after and not k.startswith(".geomscope.lock"))
    assert (run / "manifest.json").exists() and (run / "shard-00000.h5").exists()  # nothing half-deleted
    shutil.rmtree(run / "shard-00001.h5")
    code, _, err = quiet_extract(
        cli, tiny_bert, twelve_docs, run, "--overwrite"
    )  # once moved away, --overwrite works
    assert code == 0, err


def test_resume_redoes_a_shard_whose_checksum_fails(cli, tiny_bert, twelve_docs, tmp_path):
    from geomscope.store import Run, verify_shard

    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run, "--store-dtype", "float32")[0] == 0
    clean = {p.name: p.read_bytes() for p in run.glob("shard-*.h5")}
    target = run / "shard-00001.h5"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    target.write_bytes(bytes(data))
    code, out, err = cli(
        [
            "extract",
            tiny_bert,
            twelve_docs,
            "--out",
            run,
            "--quiet",
            "--shard-docs",
            "4",
            "--store-dtype",
            "float32",
            "--json",
        ]
    )
    assert code == 0, err
    s = json.loads(out)
    assert s["shards_written"] == 1 and s["shards_resumed"] == len(clean) - 1
    r = Run(run)
    for info in r.shards:
        verify_shard(r.shard_path(info), info)
    assert target.read_bytes() == clean[target.name]  # the redone shard equals the clean one


def test_max_length_below_the_special_tokens(cli, tiny_bert, twelve_docs, tmp_path):
    code, out, err = quiet_extract(cli, tiny_bert, twelve_docs, tmp_path / "run", "--max-length", "1")
    assert_one_line_error(code, out, err, "leaves no room for text", exit_code=2)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------ counts agree with nouns; a resumed run says what it did


@pytest.fixture(scope="module")
def one_doc(tmp_path_factory):
    p = tmp_path_factory.mktemp("one-doc") / "one.txt"
    p.write_text("A single document of a few words.\n")
    return p


def _summary(**changes) -> dict:
    """An extract summary (the keys done_line reads): 4 shards, 3 of them written by this call."""
    base = {
        "rows": 15492,
        "docs": 400,
        "shards": 4,
        "bytes": 119_400_000,
        "shards_resumed": 1,
        "shards_written": 3,
        "rows_this_run": 11000,
        "tokens_per_second": 556.2,
    }
    return {**base, **changes}


def test_extract_of_one_document_and_one_layer_says_so(cli, tiny_bert, one_doc, tmp_path):
    run = tmp_path / "run"
    code, out, err = cli(["extract", tiny_bert, one_doc, "--out", run, "--layers", "0"])
    assert code == 0, err
    opening = " ".join(next(ln for ln in err.splitlines() if ln.startswith("extract:")).split())
    assert "1 document in 1 shard, 1 layer x" in opening, err
    code, out, err = cli(["inspect", run, "--verify"])
    assert code == 0, err
    assert "(1 document in 1 shard)" in " ".join(out.split()), out


def test_done_line_of_one_document_in_one_shard_is_singular():
    from geomscope.extract.shards import done_line

    line = done_line(_summary(rows=1, docs=1, shards=1, shards_resumed=0, shards_written=1, rows_this_run=1))
    assert "1 row of 1 document in 1 shard," in line, line
    for wrong in ("1 rows", "1 documents", "1 shards"):
        assert wrong not in line, line


def test_done_line_of_a_finished_run_gives_no_rate():
    from geomscope.extract.shards import done_line

    line = done_line(_summary(shards_resumed=4, shards_written=0, rows_this_run=0, tokens_per_second=None))
    assert line.startswith("done: nothing to do") and "tokens/s" not in line, line
    assert "15,492 rows of 400 documents in 4 shards" in line, line


def test_done_line_of_a_resumed_run_rates_the_new_rows_only():
    from geomscope.extract.shards import done_line

    line = done_line(_summary())
    assert "1 shard kept from an earlier run, 3 written now (11,000 rows, 556 tokens/s)" in line, line


def test_rerunning_a_finished_extract_prints_no_rate(cli, tiny_bert, one_doc, tmp_path):
    import json

    args = ["extract", tiny_bert, one_doc, "--out", tmp_path / "run", "--layers", "0"]
    code, _, err = cli(args)
    assert code == 0, err
    code, _, err = cli(args)
    assert code == 0, err
    done = next(ln for ln in err.splitlines() if ln.startswith("done:"))
    assert done.startswith("done: nothing to do") and "tokens/s" not in done, err
    code, out, err = cli([*args, "--json", "--quiet"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["shards_written"] == 0 and summary["tokens_per_second"] is None
