"""``geomscope finetune --task qa``: SQuAD metrics, window/label mapping, the loop, resume, bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error
from helpers_models import WORDS, make_tiny_model

from geomscope.errors import InputError
from geomscope.train import FinetuneConfig, finetune
from geomscope.train.qa import QAEncoded, decode_span, f1_score, load_qa, normalize_answer, squad_scores

torch.set_num_threads(1)

MAX_LEN = 48  # the tiny BERT has 64 positions; long contexts become several windows


def squad_records(n: int, seed: int = 0, long_every: int = 3) -> list[dict]:
    """``n`` flat SQuAD records whose answer is a 1-3 word span of a random-word context."""
    rng = random.Random(seed)
    vocab = [w for w in WORDS if w.isalpha()]
    recs = []
    for i in range(n):
        n_words = rng.randint(40, 70) if i % long_every == 0 else rng.randint(8, 20)
        words = [rng.choice(vocab) for _ in range(n_words)]
        k = rng.randint(1, 3)
        a = rng.randrange(0, n_words - k)
        prefix = " ".join(words[:a]) + (" " if a else "")
        context = " ".join(words) + " ."
        text = " ".join(words[a : a + k])
        question = "what " + " ".join(rng.sample(vocab, 3)) + " ?"
        recs.append(
            {
                "id": f"q{seed}-{i}",
                "context": context,
                "question": question,
                "answers": {"text": [text], "answer_start": [len(prefix)]},
            }
        )
    return recs


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def to_squad_json(recs) -> dict:
    paras = [
        {
            "context": r["context"],
            "qas": [
                {
                    "id": r["id"],
                    "question": r["question"],
                    "answers": [
                        {"text": t, "answer_start": s}
                        for t, s in zip(r["answers"]["text"], r["answers"]["answer_start"], strict=True)
                    ],
                }
            ],
        }
        for r in recs
    ]
    return {"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paras}]}


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    return {
        "dir": d,
        "model": str(make_tiny_model("bert", d)),
        "train": str(write_jsonl(d / "train.jsonl", squad_records(18, 0))),
        "eval": str(write_jsonl(d / "dev.jsonl", squad_records(8, 1))),
    }


def _cfg(qa, out, **kw):
    base = dict(
        model=qa["model"],
        train=qa["train"],
        eval=qa["eval"],
        out=str(out),
        task="qa",
        epochs=2,
        lr=2e-3,
        batch_size=8,
        max_length=MAX_LEN,
        device="cpu",
        lam=-1.0,
        c0_points=2000,
    )
    base.update(kw)
    return FinetuneConfig(**base)


# -- metrics --------------------------------------------------------------------------------------


def test_squad_metrics_by_hand():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    # articles and punctuation do not count
    assert squad_scores(["the Eiffel Tower."], [["Eiffel Tower"]]) == {"exact_match": 100.0, "f1": 100.0}
    # partial overlap: pred "big red dog" vs gold "red dog runs": P = 2/3, R = 2/3 -> F1 = 2/3
    assert f1_score("big red dog", "red dog runs") == pytest.approx(2 / 3)
    # P = 1/1, R = 1/4 -> F1 = 2 * 1 * 0.25 / 1.25 = 0.4
    assert f1_score("Paris", "in the city of Paris") == pytest.approx(0.4)
    assert f1_score("london", "paris") == 0.0 and f1_score("the", "a") == 0.0
    # several gold answers: the best one counts, for EM and F1 separately; mean over examples, percent
    s = squad_scores(
        ["red dog", "in 1999", "nothing"],
        [["a red dog", "blue cat"], ["1999", "the year 1999"], ["something"]],
    )
    assert s["exact_match"] == pytest.approx(100 / 3)
    assert s["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)  # "in 1999" vs "1999": P=1/2, R=1 -> 2/3


# -- data and features ----------------------------------------------------------------------------


def test_squad_json_and_jsonl_agree_and_labels_decode_to_the_answer(qa, tmp_path):
    from transformers import AutoTokenizer

    recs = squad_records(12, 5)
    a = load_qa(write_jsonl(tmp_path / "r.jsonl", recs))
    (tmp_path / "s.json").write_text(json.dumps(to_squad_json(recs)))
    b = load_qa(tmp_path / "s.json")
    r0 = recs[0]
    listed = {
        **r0,
        "answers": [{"text": r0["answers"]["text"][0], "answer_start": r0["answers"]["answer_start"][0]}],
    }
    c = load_qa(write_jsonl(tmp_path / "l.jsonl", [listed]))
    assert (a.ids, a.contexts, a.questions, a.answers) == (b.ids, b.contexts, b.questions, b.answers)
    assert c.answers[0] == a.answers[0]

    tok = AutoTokenizer.from_pretrained(qa["model"])
    enc = QAEncoded(tok, a, MAX_LEN)
    assert len(enc) > len(a)  # long contexts were cut into several windows
    assert max(len(x) for x in enc.input_ids) <= MAX_LEN
    inside = outside = 0
    for f, (s, e) in enumerate(enc.labels):
        ex = enc.example[f]
        text, start = a.answers[ex][0]
        ctx_spans = [o for o in enc.offsets[f] if o is not None]
        holds = ctx_spans[0][0] <= start and ctx_spans[-1][1] >= start + len(text)
        if holds:
            inside += 1
            assert 0 < s <= e and decode_span(enc, f, s, e) == text
        else:
            outside += 1
            assert (s, e) == (0, 0) and enc.input_ids[f][0] == tok.cls_token_id
    assert inside >= len(a) and outside > 0  # every answer is in some window; some windows miss it
    batch = enc.collate([0, 1, 2])
    assert batch["labels"].shape == (3, 2) and batch["input_ids"].shape[0] == 3


def test_span_loss_does_not_depend_on_padding(qa):
    """One process with batch 2b and two with b pad differently; the span loss must not notice."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    from geomscope.train.qa import qa_loss_sum

    torch.manual_seed(0)
    model = AutoModelForQuestionAnswering.from_pretrained(qa["model"]).eval()
    enc = QAEncoded(AutoTokenizer.from_pretrained(qa["model"]), load_qa(qa["train"]), MAX_LEN)

    def loss(idx):
        b = enc.collate(idx)
        with torch.no_grad():
            out = model(**{k: v for k, v in b.items() if k != "labels"})
        return float(qa_loss_sum(out, b["labels"], b["attention_mask"]))

    idx = list(range(8))
    assert loss(idx) == pytest.approx(sum(loss([i]) for i in idx), rel=1e-5)


# -- the loop -------------------------------------------------------------------------------------


def _evals(out):
    return [json.loads(ln) for ln in (out / "eval.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("reg", ["istar", "cosreg"])
def test_finetune_qa_end_to_end(qa, tmp_path, reg):
    notes = []
    out = tmp_path / reg
    s = finetune(_cfg(qa, out, reg=reg), log=notes.append)
    assert any("no question-answering head" in n and "added" in n for n in notes), notes
    assert s["task"] == "qa" and s["head_added"] and s["train_examples"] == 18
    assert s["train_features"] > 18 and s["eval_examples"] == 8
    assert 0 <= s["exact_match"] <= 100 and 0 <= s["f1"] <= 100 and s["f1"] >= s["exact_match"]
    ev = _evals(out)
    assert [e["epoch"] for e in ev] == [1, 2] and ev[-1] == s["final"]
    for e in ev:
        assert 0 <= e["exact_match"] <= 100 and 0 <= e["f1"] <= 100
        assert e["eval_features"] == s["eval_features"] and e["eval_loss"] > 0
        assert 0 <= e["isoscore_star"] <= 1 and -1 <= e["avgcos_last_layer"] <= 1
        assert e["isoscore_star"] == e["isoscore_star_trace_pooled"]
        c0 = e["isoscore_star_c0_pooled"]  # against the penalty's C0: an I-STAR run has one
        assert (0 <= c0 <= 1) if reg == "istar" else c0 is None
    steps = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]
    for r in steps:
        assert r["penalty"] is not None and abs(r["loss"] - (r["task_loss"] + r["weighted_penalty"])) < 1e-9
    assert not (out / "label_map.json").exists()
    from transformers import AutoModel, AutoModelForQuestionAnswering

    assert type(AutoModelForQuestionAnswering.from_pretrained(out)).__name__ == "BertForQuestionAnswering"
    assert AutoModel.from_pretrained(out).config.hidden_size == 32  # the base weights of the QA checkpoint


def test_qa_resume_reproduces_an_uninterrupted_run(qa, tmp_path):
    full = finetune(_cfg(qa, tmp_path / "full"))
    finetune(_cfg(qa, tmp_path / "part", epochs=1))
    (tmp_path / "part" / "summary.json").unlink()
    with pytest.raises(InputError, match="trained with max_length=48, not 40"):
        finetune(_cfg(qa, tmp_path / "part", max_length=40, resume=True))
    res = finetune(_cfg(qa, tmp_path / "part", resume=True))
    assert res["resumed"] and res["steps"] == full["steps"]
    a = [json.loads(ln) for ln in (tmp_path / "full" / "steps.jsonl").read_text().splitlines()]
    b = [json.loads(ln) for ln in (tmp_path / "part" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
    for k in ("exact_match", "f1", "eval_loss", "isoscore_star"):
        assert res["final"][k] == pytest.approx(full["final"][k], abs=1e-6)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["no_answers", "empty_answers", "no_context", "bad_start", "empty_file"])
def test_bad_qa_data_is_a_one_line_cli_error(qa, tmp_path, cli, case):
    recs = squad_records(4, 2)
    needle = {
        "no_answers": "has no 'answers'",
        "empty_answers": "has no answers",
        "no_context": "has no 'context'",
        "bad_start": "does not point at the answer",
        "empty_file": "is empty",
    }[case]
    if case == "no_answers":
        del recs[2]["answers"]
    elif case == "empty_answers":
        recs[2]["answers"] = {"text": [], "answer_start": []}
    elif case == "no_context":
        del recs[1]["context"]
    elif case == "bad_start":
        recs[3]["answers"]["answer_start"] = [recs[3]["answers"]["answer_start"][0] + 1]
    bad = write_jsonl(tmp_path / "bad.jsonl", [] if case == "empty_file" else recs)
    args = ["finetune", qa["model"], "--task", "qa", "--train", bad, "--eval", qa["eval"]]
    code, out, err = cli([*args, "--out", tmp_path / "o", "--device", "cpu", "--quiet"])
    line = assert_one_line_error(code, out, err, needle)
    assert "bad.jsonl" in line


def test_compare_and_plot_read_qa_runs_on_their_own_scores(qa, tmp_path, cli):
    """compare correlates IsoScore* with F1 for QA runs (table: F1 and exact match, in percent);
    the training figure draws F1 / exact match; classification and QA runs are not mixed."""
    runs = tmp_path / "runs"
    for lam, seed in ((0.0, 0), (0.0, 1), (-1.0, 0), (-1.0, 1)):
        finetune(_cfg(qa, runs / f"l{lam}_s{seed}", lam=lam, seed=seed, epochs=1))
    code, stdout, err = cli(
        ["compare", str(runs), "--out", str(tmp_path / "cmp"), "--json", "--bootstrap", "200"]
    )
    assert code == 0, err
    res = json.loads(stdout)
    assert res["task"] == "qa" and res["outcome"] == "f1" and res["association"]["y"] == "eval f1"
    assert res["metrics"][:2] == ["f1", "exact_match"] and "accuracy" not in res["runs"][0]
    for r in res["runs"]:
        s = json.loads((Path(r["dir"]) / "summary.json").read_text())
        assert r["f1"] == s["final"]["f1"] and r["exact_match"] == s["final"]["exact_match"]
    assert [p["n_pairs"] for p in res["paired_vs_lambda_0"]] == [2] and "f1" in res["paired_vs_lambda_0"][0]
    assert "isotropy" in res["sentence"] and " F1" in res["sentence"]
    header = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()[0].split(",")
    assert header[3:5] == ["f1_mean", "f1_sd"] and "exact_match_mean" in header
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    from geomscope.plot.training import plot_training_log

    fig = plot_training_log([runs / "l0.0_s0"])
    ax = fig.axes[3]
    assert "F1" in ax.get_title() and any("exact match" in t.get_text() for t in ax.get_legend().get_texts())
    # a classification run among them is refused in one line
    from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

    cls = tmp_path / "mixed"
    cls.mkdir()
    (cls / "qa").symlink_to(runs / "l0.0_s0", target_is_directory=True)
    finetune(
        FinetuneConfig(
            model=str(make_checkpoint(tmp_path / "m", words_of([]))),
            train=str(write_csv(tmp_path / "t.csv", synthetic_rows(8, 0))),
            eval=str(write_csv(tmp_path / "e.csv", synthetic_rows(4, 1))),
            out=str(cls / "cls"),
            epochs=1,
            batch_size=4,
            device="cpu",
            c0_points=500,
        )
    )
    code, stdout, err = cli(["compare", str(cls), "--out", str(tmp_path / "cmp2"), "--allow-mixed"])
    assert code == 2 and "different tasks (classification, qa)" in err and len(err.strip().splitlines()) == 1
