"""Library tests of geomscope.train: penalties, data, batching, loop, resume, NaN handling, the effect."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_train import SAMPLE, make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope import distributed as dd
from geomscope.errors import DataError, GeomscopeError, InputError
from geomscope.layers import parse_layers
from geomscope.metrics.isotropy import isoscore_star_torch
from geomscope.train import FinetuneConfig, finetune
from geomscope.train.data import (
    build_label_map,
    check_eval_labels,
    epoch_order,
    global_batches,
    load_table,
    rank_slice,
)
from geomscope.train.regularizers import CosReg, IStar, batch_covariance, select_tokens

torch.set_num_threads(1)  # 2 shared cores: OpenMP spinning under contention is 100x slower


def _hidden(seed=0, B=3, T=5, D=6, L=3, scale=None):
    g = torch.Generator().manual_seed(seed)
    hs = tuple((torch.randn(B, T, D, generator=g) * (1 + i)).double().requires_grad_() for i in range(L))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return hs, mask


# -- penalties ----------------------------------------------------------------------------------


def test_istar_equals_isoscore_star_of_union_of_real_tokens():
    hs, mask = _hidden()
    keep = mask.bool()
    C0 = torch.cov(torch.randn(40, 6, generator=torch.Generator().manual_seed(3)).T).double()
    for c0 in (None, C0):
        X = torch.cat([hs[1][keep], hs[2][keep]])  # layers 1, 2; padding dropped
        pen, iso = IStar([1, 2], 0.3, c0)(hs, mask)
        ref = isoscore_star_torch(X, 0.3, c0)
        assert torch.allclose(iso, ref, atol=1e-12, rtol=0)
        assert torch.allclose(pen, 1 - ref, atol=1e-12, rtol=0)
        g1 = torch.autograd.grad(pen, hs[1], retain_graph=True)[0]
        g_ref = torch.autograd.grad(1 - ref, hs[1])[0]
        assert torch.allclose(g1, g_ref, atol=1e-12)
        assert g1[~keep].abs().max() == 0  # padding receives no gradient


def test_istar_matches_the_official_isoscore_package():
    from IsoScore import IsoScore as official

    hs, mask = _hidden(D=5, B=6, T=7)
    X = select_tokens(hs, [0, 1, 2], mask).detach()
    C0 = torch.cov(torch.randn(60, 5, generator=torch.Generator().manual_seed(4)).T).double()
    iso0 = IStar([0, 1, 2], 0.0)(hs, mask)[1].detach()
    assert abs(float(iso0) - float(official.IsoScore(X.numpy()))) < 1e-6
    iso = IStar([0, 1, 2], 0.2, C0)(hs, mask)[1].detach()
    assert abs(float(iso) - float(official.IsoScore_star(X.numpy(), C0, 0.2))) < 1e-6


def test_padding_is_excluded_unless_asked():
    hs, mask = _hidden()
    poisoned = tuple(torch.where(mask.bool()[..., None], h, torch.full_like(h, 1e3)) for h in hs)
    a = IStar([1, 2], 0.2)(hs, mask)[1].detach()
    b = IStar([1, 2], 0.2)(poisoned, mask)[1].detach()
    c = IStar([1, 2], 0.2, include_padding=True)(poisoned, mask)[1].detach()
    assert torch.allclose(a, b, atol=1e-12) and abs(float(a - c)) > 1e-3


def test_cosreg_equals_mean_pairwise_cosine_over_n_squared():
    hs, mask = _hidden()
    R = CosReg(-1)(hs, mask)
    X = hs[-1][mask.bool()]
    U = X / X.norm(dim=1, keepdim=True)
    G = U @ U.T
    n = X.shape[0]
    assert torch.allclose(R, (G.sum() - G.diagonal().sum()) / n**2, atol=1e-12)


@pytest.mark.parametrize("padding", ["excluded", "included", "none"])
def test_cosreg_closed_form_gradient_equals_autograd(padding):
    """R's own backward, dx = (v - (u.v) u) / |x| with v = 2 s / N^2, against autograd through the
    definition, to rounding; plus finite differences; padding rows get no gradient."""
    hs, mask = _hidden(seed=4, B=4, T=5, D=6)
    hs = tuple((h + torch.linspace(-1, 2, 6)).detach().requires_grad_() for h in hs)  # a common direction
    if padding == "none":
        mask = torch.ones_like(mask)
    inc = padding == "included"
    R = CosReg(-1, include_padding=inc)(hs, mask)
    X = select_tokens(hs, [2], mask, inc)
    U = X / X.norm(dim=1, keepdim=True)
    n = X.shape[0]
    ref = (U.sum(0).dot(U.sum(0)) - n) / n**2
    assert R.dtype == torch.float64 and float(R.detach()) == pytest.approx(float(ref.detach()), rel=1e-13)
    (g,) = torch.autograd.grad(R, hs[2])
    (w,) = torch.autograd.grad(ref, hs[2])
    torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13 * float(w.abs().max()))
    if padding == "excluded":
        assert float(g[~mask.bool()].abs().max()) == 0.0
    assert torch.autograd.gradcheck(lambda h: CosReg(0, include_padding=inc)((h,), mask), (hs[2],))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cosreg_on_low_precision_layers_with_a_zero_row(dtype):
    """The gradient comes back in the layer's dtype, as autograd's does; a zero row (no direction)
    counts in N with x^ = 0 and gets no gradient, nor does padding."""
    hs, mask = _hidden(seed=6)
    h = (hs[2].detach() + 1).to(dtype)
    h[1, 0] = 0  # a real token
    h.requires_grad_()
    R = CosReg(0)((h,), mask)
    X = select_tokens((h,), [0], mask)
    norms = X.norm(dim=1, keepdim=True)
    U = torch.where(norms > 0, X / norms.clamp_min(1e-300), torch.zeros_like(X))
    n = X.shape[0]
    ref = (U.sum(0).dot(U.sum(0)) - n) / n**2
    assert float(R.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    (g,) = torch.autograd.grad(R, h)
    (w,) = torch.autograd.grad(ref, h)
    assert g.dtype == w.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * float(w.abs().max()))
    assert float(g[1, 0].abs().max()) == 0.0 and float(g[~mask.bool()].abs().max()) == 0.0


def test_scatter_backward_and_fp32_penalty():
    from geomscope.train.regularizers import _Scatter

    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_Scatter.apply, (x,))
    hs, mask = _hidden(B=8, T=9, D=6)
    p64 = IStar([1, 2], 0.2)(hs, mask)[0]
    g64 = torch.autograd.grad(p64, hs[1])[0]
    p32 = IStar([1, 2], 0.2, dtype=torch.float32)(hs, mask)[0]
    g32 = torch.autograd.grad(p32, hs[1])[0]
    assert p32.dtype == torch.float64 and abs(float((p32 - p64).detach())) < 1e-5
    assert torch.allclose(g32, g64, atol=1e-5 * float(g64.abs().max()))


def _istar_by_autograd(hs, mask, layers, zeta, c0, include_padding=False):
    """The penalty built from autograd's pieces: rows, covariance, IsoScore* of the covariance."""
    from geomscope.metrics.isotropy import isoscore_star_from_cov_torch

    X = select_tokens(hs, layers, mask, include_padding)
    return 1 - isoscore_star_from_cov_torch(batch_covariance(X), zeta, c0)


@pytest.mark.parametrize("zeta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("target", ["trace", "c0"])
@pytest.mark.parametrize("padding", ["excluded", "included", "none"])
def test_istar_closed_form_gradient_equals_autograd(zeta, target, padding):
    """The penalty's own backward (dX = 2 Xc (a I + b C + c C0) / (n - 1)) against autograd through
    the definition, to rounding: every layer's gradient, padding rows included (zero when excluded)."""
    hs, mask = _hidden(seed=5, B=4, T=6, D=5, L=3)
    hs = tuple(
        (h * torch.linspace(0.5, 3, 5) + 2.0).detach().requires_grad_() for h in hs
    )  # anisotropic, off-centre
    if padding == "none":
        mask = torch.ones_like(mask)
    c0 = (
        None
        if target == "trace"
        else torch.cov(torch.randn(30, 5, generator=torch.Generator().manual_seed(1)).T).double()
    )
    reg = IStar([0, 2], zeta, c0, include_padding=padding == "included")
    pen, iso = reg(hs, mask)
    ref = _istar_by_autograd(hs, mask, [0, 2], zeta, c0, padding == "included")
    assert pen.dtype == iso.dtype == torch.float64
    assert float(pen.detach()) == pytest.approx(float(ref.detach()), rel=1e-13, abs=1e-15)
    got = torch.autograd.grad(pen, hs, allow_unused=True)
    want = torch.autograd.grad(ref, hs, allow_unused=True)
    assert got[1] is None and want[1] is None  # layer 1 is not chosen
    for g, w in zip((got[0], got[2]), (want[0], want[2]), strict=True):
        scale = float(w.abs().max())
        if zeta == 1.0:  # the score no longer depends on the rows
            assert scale < 1e-12 and float(g.abs().max()) < 1e-12
            continue
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12 * scale)
        if padding == "excluded":
            assert float(g[~mask.bool()].abs().max()) == 0.0


def test_istar_gradcheck_by_finite_differences():
    hs, mask = _hidden(seed=2, B=3, T=4, D=4, L=2)
    c0 = torch.eye(4, dtype=torch.float64) * 2 + 0.1
    for reg in (IStar([0, 1], 0.25), IStar([1], 0.4, c0)):
        assert torch.autograd.gradcheck(lambda *h, reg=reg: reg(h, mask)[0], hs)


def test_penalties_cost_a_few_operations_whatever_the_number_of_layers():
    """On a GPU the penalty's cost in a short step is its operations (each queued by the host), so
    it must not do per-layer work beyond handing each layer its gradient; and the backward never
    waits for the device (no nonzero, no item)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "select", "detach", "squeeze", "unsqueeze", "permute", "expand", "diagonal", "alias"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def ops(L):
        hs, mask = _hidden(seed=1, B=3, T=5, D=6, L=L)
        reg = IStar(list(range(L)), 0.2)
        with Ops() as fwd:
            pen, _ = reg(hs, mask)
        with Ops() as bwd:
            torch.autograd.grad(pen, hs)
        return [n for n in fwd.names if n not in views], [n for n in bwd.names if n not in views]

    fwd2, bwd2 = ops(2)
    fwd7, bwd7 = ops(7)
    assert fwd2 == fwd7 and bwd2 == bwd7, (fwd2, fwd7, bwd2, bwd7)
    assert fwd7.count("nonzero") == 1 and len(fwd7) <= 20 and len(bwd7) <= 15
    assert not {"nonzero", "_local_scalar_dense", "item"} & set(bwd7)
    hs, mask = _hidden(seed=1)  # CosReg: the same few operations, no wait in its backward
    with Ops() as fwd:
        R = CosReg(-1)(hs, mask)
    with Ops() as bwd:
        torch.autograd.grad(R, hs[-1])
    fwd_c, bwd_c = ([n for n in o.names if n not in views] for o in (fwd, bwd))
    assert len(fwd_c) <= 12 and len(bwd_c) <= 10 and not {"nonzero", "_local_scalar_dense"} & set(bwd_c)


def test_istar_target_can_be_replaced_and_must_fit():
    hs, mask = _hidden()
    g = torch.Generator().manual_seed(7)
    c0a, c0b = (torch.cov(torch.randn(40, 6, generator=g).T).double() for _ in range(2))

    def iso(reg):
        return float(reg(hs, mask)[1].detach())

    reg = IStar([1, 2], 0.3, c0a)
    first = iso(reg)
    reg.C0 = c0b  # as the loop does each epoch
    assert iso(reg) == pytest.approx(iso(IStar([1, 2], 0.3, c0b)), rel=1e-14) and iso(reg) != first
    reg.C0 = None
    assert iso(reg) == pytest.approx(iso(IStar([1, 2], 0.3)), rel=1e-14)
    reg.C0 = torch.eye(5, dtype=torch.float64)
    with pytest.raises(DataError, match="C0 is"):
        reg(hs, mask)


def test_istar_takes_any_target_layout_and_layer_dtypes():
    """A non-contiguous or non-symmetric C0 (only its symmetric part counts), a C0 changed in place,
    and layers of different dtypes: value and gradients as by autograd through the definition."""
    hs, mask = _hidden(seed=3, B=3, T=5, D=4, L=3)
    g = torch.Generator().manual_seed(2)
    A = torch.randn(4, 4, generator=g, dtype=torch.float64)
    for c0 in (
        A.T @ A + torch.eye(4, dtype=torch.float64),
        (A @ A.T).T,
        A.abs() + 4 * torch.eye(4, dtype=torch.float64),
    ):
        pen = IStar([0, 2], 0.4, c0)(hs, mask)[0]
        ref = _istar_by_autograd(hs, mask, [0, 2], 0.4, (c0 + c0.T) / 2)  # its symmetric part
        for a, b in zip(
            torch.autograd.grad(pen, (hs[0], hs[2])), torch.autograd.grad(ref, (hs[0], hs[2])), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    reg = IStar([0, 2], 0.4, A.T @ A)
    reg(hs, mask)
    reg.C0.mul_(3).add_(torch.eye(4, dtype=torch.float64))  # in place, after a first use
    assert float(reg(hs, mask)[1].detach()) == pytest.approx(
        float(IStar([0, 2], 0.4, reg.C0.clone())(hs, mask)[1].detach()), rel=1e-14
    )
    mixed = (hs[0].float().detach().requires_grad_(), hs[1], hs[2])
    pen, ref = IStar([0, 2], 0.2)(mixed, mask)[0], _istar_by_autograd(mixed, mask, [0, 2], 0.2, None)
    for a, b in zip(
        torch.autograd.grad(pen, (mixed[0], mixed[2])),
        torch.autograd.grad(ref, (mixed[0], mixed[2])),
        strict=True,
    ):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6 if a.dtype == torch.float32 else 1e-10, atol=1e-12)


def test_istar_edge_cases_are_nan_or_one_line_errors():
    hs, mask = _hidden()
    one = torch.zeros_like(mask)
    one[0, 0] = 1  # a single real token: no covariance, a NaN penalty (the step skips it)
    pen = IStar([1], 0.2)(hs, one)[0]
    assert torch.isnan(pen)
    assert all(torch.isnan(g[0, 0]).all() for g in torch.autograd.grad(pen, hs[1:2]))
    with pytest.raises(DataError, match="at least 2 dimensions"):
        IStar([0], 0.2)((torch.ones(2, 3, 1, dtype=torch.float64),), None)
    with pytest.raises(InputError, match="zeta"):
        IStar([0], 0.2).zeta = 1.5


def test_istar_of_a_batch_without_variance_is_nan_not_an_error():
    """The step reads a non-finite penalty and skips the update; the penalty must not raise."""
    hs = tuple(torch.ones(2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, 3, dtype=torch.long)
    assert torch.isnan(IStar([0, 1], 0.2)(hs, mask)[0])
    # with a given C0 the shrunk covariance is zeta * C0 alone: isotropic here, so exactly 1
    assert float(IStar([0, 1], 0.2, torch.eye(4, dtype=torch.float64))(hs, mask)[1].detach()) == 1.0
    with torch.no_grad():
        assert torch.isnan(IStar([0, 1], 0.0)(hs, mask)[1])


def test_batch_covariance_is_stable_under_a_large_offset():
    X = torch.randn(500, 4, generator=torch.Generator().manual_seed(0)).double() + 1e7
    C = batch_covariance(X)
    assert np.allclose(C.numpy(), np.cov(X.numpy().T), rtol=1e-8, atol=1e-8)


# -- data and batching ---------------------------------------------------------------------------


def test_tables_in_every_format_agree(tmp_path):
    rows = synthetic_rows(12)
    a = load_table(write_csv(tmp_path / "d.csv", rows))
    b = load_table(write_csv(tmp_path / "d.tsv", rows, delimiter="\t"))
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"sentence": s, "label": y}) + "\n" for s, y in rows)
    )
    c = load_table(tmp_path / "d.jsonl")
    import datasets

    datasets.Dataset.from_dict(
        {"sentence": [r[0] for r in rows], "label": [r[1] for r in rows]}
    ).save_to_disk(str(tmp_path / "ds"))
    d = load_table(tmp_path / "ds")
    for t in (b, c, d):
        assert t.texts == a.texts and t.labels == a.labels
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"sentence": ["x"], "label": [0]})}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match="DatasetDict with splits train"):
        load_table(tmp_path / "dd")


def test_label_map_numeric_order_and_pairs(tmp_path):
    p = write_csv(
        tmp_path / "p.csv",
        [("q one", "a b", 10), ("q two", "c", 2), ("q3", "d", 2)],
        header=("question", "sentence", "label"),
    )
    t = load_table(p, "question", "label", "sentence")
    assert t.texts2 == ["a b", "c", "d"]
    assert build_label_map(t) == {"2": 0, "10": 1}


@pytest.mark.parametrize("case", ["missing", "single", "empty", "header_only", "unseen", "blank_label"])
def test_bad_data_is_one_line_error(tmp_path, case):
    rows = synthetic_rows(6)
    if case == "missing":
        with pytest.raises(InputError, match="no label column 'label'.*columns: sentence, y"):
            load_table(write_csv(tmp_path / "a.csv", rows, header=("sentence", "y")))
    elif case == "single":
        with pytest.raises(DataError, match="single class"):
            build_label_map(load_table(write_csv(tmp_path / "a.csv", [(s, "pos") for s, _ in rows])))
    elif case == "empty":
        (tmp_path / "a.csv").write_text("")
        with pytest.raises(InputError, match="is empty"):
            load_table(tmp_path / "a.csv")
    elif case == "header_only":
        with pytest.raises(InputError, match="has no rows"):
            load_table(write_csv(tmp_path / "a.csv", []))
    elif case == "unseen":
        lm = build_label_map(load_table(write_csv(tmp_path / "a.csv", rows)))
        ev = load_table(write_csv(tmp_path / "b.csv", rows + [("x", "neutral")]))
        with pytest.raises(InputError, match="not seen in training: 'neutral'"):
            check_eval_labels(ev, lm)
    else:
        with pytest.raises(InputError, match="row 2 has no 'label' label"):
            load_table(write_csv(tmp_path / "a.csv", [("a", "x"), ("b", "")]))


def test_global_batches_split_exactly_over_ranks():
    order = epoch_order(23, seed=1, epoch=2)
    assert sorted(order) == list(range(23)) and order == epoch_order(23, 1, 2) != epoch_order(23, 1, 3)
    for world in (1, 2, 3):
        gbs = global_batches(order, 4, world)
        for gb in gbs:
            parts = [rank_slice(gb, r, world) for r in range(world)]
            assert sum(parts, []) == gb and all(parts)
        assert sum(gbs, []) == order[: sum(len(g) for g in gbs)]
    assert global_batches(list(range(9)), 4, 2) == [list(range(8))]  # a 1-example tail cannot feed 2 ranks


def test_parse_layers():
    # finetune's default is every block (embedding output excluded); `all` includes it, as in extract
    assert parse_layers("blocks", 7) == [1, 2, 3, 4, 5, 6] and parse_layers("all", 7) == list(range(7))
    assert parse_layers("0,2-3,-1", 7) == [0, 2, 3, 6] and parse_layers("layer_02,layer_06", 7) == [2, 6]
    with pytest.raises(InputError):
        parse_layers("7", 7)


# -- the loop ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    train = write_csv(d / "train.csv", synthetic_rows(48, 0))
    dev = write_csv(d / "dev.csv", synthetic_rows(16, 1))
    return {
        "dir": d,
        "train": str(train),
        "eval": str(dev),
        "model": str(make_checkpoint(d / "m", words_of([]))),
    }


def _cfg(tiny, out, **kw):
    base = dict(
        model=tiny["model"],
        train=tiny["train"],
        eval=tiny["eval"],
        out=str(out),
        epochs=2,
        lr=2e-3,
        batch_size=8,
        device="cpu",
        lam=-1.0,
    )
    base.update(kw)
    return FinetuneConfig(**base)


def _steps(out):
    return [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]


def test_finetune_outputs_and_head_note(tiny, tmp_path):
    notes = []
    s = finetune(_cfg(tiny, tmp_path / "o"), log=notes.append)
    out = tmp_path / "o"
    assert any("no sequence-classification head" in n and "added" in n for n in notes)
    assert s["steps"] == 12 and s["head_added"] and s["layers"] == [1, 2]
    steps = _steps(out)
    assert [r["step"] for r in steps] == list(range(1, 13))
    for r in steps:
        assert abs(r["loss"] - (r["task_loss"] + r["weighted_penalty"])) < 1e-9
        assert abs(r["penalty"] - (1 - r["isoscore_star"])) < 1e-12 and r["lr"] == 2e-3
    ev = [json.loads(ln) for ln in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in ev] == [1, 2] and ev[-1] == s["final"]
    assert 0 <= ev[-1]["isoscore_star"] <= 1 and -1 <= ev[-1]["avgcos"] <= 1
    assert json.loads((out / "label_map.json").read_text())["label2id"] == {"negative": 0, "positive": 1}
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(out)
    assert m.config.id2label == {0: "negative", 1: "positive"}
    # a checkpoint that has a matching head is used silently; a different label count is replaced loudly
    notes.clear()
    finetune(_cfg(tiny, tmp_path / "o2", model=str(out), epochs=1, reg="none"), log=notes.append)
    assert notes == []
    three = write_csv(tmp_path / "three.csv", synthetic_rows(12) + [("so so film", "mixed")] * 4)
    finetune(
        _cfg(tiny, tmp_path / "o3", model=str(out), train=str(three), eval=str(three), epochs=1),
        log=notes.append,
    )
    assert any("replaced it" in n for n in notes)


def test_resume_reproduces_an_uninterrupted_run(tiny, tmp_path):
    full = finetune(_cfg(tiny, tmp_path / "full", epochs=2))
    finetune(_cfg(tiny, tmp_path / "part", epochs=1))
    (tmp_path / "part" / "summary.json").unlink()
    with pytest.raises(InputError, match="already holds a finetune run"):
        finetune(_cfg(tiny, tmp_path / "part", epochs=2))
    with pytest.raises(InputError, match="trained with lr=0.002, not 0.001"):
        finetune(_cfg(tiny, tmp_path / "part", epochs=2, lr=1e-3, resume=True))
    res = finetune(_cfg(tiny, tmp_path / "part", epochs=2, resume=True))
    assert res["resumed"] and res["steps"] == full["steps"]
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
    for k in ("accuracy", "isoscore_star", "avgcos", "eval_loss"):
        assert res["final"][k] == pytest.approx(full["final"][k], abs=1e-6)
    with pytest.raises(InputError, match="nothing to resume"):
        finetune(_cfg(tiny, tmp_path / "fresh", resume=True))


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tiny, tmp_path, monkeypatch):
    import geomscope.train.regularizers as regs

    real = regs.IStar.__call__
    calls = {"n": 0}

    def flaky(self, hs, mask):
        calls["n"] += 1
        pen, iso = real(self, hs, mask)
        return (pen * float("nan"), iso) if calls["n"] == 9 else (pen, iso)

    monkeypatch.setattr(regs.IStar, "__call__", flaky)
    out = tmp_path / "nan"
    with pytest.raises(DataError, match=r"NaN/inf at step 9 \(epoch 2\).*last good checkpoint \(epoch 1\)"):
        finetune(_cfg(tiny, out))
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["epochs_done"] == 1 and state["global_step"] == 6
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()
    before = {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir() if p.is_file()}
    monkeypatch.setattr(regs.IStar, "__call__", real)
    s = finetune(_cfg(tiny, out, resume=True))  # the kept checkpoint resumes
    assert s["steps"] == 12 and [r["step"] for r in _steps(out)] == list(range(1, 13))
    assert before["state.json"] != (out / "checkpoint" / "state.json").read_bytes()


def test_bad_options_are_input_errors(tiny, tmp_path):
    for kw, msg in (
        (dict(precision="fp16"), "fp16 needs a CUDA GPU"),
        (dict(reg="l2"), "--reg must be one of"),
        (dict(zeta=1.5), "--zeta must be a number in"),
        (dict(layers="9"), "layer 9 is out of range"),
        (dict(model=str(tmp_path / "nope")), "does not exist"),
    ):
        with pytest.raises(GeomscopeError, match=msg):
            finetune(_cfg(tiny, tmp_path / "x", **kw))


def test_bf16_autocast_on_cpu_runs(tiny, tmp_path):
    s = finetune(_cfg(tiny, tmp_path / "bf", epochs=1, precision="bf16"))
    assert s["precision"] == "bf16" and 0 <= s["final"]["isoscore_star"] <= 1
    assert all(np.isfinite(r["penalty"]) for r in _steps(tmp_path / "bf"))


# -- the effect is real ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    return str(
        make_checkpoint(
            d / "m", words_of([SAMPLE / "train.csv", SAMPLE / "dev.csv"]), hidden=32, layers=2, seed=0
        )
    )


def _sample_run(model, out, **kw):
    cfg = FinetuneConfig(
        model=model,
        train=str(SAMPLE / "train.csv"),
        eval=str(SAMPLE / "dev.csv"),
        out=str(out),
        epochs=3,
        lr=2e-3,
        batch_size=32,
        device="cpu",
        seed=0,
        **kw,
    )
    return finetune(cfg)["final"]


def test_istar_sign_moves_eval_isoscore(sample_model, tmp_path):
    lo = _sample_run(sample_model, tmp_path / "neg", reg="istar", lam=-1.0)
    hi = _sample_run(sample_model, tmp_path / "pos", reg="istar", lam=1.0)
    assert hi["isoscore_star"] - lo["isoscore_star"] > 0.2, (lo["isoscore_star"], hi["isoscore_star"])


def test_cosreg_lowers_last_layer_avg_cosine(sample_model, tmp_path):
    base = _sample_run(sample_model, tmp_path / "none", reg="cosreg", lam=0.0)
    reg = _sample_run(sample_model, tmp_path / "cos", reg="cosreg", lam=5.0)
    b, r = base["avgcos_last_layer"], reg["avgcos_last_layer"]
    assert b - r > 0.05 and r < 0.5 * b, (b, r)


def test_single_process_dist_helpers_are_identities():
    d = dd.setup("cpu")
    assert (d.rank, d.world_size, d.active) == (0, 1, False)
    t = torch.arange(3.0)
    assert dd.all_reduce_sum(t, d) is t and dd.gather_objects(5, d) == [5]


def test_finetune_library_resolves_model_aliases():
    """`bundled:minilm` works in the library as in the CLI; the user's name is recorded."""
    from geomscope.train.loop import FinetuneConfig, _resolve_model_alias

    cfg = _resolve_model_alias(FinetuneConfig(model="bundled:minilm", train="t.csv", eval="e.csv", out="o"))
    assert Path(cfg.model).is_dir() and (Path(cfg.model) / "config.json").exists()
    assert cfg.extra["model_arg"] == "bundled:minilm" and cfg.extra["model_info"]["source"] == "bundled"
    assert _resolve_model_alias(cfg) is cfg


def test_the_test_builders_make_a_usable_checkpoint_and_rows(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    ck = make_checkpoint(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(ck)
    ids = tok("the film was good")["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == 6
    assert AutoModel.from_pretrained(ck).config.hidden_size == 32
    assert len(synthetic_rows(10)) == 10
