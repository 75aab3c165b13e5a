"""The multi-process path on the CPU: two processes, gloo, torch.multiprocessing.spawn.

Checks that (1) the I-STAR and CosReg penalties of a DDP-wrapped module equal the single-process
penalties of the same global batch, with the same parameter gradients after DDP's averaging;
(2) C0 is bitwise identical on every rank and equals the single-process C0; (3) a whole 2-process
fine-tuning run (per-process batch b) reproduces the single-process run with batch 2b.
"""

from __future__ import annotations

import json
import os

import torch
import torch.multiprocessing as mp
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.train import FinetuneConfig, finetune
from geomscope.train.regularizers import CosReg, IStar

torch.set_num_threads(1)
WORLD = 2


def _global_batch(seed=0, B=8, T=6, D=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).double()
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        mask[b, 2 + b % 4 :] = 0  # ragged lengths
    lin = torch.nn.Linear(D, D).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=g))
        lin.bias.copy_(torch.randn(D, generator=g) + 3.0)
    C0 = torch.cov(torch.randn(50, D, generator=g).T).double()
    return x, mask, lin, C0


def _penalties(lin, x, mask, C0, group=None):
    h = lin(x)
    hs = (x, h, 2 * h + h**2)
    pen, _ = IStar([1, 2], 0.3, C0, group=group)(hs, mask)
    cos = CosReg(-1, group=group)(hs, mask)
    return pen, cos


# (penalty: 0 I-STAR / 1 CosReg, each rank's loss weighted rank + 1, rank 1 without real tokens).
# Weighted: each rank's backward sums the upstream gradients of all ranks (1 + 2), and DDP averages
# over 2, so the parameter gradient is that of 1.5 x the penalty in one process.
CASES = [
    (0, False, False),
    (1, False, False),
    (0, True, False),
    (1, True, False),
    (0, False, True),
    (1, False, True),
]


def _case_mask(mask, empty_rank1: bool):
    m = mask.clone()
    if empty_rank1:
        m[4:] = 0  # rank 1's rows of the global batch: all padding
    return m


def _worker(rank, tmp, payload):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=WORLD)
    from geomscope import distributed as dd

    d = dd.setup("cpu")
    x, mask, lin, C0 = _global_batch()
    lo, hi = rank * 4, rank * 4 + 4  # rank's rows of the global batch of 8
    model = torch.nn.parallel.DistributedDataParallel(lin)
    res = {}
    for case, (which, weighted, empty_rank1) in enumerate(CASES):
        m = _case_mask(mask, empty_rank1)
        val = _penalties(model, x[lo:hi], m[lo:hi], C0, d.reg_group)[which]
        (val * (rank + 1 if weighted else 1)).backward()
        res[f"val{case}"] = float(val.detach())
        res[f"grad{case}"] = [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
    # C0 over a tiny model
    from geomscope.model.classifier import load_classifier
    from geomscope.train.data import Encoded, load_table
    from geomscope.train.evaluate import compute_c0

    t = load_table(payload["train"])
    m, tok, _ = load_classifier(payload["model"], {"negative": 0, "positive": 1}, lambda s: None)
    enc = Encoded(tok, t, {"negative": 0, "positive": 1}, 64)
    res["C0"], res["C0_n"] = compute_c0(m, enc, list(range(len(enc))), [1, 2], 10**6, 5, d, _null, False)
    torch.save(res, f"{tmp}/rank{rank}.pt")
    # a whole fine-tuning run on two processes
    finetune(FinetuneConfig(**payload["cfg"]))
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _steps(out):
    return [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]


def test_two_processes_match_one(tmp_path):
    train = write_csv(tmp_path / "train.csv", synthetic_rows(36, 0))
    dev = write_csv(tmp_path / "dev.csv", synthetic_rows(12, 1))
    model = str(make_checkpoint(tmp_path / "m", words_of([]), dropout=0.0))
    cfg = dict(
        model=model,
        train=str(train),
        eval=str(dev),
        out=str(tmp_path / "ddp"),
        epochs=2,
        lr=2e-3,
        batch_size=4,
        device="cpu",
        lam=-1.0,
        c0_points=10**6,
    )
    mp.spawn(
        _worker,
        args=(str(tmp_path), {"cfg": cfg, "train": str(train), "model": model}),
        nprocs=WORLD,
        join=True,
    )
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(WORLD)]

    # (1) penalties and DDP-averaged gradients equal the single-process ones of the global batch
    x, mask, lin, C0 = _global_batch()
    for case, (which, weighted, empty_rank1) in enumerate(CASES):
        val = _penalties(lin, x, _case_mask(mask, empty_rank1), C0)[which]
        (val * (1.5 if weighted else 1)).backward()
        for rk in r:
            assert abs(rk[f"val{case}"] - float(val.detach())) < 1e-12, case
            for g_ddp, p in zip(rk[f"grad{case}"], lin.parameters(), strict=True):
                assert torch.allclose(g_ddp, p.grad, atol=1e-10, rtol=1e-9), case
        lin.zero_grad()

    # (2) C0: bitwise identical on the ranks, equal to the one-process C0 of all examples
    assert torch.equal(r[0]["C0"], r[1]["C0"]) and r[0]["C0_n"] == r[1]["C0_n"]
    from geomscope import distributed as dd
    from geomscope.model.classifier import load_classifier
    from geomscope.train.data import Encoded, load_table
    from geomscope.train.evaluate import compute_c0

    m, tok, _ = load_classifier(model, {"negative": 0, "positive": 1}, lambda s: None)
    enc = Encoded(tok, load_table(train), {"negative": 0, "positive": 1}, 64)
    C0_1, n1 = compute_c0(m, enc, list(range(len(enc))), [1, 2], 10**6, 5, dd.setup("cpu"), _null, False)
    # (float32 forward passes over differently padded batches agree to ~1e-7, not bitwise)
    assert n1 == r[0]["C0_n"] and torch.allclose(C0_1, r[0]["C0"], rtol=1e-5, atol=1e-7)

    # (3) the 2-process run equals one process with the doubled batch (no dropout)
    single = finetune(FinetuneConfig(**{**cfg, "out": str(tmp_path / "one"), "batch_size": 8}))
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["global_batch"] == 8 and ddp["steps"] == single["steps"]
    for a, b in zip(_steps(tmp_path / "ddp"), _steps(tmp_path / "one"), strict=True):
        for k in ("task_loss", "penalty", "isoscore_star"):
            assert abs(a[k] - b[k]) < 1e-4, (k, a, b)
    for k in ("accuracy", "isoscore_star", "isoscore_star_c0_pooled", "avgcos", "eval_loss"):
        assert abs(ddp["final"][k] - single["final"][k]) < 1e-4, k
    for k in ("isoscore_star_trace_per_layer", "isoscore_star_c0_per_layer"):  # merged over the ranks
        assert ddp["final"][k].keys() == single["final"][k].keys() == {"1", "2"}
        assert all(abs(ddp["final"][k][i] - single["final"][k][i]) < 1e-4 for i in ("1", "2")), k
