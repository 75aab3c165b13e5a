"""score --metrics stratified: IsoScore, IsoScore* and the average cosine per token-frequency bin
and per position bin, against numpy on the rows of each bin (bins rebuilt here from the rule the
docs state: types by count, cut at equal token mass; positions cut at the edges), with the
jackknife directly, on a synthetic run, a --token-counts file and the bundled MiniLM."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_runs import jackknife_se, minilm_run, run_rows
from test_score import make_run, ref_avgcos, ref_cov, ref_iso, ref_star

from geomscope.errors import InputError
from geomscope.score import ScoreOptions, score


def bins_by_mass(counts, b):
    """Token id -> bin: types by count (most first, ties by id), bin floor(b x tokens before / total)."""
    types = sorted((i for i in range(len(counts)) if counts[i] > 0), key=lambda i: (-counts[i], i))
    total, before, out = sum(counts), 0, {}
    for t in types:
        out[t] = min(b - 1, before * b // total)
        before += counts[t]
    return out


def metrics_of(x):
    c = ref_cov(x)
    return {"isoscore": ref_iso(c), "isoscore_star": ref_star(c, 0.2), "avgcos": ref_avgcos(x, "plain")}


def check_bins(e, x, docs, labels, short, n_bins, groups):
    for b in range(n_bins):
        rows = labels == b
        want = metrics_of(x[rows])
        reps = [metrics_of(x[rows & (docs % groups != r)]) for r in sorted(set(docs[rows] % groups))]
        for m, v in want.items():
            key = f"{short}{b + 1}_{m}"
            assert e[key] == pytest.approx(v, rel=1e-8, abs=1e-12), key
            assert e["se"][key] == pytest.approx(jackknife_se([r[m] for r in reps]), rel=1e-6), key
        assert e["strata"]["frequency" if short == "freq" else "position"][b]["rows"] == rows.sum()


def test_position_and_counted_frequency_bins_of_a_run(tmp_path):
    make_run(tmp_path / "run", n_shards=2, rows=160, doc_len=20)
    counts = np.zeros(200, np.int64)
    counts[:160] = np.arange(160)[::-1] % 37 + 1  # a skewed table over the rows' token ids 0..159
    (tmp_path / "counts.json").write_text(json.dumps({str(i): int(c) for i, c in enumerate(counts) if c}))
    opts = ScoreOptions(
        metrics="stratified",
        position_edges="3,9",
        frequency_bins=3,
        token_counts=str(tmp_path / "counts.json"),
        jackknife_groups=4,
    )
    rep = score(tmp_path / "run", opts)
    assert rep["params"]["strata"]["frequency_from"].startswith("file:")
    to_bin = bins_by_mass(list(counts), 3)
    for e in rep["layers"]:
        x, meta = run_rows(tmp_path / "run", e["layer"])
        check_bins(e, x, meta["doc_id"], np.searchsorted([3, 9], meta["position"], side="right"), "pos", 3, 4)
        labels = np.array([to_bin.get(int(t), 2) for t in meta["token_id"]])
        check_bins(e, x, meta["doc_id"], labels, "freq", 3, 4)
    described = rep["params"]["strata"]["position"]
    assert described == [
        {"bin": 1, "positions": [0, 3]},
        {"bin": 2, "positions": [3, 9]},
        {"bin": 3, "positions": [9, None]},
    ]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm_strata")
    full = minilm_run(root, sentences=30, layers="0,6")
    (root / "kept").mkdir()
    return full, minilm_run(root / "kept", sentences=30, layers="0,6", keep="sample:20")


def test_bundled_minilm_with_its_own_counts(minilm):
    full, _ = minilm
    rep = score(full, ScoreOptions(metrics="stratified", jackknife_groups=3, position_edges="1,16"))
    x0, meta = run_rows(full, "layer_00")
    counts = np.bincount(meta["token_id"])
    to_bin = bins_by_mass(list(counts), 4)
    assert [b["tokens"] for b in rep["params"]["strata"]["frequency"]] == [
        int(sum(counts[t] for t, b in to_bin.items() if b == k)) for k in range(4)
    ]
    labels = np.array([to_bin[int(t)] for t in meta["token_id"]])
    e = rep["layers"][1]
    x, _ = run_rows(full, "layer_06")
    check_bins(e, x, meta["doc_id"], labels, "freq", 4, 3)
    pos = np.searchsorted([1, 16], meta["position"], side="right")
    for b in (1, 2):  # (bin 1 is the [CLS] token alone)
        rows = pos == b
        assert e[f"pos{b + 1}_avgcos"] == pytest.approx(ref_avgcos(x[rows], "plain"), rel=1e-8)
    # the embedding layer's [CLS] rows are identical: no variance, said why
    first = rep["layers"][0]
    assert first["pos1_isoscore"] is None and "variance" in first["notes"]["pos1_isoscore"]


def test_sources_without_rows_or_ids_say_why(minilm, tmp_path):
    _, kept = minilm
    e = score(kept, ScoreOptions(metrics="stratified", id_sample=20))["layers"][0]
    assert e["freq1_avgcos"] is None and "--keep all" in e["notes"]["freq1_avgcos"]
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(50, 4)))
    a = score(tmp_path / "x.npy", ScoreOptions(metrics="stratified"))["layers"][0]
    assert a["pos2_isoscore"] is None and "no token ids" in a["notes"]["pos2_isoscore"]


def test_bad_options(cli, minilm, tmp_path):
    full, _ = minilm
    with pytest.raises(InputError, match="must increase"):
        ScoreOptions(position_edges="8,1").validate()
    (tmp_path / "c.json").write_text('{"a": 1}')
    code, out, err = cli(["score", str(full), "-m", "stratified", "--token-counts", str(tmp_path / "c.json")])
    assert_one_line_error(code, out, err, "--token-counts")
    np.save(tmp_path / "c.npy", np.array([1.0, -2.0]))
    code, out, err = cli(["score", str(full), "-m", "stratified", "--token-counts", str(tmp_path / "c.npy")])
    assert_one_line_error(code, out, err, "whole number >= 0")
