"""Builders for the fine-tuning tests: tiny random BERT checkpoints, tokenizers and labelled data.

No test functions here: test_train.py checks the builders themselves.
"""

from __future__ import annotations

import csv
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data" / "sentiment"

POS = ["good", "great", "lovely", "wonderful", "superb", "delightful", "charming", "brilliant"]
NEG = ["bad", "awful", "dull", "terrible", "boring", "clumsy", "tedious", "weak"]
FILL = [
    "the",
    "film",
    "was",
    "a",
    "story",
    "and",
    "acting",
    "plot",
    "really",
    "quite",
    "very",
    "with",
    "music",
    "ending",
    "cast",
    "this",
    "movie",
    "it",
    "is",
    "so",
]


def synthetic_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (sentence, label) rows whose label is carried by sentiment words among filler."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        lab = "positive" if i % 2 == 0 else "negative"
        words = rng.sample(FILL, rng.randint(3, 8)) + rng.sample(POS if lab == "positive" else NEG, 2)
        rng.shuffle(words)
        rows.append((" ".join(words), lab))
    return rows


def write_csv(path: Path, rows, header=("sentence", "label"), delimiter=",") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(rows)
    return path


def words_of(paths) -> list[str]:
    vocab = set(POS + NEG + FILL)
    for p in paths:
        if Path(p).exists():
            vocab.update(re.findall(r"\w+|[^\w\s]", Path(p).read_text().lower()))
    return sorted(vocab)


def make_checkpoint(
    path: Path,
    words=None,
    *,
    head: bool = False,
    hidden: int = 32,
    layers: int = 2,
    dropout: float = 0.1,
    seed: int = 0,
    num_labels: int = 2,
) -> Path:
    """save_pretrained a random tiny BERT (+ its WordPiece tokenizer) into ``path``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words or words_of([])))
    tok = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    cfg = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(cfg) if head else BertModel(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_finetune_data(d: Path, train_rows: int = 16, eval_rows: int = 8) -> dict:
    """A tiny checkpoint and labelled train/eval CSVs under ``d``: what finetune tests run on."""
    return {
        "dir": d,
        "model": make_checkpoint(d / "m", words_of([])),
        "train": write_csv(d / "train.csv", synthetic_rows(train_rows, 0)),
        "eval": write_csv(d / "dev.csv", synthetic_rows(eval_rows, 1)),
    }


def finetune_args(data: dict, out, *extra, train=None, lr: str | None = "1e-3") -> list:
    """``geomscope finetune`` of ``data`` into ``out`` for one quiet epoch on the CPU, no regulariser
    (``lr`` None: the option left out, for a sweep that gives its own)."""
    return [
        "finetune",
        data["model"],
        "--train",
        train or data["train"],
        "--eval",
        data["eval"],
        "--out",
        out,
        "--epochs",
        "1",
        "--batch-size",
        "8",
        *(["--lr", lr] if lr is not None else []),
        "--device",
        "cpu",
        "--quiet",
        "--reg",
        "none",
        *extra,
    ]


def finetune_cosreg(cli, d: Path, out, *extra):
    """``geomscope finetune`` of a tiny checkpoint ``d/m`` on ``d/train.csv`` (16 rows; built on the
    first call, reused after) into ``out``: one quiet CosReg epoch on the CPU, evaluated on the
    training rows."""
    model = d / "m"
    if not model.exists():
        make_checkpoint(model, words_of([]))
    train = d / "train.csv"
    if not train.exists():
        write_csv(train, synthetic_rows(16, 0))
    args = ["--epochs", "1", "--batch-size", "8", "--device", "cpu", "--quiet", "--reg", "cosreg"]
    return cli(["finetune", model, "--train", train, "--eval", train, "--out", out, *args, *extra])
