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
