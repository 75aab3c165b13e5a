"""``geomscope finetune --log-geometry``: per-layer gradient energy in the layer's own top-r
activation subspace, with matched-rank normal controls, while training; equal to ``score --basis`` on
the same rows of a checkpoint saved mid-training."""

from __future__ import annotations

import json
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.train import FinetuneConfig, finetune

torch.set_num_threads(1)

RANKS = (4, 16)  # the tiny model's D is 32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three 1-epoch runs of 6 steps: I-STAR and none with --log-geometry 1, none without."""
    d = tmp_path_factory.mktemp("geom")
    data = {
        "dir": d,
        "train": str(write_csv(d / "train.csv", synthetic_rows(48, 0))),
        "eval": str(write_csv(d / "dev.csv", synthetic_rows(16, 1))),
        "model": str(make_checkpoint(d / "m", words_of([]))),
    }

    def run(name, **kw):
        base = dict(
            model=data["model"],
            train=data["train"],
            eval=data["eval"],
            out=str(d / name),
            epochs=1,
            lr=2e-3,
            batch_size=8,
            device="cpu",
            lam=-1.0,
        )
        cfg = FinetuneConfig(**{**base, **kw})
        return cfg, finetune(cfg)

    data["istar"] = run("istar", reg="istar", log_geometry=1, geometry_rank=RANKS, save_every=100)
    data["none_geo"] = run("none_geo", reg="none", log_geometry=1, geometry_rank=RANKS)
    data["none"] = run("none", reg="none")
    return data


def _steps(out):
    return [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]


def test_every_step_has_geometry_for_each_layer_and_rank(runs):
    for key in ("istar", "none_geo"):
        cfg, summary = runs[key]
        out = runs["dir"] / key
        steps = _steps(out)
        assert len(steps) == summary["steps"] == 6
        meta = json.loads((out / "run.json").read_text())
        assert meta["config"]["log_geometry"] == 1 and meta["config"]["geometry_rank"] == list(RANKS)
        geo_meta = meta["geometry"]
        assert geo_meta["layers"] == ["layer_01", "layer_02"] and geo_meta["dim"] == 32
        assert "own activation covariance" in geo_meta["subspace"]
        assert geo_meta["controls"] == 20 and geo_meta["control_seed"] == cfg.seed
        assert geo_meta["isoscore_target"] == ("C0" if key == "istar" else "trace-matched identity")
        for rec in steps:
            assert set(rec["geometry"]) == {"layer_01", "layer_02"} and rec["geometry_seconds"] >= 0
            for layer in rec["geometry"].values():
                assert 0 <= layer["isoscore_star"] <= 1 and layer["tokens"] > 32
                for r in RANKS:
                    e, m = layer["energy"][str(r)], layer["energy_max"][str(r)]
                    assert 0 <= e <= m + 1e-12 <= 1 + 1e-12
                    assert layer["baseline"][str(r)] == r / 32
                    kappa = layer["kappa"][str(r)]
                    assert kappa is None or kappa == pytest.approx((e - r / 32) / (m - r / 32))
                    mean, p = layer["control_energy_mean"][str(r)], layer["p_value"][str(r)]
                    assert 0 < mean < 1 and layer["control_energy_sd"][str(r)] > 0
                    assert p in {k / 21 for k in range(1, 22)}
                    assert layer["energy_ratio"][str(r)] == pytest.approx(e / mean)
    assert all("geometry" not in r for r in _steps(runs["dir"] / "none"))
    assert "geometry" not in json.loads((runs["dir"] / "none" / "run.json").read_text())


def _energy_by_definition(S, C, r: int, controls: int, seed: int) -> dict:
    """E, E_max and the normal controls of rank r straight from their definitions in numpy: U_r the
    top-r eigenvectors of C, control k from ``default_rng([seed, r])``'s k-th Gaussian (D, r) draw
    with U_r projected out, orthonormalised (docs/metrics.md)."""
    D = S.shape[0]
    U = np.linalg.eigh(C)[1][:, ::-1][:, :r]
    tr = np.trace(S)
    e = np.trace(U.T @ S @ U) / tr
    e_max = np.sort(np.linalg.eigvalsh(S))[::-1][:r].sum() / tr
    rng = np.random.default_rng([seed, r])
    ek = []
    for _ in range(controls):
        g = rng.standard_normal((D, r))
        g -= U @ (U.T @ g)
        g -= U @ (U.T @ g)
        q = np.linalg.qr(g)[0]
        ek.append(np.trace(q.T @ S @ q) / tr)
    ek = np.array(ek)
    return {
        "energy": e,
        "energy_max": e_max,
        "kappa": (e - r / D) / (e_max - r / D),
        "control_energy_mean": ek.mean(),
        "control_energy_sd": ek.std(ddof=1),
        "p_value": (1 + np.sum(ek >= e)) / (controls + 1),
    }


def test_step_one_energy_matches_an_independent_recomputation(runs):
    """Step 1 redone from the step-0 snapshot: autograd of the task loss w.r.t. each hidden state,
    S from the real tokens' gradients, each layer's own covariance of the same tokens, and E, E_max,
    kappa and the 20 controls from their definitions in numpy."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from geomscope import distributed as dd
    from geomscope.metrics.isotropy import isoscore_star_from_cov
    from geomscope.train.data import Encoded, epoch_order, global_batches, load_table
    from geomscope.train.evaluate import compute_c0

    cfg, _ = runs["istar"]
    out = runs["dir"] / "istar"
    snap = out / "checkpoints" / "step0"
    model = AutoModelForSequenceClassification.from_pretrained(snap)
    tok = AutoTokenizer.from_pretrained(snap)
    label2id = json.loads((out / "label_map.json").read_text())["label2id"]
    enc = Encoded(tok, load_table(cfg.train), label2id, cfg.max_length)
    order = epoch_order(len(enc), cfg.seed, 0)
    gb = global_batches(order, cfg.batch_size, 1)[0]
    batch = enc.collate(gb)
    torch.manual_seed(cfg.seed)  # the trainer's dropout stream (rank 0) at its first step
    model.train()
    o = model(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True)
    task = torch.nn.functional.cross_entropy(o.logits.float(), batch["labels"], reduction="sum") / len(gb)
    step1 = _steps(out)[0]
    # the same forward as the trainer's first step
    assert step1["task_loss"] == pytest.approx(float(task.detach()), abs=1e-6)
    keep = batch["attention_mask"].bool()
    d = dd.Dist(0, 1, 0, torch.device("cpu"))
    C0, _ = compute_c0(model, enc, order, [1, 2], cfg.c0_points, cfg.batch_size, d, nullcontext)
    none_step1 = _steps(runs["dir"] / "none_geo")[0]["geometry"]
    for i, name in zip([1, 2], ("layer_01", "layer_02"), strict=True):
        (g,) = torch.autograd.grad(task, o.hidden_states[i], retain_graph=True)
        G = g[keep].double().numpy()
        X = o.hidden_states[i][keep].detach().double().numpy()
        logged = step1["geometry"][name]
        assert logged["tokens"] == len(X)
        for r in RANKS:
            ref = _energy_by_definition(G.T @ G, np.cov(X.T), r, 20, cfg.seed)
            for key, want in ref.items():
                assert logged[key][str(r)] == pytest.approx(want, rel=1e-6, abs=1e-9), (name, r, key)
        # the batch IsoScore* of the layer's tokens against the penalty's C0 (I-STAR); the run
        # without a regulariser took the same first step and shrinks towards the trace
        iso = isoscore_star_from_cov(np.cov(X.T), cfg.zeta, C0.numpy())
        assert logged["isoscore_star"] == pytest.approx(iso, abs=1e-6)
        trace = isoscore_star_from_cov(np.cov(X.T), cfg.zeta, "trace")
        assert none_step1[name]["isoscore_star"] == pytest.approx(trace, abs=1e-6)


def test_logging_geometry_leaves_training_bitwise_unchanged(runs):
    from safetensors.torch import load_file

    a, b = _steps(runs["dir"] / "none_geo"), _steps(runs["dir"] / "none")
    for ra, rb in zip(a, b, strict=True):
        for k in ("loss", "task_loss", "isoscore_star"):
            assert ra[k] == rb[k]
    wa = load_file(str(runs["dir"] / "none_geo" / "model.safetensors"))
    wb = load_file(str(runs["dir"] / "none" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_geometry_options_are_one_line_errors(cli, runs, tmp_path):
    base = [
        "finetune",
        runs["model"],
        "--train",
        runs["train"],
        "--eval",
        runs["eval"],
        "--epochs",
        "1",
        "--device",
        "cpu",
    ]
    for extra, needle in (
        (["--log-geometry", "1"], "--geometry-rank 32 is not below the model's hidden size D = 32"),
        (["--log-geometry", "1", "--geometry-rank", "8,40"], "--geometry-rank 40 is not below"),
        (["--log-geometry", "0"], "--log-geometry must be a positive whole number"),
        (["--log-geometry", "2", "--geometry-rank", "8,x"], "comma list of whole numbers"),
        (["--log-geometry", "2", "--geometry-rank", "0"], "--geometry-rank must be a comma list"),
        (["--geometry-controls", "5"], "--geometry-controls sets the controls of --log-geometry"),
        (["--log-geometry", "2", "--geometry-controls", "-1"], "--geometry-controls must be"),
    ):
        out = tmp_path / "o"
        assert_one_line_error(*cli([*base, "--out", out, *extra]), needle, exit_code=2)
        assert not out.exists() or not any(out.iterdir())


def test_training_plot_draws_the_geometry_panels(runs, tmp_path, cli):
    from geomscope.plot.training import plot_training_log

    fig = plot_training_log(runs["dir"] / "none_geo", tmp_path / "geo.png")
    assert (tmp_path / "geo.png").read_bytes().startswith(b"\x89PNG")
    axes = fig.get_axes()
    assert len(axes) == 6
    ax_e, ax_i = axes[4], axes[5]
    assert "gradient energy" in ax_e.get_title() and "IsoScore* per layer" in ax_i.get_title()
    labels = [ln.get_label() for ln in ax_e.get_lines()]
    assert {"layer_01, r=16", "layer_02, r=16"} <= set(labels)
    dashed = [ln for ln in ax_e.get_lines() if ln.get_linestyle() == "--"]
    assert [float(ln.get_ydata()[0]) for ln in dashed] == [16 / 32]
    dotted = [ln for ln in ax_e.get_lines() if ln.get_linestyle() == ":"]
    assert [ln.get_label() for ln in dotted][:1] == ["mean of the normal controls (dotted)"]
    logged = [
        r["geometry"]["layer_01"]["control_energy_mean"]["16"] for r in _steps(runs["dir"] / "none_geo")
    ]
    assert len(dotted) == 2 and list(dotted[0].get_ydata()) == logged
    assert {ln.get_label() for ln in ax_i.get_lines()} == {"layer_01", "layer_02"}
    # a log without geometry keeps the four panels; overlaying both works through the CLI
    assert len(plot_training_log(runs["dir"] / "none").get_axes()) == 4
    code, _, err = cli(
        [
            "plot",
            runs["dir"] / "istar",
            runs["dir"] / "none",
            "--kind",
            "training",
            "--out",
            tmp_path / "t.png",
        ]
    )
    assert code == 0, err
    assert (tmp_path / "t.png").is_file()


# -- the eval IsoScore* against each shrinkage target -------------------------------------------

STAR_KEYS = ("isoscore_star_trace", "isoscore_star_c0")


def _iso(M):
    """IsoScore of a covariance from its definition: (tr(M)^2 / ||M||_F^2 - 1) / (D - 1)."""
    return (np.trace(M) ** 2 / np.sum(M * M) - 1) / (M.shape[0] - 1)


def _stars_by_definition(rows_by_layer: dict, zeta: float, C0) -> dict:
    """The eval record's four IsoScore* entries, straight from their definitions in numpy."""
    D = next(iter(rows_by_layer.values())).shape[1]
    c0 = (C0 + C0.T) / 2
    covs = {name: np.cov(X.T, ddof=1) for name, X in rows_by_layer.items()}
    covs["pooled"] = np.cov(np.vstack(list(rows_by_layer.values())).T, ddof=1)
    trace = {k: _iso((1 - zeta) * C + zeta * np.trace(C) / D * np.eye(D)) for k, C in covs.items()}
    to_c0 = {k: _iso((1 - zeta) * C + zeta * c0) for k, C in covs.items()}
    out = {}
    for key, values in zip(STAR_KEYS, (trace, to_c0), strict=True):
        out[f"{key}_pooled"] = values.pop("pooled")
        out[f"{key}_per_layer"] = values
    return out


def _assert_stars_match(rec: dict, ref: dict, rel: float) -> None:
    for key in STAR_KEYS:
        assert rec[f"{key}_pooled"] == pytest.approx(ref[f"{key}_pooled"], rel=rel, abs=0)
        assert rec[f"{key}_per_layer"].keys() == ref[f"{key}_per_layer"].keys()
        for layer, v in ref[f"{key}_per_layer"].items():
            assert rec[f"{key}_per_layer"][layer] == pytest.approx(v, rel=rel, abs=0)


def _synthetic_batches(D=6, seed=0):
    """Two float64 batches of 3 hidden-state layers with padding: (hidden states, attention mask)."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.3, 3.0, D)
    batches = []
    for B, T in ((3, 5), (2, 7)):
        hs = tuple(torch.from_numpy(rng.normal(size=(B, T, D)) * scale * (i + 1) + 2.0) for i in range(3))
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T - 2 :] = 0  # padding in every batch
        batches.append((hs, mask))
    return batches


def test_eval_isoscore_star_against_each_target_matches_its_definition():
    """float64 hidden states through EvalGeometry against numpy from the definitions (to 1e-8 relative,
    far above float64's rounding of a few hundred products); the trace variant also against the isoscore
    package (whose sqrt(D) constants are float32, hence 1e-5); the C0 variant of one batch against the
    I-STAR penalty's own IsoScore* of that batch (1 - penalty)."""
    from types import SimpleNamespace

    from IsoScore import IsoScore as isoscore_pkg

    from geomscope import distributed as dd
    from geomscope.train.evaluate import EvalGeometry
    from geomscope.train.regularizers import IStar

    layers, zeta, D = [1, 2], 0.3, 6
    rng = np.random.default_rng(1)
    A = rng.normal(size=(40, D)) * np.linspace(2.0, 0.5, D)
    C0 = np.cov(A.T) + np.triu(np.full((D, D), 0.05), 1)  # an asymmetric part only the symmetric counts
    d = dd.Dist(0, 1, 0, torch.device("cpu"))
    batches = _synthetic_batches(D)
    geo = EvalGeometry(D, layers, torch.device("cpu"))
    for hs, mask in batches:
        geo.update(SimpleNamespace(hidden_states=hs), mask)
    rec = geo.finish(d, zeta, C0=torch.from_numpy(C0))
    real = {str(i): np.vstack([hs[i][mask.bool()].numpy() for hs, mask in batches]) for i in layers}
    _assert_stars_match(rec, _stars_by_definition(real, zeta, C0), rel=1e-8)
    assert rec["isoscore_star"] == rec["isoscore_star_trace_pooled"]
    pooled = np.vstack(list(real.values()))
    trace_target = torch.eye(D, dtype=torch.float64) * np.trace(np.cov(pooled.T)) / D
    pkg = float(isoscore_pkg.IsoScore_star(pooled, trace_target, zeta))
    assert rec["isoscore_star_trace_pooled"] == pytest.approx(pkg, abs=1e-5)

    hs, mask = batches[0]
    one = EvalGeometry(D, layers, torch.device("cpu"))
    one.update(SimpleNamespace(hidden_states=hs), mask)
    _, penalty_iso = IStar(layers, zeta, torch.from_numpy(C0))(hs, mask)
    got = one.finish(d, zeta, C0=C0)["isoscore_star_c0_pooled"]
    assert got == pytest.approx(float(penalty_iso), rel=1e-8, abs=0)
    # without a C0 the C0 variant is null, per layer too; the trace variant is unchanged
    none = geo.finish(d, zeta)
    assert none["isoscore_star_c0_pooled"] is None and set(none["isoscore_star_c0_per_layer"].values()) == {
        None
    }
    assert none["isoscore_star_trace_pooled"] == rec["isoscore_star_trace_pooled"]


def test_finetune_eval_records_both_targets_from_the_penalty_c0(tmp_path, monkeypatch):
    """A tiny I-STAR run: the eval record's four values recomputed in numpy from the eval tokens the
    trainer saw and the C0 its penalty was given (the one compute_c0 returned this epoch)."""
    from geomscope.train import evaluate as ev_mod

    seen: dict = {"rows": [], "c0": []}
    real_update, real_finish, real_c0 = (
        ev_mod.EvalGeometry.update,
        ev_mod.EvalGeometry.finish,
        ev_mod.compute_c0,
    )

    def update(self, out, mask):
        keep = mask.bool()
        seen["rows"].append({str(i): out.hidden_states[i][keep].double().numpy().copy() for i in self.layers})
        return real_update(self, out, mask)

    def finish(self, d, zeta, reduced=None, C0=None):
        seen["eval_c0"] = C0
        return real_finish(self, d, zeta, reduced, C0)

    def compute_c0(*a, **kw):
        C0, n = real_c0(*a, **kw)
        seen["c0"].append(C0)
        return C0, n

    monkeypatch.setattr(ev_mod.EvalGeometry, "update", update)
    monkeypatch.setattr(ev_mod.EvalGeometry, "finish", finish)
    monkeypatch.setattr(ev_mod, "compute_c0", compute_c0)
    train = write_csv(tmp_path / "train.csv", synthetic_rows(24, 0))
    dev = write_csv(tmp_path / "dev.csv", synthetic_rows(12, 1))
    model = make_checkpoint(tmp_path / "m", words_of([]))
    cfg = FinetuneConfig(
        model=str(model), train=str(train), eval=str(dev), out=str(tmp_path / "o"), epochs=1, lr=2e-3,
        batch_size=8, device="cpu", reg="istar", lam=-1.0, zeta=0.4,
    )  # fmt: skip
    summary = finetune(cfg)
    rec = summary["final"]
    assert len(seen["c0"]) == 1 and seen["eval_c0"] is seen["c0"][0]
    rows = {k: np.vstack([b[k] for b in seen["rows"]]) for k in ("1", "2")}
    _assert_stars_match(rec, _stars_by_definition(rows, 0.4, seen["c0"][0].numpy()), rel=1e-8)
    assert rec["isoscore_star"] == rec["isoscore_star_trace_pooled"]
    assert abs(rec["isoscore_star_c0_pooled"] - rec["isoscore_star_trace_pooled"]) > 1e-3


def test_eval_records_name_each_target_in_every_run(runs):
    """Every eval record holds both variants; the C0 one where the run computed a C0 (I-STAR), null
    otherwise (--log-geometry needs none); ``isoscore_star`` (what compare reads) is the trace one."""
    for key, has_c0 in (("istar", True), ("none_geo", False), ("none", False)):
        for rec in (json.loads(ln) for ln in (runs["dir"] / key / "eval.jsonl").read_text().splitlines()):
            assert rec["isoscore_star"] == rec["isoscore_star_trace_pooled"]
            for k in STAR_KEYS:
                assert set(rec[f"{k}_per_layer"]) == {"1", "2"}
            values = [rec["isoscore_star_c0_pooled"], *rec["isoscore_star_c0_per_layer"].values()]
            assert all((v is not None and 0 <= v <= 1) if has_c0 else v is None for v in values)


def test_training_plot_names_each_isoscore_target(runs):
    """The I-STAR run's batch and eval IsoScore* are both the penalty's (C0 target); the other runs'
    are trace-target, and their labels say so."""
    from geomscope.plot.training import plot_training_log

    fig = plot_training_log([runs["dir"] / "istar", runs["dir"] / "none"])
    labels = {ln.get_label() for ln in fig.get_axes()[2].get_lines()}
    assert {
        "istar (istar, λ=-1): batch, C0 target",
        "istar (istar, λ=-1): eval, C0 target",
        "none (none): batch, trace target",
        "none (none): eval, trace target",
    } == labels
    ev = json.loads((runs["dir"] / "istar" / "eval.jsonl").read_text().splitlines()[-1])
    (marks,) = [
        ln for ln in fig.get_axes()[2].get_lines() if ln.get_label() == "istar (istar, λ=-1): eval, C0 target"
    ]
    assert list(marks.get_ydata()) == [ev["isoscore_star_c0_pooled"]]


# -- the same numbers as score --basis ------------------------------------------------------------


def test_logged_geometry_equals_score_basis_on_a_mid_training_checkpoint(tmp_path, cli):
    """A causal LM logs its geometry every step and keeps its weights every 2 steps: step 3 ran on
    the weights of checkpoints/step2. ``extract --capture activations,gradients`` of those weights on
    step 3's documents, then ``score --basis`` of that run with the same ranks, controls and seed,
    give every penalised layer's logged energy, E_max, kappa and controls to 1e-5 relative: float32
    forwards of other batch shapes and a loss of another scale may round apart. The documents have
    one length, so extract's loss (the sum of each document's mean token loss) is the step's token
    mean times a constant, which no energy sees. The last hidden state of this decoder is its final
    norm's output: extract's ``final_norm``."""
    import random

    from helpers_models import WORDS, make_tiny_model

    from geomscope.train.data import epoch_order, global_batches

    rng = random.Random(0)
    vocab = [w for w in WORDS if w.isalpha()]
    docs = [" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(12)]
    train = tmp_path / "train.txt"
    train.write_text("\n".join(docs) + "\n")
    out = tmp_path / "ft"
    cfg = FinetuneConfig(
        model=str(make_tiny_model("gpt_neox", tmp_path)), train=str(train), eval=str(train), out=str(out),
        task="causal-lm", lm_batching="pad", epochs=1, batch_size=4, lr=5e-3, device="cpu", lam=-1.0,
        log_geometry=1, save_every=2, geometry_rank=(2, 8), geometry_controls=7, seed=3,
    )  # fmt: skip
    finetune(cfg)
    step3 = _steps(out)[2]
    assert step3["step"] == 3 and (out / "checkpoints" / "step2").is_dir()
    third = global_batches(epoch_order(len(docs), cfg.seed, 0), cfg.batch_size, 1)[2]
    rows = tmp_path / "rows.txt"
    rows.write_text("\n".join(docs[i] for i in third) + "\n")
    run, rep = tmp_path / "run", tmp_path / "rep"
    code, _, err = cli(
        ["extract", out / "checkpoints" / "step2", rows, "--capture", "activations,gradients"]
        + ["--loss", "causal-lm", "--layers", "1,final_norm", "--out", run, "--quiet"]
    )
    assert code == 0, err
    code, _, err = cli(
        ["score", run, "--basis", run, "--rank", "2,8", "--controls", "7", "--seed", "3"]
        + ["--metrics", "isoscore", "--out", rep, "--quiet"]
    )
    assert code == 0, err
    scored = json.loads((tmp_path / "rep.json").read_text())["gradient_energy"]["layers"]
    keys = ("energy", "energy_max", "kappa", "control_energy_mean", "control_energy_sd", "p_value")
    for logged_name, scored_name in (("layer_01", "layer_01.grad"), ("layer_02", "final_norm.grad")):
        logged = step3["geometry"][logged_name]
        assert logged["tokens"] == 4 * 12 and [row["rank"] for row in scored[scored_name]] == [2, 8]
        for row in scored[scored_name]:
            r = str(row["rank"])
            for key in (*keys, "energy_ratio", "baseline"):
                assert logged[key][r] == pytest.approx(row[key], rel=1e-5, abs=1e-12), (logged_name, r, key)
            assert row["controls"] == 7 and row["control_energy_mean"] is not None


def test_check_ranks_reads_ranks_by_the_declared_rule():
    """A library call's ranks meet --geometry-rank's declaration, in its words; then each is below D."""
    from geomscope.errors import InputError
    from geomscope.train.geometry import check_ranks

    assert check_ranks("8,2,8", 16) == (8, 2)
    assert check_ranks([4, "2,4"]) == (4, 2)
    for bad in ("0", [0], "8,x", [True], ""):
        with pytest.raises(InputError) as e:
            check_ranks(bad, 16)
        named = " ('x' is not one)" if bad == "8,x" else ""  # a list of several words names its bad one
        assert (
            str(e.value)
            == f"--geometry-rank must be a comma list of whole numbers >= 1 (e.g. 8,32), not {bad!r}{named}"
        )
    with pytest.raises(InputError, match="--geometry-rank 16 is not below the model's hidden size D = 16"):
        check_ranks("8,16", 16)
