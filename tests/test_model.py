"""The model room (geomscope/model) against checkpoints that would have been read wrongly, and kept
quiet about it, and against checkpoints someone else made: weights that lack tensors (loaded with
those at random), damaged weight files and configs (tracebacks that ended an ``extract --revisions``
sweep), a model's own code or tokenizer code (never run unless asked), weights that need pickle
(never unpickled), a directory without tokenizer files; a revision name that is also a folder here,
a ref file with a trailing newline, a snapshot shared with a new ref deleted by ``--drop-weights``,
``--cache-dir`` left out of a missing revision's message; an adapter's settings left out of the
fingerprint; and I(W) read from a checkpoint overwritten since the run (or at a ref moved since)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import Planted, assert_one_line_error, quiet_extract
from helpers_models import (
    SAMPLE_TEXTS,
    bundled_minilm_dir,
    hf_cache_with,
    make_tiny_head_model,
    make_tiny_model,
)
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.errors import InputError

REPO = "tiny-org/tiny-neox"


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text("\n".join(SAMPLE_TEXTS[:5]) + "\n")
    return p


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache holding step0 and step1000 of a tiny GPT-NeoX, with different weights."""
    root = tmp_path_factory.mktemp("hub")
    for i, step in enumerate(("step0", "step1000")):
        hf_cache_with(
            make_tiny_model("gpt_neox", root / step, seed=i),
            root / "cache",
            REPO,
            commit=f"{i:040x}",
            ref=step,
        )
    return root / "cache"


def _copy(src, dest):
    shutil.copytree(src, dest)
    return dest


def _save_without(model_dir, drop) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not drop(k)},
        model_dir / "model.safetensors",
        metadata={"format": "pt"},
    )


def _edit_config(model_dir, **values) -> None:
    p = model_dir / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **values}))


# -- weights that lack tensors: refused, never loaded at random ------------------------------------


def test_weights_without_a_block_are_refused(tiny_bert, text, tmp_path, cli):
    ckpt = _copy(tiny_bert, tmp_path / "no-block")
    _save_without(ckpt, lambda k: ".layer.1." in k)  # block 1 absent: it would be random, run to run
    code, out, err = cli(["extract", ckpt, text, "--out", tmp_path / "run", "-q"])
    line = assert_one_line_error(code, out, err, "encoder.layer.1.", "incomplete", exit_code=2)
    assert "and 13 more" in line and not (tmp_path / "run" / "manifest.json").exists()


def test_another_architectures_weights_are_refused(tiny_bert, text, tmp_path, cli):
    ckpt = _copy(tiny_bert, tmp_path / "neox-weights")
    neox = make_tiny_model("gpt_neox", tmp_path / "neox")
    shutil.copy(neox / "model.safetensors", ckpt / "model.safetensors")
    code, out, err = cli(["extract", ckpt, text, "--out", tmp_path / "run", "-q"])
    assert_one_line_error(code, out, err, "another architecture", "embeddings.", exit_code=2)


def test_what_adds_no_hidden_state_may_be_absent(tmp_path):
    """BERT's pooler (a masked-LM checkpoint has none) and a tied LM head (not stored) load; a head
    the gradients need is still refused by check_head, with its own message."""
    from geomscope.model.load import load_model

    mlm = make_tiny_head_model("bert", "masked-lm", tmp_path)
    assert load_model(str(mlm), device="cpu").info["architecture"] == "BertModel"
    assert load_model(str(mlm), device="cpu", loss="auto").info["loss"] == "masked-lm"
    tied = make_tiny_head_model("gpt2", "causal-lm", tmp_path)  # lm_head.weight tied to wte: not stored
    assert load_model(str(tied), device="cpu", loss="auto").info["architecture"] == "GPT2LMHeadModel"
    with pytest.raises(InputError, match="no trained causal-lm head"):
        load_model(str(make_tiny_model("gpt_neox", tmp_path)), device="cpu", loss="causal-lm")


# -- damaged checkpoints: one line naming the file, and the sweep goes on ---------------------------


def _garbage_bin(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04garbage" * 10)


def _empty_bin(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"")


def _index_without_metadata(d):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))


DAMAGE = {
    "garbage_bin": (_garbage_bin, ("pytorch_model.bin", "damaged")),
    "empty_bin": (_empty_bin, ("pytorch_model.bin", "damaged")),
    "index_without_metadata": (_index_without_metadata, ("model.safetensors.index.json", "metadata")),
    "config_field_type": (lambda d: _edit_config(d, hidden_size="abc"), ("config.json", "hidden_size")),
    "config_of_another_size": (lambda d: _edit_config(d, intermediate_size=80), ("other shapes",)),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_is_one_line(case, tiny_bert, text, tmp_path, cli):
    damage, needles = DAMAGE[case]
    ckpt = _copy(tiny_bert, tmp_path / case)
    damage(ckpt)
    code, out, err = cli(["extract", ckpt, text, "--out", tmp_path / "run", "-q"])
    line = assert_one_line_error(code, out, err, *needles, exit_code=2)
    assert "an input file ended" not in line  # (the empty .bin's EOFError blamed the text input)


def test_revisions_sweep_goes_on_past_a_damaged_checkpoint(tiny_bert, text, tmp_path, cli):
    ckpts = tmp_path / "ckpts"
    for step in ("step1", "step2", "step3"):
        _copy(tiny_bert, ckpts / step)
    _garbage_bin(ckpts / "step2")
    out = tmp_path / "runs"
    code, o, err = cli(["extract", "ft", text, "--revisions", str(ckpts / "*"), "--out", out, "-q"])
    assert_one_line_error(code, o, err, "1 of 3 revisions failed", "step2", "pytorch_model.bin", exit_code=2)
    for step in ("step1", "step3"):
        assert json.loads((out / step / "manifest.json").read_text())["complete"]


# -- a revision name that is also a folder here ------------------------------------------------------


def test_bare_revision_of_a_hub_model_is_never_a_folder_here(tmp_path, monkeypatch):
    from geomscope.model.revisions import resolve_revisions

    monkeypatch.chdir(tmp_path)
    (tmp_path / "step1000").mkdir()
    with pytest.raises(InputError, match=r"write \./step1000 for the folder"):
        resolve_revisions("org/neox", "step0,step1000")
    (tmp_path / "list.txt").write_text("step1000\n")
    with pytest.raises(InputError, match="both a revision"):
        resolve_revisions("org/neox", str(tmp_path / "list.txt"))
    got = resolve_revisions("org/neox", "step0,./step1000")
    assert [(r.name, r.revision) for r in got] == [("step0", "step0"), ("step1000", None)]
    assert got[1].model == "./step1000"
    # of a local model folder nothing changes: a folder named like that is a checkpoint
    model = make_tiny_model("bert", tmp_path / "m")
    assert resolve_revisions(str(model), "step1000")[0].revision is None


# -- the fingerprint covers an adapter's settings ---------------------------------------------------


def test_fingerprint_covers_adapter_config(tiny_bert, tmp_path):
    from geomscope.model.fingerprint import weights_fingerprint

    d = _copy(tiny_bert, tmp_path / "adapted")
    bare = weights_fingerprint(d)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8}))
    with_adapter = weights_fingerprint(d)
    assert with_adapter != bare
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 64}))
    assert weights_fingerprint(d) not in (bare, with_adapter)  # lora_alpha scales the adapter's output


# -- a ref file with a trailing newline; a snapshot that cannot be identified ------------------------


def test_ref_with_trailing_newline_finds_its_snapshot(hub, tmp_path, monkeypatch):
    from geomscope.model.hub import cached_snapshot

    cache = tmp_path / "cache"
    shutil.copytree(hub, cache, symlinks=True)
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "refs" / "step0").write_text(f"{0:040x}\n")  # written by hand
    assert cached_snapshot(REPO, "step0", str(cache)) == repo / "snapshots" / f"{0:040x}"
    (repo / "refs" / "step0").write_text("../../../step1000\n")  # a ref is never a path to follow
    assert cached_snapshot(REPO, "step0", str(cache)) is None
    (repo / "refs" / "step0").write_text(f"{0:040x}\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from geomscope.extract.run import extract

    (tmp_path / "t.txt").write_text("\n".join(SAMPLE_TEXTS[:4]) + "\n")
    extract(REPO, [str(tmp_path / "t.txt")], tmp_path / "run", cache_dir=str(cache), revision="step0")
    model = json.loads((tmp_path / "run" / "manifest.json").read_text())["identity"]["model"]
    assert model["commit"] == f"{0:040x}" and model["weights_xxh3_128"]


def test_offline_load_of_an_unidentified_snapshot_is_refused(hub, monkeypatch):
    from geomscope.model import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(load, "cached_snapshot", lambda *a, **k: None)  # the cache's refs unreadable
    with pytest.raises(InputError, match="names no snapshot folder"):
        load.load_model(REPO, revision="step0", cache_dir=str(hub), device="cpu")


# -- --drop-weights keeps a snapshot that was in the cache before the call ---------------------------


def test_drop_weights_keeps_a_snapshot_a_new_ref_shares(hub, text, tmp_path, monkeypatch):
    """Pythia's main is step143000's commit: downloading main writes only refs/main, and the
    snapshot step143000 had before the call is not the call's to delete."""
    from geomscope.extract import revisions as rv
    from geomscope.extract import run as run_module
    from geomscope.extract.options import ExtractOptions
    from geomscope.model.revisions import resolve_revisions

    cache = tmp_path / "cache"
    shutil.copytree(hub, cache, symlinks=True)
    repo = cache / ("models--" + REPO.replace("/", "--"))
    real = run_module.extract

    def downloading_main(*args, **kwargs):
        (repo / "refs" / "main").write_text(f"{1:040x}")  # what resolving main online writes
        return real(*args, **kwargs)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(run_module, "extract", downloading_main)
    opts = ExtractOptions(cache_dir=str(cache))
    res = rv.extract_revisions(
        REPO, [text], tmp_path / "runs", resolve_revisions(REPO, "main"), opts, drop_weights=True
    )
    assert res["runs"][0]["status"] == "done" and res["runs"][0]["dropped_bytes"] == 0
    assert (repo / "snapshots" / f"{1:040x}" / "model.safetensors").exists()


# -- I(W) from the checkpoint the run was extracted from, or none ------------------------------------


def test_iw_is_null_when_the_checkpoint_was_overwritten(text, tmp_path):
    from geomscope.extract.run import extract
    from geomscope.score import ScoreOptions, score

    ckpt = make_tiny_model("gpt_neox", tmp_path / "a", seed=0)
    extract(str(ckpt), [str(text)], tmp_path / "run")
    opts = ScoreOptions(metrics=("isoscore", "partition"))
    assert score(tmp_path / "run", opts)["embeddings"]["input"]["raw"] > 0
    other = make_tiny_model("gpt_neox", tmp_path / "b", seed=5)  # finetune --overwrite into the same folder
    shutil.copy(other / "model.safetensors", ckpt / "model.safetensors")
    rep = score(tmp_path / "run", opts)
    assert rep["embeddings"] is None and "other weights" in rep["notes"]["embeddings"]


def test_iw_is_read_at_the_recorded_commit_not_a_moved_ref(hub, text, tmp_path, monkeypatch):
    import numpy as np
    from huggingface_hub import constants
    from safetensors.numpy import load_file

    from geomscope.extract.run import extract
    from geomscope.metrics import partition_isotropy
    from geomscope.score import ScoreOptions, score

    first = tmp_path / "first"
    shutil.copytree(hub, first, symlinks=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extract(REPO, [str(text)], tmp_path / "run", cache_dir=str(first), revision="step0")
    cache = tmp_path / "moved"
    first.rename(cache)  # the recorded snapshot path is gone: the name and commit are looked up
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "refs" / "step0").write_text(f"{1:040x}")  # step0 now names step1000's weights
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    emb = score(tmp_path / "run", ScoreOptions(metrics=("isoscore", "partition")))["embeddings"]
    w = load_file(repo / "snapshots" / f"{0:040x}" / "model.safetensors")["embed_in.weight"]
    assert emb["checkpoint"].endswith(f"{0:040x}")
    assert emb["input"]["raw"] == pytest.approx(partition_isotropy(w.astype(np.float64))["I"], rel=1e-10)


@pytest.mark.parametrize("content", [b"PK\x03\x04garbage" * 10, b""], ids=["garbage", "empty"])
def test_iw_of_a_damaged_checkpoint_is_null_with_reason(content, tiny_bert, tmp_path):
    from test_score import make_run

    from geomscope.score import ScoreOptions, score

    ckpt = _copy(tiny_bert, tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(content)
    make_run(tmp_path / "run", n_shards=1, rows=60, dim=32, model_name=str(ckpt))  # no fingerprint recorded
    rep = score(tmp_path / "run", ScoreOptions(metrics=("isoscore", "partition")))
    assert rep["embeddings"] is None and "could not read the embedding matrices" in rep["notes"]["embeddings"]
    assert rep["layers"][0]["isoscore"] > 0  # the rest of the report is there


# -- what transformers reports of tensors it made at random -----------------------------------------


def test_random_tensors_refused_whatever_transformers_reports_them_as():
    """transformers 4 lists mismatched_keys as (key, checkpoint shape, model shape); 5 raises."""
    from geomscope.model.load_errors import refuse_random_weights

    class Model:
        config = type("Config", (), {"model_type": "bert"})()

    with pytest.raises(
        InputError, match=r"have another shape for 1 tensor\(s\) of the bert architecture \(a\.w\)"
    ):
        refuse_random_weights(Model(), {"missing_keys": [], "mismatched_keys": [("a.w", (3,), (4,))]}, "m")
    refuse_random_weights(Model(), {"missing_keys": set(), "mismatched_keys": set()}, "m")


# -- --cache-dir reaches the message of a revision the cache lacks ------------------------------------


def test_missing_revision_names_those_of_the_cache_dir(hub, tmp_path, monkeypatch):
    from geomscope.model.load import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # the default cache: empty
    with pytest.raises(
        InputError, match=r"no revision 'step9' in the local cache \(it has step0, step1000\)"
    ):
        load_model(REPO, revision="step9", cache_dir=str(hub), device="cpu")


# -- a checkpoint someone else made: its code never runs, no pickle is loaded, damage is one line ---


def _remote_code_model(tmp_path: Path, base: Path, marker: Path, model_type: str) -> Path:
    d = tmp_path / f"remote-{model_type}"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModel": "evil.EvilModel",
        "AutoModelForSequenceClassification": "evil.EvilModel",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    return d


def test_a_models_own_code_never_runs_unless_asked(cli, tiny_bert, text, tmp_path):
    """A config that points at its own code: a known architecture loads transformers' own class,
    an unknown one is refused with one line; the model's code never runs."""
    marker = tmp_path / "RAN"
    train = write_csv(tmp_path / "train.csv", synthetic_rows(8, 0))
    known = _remote_code_model(tmp_path, tiny_bert, marker, "bert")
    code, _, err = quiet_extract(cli, known, text, tmp_path / "run-known")
    assert code == 0, err
    unknown = _remote_code_model(tmp_path, tiny_bert, marker, "evil-arch")
    code, out, err = quiet_extract(cli, unknown, text, tmp_path / "run")
    assert_one_line_error(code, out, err, exit_code=2)
    code, out, err = cli(["finetune", unknown, "--train", train, "--eval", train, "--out", tmp_path / "ft"])
    assert_one_line_error(code, out, err, "never runs a model's code", exit_code=2)
    assert not marker.exists()


def test_model_directory_without_tokenizer_files_is_refused(cli, tiny_bert, text, tmp_path):
    d = tmp_path / "notok"
    shutil.copytree(tiny_bert, d)
    for p in d.iterdir():
        if p.name.startswith(("tokenizer", "vocab", "special")):
            p.unlink()
    code, out, err = quiet_extract(cli, d, text, tmp_path / "run")
    assert_one_line_error(code, out, err, "has no tokenizer files", "tokenizer.json", exit_code=2)
    train = write_csv(tmp_path / "train.csv", synthetic_rows(8, 0))
    code, out, err = cli(["finetune", d, "--train", train, "--eval", train, "--out", tmp_path / "ft"])
    assert_one_line_error(code, out, err, "has no tokenizer files", exit_code=2)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ft").exists()


def test_corrupt_safetensors_is_one_line(cli, tiny_bert, text, tmp_path):
    d = tmp_path / "corrupt"
    shutil.copytree(tiny_bert, d)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    code, out, err = quiet_extract(cli, d, text, tmp_path / "run")
    assert_one_line_error(code, out, err, "model.safetensors", "is damaged", exit_code=2)
    train = write_csv(tmp_path / "train.csv", synthetic_rows(8, 0))
    code, out, err = cli(["finetune", d, "--train", train, "--eval", train, "--out", tmp_path / "ft"])
    assert_one_line_error(code, out, err, "model.safetensors", "is damaged", exit_code=2)


def test_a_checkpoint_whose_weights_need_pickle_is_one_line_and_never_loaded(cli, tiny_bert, text, tmp_path):
    """A pytorch_model.bin holding more than tensors: transformers' torch.load(weights_only=True) refuses
    it with a 70-line UnpicklingError; geomscope says what it is, and nothing in it runs."""
    marker = tmp_path / "PWNED"
    models = []
    for name, src in (("enc", tiny_bert), ("clf", make_checkpoint(tmp_path / "m", words_of([])))):
        bad = tmp_path / name
        shutil.copytree(src, bad)
        for f in bad.glob("*.safetensors"):
            f.unlink()
        with open(bad / "pytorch_model.bin", "wb") as fh:
            pickle.dump({"weight": Planted(marker)}, fh)
        models.append(bad)
    code, out, err = quiet_extract(cli, models[0], text, tmp_path / "run")
    assert_one_line_error(code, out, err, "never unpickles", "safetensors", exit_code=2)
    train = write_csv(tmp_path / "train.csv", synthetic_rows(16, 0))
    code, out, err = cli(
        ["finetune", models[1], "--train", train, "--eval", train, "--out", tmp_path / "ft", "--quiet"]
    )
    assert_one_line_error(code, out, err, "never unpickles", exit_code=2)
    assert not marker.exists()


def test_embedding_weights_that_need_pickle_are_refused_not_loaded(tmp_path):
    """score --metrics partition reads a run's embedding matrices from its checkpoint: a
    pytorch_model.bin holding more than tensors is one line, and nothing in it runs."""
    from geomscope.model.embeddings import _Weights

    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with open(ckpt / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"weight": Planted(marker)}, fh)
    with pytest.raises(InputError, match="never unpickles"):
        _Weights(ckpt)
    assert not marker.exists()


def test_a_tokenizer_of_its_own_code_asks_for_trust_and_runs_nothing(cli, tmp_path):
    """transformers said only that a backend tokenizer could not be built (sentencepiece)."""
    model = tmp_path / "model"
    shutil.copytree(bundled_minilm_dir(), model)
    (model / "tokenizer.json").unlink()
    marker = tmp_path / "ran"
    (model / "tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": ["tok.MyTok", None]}, tokenizer_class="MyTok")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    src = tmp_path / "in.txt"
    src.write_text("a sentence\n")
    code, out, err = cli(["extract", model, src, "--out", tmp_path / "r", "-q"])
    assert_one_line_error(code, out, err, "needs its own code", "--trust-remote-code", exit_code=2)
    assert not marker.exists()


def test_lora_adapter_missing_from_a_checkpoint_is_one_line(tmp_path):
    pytest.importorskip("peft")
    from geomscope.model.classifier import load_lora_adapter

    with pytest.raises(InputError) as e:
        load_lora_adapter(None, tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"cannot read the LoRA adapter in {tmp_path} (") and "\n" not in msg
    assert msg.endswith("start again without --resume into a new --out (or --overwrite)")
