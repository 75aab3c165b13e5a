"""Causal language modelling for ``geomscope finetune --task causal-lm``: next-token loss on text.

I-STAR's open question is isotropy during language-model training itself; this module gives the
classification loop what a decoder trained on its own text needs.

* **Data** (:func:`geomscope.train.data.read_documents`): a text file, one document per line, or
  the ``--text-field`` of a CSV/TSV/JSONL file or a save_to_disk directory; blank documents are
  left out (counted in summary.json).
* **Rows** (:class:`LMEncoded`, ``--lm-batching``). Each document is tokenised as the tokenizer
  encodes it (its own special tokens: a Llama BOS, a BERT-vocabulary [CLS] ... [SEP]), then

  - ``pack`` (the default, as Hugging Face's ``run_clm``): the documents, each followed by the EOS
    token unless it already ends with it, are concatenated in file order and cut into blocks of
    ``--max-length`` tokens; the last block keeps the remainder (padded in its batch) when it holds
    at least 2 tokens. Attention runs across document boundaries inside a block, as in
    ``run_clm``.
  - ``pad``: one document per row, truncated to ``--max-length``, padded on the right in its batch.
    A document of fewer than 2 tokens predicts nothing and is left out (counted).

  The rows, not the documents, are the unit of a batch, so the loop's deterministic global batches
  and rank slices apply unchanged.
* **Loss** (:func:`lm_loss_sum`): position t predicts token t + 1 (labels are the ids, -100 on
  padding, so padding neither predicts nor is predicted); the cross-entropy summed over the predicted
  tokens in float32. The task loss of a global batch is that sum divided by the number of predicted
  tokens of the *whole* global batch, which every process counts from the batch's rows (no
  communication): a token-level mean, as ``model(..., labels=...)`` takes over one batch, and the
  same for one process with batch N·B and N processes with B.
* **Penalties**: I-STAR and CosReg act on the decoder's hidden states exactly as for a classifier
  (the same ``--layers`` grammar); their rows are the real tokens of the attention mask, so padding
  never enters the covariance (``--include-padding`` counts it, as for the other tasks).
* **Evaluation** (:func:`evaluate_lm`): ``eval_loss`` = sum of the token losses over the eval set /
  number of predicted tokens (exact: summed in float64 over every batch and process, not a mean of
  batch means) and ``perplexity`` = exp(eval_loss), with the eval-set geometry of
  :class:`geomscope.train.evaluate.EvalGeometry` over the real tokens.
"""

from __future__ import annotations

import math

from geomscope.errors import InputError
from geomscope.train.data import Documents, pad_batch

#: the label of a position that predicts nothing (transformers' and torch's ignore index)
IGNORE = -100


def eos_token_id(tokenizer, config) -> int | None:
    """The token that ends a document: the tokenizer's EOS, else the model config's."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):  # (some configs list several)
            eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


class LMEncoded:
    """Token rows of a causal-LM data set (module docstring): ``input_ids`` (unpadded lists),
    ``n_examples`` documents read, ``short`` documents left out (``pad``: fewer than 2 tokens)."""

    def __init__(self, tokenizer, docs: Documents, max_length: int, batching: str, eos_id: int | None):
        pack = batching == "pack"
        if pack and eos_id is None:
            raise InputError(
                "--lm-batching pack joins documents with the EOS token, and neither this tokenizer nor "
                "the model's config has one; pass --lm-batching pad"
            )
        enc = tokenizer(
            docs.texts,
            add_special_tokens=True,
            truncation=not pack,
            max_length=None if pack else max_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        ids = enc["input_ids"]
        self.short = 0
        if pack:
            self.input_ids = pack_blocks(ids, eos_id, max_length)
        else:
            self.input_ids = [x for x in ids if len(x) >= 2]
            self.short = len(ids) - len(self.input_ids)
        if not self.input_ids:
            raise InputError(
                f"{docs.source} has no document of 2 tokens or more; a next-token loss needs one to "
                "predict from"
            )
        self.batching = batching
        self.n_examples = len(docs)
        self.blank = docs.blank
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.n_tokens = sum(len(x) for x in self.input_ids)
        self.n_predicted = self.predicted(range(len(self.input_ids)))

    def __len__(self) -> int:
        return len(self.input_ids)

    def predicted(self, idx) -> int:
        """The number of predicted tokens of rows ``idx``: each row of n tokens predicts n - 1."""
        return sum(len(self.input_ids[i]) - 1 for i in idx)

    def collate(self, idx) -> dict:
        """Pad the rows ``idx`` on the right; ``labels`` are the ids, -100 on padding."""
        batch = pad_batch(self.input_ids, None, self.pad_id, idx, None)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        return batch


def pack_blocks(docs: list[list[int]], eos_id: int, block: int) -> list[list[int]]:
    """The documents' ids, each followed by ``eos_id`` unless it ends with it, concatenated and cut
    into rows of ``block`` tokens; a last row shorter than 2 tokens (nothing to predict) is dropped."""
    stream: list[int] = []
    for ids in docs:
        stream.extend(ids)
        if not ids or ids[-1] != eos_id:
            stream.append(eos_id)
    rows = [stream[i : i + block] for i in range(0, len(stream), block)]
    if rows and len(rows[-1]) < 2:
        rows.pop()
    return rows


def lm_loss_sum(logits, labels):
    """(sum of the next-token cross-entropies, number of predicted tokens) of a batch: position t's
    logits against token t + 1, positions whose target is -100 left out; float32 or wider."""
    import torch.nn.functional as F

    target = labels[:, 1:].reshape(-1)
    where = (target != IGNORE).nonzero().squeeze(1)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, where).float()
    return F.cross_entropy(flat, target.index_select(0, where), reduction="sum"), int(where.numel())


def perplexity(mean_loss: float) -> float:
    """exp(mean token loss); inf where it overflows a float (JSON then says null)."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf


def evaluate_lm(
    model,
    encoded: LMEncoded,
    layers: list[int],
    zeta: float,
    batch_size: int,
    d,
    autocast,
    C0=None,
) -> dict:
    """Per-epoch causal-LM evaluation record, identical on every rank: ``eval_loss`` (the sum of the
    token losses over all predicted eval tokens divided by their number), ``perplexity``, the counts,
    and the eval-set geometry of :func:`geomscope.train.evaluate.evaluate` (``C0``: the shrinkage
    target the penalty used this epoch, or None)."""
    import torch

    from geomscope import distributed as dd
    from geomscope.train.evaluate import EvalGeometry, eval_batches

    dev = d.device
    geo = EvalGeometry(model.config.hidden_size, layers, dev)
    totals = torch.zeros(2, dtype=torch.float64, device=dev)  # loss sum, predicted tokens
    for _, batch, out, _ in eval_batches(model, encoded, geo, batch_size, d, autocast):
        loss_sum, count = lm_loss_sum(out.logits, batch["labels"].to(dev))
        totals[0] += loss_sum.double()
        totals[1] += count
    totals = dd.all_reduce_sum(totals, d)
    loss_sum, count = float(totals[0]), int(totals[1])
    mean = loss_sum / count if count else math.nan
    return {
        "eval_examples": encoded.n_examples,
        "eval_rows": len(encoded),
        "eval_predicted_tokens": count,
        "eval_loss": mean,
        "perplexity": perplexity(mean) if count else math.nan,
        **geo.finish(d, zeta, C0=C0),
    }
