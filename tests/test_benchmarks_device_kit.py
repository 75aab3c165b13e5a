"""benchmarks/device_kit.py: the bundled MiniLM packed in float16 for a GPU machine, and restored there
to a float32 model that ``bundled:minilm`` resolves to and that computes what the real one does, to
float16's rounding of the weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import device_kit  # noqa: E402

from geomscope.model.load import load_model  # noqa: E402
from geomscope.model.names import bundled_minilm_dir  # noqa: E402

pytestmark = pytest.mark.skipif(bundled_minilm_dir() is None, reason="needs the bundled MiniLM")


def test_pack_small_unpack_float32_and_the_same_forward(tmp_path):
    kit = tmp_path / "kit"
    model = device_kit.main(["pack", str(kit)])
    packed = sum(p.stat().st_size for p in model.iterdir())
    assert packed < 48 * 2**20  # inside a call's 64 MiB beside the working tree
    assert not (model / device_kit.WEIGHTS).exists()
    with pytest.raises(SystemExit, match="pack"):
        device_kit.unpack(tmp_path / "elsewhere")
    device_kit.main(["unpack", str(kit)])

    from safetensors.torch import load_file

    weights = load_file(str(model / device_kit.WEIGHTS))
    real = load_file(str(bundled_minilm_dir() / device_kit.WEIGHTS))
    assert weights.keys() == real.keys()
    for k, v in real.items():
        assert weights[k].dtype == v.dtype and torch.equal(weights[k], v.half().to(v.dtype)), k

    ours, theirs = load_model(str(model), device="cpu"), load_model("bundled:minilm", device="cpu")
    enc = theirs.tokenizer(["the kit computes what the package does"], return_tensors="pt")
    a = ours.hidden_states(enc["input_ids"], enc["attention_mask"], None)
    b = theirs.hidden_states(enc["input_ids"], enc["attention_mask"], None)
    assert len(a) == len(b) == 7
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)

    # with the kit first on the path, bundled:minilm is the kit's directory
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(kit), os.environ.get("PYTHONPATH", "")])}
    code = "from geomscope.model.names import bundled_minilm_dir; print(bundled_minilm_dir())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == model.resolve()
