"""Batch planning (extract/batching.py): every cut respects the token budget, keeps the order, and pads
little; a huge document is tokenized from a bounded prefix, to the tokens of the whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
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


#: the environment of the measured process: one thread for every pool (torch's OpenMP, BLAS, the
#: tokenizer's), no distributed or SLURM variables that a test or the machine set, the CPU device --
#: so what is measured is the same process on every machine
_PINNED_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAYON_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}

_MEASURE = """
import json, resource, sys
from geomscope.extract.run import extract
model, out, *inputs = sys.argv[1:]
got = []
for i, path in enumerate(inputs):
    s = extract(model, [path], f"{out}/run{i}", max_length=16, device="cpu")
    got.append({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rows": s["rows"]})
print(json.dumps(got))
"""


def _peaks_of_extracts(model, tmp_path, inputs) -> list[dict]:
    """``{"peak_mb", "rows"}`` after each input's extract (max_length 16), one after the other in
    one fresh process in :data:`_PINNED_ENV`."""
    keep = ("PATH", "HOME", "TMPDIR", "LD_LIBRARY_PATH")
    env = {k: os.environ[k] for k in keep if k in os.environ} | _PINNED_ENV
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    args = [sys.executable, "-c", _MEASURE, str(model), str(tmp_path), *map(str, inputs)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_huge_document_keeps_memory_flat(tmp_path, tiny_bert):
    """Two 20 MB lines, truncated to 16 tokens -- words, and one character repeated (no whitespace
    to cut at) -- grow the process's peak by less than 400 MB over an extract of one short line in
    the same process (tokenizing them whole takes 5,000 and 1,200 MB more), and the stored tokens
    are those of each document's start."""
    from transformers import AutoTokenizer

    small = tmp_path / "small.txt"
    small.write_text("short first document\n")
    big = tmp_path / "big.txt"
    words = ("lorem ipsum dolor sit amet " * 800_000)[:20_000_000]
    big.write_text("short first document\n" + words + "\n" + "a" * 20_000_000 + "\n")
    base, huge = _peaks_of_extracts(tiny_bert, tmp_path, [small, big])
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    short = len(tok("short first document")["input_ids"])
    # the tokenizer reads any run of over 100 letters as one unknown word: [CLS] [UNK] [SEP]
    one_word = len(tok("a" * 200_000)["input_ids"])
    assert base["rows"] == short and huge["rows"] == short + 16 + one_word
    assert huge["peak_mb"] - base["peak_mb"] < 400, (base, huge)


_FOX = "the quick brown fox jumps over the lazy dog"
#: documents of 200,000 characters or more, each of whose first 16 tokens lie in its first 16 x 1024
_HUGE_DOCUMENTS = {
    "words": " ".join([_FOX] * 5000),
    "one character": "a" * 200_000,
    "words then one long word": "a b c\t" + "x" * 200_000,
    "long words between lines": "\n".join(["y" * 150] * 2000),
    "a word over a quarter of the prefix": _FOX + " " + "z" * 16_000 + " " + _FOX * 5000,
    "a long word across the prefix's end": "fox " + " " * 12_000 + "z" * 200_000,
}


@pytest.mark.parametrize("name", sorted(_HUGE_DOCUMENTS))
def test_bounded_prefix_gives_the_tokens_of_the_whole_document(tiny_bert, name):
    from transformers import AutoTokenizer

    from geomscope.extract.batching import MAX_CHARS_PER_TOKEN, tokenize

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    text = _HUGE_DOCUMENTS[name]
    for max_length in (16, 64):
        [doc] = tokenize(tok, [(0, text)], max_length)
        whole = tok(text, truncation=True, max_length=max_length)["input_ids"]
        assert doc.ids.tolist() == whole, (name, max_length)
        assert len(text) > max_length * MAX_CHARS_PER_TOKEN


class _Recording:
    """A tokenizer that records the length of every text it is given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __call__(self, texts, **kw):
        self.lengths += [len(t) for t in ([texts] if isinstance(texts, str) else texts)]
        return self.tok(texts, **kw)


def test_a_document_is_read_to_at_most_max_length_times_the_chars_per_token_limit(tiny_bert):
    """A document of one character repeated gives 3 tokens however much of it is read: the prefix
    stops growing at MAX_CHARS_PER_TOKEN characters a token, and the tokens of what follows a run of
    whitespace or a word longer than that are left out (the stated limit)."""
    from transformers import AutoTokenizer

    from geomscope.extract.batching import MAX_CHARS_PER_TOKEN, tokenize

    tok = _Recording(AutoTokenizer.from_pretrained(tiny_bert))
    text = "a" * 1_000_000
    tokenize(tok, [(0, text)], 16)
    assert tok.lengths and max(tok.lengths) <= 16 * MAX_CHARS_PER_TOKEN
    for far in ("fox " + " " * (16 * MAX_CHARS_PER_TOKEN) + _FOX, "x" * 200_000 + " " + _FOX):
        [doc] = tokenize(tok, [(0, far)], 16)
        assert doc.ids.tolist() == tok.tok(far[: 16 * MAX_CHARS_PER_TOKEN])["input_ids"]
        assert len(doc) < len(tok.tok(far, truncation=True, max_length=16)["input_ids"])
