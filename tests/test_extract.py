"""geomscope.extract (library): rows and values against plain transformers forwards, invariances, inputs,
limits, resume, identity, disk, errors.  Tiny random BERT / GPT-2 / GPT-NeoX / T5 + the bundled MiniLM."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pytest
import torch
from helpers_models import SAMPLE_TEXTS, make_tiny_model, poison_token

from geomscope.errors import DataError, InputError
from geomscope.extract.run import extract
from geomscope.layers import parse_layers
from geomscope.model.load import load_model
from geomscope.store import Run, iter_shard

TEXTS = SAMPLE_TEXTS + ["a <|endoftext|> inside the text", "  ", "", "The end."]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: make_tiny_model(k, root) for k in ("bert", "gpt2", "gpt_neox", "t5", "llama")} | {
        "gpt2-left": make_tiny_model("gpt2", root, padding_side="left"),
        "bert-left": make_tiny_model("bert", root, padding_side="left"),
    }


@pytest.fixture(scope="session")
def loaded(tiny):
    cache = {}

    def get(kind, **kw):
        key = (kind, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = load_model(str(tiny[kind]), **kw)
        return cache[key]

    return get


def write_lines(path, texts):
    path.write_text("\n".join(texts) + "\n")
    return path


def read_run(run_dir):
    """All rows of a run, sorted by (doc_id, position): meta arrays + float32 layers + nonfinite flags."""
    run = Run(run_dir)
    parts = []
    for info in run.shards:
        for ch in iter_shard(run.shard_path(info)):
            parts.append(ch)
    meta = {
        k: np.concatenate([getattr(c, k) for c in parts])
        for k in ("token_id", "doc_id", "position", "is_special")
    }
    order = np.lexsort((meta["position"], meta["doc_id"]))
    out = {k: v[order] for k, v in meta.items()}
    out["layers"] = {
        n: np.concatenate([c.layers[n] for c in parts]).astype(np.float32)[order] for n in run.layer_names
    }
    out["nonfinite"] = {n: np.concatenate([c.nonfinite[n] for c in parts])[order] for n in run.layer_names}
    out["stored_doc_order"] = np.concatenate([c.doc_id for c in parts])
    return out


def reference(model_dir, texts, *, stack="model", max_length=None, norm=None):
    """Plain transformers: each non-empty document alone (no padding), output_hidden_states=True.
    ``norm``: the final norm's module name, named here per family; its input is hooked into ``pre``."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    rows = {"token_id": [], "doc_id": [], "position": [], "is_special": [], "hs": [], "pre": []}
    if norm is not None:
        model.get_submodule(norm).register_forward_hook(lambda m, a, o: rows["pre"].append(a[0][0].numpy()))
    for i, t in enumerate(texts):
        if not t.strip():
            continue
        kw = {"truncation": True, "max_length": max_length} if max_length else {}
        enc = tok(t, return_special_tokens_mask=True, **kw)
        ids = torch.tensor([enc["input_ids"]])
        with torch.no_grad():
            if stack == "encoder":
                hs = model.get_encoder()(input_ids=ids, output_hidden_states=True).hidden_states
            elif stack == "decoder":
                dec = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), ids[:, :-1]], 1)
                hs = model(
                    input_ids=ids, decoder_input_ids=dec, output_hidden_states=True
                ).decoder_hidden_states
                ids = dec
            else:
                hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        n = ids.shape[1]
        rows["token_id"].append(ids[0].numpy())
        rows["doc_id"].append(np.full(n, i))
        rows["position"].append(np.arange(n))
        sp = np.array(enc["special_tokens_mask"], bool)
        rows["is_special"].append(np.concatenate([[True], sp[:-1]]) if stack == "decoder" else sp)
        rows["hs"].append(np.stack([h[0].numpy() for h in hs]))  # (L, n, D)
    out = {k: np.concatenate(v) for k, v in rows.items() if k not in ("hs", "pre") or (k == "pre" and v)}
    out["hs"] = np.concatenate(rows["hs"], axis=1)
    return out


#: each family's final norm, named here independently of geomscope's own search
FINAL_NORMS = {
    ("bert", "model"): None,
    ("gpt2", "model"): "ln_f",
    ("gpt_neox", "model"): "final_layer_norm",
    ("t5", "encoder"): "encoder.final_layer_norm",
    ("t5", "decoder"): "decoder.final_layer_norm",
    ("llama", "model"): "norm",
}


# ---------------------------------------------------------------- correctness against plain transformers
@pytest.mark.parametrize(
    "kind,stack",
    [
        ("bert", "model"),
        ("gpt2", "model"),
        ("gpt_neox", "model"),
        ("t5", "encoder"),
        ("t5", "decoder"),
        ("llama", "model"),
    ],
)
def test_rows_and_values_match_plain_forward(tmp_path, tiny, kind, stack):
    src = write_lines(tmp_path / "in.txt", TEXTS)
    s = extract(
        str(tiny[kind]),
        [src],
        tmp_path / "run",
        store_dtype="float32",
        batch_tokens=40,
        stack="decoder" if stack == "decoder" else None,
    )
    got = read_run(tmp_path / "run")
    norm = FINAL_NORMS[(kind, stack)]
    ref = reference(tiny[kind], TEXTS, stack=stack, norm=norm)
    for k in ("token_id", "doc_id", "position", "is_special"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    names = Run(tmp_path / "run").layer_names
    n_hs = ref["hs"].shape[0]
    assert n_hs == (4 if stack == "decoder" else 3)
    # layer_i = the residual stream after block i; the last one read at the final norm's input,
    # and final_norm = the norm's output = the last entry of output_hidden_states
    want = {f"layer_{i:02d}": ref["hs"][i] for i in range(n_hs)}
    if norm is not None:
        want[f"layer_{n_hs - 1:02d}"] = ref["pre"]
        want["final_norm"] = ref["hs"][-1]
        assert not np.allclose(ref["pre"], ref["hs"][-1])
    assert names == list(want)
    for n in names:
        np.testing.assert_allclose(got["layers"][n], want[n], rtol=1e-4, atol=2e-5, err_msg=n)
    assert s["rows"] == len(ref["token_id"]) and s["docs_empty"] == 2 and s["docs"] == len(TEXTS) - 2
    layers = Run(tmp_path / "run").layers
    assert [la["final_norm"] for la in layers] == [False] * n_hs + [True] * (norm is not None)
    assert [la["kind"] for la in layers] == ["embeddings"] + ["block"] * (n_hs - 1) + ["final_norm"] * (
        norm is not None
    )
    if norm is not None:
        params = json.loads((tmp_path / "run" / "manifest.json").read_text())["final_norm"]
        assert params["module"] == norm and len(params["gain"]) == ref["hs"].shape[-1]
    # the vocabulary the shards' token ids are held below when the run is read back
    from transformers import AutoConfig, AutoTokenizer

    from geomscope.store import describe_run

    vocab = json.loads((tmp_path / "run" / "manifest.json").read_text())["vocab_size"]
    known = (
        len(AutoTokenizer.from_pretrained(tiny[kind])),
        AutoConfig.from_pretrained(tiny[kind]).vocab_size,
    )
    assert vocab == max(known) and 0 <= got["token_id"].min() and got["token_id"].max() < vocab
    assert describe_run(tmp_path / "run", verify=True)["verify"]["ok"]
    # stored order within the shard: descending length, ties by doc id
    lengths = np.bincount(got["doc_id"])
    seen = list(dict.fromkeys(got["stored_doc_order"].tolist()))
    assert seen == sorted(seen, key=lambda d: (-lengths[d], d))


def test_gpt2_pad_equals_eos_rows_kept(tmp_path, tiny, loaded):
    lm = loaded("gpt2")
    eos = lm.tokenizer.eos_token_id
    assert lm.tokenizer.pad_token_id == eos
    src = write_lines(
        tmp_path / "in.txt", ["<|endoftext|> hello <|endoftext|>", "the dog", "one two three four"]
    )
    extract(lm, [src], tmp_path / "run", batch_tokens=64)
    got = read_run(tmp_path / "run")
    doc0 = got["token_id"][got["doc_id"] == 0]
    assert doc0[0] == eos and doc0[-1] == eos and len(doc0) == 3  # eos rows present, nothing dropped or added
    assert len(got["token_id"]) == 3 + 2 + 4


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_independent_of_batch_size_and_padding_side(tmp_path, tiny, loaded, kind):
    src = write_lines(tmp_path / "in.txt", TEXTS * 3)
    runs = {}
    for label, model, bt in [
        ("big", kind, 4096),
        ("one-doc", kind, 1),
        ("small", kind, 37),
        ("left", f"{kind}-left", 53),
    ]:
        extract(loaded(model), [src], tmp_path / label, store_dtype="float32", batch_tokens=bt, shard_docs=7)
        runs[label] = read_run(tmp_path / label)
    assert loaded(f"{kind}-left").tokenizer.padding_side == "left"
    base = runs["big"]
    for label, r in runs.items():
        for k in ("token_id", "doc_id", "position", "is_special", "stored_doc_order"):
            np.testing.assert_array_equal(r[k], base[k], err_msg=f"{label}:{k}")
        for n, a in r["layers"].items():
            np.testing.assert_allclose(a, base["layers"][n], rtol=1e-4, atol=1e-5, err_msg=f"{label}:{n}")


def test_bundled_minilm_matches_transformers(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from geomscope.model.names import bundled_minilm_dir, resolve_model

    sents = [
        "A man is playing a guitar.",
        "The new movie is awesome, and everyone should see it this week.",
        "Hi",
    ]
    src = write_lines(tmp_path / "in.txt", sents)
    s = extract("all-MiniLM-L6-v2", [src], tmp_path / "run", layers="0,6", store_dtype="float32")
    assert s["model"] == "sentence-transformers/all-MiniLM-L6-v2" and s["layers"] == ["layer_00", "layer_06"]
    path = bundled_minilm_dir()
    for alias in ("bundled:minilm", "sentence-transformers/all-MiniLM-L6-v2", "ALL-MINILM-L6-V2"):
        assert resolve_model(alias)[0] == str(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    got = read_run(tmp_path / "run")
    ident = Run(tmp_path / "run").identity
    assert ident["model"]["hidden_size"] == 384 and ident["model"]["model_type"] == "bert"
    assert [la["final_norm"] for la in ident["layers"]] == [False, False]  # post-LN BERT: no final norm
    for i, t in enumerate(sents):
        enc = tok(t, return_tensors="pt")
        with torch.no_grad():
            o = model(**enc)
        sel = got["doc_id"] == i
        np.testing.assert_allclose(
            got["layers"]["layer_06"][sel], o.last_hidden_state[0].numpy(), atol=1e-4, rtol=1e-4
        )
        np.testing.assert_array_equal(got["token_id"][sel], enc["input_ids"][0].numpy())


# ---------------------------------------------------------------- layers
def test_parse_layers():
    assert parse_layers("all", 7) == list(range(7)) and parse_layers(None, 3) == [0, 1, 2]
    assert parse_layers("0,6", 7) == [0, 6] and parse_layers("4-6", 7) == [4, 5, 6]
    assert parse_layers("-1", 7) == [6] and parse_layers("0, -2--1", 7) == [0, 5, 6]
    assert parse_layers([3, "1"], 7) == [1, 3] and parse_layers("layer_00,layer_02-layer_03", 7) == [0, 2, 3]
    for bad, msg in [
        ("7", "out of range"),
        ("-8", "out of range"),
        ("x", "not a layer index"),
        ("5-2", "backwards"),
        (",", "selects no layer"),
    ]:
        with pytest.raises(InputError, match=msg):
            parse_layers(bad, 7)


def test_layer_subset_and_names(tmp_path, loaded):
    src = write_lines(tmp_path / "in.txt", TEXTS)
    s = extract(
        loaded("gpt_neox"), src, tmp_path / "run", layers="-1", store_dtype="float32"
    )  # one bare input
    full = extract(loaded("gpt_neox"), [src], tmp_path / "full", store_dtype="float32")
    kept = Run(tmp_path / "run").layers
    assert s["layers"] == ["layer_02"] and kept[0]["final_norm"] is False  # the norm's input
    assert "input of the final norm final_layer_norm" in kept[0]["tensor"]
    assert full["layers"][-2:] == ["layer_02", "final_norm"]  # `all` keeps both sides of the norm
    np.testing.assert_array_equal(
        read_run(tmp_path / "run")["layers"]["layer_02"], read_run(tmp_path / "full")["layers"]["layer_02"]
    )
    assert full["bytes"] > s["bytes"]


# ---------------------------------------------------------------- inputs
def test_input_formats_give_identical_runs(tmp_path, loaded):
    import datasets

    docs = ["first document here", "", "second, with a comma", 'third "quoted" one', "  ", "fourth"]
    (tmp_path / "a.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"meta": {"body": d}, "id": i}) for i, d in enumerate(docs))
    )
    import csv

    for name, delim in (("a.csv", ","), ("a.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.writer(f, delimiter=delim)
            w.writerow(["id", "body"])
            w.writerows([[i, d] for i, d in enumerate(docs)])
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "ds"))
    with gzip.open(tmp_path / "a.txt.gz", "wt") as f:
        f.write("\n".join(docs) + "\n")
    lm = loaded("bert")
    base = None
    for name, kw in [
        ("a.txt", {}),
        ("a.jsonl", {"text_field": "meta.body"}),
        ("a.csv", {"text_column": "body"}),
        ("a.tsv", {"text_field": "body"}),  # a .csv/.tsv column too, as the CLI's --text-field
        ("ds", {"text_field": "body"}),
        ("a.txt.gz", {}),
    ]:
        s = extract(lm, [tmp_path / name], tmp_path / f"run-{name}", **kw)
        assert (s["docs"], s["docs_empty"], s["records_read"]) == (4, 2, 6), name
        r = read_run(tmp_path / f"run-{name}")
        if base is None:
            base = r
            continue
        for k in ("token_id", "doc_id", "position"):
            np.testing.assert_array_equal(r[k], base[k], err_msg=name)
        np.testing.assert_array_equal(r["layers"]["layer_02"], base["layers"]["layer_02"], err_msg=name)
    assert Run(tmp_path / "run-a.jsonl").identity["text_field"] == "meta.body"
    assert Run(tmp_path / "run-a.tsv").identity["text_column"] == "body"


def test_several_inputs_and_stdin(tmp_path, loaded):
    import io

    (tmp_path / "a.txt").write_text("one\ntwo three\n")
    (tmp_path / "b.jsonl").write_text('{"text": "four"}\n\n{"text": null}\n{"text": "five six"}\n')
    stdin = io.TextIOWrapper(io.BytesIO(b"seven\n\neight nine\n"))
    s = extract(
        loaded("gpt2"), [tmp_path / "a.txt", tmp_path / "b.jsonl", "-"], tmp_path / "run", stdin=stdin
    )
    got = read_run(tmp_path / "run")
    # doc ids count records across inputs: a.txt 0,1; b.jsonl 2,3(null),4; stdin 5,6(empty),7
    assert sorted(set(got["doc_id"].tolist())) == [0, 1, 2, 4, 5, 7]
    assert s["docs_empty"] == 2 and s["records_read"] == 8
    ident = Run(tmp_path / "run").identity
    assert [i["kind"] for i in ident["inputs"]] == ["text", "jsonl", "stdin"] and ident["inputs"][2][
        "path"
    ] == "-"
    assert all(len(i["sha256"]) == 64 for i in ident["inputs"])


# ---------------------------------------------------------------- limits
def test_max_docs_max_tokens_max_length(tmp_path, loaded):
    lm = loaded("bert")
    src = write_lines(tmp_path / "in.txt", TEXTS)
    s = extract(lm, [src], tmp_path / "docs", max_docs=3)
    assert s["docs"] == 3 and set(read_run(tmp_path / "docs")["doc_id"].tolist()) == {0, 1, 2}
    full = read_run(tmp_path / "docs")
    s = extract(lm, [src], tmp_path / "tok", max_tokens=25, shard_docs=2, store_dtype="float32")
    r = read_run(tmp_path / "tok")
    assert s["rows"] == 25 and s["docs_cut_by_max_tokens"] == 1
    n0 = int((full["doc_id"] == 0).sum()) + int((full["doc_id"] == 1).sum())
    last = r["doc_id"] == r["doc_id"].max()
    assert last.sum() == 25 - n0 and r["position"][last].tolist() == list(
        range(25 - n0)
    )  # first positions kept
    s = extract(lm, [src], tmp_path / "len", max_length=8)
    r = read_run(tmp_path / "len")
    assert np.bincount(r["doc_id"]).max() == 8 and s["docs_at_max_length"] >= 3
    assert r["is_special"][r["position"] == 7].all()  # truncation keeps [SEP]
    assert Run(tmp_path / "len").identity["max_length"] == 8
    with pytest.raises(InputError, match="exceeds what .* can read \\(64 tokens\\)"):
        extract(lm, [src], tmp_path / "long", max_length=1000)
    assert not (tmp_path / "long").exists()


# ---------------------------------------------------------------- resume, identity, disk
def interrupted_extract(monkeypatch, at: int, *args, **kw) -> None:
    """``extract(*args, **kw)`` stopped by a KeyboardInterrupt at its ``at``-th batch (Ctrl-C)."""
    from geomscope.extract import capture as cap

    real = cap.Capture.launch
    calls = {"n": 0}

    def stops(self, docs):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real(self, docs)

    monkeypatch.setattr(cap.Capture, "launch", stops)
    with pytest.raises(KeyboardInterrupt):
        extract(*args, **kw)
    monkeypatch.setattr(cap.Capture, "launch", real)


def test_resume_after_crash_equals_clean_run(tmp_path, loaded, monkeypatch):
    lm = loaded("gpt_neox")
    src = write_lines(tmp_path / "in.txt", TEXTS * 4)
    extract(lm, [src], tmp_path / "clean", shard_docs=5, batch_tokens=64)
    interrupted_extract(monkeypatch, 9, lm, [src], tmp_path / "run", shard_docs=5, batch_tokens=64)
    partial = Run(tmp_path / "run")
    assert not partial.complete and 0 < len(partial.shards) < partial.manifest["planned_shards"]
    assert not list((tmp_path / "run").glob(".*.tmp"))
    s = extract(lm, [src], tmp_path / "run", shard_docs=5, batch_tokens=999)  # batch size may change
    assert s["shards_resumed"] == len(partial.shards) and s["shards_written"] > 0
    a, b = read_run(tmp_path / "clean"), read_run(tmp_path / "run")
    for k in ("token_id", "doc_id", "position", "is_special", "stored_doc_order"):
        np.testing.assert_array_equal(a[k], b[k])
    for n in a["layers"]:
        np.testing.assert_allclose(a["layers"][n], b["layers"][n], atol=2e-3, rtol=2e-3)  # float16 store
    assert Run(tmp_path / "run").complete
    again = extract(lm, [src], tmp_path / "run", shard_docs=5)
    assert again["shards_written"] == 0 and again["rows"] == s["rows"]


def test_resume_reads_the_finished_shards_once(tmp_path, loaded, monkeypatch):
    # each shard asks whether an earlier run finished it; rebuilding the finished shards for every
    # question would make resuming O(shards^2) (3,000 one-document shards: 13 s before a shard runs)
    from geomscope.store.manifest import RunWriter

    lm = loaded("bert")
    src = write_lines(tmp_path / "in.txt", TEXTS * 2)
    # one document per shard and per batch: 5 shards, then Ctrl-C
    interrupted_extract(monkeypatch, 6, lm, [src], tmp_path / "run", shard_docs=1)
    built = {"n": 0}
    finished = RunWriter.finished.fget

    def counted(self):
        built["n"] += 1
        return finished(self)

    monkeypatch.setattr(RunWriter, "finished", property(counted))
    s = extract(lm, [src], tmp_path / "run", shard_docs=1)
    assert s["shards_resumed"] == 5 and s["shards_written"] > 5
    assert s["shards_resumed"] + s["shards_written"] == Run(tmp_path / "run").manifest["planned_shards"]
    assert built["n"] == 1


def test_other_options_refused_overwrite_starts_over(tmp_path, loaded):
    lm = loaded("bert")
    src = write_lines(tmp_path / "in.txt", TEXTS)
    extract(lm, [src], tmp_path / "run")
    before = (tmp_path / "run" / "manifest.json").read_text()
    with pytest.raises(InputError, match=r"different options \(layers"):
        extract(lm, [src], tmp_path / "run", layers="0,1")
    with pytest.raises(InputError, match="store_dtype: 'float16' in the run, 'float32' now"):
        extract(lm, [src], tmp_path / "run", store_dtype="float32")
    write_lines(src, TEXTS[:3])
    with pytest.raises(InputError, match="inputs"):
        extract(lm, [src], tmp_path / "run")
    assert (tmp_path / "run" / "manifest.json").read_text() == before
    s = extract(lm, [src], tmp_path / "run", layers="0,1", overwrite=True)
    assert s["layers"] == ["layer_00", "layer_01"] and s["shards_resumed"] == 0


def test_disk_space_refused_before_writing(tmp_path, loaded, monkeypatch):
    src = write_lines(tmp_path / "in.txt", TEXTS)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(InputError, match="not enough disk space .* needs about .* free"):
        extract(loaded("bert"), [src], tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- errors
def test_helpers_make_tiny_run(tmp_path):
    from helpers_models import make_tiny_run

    run = make_tiny_run(tmp_path, "gpt2", layers="-1", store_dtype="float32")
    r = Run(run)
    assert r.complete and r.layer_names == ["layer_02"] and r.total_rows > len(SAMPLE_TEXTS)
    assert make_tiny_run(tmp_path, "gpt2") == run  # reused


def test_model_errors(tmp_path, tiny):
    from helpers_models import hf_cache_with

    src = write_lines(tmp_path / "in.txt", TEXTS)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        (str(tmp_path / "nope"), "does not exist"),
        ("./also/not/here", "does not exist"),
        (str(tmp_path / "afile"), "is a file"),
        (str(tmp_path / "empty"), "no config.json"),
        ("acme/not-cached", "not in the local Hugging Face cache and offline mode is on"),
    ]
    for name, msg in cases:
        with pytest.raises(InputError, match=msg):
            extract(name, [src], tmp_path / "run", cache_dir=str(tmp_path / "hf"))
    with pytest.raises(InputError, match="bundled:minilm has no revisions"):
        extract("bundled:minilm", [src], tmp_path / "run", revision="v1")
    with pytest.raises(InputError, match="--revision applies to hub names"):
        extract(str(tiny["bert"]), [src], tmp_path / "run", revision="v1")
    hf_cache_with(tiny["bert"], tmp_path / "hf-noweights", "acme/tiny", weights=False)
    with pytest.raises(InputError, match="holds its config but not its weights"):
        extract("acme/tiny", [src], tmp_path / "run", cache_dir=str(tmp_path / "hf-noweights"))
    assert not (tmp_path / "run").exists()
    # the same layout with weights loads offline, at a revision, and records the commit
    commit = "ab" * 20
    hf_cache_with(tiny["bert"], tmp_path / "hf", "acme/tiny", commit=commit, ref="v1")
    s = extract("acme/tiny", [src], tmp_path / "run", revision="v1", cache_dir=str(tmp_path / "hf"))
    m = Run(tmp_path / "run").identity["model"]
    assert (m["name"], m["revision"], m["commit"], s["commit"]) == ("acme/tiny", "v1", commit, commit)
    with pytest.raises(InputError, match="offline"):
        extract("acme/tiny", [src], tmp_path / "run2", revision="v2", cache_dir=str(tmp_path / "hf"))
    with pytest.raises(InputError, match="--stack decoder applies to encoder-decoder models"):
        extract(str(tiny["bert"]), [src], tmp_path / "run3", stack="decoder")


def test_input_errors_write_nothing(tmp_path, loaded):
    lm = loaded("bert")
    good = write_lines(tmp_path / "in.txt", TEXTS)
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "bad.txt").write_bytes(b"fine line\n\xff\xfe broken \x80\n")
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "arr.jsonl").write_text('[{"text": "x"}]\n')
    (tmp_path / "a.csv").write_text("id,body\n1,x\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    import datasets

    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tmp_path / "ds-missing-col"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a"]}),
            "test": datasets.Dataset.from_dict({"text": ["b"]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    cases = [
        ([tmp_path / "missing.txt"], {}, "does not exist"),
        ([tmp_path / "blank.txt"], {}, "no text in"),
        ([tmp_path / "bad.txt"], {}, "not UTF-8 text .*on line 2"),
        ([tmp_path / "a.jsonl"], {}, "line 1 has no field 'text' \\(it has: body\\)"),
        ([tmp_path / "arr.jsonl"], {}, "JSON array"),
        ([tmp_path / "a.csv"], {}, "no column 'text' \\(columns: id, body\\)"),
        ([tmp_path / "dir"], {}, "not a dataset saved by"),
        ([tmp_path / "bad.gz"], {}, "cannot be read"),
        (
            [tmp_path / "dd"],
            {},
            "holds several splits \\(train, test\\); give one split's directory, e.g. .*dd/train",
        ),
        ([tmp_path / "ds-missing-col"], {"text_field": "body"}, "has no column 'body' \\(columns: text\\)"),
        ([good], {"layers": "3"}, "layer 3 is out of range"),
        ([good], {"layers": "-4"}, "out of range"),
        ([good], {"max_docs": 0}, "--max-docs must be a positive"),
        ([good], {"store_dtype": "int8"}, "--store-dtype must be one of"),
        ([], {}, "no input given"),
    ]
    for inputs, kw, msg in cases:
        with pytest.raises(InputError, match=msg):
            extract(lm, inputs, tmp_path / "run", **kw)
        assert not (tmp_path / "run").exists(), msg


def test_nonfinite_activations_flagged_and_reported(tmp_path, tiny):
    model = make_tiny_model("bert", tmp_path, name="poisoned")
    poison_token(model, "poison")
    src = write_lines(tmp_path / "in.txt", ["the dog", "a poison here", "the cat"])
    with pytest.raises(DataError, match="rows hold NaN/Inf activations") as ei:
        extract(str(model), [src], tmp_path / "run")
    s = ei.value.summary
    run = Run(tmp_path / "run")
    assert run.complete and s["rows"] == run.total_rows == 4 + 5 + 4
    got = read_run(tmp_path / "run")
    bad0 = got["nonfinite"]["layer_00"]
    assert bad0.sum() == 1 and got["doc_id"][bad0][0] == 1  # the poisoned token itself at the embeddings
    bad2 = got["nonfinite"]["layer_02"]
    assert set(got["doc_id"][bad2].tolist()) == {1}  # attention spreads it within document 1 only
    assert s["nonfinite_by_layer"]["layer_00"] == 1 and s["nonfinite_rows"] == int(bad2.sum())
    assert np.isfinite(got["layers"]["layer_02"][got["doc_id"] != 1]).all()
    ok = extract(str(model), [src], tmp_path / "run2", allow_nonfinite=True)
    assert ok["nonfinite_rows"] == s["nonfinite_rows"]


def test_float16_overflow_flagged(tmp_path):
    model = make_tiny_model("gpt2", tmp_path, name="loud")
    poison_token(model, "poison", value=1e6)
    src = write_lines(tmp_path / "in.txt", ["poison", "the dog"])
    s = extract(str(model), [src], tmp_path / "run", layers="0", allow_nonfinite=True)
    assert s["nonfinite_rows"] == 1  # 1e6 is finite in float32, Inf in the float16 store
    s32 = extract(str(model), [src], tmp_path / "run32", layers="0", store_dtype="float32")
    assert s32["nonfinite_rows"] == 0


def test_bfloat16_compute_close_to_float32(tmp_path, tiny):
    src = write_lines(tmp_path / "in.txt", TEXTS)
    extract(str(tiny["gpt2"]), [src], tmp_path / "f32", store_dtype="float32")
    s = extract(
        str(tiny["gpt2"]), [src], tmp_path / "bf16", dtype="bfloat16", store_dtype="float32", device="auto"
    )
    assert s["device"] == "cpu" and Run(tmp_path / "bf16").identity["model"]["dtype"] == "bfloat16"
    a, b = read_run(tmp_path / "f32"), read_run(tmp_path / "bf16")
    np.testing.assert_array_equal(a["token_id"], b["token_id"])
    for n in a["layers"]:
        scale = np.abs(a["layers"][n]).max()
        assert np.abs(a["layers"][n] - b["layers"][n]).max() < 0.05 * scale
    with pytest.raises(InputError, match="--stack must be one of auto, encoder, decoder"):
        extract(str(tiny["t5"]), [src], tmp_path / "x", stack="sideways")


def test_final_norm_layer_choice(tmp_path, loaded):
    src = write_lines(tmp_path / "in.txt", TEXTS)
    s = extract(loaded("gpt2"), [src], tmp_path / "a", layers="final_norm,0", store_dtype="float32")
    assert s["layers"] == ["layer_00", "final_norm"]
    assert extract(loaded("gpt2"), [src], tmp_path / "b", layers="blocks")["layers"] == [
        "layer_01",
        "layer_02",
    ]
    assert extract(loaded("gpt2"), [src], tmp_path / "c", layers="final_norm")["layers"] == ["final_norm"]
    with pytest.raises(InputError, match="no final norm to store separately.*post-LN"):
        extract(loaded("bert"), [src], tmp_path / "d", layers="final_norm")
    assert not (tmp_path / "d").exists()


def test_the_device_side_nan_check_records_what_the_store_check_does(tmp_path, monkeypatch):
    """On a GPU the capture checks NaN/Inf on the device and the store thread takes its answer;
    forced here on the CPU (the same code, .cpu() a no-op): the same rows, flags and summary, and
    the store's own check never runs on rows already in the store dtype."""
    import geomscope.store.shard as shard_mod
    from geomscope.extract import capture as cap

    model = make_tiny_model("bert", tmp_path, name="poisoned-device")
    poison_token(model, "poison")
    src = write_lines(tmp_path / "in.txt", ["the dog", "a poison here", "the cat"])
    ref = extract(str(model), [src], tmp_path / "ref", allow_nonfinite=True)
    real_init, checked = cap.Capture.__init__, []

    def as_if_on_a_gpu(self, *a, **k):
        real_init(self, *a, **k)
        self.on_cpu = False

    real_check = shard_mod.nonfinite_rows
    monkeypatch.setattr(cap.Capture, "__init__", as_if_on_a_gpu)
    monkeypatch.setattr(shard_mod, "nonfinite_rows", lambda a: checked.append(1) or real_check(a))
    dev = extract(str(model), [src], tmp_path / "dev", allow_nonfinite=True)
    assert checked == []
    assert dev["nonfinite_rows"] == ref["nonfinite_rows"] > 0
    assert dev["nonfinite_by_layer"] == ref["nonfinite_by_layer"]
    a, b = read_run(tmp_path / "ref"), read_run(tmp_path / "dev")
    for n in a["nonfinite"]:
        np.testing.assert_array_equal(a["nonfinite"][n], b["nonfinite"][n])
        np.testing.assert_array_equal(a["layers"][n], b["layers"][n])


def test_on_a_gpu_the_next_batch_is_queued_before_the_last_is_waited_for(tmp_path, monkeypatch):
    """On a GPU a batch's forward and copies are queued (capture.launch) before the previous batch's
    rows are waited for, so the GPU runs while the host hands those over. Forced here on the CPU:
    copies that stay "in flight" until waited for. In every shard batch k is waited for right after
    batch k + 1 is launched, the last one before the shard is published, and the run stores what
    the plain run stores."""
    from geomscope.extract import capture as cap
    from geomscope.extract import shards as shards_mod

    model = make_tiny_model("bert", tmp_path, name="pipelined")
    src = write_lines(tmp_path / "in.txt", TEXTS * 3)
    kw = {"shard_docs": 6, "batch_tokens": 24}
    ref = extract(str(model), [src], tmp_path / "ref", **kw)
    log: list[str] = []

    class Event:  # stands for a CUDA event recorded after a batch's copies
        def __init__(self, n):
            self.n = n

        def synchronize(self):
            log.append(f"W{self.n}")

    real_init, real_launch, real_copies = cap.Capture.__init__, cap.Capture.launch, cap.start_host_copies
    real_write = shards_mod.ShardRun._write

    def as_if_on_a_gpu(self, *a, **k):
        real_init(self, *a, **k)
        self.on_cpu = False

    def launch(self, docs):
        log.append(f"L{sum(e[0] == 'L' for e in log)}")
        return real_launch(self, docs)

    def in_flight(tensors):
        return cap.HostCopies(real_copies(tensors).value, [Event(sum(e[0] == "L" for e in log) - 1)])

    def write(self, k, *a):
        log.append("|")
        return real_write(self, k, *a)

    monkeypatch.setattr(cap.Capture, "__init__", as_if_on_a_gpu)
    monkeypatch.setattr(cap.Capture, "launch", launch)
    monkeypatch.setattr(cap, "start_host_copies", in_flight)
    monkeypatch.setattr(shards_mod.ShardRun, "_write", write)
    got = extract(str(model), [src], tmp_path / "got", **kw)
    shards = " ".join(log).split("|")[1:]
    assert len(shards) == got["shards_written"] >= 3
    several = 0
    for shard in shards:
        steps = shard.split()
        first = int(steps[0][1:])
        n = len(steps) // 2
        want = [f"L{first}"]
        for i in range(first + 1, first + n):
            want += [f"L{i}", f"W{i - 1}"]
        assert steps == [*want, f"W{first + n - 1}"]
        several += n > 1
    assert several >= 2  # shards of several batches, so that the overlap is seen
    for k in ("rows", "shards_written", "nonfinite_rows"):
        assert got[k] == ref[k]
    a, b = read_run(tmp_path / "ref"), read_run(tmp_path / "got")
    for n in a["layers"]:
        np.testing.assert_array_equal(a["layers"][n], b["layers"][n])
    for k in ("token_id", "doc_id", "position"):
        np.testing.assert_array_equal(a[k], b[k])


def test_append_takes_a_given_nan_check_only_for_rows_in_the_store_dtype(tmp_path):
    from geomscope.store.shard import ShardWriter

    meta = {"token_id": [1, 2], "doc_id": [0, 0], "position": [0, 1], "is_special": [False, False]}
    w = ShardWriter(tmp_path / "a.h5", index=0, layer_names=["x"], dim=3)
    w.append({"x": np.ones((2, 3), np.float16)}, **meta, nonfinite={"x": np.array([True, False])})
    assert w.nonfinite_rows == 1  # the caller's check of these very values is taken as given
    # float32 rows are cast here: 1e6 overflows float16, so the given check cannot know it
    w.append({"x": np.full((2, 3), 1e6, np.float32)}, **meta, nonfinite={"x": np.zeros(2, bool)})
    assert w.nonfinite_rows == 3 and w.nonfinite_by_layer == {"x": 3}
    w.abort()
