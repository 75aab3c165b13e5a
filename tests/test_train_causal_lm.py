"""``geomscope finetune --task causal-lm``: documents, packed and padded rows, the next-token loss
against the model's own, the penalties on a decoder's real tokens, eval perplexity by its
definition, and bad input."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error
from helpers_models import WORDS, make_tiny_model

from geomscope.errors import InputError
from geomscope.train import FinetuneConfig, finetune
from geomscope.train.causal_lm import LMEncoded, lm_loss_sum, pack_blocks
from geomscope.train.data import read_documents

torch.set_num_threads(1)

MAX_LEN = 16
VOCAB = [w for w in WORDS if w.isalpha()]


def documents(n: int, seed: int) -> list[str]:
    """``n`` documents of 2 to 14 known words (so a word is a token), some ending in a full stop."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(VOCAB) for _ in range(rng.randint(2, 14))) + (" ." if i % 3 == 0 else "")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    train = d / "train.txt"
    train.write_text("\n".join(documents(24, 0)[:12] + ["", "   "] + documents(24, 0)[12:]) + "\n")
    ev = d / "eval.txt"
    ev.write_text("\n".join(documents(7, 1)) + "\n")
    return {
        "dir": d,
        "gpt_neox": str(make_tiny_model("gpt_neox", d)),
        "llama": str(make_tiny_model("llama", d)),
        "train": str(train),
        "eval": str(ev),
    }


def _cfg(lm, kind: str, out, **kw) -> FinetuneConfig:
    base = dict(
        model=lm[kind],
        train=lm["train"],
        eval=lm["eval"],
        out=str(out),
        task="causal-lm",
        epochs=1,
        lr=2e-3,
        batch_size=4,
        max_length=MAX_LEN,
        device="cpu",
        lam=-1.0,
        c0_points=100_000,
        save_every=1000,  # checkpoints/step0: the model of the first step
    )
    base.update(kw)
    return FinetuneConfig(**base)


# -- data and rows --------------------------------------------------------------------------------


def test_documents_from_text_csv_and_jsonl(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_bytes("\ufefffirst doc\r\n\nsecond  doc \n   \nthird\n".encode())
    docs = read_documents(txt)
    assert docs.texts == ["first doc", "second  doc ", "third"] and docs.blank == 2
    (tmp_path / "d.csv").write_text('text,other\n"a, b",1\n,2\nc d,3\n')
    docs = read_documents(tmp_path / "d.csv", "text")
    assert docs.texts == ["a, b", "c d"] and docs.blank == 1
    (tmp_path / "d.jsonl").write_text('{"body": "x y"}\n{"body": null}\n\n{"body": "z"}\n')
    docs = read_documents(tmp_path / "d.jsonl", "body")
    assert docs.texts == ["x y", "z"] and docs.blank == 1
    for path, field, needle in (
        (tmp_path / "d.csv", "sentence", "has no text column 'sentence'"),
        (tmp_path / "missing.txt", "sentence", "does not exist"),
    ):
        with pytest.raises(InputError, match=needle):
            read_documents(path, field)
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(InputError, match="has no document with text"):
        read_documents(tmp_path / "blank.txt")
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(InputError, match="is a int, not text"):
        read_documents(tmp_path / "num.jsonl", "text")


def test_pack_blocks_by_hand():
    # EOS = 0 after each document unless it ends with it; blocks of 4; a last block of 1 token dropped
    assert pack_blocks([[5, 6], [7, 0], [8, 9, 10]], 0, 4) == [[5, 6, 0, 7], [0, 8, 9, 10]]
    assert pack_blocks([[5, 6], [7]], 0, 4) == [[5, 6, 0, 7]]  # the last block [0] predicts nothing
    assert pack_blocks([[5, 6, 7]], 0, 3) == [[5, 6, 7]]
    assert pack_blocks([[5], [6, 7, 8]], 0, 3) == [[5, 0, 6], [7, 8, 0]]


def test_packed_and_padded_rows(lm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm["gpt_neox"])
    docs = read_documents(lm["train"])
    ids = [tok(t)["input_ids"] for t in docs.texts]
    eos = tok.eos_token_id
    packed = LMEncoded(tok, docs, MAX_LEN, "pack", eos)
    stream = [t for x in ids for t in [*x, eos]]
    assert [t for row in packed.input_ids for t in row] == stream[: len(stream) - (len(stream) % MAX_LEN < 2)]
    assert all(len(r) == MAX_LEN for r in packed.input_ids[:-1])
    assert packed.n_predicted == sum(len(r) - 1 for r in packed.input_ids) and packed.n_examples == 24
    padded = LMEncoded(tok, docs, MAX_LEN, "pad", eos)
    assert padded.input_ids == [x[:MAX_LEN] for x in ids if len(x) >= 2]
    assert padded.short == sum(len(x) < 2 for x in ids)
    batch = padded.collate([0, 1, 2])
    mask = batch["attention_mask"].bool()
    assert (batch["labels"][~mask] == -100).all() and torch.equal(
        batch["labels"][mask], batch["input_ids"][mask]
    )
    assert "token_type_ids" not in batch
    with pytest.raises(InputError, match="pass --lm-batching pad"):
        LMEncoded(tok, docs, MAX_LEN, "pack", None)


# -- the loss -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt_neox", "llama"])
def test_loss_equals_the_models_own_and_ignores_padding(lm, kind):
    """lm_loss_sum / count equals transformers' loss with labels on a padded batch, and the sum of
    each row's loss computed alone (no padding) by a manual shift."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(lm[kind]).eval()
    tok = AutoTokenizer.from_pretrained(lm[kind])
    enc = LMEncoded(tok, read_documents(lm["train"]), MAX_LEN, "pad", tok.eos_token_id)
    idx = [0, 3, 5, 8]
    batch = enc.collate(idx)
    assert (batch["attention_mask"] == 0).any()  # rows of different lengths: padding in the batch
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        total, count = lm_loss_sum(out.logits, batch["labels"])
        alone = 0.0
        for i in idx:
            ids = torch.tensor([enc.input_ids[i]])
            logits = model(input_ids=ids).logits[0].double()
            logp = torch.log_softmax(logits[:-1], -1)
            alone -= float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].sum())
    assert count == enc.predicted(idx) == sum(len(enc.input_ids[i]) - 1 for i in idx)
    assert float(total) / count == pytest.approx(float(out.loss), rel=1e-6)
    assert float(total) == pytest.approx(alone, rel=1e-5)


# -- the loop -------------------------------------------------------------------------------------


def _steps(out):
    return [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]


def _alone(model, rows, layers):
    """Each row run alone (no padding) in eval mode: the hidden states of ``layers`` (float64 rows)
    and the token losses' sum and count."""
    hs = {i: [] for i in layers}
    loss, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row])
            o = model(input_ids=ids, output_hidden_states=True)
            for i in layers:
                hs[i].append(o.hidden_states[i][0].double().numpy())
            logp = torch.log_softmax(o.logits[0].double()[:-1], -1)
            loss -= float(logp[torch.arange(len(row) - 1), ids[0, 1:]].sum())
            count += len(row) - 1
    return {i: np.vstack(v) for i, v in hs.items()}, loss, count


def _isoscore_star(C, zeta, C0):
    """IsoScore* from its definition: IsoScore((1 - zeta) C + zeta C0s), IsoScore(M) =
    (tr(M)^2 / ||M||_F^2 - 1) / (D - 1)."""
    M = (1 - zeta) * C + zeta * (C0 + C0.T) / 2
    return (np.trace(M) ** 2 / np.sum(M * M) - 1) / (M.shape[0] - 1)


@pytest.mark.parametrize(
    "kind, batching, reg",
    [("gpt_neox", "pack", "istar"), ("llama", "pad", "istar"), ("llama", "pad", "cosreg")],
)
def test_causal_lm_run_against_direct_computation(lm, tmp_path, kind, batching, reg):
    """The first step's task loss is the model's own loss on the first global batch; its penalty is
    the I-STAR / CosReg of the batch's real tokens (each row run alone, so padding cannot enter);
    eval perplexity is exp(sum of token losses / predicted tokens) over the eval rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from geomscope.train.data import epoch_order, global_batches

    cfg = _cfg(lm, kind, tmp_path / "o", lm_batching=batching, reg=reg)
    notes = []
    s = finetune(cfg, log=notes.append)
    out = tmp_path / "o"
    assert any("no causal-LM head" in n for n in notes), notes
    assert s["task"] == "causal-lm" and s["lm_batching"] == batching and s["blank_documents"]["train"] == 2
    assert s["train_examples"] == 24 and s["eval_examples"] == 7 and not (out / "label_map.json").exists()

    snap = out / "checkpoints" / "step0"
    model = AutoModelForCausalLM.from_pretrained(snap).eval()
    tok = AutoTokenizer.from_pretrained(snap)
    train = LMEncoded(tok, read_documents(lm["train"]), MAX_LEN, batching, tok.eos_token_id)
    assert s["train_rows"] == len(train) and s["train_predicted_tokens"] == train.n_predicted
    first = global_batches(epoch_order(len(train), cfg.seed, 0), cfg.batch_size, 1)[0]
    batch = train.collate(first)
    with torch.no_grad():
        hf = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
    step1 = _steps(out)[0]
    assert step1["examples"] == len(first) and step1["predicted_tokens"] == train.predicted(first)
    assert step1["task_loss"] == pytest.approx(float(hf.loss), rel=1e-5)

    layers = [1, 2]
    rows_b, _, _ = _alone(model, [train.input_ids[i] for i in first], layers)
    if reg == "istar":
        rows_all, _, _ = _alone(model, train.input_ids, layers)
        C0 = np.cov(np.vstack([rows_all[i] for i in layers]).T)
        C = np.cov(np.vstack([rows_b[i] for i in layers]).T)
        assert step1["penalty"] == pytest.approx(1 - _isoscore_star(C, cfg.zeta, C0), rel=1e-5)
    else:  # CosReg over the last layer's real tokens
        X = rows_b[2] / np.linalg.norm(rows_b[2], axis=1, keepdims=True)
        n = len(X)
        assert step1["penalty"] == pytest.approx((np.sum(X.sum(0) ** 2) - n) / n**2, rel=1e-5)

    final = AutoModelForCausalLM.from_pretrained(out).eval()
    ev = LMEncoded(tok, read_documents(lm["eval"]), MAX_LEN, batching, tok.eos_token_id)
    _, loss, count = _alone(final, ev.input_ids, layers)
    rec = s["final"]
    assert rec["eval_predicted_tokens"] == count == s["eval_predicted_tokens"]
    assert rec["eval_loss"] == pytest.approx(loss / count, rel=1e-6)
    assert rec["perplexity"] == pytest.approx(math.exp(loss / count), rel=1e-6) == s["perplexity"]
    assert 0 <= rec["isoscore_star"] <= 1


# -- the command line and bad input ---------------------------------------------------------------


def test_cli_run_says_perplexity_and_bad_options_are_one_line(lm, tmp_path, cli):
    args = ["finetune", lm["gpt_neox"], "--train", lm["train"], "--eval", lm["eval"], "--device", "cpu"]
    small = ["--epochs", "1", "--batch-size", "8", "--max-length", "8", "--reg", "none"]
    code, out, err = cli([*args, "--task", "causal-lm", *small, "--out", tmp_path / "ok"])
    assert code == 0, err
    assert "steps, eval perplexity " in err.strip().splitlines()[-1]
    code, out, err = cli([*args, "--lm-batching", "pad", "--out", tmp_path / "cls"])
    assert_one_line_error(code, out, err, "--lm-batching sets the rows of --task causal-lm", exit_code=2)
    bert = make_tiny_model("bert", lm["dir"])
    code, out, err = cli([*args[:1], bert, *args[2:], "--task", "causal-lm", *small, "--out", tmp_path / "b"])
    assert_one_line_error(code, out, err, "attends to later tokens (bidirectional)", exit_code=2)


# -- a lambda grid and compare --------------------------------------------------------------------


def test_lambda_grid_then_compare_on_perplexity(lm, tmp_path, cli):
    """finetune --task causal-lm --lambda=-1,0,1 runs as a grid (a rerun skips it); compare reads
    perplexity as the outcome, lower is better, and its Spearman rho is scipy's on the runs."""
    from scipy import stats as sps

    from geomscope.plot.training import plot_training_log

    grid = tmp_path / "grid"
    args = ["finetune", lm["gpt_neox"], "--task", "causal-lm", "--train", lm["train"], "--eval", lm["eval"]]
    args += ["--reg", "istar", "--lambda=-1,0,1", "--seed", "0", "--epochs", "1", "--batch-size", "8"]
    args += ["--max-length", "8", "--lr", "3e-3", "--device", "cpu", "--out", grid, "--quiet", "--json"]
    code, out, err = cli(args)
    assert code == 0, err
    assert [r["status"] for r in json.loads(out)["runs"]] == ["done"] * 3
    code, out, err = cli(args)
    assert code == 0 and [r["status"] for r in json.loads(out)["runs"]] == ["skipped"] * 3, err
    code, out, err = cli(["compare", grid, "--json", "--bootstrap", "200"])
    assert code == 0, err
    res = json.loads(out)
    assert res["task"] == "causal-lm" and res["outcome"] == "perplexity"
    assert res["outcome_direction"] == "lower is better" and res["metrics"][:2] == ["perplexity", "eval_loss"]
    iso, ppl = [], []
    for r in res["runs"]:
        s = json.loads((tmp_path / r["dir"] / "summary.json").read_text())
        assert r["perplexity"] == s["perplexity"] == s["final"]["perplexity"]
        iso.append(s["final"]["isoscore_star"])
        ppl.append(s["perplexity"])
    rho = float(sps.spearmanr(iso, ppl).statistic)
    assert res["association"]["spearman"]["estimate"] == pytest.approx(rho)
    better = "higher isotropy went with lower perplexity (better)"
    assert (better if rho < 0 else "lower isotropy went with lower perplexity (better)") in res["sentence"]
    assert [p["lambda"] for p in res["paired_vs_lambda_0"]] == [-1.0, 1.0]
    header = (grid / "compare.csv").read_text().splitlines()[0].split(",")
    assert header[3:5] == ["perplexity_mean", "perplexity_sd"] and (grid / "compare.png").stat().st_size
    fig = plot_training_log([grid / "istar_lambda-1_seed0"])
    assert fig.axes[3].get_title() == "eval perplexity (per epoch)"


# -- Accelerate and resume ------------------------------------------------------------------------


def test_two_accelerate_processes_equal_one(lm, tmp_path):
    """accelerate launch with 2 CPU processes (gloo) and batch 4 trains as one process with batch
    8: every process counts the global batch's predicted tokens, so the token mean and the I-STAR
    covariance are the global batch's, whatever the padding of each process's rows; the logged
    gradient geometry (moments merged over the processes) is the global batch's too."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.exists():
        pytest.skip("accelerate is not installed next to python")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")

    def args(out, batch):
        return [
            *("-m", "geomscope", "finetune", lm["gpt_neox"], "--task", "causal-lm", "--lm-batching", "pad"),
            *("--train", lm["train"], "--eval", lm["eval"], "--out", str(out), "--epochs", "1"),
            *("--batch-size", str(batch), "--max-length", str(MAX_LEN), "--lr", "2e-3"),
            *("--lambda=-1", "--log-geometry", "1", "--geometry-rank", "2,8", "--device", "cpu", "-q"),
        ]

    one = subprocess.run(
        [sys.executable, *args(tmp_path / "one", 8)], env=env, capture_output=True, text=True
    )
    assert one.returncode == 0, one.stderr
    launch = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    two = subprocess.run([*launch, *args(tmp_path / "two", 4)], env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert s2["world_size"] == 2 and s1["global_batch"] == s2["global_batch"] == 8
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        assert ra["predicted_tokens"] == rb["predicted_tokens"]
        for k in ("task_loss", "penalty", "isoscore_star"):
            assert abs(ra[k] - rb[k]) < 1e-5, (k, ra, rb)
        for name, ga in ra["geometry"].items():
            gb = rb["geometry"][name]
            assert ga["tokens"] == gb["tokens"] and ga["p_value"] == gb["p_value"]
            for key in ("energy", "energy_max", "control_energy_mean", "control_energy_sd"):
                for r, v in ga[key].items():
                    assert v == pytest.approx(gb[key][r], rel=1e-4), (name, key, r)
    for k in ("eval_loss", "perplexity", "isoscore_star"):
        assert s1["final"][k] == pytest.approx(s2["final"][k], rel=1e-5), k
    assert s1["final"]["eval_predicted_tokens"] == s2["final"]["eval_predicted_tokens"]


def test_resume_reproduces_an_uninterrupted_run(lm, tmp_path):
    full = finetune(_cfg(lm, "llama", tmp_path / "full", epochs=2, lm_batching="pad", save_every=None))
    finetune(_cfg(lm, "llama", tmp_path / "part", epochs=1, lm_batching="pad", save_every=None))
    (tmp_path / "part" / "summary.json").unlink()
    with pytest.raises(InputError, match="trained with lm_batching='pad', not 'pack'"):
        finetune(_cfg(lm, "llama", tmp_path / "part", epochs=2, resume=True, save_every=None))
    res = finetune(
        _cfg(lm, "llama", tmp_path / "part", epochs=2, lm_batching="pad", resume=True, save_every=None)
    )
    assert res["resumed"] and res["steps"] == full["steps"]
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
    for k in ("perplexity", "eval_loss", "isoscore_star"):
        assert res["final"][k] == pytest.approx(full["final"][k], rel=1e-6)
