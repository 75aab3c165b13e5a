"""Batch planning (extract/batching.py): every cut respects the token budget, keeps the order, and pads
little; a huge document is tokenized from a bounded prefix, to the tokens of the whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from geomscope.extract.batching import Doc, length_order, pad_right, plan_batches, row_meta


def docs_of(lengths):
    return length_order(
        [Doc(i, np.arange(n, dtype=np.int64) + 5, np.zeros(n, bool)) for i, n in enumerate(lengths)]
    )


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=120), st.integers(1, 4096))
def test_plan_respects_budget_and_order(lengths, budget):
    docs = docs_of(lengths)
    batches = plan_batches(docs, budget)
    assert [d.doc_id for b in batches for d in b] == [d.doc_id for d in docs]  # consecutive, nothing lost
    for b in batches:
        assert len(b) == 1 or len(b) * max(len(d) for d in b) <= budget


def _padded(batches):
    return sum(len(b) * max(len(d) for d in b) for b in batches)


def test_plan_is_optimal_against_brute_force_and_beats_greedy():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=12).tolist()
    docs = docs_of(lengths)
    budget, c = 120, 10.0
    got = plan_batches(docs, budget, overhead=c)
    # brute force over all 2^(n-1) ways to cut the sorted list
    n = len(docs)
    best = None
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        bs = [docs[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        if all(len(b) * len(b[0]) <= budget for b in bs):
            cost = _padded(bs) + c * len(bs)
            best = cost if best is None else min(best, cost)
    assert _padded(got) + c * len(got) == best
    wide = docs_of([200] + [20] * 300)
    assert _padded(plan_batches(wide, 8192)) < 1.1 * sum(len(d) for d in wide)  # the long one alone


def test_pad_right_and_row_meta():
    docs = [
        Doc(7, np.array([1, 2, 3]), np.array([True, False, True])),
        Doc(3, np.array([9]), np.array([False])),
    ]
    ids, mask = pad_right(docs, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [9, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    m = row_meta(docs)
    assert m["doc_id"].tolist() == [7, 7, 7, 3] and m["position"].tolist() == [0, 1, 2, 0]
    assert m["token_id"].tolist() == [1, 2, 3, 9] and m["is_special"].tolist() == [True, False, True, False]
    d = row_meta(docs, decoder_start=0)
    assert d["token_id"].tolist() == [0, 1, 2, 0] and d["is_special"].tolist() == [True, True, False, True]


def _direct_plan(lengths: list[int], budget: int) -> list[int]:
    """The batch ends of the direct programme: for each document i, from the last, every batch end j
    in its window priced in full (the definition plan_batches's sliding minimum must reproduce)."""
    n, c = len(lengths), budget / 32
    best, nxt = [0.0] * (n + 1), [0] * n
    for i in range(n - 1, -1, -1):
        top = min(n, i + max(1, budget // lengths[i]))
        costs = [((j - i) * float(lengths[i]) + c + best[j], j) for j in range(i + 1, top + 1)]
        low = min(cost for cost, _ in costs)
        best[i], nxt[i] = low, max(j for cost, j in costs if cost == low)  # ties: the larger batch
    ends, i = [], 0
    while i < n:
        ends.append(nxt[i])
        i = nxt[i]
    return ends


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(1, 8), st.integers(1, 700)),  # few distinct lengths, or many
        min_size=1,
        max_size=250,
    ),
    st.one_of(st.integers(1, 64), st.integers(64, 40000)),
)
def test_plan_equals_the_direct_programme(lengths, budget):
    docs = docs_of(lengths)
    batches = plan_batches(docs, budget)
    ends = list(np.cumsum([len(b) for b in batches]))
    assert ends == _direct_plan([len(d) for d in docs], budget)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=20),
    st.one_of(st.none(), st.integers(0, 50)),
    st.integers(0, 2**31),
)
def test_pad_right_and_row_meta_match_document_by_document(lengths, decoder_start, seed):
    rng = np.random.default_rng(seed)
    docs = [
        Doc(int(rng.integers(0, 10**9)), rng.integers(0, 50000, n).astype(np.int64), rng.random(n) < 0.3)
        for n in lengths
    ]
    ids, mask = pad_right(docs, pad_id=-1)
    assert ids.dtype == mask.dtype == np.int64 and ids.shape == (len(docs), max(lengths))
    meta = row_meta(docs, decoder_start=decoder_start)
    rows = 0
    for b, d in enumerate(docs):
        n = len(d)
        assert ids[b, :n].tolist() == d.ids.tolist() and (ids[b, n:] == -1).all()
        assert mask[b].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        part = slice(rows, rows + n)
        if decoder_start is None:
            tokens, special = d.ids.tolist(), d.special.tolist()
        else:  # the decoder's inputs: the start token, then the document shifted right by one
            tokens, special = [decoder_start, *d.ids[:-1].tolist()], [True, *d.special[:-1].tolist()]
        assert meta["token_id"][part].tolist() == tokens and meta["is_special"][part].tolist() == special
        assert meta["doc_id"][part].tolist() == [d.doc_id] * n and meta["position"][part].tolist() == list(
            range(n)
        )
        rows += n
    assert all(len(v) == rows for v in meta.values()) and meta["token_id"].dtype == np.int64


# ------------------------------------------------------------------ tokenizing a bounded prefix


def test_a_huge_document_keeps_memory_flat(tmp_path, tiny_bert):
    """A 20 MB line, truncated to 16 tokens: the tokenizer sees a bounded prefix (the original bug took
    3.4 GB), and the stored tokens are those of the document's start."""
    big = tmp_path / "big.txt"
    words = ("lorem ipsum dolor sit amet " * 800_000)[:20_000_000]
    big.write_text("short first document\n" + words + "\n")
    code = (
        "import resource, sys, json\n"
        "from geomscope.extract.run import extract\n"
        f"s = extract({str(tiny_bert)!r}, [{str(big)!r}], {str(tmp_path / 'run')!r}, max_length=16)\n"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(json.dumps({'rss_mb': rss, 'rows': s['rows']}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    short = len(AutoTokenizer.from_pretrained(tiny_bert)("short first document")["input_ids"])
    assert got["rows"] == short + 16  # the short document whole, 16 tokens of the huge one
    assert got["rss_mb"] < 1500, got  # the whole-line tokenization alone took over 3,000 MB


def test_bounded_prefix_gives_the_tokens_of_the_whole_document(tiny_bert):
    from transformers import AutoTokenizer

    from geomscope.extract.batching import tokenize

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    long_doc = " ".join(["the quick brown fox jumps over the lazy dog"] * 5000)
    [doc] = tokenize(tok, [(0, long_doc)], 64)
    whole = tok(long_doc, truncation=True, max_length=64)["input_ids"]
    assert doc.ids.tolist() == whole and len(whole) == 64
