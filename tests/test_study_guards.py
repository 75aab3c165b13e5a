"""compare's statistics and guards against the review of the study (each test failed before its fix):
a zero-width interval from one seed per configuration, undefined resamples dropped, Pearson's r and
the table's SD overflowing (Infinity in compare.json), one setting counted twice, eval sets told
apart by a path resolved in compare's folder, no usable run, figures that could not be drawn after
the JSON was written, the n = 2 sentence, the fit band's fixed resamples, refusals after the
bootstraps, lambdas printed alike, and nan lambdas in a grid. Runs are made by hand: only the files
compare reads (summary.json, run.json, checkpoint/state.json)."""

from __future__ import annotations

import json
import math
import re
import sys
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from conftest import assert_one_line_error
from scipy import stats as sps

from geomscope.errors import InputError
from geomscope.study import stats


def make_run(d, reg="istar", lam=0.0, seed=0, acc=0.8, iso=0.2, *, eval_="dev.csv", sha=None, final=None):
    """A finished finetune run as compare reads it; ``sha``: the eval file's sha256 its checkpoint
    records (None: a run from before finetune recorded it, no checkpoint)."""
    d.mkdir(parents=True)
    final = final or {"accuracy": acc, "macro_f1": acc, "isoscore_star": iso, "isoscore": 0.1, "avgcos": 0.2}
    summary = {"reg": reg, "lambda": lam, "seed": seed, "task": "classification", "final": final}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "run.json").write_text(json.dumps({"config": {"model": "m", "eval": eval_}}))
    if sha is not None:
        (d / "checkpoint").mkdir()
        state = {
            "epochs_done": 1,
            "global_step": 2,
            "fingerprint": {"eval_data": {"sha256": sha, "bytes": 100}, "lr": 1e-3},
            "label2id": {"a": 0, "b": 1},
        }
        (d / "checkpoint" / "state.json").write_text(json.dumps(state))
    return d


def make_runs(root, runs, **kw):
    """``runs``: (reg, lambda, seed, accuracy, IsoScore*) each, in folders r0, r1, ..."""
    for i, (reg, lam, seed, acc, iso) in enumerate(runs):
        make_run(root / f"r{i}", reg, lam, seed, acc, iso, **kw)
    return root


def grid_runs(reg="istar"):
    """3 lambdas x 2 seeds: a small sweep with an association."""
    return [
        (reg, -1.0, 0, 0.55, 0.01),
        (reg, 0.0, 0, 0.80, 0.20),
        (reg, 1.0, 0, 0.81, 0.50),
        (reg, -1.0, 1, 0.50, 0.011),
        (reg, 0.0, 1, 0.82, 0.19),
        (reg, 1.0, 1, 0.79, 0.52),
    ]


def strict_json(text: str):
    """JSON as the standard defines it: Infinity and NaN are not numbers."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------------------ statistics
@pytest.mark.filterwarnings("ignore::scipy.stats.NearConstantInputWarning")
@pytest.mark.parametrize(
    "x, y, scale",
    [
        ([1e160, 2e160, 3e160, 5e160], [0.1, 0.2, 0.3, 0.5], 1.0),  # was 0.0
        ([1e-170, 2e-170, 3e-170, 5e-170], [0.1, 0.2, 0.4, 0.3], 1.0),  # was inf
        ([1e8, 1e8 + 1e-8, 1e8 + 2e-8, 1e8 + 3e-8], [0.1, 0.2, 0.4, 0.3], 1.0),
        # scipy itself overflows here: it is given x / 1e300 (r does not depend on the scale)
        ([1.7e308, -1.7e308, 1e308, 0.0], [1.0, 2.0, 4.0, 3.0], 1e300),
    ],
)
def test_pearson_at_the_ends_of_the_float_range_equals_scipy(x, y, scale):
    ref = sps.pearsonr(np.asarray(x) / scale, y)[0]
    assert stats.pearson(x, y) == pytest.approx(ref, abs=1e-12)
    assert stats.spearman(x, y) == pytest.approx(sps.spearmanr(x, y)[0], abs=1e-12)


@pytest.mark.parametrize(
    "x, y",
    [
        ([0.25, 0.5, 0.5], [0.8, 0.5, 0.5]),
        ([0.1, 0.7, 0.1], [2 / 3, 0.8, 2 / 3]),
        ([0.5, 0.7, 0.7, 0.5], [0.8, 0.5, 0.5, 0.8]),
    ],
)
def test_pearson_stays_within_one(x, y):
    """These gave +-1.0000000000000002."""
    r = stats.pearson(x, y)
    assert -1.0 <= r <= 1.0 and r == pytest.approx(sps.pearsonr(x, y)[0], abs=1e-12)


def _exact_mean_sd(values):
    """Mean and sample SD in exact rational arithmetic, the root in 60 digits (None where a float
    cannot hold it)."""
    d = [Fraction(v) for v in values]
    mean = sum(d) / len(d)
    var = sum((v - mean) ** 2 for v in d) / (len(d) - 1)
    with localcontext() as ctx:
        ctx.prec = 60
        sd = (Decimal(var.numerator) / Decimal(var.denominator)).sqrt()
    return tuple(float(v) if math.isfinite(float(v)) else None for v in (mean, sd))


@pytest.mark.parametrize(
    "values",
    [[1e308, 1e308, 1.5e308], [1e-170, 3e-170], [1.7e308, -1.7e308], [0.25, 0.5, 0.125]],
)
def test_mean_sd_against_exact_arithmetic(values):
    """[1e308, ...] gave a mean of inf, [1e-170, 3e-170] an SD of 0 (its squares underflowed), and
    [1.7e308, -1.7e308], whose SD no float holds, inf (written to compare.json as Infinity)."""
    mean, sd, n = stats.mean_sd(values)
    want_mean, want_sd = _exact_mean_sd(values)
    assert n == len(values)
    assert mean == pytest.approx(want_mean, rel=1e-12, abs=0)
    assert sd == (None if want_sd is None else pytest.approx(want_sd, rel=1e-12, abs=0))
    iv = stats.bootstrap_mean(values, n_boot=200)
    assert iv.estimate == pytest.approx(want_mean, rel=1e-12, abs=0)
    assert all(v is None or math.isfinite(v) for v in (iv.low, iv.high))


def test_one_seed_per_configuration_resamples_runs():
    """With every group of one run, resampling within groups never changed the data: a zero-width
    interval (rho 0.10, "95% interval 0.10 to 0.10"). Now the runs are resampled (pairs bootstrap),
    as scipy.stats.bootstrap does with paired=True."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=12)
    y = 0.5 * x + rng.normal(size=12)
    iv = stats.bootstrap_correlation(x, y, np.arange(12), method="spearman", n_boot=4000, seed=1)
    ref = sps.bootstrap(
        (x, y),
        lambda a, b: sps.spearmanr(a, b)[0],
        paired=True,
        vectorized=False,
        method="percentile",
        n_resamples=4000,
        rng=np.random.default_rng(2),
    ).confidence_interval
    assert iv.high - iv.low > 0.3
    assert iv.low == pytest.approx(ref.low, abs=0.06) and iv.high == pytest.approx(ref.high, abs=0.06)
    assert iv.resampling == "runs"
    # one configuration with a single run is enough: it would be held fixed
    assert stats.bootstrap_correlation(x, y, [0] * 11 + [1], n_boot=50).resampling == "runs"
    paired = stats.bootstrap_correlation(x, y, np.repeat(np.arange(6), 2), n_boot=50)
    assert paired.resampling == "seeds within configurations"


def test_undefined_resamples_are_counted_and_can_leave_no_interval():
    """Resamples without the one run of higher accuracy have a constant accuracy: (4/5)^5 = 33% of
    them. They were dropped, and the defined ones (all positive) gave an interval that excluded 0."""
    x, y = [0.1, 0.2, 0.3, 0.4, 0.5], [0.5, 0.5, 0.5, 0.5, 0.9]
    n_boot = 2000
    iv = stats.bootstrap_correlation(x, y, [0] * 5, n_boot=n_boot, seed=0)
    assert iv.estimate == pytest.approx(sps.spearmanr(x, y)[0]) and iv.low is None and iv.high is None
    p = (4 / 5) ** 5
    assert abs(iv.undefined / n_boot - p) < 4 * math.sqrt(p * (1 - p) / n_boot)
    d = iv.to_dict()
    assert d["undefined"] == iv.undefined and d["low"] is None


def test_an_undefined_resample_counts_beyond_each_end():
    """41 replicates, 95%: the ends are order statistics 2 and 40 (numpy's linear rule puts them at
    positions 1 and 39 exactly). One undefined replicate counts below every value for the low end
    and above for the high end: the 1st and 40th defined values. Two (4.9% > 2.5%): no interval."""
    values = list(np.arange(1.0, 41.0))
    iv = stats._percentile_interval(0.5, [None, *values], 0.95, 5)
    assert (iv.low, iv.high) == (pytest.approx(1.0), pytest.approx(40.0)) and iv.undefined == 1
    iv = stats._percentile_interval(0.5, [None, None, *values[1:]], 0.95, 5)
    assert (iv.low, iv.high) == (None, None) and iv.undefined == 2


def test_fit_band_of_tiny_isoscores_equals_linregress():
    """IsoScore* near 1e-170: np.polyfit's SVD did not converge (a traceback from compare)."""
    x = np.array([1e-170, 2e-170, 3e-170, 5e-170])
    y = np.array([0.5, 0.6, 0.65, 0.9])
    grid = np.linspace(x.min(), x.max(), 5)
    fit, lo, hi = stats.line_fit_band(x, y, grid, n_boot=200)
    ref = sps.linregress(x * 1e170, y)
    assert fit == pytest.approx(ref.intercept + ref.slope * grid * 1e170, rel=1e-9)
    assert np.all(np.isfinite(lo)) and np.all(lo <= fit + 1e-12) and np.all(fit <= hi + 1e-12)


# ------------------------------------------------------------------------------ compare
def test_single_seed_sweep_cannot_claim_a_sign(tmp_path):
    from geomscope.study import compare

    runs = [
        ("istar", lam, 0, acc, iso)
        for lam, acc, iso in [
            (-1.0, 0.55, 0.01),
            (-0.5, 0.8, 0.05),
            (0.0, 0.7, 0.2),
            (0.5, 0.82, 0.3),
            (1.0, 0.6, 0.5),
        ]
    ]
    res = compare([make_runs(tmp_path / "sw", runs)], n_boot=500)
    rho = res["association"]["spearman"]
    assert rho["estimate"] == pytest.approx(sps.spearmanr([r[4] for r in runs], [r[3] for r in runs])[0])
    assert "cannot tell the sign" in res["sentence"]  # was "95% interval 0.10 to 0.10."
    assert rho["low"] is None or rho["low"] < rho["estimate"] < rho["high"]
    assert res["association"]["resampling"] == rho["resampling"] == "runs"


def test_one_setting_twice_is_refused_naming_both(cli, tmp_path):
    """`compare sweepA sweepB` with lambda 0 seed 0 in both counted it twice (the paired difference
    kept one of them)."""
    make_runs(tmp_path / "A", [("istar", 0.0, 0, 0.8, 0.2), ("istar", 1.0, 0, 0.7, 0.5)])
    make_runs(tmp_path / "B", [("istar", 0.0, 0, 0.6, 0.2), ("istar", 1.0, 1, 0.75, 0.45)])
    code, out, err = cli(["compare", tmp_path / "A", tmp_path / "B", "--out", tmp_path / "C"])
    line = assert_one_line_error(code, out, err, "compare them separately", exit_code=2)
    assert str(tmp_path / "A" / "r0") in line and str(tmp_path / "B" / "r0") in line
    assert not (tmp_path / "C").exists()


def test_eval_sets_are_told_by_their_recorded_contents(cli, tmp_path, monkeypatch):
    """run.json's --eval was resolved against compare's own folder: two projects' `--eval dev.csv`
    passed as one eval set, and the same file named two ways was refused."""
    args = ["--out", tmp_path / "out", "--quiet"]
    make_run(tmp_path / "p1" / "a", lam=0.0, sha="1" * 64)
    make_run(tmp_path / "p2" / "b", lam=1.0, acc=0.7, iso=0.5, sha="2" * 64)
    code, out, err = cli(["compare", tmp_path / "p1" / "a", tmp_path / "p2" / "b", *args])
    assert_one_line_error(code, out, err, "different eval sets", "sha256 111111111111", exit_code=2)
    make_run(tmp_path / "p3" / "c", lam=0.0, sha="1" * 64, eval_="data/dev.csv")
    make_run(tmp_path / "p3" / "d", lam=1.0, acc=0.7, iso=0.5, sha="1" * 64, eval_="../dev.csv")
    code, out, err = cli(["compare", tmp_path / "p3" / "c", tmp_path / "p3" / "d", *args])
    assert code == 0, err
    # runs from before finetune recorded the contents: their paths as recorded, not as resolved here
    make_run(tmp_path / "p4" / "e", lam=0.0, eval_="dev.csv")
    make_run(tmp_path / "p4" / "f", lam=1.0, acc=0.7, iso=0.5, eval_="other.csv")
    monkeypatch.chdir("/")
    code, out, err = cli(["compare", tmp_path / "p4" / "e", tmp_path / "p4" / "f", *args])
    assert_one_line_error(code, out, err, "different eval sets (dev.csv, other.csv)", exit_code=2)


def test_runs_without_values_are_one_line(cli, tmp_path):
    """finetune writes null for a metric it could not compute: a ValueError traceback."""
    nulls = {"accuracy": 0.8, "macro_f1": 0.8, "isoscore_star": None, "isoscore": None, "avgcos": None}
    make_run(tmp_path / "runs" / "a", lam=0.0, final=nulls)
    make_run(tmp_path / "runs" / "b", lam=1.0, final=nulls)
    code, out, err = cli(["compare", tmp_path / "runs"])
    assert_one_line_error(code, out, err, "0 of the 2 runs", "IsoScore*", exit_code=2)
    assert not (tmp_path / "runs" / "compare.json").exists()


def test_two_runs_say_a_correlation_needs_three(tmp_path):
    from geomscope.study import compare

    res = compare([make_runs(tmp_path / "two", [("istar", 0.0, 0, 0.8, 0.2), ("istar", 1.0, 0, 0.7, 0.5)])])
    assert "at least 3 runs" in res["sentence"] and "constant" not in res["sentence"]


def test_extreme_values_give_strict_json(cli, tmp_path):
    """Accuracies of +-1.7e308 (a hand-made summary): the SD and the paired difference overflowed and
    compare.json held Infinity, which no JSON reader takes."""
    runs = [
        ("istar", 0.0, 0, 1.7e308, 0.1),
        ("istar", 0.0, 1, -1.7e308, 0.2),
        ("istar", 1.0, 0, 1.7e308, 0.3),
        ("istar", 1.0, 1, -1.6e308, 0.4),
    ]
    make_runs(tmp_path / "big", runs)
    code, out, err = cli(["compare", tmp_path / "big", "--json", "--quiet", "--bootstrap", "200"])
    assert code == 0, err
    res = strict_json(out)
    assert strict_json((tmp_path / "big" / "compare.json").read_text()) == res
    assert res["table"][0]["accuracy_mean"] == 0.0 and res["table"][0]["accuracy_sd"] is None


def test_a_figure_that_cannot_be_drawn_writes_nothing(cli, tmp_path):
    """lambda = +-1e308 cannot be put on an axis: the traceback came after compare.json and
    compare.csv were replaced, beside the old compare.png."""
    out = tmp_path / "out"
    make_runs(tmp_path / "good", grid_runs())
    assert cli(["compare", tmp_path / "good", "--out", out, "--quiet", "--bootstrap", "100"])[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["compare.csv", "compare.json", "compare.png"]
    runs = [
        ("istar", -1e308, 0, 0.5, 0.01),
        ("istar", 0.0, 0, 0.8, 0.2),
        ("istar", 1e308, 0, 0.8, 0.5),
        ("istar", 1e308, 1, 0.7, 0.6),
    ]
    make_runs(tmp_path / "huge", runs)
    code, o, err = cli(["compare", tmp_path / "huge", "--out", out, "--bootstrap", "100"])
    assert_one_line_error(
        code, o, err, "cannot draw the comparison's figure", "nothing was written", exit_code=2
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("reg", [r"$\frac{x$", "a$b$", "_x", "\x1b[31m[bold]red\u202e"])
def test_names_and_tiny_values_are_drawn(cli, tmp_path, reg):
    """A reg name parsed as mathtext was a traceback ("$\\frac{x$") or drawn as maths ("a$b$"); one
    starting with "_" was left out of the legend."""
    from geomscope.plot.figures import is_figure
    from geomscope.plot.study import study_figure
    from geomscope.study import compare

    runs = make_runs(tmp_path / "runs", grid_runs(reg))
    code, out, err = cli(["compare", runs, "--quiet", "--bootstrap", "100"])
    assert code == 0, err
    assert is_figure((runs / "compare.png").read_bytes())
    fig = study_figure(compare([runs], n_boot=100))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(legend) == 2  # the regulariser and the fit band
    assert re.search(r"(?<!\\)\$", legend[0]) is None  # every $ escaped: no mathtext
    if "\x1b" in reg:
        assert "\x1b" not in legend[0] and "\\x1b[31m[bold]red\\u202e" in legend[0]
    else:
        assert legend[0].replace("\\$", "$").strip() == reg


def test_tiny_isoscores_are_drawn(cli, tmp_path):
    make_runs(tmp_path / "tiny", [("istar", 0.0, s, 0.5 + 0.1 * s, 1e-170 * (s + 1)) for s in range(4)])
    code, out, err = cli(["compare", tmp_path / "tiny", "--quiet", "--bootstrap", "100"])
    assert code == 0, err


def test_bootstrap_and_seed_reach_every_interval_and_the_band(cli, tmp_path, monkeypatch):
    """The figure's band always used 1000 resamples and seed 0, the paired differences 2000."""
    import geomscope.plot.study

    calls = []
    real_band, real_mean = stats.line_fit_band, stats.bootstrap_mean

    def band(*a, **kw):
        calls.append(("band", kw.get("n_boot"), kw.get("seed")))
        return real_band(*a, **kw)

    def mean(*a, **kw):
        calls.append(("paired", kw.get("n_boot"), kw.get("seed")))
        return real_mean(*a, **kw)

    monkeypatch.setattr(geomscope.plot.study.stats, "line_fit_band", band)
    monkeypatch.setattr(sys.modules["geomscope.study.compare"].stats, "bootstrap_mean", mean)
    runs = make_runs(tmp_path / "runs", grid_runs())
    code, out, err = cli(["compare", runs, "--json", "--quiet", "--bootstrap", "150", "--seed", "3"])
    assert code == 0, err
    assert {c[1:] for c in calls} == {(150, 3)} and {c[0] for c in calls} == {"band", "paired"}
    assoc = json.loads(out)["association"]
    assert (assoc["n_boot"], assoc["seed"]) == (150, 3)


def test_refusals_come_before_the_comparison(cli, tmp_path, monkeypatch):
    """A user's file at an output name, and several DIRs without --out, were refused only after both
    bootstraps had run."""

    def never(*a, **kw):
        raise AssertionError("compare ran before the refusal")

    # (the module: geomscope.study's own attribute `compare` is the function)
    monkeypatch.setattr(sys.modules["geomscope.study.compare"], "compare", never)
    runs = make_runs(tmp_path / "runs", grid_runs())
    (runs / "compare.csv").write_text("my,own\n")
    code, out, err = cli(["compare", runs])
    assert_one_line_error(code, out, err, "compare.csv exists", exit_code=2)
    assert (runs / "compare.csv").read_text() == "my,own\n"
    code, out, err = cli(["compare", runs, runs / "r0"])
    assert_one_line_error(code, out, err, "--out", exit_code=2)


def test_the_table_tells_close_lambdas_apart(cli, tmp_path, monkeypatch):
    """`:g` printed 1e-06 and 1.000001e-06 alike; they are written as the sweep names their folders."""
    monkeypatch.setenv("COLUMNS", "80")
    runs = [
        ("istar", lam, s, 0.5 + 0.1 * i + 0.01 * s, 0.1 * i + 0.01 * s)
        for i, lam in enumerate([0.0, 1e-6, 1.000001e-6])
        for s in (0, 1)
    ]
    code, out, err = cli(["compare", make_runs(tmp_path / "runs", runs), "--bootstrap", "100"])
    assert code == 0, err
    cells = [ln.split("│")[2].strip() for ln in err.splitlines() if ln.startswith("│ istar")]
    assert cells == ["0", "1e-06", "1.000001e-06"]


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_grid_refuses_lambdas_that_are_not_numbers(cli, tmp_path, bad):
    """`finetune --lambda nan,0 --dry-run` printed istar_lambdanan_seed0."""
    from geomscope.study import grid

    with pytest.raises(InputError, match="finite"):
        grid(["istar"], [float(bad), 0.0], [0])
    code, out, err = cli(
        [
            "finetune",
            "m",
            "--train",
            "t.csv",
            "--eval",
            "e.csv",
            "--out",
            tmp_path / "o",
            "--lambda",
            f"{bad},0",
            "--dry-run",
        ]
    )
    assert_one_line_error(code, out, err, "--lambda must be a finite number", exit_code=2)
