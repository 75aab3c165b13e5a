"""The final norm's effect in the score report (score/finalnorm.py), checked against the stored rows
and the checkpoint's own gain and bias."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_models import SAMPLE_TEXTS, make_tiny_run
from scipy.stats import spearmanr

from geomscope.score import ScoreOptions, score
from geomscope.store import Run, iter_shard


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("fn"), "llama", SAMPLE_TEXTS * 4, store_dtype="float32")


def _rows(run, name):
    r = Run(run)
    return np.concatenate([ch.layers[name] for s in r.shards for ch in iter_shard(r.shard_path(s), [name])])


def test_final_norm_effect_against_rows_and_checkpoint(llama_run):
    from safetensors.numpy import load_file

    rep = score(llama_run, ScoreOptions(metrics=("isoscore", "isoscore_star", "avgcos", "outliers")))
    fn = rep["final_norm"]
    assert fn["before"] == "layer_02" and fn["after"] == "final_norm"
    by = {e["layer"]: e for e in rep["layers"]}
    for m in ("isoscore", "isoscore_star", "avgcos"):
        assert (
            fn["metrics"][m]["before"] == by["layer_02"][m]
            and fn["metrics"][m]["after"] == by["final_norm"][m]
        )
        assert fn["metrics"][m]["change"] == pytest.approx(by["final_norm"][m] - by["layer_02"][m])
    # the gain recorded by extract is the checkpoint's, and the correlation is the one of the rows
    weights = load_file(str(_checkpoint_dir(llama_run) / "model.safetensors"))
    manifest = json.loads((llama_run / "manifest.json").read_text())
    np.testing.assert_allclose(manifest["final_norm"]["gain"], weights["norm.weight"], rtol=1e-6)
    var = _rows(llama_run, "layer_02").astype(np.float64).var(axis=0, ddof=1)
    gain = np.abs(weights["norm.weight"].astype(np.float64))
    want = spearmanr(gain, var).statistic
    assert fn["gain"]["spearman_abs_gain_variance"] == pytest.approx(want, abs=1e-12)
    assert fn["gain"]["module"] == "norm" and fn["bias"] is None  # RMSNorm: no bias
    for o in fn["outliers"]:
        d = o["dim"]
        assert o["gain_ratio"] == pytest.approx(gain[d] / np.median(gain))
        assert o["variance_ratio"] == pytest.approx(var[d] / var.mean(), rel=1e-9)
        assert o["effect"] == ("damped" if o["gain_ratio"] < 1 else "amplified")
    assert [o["dim"] for o in fn["outliers"]] == by["layer_02"]["outliers"]


def _checkpoint_dir(run):
    """The checkpoint directory the run was extracted from."""
    from pathlib import Path

    ident = Run(run).identity
    return Path(ident["model"].get("path") or ident["model"]["name"])


def test_final_norm_null_with_reasons(llama_run, tmp_path):
    rep = score(llama_run, ScoreOptions(metrics=("isoscore",), layers=("layer_00", "layer_01")))
    assert rep["final_norm"] is None and "no final_norm layer" in rep["notes"]["final_norm"]
    rep = score(llama_run, ScoreOptions(metrics=("isoscore",), layers=("final_norm",)))
    assert rep["final_norm"] is None and "index 2" in rep["notes"]["final_norm"]
    bert = make_tiny_run(tmp_path, "bert")
    rep = score(bert, ScoreOptions(metrics=("isoscore",)))
    assert rep["final_norm"] is None and "BERT-style" in rep["notes"]["final_norm"]


def _tiny_gemma(dest, make_tiny_model):
    """A tiny Gemma (its RMSNorm multiplies by 1 + weight) whose dimension 5 is an outlier before the
    final norm and damped by it (weight -0.9: factor 0.1)."""
    import shutil

    import torch
    import transformers

    base = make_tiny_model("llama", dest)  # for its tokenizer files
    d = dest / "tiny-gemma"
    d.mkdir()
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, d / f.name)
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    m = transformers.GemmaModel(cfg).eval()
    with torch.no_grad():
        m.norm.weight.uniform_(-0.9, 1.0)
        m.norm.weight[5] = -0.9
        m.layers[-1].mlp.down_proj.weight[5, :] *= 400
    m.save_pretrained(d)
    return d, m.norm


def test_the_gain_recorded_is_the_factor_the_norm_applies(tmp_path):
    """Gemma's RMSNorm multiplies by 1 + weight, which is the gain recorded; the weight as the gain
    would read a dimension the norm damps 10x as amplified (gain ratio 1.58) and put the
    gain-variance correlation off."""
    import torch
    from helpers_models import make_tiny_model

    from geomscope.extract import extract

    model, norm = _tiny_gemma(tmp_path, make_tiny_model)
    src = tmp_path / "s.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 5) + "\n")
    extract(str(model), [src], tmp_path / "run", store_dtype="float32")
    recorded = Run(tmp_path / "run").manifest["final_norm"]
    w = norm.weight.detach().double().numpy()
    assert recorded["gain_is"] == "1 + weight"
    np.testing.assert_allclose(recorded["gain"], 1 + w, rtol=1e-6)
    x = torch.randn(8, 32)  # the factor, measured independently on other inputs
    factor = (norm(x) / (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))).mean(0)
    np.testing.assert_allclose(recorded["gain"], factor.detach().double().numpy(), atol=1e-5)
    fn = score(tmp_path / "run", ScoreOptions(metrics=("isoscore", "outliers")))["final_norm"]
    (out5,) = [o for o in fn["outliers"] if o["dim"] == 5]
    assert out5["effect"] == "damped" and out5["gain_ratio"] < 0.2


def test_a_plain_layer_norm_records_its_weight(llama_run):
    """Llama's RMSNorm and GPT-2's LayerNorm multiply by their weight: recorded as it is."""
    recorded = Run(llama_run).manifest["final_norm"]
    assert recorded["gain_is"] == "weight" and recorded["gain"] is not None


def test_a_gradient_layer_is_never_the_layer_before_the_norm():
    """A gradient layer shares its layer's index: scored with --layers final_norm,layer_02.grad, the
    norm's "before" is the activations (IsoScore 0.571 here), never the gradients (0.256)."""
    from geomscope.score.finalnorm import final_norm_effect

    grad = {"layer": "layer_02.grad", "index": 2, "isoscore": 0.256}
    act = {"layer": "layer_02", "index": 2, "isoscore": 0.571}
    after = {"layer": "final_norm", "index": 3, "isoscore": 0.558}
    out, why = final_norm_effect([grad, after], {}, None)
    assert out is None and "index 2" in why
    out, why = final_norm_effect([grad, act, after], {}, None)
    assert why is None and out["before"] == "layer_02" and out["metrics"]["isoscore"]["before"] == 0.571


def test_the_last_block_s_modules_are_not_the_layer_before_the_norm():
    """Block N's module layers (extract --modules) share layer_N's index; the norm's input is the
    hidden state layer_N, wherever the modules sit in the report."""
    from geomscope.score.finalnorm import final_norm_effect

    module_in = {"layer": "layers.1.input_layernorm:in", "index": 2, "isoscore": 0.3}
    act = {"layer": "layer_02", "index": 2, "isoscore": 0.571}
    after = {"layer": "final_norm", "index": 3, "isoscore": 0.558}
    out, why = final_norm_effect([module_in, act, after], {}, None)
    assert why is None and out["before"] == "layer_02" and out["metrics"]["isoscore"]["before"] == 0.571


def test_gain_ratio_is_null_when_the_median_gain_is_zero():
    """More than half the gains 0: the median |gain| is 0 and |gain_d| / median is undefined. Read as 1, it
    would call an outlier dimension with gain 0.5 (infinitely above the median) "damped"."""
    from geomscope.score.finalnorm import final_norm_effect

    var = np.array([50.0, 1, 1.2, 0.9, 1.1, 1.0, 0.8, 1.3])
    layers = [
        {"layer": "layer_02", "index": 2, "outliers": [0, 7]},
        {"layer": "final_norm", "index": 3, "outliers": []},
    ]
    extras = {"layer_02": {"variance": var.tolist()}}
    gain = np.array([0.5, 0, 0, 0, 0, 0, 3, 4])
    out, why = final_norm_effect(layers, extras, {"gain": gain.tolist()})
    assert why is None and np.median(np.abs(gain)) == 0
    assert out["gain"]["median_abs_gain"] == 0.0
    for o in out["outliers"]:
        assert o["gain_ratio"] is None and o["effect"] is None
        assert o["variance_ratio"] == pytest.approx(var[o["dim"]] / var.mean())
    assert "median |gain| is 0" in out["note"]
    assert json.loads(json.dumps(out)) == out
    # a usable median: the ratio of the definition, against numpy
    gain = np.array([0.5, 2, 1, 1, 3, 1, 3, 4])
    out, _ = final_norm_effect(layers, extras, {"gain": (-gain).tolist()})
    med = np.median(np.abs(gain))
    assert [o["gain_ratio"] for o in out["outliers"]] == pytest.approx([0.5 / med, 4 / med])
    assert [o["effect"] for o in out["outliers"]] == ["damped", "amplified"] and "note" not in out


# ----------------------------------------------------------------- every norm (extract --modules norms)
@pytest.fixture(scope="module")
def minilm_norms(tmp_path_factory):
    """The bundled MiniLM with every LayerNorm stored at its input and output, and its report."""
    from geomscope.extract import extract

    root = tmp_path_factory.mktemp("norms")
    src = root / "s.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 3) + "\n")
    extract("bundled:minilm", [src], root / "run", modules="norms", layers="0")
    rep = score(root / "run", ScoreOptions(metrics=("isoscore", "avgcos", "outliers")))
    return root / "run", rep


def test_every_norm_s_gain_against_rows_and_checkpoint(minilm_norms):
    """Each norm's entry against numpy and scipy on the stored rows and the checkpoint's weights:
    the measured gain sd(out_d) / sd(in_d), the weight, their Spearman correlations with the input
    variance, and the outlier rows."""
    from transformers import AutoModel

    from geomscope.model.names import bundled_minilm_dir

    run, rep = minilm_norms
    weights = AutoModel.from_pretrained(bundled_minilm_dir()).state_dict()
    by = {e["layer"]: e for e in rep["layers"]}
    norms = rep["norms"]
    assert len(norms) == 13 and norms[0]["module"] == "embeddings.LayerNorm"
    assert [n["block"] for n in norms] == [None] + [b for b in range(6) for _ in range(2)]
    for n in norms:
        x = _rows(run, n["before"]).astype(np.float64)
        y = _rows(run, n["after"]).astype(np.float64)
        var_in, var_out = x.var(axis=0, ddof=1), y.var(axis=0, ddof=1)
        g = np.sqrt(var_out / var_in)
        measured = n["measured_gain"]
        assert measured["spearman_gain_variance"] == pytest.approx(spearmanr(g, var_in).statistic, abs=1e-9)
        assert measured["median_gain"] == pytest.approx(np.median(g), rel=1e-9)
        w = np.abs(weights[n["module"] + ".weight"].double().numpy())
        assert n["gain"]["spearman_abs_gain_variance"] == pytest.approx(
            spearmanr(w, var_in).statistic, abs=1e-9
        )
        b = np.abs(weights[n["module"] + ".bias"].double().numpy())
        assert n["bias"]["spearman_abs_bias_variance"] == pytest.approx(
            spearmanr(b, var_in).statistic, abs=1e-9
        )
        assert [o["dim"] for o in n["outliers"]] == by[n["before"]]["outliers"]
        for o in n["outliers"]:
            d = o["dim"]
            assert o["variance_ratio"] == pytest.approx(var_in[d] / var_in.mean(), rel=1e-9)
            assert o["gain_ratio"] == pytest.approx(w[d] / np.median(w), rel=1e-9)
            assert o["measured_gain_ratio"] == pytest.approx(g[d] / np.median(g), rel=1e-9)
            assert o["measured_effect"] == ("damped" if g[d] < np.median(g) else "amplified")
        for m in ("isoscore", "avgcos"):
            assert (
                n["metrics"][m]["before"] == by[n["before"]][m]
                and n["metrics"][m]["after"] == by[n["after"]][m]
            )
    assert sum(len(n["outliers"]) for n in norms) > 0  # the real model has outlier dimensions to judge


def test_the_norms_section_is_in_the_caption_and_the_page(minilm_norms, tmp_path):
    from geomscope.htmlreport import html_page
    from geomscope.report import norms_line
    from geomscope.schema import report_defect

    _, rep = minilm_norms
    line = norms_line(rep["norms"])
    assert line.startswith("norms: 13 norms scored at input and output; Spearman(measured gain")
    page = html_page([rep], kinds=())
    assert "encoder.layer.5.output.LayerNorm (encoder.layer.5.output.LayerNorm:in -&gt;" in page
    assert report_defect(rep) is None
    assert report_defect({**rep, "norms": "x"}) == "norms is not a list"
    broken = [{**rep["norms"][0], "measured_gain": {"median_gain": "big"}}]
    assert report_defect({**rep, "norms": broken}) == "norms[0].measured_gain is not what score writes"


def test_norms_null_or_absent_with_reasons(minilm_norms, llama_run):
    run, _ = minilm_norms
    rep = score(run, ScoreOptions(metrics=("isoscore",), layers=("encoder.layer.0.output.LayerNorm",)))
    assert rep["norms"] is None and "input and its output" in rep["notes"]["norms"]
    rep = score(llama_run, ScoreOptions(metrics=("isoscore",)))
    assert "norms" not in rep and "norms" not in rep["notes"]  # a run without norm modules
    rep = score(
        run,
        ScoreOptions(
            metrics=("twonn",),
            id_sample=100,
            layers=("encoder.layer.0.output.LayerNorm", "encoder.layer.0.output.LayerNorm:in"),
        ),
    )
    (n,) = rep["norms"]
    assert n["measured_gain"] is None and "variance unavailable" in n["note"]
