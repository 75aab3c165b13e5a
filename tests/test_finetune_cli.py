"""CLI tests of ``geomscope finetune`` (in-process through the ``cli`` fixture)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_one_line_error
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return {
        "model": make_checkpoint(d / "m", words_of([])),
        "train": write_csv(d / "train.csv", synthetic_rows(32, 0)),
        "eval": write_csv(d / "dev.csv", synthetic_rows(12, 1)),
        "dir": d,
    }


def _args(data, out, *extra, train=None, ev=None, model=None):
    return [
        "finetune",
        model or data["model"],
        "--train",
        train or data["train"],
        "--eval",
        ev or data["eval"],
        "--out",
        out,
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        *extra,
    ]


def test_finetune_json_outputs_and_plot(cli, data, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = cli(
        _args(
            data,
            out,
            "--reg",
            "istar",
            "--lambda",
            "-2",
            "--zeta",
            "0.1",
            "--layers",
            "1-2",
            "--json",
            "--quiet",
        )
    )
    assert code == 0, err
    s = json.loads(stdout)  # exactly one JSON object on stdout
    assert s["reg"] == "istar" and s["lambda"] == -2.0 and s["zeta"] == 0.1 and s["layers"] == [1, 2]
    assert s["steps"] == 4 and s["final"]["epoch"] == 1 and 0 <= s["final"]["accuracy"] <= 1
    assert "no sequence-classification head" in err and "added" in err
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "label_map.json",
        "steps.jsonl",
        "eval.jsonl",
        "summary.json",
        "run.json",
        "checkpoint/state.json",
    ):
        assert (out / name).exists(), name
    assert json.loads((out / "summary.json").read_text()) == s
    assert len((out / "steps.jsonl").read_text().splitlines()) == 4
    code, stdout, err = cli(["plot", out, "--out", tmp_path / "train.png"])
    assert code == 0, err
    assert (tmp_path / "train.png").stat().st_size > 1000
    # the fine-tuned directory is a model `geomscope extract` reads
    code, stdout, err = cli(
        [
            "extract",
            out,
            data["eval"],
            "--text-column",
            "sentence",
            "--out",
            tmp_path / "ext",
            "--device",
            "cpu",
            "--quiet",
        ]
    )
    assert code == 0, err
    assert json.loads((tmp_path / "ext" / "manifest.json").read_text())


def test_finetune_cosreg_and_none_and_pairs(cli, data, tmp_path):
    pairs = write_csv(
        tmp_path / "pairs.tsv",
        [(s, s.split()[0], y) for s, y in synthetic_rows(16)],
        header=("question", "sentence", "gold"),
        delimiter="\t",
    )
    code, stdout, err = cli(
        _args(
            data,
            tmp_path / "c",
            "--reg",
            "cosreg",
            "--lambda",
            "1",
            "--text-field",
            "question",
            "--text-field-2",
            "sentence",
            "--label-field",
            "gold",
            "--json",
            train=pairs,
            ev=pairs,
        )
    )
    assert code == 0, err
    s = json.loads(stdout)
    steps = [json.loads(ln) for ln in (tmp_path / "c" / "steps.jsonl").read_text().splitlines()]
    assert s["reg"] == "cosreg" and all(-0.1 < r["penalty"] <= 1 for r in steps)
    code, stdout, err = cli(_args(data, tmp_path / "n", "--reg", "none", "--json"))
    assert code == 0 and json.loads(stdout)["reg"] == "none"
    assert "wrote" in err  # the one-line result on stderr when not --quiet


@pytest.mark.parametrize(
    "case,code,pattern",
    [
        ("missing_label", 2, "no label column 'label'"),
        ("single_class", 3, "single class"),
        ("empty", 2, "is empty"),
        ("unseen", 2, "not seen in training: 'neutral'"),
        ("fp16_cpu", 2, "fp16 needs a CUDA GPU"),
        ("bad_layers", 2, "layer 3 is out of range"),
        ("no_model", 2, "does not exist"),
        ("resume_nothing", 2, "nothing to resume"),
        ("nan", 3, "NaN/inf at step 2 (epoch 1)"),
    ],
)
def test_bad_input_one_line_errors(cli, data, tmp_path, case, code, pattern):
    out = tmp_path / "o"
    extra, kw = [], {}
    if case == "missing_label":
        kw["train"] = write_csv(tmp_path / "t.csv", synthetic_rows(8), header=("sentence", "y"))
    elif case == "single_class":
        kw["train"] = write_csv(tmp_path / "t.csv", [(s, "positive") for s, _ in synthetic_rows(8)])
    elif case == "empty":
        (tmp_path / "t.csv").write_text("")
        kw["train"] = tmp_path / "t.csv"
    elif case == "unseen":
        kw["ev"] = write_csv(tmp_path / "e.csv", synthetic_rows(4) + [("meh", "neutral")])
    elif case == "fp16_cpu":
        extra = ["--precision", "fp16"]
    elif case == "bad_layers":
        extra = ["--layers", "3"]
    elif case == "no_model":
        kw["model"] = tmp_path / "missing-model"
    elif case == "resume_nothing":
        extra = ["--resume"]
    elif case == "nan":
        extra = ["--lr", "1e20"]
    assert_one_line_error(*cli(_args(data, out, *extra, **kw)), pattern, exit_code=code)
    if case == "nan":  # the failing step is logged, nothing is exported as if finished
        assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()
    else:
        assert not out.exists() or not any(out.iterdir())


def test_existing_run_is_not_overwritten(cli, data, tmp_path):
    out = tmp_path / "run"
    assert cli(_args(data, out, "--quiet"))[0] == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert_one_line_error(*cli(_args(data, out)), "already holds a finetune run", exit_code=2)
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # --resume with more epochs continues from the checkpoint
    code, stdout, err = cli(_args(data, out, "--epochs", "2", "--resume", "--json", "--quiet"))  # last wins
    assert code == 0, err
    s = json.loads(stdout)
    assert s["resumed"] and s["steps"] == 8 and [e["epoch"] for e in s["evals"]] == [1, 2]


def test_save_every_checkpoints_feed_a_trajectory(cli, data, tmp_path):
    """finetune --save-every -> extract --revisions 'OUT/checkpoints/*' -> score DIR -> trajectory.csv;
    the last snapshot is the exported model, step0 the model before training."""
    import csv

    from safetensors.numpy import load_file

    out = tmp_path / "ft"
    code, _, err = cli(_args(data, out, "--reg", "none", "--save-every", "2", "--quiet"))
    assert code == 0, err
    snaps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert snaps == ["step0", "step2", "step4"]  # 32 rows / batch 8 = 4 steps
    last = load_file(str(out / "checkpoints" / "step4" / "model.safetensors"))
    final = load_file(str(out / "model.safetensors"))
    assert all((last[k] == final[k]).all() for k in final)
    first = load_file(str(out / "checkpoints" / "step0" / "model.safetensors"))
    assert any((first[k] != final[k]).any() for k in final if k in first)
    text = tmp_path / "t.txt"
    text.write_text("good film\nbad plot and dull\n")
    runs = tmp_path / "runs"
    code, _, err = cli(
        ["extract", "ft", text, "--revisions", str(out / "checkpoints" / "*"), "--out", runs, "-q"]
    )
    assert code == 0, err
    code, _, err = cli(["score", runs, "-q", "--metrics", "isoscore,avgcos"])
    assert code == 0, err
    rows = list(csv.DictReader((runs / "trajectory.csv").open()))
    assert [r["step"] for r in rows[:: len(rows) // 3]] == ["0", "2", "4"]
    # --overwrite removes the snapshots too (they are this run's)
    code, _, err = cli(_args(data, out, "--reg", "none", "--overwrite", "--quiet"))
    assert code == 0, err
    assert not (out / "checkpoints").exists()
