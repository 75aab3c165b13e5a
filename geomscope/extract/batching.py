"""Tokenizing a shard's documents, ordering them by length and cutting batches by a token budget.

Within a shard, documents are processed -- and their rows stored -- in descending token length, ties
broken by ascending ``doc_id``.  That order depends only on the documents, never on the batch size,
so the stored rows are identical whatever ``batch_tokens`` is.  Batches are consecutive runs of that
order with ``n_docs x longest <= batch_tokens`` (a document longer than the budget gets a batch of
its own), cut where padding is least (see :func:`plan_batches`), so the padded size of every batch
is bounded and little compute goes to padding.
"""

from __future__ import annotations

from collections import deque
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


#: characters of a document read per token kept, at first (the prefix grows 4x while too few tokens
#: come out of it: :func:`_truncated_texts`)
CHARS_PER_TOKEN = 16

#: the most characters of a document read per token kept: ``max_length x 1024`` characters at most
#: are tokenized, so memory follows ``max_length``, not the document (tokenizing costs up to ~270
#: bytes a character: 140 MB for 512 tokens). A vocabulary's longest tokens are ~100 characters (a
#: longer word is one unknown token in WordPiece), so only runs of whitespace or of words over a
#: thousand characters leave fewer than ``max_length`` tokens in that many characters.
MAX_CHARS_PER_TOKEN = 1024

_WHITESPACE = " \t\n\r\f\v"


def _last_whitespace(text: str, stop: int) -> int:
    """The index of the last whitespace character in ``text[:stop]``, -1 where there is none."""
    return max(text.rfind(c, 0, stop) for c in _WHITESPACE)


def bounded_prefix(text: str, max_length: int | None, chars_per_token: int = CHARS_PER_TOKEN) -> str:
    """The part of ``text`` that can matter for its first ``max_length`` tokens, at most
    ``max_length x chars_per_token`` characters, so that memory does not grow with a document's
    length (a 20 MB line would otherwise be tokenized whole to keep 128 tokens).

    The cut falls on the last whitespace before that limit, so no word is split and the prefix's
    tokens are the document's first ones. A first word longer than the limit (a line without
    whitespace) is cut at the limit. At :data:`MAX_CHARS_PER_TOKEN`, the prefix's last size, a word
    of over a quarter of the limit that crosses it is cut there rather than left out: its part has
    at least 256 characters, which WordPiece reads as one unknown token, as it does the whole word."""
    if max_length is None:
        return text
    limit = max_length * chars_per_token
    if len(text) <= limit:
        return text
    cut = _last_whitespace(text, limit)
    if cut > 0 and (chars_per_token < MAX_CHARS_PER_TOKEN or cut >= limit * 3 // 4):
        return text[:cut]
    return text[:limit]


def _truncated_texts(tokenizer, texts: list[str], max_length: int | None) -> list[str]:
    """Each text cut to :func:`bounded_prefix`, with a prefix 4x longer wherever a cut one gave fewer
    than ``max_length`` tokens (so the tokens kept are those of the whole text), up to
    :data:`MAX_CHARS_PER_TOKEN` characters a token."""
    out = []
    for text in texts:
        per_token = CHARS_PER_TOKEN
        while True:
            prefix = bounded_prefix(text, max_length, per_token)
            if len(prefix) == len(text) or per_token >= MAX_CHARS_PER_TOKEN:
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
    programme over the sorted lengths; on ties, the larger batch).  ``overhead`` -- the cost of one
    more batch in token-equivalents -- defaults to ``batch_tokens / 32``: a batch is split when that
    saves more padding than 1/32 of the budget.  Greedy filling up to the budget padded 20 % of a
    shard of varied sentences; this pads ~7 %.  A document longer than the budget is a batch of its
    own.

    The programme: ``best[i]``, the least cost of documents i.., is the least over the batch ends j
    in (i, i + fit] of ``(j - i) L + overhead + best[j]`` (L = document i's length, the batch's
    longest; fit = budget // L).  Within a run of documents of equal length L that is
    ``g(j) - i L + overhead`` with ``g(j) = j L + best[j]``, so the minimum over a window that slides
    down by one document per step is kept in a monotone deque (amortised O(1) a document) and built
    afresh, in numpy, where the length changes: 1.1 ms for 1,000 sentences of 3-128 tokens
    (budgets 8,192 and 32,768), where one numpy pass over the window per document, O(n x
    docs-per-batch), takes 5.4-6.1 ms -- work on the thread that feeds the GPU, which runs MiniLM's
    forward at ~900,000 tokens/s (an H100).  With the default overhead every cost is an integer plus a
    multiple of 1/32, exact in float64, so the cuts are those of the direct programme (tested).
    """
    n = len(docs)
    if n == 0:
        return []
    c = batch_tokens / 32 if overhead is None else float(overhead)
    lengths = [max(1, len(d)) for d in docs]
    if any(a < b for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ValueError("plan_batches needs documents in descending length order (length_order)")
    best = [0.0] * (n + 1)
    best_array = np.zeros(n + 1)  # the same values, for the rebuilds
    nxt = [0] * n
    window: deque[int] = deque()  # batch ends j, ascending, g(j) non-increasing: the last is the argmin
    run_length = None
    for i in range(n - 1, -1, -1):
        length = lengths[i]
        top = min(n, i + max(1, batch_tokens // length))
        if length != run_length:  # g changed: the window's candidates afresh
            run_length = length
            ends = np.arange(i + 1, top + 1)
            g = ends * float(length) + best_array[i + 1 : top + 1]
            lowest_before = np.minimum.accumulate(np.concatenate(([np.inf], g[:-1])))
            window = deque(ends[g <= lowest_before].tolist())  # none before it is lower: a candidate
        else:
            j = i + 1  # the new, smallest end: it outlives every other, which it beats when lower
            g_new = j * float(length) + best[j]
            while window and window[0] * float(length) + best[window[0]] > g_new:
                window.popleft()
            window.appendleft(j)
            while window[-1] > top:
                window.pop()
        j = window[-1]
        best[i] = best_array[i] = (j - i) * float(length) + c + best[j]
        nxt[i] = j
    batches, i = [], 0
    while i < n:
        batches.append(docs[i : nxt[i]])
        i = nxt[i]
    return batches


def pad_right(docs: list[Doc], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)`` (B, T) int64, real tokens first, padding on the right.

    Right padding keeps every model's default positions (0, 1, ... for the real tokens) and, in causal
    models, keeps padding out of every real token's context; so the rows do not depend on the
    tokenizer's configured padding side.
    """
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    real = np.arange(lengths.max(initial=0)) < lengths[:, None]
    ids = np.full(real.shape, pad_id, dtype=np.int64)
    ids[real] = np.concatenate([d.ids for d in docs])  # row-major: each document's tokens in order
    mask = real.astype(np.int64)
    return ids, mask


def row_meta(docs: list[Doc], *, decoder_start: int | None = None) -> dict[str, np.ndarray]:
    """Per-row ``token_id``, ``doc_id``, ``position``, ``is_special`` in the batch's row order.

    Row order = the attention mask's real positions in row-major (document, position) order.  With
    ``decoder_start`` (the decoder stack of an encoder-decoder model) the token of each row is the
    decoder's input there: the start token, then the document shifted right by one.
    """
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    starts = np.cumsum(lengths) - lengths
    token_id = np.concatenate([d.ids for d in docs])
    special = np.concatenate([d.special for d in docs])
    if decoder_start is not None and len(token_id):  # the whole batch shifted by one, then each start
        first = starts[lengths > 0]
        token_id = np.concatenate(([decoder_start], token_id[:-1])).astype(np.int64)
        token_id[first] = decoder_start
        special = np.concatenate(([True], special[:-1])).astype(bool)
        special[first] = True
    doc_id = np.repeat(np.fromiter((d.doc_id for d in docs), np.int64, len(docs)), lengths)
    position = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
    return {"token_id": token_id, "doc_id": doc_id, "position": position, "is_special": special}
