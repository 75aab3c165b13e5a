"""``finetune`` on Hugging Face Accelerate (:mod:`geomscope.train.engine`).

* The move changed no result: four fine-tunings rerun against the steps and final evaluation that
  geomscope's own loop wrote before the move (``tests/data/finetune_before_accelerate.json``).
* Real launchers: ``torchrun``, ``accelerate launch`` and srun's variables, 2 gloo processes, equal
  one process with the doubled batch (the I-STAR covariance is the global batch's, through the
  gradient-carrying all-reduce; DDP averages the gradients).
* The engine itself: one Accelerator per run in a process, fp16 refused on the CPU, a launch's mixed
  precision that disagrees with ``--precision`` refused.
* DeepSpeed ZeRO-2 and ZeRO-3 under ``accelerate launch`` (its CPU accelerator, gloo): 2 processes
  equal one process with the doubled batch, with accumulation, clipping, a schedule and weight decay;
  a DeepSpeed config that disagrees with finetune's flags is refused in one line.
* A sharded run's side that geomscope owns: lockstep passes, gathered saves, refusals; and real
  FSDP2 on 2 CPU processes (geomscope takes Accelerate's FSDP path there), equal to one process.
* What the libraries give nearly for free: ``--max-grad-norm``, ``--gradient-checkpointing``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

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
    summary = finetune(FinetuneConfig(**{**cfg, **kw}))
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


def _srun_by_hand(args: list[str]) -> subprocess.CompletedProcess:
    """What srun starts: one process per task with SLURM's variables and no RANK / WORLD_SIZE."""
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "geomscope", *args],
            env={
                **_env(),
                "SLURM_PROCID": str(r),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    bad = [(p.returncode, e) for p, (_, e) in zip(procs, outs, strict=True) if p.returncode != 0]
    return subprocess.CompletedProcess(args, bad[0][0] if bad else 0, outs[0][0], bad[0][1] if bad else "")


@pytest.mark.parametrize("launcher", [*LAUNCHERS, "srun"])
def test_two_launched_processes_equal_one(data, tmp_path, launcher):
    if launcher != "srun" and not Path(LAUNCHERS[launcher]()[0]).exists():
        pytest.skip(f"{launcher} is not installed next to python")
    one = subprocess.run(
        [sys.executable, "-m", "geomscope", *_args(data, tmp_path / "one", 4)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    if launcher == "srun":
        two = _srun_by_hand(_args(data, tmp_path / "two", 2))
    else:
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


# -- sharded launches (FSDP) -----------------------------------------------------------------------
# Real FSDP2 and DeepSpeed launches run below (test_a_sharded_launch_equals_one_process); these tests
# pin geomscope's own side of a sharded run: every process makes the same number of forwards, the
# weights come from the gathered state dict, and what a sharded run cannot honour is refused.


def _lockstep_worker(rank, tmp, payload):
    import dataclasses

    import torch
    import torch.distributed as dist

    from geomscope import distributed as dd
    from geomscope.model.classifier import load_classifier
    from geomscope.train.data import Encoded, load_table
    from geomscope.train.evaluate import compute_c0, evaluate

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    d = dd.setup("cpu")
    labels = {"negative": 0, "positive": 1}
    model, tok, _ = load_classifier(payload["no_dropout"], labels, lambda s: None)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    enc = Encoded(tok, load_table(payload["eval"]), labels, 64)
    res = {}
    for lock in (False, True):
        dl = dataclasses.replace(d, lockstep=lock)
        calls.clear()
        res[f"eval{lock}"] = evaluate(model, enc, [1, 2], 0.2, 2, dl, _Null, 2)
        res[f"eval_calls{lock}"] = len(calls)
        calls.clear()
        for budget in (20, 40, 60, 80, 120):  # budgets the ranks fill after different batch counts
            calls.clear()
            C0, n = compute_c0(model, enc, list(range(len(enc))), [1, 2], budget, 1, dl, _Null)
            res[f"c0{lock}{budget}"], res[f"c0_n{lock}{budget}"] = C0, n
            res[f"c0_calls{lock}{budget}"] = len(calls)
    torch.save(res, f"{tmp}/lock{rank}.pt")
    dist.destroy_process_group()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_lockstep_passes_make_as_many_forwards_on_every_process(data, tmp_path):
    """9 eval sentences in batches of 2 over 2 processes: 3 batches on rank 0, 2 on rank 1. Under
    lockstep rank 1 runs one more forward and drops it; the records and C0 do not change."""
    import torch
    import torch.multiprocessing as mp

    ev = write_csv(tmp_path / "dev9.csv", synthetic_rows(9, 3))
    mp.spawn(_lockstep_worker, args=(str(tmp_path), {**data, "eval": str(ev)}), nprocs=2, join=True)
    r = [torch.load(tmp_path / f"lock{i}.pt", weights_only=False) for i in range(2)]
    assert [x["eval_callsFalse"] for x in r] == [3, 2]
    assert [x["eval_callsTrue"] for x in r] == [3, 3]
    budgets = (20, 40, 60, 80, 120)
    assert all(r[0][f"c0_callsTrue{k}"] == r[1][f"c0_callsTrue{k}"] for k in budgets)
    assert any(r[0][f"c0_callsFalse{k}"] != r[1][f"c0_callsFalse{k}"] for k in budgets)  # lockstep's case
    for x in r:
        assert x["evalTrue"] == x["evalFalse"]
        for k in budgets:
            assert torch.equal(x[f"c0True{k}"], x[f"c0False{k}"]) and x[f"c0_nTrue{k}"] == x[f"c0_nFalse{k}"]


def _rank_batches(n, b, rank, world, lockstep):
    from geomscope import distributed as dd
    from geomscope.train.evaluate import rank_batches

    return rank_batches(list(range(n)), b, dd.Dist(rank, world, rank, "cpu", lockstep=lockstep))


@pytest.mark.parametrize("n,b,world", [(9, 2, 2), (1, 4, 3), (10, 3, 4), (12, 2, 3)])
def test_rank_batches_cover_each_example_once(n, b, world):
    for lockstep in (False, True):
        parts = [_rank_batches(n, b, r, world, lockstep) for r in range(world)]
        real = sorted(i for p in parts for ids, ok in p if ok for i in ids)
        assert real == list(range(n))
        if lockstep:
            assert len({len(p) for p in parts}) == 1


@pytest.fixture
def fake_sharded(monkeypatch):
    """A single process that geomscope treats as sharded: Accelerate's state dict of an unwrapped
    model is the model's own, so the gathered weights must equal an ordinary run's."""
    from geomscope.train import engine

    monkeypatch.setattr(engine.Engine, "sharded", property(lambda self: True))


def _cfg(data, out, **kw):
    base = dict(model=data["no_dropout"], train=data["train"], eval=data["eval"], out=str(out), epochs=1)
    base.update(lr=2e-3, batch_size=8, device="cpu", lam=-1.0, c0_points=2000, save_every=2)
    return FinetuneConfig(**{**base, **kw})


def test_a_sharded_run_saves_the_gathered_model_and_cannot_be_resumed(data, tmp_path, fake_sharded):
    import torch
    from safetensors.torch import load_file

    sharded = finetune(_cfg(data, tmp_path / "sh"))
    ck = tmp_path / "sh" / "checkpoint"
    state = json.loads((ck / "state.json").read_text())
    assert state["resumable"] is False and not (ck / "trainer.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "sh" / "checkpoints").iterdir()) == ["step0", "step2", "step4"]
    with pytest.raises(InputError, match="--resume is not available under FSDP"):
        finetune(_cfg(data, tmp_path / "sh", epochs=2, resume=True))
    for flag, kw in (("--lora", {"lora": 4}), ("--log-geometry", {"log_geometry": 1})):
        with pytest.raises(InputError, match=f"{flag} is not available under FSDP"):
            finetune(_cfg(data, tmp_path / flag, save_every=None, **kw))
        assert not (tmp_path / flag).exists()  # refused before anything was written
    from geomscope.train import engine

    plain = _cfg(data, tmp_path / "plain")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.Engine, "sharded", property(lambda self: False))
        ordinary = finetune(plain)
        # a DDP launch cannot resume the sharded run's checkpoint either: it has no optimizer state
        with pytest.raises(InputError, match="written by a sharded run"):
            finetune(_cfg(data, tmp_path / "sh", epochs=2, resume=True))
    assert sharded["final"] == ordinary["final"]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("sh", "plain"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- DeepSpeed -------------------------------------------------------------------------------------
# DeepSpeed runs on the CPU (its CPU accelerator with gloo), so ZeRO is tested for real: 2 processes
# launched by `accelerate launch` with a DeepSpeed config against one process with the doubled batch.


SHARDED_LAUNCHES = {
    "zero2": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n",
    "zero3": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n",
    # FSDP2 on CPU processes (gloo): geomscope takes Accelerate's FSDP path there (engine._fsdp_on_cpu)
    "fsdp2": "distributed_type: FSDP\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
    "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: BertLayer\n"
    "  fsdp_state_dict_type: FULL_STATE_DICT\n",
}
ENGINE_KIND = {"zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3", "fsdp2": "FSDP"}


def _launch_yaml(tmp: Path, launch: str) -> Path:
    cfg = tmp / f"{launch}.yaml"
    cfg.write_text(
        "compute_environment: LOCAL_MACHINE\nnum_processes: 2\nnum_machines: 1\nmachine_rank: 0\n"
        "mixed_precision: 'no'\n" + SHARDED_LAUNCHES[launch]
    )
    return cfg


def _weights(out: Path) -> dict:
    """The saved model's parameters as transformers loads them (under ZeRO-3 transformers saves
    LayerNorm weights under their legacy names, gamma/beta, and maps them back on loading)."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(out)).state_dict()


@pytest.mark.parametrize("launch", list(SHARDED_LAUNCHES))
def test_a_sharded_launch_equals_one_process(data, tmp_path, launch):
    """DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2, 2 CPU processes under `accelerate launch`, against one
    process with the doubled batch: every step, the evaluation, the saved weights."""
    if launch.startswith("zero"):
        pytest.importorskip("deepspeed")
        if not (shutil.which("c++") or shutil.which("g++")):
            pytest.skip("DeepSpeed's CPU backend compiles its shared-memory op at start; no C++ compiler")
    more = ["--epochs", "2", "--max-grad-norm", "0.5", "--scheduler", "cosine", "--warmup", "0.2"]
    more += ["--weight-decay", "0.01", "--save-every", "3"]

    def args(out, batch):
        a = _args(data, tmp_path / out, batch)
        a[a.index("--epochs") : a.index("--epochs") + 2] = []
        return a + more

    one = subprocess.run(
        [sys.executable, "-m", "geomscope", *args("one", 4)], env=_env(), capture_output=True, text=True
    )
    assert one.returncode == 0, one.stderr
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(_launch_yaml(tmp_path, launch))]
    cmd += ["--main_process_port", str(_free_port()), "-m", "geomscope"]
    two = subprocess.run([*cmd, *args("ds", 2)], env=_env(), capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "ds"))
    assert s2["engine"] == ENGINE_KIND[launch] and s2["world_size"] == 2
    assert s1["engine"] == "one process" and s1["global_batch"] == s2["global_batch"] == 8
    steps = [_steps(tmp_path / d) for d in ("one", "ds")]
    assert len(steps[0]) == len(steps[1]) == 8
    for a, b in zip(*steps, strict=True):
        assert a["lr"] == b["lr"]  # the schedule is stepped once per update, not per micro-batch
        for k in ("task_loss", "penalty", "isoscore_star", "grad_norm"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a, b)
    for k in ("accuracy", "eval_loss", "isoscore_star"):
        assert abs(s1["final"][k] - s2["final"][k]) < 1e-5, k
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "ds")
    assert w1.keys() == w2.keys() and all((w1[k] - w2[k]).abs().max() < 1e-5 for k in w1)
    state = json.loads((tmp_path / "ds" / "checkpoint" / "state.json").read_text())
    assert state["resumable"] is False
    snaps = sorted(p.name for p in (tmp_path / "ds" / "checkpoints").iterdir())
    assert snaps == ["step0", "step3", "step6"]


class _PluginEngine:
    """An Engine with a DeepSpeed plugin's config and nothing else (configure_deepspeed's inputs)."""

    deepspeed = True

    def __init__(self, ds_config: dict, world: int = 2):
        plugin = type("Plugin", (), {"deepspeed_config": ds_config})()
        self.acc = type(
            "Acc", (), {"num_processes": world, "state": type("S", (), {"deepspeed_plugin": plugin})()}
        )()


def test_finetunes_flags_fill_the_deepspeed_config_or_a_disagreeing_one_is_refused():
    from geomscope.train.engine import configure_deepspeed

    ds = {"train_batch_size": "auto", "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    configure_deepspeed(_PluginEngine(ds), batch_size=4, grad_accum=1, max_grad_norm=None)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert (
        ds["gradient_clipping"] == 0.0
        and ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    )
    for key, value, flag in (
        ("gradient_accumulation_steps", 4, "--grad-accum"),
        ("gradient_clipping", 1.0, "--max-grad-norm"),
        ("train_micro_batch_size_per_gpu", 16, "--batch-size"),
    ):
        with pytest.raises(InputError, match=f"sets {key} {value} but finetune has {flag}"):
            configure_deepspeed(_PluginEngine({key: value}), batch_size=4, grad_accum=2, max_grad_norm=0.5)
    for section in ("optimizer", "scheduler"):
        with pytest.raises(InputError, match=f"has a {section} section"):
            configure_deepspeed(_PluginEngine({section: {"type": "AdamW"}}), 4, 1, None)
    agreeing = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "train_batch_size": 16}
    configure_deepspeed(_PluginEngine(agreeing), batch_size=4, grad_accum=2, max_grad_norm=0.5)


def test_fsdp1_on_cpu_processes_is_refused_in_one_line(monkeypatch):
    from accelerate.utils import DistributedType

    from geomscope.train import engine

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    acc = type("Acc", (), {"distributed_type": DistributedType.MULTI_CPU, "mixed_precision": "no"})()
    with pytest.raises(InputError, match="needs fsdp_version: 2"):
        engine._fsdp_on_cpu(acc)


def test_a_deepspeed_launch_without_deepspeed_is_one_line(monkeypatch):
    from geomscope.train import engine

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(InputError, match=r"pip install 'geomscope\[deepspeed\]'"):
        engine.start("cpu", "fp32")


def test_options_a_deepspeed_launch_cannot_honour_are_refused_before_writing(data, tmp_path, monkeypatch):
    from geomscope.train import engine

    monkeypatch.setattr(engine.Engine, "sharded", property(lambda self: True))
    monkeypatch.setattr(engine.Engine, "kind", property(lambda self: "DeepSpeed ZeRO-2"))
    with pytest.raises(InputError, match="--lora is not available under DeepSpeed ZeRO-2"):
        finetune(_cfg(data, tmp_path / "l", save_every=None, lora=4))
    assert not (tmp_path / "l").exists()


class _NaNOnSecondCall:
    """A classifier whose logits are NaN from its second forward on (the second micro-batch)."""

    def __init__(self):
        import torch

        self.lin, self.calls = torch.nn.Linear(3, 2), 0

    def __call__(self, input_ids, attention_mask, output_hidden_states=False):
        import torch

        self.calls += 1
        logits = self.lin(input_ids.float())
        return type("Out", (), {"logits": logits * (torch.nan if self.calls > 1 else 1.0)})()

    def train(self):
        return self


class _Engine:
    def __init__(self, deepspeed: bool):
        from contextlib import nullcontext

        from geomscope.distributed import Dist

        self.deepspeed, self.scaler, self.steps = deepspeed, None, 0
        self.d = Dist(rank=0, world_size=1, local_rank=0, device=__import__("torch").device("cpu"))
        self.autocast = self.micro_batch_ctx = nullcontext

    def micro_batch(self, model, last):
        return self.micro_batch_ctx()

    def backward(self, loss, model=None):
        loss.backward()

    def step(self, model, optimizer, max_grad_norm):
        self.steps += 1


@pytest.mark.parametrize("deepspeed", [False, True])
def test_a_non_finite_later_micro_batch_skips_the_step_or_stops_under_deepspeed(deepspeed):
    """Elsewhere the step is skipped (the accumulated gradients are cleared by zero_grad); DeepSpeed
    keeps them inside its engine with no call to discard them, so the run stops with one line."""
    import torch

    from geomscope.errors import DataError
    from geomscope.train.step import train_step

    model, eng = _NaNOnSecondCall(), _Engine(deepspeed)
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    mb = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3),
        "labels": torch.tensor([0, 1]),
    }
    if deepspeed:
        with pytest.raises(DataError, match="not finite in micro-batch 2 of a step under DeepSpeed"):
            train_step(model, [mb, mb], 4, None, 0.0, opt, eng)
    else:
        rec = train_step(model, [mb, mb], 4, None, 0.0, opt, eng)
        assert rec["finite"] is False and eng.steps == 0
        assert all(p.grad is None for p in model.lin.parameters())


# -- what Accelerate and transformers give nearly for free ------------------------------------------


def test_max_grad_norm_clips_the_global_norm_and_logs_it(data):
    """grad_norm is the norm of the task-loss gradient before clipping (autograd on a copy), and the
    update sees the gradient scaled to the cap (the optimizer's step is intercepted)."""
    import copy

    import torch
    import torch.nn.functional as F

    from geomscope.model.classifier import load_classifier
    from geomscope.train import engine
    from geomscope.train.data import Encoded, load_table
    from geomscope.train.step import train_step

    labels = {"negative": 0, "positive": 1}
    model, tok, _ = load_classifier(data["no_dropout"], labels, lambda s: None)
    batch = Encoded(tok, load_table(data["train"]), labels, 64).collate(range(8))
    ref = copy.deepcopy(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    (F.cross_entropy(ref(**inputs).logits, batch["labels"], reduction="sum") / 8).backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    ref_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads])))
    eng = engine.start("cpu", "fp32")
    try:
        model, opt, _ = eng.prepare(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        seen = []
        opt.step = lambda *a, **k: seen.append([p.grad.clone() for p in model.parameters()])
        rec = train_step(model, batch, 8, None, 0.0, opt, eng, max_grad_norm=ref_norm / 10)
    finally:
        engine.stop(eng)
    assert rec["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    for g, r in zip(seen[0], ref_grads, strict=True):
        # float32 sums in another order: 1e-4 relative on the smallest entries
        torch.testing.assert_close(g, r / 10, rtol=1e-3, atol=1e-5 * float(r.abs().max()))


def test_gradient_checkpointing_gives_the_same_run_and_resumes_either_way(data, tmp_path):
    """Dropout is on: the non-reentrant recomputation replays its masks, so the steps match."""
    cfg = dict(model=data["dropout"], train=data["train"], eval=data["eval"], epochs=1, lr=2e-3)
    cfg.update(batch_size=8, device="cpu", lam=-1.0, c0_points=2000)
    plain = finetune(FinetuneConfig(**cfg, out=str(tmp_path / "a")))
    ckpt = finetune(FinetuneConfig(**cfg, out=str(tmp_path / "b"), gradient_checkpointing=True))
    for a, b in zip(_steps(tmp_path / "a"), _steps(tmp_path / "b"), strict=True):
        for k in ("task_loss", "penalty", "isoscore_star"):
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])), (k, a, b)
    assert abs(plain["final"]["eval_loss"] - ckpt["final"]["eval_loss"]) < 1e-6
    # not part of the resume fingerprint: a run may be continued with or without it
    more = {**cfg, "epochs": 2}
    finetune(FinetuneConfig(**more, out=str(tmp_path / "a"), resume=True))
    finetune(FinetuneConfig(**more, out=str(tmp_path / "b"), resume=True, gradient_checkpointing=False))


def test_a_launch_asking_for_other_mixed_precision_is_refused(monkeypatch):
    from geomscope.train import engine

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(InputError, match="pass --precision bf16"):
        engine.start("cpu", "fp32")
    eng = engine.start("cpu", "bf16")  # agreeing settings run
    engine.stop(eng)
