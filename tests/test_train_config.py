"""The training options of train/config.py on geomscope's own loop: --weight-decay, --scheduler/--warmup,
--grad-accum, --lora, --report-to (tiny BERT, a few steps each)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import assert_one_line_error
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.errors import InputError
from geomscope.train import FinetuneConfig, finetune
from geomscope.train import config as config_mod
from geomscope.train import loop as loop_mod
from geomscope.train import step as step_mod

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    return {
        "dir": d,
        "train": str(write_csv(d / "train.csv", synthetic_rows(32, 0))),
        "eval": str(write_csv(d / "dev.csv", synthetic_rows(8, 1))),
        # no dropout: micro-batches of B/N and one batch of B must see the same network
        "model": str(make_checkpoint(d / "m", words_of([]), dropout=0.0)),
    }


def _cfg(tiny, out, **kw):
    base = dict(
        model=tiny["model"],
        train=tiny["train"],
        eval=tiny["eval"],
        out=str(out),
        epochs=1,
        lr=2e-3,
        batch_size=8,
        device="cpu",
        lam=-1.0,
        c0_points=2000,
    )
    base.update(kw)
    return FinetuneConfig(**base)


def _run(tiny, out, **kw):
    return finetune(_cfg(tiny, out, **kw))


def _steps(out):
    return [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]


def _no_seconds(recs):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in recs]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _cli_args(tiny, out, *extra):
    return [
        "finetune",
        tiny["model"],
        "--train",
        tiny["train"],
        "--eval",
        tiny["eval"],
        "--out",
        out,
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--lr",
        "2e-3",
        "--c0-points",
        "2000",
        "--device",
        "cpu",
        "--quiet",
        *extra,
    ]


class _Stop(Exception):
    pass


def _interrupt_after_first_epoch(monkeypatch):
    real = loop_mod._Trainer._end_epoch

    def end_epoch(self, epoch, progress):
        ev = real(self, epoch, progress)
        if epoch == 0:
            raise _Stop
        return ev

    monkeypatch.setattr(loop_mod._Trainer, "_end_epoch", end_epoch)


def _stopped_after_first_epoch(tiny, out, monkeypatch, **kw):
    """``out``: a run of ``kw`` stopped at the end of its first epoch (its checkpoint written)."""
    with monkeypatch.context() as mp:
        _interrupt_after_first_epoch(mp)
        with pytest.raises(_Stop):
            _run(tiny, out, **kw)
    return out


# -- defaults -------------------------------------------------------------------------------------


def test_the_defaults_an_older_run_implies_are_the_declared_defaults():
    """NEW_DEFAULTS says what a run.json without the key means; it must be what the option
    declares, or a run resumed without the option would silently train differently."""
    from dataclasses import fields

    declared = {f.name: f.default for f in fields(config_mod.FinetuneConfig)}
    for name, implied in config_mod.NEW_DEFAULTS.items():
        assert name in declared, f"NEW_DEFAULTS names {name!r}, which FinetuneConfig does not declare"
        assert declared[name] == implied, (
            f"--{name.replace('_', '-')}: declared {declared[name]!r}, implied {implied!r}"
        )


def test_the_library_reads_task_reg_and_device_in_any_case_as_the_cli_does():
    """`finetune --task QA --reg ISTAR --device CPU` runs qa, istar on cpu; so does the config."""
    from geomscope.study import grid

    cfg = FinetuneConfig(
        model="m", train="t.csv", eval="e.csv", out="o", task=" QA", reg="ISTAR", device="CPU"
    )
    cfg.validate()
    assert (cfg.task, cfg.reg, cfg.device) == ("qa", "istar", "cpu")
    assert [p.name for p in grid(["ISTAR", "istar", "CosReg"], [0.0], [0])] == [
        "istar_lambda0_seed0",
        "cosreg_lambda0_seed0",
    ]


def test_defaults_passed_explicitly_change_nothing(cli, tiny, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    code, _, err = cli(_cli_args(tiny, a))
    assert code == 0, err
    explicit = ("--scheduler", "constant", "--warmup", "0", "--grad-accum", "1", "--report-to", "none")
    code, _, err = cli(_cli_args(tiny, b, *explicit, "--lora-target", "q,v"))
    assert code == 0, err
    assert _no_seconds(_steps(a)) == _no_seconds(_steps(b))
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    run = json.loads((a / "run.json").read_text())
    for k in config_mod.NEW_DEFAULTS:  # at their defaults: absent, as in a run.json without them
        assert k not in run["config"]
    assert not {"lr_schedule", "accumulation", "lora_adapters"} & set(run)
    state = json.loads((a / "checkpoint" / "state.json").read_text())
    assert (
        not set(config_mod.NEW_DEFAULTS) & set(state["fingerprint"]) and "epochs" not in state["fingerprint"]
    )
    trainer = json.loads((a / "checkpoint" / "trainer.json").read_text())
    assert "scheduler" not in trainer
    groups = trainer["optimizer"]["param_groups"]  # torch's AdamW default, as before the options
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.01


# -- learning-rate schedule and weight decay -------------------------------------------------------


def _reference_lrs(name, lr, warmup_steps, total):
    from transformers import get_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup_steps, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(
    "scheduler,warmup,name,warmup_steps",
    [
        ("linear", 0.25, "linear", 2),
        ("cosine", 0.0, "cosine", 0),
        ("constant", 0.3, "constant_with_warmup", 3),
    ],
)
def test_lr_in_steps_follows_transformers_schedule(tiny, tmp_path, scheduler, warmup, name, warmup_steps):
    out = tmp_path / "s"
    s = _run(tiny, out, reg="none", epochs=2, scheduler=scheduler, warmup=warmup)
    steps = _steps(out)
    assert len(steps) == 8 == s["steps"]
    ref = _reference_lrs(name, 2e-3, warmup_steps, 8)
    assert [r["lr"] for r in steps] == pytest.approx(ref, rel=1e-12, abs=0)
    if warmup_steps:
        assert steps[0]["lr"] == 0.0 and steps[warmup_steps]["lr"] == pytest.approx(2e-3)
    run = json.loads((out / "run.json").read_text())
    assert run["config"].get("scheduler", "constant") == scheduler
    assert run["config"].get("warmup", 0.0) == warmup
    assert run["lr_schedule"] == {"scheduler": scheduler, "warmup_steps": warmup_steps, "total_steps": 8}


def test_weight_decay_groups_skip_biases_and_layernorm(tiny):
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(tiny["model"], num_labels=2)
    decay, no_decay = step_mod.optimizer_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    dc = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(n.endswith("bias") or "LayerNorm" in n for n in nd)
    assert not any(n.endswith("bias") or "LayerNorm" in n for n in dc)
    assert "bert.embeddings.LayerNorm.weight" in nd and "classifier.weight" in dc
    assert len(nd) + len(dc) == len(names)
    assert step_mod.optimizer_groups(m, None) == list(m.parameters())


def test_resume_mid_run_with_schedule_and_weight_decay_equals_uninterrupted(tiny, tmp_path, monkeypatch):
    kw = dict(epochs=2, scheduler="linear", warmup=0.25, weight_decay=0.1)
    full = _run(tiny, tmp_path / "full", **kw)
    part = _stopped_after_first_epoch(tiny, tmp_path / "part", monkeypatch, **kw)
    trainer = json.loads((part / "checkpoint" / "trainer.json").read_text())
    assert trainer["scheduler"]["last_epoch"] == 4
    assert [g["weight_decay"] for g in trainer["optimizer"]["param_groups"]] == [0.1, 0.0]
    fp = json.loads((part / "checkpoint" / "state.json").read_text())["fingerprint"]
    assert fp["scheduler"] == "linear" and fp["weight_decay"] == 0.1 and fp["epochs"] == 2
    with pytest.raises(InputError, match="trained with epochs=2, not 3"):
        _run(tiny, part, resume=True, **{**kw, "epochs": 3})
    with pytest.raises(InputError, match="trained with scheduler='linear', not 'constant'"):
        _run(tiny, part, resume=True, **{**kw, "scheduler": "constant"})
    res = _run(tiny, part, resume=True, **kw)
    assert res["resumed"] and res["steps"] == full["steps"] == 8
    a, b = _steps(tmp_path / "full"), _steps(part)
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
    for k in ("accuracy", "isoscore_star", "eval_loss"):
        assert res["final"][k] == pytest.approx(full["final"][k], abs=1e-6)


# -- gradient accumulation ------------------------------------------------------------------------


def test_split_micro_batches():
    assert step_mod.split_micro(list(range(8)), 1, 1) == [list(range(8))]
    assert step_mod.split_micro(list(range(8)), 3, 1) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert step_mod.split_micro(list(range(5)), 4, 2) == [[0, 1, 2], [3, 4]]  # each >= world


def test_grad_accum_gives_the_update_of_the_whole_batch(tiny, tmp_path):
    one = _run(tiny, tmp_path / "one", reg="none", batch_size=8)
    acc = _run(tiny, tmp_path / "acc", reg="none", batch_size=4, grad_accum=2)
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "acc")
    assert len(a) == len(b) == 4 and one["steps"] == acc["steps"]
    for ra, rb in zip(a, b, strict=True):
        assert rb["examples"] == ra["examples"] == 8
        assert rb["task_loss"] == pytest.approx(ra["task_loss"], abs=1e-5)
    wa, wb = _weights(tmp_path / "one"), _weights(tmp_path / "acc")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    run = json.loads((tmp_path / "acc" / "run.json").read_text())
    assert run["config"]["grad_accum"] == 2 and run["accumulation"]["examples_per_step"] == 8


def test_grad_accum_with_istar_averages_micro_batch_penalties(tiny, tmp_path, monkeypatch):
    import geomscope.train.regularizers as regs

    seen = []
    real = regs.IStar.__call__

    def spy(self, hs, mask):
        pen, iso = real(self, hs, mask)
        seen.append((hs[0].shape[0], float(pen.detach())))
        return pen, iso

    monkeypatch.setattr(regs.IStar, "__call__", spy)
    _run(tiny, tmp_path / "i", batch_size=4, grad_accum=2)
    steps = _steps(tmp_path / "i")
    assert len(steps) == 4 and len(seen) == 8 and all(n == 4 for n, _ in seen)
    for i, r in enumerate(steps):
        pens = [p for _, p in seen[2 * i : 2 * i + 2]]
        assert r["penalty"] == pytest.approx(sum(pens) / 2, abs=1e-12)
        assert r["weighted_penalty"] == pytest.approx(-1.0 * r["penalty"])


# -- LoRA -----------------------------------------------------------------------------------------

peft_missing = importlib.util.find_spec("peft") is None


@pytest.mark.skipif(peft_missing, reason="needs peft (geomscope[lora])")
def test_lora_trains_only_adapters_and_exports_a_merged_model(cli, tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from geomscope.train import lora

    base = AutoModelForSequenceClassification.from_pretrained(tiny["model"], num_labels=2)
    targets = lora.resolve_targets(base, ["q", "v"])
    assert targets == ["query", "value"]
    m = lora.wrap(base, 4, 8.0, targets)
    trainable = lora.trainable_names(m)
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("classifier" in n for n in trainable)  # the new head trains too
    n_train = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert n_train < 0.2 * sum(p.numel() for p in m.parameters())

    out = tmp_path / "lora"
    s = _run(tiny, out, lora=4, reg="istar")
    assert s["lora_adapters"]["targets"] == ["query", "value"] and s["lora"] == 4 and s["lora_alpha"] == 8.0
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert all(r["penalty"] is not None for r in _steps(out))
    # the merged export: frozen weights exactly as loaded, adapted ones moved, no peft names left
    orig = AutoModelForSequenceClassification.from_pretrained(tiny["model"], num_labels=2).state_dict()
    merged = _weights(out)
    assert not any("lora" in k for k in merged)
    for k, v in merged.items():
        if k.startswith("classifier."):
            continue
        if ".query.weight" in k or ".value.weight" in k:
            assert not torch.equal(v, orig[k]), k
        else:
            assert torch.equal(v, orig[k]), k
    code, _, err = cli(
        [
            "extract",
            out,
            tiny["eval"],
            "--text-column",
            "sentence",
            "--out",
            tmp_path / "ext",
            "--device",
            "cpu",
        ]
        + ["--quiet"]
    )
    assert code == 0, err
    assert json.loads((tmp_path / "ext" / "manifest.json").read_text())


@pytest.mark.skipif(peft_missing, reason="needs peft (geomscope[lora])")
def test_lora_resume_equals_uninterrupted(tiny, tmp_path, monkeypatch):
    kw = dict(epochs=2, lora=4, lora_target="query,value,key")
    full = _run(tiny, tmp_path / "full", **kw)
    part = _stopped_after_first_epoch(tiny, tmp_path / "part", monkeypatch, **kw)
    assert (part / "checkpoint" / "adapter_model.safetensors").exists()
    with pytest.raises(InputError, match="trained with lora=4, not 8"):
        _run(tiny, part, resume=True, **{**kw, "lora": 8})
    res = _run(tiny, part, resume=True, **kw)
    a, b = _steps(tmp_path / "full"), _steps(part)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
    assert res["final"]["accuracy"] == pytest.approx(full["final"]["accuracy"], abs=1e-6)
    wa, wb = _weights(tmp_path / "full"), _weights(part)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-6


# -- trackers -------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_tensorboard_events_hold_the_step_and_eval_scalars(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    _run(tiny, out, report_to="tensorboard", scheduler="linear")
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/task_loss", "train/penalty", "train/isoscore_star", "train/lr"} <= tags
    assert {"eval/accuracy", "eval/isoscore_star"} <= tags
    steps = _steps(out)
    got = acc.Scalars("train/loss")
    assert [e.step for e in got] == [r["step"] for r in steps]
    assert [e.value for e in got] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([r["lr"] for r in steps], rel=1e-6)
    ev = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    (e,) = acc.Scalars("eval/accuracy")
    assert e.step == ev["step"] and e.value == pytest.approx(ev["accuracy"])


# -- one-line errors through the CLI ---------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,needle",
    [
        (("--grad-accum", "0"), "--grad-accum"),
        (("--warmup", "1.5"), "--warmup"),
        (("--weight-decay", "-1"), "--weight-decay"),
        (("--scheduler", "exponential"), "--scheduler"),
        (("--report-to", "comet"), "--report-to"),
        (("--lora-alpha", "4"), "need --lora"),
        (("--lora", "0"), "--lora"),
        (("--lora", "4", "--save-every", "2"), "--save-every"),
        (
            ("--lora", "4", "--lora-target", ","),
            "--lora-target must be a comma list of module names, not ','",
        ),
        (("--max-grad-norm", "0"), "--max-grad-norm"),
        (("--max-grad-norm", "nan"), "--max-grad-norm"),
    ],
)
def test_bad_values_are_one_line_errors(cli, tiny, tmp_path, extra, needle):
    out = tmp_path / "bad"
    code, stdout, err = cli(_cli_args(tiny, out, *extra))
    assert_one_line_error(code, stdout, err, needle)
    assert not out.exists()


@pytest.mark.skipif(peft_missing, reason="needs peft (geomscope[lora])")
def test_lora_target_matching_nothing_names_modules(cli, tiny, tmp_path):
    code, stdout, err = cli(_cli_args(tiny, tmp_path / "bad", "--lora", "4", "--lora-target", "q,nope"))
    line = assert_one_line_error(code, stdout, err, "--lora-target 'nope'", "modules there:")
    assert "query" in line and "value" in line


def test_missing_packages_are_one_line_errors(cli, tiny, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("peft", "wandb", "mlflow") else real(name, *a),
    )
    code, stdout, err = cli(_cli_args(tiny, tmp_path / "a", "--lora", "4"))
    assert_one_line_error(code, stdout, err, "pip install 'geomscope[lora]'")
    for tracker in ("wandb", "mlflow"):
        code, stdout, err = cli(_cli_args(tiny, tmp_path / "b", "--report-to", tracker))
        assert_one_line_error(code, stdout, err, f"needs the {tracker} package")


# -- two processes ---------------------------------------------------------------------------------


def _ddp_worker(rank, tmp, cfg):
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    finetune(FinetuneConfig(**cfg))
    dist.destroy_process_group()


@pytest.mark.skipif(peft_missing, reason="needs peft (geomscope[lora])")
def test_two_processes_with_grad_accum_lora_and_tensorboard_match_one(tiny, tmp_path):
    """DDP (2 x batch 2, 2 micro-batches) equals one process (batch 4, 2 micro-batches): the same
    micro-batches, the I-STAR covariance of each pooled over the ranks; only rank 0 logs."""
    import torch.multiprocessing as mp

    cfg = dict(
        model=tiny["model"],
        train=tiny["train"],
        eval=tiny["eval"],
        out=str(tmp_path / "ddp"),
        epochs=1,
        lr=2e-3,
        batch_size=2,
        grad_accum=2,
        lora=4,
        scheduler="linear",
        report_to="tensorboard",
        device="cpu",
        lam=-1.0,
        c0_points=10**6,
    )
    mp.spawn(_ddp_worker, args=(str(tmp_path), cfg), nprocs=2, join=True)
    single = finetune(
        FinetuneConfig(**{**cfg, "out": str(tmp_path / "one"), "batch_size": 4, "report_to": "none"})
    )
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["global_batch"] == 8 and ddp["steps"] == single["steps"] == 4
    for a, b in zip(_steps(tmp_path / "ddp"), _steps(tmp_path / "one"), strict=True):
        assert a["lr"] == b["lr"]
        for k in ("task_loss", "penalty", "isoscore_star"):
            assert abs(a[k] - b[k]) < 1e-4, (k, a, b)
    assert abs(ddp["final"]["accuracy"] - single["final"]["accuracy"]) < 1e-6
    assert len(list((tmp_path / "ddp" / "tensorboard").glob("events.out.tfevents.*"))) == 1
