"""Tokenizing a shard's documents, ordering them by length and cutting batches by a token budget.

Within a shard, documents are processed -- and their rows stored -- in descending token length, ties
broken by ascending ``doc_id``.  That order depends only on the documents, never on the batch size,
so the stored rows are identical whatever ``batch_tokens`` is.  Batches are consecutive runs of that
order with ``n_docs x longest <= batch_tokens`` (a document longer than the budget gets a batch of
its own), cut where padding is least (see :func:`plan_batches`), so the padded size of every batch
is bounded and little compute goes to padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Doc:
    """One tokenized document: its id, token ids and special-token flags (both (n,))."""

    doc_id: int
    ids: np.ndarray
    special: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


#: characters of a document read per token kept, before tokenizing (grown while too few tokens come out)
CHARS_PER_TOKEN = 16


def bounded_prefix(text: str, max_length: int | None, chars_per_token: int = CHARS_PER_TOKEN) -> str:
    """The part of ``text`` that can matter for its first ``max_length`` tokens, so that memory does
    not grow with a document's length (a 20 MB line would otherwise be tokenized whole to keep 128
    tokens). The cut falls on whitespace where there is some, so no word is split."""
    if max_length is None:
        return text
    limit = max_length * chars_per_token
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", limit * 3 // 4, limit)
    return text[: cut if cut > 0 else limit]


def _truncated_texts(tokenizer, texts: list[str], max_length: int | None) -> list[str]:
    """Each text cut to :func:`bounded_prefix`, with a longer prefix wherever a cut one gave fewer than
    ``max_length`` tokens (so the tokens kept are those of the whole text)."""
    out = []
    for text in texts:
        per_token = CHARS_PER_TOKEN
        while True:
            prefix = bounded_prefix(text, max_length, per_token)
            if len(prefix) == len(text):
                break
            n = len(
                tokenizer(prefix, add_special_tokens=True, truncation=True, max_length=max_length)[
                    "input_ids"
                ]
            )
            if n >= max_length:
                break
            per_token *= 4
        out.append(prefix)
    return out


def tokenize(tokenizer, items: list[tuple[int, str]], max_length: int | None) -> list[Doc]:
    """Tokenize ``(doc_id, text)`` pairs with the model's special tokens, truncating to ``max_length``
    (reading only a bounded prefix of each text: :func:`bounded_prefix`)."""
    if not items:
        return []
    texts = _truncated_texts(tokenizer, [t for _, t in items], max_length)
    kw = {"truncation": True, "max_length": max_length} if max_length else {"truncation": False}
    enc = tokenizer(
        texts,
        add_special_tokens=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
        return_token_type_ids=False,
        **kw,
    )
    docs = []
    for (doc_id, _), ids, special in zip(items, enc["input_ids"], enc["special_tokens_mask"], strict=True):
        docs.append(Doc(doc_id, np.asarray(ids, dtype=np.int64), np.asarray(special, dtype=bool)))
    return docs


def length_order(docs: list[Doc]) -> list[Doc]:
    """Descending length, ties by ascending doc id (the stored row order within a shard)."""
    return sorted(docs, key=lambda d: (-len(d), d.doc_id))


def plan_batches(docs: list[Doc], batch_tokens: int, overhead: float | None = None) -> list[list[Doc]]:
    """Cut length-ordered (descending) docs into consecutive batches with
    ``len(batch) * longest <= batch_tokens``.

    Among all such cuts, the one with the least ``padded tokens + overhead x batches`` (exact dynamic
    programme over the sorted lengths, O(n x docs-per-batch) in numpy).  ``overhead`` -- the cost of
    one more batch in token-equivalents -- defaults to ``batch_tokens / 32``: a batch is split when
    that saves more padding than 1/32 of the budget.  Greedy filling up to the budget padded 20 %
    of a shard of varied sentences; this pads ~7 %.  A document longer than the budget is a batch
    of its own.
    """
    n = len(docs)
    if n == 0:
        return []
    c = batch_tokens / 32 if overhead is None else float(overhead)
    lengths = np.array([max(1, len(d)) for d in docs], dtype=np.int64)
    if np.any(np.diff(lengths) > 0):
        raise ValueError("plan_batches needs documents in descending length order (length_order)")
    best = np.zeros(n + 1)
    nxt = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        fit = max(1, batch_tokens // int(lengths[i]))
        j = np.arange(i + 1, min(n, i + fit) + 1)
        cost = (j - i) * float(lengths[i]) + c + best[j]
        m = len(cost) - 1 - int(np.argmin(cost[::-1]))  # on ties, the larger batch
        best[i], nxt[i] = cost[m], j[m]
    batches, i = [], 0
    while i < n:
        batches.append(docs[i : int(nxt[i])])
        i = int(nxt[i])
    return batches


def pad_right(docs: list[Doc], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)`` (B, T) int64, real tokens first, padding on the right.

    Right padding keeps every model's default positions (0, 1, ... for the real tokens) and, in causal
    models, keeps padding out of every real token's context; so the rows do not depend on the
    tokenizer's configured padding side.
    """
    width = max(len(d) for d in docs)
    ids = np.full((len(docs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(docs), width), dtype=np.int64)
    for b, d in enumerate(docs):
        ids[b, : len(d)] = d.ids
        mask[b, : len(d)] = 1
    return ids, mask


def row_meta(docs: list[Doc], *, decoder_start: int | None = None) -> dict[str, np.ndarray]:
    """Per-row ``token_id``, ``doc_id``, ``position``, ``is_special`` in the batch's row order.

    Row order = the attention mask's real positions in row-major (document, position) order.  With
    ``decoder_start`` (the decoder stack of an encoder-decoder model) the token of each row is the
    decoder's input there: the start token, then the document shifted right by one.
    """
    if decoder_start is None:
        token_id = np.concatenate([d.ids for d in docs])
        special = np.concatenate([d.special for d in docs])
    else:
        token_id = np.concatenate(
            [np.concatenate([[decoder_start], d.ids[:-1]]).astype(np.int64) for d in docs]
        )
        special = np.concatenate([np.concatenate([[True], d.special[:-1]]).astype(bool) for d in docs])
    lengths = np.array([len(d) for d in docs])
    doc_id = np.repeat(np.array([d.doc_id for d in docs], dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    position = np.arange(int(lengths.sum()), dtype=np.int64) - starts
    return {"token_id": token_id, "doc_id": doc_id, "position": position, "is_special": special}
