"""``extract --capture gradients``: the stored g_t = dL/dh_t against outside references -- the
model's own ``labels=`` loss differentiated by torch.autograd one document at a time, and central
finite differences of the float64 loss -- plus batch independence, the report, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, make_tiny_head_model, make_tiny_model

from geomscope.errors import InputError
from geomscope.extract.batching import Doc
from geomscope.extract.gradients import mask_positions
from geomscope.extract.run import extract
from geomscope.store import Run, iter_shard

TEXTS = [t for t in SAMPLE_TEXTS if t.strip()]
LABELS = ["neg", "pos"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("heads")
    return {
        (k, h): make_tiny_head_model(k, h, d)
        for k, h in [
            ("gpt2", "causal-lm"),
            ("llama", "causal-lm"),
            ("bert", "masked-lm"),
            ("bert", "classification"),
        ]
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    txt = d / "t.txt"
    txt.write_text("\n".join(TEXTS) + "\n")
    jl = d / "l.jsonl"
    jl.write_text(
        "".join(json.dumps({"text": t, "label": LABELS[i % 2]}) + "\n" for i, t in enumerate(TEXTS))
    )
    return {"text": txt, "labelled": jl}


def _rows(run_dir) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every layer's rows and the row index of a run, sorted by (doc_id, position)."""
    run = Run(run_dir)
    layers: dict[str, list] = {n: [] for n in run.layer_names}
    meta: dict[str, list] = {"doc_id": [], "position": [], "loss_target": []}
    for s in run.shards:
        path = run.shard_path(s)
        for ch in iter_shard(path):
            for n in layers:
                layers[n].append(ch.layers[n])
            meta["doc_id"].append(ch.doc_id)
            meta["position"].append(ch.position)
        import h5py

        with h5py.File(path, "r") as f:
            meta["loss_target"].append(f["loss_target"][:])
    m = {k: np.concatenate(v) for k, v in meta.items()}
    order = np.lexsort((m["position"], m["doc_id"]))
    return {n: np.concatenate(v)[order] for n, v in layers.items()}, {k: v[order] for k, v in m.items()}


def _extract(model, inp, out, **kw):
    kw.setdefault("capture", "activations,gradients")
    return extract(str(model), [str(inp)], out, device="cpu", overwrite=True, **kw)


def _reference(model_dir, loss: str, text: str, doc_id: int, label: int | None, dtype):
    """(hidden states, their gradients) of one document, from the model's own ``labels=`` loss and
    torch.autograd; the final norm's input is read with a hook."""
    import torch
    import transformers
    from helpers_models import HEADS

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = getattr(transformers, HEADS[loss]).from_pretrained(model_dir, dtype=dtype).eval()
    enc = tok(text, add_special_tokens=True, return_special_tokens_mask=True)
    ids = torch.tensor([enc["input_ids"]])
    kw: dict = {}
    if loss == "causal-lm":
        kw["labels"] = ids
    elif loss == "masked-lm":
        doc = Doc(doc_id, np.array(enc["input_ids"]), np.array(enc["special_tokens_mask"], bool))
        pos = mask_positions(doc, 0.15, 0)
        labels = torch.full_like(ids, -100)
        labels[0, pos] = ids[0, pos]
        ids = ids.clone()
        ids[0, pos] = tok.mask_token_id
        kw["labels"] = labels
    else:
        kw["labels"] = torch.tensor([label])
    grabbed = {}
    norm = getattr(model.base_model, "ln_f", None) or getattr(model.base_model, "norm", None)
    handle = None
    if norm is not None:
        handle = norm.register_forward_hook(lambda m, a, o: grabbed.__setitem__("pre", a[0]))
    emb = model.get_input_embeddings()
    h2 = emb.register_forward_hook(lambda m, a, o: o.requires_grad_(True))
    out = model(input_ids=ids, output_hidden_states=True, **kw)
    h2.remove()
    if handle is not None:
        handle.remove()
    hs = list(out.hidden_states)
    names = [f"layer_{i:02d}" for i in range(len(hs))]
    tensors = dict(zip(names, hs, strict=True))
    if norm is not None:  # geomscope's layer_N is the norm's input; the tuple's last entry is final_norm
        tensors["final_norm"] = hs[-1]
        tensors[names[-1]] = grabbed["pre"]
    grads = torch.autograd.grad(out.loss, list(tensors.values()))
    return (
        {n: t[0].detach().double().numpy() for n, t in tensors.items()},
        {n: g[0].double().numpy() for n, g in zip(tensors, grads, strict=True)},
        float(out.loss.detach()),
    )


@pytest.mark.parametrize(
    "kind,loss",
    [("gpt2", "causal-lm"), ("llama", "causal-lm"), ("bert", "masked-lm"), ("bert", "classification")],
)
def test_gradients_equal_autograd_of_the_models_own_loss(models, inputs, tmp_path, kind, loss):
    import torch

    inp = inputs["labelled" if loss == "classification" else "text"]
    summary = _extract(models[kind, loss], inp, tmp_path / "run", batch_tokens=64)
    assert summary["loss"] == loss and summary["store_dtype"] == "float32"
    layers, meta = _rows(tmp_path / "run")
    losses = []
    for doc_id, text in enumerate(TEXTS):
        sel = meta["doc_id"] == doc_id
        if loss == "causal-lm" and sel.sum() == 1:  # predicts nothing: no loss (HF: NaN), gradient 0
            assert not meta["loss_target"][sel].any()
            assert all(np.all(layers[n][sel] == 0) for n in layers if n.endswith(".grad"))
            continue
        acts, grads, doc_loss = _reference(
            models[kind, loss],
            loss,
            text,
            doc_id,
            doc_id % 2 if loss == "classification" else None,
            torch.float32,
        )
        losses.append(doc_loss)
        for name, g in grads.items():
            got = layers[name + ".grad"][sel]
            scale = np.abs(g).max() or 1.0
            np.testing.assert_allclose(got, g, atol=2e-5 * scale, rtol=0, err_msg=f"{name} doc {doc_id}")
            np.testing.assert_allclose(layers[name][sel], acts[name], atol=2e-5 * np.abs(acts[name]).max())
        if loss == "causal-lm":  # every position but the last predicts the next token
            assert meta["loss_target"][sel].tolist() == [True] * (sel.sum() - 1) + [False]
    assert summary["loss_mean"] == pytest.approx(np.mean(losses), rel=1e-5)
    if loss == "masked-lm":
        assert meta["loss_target"].sum() >= len(TEXTS)  # at least one masked position per document


def test_gradients_match_finite_differences_float64(models, inputs, tmp_path):
    """<g_t, v> of the stored (float32) gradient against the central difference of the float64 loss
    when the hidden state at one position is moved along v: inside a block stack, at the final
    norm's input and at its output."""
    import torch
    import transformers

    model_dir = models["gpt2", "causal-lm"]
    _extract(model_dir, inputs["text"], tmp_path / "run", capture="gradients")
    layers, meta = _rows(tmp_path / "run")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    doc_id = 3
    ids = torch.tensor([tok(TEXTS[doc_id])["input_ids"]])
    blocks = model.transformer.h
    where = {
        "layer_01": blocks[0],  # output of block 1
        "layer_02": blocks[1],  # the last block's output = the final norm's input
        "final_norm": model.transformer.ln_f,
    }
    rng = np.random.default_rng(0)
    for name, module in where.items():
        for t in (0, ids.shape[1] // 2, ids.shape[1] - 2):
            v = rng.standard_normal(32)

            def loss_at(eps, t=t, v=v, module=module):
                def shift(_m, _a, out):
                    h = out[0] if isinstance(out, tuple) else out
                    h = h.clone()
                    h[0, t] += eps * torch.from_numpy(v)
                    return (h, *out[1:]) if isinstance(out, tuple) else h

                handle = module.register_forward_hook(shift)
                try:  # the loss in float64 (transformers' own loss casts the logits to float32)
                    with torch.no_grad():
                        logits = model(input_ids=ids).logits[0, :-1]
                    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))
                finally:
                    handle.remove()

            fd = (loss_at(1e-5) - loss_at(-1e-5)) / 2e-5
            g = layers[name + ".grad"][(meta["doc_id"] == doc_id) & (meta["position"] == t)][0]
            # the stored gradient is float32: agreement to ~1e-5 relative
            assert float(g @ v) == pytest.approx(fd, rel=1e-4, abs=1e-6 * float(np.abs(g).sum())), (name, t)


def test_gradients_do_not_depend_on_the_batch(models, inputs, tmp_path):
    a = _extract(models["bert", "masked-lm"], inputs["text"], tmp_path / "a", batch_tokens=16)
    b = _extract(models["bert", "masked-lm"], inputs["text"], tmp_path / "b", batch_tokens=100000)
    assert a["loss_mean"] == pytest.approx(b["loss_mean"], rel=1e-6)
    la, ma = _rows(tmp_path / "a")
    lb, mb = _rows(tmp_path / "b")
    assert np.array_equal(ma["loss_target"], mb["loss_target"])
    for n in la:
        np.testing.assert_allclose(la[n], lb[n], atol=1e-6 * np.abs(lb[n]).max())


def test_gradient_run_manifest_and_resume(models, inputs, tmp_path):
    out = tmp_path / "run"
    _extract(models["bert", "classification"], inputs["labelled"], out, capture="gradients", shard_docs=4)
    ident = json.loads((out / "manifest.json").read_text())["identity"]
    assert ident["capture"] == "gradients" and ident["loss"]["kind"] == "classification"
    assert ident["loss"]["label_field"] == "label" and ident["store_dtype"] == "float32"
    assert [la["name"] for la in ident["layers"]] == ["layer_00.grad", "layer_01.grad", "layer_02.grad"]
    assert all(la["capture"] == "gradients" for la in ident["layers"])
    again = extract(
        str(models["bert", "classification"]),
        [str(inputs["labelled"])],
        out,
        device="cpu",
        capture="gradients",
        shard_docs=4,
    )
    assert again["shards_resumed"] == again["shards"] == 3


def test_activation_runs_keep_their_identity(models, inputs, tmp_path):
    """A run without gradients records no capture/loss keys and float16, as before."""
    extract(str(make_tiny_model("bert", tmp_path)), [str(inputs["text"])], tmp_path / "r", device="cpu")
    ident = json.loads((tmp_path / "r" / "manifest.json").read_text())["identity"]
    assert "capture" not in ident and "loss" not in ident and ident["store_dtype"] == "float16"


@pytest.mark.parametrize(
    "case,kw,needle",
    [
        ("no head", {}, "has no head for a loss"),
        ("wrong head", {"loss": "masked-lm", "model": ("gpt2", "causal-lm")}, "masked-lm head"),
        (
            "random head",
            {"loss": "classification", "model": ("bert", "masked-lm")},
            "no trained classification",
        ),
        ("plain text labels", {"model": ("bert", "classification")}, "plain text, which has no labels"),
        ("float16", {"store_dtype": "float16", "model": ("gpt2", "causal-lm")}, "float16 cannot hold"),
        ("sample", {"keep": "sample:5", "model": ("gpt2", "causal-lm")}, "--keep sample stores activations"),
        ("capture", {"capture": "weights", "model": ("gpt2", "causal-lm")}, "--capture"),
        ("mlm p", {"mlm_probability": 1.5, "model": ("bert", "masked-lm")}, "--mlm-probability"),
    ],
)
def test_bad_gradient_input(models, inputs, tmp_path, case, kw, needle):
    kw = dict(kw)
    key = kw.pop("model", None)
    model = models[key] if key else make_tiny_model("bert", tmp_path)
    kw.setdefault("capture", "gradients")
    with pytest.raises(InputError, match=needle.replace("-", r"\-")):
        extract(str(model), [str(inputs["text"])], tmp_path / "run", device="cpu", **kw)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_unknown_label_is_one_line(models, inputs, tmp_path, cli):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a dog", "label": "maybe"}) + "\n")
    code, out, err = cli(
        [
            "extract",
            models["bert", "classification"],
            bad,
            "--out",
            tmp_path / "run",
            "--capture",
            "gradients",
            "--device",
            "cpu",
            "-q",
        ]
    )
    assert "not one of the model's labels (neg, pos)" in assert_one_line_error(code, out, err, exit_code=2)


def test_encoder_decoder_is_refused(inputs, tmp_path):
    with pytest.raises(InputError, match="encoder-decoder"):
        extract(
            str(make_tiny_model("t5", tmp_path)),
            [str(inputs["text"])],
            tmp_path / "run",
            device="cpu",
            capture="gradients",
            loss="causal-lm",
        )


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_decoder_classifier_is_read_at_each_documents_last_token(inputs, tmp_path, kind):
    """A decoder's sequence classifier reads its prediction from the last token that is not
    config.pad_token_id; padded with the tokenizer's pad (or eos) where that differs, every
    document shorter than its batch's longest would be classified from padding: loss 0.707 where each
    document alone gives 0.680, gradients off by ~100 %. One batch must give one document's own."""
    import shutil

    import transformers

    src = make_tiny_head_model(kind, "classification", tmp_path / "m")
    model = tmp_path / f"{kind}-cls-own-pad"
    shutil.copytree(src, model)
    cfg = json.loads((model / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(model)
    cfg["pad_token_id"] = max(tok.get_vocab().values())  # a pad id of the config's own
    assert cfg["pad_token_id"] not in (tok.pad_token_id, tok.eos_token_id)
    (model / "config.json").write_text(json.dumps(cfg))
    one = _extract(model, inputs["labelled"], tmp_path / "one", capture="gradients", batch_tokens=100000)
    alone = _extract(model, inputs["labelled"], tmp_path / "alone", capture="gradients", batch_tokens=1)
    assert one["loss_mean"] == pytest.approx(alone["loss_mean"], rel=1e-6)
    la, _ = _rows(tmp_path / "one")
    lb, _ = _rows(tmp_path / "alone")
    for n in la:
        np.testing.assert_allclose(la[n], lb[n], atol=1e-5 * np.abs(lb[n]).max(), err_msg=n)
