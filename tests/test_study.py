"""The sweep-and-compare study: statistics against scipy and a known distribution, a tiny grid end to
end through the CLI, and the bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from scipy import stats as sps
from test_train_helpers import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.study import stats


@pytest.mark.parametrize("seed", range(5))
def test_correlations_equal_scipy(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=15)
    y = 0.5 * x + rng.normal(size=15)
    y[3] = y[7]  # ties
    assert stats.pearson(x, y) == pytest.approx(sps.pearsonr(x, y)[0], abs=1e-12)
    assert stats.spearman(x, y) == pytest.approx(sps.spearmanr(x, y)[0], abs=1e-12)
    assert stats.pearson([1, 1, 1], [1, 2, 3]) is None


def test_bootstrap_mean_matches_the_normal_interval():
    rng = np.random.default_rng(0)
    a = rng.normal(3.0, 2.0, size=400)
    iv = stats.bootstrap_mean(a, n_boot=4000, seed=1)
    half = 1.959964 * a.std(ddof=1) / np.sqrt(a.size)  # the analytic 95% interval of a normal mean
    assert iv.estimate == pytest.approx(a.mean())
    assert iv.low == pytest.approx(a.mean() - half, abs=0.1 * half)
    assert iv.high == pytest.approx(a.mean() + half, abs=0.1 * half)


def test_bootstrap_correlation_covers_the_truth_and_keeps_groups():
    rng = np.random.default_rng(2)
    cover = 0
    for rep in range(40):
        x = rng.normal(size=60)
        y = 0.6 * x + 0.8 * rng.normal(size=60)  # true Pearson r = 0.6
        iv = stats.bootstrap_correlation(
            x, y, np.repeat(np.arange(6), 10), method="pearson", n_boot=400, seed=rep
        )
        cover += iv.low <= 0.6 <= iv.high
    assert cover >= 32  # nominal 95%: at least 80% of 40 intervals cover (a loose, fail-safe bound)


def test_mean_sd():
    assert stats.mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)
    assert stats.mean_sd([5.0, None]) == (5.0, None, 1)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("study")
    model = make_checkpoint(d / "m", words_of([]))
    train = write_csv(d / "train.csv", synthetic_rows(16, 0))
    dev = write_csv(d / "dev.csv", synthetic_rows(8, 1))
    args = [
        "finetune",
        model,
        "--train",
        train,
        "--eval",
        dev,
        "--out",
        d / "grid",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        "--quiet",
        "--lambda",
        "-1,0,1",
        "--seed",
        "0,1",
        "--reg",
        "istar",
    ]
    return d, args


def test_tiny_grid_and_compare(cli, sweep):
    d, args = sweep
    code, out, err = cli([*args, "--dry-run"])
    assert code == 0 and len(out.split()) == 6
    code, out, err = cli([*args, "--json"])
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert [r["status"] for r in runs] == ["done"] * 6
    assert sorted(p.name for p in (d / "grid").iterdir() if p.is_dir()) == sorted(r["name"] for r in runs)
    code, out, err = cli([*args, "--json"])  # a rerun skips what finished
    assert code == 0 and [r["status"] for r in json.loads(out)["runs"]] == ["skipped"] * 6
    code, out, err = cli(["compare", d / "grid", "--json", "--bootstrap", "200"])
    assert code == 0, err
    res = json.loads(out)
    assert len(res["runs"]) == 6 and [r["n"] for r in res["table"]] == [2, 2, 2]
    assert {p["lambda"] for p in res["paired_vs_lambda_0"]} == {-1.0, 1.0}
    x = [r["isoscore_star"] for r in res["runs"]]
    y = [r["accuracy"] for r in res["runs"]]
    rho = res["association"]["spearman"]["estimate"]
    ref = sps.spearmanr(x, y)[0]
    assert (rho is None and np.isnan(ref)) or rho == pytest.approx(ref, abs=1e-12)
    assert "runs" in res["sentence"] and "pilot" in res["sentence"]  # n = 6: the caveat is said
    for name in ("compare.json", "compare.csv", "compare.png"):
        assert (d / "grid" / name).stat().st_size > 0
    header = (d / "grid" / "compare.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["reg", "lambda", "n"] and "accuracy_mean" in header


def test_compare_bad_inputs(cli, sweep, tmp_path):
    d, _ = sweep
    (tmp_path / "not-a-run").mkdir()
    code, out, err = cli(["compare", tmp_path / "not-a-run"])
    assert_one_line_error(code, out, err, "not-a-run is not a finetune output", exit_code=2)
    from geomscope.study import grid, run_sweep
    from geomscope.train import FinetuneConfig

    model, train, dev = d / "m", d / "train.csv", d / "dev.csv"
    base = FinetuneConfig(
        model=str(model),
        train=str(train),
        eval=str(dev),
        out=str(tmp_path / "pair"),
        epochs=1,
        batch_size=8,
        device="cpu",
        reg="none",
    )
    assert all(r["status"] == "done" for r in run_sweep(base, grid(["none"], [0.0], [0, 1]), quiet=True))
    other = tmp_path / "other"
    import shutil

    shutil.copytree(tmp_path / "pair" / "none_lambda0_seed0", other)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "seed": 2}))  # not a second seed 0
    # trained on another eval file: the contents its checkpoint records differ (the path need not)
    state = json.loads((other / "checkpoint" / "state.json").read_text())
    assert state["fingerprint"]["eval_data"]["sha256"]  # what finetune records and compare compares
    state["fingerprint"]["eval_data"]["sha256"] = "0" * 64
    (other / "checkpoint" / "state.json").write_text(json.dumps(state))
    code, out, err = cli(["compare", tmp_path / "pair", other, "--out", tmp_path / "cmp"])
    assert_one_line_error(code, out, err, "different eval sets", "--allow-mixed", exit_code=2)
    mixed = ["compare", tmp_path / "pair", other, "--out", tmp_path / "cmp", "--allow-mixed", "--quiet"]
    code, out, err = cli(mixed)
    assert code == 0, err
    assert cli(mixed)[0] == 0  # its own outputs are replaced on a rerun
    # a user's file at one of its names is refused before anything is written, and kept
    (tmp_path / "cmp" / "compare.csv").write_text("my,own\n")
    before = (tmp_path / "cmp" / "compare.json").stat().st_mtime_ns
    code, out, err = cli(mixed)
    assert_one_line_error(code, out, err, "compare.csv exists", "geomscope did not write", exit_code=2)
    assert (tmp_path / "cmp" / "compare.csv").read_text() == "my,own\n"
    assert (tmp_path / "cmp" / "compare.json").stat().st_mtime_ns == before
    # damaged or hand-made run files: one line each, naming the run
    pair0 = tmp_path / "pair" / "none_lambda0_seed0"
    for name, edit in [
        ("summary.json", lambda d: [1, 2]),
        ("summary.json", lambda d: {**d, "final": "x"}),
        ("summary.json", lambda d: {**d, "final": {**d["final"], "accuracy": "high"}}),
        ("summary.json", lambda d: {**d, "final": {**d["final"], "accuracy": {}}}),
        ("summary.json", lambda d: {**d, "final": {**d["final"], "isoscore_star": float("inf")}}),
        ("run.json", lambda d: {**d, "config": [1]}),
    ]:
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(pair0, bad)
        doc = json.loads((bad / name).read_text())
        (bad / name).write_text(json.dumps(edit(doc)))
        code, out, err = cli(["compare", tmp_path / "pair", bad, "--out", tmp_path / "cmp2", "--allow-mixed"])
        assert_one_line_error(code, out, err, "bad is not a readable finetune output", exit_code=2)
    (bad / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    code, out, err = cli(["compare", bad, "--out", tmp_path / "cmp2"])
    assert_one_line_error(code, out, err, "bad", exit_code=2)
    code, out, err = cli(["compare", tmp_path / "pair", tmp_path / "pair", "--out", tmp_path / "cmp2"])
    assert_one_line_error(code, out, err, "same run", exit_code=2)
    (tmp_path / "a-file").write_text("x")
    code, out, err = cli([*mixed[:4], "--out", tmp_path / "a-file", "--allow-mixed"])
    assert_one_line_error(code, out, err, "a-file", exit_code=2)
    assert (tmp_path / "a-file").read_text() == "x"


def test_sweep_restarts_a_run_cut_off_before_its_first_checkpoint(tmp_path):
    from geomscope.study import grid, run_sweep
    from geomscope.train import FinetuneConfig

    model = make_checkpoint(tmp_path / "m", words_of([]))
    train = write_csv(tmp_path / "train.csv", synthetic_rows(16, 0))
    base = FinetuneConfig(
        model=str(model),
        train=str(train),
        eval=str(train),
        out=str(tmp_path / "g"),
        epochs=1,
        batch_size=8,
        device="cpu",
        reg="none",
    )
    points = grid(["none"], [0.0], [0, 1])
    cut = tmp_path / "g" / points[0].name
    cut.mkdir(parents=True)
    (cut / ".geomscope-finetune.json").write_text('{"format": "geomscope-finetune", "files": []}')
    (cut / "run.json").write_text("{}")  # what a run killed during its first epoch leaves
    (tmp_path / "g" / "sweep.json").write_text('{"format": "geomscope-sweep", "runs": []}')
    assert [r["status"] for r in run_sweep(base, points, quiet=True)] == ["done", "done"]
    assert [r["status"] for r in run_sweep(base, points, quiet=True)] == ["skipped", "skipped"]


def test_a_grid_stops_at_a_bad_input_and_says_why(cli, sweep, tmp_path):
    """Bad data fails every point the same way: the first failure is the error line (it was "sweep: 0
    of N runs finished" with no cause, after loading the model for every point)."""
    d, args = sweep
    nolabel = tmp_path / "nolabel.csv"
    nolabel.write_text("sentence\nhello there\nanother one\n")
    bad = [str(a) for a in args]
    bad[bad.index("--train") + 1] = str(nolabel)
    bad[bad.index("--out") + 1] = str(tmp_path / "grid")
    code, out, err = cli(bad)
    assert_one_line_error(code, out, err, "nolabel.csv", "label", exit_code=2)


@pytest.mark.parametrize("error", ["DataError", "InputError"])
def test_a_grid_with_failed_points_ends_with_one_error_line(cli, sweep, tmp_path, monkeypatch, error):
    """A point that fails on its own (a lambda that diverges; a damaged checkpoint of its own, an
    InputError that only that point meets) leaves the others running; the command ends with one error
    line that names the first failure."""
    import geomscope.errors
    import geomscope.train

    real = geomscope.train.finetune

    def diverging(cfg, **kw):
        if cfg.lam == 1.0:
            raise getattr(geomscope.errors, error)("the loss became NaN at step 2; lower --lambda or --lr")
        return real(cfg, **kw)

    monkeypatch.setattr(geomscope.train, "finetune", diverging)
    d, args = sweep
    grid_args = [str(a) for a in args]
    grid_args[grid_args.index("--out") + 1] = str(tmp_path / "grid")
    grid_args[grid_args.index("--seed") + 1] = "0"
    code, out, err = cli(grid_args)
    assert_one_line_error(code, out, err, "1 of 3 runs failed", "istar_lambda1_seed0", "NaN", exit_code=1)
    assert (tmp_path / "grid" / "istar_lambda-1_seed0" / "summary.json").is_file()
