"""score --metrics rogue: each dimension's share of the average cosine (Timkey & van Schijndel 2021)
against E[u_d v_d] / E[cos] over every distinct pair of unit rows, computed here pair by pair, on a
synthetic run and on the bundled MiniLM; the jackknife SEs directly; the --keep sample run."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_runs import jackknife_se, minilm_run, run_rows
from test_score import make_run

from geomscope.errors import DataError
from geomscope.metrics.cosine import rogue_shares
from geomscope.report import load_report, save_report, to_csv
from geomscope.score import ScoreOptions, score


def pair_shares(x):
    """Each dimension's E[u_d v_d] over distinct pairs of unit rows, over the mean cosine of those pairs."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    n = len(u)
    off = ~np.eye(n, dtype=bool)
    cc = np.array([np.outer(u[:, d], u[:, d])[off].mean() for d in range(u.shape[1])])
    cos = (u @ u.T)[off].mean()
    return cc / cos


def standardised_avgcos(x):
    """The mean cosine of the z-scored rows; a constant dimension (its spread within 1e3 eps of its
    mean's size, the rule docs/metrics.md gives) is 0 after centring."""
    mean, std = x.mean(0), x.std(0, ddof=1)
    constant = std <= 1e3 * np.finfo(np.float64).eps * np.abs(mean)
    z = np.where(constant, 0.0, (x - mean) / np.where(constant, 1.0, std))
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    g = u @ u.T
    return (g.sum() - len(u)) / (len(u) * (len(u) - 1))


def reference(x):
    shares = pair_shares(x)
    top = np.sort(shares)[::-1]
    return {
        "rogue_top1_share": top[0],
        "rogue_top3_share": top[:3].sum(),
        "avgcos_standardised": standardised_avgcos(x),
        "shares": shares,
    }


def test_shares_sum_to_one_and_match_pairs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6)) + np.array([0, 0, 4.0, 0, 1, 0])
    from geomscope.metrics import Moments

    m = Moments.from_rows(x)
    shares, total = rogue_shares(m.sum_unit, m.n_unit(), m.sum_unit_sq)
    np.testing.assert_allclose(shares, pair_shares(x), rtol=1e-10)
    assert shares.sum() == pytest.approx(1.0) and np.argmax(shares) == 2
    with pytest.raises(DataError, match="average cosine is 0"):
        rogue_shares(np.array([1.0, 1.0, 0.0]), 2, np.array([1.0, 1.0, 0.0]))  # two orthogonal rows


def test_synthetic_run_values_and_ses(tmp_path):
    data = make_run(tmp_path / "run", n_shards=2, rows=200)
    rep = score(tmp_path / "run", ScoreOptions(metrics="rogue", jackknife_groups=4))
    groups = data["doc"] % 4
    for e in rep["layers"]:
        x = data["X"][e["layer"]]
        ref = reference(x)
        reps = [reference(x[groups != r]) for r in range(4)]
        for key in ("rogue_top1_share", "rogue_top3_share", "avgcos_standardised"):
            assert e[key] == pytest.approx(ref[key], rel=1e-9), key
            assert e["se"][key] == pytest.approx(jackknife_se([r[key] for r in reps]), rel=1e-7), key
        dims = e["rogue_dims"]
        top = np.sort(ref["shares"])[::-1][:10]  # the order of dimensions whose shares tie is free
        np.testing.assert_allclose([d["share"] for d in dims], top, rtol=1e-9)
        for d in dims:
            assert d["share"] == pytest.approx(ref["shares"][d["dim"]], rel=1e-9)
            assert d["share_se"] == pytest.approx(
                jackknife_se([r["shares"][d["dim"]] for r in reps]), rel=1e-7
            )
    assert rep["layers"][0]["avgcos"] is None and "not requested" in rep["layers"][0]["notes"]["avgcos"]
    save_report(rep, tmp_path / "r")
    again = load_report(tmp_path / "r.json")
    assert again["layers"][0]["rogue_dims"] == rep["layers"][0]["rogue_dims"]
    assert "rogue_top3_share" in to_csv(rep).splitlines()[0]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm_rogue")
    full = minilm_run(root, sentences=30)
    (root / "kept").mkdir()
    return full, minilm_run(root / "kept", sentences=30, keep="sample:20")


def test_bundled_minilm_against_pairs(minilm):
    full, kept = minilm
    rep = score(full, ScoreOptions(metrics="rogue", layers="0,6", jackknife_groups=4))
    for e in rep["layers"]:
        x, meta = run_rows(full, e["layer"])
        ref = reference(x)
        for key in ("rogue_top1_share", "rogue_top3_share", "avgcos_standardised"):
            assert e[key] == pytest.approx(ref[key], rel=1e-8), (e["layer"], key)
        assert [d["dim"] for d in e["rogue_dims"][:3]] == list(np.argsort(-ref["shares"])[:3])
    # layer 0's rogue dimension carries a large share of the cosine, the standardised cosine is near 0
    first = rep["layers"][0]
    assert first["rogue_top1_share"] > 0.3 and abs(first["avgcos_standardised"]) < 0.01
    # a --keep sample run keeps the unit sums: the shares are exact, the standardised cosine is not there
    k = score(kept, ScoreOptions(metrics="rogue", layers="0", id_sample=20))["layers"][0]
    f = score(full, ScoreOptions(metrics="rogue", layers="0", id_sample=20))["layers"][0]
    assert k["rogue_top1_share"] == pytest.approx(f["rogue_top1_share"], rel=1e-9)
    assert k["rogue_dims"][0]["dim"] == f["rogue_dims"][0]["dim"]
    assert k["avgcos_standardised"] is None and "--keep all" in k["notes"]["avgcos_standardised"]


def test_cli_columns(cli, minilm, tmp_path):
    full, _ = minilm
    code, out, err = cli(
        [
            "score",
            str(full),
            "-m",
            "rogue",
            "-l",
            "0",
            "--columns",
            "rogue_top1_share",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert code == 0, err
    assert "rogue1" in err
