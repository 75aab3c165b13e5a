"""score on runs of real (tiny) checkpoints: an end-to-end extract -> score, and the partition isotropy
of input/output embedding matrices (separate, tied, absent) read straight from the weight files."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_models import SAMPLE_TEXTS, make_tiny_model
from test_score import make_run

from geomscope.metrics import isoscore_published, partition_isotropy
from geomscope.score import ScoreOptions, score
from geomscope.store import Run, iter_shard


@pytest.fixture(scope="module")
def tiny_bert_run(tmp_path_factory):
    from geomscope.extract.run import extract

    tmp = tmp_path_factory.mktemp("tinybert")
    (tmp / "t.txt").write_text("\n".join(SAMPLE_TEXTS * 3))
    model = make_tiny_model("bert", tmp)
    extract(model, [str(tmp / "t.txt")], tmp / "run", shard_docs=12, store_dtype="float32")
    return tmp / "run", model


def _stored(run_dir):
    run = Run(run_dir)
    X = {n: [] for n in run.layer_names}
    special = []
    for info in run.shards:
        for ch in iter_shard(run.shard_path(info)):
            for n in run.layer_names:
                X[n].append(ch.layers[n].astype(np.float64))
            special.append(ch.is_special)
    return {n: np.concatenate(v) for n, v in X.items()}, np.concatenate(special)


def test_real_extract_end_to_end(tiny_bert_run):
    run_dir, model = tiny_bert_run
    X, special = _stored(run_dir)
    rep = score(
        run_dir,
        ScoreOptions(
            metrics=("isoscore", "avgcos", "twonn", "partition"),
            id_sample=400,
            exclude_special=True,
            workers=2,
        ),
    )
    assert rep["model"]["name"] == str(model) and rep["source"]["dataset"] == "t.txt"
    assert rep["run"]["complete"] and rep["run"]["rows"] == len(special)
    for e in rep["layers"]:
        Xl = X[e["layer"]][~special]
        assert e["n_rows"] == len(Xl) and e["dropped"]["special"] == special.sum() > 0
        assert e["isoscore"] == pytest.approx(isoscore_published(Xl), abs=1e-8)
        assert e["twonn"] > 0 and e["se"]["twonn"] > 0 and e["twonn_n_used"] > 3
    emb = rep["embeddings"]
    from transformers import AutoModel

    W = AutoModel.from_pretrained(model).get_input_embeddings().weight.detach().numpy()
    assert emb["input"]["raw"] == pytest.approx(partition_isotropy(W)["I"], rel=1e-10)
    assert emb["input"]["centred"] == pytest.approx(partition_isotropy(W, centred=True)["I"], rel=1e-10)
    assert emb["output"] is None and "no output" in emb["note"]  # a bare BertModel has no LM head


def _lm_checkpoint(tmp_path, kind):
    import torch
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel, GPTNeoXForCausalLM

    base = make_tiny_model(kind, tmp_path)
    cfg = AutoConfig.from_pretrained(base)
    torch.manual_seed(1)
    if kind == "gpt2":
        model = GPT2LMHeadModel(cfg)  # tied: lm_head.weight is wte.weight
    else:
        cfg.tie_word_embeddings = False
        model = GPTNeoXForCausalLM(cfg)  # Pythia: separate embed_in / embed_out
    out = tmp_path / f"lm-{kind}"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out, model


def test_partition_tied_and_separate_embeddings(tmp_path):
    ckpt, model = _lm_checkpoint(tmp_path, "gpt2")
    make_run(tmp_path / "r1", n_shards=1, rows=60, dim=32, model_name=str(ckpt))
    rep = score(tmp_path / "r1", ScoreOptions(metrics=("isoscore", "partition")))
    emb = rep["embeddings"]
    W = model.get_input_embeddings().weight.detach().numpy()
    assert emb["tied"] is True and emb["output"] == emb["input"]
    assert emb["input"]["raw"] == pytest.approx(partition_isotropy(W)["I"], rel=1e-10)

    ckpt, model = _lm_checkpoint(tmp_path, "gpt_neox")
    make_run(tmp_path / "r2", n_shards=1, rows=60, dim=32, model_name=str(ckpt))
    emb = score(tmp_path / "r2", ScoreOptions(metrics=("partition", "isoscore")))["embeddings"]
    Wout = model.get_output_embeddings().weight.detach().numpy()
    assert emb["tied"] is False and emb["output_key"] == "embed_out.weight"
    assert emb["output"]["raw"] == pytest.approx(partition_isotropy(Wout)["I"], rel=1e-10)
    assert emb["output"]["centred"] == pytest.approx(partition_isotropy(Wout, centred=True)["I"], rel=1e-10)


def test_partition_without_checkpoint_is_null_with_reason(tmp_path):
    make_run(tmp_path / "r", n_shards=1, rows=60)  # model "toy": no checkpoint anywhere
    rep = score(tmp_path / "r", ScoreOptions(metrics=("isoscore", "partition")))
    assert rep["embeddings"] is None and "not at hand" in rep["notes"]["embeddings"]
