"""score --metrics abtt,whitened: all-but-the-top and whitening per layer, against the rows
post-processed here (Mu & Viswanath's steps; ZCA whitening from the SVD) on a synthetic run and on
the bundled MiniLM, their delete-one-document-group jackknife SEs computed directly, the
--keep sample run (exact covariance metrics, no cosine), and reports without them unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_runs import jackknife_se, minilm_run, run_rows
from test_metrics_postprocess import abtt_reference, iso_of_cov, pairs_avgcos, zca_reference
from test_score import make_run

from geomscope.errors import InputError
from geomscope.report import load_report, table_metrics, to_csv
from geomscope.schema import LAYER_KEYS
from geomscope.score import ScoreOptions, score

KS = (1, 3)


def reference(x, zeta=0.2):
    """Every abtt/whitened value of rows ``x``, from the processed rows themselves."""
    out = {}
    for k in KS:
        z = abtt_reference(x, k)
        c = np.cov(z.T)
        out[f"abtt{k}_isoscore"] = iso_of_cov(c)
        out[f"abtt{k}_isoscore_star"] = iso_of_cov(
            (1 - zeta) * c + zeta * np.trace(c) / len(c) * np.eye(len(c))
        )
        out[f"abtt{k}_avgcos"] = pairs_avgcos(z)
    w = zca_reference(x)
    c = np.cov(w.T)
    out["whitened_isoscore"] = iso_of_cov(c)
    out["whitened_isoscore_star"] = iso_of_cov((1 - zeta) * c + zeta * np.trace(c) / len(c) * np.eye(len(c)))
    out["whitened_avgcos"] = pairs_avgcos(w)
    return out


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("post") / "run"
    return d, make_run(d, n_shards=2, rows=300)


def test_values_and_jackknife_ses_on_a_synthetic_run(toy):
    d, data = toy
    rep = score(d, ScoreOptions(metrics="abtt,whitened", abtt_k=KS, jackknife_groups=4))
    groups = data["doc"] % 4
    for e in rep["layers"]:
        x = data["X"][e["layer"]]
        ref = reference(x)
        reps = [reference(x[groups != r]) for r in range(4)]
        for key, want in ref.items():
            assert e[key] == pytest.approx(want, abs=1e-9), (e["layer"], key)
            assert e["se"][key] == pytest.approx(jackknife_se([r[key] for r in reps]), abs=1e-8), key
        assert e["whitened_isoscore"] == 1.0
    assert rep["params"]["abtt_k"] == list(KS)


def test_threads_and_workers_give_the_same_numbers(toy):
    d, _ = toy
    keys = [f"abtt{k}_avgcos" for k in KS] + ["whitened_avgcos"]
    one = score(d, ScoreOptions(metrics="abtt,whitened", abtt_k=KS, block_rows=100))
    two = score(d, ScoreOptions(metrics="abtt,whitened", abtt_k=KS, workers=2))
    for a, b in zip(one["layers"], two["layers"], strict=True):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-12) and a["se"][k] == pytest.approx(
                b["se"][k], rel=1e-9
            )


def test_reports_without_the_diagnostics_keep_their_keys(toy):
    d, _ = toy
    plain = score(d, ScoreOptions(metrics="isoscore,avgcos"))
    both = score(d, ScoreOptions(metrics="isoscore,avgcos,abtt", abtt_k=KS))
    assert all(list(e) == list(LAYER_KEYS) for e in plain["layers"])
    assert "abtt_k" not in plain["params"] and to_csv(plain).split("\n")[0] == to_csv(plain).split("\n")[0]
    assert "abtt1_isoscore" not in to_csv(plain)
    for a, b in zip(plain["layers"], both["layers"], strict=True):
        assert [k for k in b if k in a] == list(a)
        for k in ("isoscore", "avgcos", "avgcos_centred"):
            assert a[k] == b[k] and a["se"][k] == b["se"][k]
        assert [k for k in b["se"] if k in a["se"]] == list(a["se"])
    assert "abtt3_avgcos" in table_metrics(both, ["all"])[0]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm_post")
    full = minilm_run(root, sentences=40)
    (root / "kept").mkdir()
    kept = minilm_run(root / "kept", sentences=40, keep="sample:30")
    return full, kept


def test_bundled_minilm_against_numpy(minilm):
    full, _ = minilm
    rep = score(full, ScoreOptions(metrics="abtt,whitened", abtt_k=KS, jackknife_groups=4, layers="0,6"))
    for e in rep["layers"]:
        x, meta = run_rows(full, e["layer"])
        ref = reference(x)
        for key, want in ref.items():
            assert e[key] == pytest.approx(want, rel=1e-7, abs=1e-9), (e["layer"], key)
        assert e["n_rows"] == len(x) and e["n_rows"] > x.shape[1]  # full rank: whitening gives 1
    e = rep["layers"][-1]
    x, meta = run_rows(full, e["layer"])
    groups = meta["doc_id"] % 4
    reps = [reference(x[groups != r]) for r in range(4)]
    for key in ("abtt1_avgcos", "abtt3_isoscore", "whitened_avgcos"):
        assert e["se"][key] == pytest.approx(jackknife_se([r[key] for r in reps]), rel=1e-6)


def test_keep_sample_run_gives_the_covariance_metrics_only(minilm):
    full, kept = minilm
    opts = dict(metrics="abtt,whitened", abtt_k=KS, layers="2", id_sample=30)
    a = score(full, ScoreOptions(**opts))["layers"][0]
    b = score(kept, ScoreOptions(**opts))["layers"][0]
    for key in ("abtt1_isoscore", "abtt3_isoscore_star", "whitened_isoscore"):
        assert b[key] == pytest.approx(a[key], rel=1e-9)
    for key in ("abtt1_avgcos", "whitened_avgcos"):
        assert b[key] is None and "--keep all" in b["notes"][key]
        assert a[key] is not None


def test_cli(cli, minilm, tmp_path):
    full, _ = minilm
    code, out, err = cli(
        [
            "score",
            str(full),
            "-m",
            "abtt",
            "--abtt-k",
            "2",
            "-l",
            "1",
            "--columns",
            "abtt2_avgcos",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert code == 0, err
    assert "cos-2" in err
    rep = load_report(tmp_path / "r.json")
    assert rep["layers"][0]["abtt2_isoscore"] is not None
    assert "abtt2_avgcos" in (tmp_path / "r.csv").read_text().splitlines()[0]
    assert json.loads((tmp_path / "r.json").read_text())["params"]["abtt_k"] == [2]
    code, out, err = cli(["score", str(full), "-m", "abtt", "--abtt-k", "384", "--out", str(tmp_path / "x")])
    assert_one_line_error(code, out, err, "below 384")
    with pytest.raises(InputError, match="--abtt-k"):
        ScoreOptions(abtt_k=()).validate()
