"""``finetune`` on Hugging Face Accelerate (:mod:`geomscope.train.engine`).

* The move changed no result: four fine-tunings rerun against the steps and final evaluation that
  geomscope's own loop wrote before the move (``tests/data/finetune_before_accelerate.json``).
* Real launchers: ``torchrun`` and ``accelerate launch`` with 2 gloo processes equal one process with
  the doubled batch (the I-STAR covariance is the global batch's, through the gradient-carrying
  all-reduce; DDP averages the gradients).
* The engine itself: one Accelerator per run in a process, fp16 refused on the CPU, and the group
  a caller made is left to the caller.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_helpers import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.errors import InputError
from geomscope.train import FinetuneConfig, finetune

BEFORE = json.loads((Path(__file__).parent / "data" / "finetune_before_accelerate.json").read_text())
BIN = Path(sys.executable).parent
# Tolerance against the numbers recorded before the move. On this machine the rerun is bitwise equal
# (the same float32 kernels run in the same order). Another CPU's BLAS may round float32 products
# differently (~1e-7 relative per operation), and 8 AdamW steps at lr 2e-3 amplify that to ~1e-6; a
# real change (a lost or repeated step, another batch, a rescaled loss or penalty) moves these
# numbers by 1e-3 or more.
REL = 1e-4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    return {
        "train": str(write_csv(d / "train.csv", synthetic_rows(32, 0))),
        "eval": str(write_csv(d / "dev.csv", synthetic_rows(8, 1))),
        "dropout": str(make_checkpoint(d / "m", words_of([]))),
        "no_dropout": str(make_checkpoint(d / "m0", words_of([]), dropout=0.0)),
    }


CONFIGS = {
    "istar": dict(model="dropout"),
    "cosreg": dict(model="dropout", reg="cosreg", lam=0.5),
    "istar_accum_sched_wd": dict(
        model="no_dropout", grad_accum=2, scheduler="cosine", warmup=0.1, weight_decay=0.01
    ),
    "istar_bf16": dict(model="dropout", precision="bf16"),
}


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-3)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_results_equal_the_loop_before_accelerate(data, tmp_path, name):
    import torch

    torch.set_num_threads(1)
    kw = dict(CONFIGS[name])
    kw["model"] = data[kw["model"]]
    cfg = dict(train=data["train"], eval=data["eval"], out=str(tmp_path / name), epochs=2, lr=2e-3)
    cfg.update(batch_size=8, device="cpu", lam=-1.0, c0_points=2000)
    summary = finetune(FinetuneConfig(**{**cfg, **kw}), quiet=True, note=lambda m: None)
    steps = [json.loads(ln) for ln in (tmp_path / name / "steps.jsonl").read_text().splitlines()]
    want = BEFORE[name]
    assert len(steps) == len(want["steps"])
    for got, exp in zip(steps, want["steps"], strict=True):
        assert got["step"] == exp["step"] and got["lr"] == exp["lr"]
        for k in ("task_loss", "penalty", "isoscore_star"):
            assert _close(got[k], exp[k]), (name, got["step"], k, got[k], exp[k])
    for k, v in want["final"].items():
        assert _close(summary["final"][k], v), (name, k, summary["final"][k], v)


# -- real launchers --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def _args(data, out, batch) -> list[str]:
    return [
        "finetune",
        data["no_dropout"],
        "--train",
        data["train"],
        "--eval",
        data["eval"],
        "--out",
        str(out),
        "--epochs",
        "1",
        "--lr",
        "2e-3",
        "--batch-size",
        str(batch),
        "--grad-accum",
        "2",
        "--lambda",
        "-1",
        "--c0-points",
        "1000000",
        "--device",
        "cpu",
        "-q",
    ]


def _steps(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]


LAUNCHERS = {
    "torchrun": lambda: [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(_free_port())],
    "accelerate": lambda: [
        str(BIN / "accelerate"),
        "launch",
        "--multi_gpu",  # several processes; on a machine without GPUs they are CPU processes (gloo)
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
    ],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_two_launched_processes_equal_one(data, tmp_path, launcher):
    exe = Path(LAUNCHERS[launcher]()[0])
    if not exe.exists():
        pytest.skip(f"{exe.name} is not installed next to python")
    one = subprocess.run(
        [sys.executable, "-m", "geomscope", *_args(data, tmp_path / "one", 4)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [*LAUNCHERS[launcher](), "-m", "geomscope", *_args(data, tmp_path / "two", 2)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert s2["world_size"] == 2 and s1["global_batch"] == s2["global_batch"] == 8
    steps = [_steps(tmp_path / d) for d in ("one", "two")]
    assert len(steps[0]) == len(steps[1]) == 4
    for a, b in zip(*steps, strict=True):
        # float32 forwards over differently split batches: equal to ~1e-7, not bitwise
        for k in ("task_loss", "penalty", "isoscore_star"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a, b)
    for k in ("accuracy", "eval_loss", "isoscore_star"):
        assert abs(s1["final"][k] - s2["final"][k]) < 1e-5, k


# -- the engine ------------------------------------------------------------------------------------


def test_fp16_on_the_cpu_is_refused():
    from geomscope.train import engine

    with pytest.raises(InputError, match="fp16 needs a CUDA GPU"):
        engine.start("cpu", "fp16")


def test_one_accelerator_per_run_in_a_process():
    """Accelerate's state is a process-wide singleton: a second run with another precision must not
    meet the first run's settings."""
    from geomscope.train import engine

    for precision, mixed in (("bf16", "bf16"), ("fp32", "no"), ("bf16", "bf16")):
        eng = engine.start("cpu", precision)
        try:
            assert eng.acc.mixed_precision == mixed and not eng.d.active and not eng.sharded
            assert str(eng.d.device) == "cpu" and eng.scaler is None
        finally:
            engine.stop(eng)
