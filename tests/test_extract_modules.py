"""extract --modules: every family's module outputs, inputs and q/k/v against torch forward hooks
written here on a plain transformers forward, one document at a time (to 1e-6); the same rows
whatever the batch size and padding side; gradients against torch.autograd; --keep sample against
the full run; the bundled MiniLM; the layer names and manifest entries; one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, make_tiny_head_model, make_tiny_model

from geomscope.extract.run import extract
from geomscope.store import Run, iter_shard

TEXTS = [t for t in SAMPLE_TEXTS if t.strip()]
SPEC = "attn_out,mlp_out,q,k,v,ln1_in,ln2_out"


def _expected(kind: str, stack: str, blocks: int) -> dict[str, tuple[str, str, str | None]]:
    """Each family's module layers for SPEC, named here from transformers' own module layout:
    ``{layer: (module path, side, how a fused q/k/v output is cut)}``."""
    per_block = {
        "bert": [
            ("attention.output.dense", "out", None),
            ("output.dense", "out", None),
            ("attention.self.query", "out", None),
            ("attention.self.key", "out", None),
            ("attention.self.value", "out", None),
            ("attention.output.LayerNorm", "in", None),
            ("output.LayerNorm", "out", None),
        ],
        "gpt2": [
            ("attn", "out", None),
            ("mlp", "out", None),
            ("attn.c_attn", "out", "thirds:0"),
            ("attn.c_attn", "out", "thirds:1"),
            ("attn.c_attn", "out", "thirds:2"),
            ("ln_1", "in", None),
            ("ln_2", "out", None),
        ],
        "gpt_neox": [
            ("attention", "out", None),
            ("mlp", "out", None),
            ("attention.query_key_value", "out", "heads:0"),
            ("attention.query_key_value", "out", "heads:1"),
            ("attention.query_key_value", "out", "heads:2"),
            ("input_layernorm", "in", None),
            ("post_attention_layernorm", "out", None),
        ],
        "mistral": [
            ("self_attn", "out", None),
            ("mlp", "out", None),
            ("self_attn.q_proj", "out", None),
            ("self_attn.k_proj", "out", None),
            ("self_attn.v_proj", "out", None),
            ("input_layernorm", "in", None),
            ("post_attention_layernorm", "out", None),
        ],
        "t5": [
            ("layer.0.SelfAttention", "out", None),
            ("layer.1.DenseReluDense", "out", None),
            ("layer.0.SelfAttention.q", "out", None),
            ("layer.0.SelfAttention.k", "out", None),
            ("layer.0.SelfAttention.v", "out", None),
            ("layer.0.layer_norm", "in", None),
            ("layer.1.layer_norm", "out", None),
        ],
    }[kind]
    prefix = {"bert": "encoder.layer", "gpt2": "h", "gpt_neox": "layers", "mistral": "layers"}.get(
        kind, f"{stack}.block"
    )
    out = {}
    for b in range(blocks):
        for rel, side, cut in per_block:
            path = f"{prefix}.{b}.{rel}"
            name = path + (":in" if side == "in" else "") + (f":{'qkv'[int(cut[-1])]}" if cut else "")
            out[name] = (path, side, cut)
    return out


def _cut(t, cut: str | None, heads: int):
    """A fused projection's output cut as the model itself cuts it (GPT-2: ``split`` into thirds;
    GPT-NeoX: per head ``view(..., heads, 3 * d_head).chunk(3, -1)``), back to (tokens, D)."""
    if cut is None:
        return t
    how, j = cut.split(":")
    if how == "thirds":
        return t.split(t.shape[-1] // 3, dim=-1)[int(j)]
    part = t.view(*t.shape[:-1], heads, t.shape[-1] // heads).chunk(3, dim=-1)[int(j)]
    return part.reshape(*t.shape[:-1], -1)


def _hooked(model, expected, heads: int):
    """Forward hooks on ``model`` that append each expected layer's (tokens, D) rows to ``got``."""
    got = {name: [] for name in expected}
    handles = []
    for name, (path, side, cut) in expected.items():
        module = model.get_submodule(path)

        def keep(t, name=name, cut=cut):
            got[name].append(_cut(t, cut, heads)[0].detach().double().numpy())
            if len(got[name]) == 1:  # the order the forward pass computes them in
                got.setdefault("_order", []).append(name)

        if side == "in":
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, kw, keep=keep: keep(a[0] if a else kw["hidden_states"]), with_kwargs=True
                )
            )
        else:
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, keep=keep: keep(o[0] if isinstance(o, tuple) else o)
                )
            )
    return got, handles


def _reference(model_dir, texts, expected, stack="model"):
    """Every expected layer's rows, one document at a time (no padding), from hooks on the plain
    transformers model, in (document, position) order."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    got, handles = _hooked(model, expected, model.config.num_attention_heads)
    for text in texts:
        ids = torch.tensor([tok(text)["input_ids"]])
        ones = torch.ones_like(ids)
        with torch.no_grad():
            if stack == "encoder":
                model.get_encoder()(input_ids=ids, attention_mask=ones)
            elif stack == "decoder":
                dec = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), ids[:, :-1]], 1)
                model(input_ids=ids, attention_mask=ones, decoder_input_ids=dec, decoder_attention_mask=ones)
            else:
                model(input_ids=ids, attention_mask=ones)
    for h in handles:
        h.remove()
    order = got.pop("_order")
    return {name: np.concatenate(got[name]) for name in order}


def _rows(run_dir) -> dict[str, np.ndarray]:
    """Every layer of a run, float64, in (document, position) order."""
    run = Run(run_dir)
    parts = [ch for s in run.shards for ch in iter_shard(run.shard_path(s))]
    doc = np.concatenate([c.doc_id for c in parts])
    pos = np.concatenate([c.position for c in parts])
    order = np.lexsort((pos, doc))
    return {
        n: np.concatenate([c.layers[n] for c in parts]).astype(np.float64)[order] for n in run.layer_names
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {k: make_tiny_model(k, root) for k in ("bert", "gpt2", "gpt_neox", "t5", "llama")}
    out["bert-left"] = make_tiny_model("bert", root, padding_side="left")
    out["gpt2-left"] = make_tiny_model("gpt2", root, padding_side="left")
    out["mistral"] = _tiny_mistral(root, out["llama"])
    return out


def _tiny_mistral(root, llama_dir):
    """A tiny MistralModel (2 query and 2 key/value heads, so its k and v are D wide) with the tiny
    Llama's tokenizer."""
    from transformers import MistralConfig, MistralModel

    dest = root / "tiny-mistral"
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=len(json.loads((llama_dir / "tokenizer.json").read_text())["model"]["vocab"]),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    MistralModel(cfg).eval().save_pretrained(dest)
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("in") / "in.txt"
    p.write_text("\n".join(TEXTS) + "\n")
    return p


@pytest.mark.parametrize(
    "kind,stack",
    [("bert", "model"), ("gpt2", "model"), ("gpt_neox", "model"), ("mistral", "model"), ("t5", "encoder")],
)
def test_each_family_matches_hooks_on_a_plain_forward(models, text_file, tmp_path, kind, stack):
    """One document a batch (no padding): the very computation the reference makes, to 1e-6."""
    out = tmp_path / "run"
    extract(
        str(models[kind]), [text_file], out, modules=SPEC, layers="-1", store_dtype="float32", batch_tokens=1
    )
    expected = _expected(kind, "encoder" if kind == "t5" else stack, 2)
    ref = _reference(models[kind], TEXTS, expected, stack="encoder" if kind == "t5" else stack)
    got = _rows(out)
    entries = {la["name"]: la for la in Run(out).layers}
    assert [n for n in entries if entries[n]["kind"] == "module"] == list(ref)  # in forward order
    for name, (path, side, _) in expected.items():
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)
        entry = entries[name]
        block = int(path.split(".")[2 if kind in ("bert", "t5") else 1])
        assert (entry["module"], entry["side"], entry["block"], entry["index"]) == (
            path,
            side,
            block,
            block + 1,
        )
    # the layers sit in forward order, each block's modules before its output
    names = list(entries)
    assert names.index("layer_02") > max(names.index(n) for n in expected if entries[n]["block"] == 1)


def test_t5_decoder_aliases(models, text_file, tmp_path):
    out = tmp_path / "run"
    extract(
        str(models["t5"]),
        [text_file],
        out,
        modules="attn_out,mlp_out",
        stack="decoder",
        layers="-1",
        store_dtype="float32",
        batch_tokens=1,
    )
    expected = {}
    for b in range(3):
        expected[f"decoder.block.{b}.layer.0.SelfAttention"] = (
            f"decoder.block.{b}.layer.0.SelfAttention",
            "out",
            None,
        )
        expected[f"decoder.block.{b}.layer.2.DenseReluDense"] = (
            f"decoder.block.{b}.layer.2.DenseReluDense",
            "out",
            None,
        )
    ref = _reference(models["t5"], TEXTS, expected, stack="decoder")
    got = _rows(out)
    for name in expected:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_rows_do_not_depend_on_batch_size_or_padding_side(models, text_file, tmp_path, kind):
    runs = {}
    for label, model, bt in [
        ("big", kind, 4096),
        ("one-doc", kind, 1),
        ("small", kind, 37),
        ("left", f"{kind}-left", 53),
    ]:
        extract(
            str(models[model]),
            [text_file],
            tmp_path / label,
            modules=SPEC,
            layers="-1",
            store_dtype="float32",
            batch_tokens=bt,
            shard_docs=7,
        )
        runs[label] = _rows(tmp_path / label)
    for label, rows in runs.items():
        assert list(rows) == list(runs["big"])
        for name, a in rows.items():
            np.testing.assert_allclose(a, runs["big"][name], rtol=1e-4, atol=1e-5, err_msg=f"{label}:{name}")


def test_bundled_minilm_matches_hooks(tmp_path):
    """The real checkpoint: q, k, v, both sub-layer outputs and every LayerNorm's input and output."""
    from geomscope.model.names import bundled_minilm_dir

    sents = ["A man is playing a guitar.", "The new movie is awesome, and everyone should see it.", "Hi"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(sents) + "\n")
    out = tmp_path / "run"
    extract(
        "bundled:minilm",
        [src],
        out,
        modules="q,k,v,attn_out,mlp_out,norms",
        layers="0",
        store_dtype="float32",
        batch_tokens=1,
    )
    expected = {}
    for b in range(6):
        p = f"encoder.layer.{b}"
        for rel in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ):
            expected[f"{p}.{rel}"] = (f"{p}.{rel}", "out", None)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            expected[f"{p}.{norm}:in"] = (f"{p}.{norm}", "in", None)
            expected[f"{p}.{norm}"] = (f"{p}.{norm}", "out", None)
        expected[f"{p}.output.dense"] = (f"{p}.output.dense", "out", None)
    expected["embeddings.LayerNorm:in"] = ("embeddings.LayerNorm", "in", None)
    expected["embeddings.LayerNorm"] = ("embeddings.LayerNorm", "out", None)
    ref = _reference(bundled_minilm_dir(), sents, expected)
    got = _rows(out)
    assert set(got) == {*expected, "layer_00"}
    for name in expected:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)
    entries = {la["name"]: la for la in Run(out).layers}
    assert entries["embeddings.LayerNorm"]["index"] == 0 and entries["embeddings.LayerNorm"]["block"] is None
    norms = json.loads((out / "manifest.json").read_text())["module_norms"]
    assert len(norms) == 13 and all(
        len(p["gain"]) == 384 and p["gain_is"] == "weight" for p in norms.values()
    )


def _autograd_reference(model_dir, texts, expected):
    """Per document with a next-token prediction: each expected layer's tensor and the gradient of
    the model's own ``labels=`` loss with respect to it (torch.autograd; a fused projection's q, k, v
    cut from the gradient of its output), from hooks on the model with its head."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    heads = model.config.num_attention_heads
    acts = {n: [] for n in expected}
    grads = {n: [] for n in expected}
    docs = []
    for doc_id, text in enumerate(texts):
        ids = torch.tensor([tok(text)["input_ids"]])
        if ids.shape[1] < 2:  # predicts nothing
            continue
        kept, handles = {}, []
        for path in {p for p, _, _ in expected.values()}:
            module = model.base_model.get_submodule(path)
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, kw, path=path, kept=kept: kept.__setitem__(
                        (path, "in"), a[0] if a else kw["hidden_states"]
                    ),
                    with_kwargs=True,
                )
            )
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, path=path, kept=kept: kept.__setitem__(
                        (path, "out"), o[0] if isinstance(o, tuple) else o
                    )
                )
            )
        out = model(input_ids=ids, labels=ids)
        for h in handles:
            h.remove()
        keys = list(dict.fromkeys((p, s) for p, s, _ in expected.values()))
        g = dict(zip(keys, torch.autograd.grad(out.loss, [kept[k] for k in keys]), strict=True))
        for name, (path, side, cut) in expected.items():
            acts[name].append(_cut(kept[path, side], cut, heads)[0].detach().double().numpy())
            grads[name].append(_cut(g[path, side], cut, heads)[0].double().numpy())
        docs.append(doc_id)
    return (
        docs,
        {n: np.concatenate(v) for n, v in acts.items()},
        {n: np.concatenate(v) for n, v in grads.items()},
    )


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox"])
def test_module_gradients_equal_autograd(models, text_file, tmp_path, kind):
    model_dir = make_tiny_head_model(kind, "causal-lm", tmp_path)
    out = tmp_path / "run"
    extract(
        str(model_dir),
        [text_file],
        out,
        modules=SPEC,
        layers="-1",
        capture="activations,gradients",
        loss="causal-lm",
        batch_tokens=1,
    )
    expected = _expected(kind, "model", 2)
    docs, acts, grads = _autograd_reference(model_dir, TEXTS, expected)
    run = Run(out)
    rows = _rows(out)
    parts = [ch for s in run.shards for ch in iter_shard(run.shard_path(s))]
    doc_of_row = np.sort(np.concatenate([c.doc_id for c in parts]))
    sel = np.isin(doc_of_row, docs)
    assert (~sel).sum() == 1  # "Hello", one token: no prediction, so no loss
    for name in expected:
        scale = np.abs(grads[name]).max()
        assert scale > 0
        np.testing.assert_allclose(
            rows[name + ".grad"][sel], grads[name], atol=1e-6 * scale, rtol=0, err_msg=name
        )
        np.testing.assert_allclose(rows[name][sel], acts[name], rtol=1e-6, atol=1e-6, err_msg=name)
        assert np.all(rows[name + ".grad"][~sel] == 0)
    entries = {la["name"]: la for la in run.layers}
    grad = entries[next(iter(expected)) + ".grad"]
    assert (
        grad["capture"] == "gradients"
        and grad["kind"] == "module"
        and grad["module"] == next(iter(expected.values()))[0]
    )


def test_keep_sample_scores_module_layers_like_the_full_run(models, tmp_path):
    from geomscope.score import ScoreOptions, score

    src = tmp_path / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 4) + "\n")
    common = {"shard_docs": 12, "batch_tokens": 256, "modules": "attn_out,ln1_in", "layers": "-1"}
    extract(str(models["bert"]), [src], tmp_path / "full", **common)
    summary = extract(str(models["bert"]), [src], tmp_path / "kept", keep="sample:60", **common)
    assert summary["rows_stored"] < summary["rows"]
    a, b = (score(tmp_path / r, ScoreOptions(id_sample=60), log=lambda m: None) for r in ("kept", "full"))
    modules = [la for la in a["layers"] if la["layer"].startswith("encoder.")]
    assert len(modules) == 4
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la["layer"] == lb["layer"] and la["n_rows"] == lb["n_rows"]
        for key in ("isoscore", "isoscore_star", "avgcos", "pr"):
            assert la[key] == pytest.approx(lb[key], rel=1e-9, abs=1e-12), (la["layer"], key)


def test_module_layers_score_and_plot_by_name(models, text_file, tmp_path, cli):
    run = tmp_path / "run"
    code, _, err = cli(
        ["extract", models["gpt2"], text_file, "--out", run, "--modules", "attn_out,*.mlp.*", "--quiet"]
    )
    assert code == 0, err
    dims = Run(run).layer_dims
    assert dims["h.1.mlp.c_proj"] == 32 and dims["h.1.mlp.c_fc"] == 128  # each at its own width
    code, _, err = cli(
        [
            "score",
            run,
            "--layers",
            "h.1.attn,layer_02,-1",
            "--metrics",
            "isoscore,avgcos",
            "--out",
            tmp_path / "r.json",
            "--quiet",
        ]
    )
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    scored = [la["layer"] for la in report["layers"]]
    assert scored[0] == "h.1.attn" and "layer_02" in scored and "h.1.mlp.c_proj" in scored  # -1: block 2's
    assert "h.1.mlp.c_fc" in scored
    code, _, err = cli(["plot", tmp_path / "r.json", "--out", tmp_path / "fig.png"])
    assert code == 0, err


def test_glob_leaves_out_what_is_not_one_vector_per_token(models, text_file, tmp_path, cli):
    code, _, err = cli(
        ["extract", models["bert"], text_file, "--out", tmp_path / "run", "--modules", "pooler*,attn_out"]
    )
    assert code == 0, err
    said = "--modules leaves out 3 modules that give no vector per token: "
    assert said + "pooler (gives its output as shape [" in err
    assert not any(n.startswith("pooler") for n in Run(tmp_path / "run").layer_names)


@pytest.mark.parametrize(
    "kind,spec,needles",
    [
        ("gpt2", "*.nothing", ["matches *.nothing", "h.0.attn", "aliases (gpt2): attn_out"]),
        ("gpt2", "q:in", ["an alias takes no suffix"]),
        ("gpt2", "*.mlp:sideways", ["'sideways' is not a side"]),
        ("gpt2", "*.mlp:q", ["h.0.mlp is not a fused query-key-value projection"]),
        ("bert", "*.embeddings.word_embeddings:in", ["takes token ids"]),
        ("bert", "pooler", ["pooler gives its output as shape"]),
    ],
)
def test_bad_modules_are_one_line_and_write_nothing(models, text_file, tmp_path, cli, kind, spec, needles):
    code, out, err = cli(["extract", models[kind], text_file, "--out", tmp_path / "run", "--modules", spec])
    assert_one_line_error(code, out, err, *needles, exit_code=2)
    assert not (tmp_path / "run").exists()
