"""``score GRADRUN --basis ACTRUN``: the report's gradient_energy equals the subspace arithmetic on
the stored rows (S = sum g g^T of the gradient rows, C = covariance of the activation rows), the
CLI prints it, and runs that cannot serve it get one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, make_tiny_head_model, make_tiny_model

from geomscope.errors import InputError
from geomscope.extract.run import extract
from geomscope.metrics.subspace import gradient_energy
from geomscope.score import ScoreOptions, score
from geomscope.store import Run, iter_shard


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("energy")
    txt = d / "t.txt"
    txt.write_text("\n".join(SAMPLE_TEXTS * 6) + "\n")
    model = make_tiny_head_model("gpt2", "causal-lm", d)
    both = d / "both"
    extract(str(model), [str(txt)], both, device="cpu", capture="activations,gradients", shard_docs=20)
    acts = d / "acts"
    extract(str(model), [str(txt)], acts, device="cpu", layers="1,2")
    other = d / "other"
    extract(str(make_tiny_model("gpt2", d, name="other-gpt2", seed=5)), [str(txt)], other, device="cpu")
    wide = d / "wide"
    extract(str(make_tiny_model("gpt2", d, name="wide-gpt2", n_embd=48)), [str(txt)], wide, device="cpu")
    return {"both": both, "acts": acts, "other": other, "wide": wide, "text": txt, "model": model, "dir": d}


def _rows(run_dir, name):
    r = Run(run_dir)
    return np.concatenate(
        [ch.layers[name] for s in r.shards for ch in iter_shard(r.shard_path(s), [name])]
    ).astype(np.float64)


def test_report_equals_the_arithmetic_on_the_stored_rows(runs):
    opts = ScoreOptions(metrics=("isoscore",), basis=str(runs["both"]), ranks=(2, 8), controls=7, seed=3)
    rep = score(runs["both"], opts)
    ge = rep["gradient_energy"]
    assert ge["pairs"]["layer_01.grad"] == "layer_01" and ge["ranks"] == [2, 8] and ge["controls"] == 7
    assert set(ge["layers"]) == {n for n in Run(runs["both"]).layer_names if n.endswith(".grad")}
    for grad_layer, act_layer in ge["pairs"].items():
        g = _rows(runs["both"], grad_layer)
        a = _rows(runs["both"], act_layer)
        want = gradient_energy(g.T @ g, g.mean(axis=0), np.cov(a.T), (2, 8), controls=7, seed=3, zeta=0.2)
        for got, ref in zip(ge["layers"][grad_layer], want, strict=True):
            for key, v in ref.items():
                if isinstance(v, float):
                    assert got[key] == pytest.approx(v, rel=1e-9, abs=1e-12), (grad_layer, key)
                else:
                    assert got[key] == v, (grad_layer, key)
    # the gradient layers are scored like any other layer: their IsoScore is in the table
    by = {e["layer"]: e for e in rep["layers"]}
    assert 0 < by["layer_01.grad"]["isoscore"] < 1


def test_energy_se_is_the_jackknife_over_document_groups(runs):
    """energy_se: delete-one-group jackknife of E over doc_id % G, U_r of the full basis held fixed."""
    from geomscope.metrics.subspace import top_eigenvectors

    G = 5
    rep = score(
        runs["both"],
        ScoreOptions(
            metrics=("isoscore",),
            basis=str(runs["both"]),
            ranks=(2, 8),
            controls=0,
            jackknife_groups=G,
            layers=("layer_01.grad",),
        ),
    )
    got = [r["energy_se"] for r in rep["gradient_energy"]["layers"]["layer_01.grad"]]
    r = Run(runs["both"])
    doc = np.concatenate(
        [ch.doc_id for s in r.shards for ch in iter_shard(r.shard_path(s), ["layer_01.grad"])]
    )
    g = _rows(runs["both"], "layer_01.grad")
    U = top_eigenvectors(np.cov(_rows(runs["both"], "layer_01").T), 8)
    reps = []
    for k in range(G):
        keep = g[doc % G != k]
        S = keep.T @ keep
        reps.append([np.trace(U[:, :rk].T @ S @ U[:, :rk]) / np.trace(S) for rk in (2, 8)])
    reps = np.array(reps)
    want = np.sqrt((G - 1) / G * ((reps - reps.mean(axis=0)) ** 2).sum(axis=0))
    np.testing.assert_allclose(got, want, rtol=1e-8)
    assert all(0 < x < 0.2 for x in got)


def test_basis_from_another_run_of_the_same_checkpoint(runs):
    """A separate activation run of the same checkpoint serves as basis; layers it lacks are refused."""
    opts = ScoreOptions(
        metrics=("isoscore",), basis=str(runs["acts"]), ranks=(4,), controls=3, layers=("1.grad",)
    )
    with pytest.raises(InputError, match="resolve|not in this run"):
        score(runs["both"], opts)  # "1.grad" is not a layer name: names only
    ok = score(
        runs["both"],
        ScoreOptions(
            metrics=("isoscore",),
            basis=str(runs["acts"]),
            ranks=(4,),
            controls=3,
            layers=("layer_01.grad", "layer_02.grad"),
        ),
    )
    assert set(ok["gradient_energy"]["layers"]) == {"layer_01.grad", "layer_02.grad"}
    with pytest.raises(InputError, match="no activation layer layer_00"):
        score(runs["both"], ScoreOptions(metrics=("isoscore",), basis=str(runs["acts"]), ranks=(4,)))


@pytest.mark.parametrize(
    "case,needle",
    [
        ("activations given", "holds no gradient layers"),
        ("other model", "other weights"),
        ("other width", "has hidden size D = 48, the gradients D = 32"),
        ("rank too big", "--rank 32 is not below the hidden size D = 32"),
        ("not a run", "is not a run directory"),
    ],
)
def test_basis_refusals(runs, tmp_path, cli, case, needle):
    src, basis, rank = runs["both"], runs["both"], "4"
    if case == "activations given":
        src = runs["acts"]
    elif case == "other model":
        basis = runs["other"]
    elif case == "other width":
        basis = runs["wide"]
    elif case == "rank too big":
        rank = "4,32"
    else:
        basis = tmp_path / "x.npy"
        np.save(basis, np.zeros((4, 32)))
    code, out, err = cli(["score", src, "--basis", basis, "--rank", rank, "--out", tmp_path / "r", "-q"])
    assert needle in assert_one_line_error(code, out, err, exit_code=2)
    assert not (tmp_path / "r.json").exists()


def test_cli_prints_and_writes_the_section(runs, tmp_path, cli):
    code, out, err = cli(
        [
            "score",
            runs["both"],
            "--metrics",
            "isoscore",
            "--basis",
            runs["both"],
            "--rank",
            "2,4",
            "--controls",
            "4",
            "--out",
            tmp_path / "r",
        ]
    )
    assert code == 0, err
    assert "gradient energy in the top-r activation subspace" in err and "layer_02.grad r=4: E" in err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["gradient_energy"]["ranks"] == [2, 4]
    assert rep["command"].endswith("--out " + str(tmp_path / "r"))
    code, out, err = cli(["score", runs["both"], "--basis", runs["both"], "--rank", "two", "-q"])
    assert "--rank" in assert_one_line_error(code, out, err, exit_code=2)
