"""A run's identity fingerprints the whole checkpoint: a resume with weights changed anywhere in a
file (not only its first and last 64 KiB, the size kept) is refused, not mixed into the run."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers_models import make_tiny_model

from geomscope.errors import InputError
from geomscope.extract import extract
from geomscope.model.fingerprint import WEIGHTS_KEY, weights_fingerprint
from geomscope.store import Run

TEXTS = [f"sentence {i} about the cat and the dog" for i in range(12)]


def _retune_middle(model_dir) -> None:
    """The checkpoint re-saved with one tensor in the middle of the file changed: same size, same
    first and last 64 KiB (what an encoder tuned with frozen embeddings looks like on disk)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    names = sorted(tensors)  # safetensors lays tensors out by name
    middle = [k for k in names if "layer.0." in k and k.endswith("weight") and tensors[k].numel() > 64]
    tensors[middle[0]] = tensors[middle[0]] * 1.05
    before = path.read_bytes()
    save_file(tensors, path, metadata=meta)
    after = path.read_bytes()
    assert len(after) == len(before) and after != before
    assert after[: 64 * 1024] == before[: 64 * 1024] and after[-64 * 1024 :] == before[-64 * 1024 :]


def test_a_checkpoint_changed_in_the_middle_is_another_model(tmp_path):
    model = make_tiny_model("bert", tmp_path / "models", hidden_size=64, intermediate_size=128)
    a = tmp_path / "a"
    shutil.copytree(model, a)
    fp = weights_fingerprint(a)
    _retune_middle(a)
    assert weights_fingerprint(a) != fp
    (a / "extra_code.py").write_text("# a model's own code counts too\n")
    assert weights_fingerprint(a) not in (fp, None)


def test_a_resume_with_weights_changed_in_the_middle_is_refused(tmp_path):
    model = make_tiny_model("bert", tmp_path / "models", hidden_size=64, intermediate_size=128)
    a = tmp_path / "a"
    shutil.copytree(model, a)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    run = tmp_path / "run"
    extract(str(a), [src], run, shard_docs=3, layers="0")
    manifest = Run(run).manifest
    assert manifest["identity"]["model"][WEIGHTS_KEY] == weights_fingerprint(a)
    # an interrupted run: its last shards gone, the checkpoint re-saved in between
    m = manifest
    m["shards"] = m["shards"][:2]
    m["complete"] = False
    (run / "manifest.json").write_text(json.dumps(m))
    for f in sorted(run.glob("shard-*.h5"))[2:]:
        f.unlink()
    _retune_middle(a)
    with pytest.raises(InputError, match=WEIGHTS_KEY):
        extract(str(a), [src], run, shard_docs=3, layers="0")
    assert [s["file"] for s in Run(run).manifest["shards"]] == ["shard-00000.h5", "shard-00001.h5"]


def test_a_run_from_before_whole_file_fingerprints_still_resumes(tmp_path):
    """A run whose identity records weights_sha256 (the first and last 64 KiB), not WEIGHTS_KEY, is
    compared on that and resumes, not refused as made with other weights."""
    from geomscope.model.fingerprint import legacy_weights_fingerprint

    model = make_tiny_model("bert", tmp_path / "models", hidden_size=64, intermediate_size=128)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    run = tmp_path / "run"
    extract(str(model), [src], run, shard_docs=3, layers="0")
    m = json.loads((run / "manifest.json").read_text())
    ident = m["identity"]["model"]
    del ident[WEIGHTS_KEY]
    ident["weights_sha256"] = legacy_weights_fingerprint(model)  # an identity without WEIGHTS_KEY
    m["shards"] = m["shards"][:2]
    m["complete"] = False
    m.pop("request", None)
    (run / "manifest.json").write_text(json.dumps(m))
    for f in sorted(run.glob("shard-*.h5"))[2:]:
        f.unlink()
    s = extract(str(model), [src], run, shard_docs=3, layers="0")
    assert s["shards_resumed"] == 2 and s["shards_written"] == 2
    assert "weights_sha256" in json.loads((run / "manifest.json").read_text())["identity"]["model"]


def test_a_trainers_optimizer_state_is_not_read():
    """optimizer.pt (often twice the model) and rng_state.pth do not change the rows."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"w" * 100)
        before = weights_fingerprint(d)
        (d / "optimizer.pt").write_bytes(b"o" * 100)
        (d / "rng_state.pth").write_bytes(b"r" * 10)
        assert weights_fingerprint(d) == before
