"""Extractive question answering for ``geomscope finetune --task qa`` (SQuAD v1.1 style).

The I-STAR paper fine-tunes on SQuAD besides GLUE; this module supplies what a span-extraction task
needs on top of the classification loop, following the standard Hugging Face ``run_qa`` recipe:

* **Data** (:func:`load_qa`): SQuAD v1.1 JSON (``{"data": [{"paragraphs": [{"context", "qas":
  [{"id", "question", "answers": [{"text", "answer_start"}]}]}]}]}``), or flat records (JSON lines,
  a JSON list, or a ``datasets`` save_to_disk directory) with ``id``, ``context``, ``question`` and
  ``answers`` either as ``{"text": [...], "answer_start": [...]}`` (the HF ``squad`` layout) or as a
  list of ``{"text", "answer_start"}``.  Every record needs at least one answer whose
  ``answer_start`` points at its text in the context; anything else is a one-line
  :class:`~geomscope.errors.InputError` (unanswerable SQuAD v2 questions are not supported).
* **Features** (:class:`QAEncoded`): ``tokenizer(question, context, truncation="only_second",
  max_length, stride, return_overflowing_tokens, return_offsets_mapping)`` -- a long context becomes
  several overlapping windows (``stride`` = ``min(128, max_length // 4)`` tokens of overlap).
  *Features*, not examples, are the unit of a batch, so the loop's deterministic global batches,
  rank slices and loss scaling apply unchanged.  The training label of a feature is the (start, end)
  token span of the first gold answer, or (0, 0) -- the CLS position -- when the window does not
  contain the whole answer.  ``collate`` returns them as ``labels`` of shape (B, 2).
* **Loss**: ``(CE(start) + CE(end)) / 2`` per feature over its real tokens (padding is masked out of
  the softmax, so the loss does not depend on the batch's padding width), summed and scaled across
  ranks exactly as the classification cross-entropy (:func:`qa_loss_sum`); the I-STAR / CosReg
  penalties act on the hidden states of the real tokens (attention mask) as for classification.
* **Evaluation** (:func:`evaluate_qa`): for every feature the ``N_BEST`` (20) highest start and end
  logits; candidate spans lie inside the context, end >= start, at most ``MAX_ANSWER_TOKENS`` (30)
  tokens long, scored by start + end logit; the best span over all features of an example is mapped
  back through the offsets to the context text.  ``exact_match`` and ``f1`` are the official SQuAD
  v1.1 metrics (:func:`squad_scores`: lower-case, strip punctuation, the articles a/an/the and extra
  whitespace; token-overlap F1 = 2PR/(P+R); the maximum over the gold answers; mean over examples)
  **in percent, 0-100**, as the official script reports them.  The eval record also carries the
  mean span loss and the same eval-set geometry (IsoScore, IsoScore*, average cosines) as the
  classification evaluation, over all eval features.
"""

from __future__ import annotations

import collections
import math
import re
import string
from dataclasses import dataclass
from pathlib import Path

from geomscope.errors import InputError, first_line
from geomscope.fileio import read_json

N_BEST = 20
MAX_ANSWER_TOKENS = 30


# -- metrics (official SQuAD v1.1 evaluation script) -----------------------------------------------


def normalize_answer(s: str) -> str:
    """Lower-case, remove punctuation, the articles a/an/the and extra whitespace (SQuAD v1.1)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token-overlap F1 of the normalised strings (0 when nothing is shared)."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: list[str], golds: list[list[str]]) -> dict:
    """``{"exact_match", "f1"}`` in percent: the mean over examples of the max over gold answers."""
    if len(predictions) != len(golds):
        raise ValueError("one prediction per example is needed")
    n = len(predictions)
    em = sum(max(exact_match_score(p, g) for g in gs) for p, gs in zip(predictions, golds, strict=True))
    f1 = sum(max(f1_score(p, g) for g in gs) for p, gs in zip(predictions, golds, strict=True))
    return {"exact_match": 100.0 * em / n if n else 0.0, "f1": 100.0 * f1 / n if n else 0.0}


# -- data -------------------------------------------------------------------------------------------


@dataclass
class QATable:
    """SQuAD examples: ids, questions, contexts and gold answers (text, character start)."""

    source: str
    ids: list[str]
    questions: list[str]
    contexts: list[str]
    answers: list[list[tuple[str, int]]]

    def __len__(self) -> int:
        return len(self.ids)


def _read_records(path: Path) -> list[dict]:
    """Flat records of a SQuAD JSON, a JSON list, JSON lines, or a save_to_disk directory."""
    from geomscope.train.data import read_rows

    if not path.exists():
        raise InputError(f"data file {path} does not exist")
    if path.is_file() and path.stat().st_size == 0:
        raise InputError(f"data file {path} is empty; it needs at least one question with an answer")
    if path.is_file() and path.suffix.lower() == ".json":
        try:
            whole = read_json(path, encoding="utf-8-sig", max_bytes=None)  # (nesting bounded)
        except UnicodeDecodeError:
            raise InputError(f"data file {path} is not UTF-8 text; convert it to UTF-8") from None
        except (ValueError, RecursionError):
            whole = None  # JSON lines in a .json file (each line is then checked on its own)
        if isinstance(whole, dict) and "data" in whole:
            return _flatten_squad(whole, path)
        if isinstance(whole, list):
            if not all(isinstance(r, dict) for r in whole):
                raise InputError(f"{path} is a JSON list whose items are not all objects (records)")
            return whole
        if isinstance(whole, dict):
            return [whole]
    if path.is_file() and path.suffix.lower() not in (".json", ".jsonl"):
        raise InputError(
            f"unsupported QA data file {path}: use SQuAD .json, .jsonl records or a datasets "
            "save_to_disk directory"
        )
    return read_rows(path)[1]


def _flatten_squad(obj: dict, path: Path) -> list[dict]:
    data = obj["data"]
    if not isinstance(data, list):
        raise InputError(f"{path}: 'data' is not a list of articles (SQuAD v1.1 layout expected)")
    rows = []
    for a, art in enumerate(data):
        paras = art.get("paragraphs") if isinstance(art, dict) else None
        if not isinstance(paras, list):
            raise InputError(f"{path}: article {a + 1} has no 'paragraphs' list (SQuAD v1.1 layout expected)")
        for p, para in enumerate(paras):
            if not isinstance(para, dict) or not isinstance(para.get("qas"), list):
                raise InputError(f"{path}: article {a + 1} paragraph {p + 1} has no 'qas' list")
            for qa in para["qas"]:
                if not isinstance(qa, dict):
                    raise InputError(
                        f"{path}: article {a + 1} paragraph {p + 1} has a question that is not an object"
                    )
                rows.append({**qa, "context": para.get("context")})
    return rows


def _answers(rec: dict, where: str) -> list[tuple[str, int]]:
    ans = rec.get("answers")
    if isinstance(ans, dict):
        texts, starts = ans.get("text"), ans.get("answer_start")
        if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
            raise InputError(f"{where}: 'answers' needs lists 'text' and 'answer_start' of the same length")
        pairs = list(zip(texts, starts, strict=True))
    elif isinstance(ans, list):
        pairs = []
        for a in ans:
            if not isinstance(a, dict) or "text" not in a or "answer_start" not in a:
                raise InputError(f"{where}: each answer needs 'text' and 'answer_start'")
            pairs.append((a["text"], a["answer_start"]))
    elif ans is None:
        raise InputError(f"{where} has no 'answers'; every question needs at least one answer")
    else:
        raise InputError(f"{where}: 'answers' must be a list or {{'text': [...], 'answer_start': [...]}}")
    if not pairs:
        raise InputError(
            f"{where} has no answers; every question needs at least one "
            "(unanswerable SQuAD v2 questions are not supported)"
        )
    out = []
    for text, start in pairs:
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{where}: an answer text is empty or not a string")
        if (
            isinstance(start, bool)
            or not isinstance(start, (int, float))
            or not math.isfinite(start)
            or int(start) != start
        ):
            raise InputError(f"{where}: answer_start {start!r} is not a whole number")
        out.append((text, int(start)))
    return out


def load_qa(path: str | Path) -> QATable:
    """Read SQuAD-format data; a one-line :class:`InputError` on anything a QA run cannot use."""
    path = Path(path)
    rows = _read_records(path)
    if not rows:
        raise InputError(f"data file {path} has no records; it needs at least one question with an answer")
    t = QATable(str(path), [], [], [], [])
    for i, rec in enumerate(rows, 1):
        rid = rec.get("id")
        where = f"{path} record {i}" + (f" (id {rid!r})" if rid is not None else "")
        for name in ("id", "context", "question"):
            v = rec.get(name)
            if v is None or (name != "id" and not isinstance(v, str)) or str(v).strip() == "":
                raise InputError(
                    f"{where} has no {name!r}; QA records need id, context, question and answers"
                )
        ctx = rec["context"]
        answers = _answers(rec, where)
        for text, start in answers:
            if ctx[start : start + len(text)] != text:
                found = ctx[max(start, 0) : max(start, 0) + len(text)]
                raise InputError(
                    f"{where}: answer_start {start} does not point at the answer {text!r} in the context "
                    f"(found {found!r} there)"
                )
        t.ids.append(str(rid))
        t.questions.append(rec["question"].lstrip())
        t.contexts.append(ctx)
        t.answers.append(answers)
    return t


# -- features ---------------------------------------------------------------------------------------


def doc_stride(max_length: int) -> int:
    """Overlap of consecutive windows of one context: min(128, max_length // 4) tokens."""
    return min(128, max_length // 4)


class QAEncoded:
    """Tokenised windows (features) of QA examples with (start, end) token labels and offsets.

    ``offsets[f][j]`` is the character span of token ``j`` of feature ``f`` in its context, or None
    for question / special tokens; ``example[f]`` is the example a feature came from.
    """

    def __init__(self, tokenizer, table: QATable, max_length: int):
        if not getattr(tokenizer, "is_fast", False):
            raise InputError(
                "--task qa needs a fast (Rust) tokenizer for character offsets; this model's tokenizer "
                "is a slow one"
            )
        self.stride = doc_stride(max_length)
        try:
            enc = tokenizer(
                table.questions,
                table.contexts,
                truncation="only_second",
                max_length=max_length,
                stride=self.stride,
                return_overflowing_tokens=True,
                return_offsets_mapping=True,
                padding=False,
            )
        except Exception as e:  # the tokenizers library raises its own Exception for impossible windows
            raise InputError(
                f"cannot cut {table.source} into windows of --max-length {max_length} "
                f"({first_line(e)}); a question is too long: raise --max-length"
            ) from None
        self.input_ids: list[list[int]] = enc["input_ids"]
        self.token_type_ids: list[list[int]] | None = enc.get("token_type_ids")
        self.example: list[int] = list(enc["overflow_to_sample_mapping"])
        self.offsets: list[list[tuple[int, int] | None]] = []
        self.labels: list[tuple[int, int]] = []
        for f in range(len(self.input_ids)):
            seq = enc.sequence_ids(f)
            offs = [tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][f], seq, strict=True)]
            self.offsets.append(offs)
            text, start = table.answers[self.example[f]][0]
            self.labels.append(_span_label(offs, start, start + len(text)))
        self.table = table
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.n_tokens = sum(len(x) for x in self.input_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_examples(self) -> int:
        return len(self.table)

    def collate(self, idx):
        """Pad the features ``idx`` on the right; ``labels`` is the (B, 2) start/end tensor."""
        from geomscope.train.data import pad_batch

        return pad_batch(self.input_ids, self.token_type_ids, self.pad_id, idx, self.labels)


def _span_label(offsets: list, start_char: int, end_char: int) -> tuple[int, int]:
    """(start, end) token indices of the answer characters [start_char, end_char) in this window, or
    (0, 0) (CLS) when the window does not hold the whole answer."""
    ctx = [j for j, o in enumerate(offsets) if o is not None]
    if not ctx:
        return (0, 0)
    first, last = ctx[0], ctx[-1]
    if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
        return (0, 0)
    s = first
    while s <= last and offsets[s][1] <= start_char:  # skip tokens that end before the answer starts
        s += 1
    e = last
    while e >= first and offsets[e][0] >= end_char:  # skip tokens that start after the answer ends
        e -= 1
    return (s, e) if s <= e else (0, 0)


def decode_span(encoded: QAEncoded, feature: int, start: int, end: int) -> str:
    """The context text of tokens ``start..end`` of ``feature`` (through the offsets)."""
    offs = encoded.offsets[feature]
    ctx = encoded.table.contexts[encoded.example[feature]]
    return ctx[offs[start][0] : offs[end][1]]


# -- loss and evaluation ----------------------------------------------------------------------------


def qa_loss_sum(out, labels, attention_mask):
    """Sum over the features of (CE(start) + CE(end)) / 2 (labels: (B, 2) token indices).

    Padding positions are excluded from the softmax, so a feature's loss does not depend on how far
    its batch was padded (one process with batch 2b and two with b each give the same loss)."""
    import torch.nn.functional as F

    pad = attention_mask == 0
    s_log = out.start_logits.float().masked_fill(pad, -1e9)
    e_log = out.end_logits.float().masked_fill(pad, -1e9)
    s = F.cross_entropy(s_log, labels[:, 0], reduction="sum")
    e = F.cross_entropy(e_log, labels[:, 1], reduction="sum")
    return (s + e) / 2


def best_spans(encoded: QAEncoded, start_logits: list, end_logits: list) -> list[str]:
    """The predicted answer text of every example (see the module docstring); examples without a
    valid span get the empty string."""
    import numpy as np

    best: list[tuple[float, str] | None] = [None] * encoded.n_examples
    for f in range(len(encoded)):
        s_log, e_log = np.asarray(start_logits[f]), np.asarray(end_logits[f])
        offs = encoded.offsets[f]
        n = len(offs)
        s_top = np.argsort(-s_log[:n], kind="stable")[:N_BEST]
        e_top = np.argsort(-e_log[:n], kind="stable")[:N_BEST]
        ex = encoded.example[f]
        for s in s_top:
            if offs[s] is None:
                continue
            for e in e_top:
                if offs[e] is None or e < s or e - s + 1 > MAX_ANSWER_TOKENS:
                    continue
                score = float(s_log[s] + e_log[e])
                if best[ex] is None or score > best[ex][0]:
                    best[ex] = (score, decode_span(encoded, f, int(s), int(e)))
    return ["" if b is None else b[1] for b in best]


def evaluate_qa(
    model,
    encoded: QAEncoded,
    layers: list[int],
    zeta: float,
    batch_size: int,
    d,
    autocast,
    C0=None,
) -> dict:
    """Per-epoch QA evaluation record, identical on every rank: exact_match, f1 (percent), the mean
    span loss over features, and the eval-set geometry of :func:`geomscope.train.evaluate.evaluate`
    (``C0``: the shrinkage target the penalty used this epoch, or None)."""
    import torch

    from geomscope import distributed as dd
    from geomscope.train.evaluate import EvalGeometry, eval_batches

    dev = d.device
    geo = EvalGeometry(model.config.hidden_size, layers, dev)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=dev)
    logits: dict = {}  # feature -> (start logits, end logits) as float32 arrays of its length
    for idx, batch, out, mask in eval_batches(model, encoded, geo, batch_size, d, autocast):
        loss_sum += qa_loss_sum(out, batch["labels"].to(dev), mask).double()
        s_log, e_log = out.start_logits.float().cpu(), out.end_logits.float().cpu()
        for row, f in enumerate(idx):
            n = len(encoded.input_ids[f])
            logits[f] = (s_log[row, :n].numpy().copy(), e_log[row, :n].numpy().copy())
    loss_sum = dd.all_reduce_sum(loss_sum, d)
    merged: dict = {}
    for part in dd.gather_objects(logits, d):
        merged.update(part)
    preds = best_spans(
        encoded, [merged[f][0] for f in range(len(encoded))], [merged[f][1] for f in range(len(encoded))]
    )
    golds = [[t for t, _ in a] for a in encoded.table.answers]
    scores = squad_scores(preds, golds)
    return {
        "eval_examples": encoded.n_examples,
        "eval_features": len(encoded),
        **scores,
        "eval_loss": float(loss_sum[0]) / max(len(encoded), 1),
        **geo.finish(d, zeta, C0=C0),
    }
