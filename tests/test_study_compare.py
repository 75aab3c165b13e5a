"""compare's statistics and guards: no zero-width interval from one seed per configuration, undefined
resamples dropped, Pearson's r and the table's SD without overflow (no Infinity in compare.json), one
setting counted once, eval sets told apart by their contents, no usable run, figures that cannot be
drawn refused before the JSON is written, the n = 2 sentence, the fit band's fixed resamples, refusals
before the bootstraps, distinct lambdas printed distinctly, nan lambdas in a grid, intervals from seeds
resampled within fixed configurations, paired differences only in the JSON, and "IsoScor…". Runs are
made by hand: only the files compare reads (summary.json, run.json, checkpoint/state.json)."""

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
    records (None: no checkpoint, so none recorded)."""
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
        ([1e160, 2e160, 3e160, 5e160], [0.1, 0.2, 0.3, 0.5], 1.0),  # not 0.0
        ([1e-170, 2e-170, 3e-170, 5e-170], [0.1, 0.2, 0.4, 0.3], 1.0),  # not inf
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
    iv = stats.mean_interval(values)
    assert iv.estimate == pytest.approx(want_mean, rel=1e-12, abs=0)
    assert all(v is None or math.isfinite(v) for v in (iv.low, iv.high))


@pytest.mark.parametrize("scale", [1e160, 1e-170, 2.5e307])
@pytest.mark.parametrize("method", ["spearman", "pearson"])
def test_the_interval_over_configurations_does_not_depend_on_scale(scale, method):
    """IsoScore* near the ends of the float range: the same interval as at unit scale."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=12)
    y, groups = x + rng.normal(size=12), np.repeat(np.arange(4), 3)
    want = stats.cluster_correlation(x, y, groups, method=method, n_boot=300)
    got = stats.cluster_correlation(x * scale, y, groups, method=method, n_boot=300)
    assert want.low is not None
    for a, b in ((got.estimate, want.estimate), (got.low, want.low), (got.high, want.high)):
        assert a == pytest.approx(b, abs=1e-12)


def test_one_seed_per_configuration_gives_no_interval():
    """Resampling within configurations of one run gave a zero-width interval (rho 0.10, "95%
    interval 0.10 to 0.10"), and resampling the runs instead treated the configurations as if
    they were seeds. The design has nothing to say about the association's uncertainty: the
    estimate stands alone, and the reason says so."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=12)
    y = 0.5 * x + rng.normal(size=12)
    for groups in (np.arange(12), np.repeat(np.arange(6), 2), np.repeat(np.arange(2), 6), [0] * 11 + [1]):
        iv = stats.cluster_correlation(x, y, groups, method="spearman", n_boot=200, seed=1)
        assert iv.estimate == pytest.approx(sps.spearmanr(x, y)[0], abs=1e-12)
        assert (iv.low, iv.high) == (None, None)
        assert iv.reason.startswith("too few runs for an interval") and iv.resampling == "configurations"
    assert stats.cluster_correlation(x, y, np.repeat(np.arange(4), 3), n_boot=200).low is not None


def test_the_interval_resamples_configurations_as_scipy_does():
    """6 configurations of 3 seeds: the spread of Fisher's z over resampled configurations, taken
    from scipy.stats.bootstrap's own resamples of the configuration labels, gives the same
    interval tanh(z -+ t_5 s). Both draw K labels per resample from one seeded generator, so
    with the same seed they agree to rounding; the tolerance is that of independent draws."""
    rng = np.random.default_rng(5)
    effect = np.repeat(rng.normal(size=6), 3)
    x, y = effect + 0.5 * rng.normal(size=18), 0.7 * effect + 0.5 * rng.normal(size=18)
    groups = np.repeat(np.arange(6), 3)
    iv = stats.cluster_correlation(x, y, groups, method="spearman", n_boot=4000, seed=2)

    def z_of(labels):
        runs = np.concatenate([np.flatnonzero(groups == g) for g in labels.astype(int)])
        return np.arctanh(np.clip(sps.spearmanr(x[runs], y[runs])[0], -0.999999, 0.999999))  # not inf

    z = sps.bootstrap(
        (np.arange(6.0),), z_of, vectorized=False, n_resamples=4000, rng=np.random.default_rng(2)
    ).bootstrap_distribution
    s = (np.quantile(z, sps.norm.cdf(1)) - np.quantile(z, sps.norm.cdf(-1))) / 2
    half = sps.t.ppf(0.975, 5) * s
    centre = np.arctanh(sps.spearmanr(x, y)[0])
    assert iv.low == pytest.approx(np.tanh(centre - half), abs=0.06)
    assert iv.high == pytest.approx(np.tanh(centre + half), abs=0.06)
    assert (iv.units, iv.n, iv.resampling) == (6, 18, "configurations")


def test_weighted_resamples_equal_repeated_runs():
    """A resample weights each run by how often its configuration was drawn: its Spearman and
    Pearson are scipy's on the runs repeated that often (ties and all)."""
    rng = np.random.default_rng(3)
    x, y = np.round(rng.normal(size=12), 1), np.round(rng.normal(size=12), 1)
    weights = stats._cluster_weights(np.repeat(np.arange(4), 3), 40, rng)
    for method, ref in (("spearman", sps.spearmanr), ("pearson", sps.pearsonr)):
        r = stats._resampled_correlations(x, y, weights, method)
        for w, got in zip(weights, r, strict=True):
            idx = np.repeat(np.arange(12), w)
            want = ref(x[idx], y[idx])[0] if np.ptp(x[idx]) and np.ptp(y[idx]) else np.nan
            assert (np.isnan(want) and np.isnan(got)) or got == pytest.approx(want, abs=1e-12)


def test_undefined_resamples_are_counted_and_can_leave_no_interval():
    """Resamples without the one configuration of higher accuracy have a constant accuracy:
    (4/5)^5 = 33% of them, more than the 15.9 % below the spread's low quantile, so there is no
    interval. Dropping them would leave only resamples that hold the association."""
    x = np.linspace(0.1, 1.5, 15)
    y = np.where(np.arange(15) >= 12, 0.9, 0.5)
    n_boot = 2000
    iv = stats.cluster_correlation(x, y, np.repeat(np.arange(5), 3), n_boot=n_boot, seed=0)
    assert iv.estimate == pytest.approx(sps.spearmanr(x, y)[0]) and iv.low is None and iv.high is None
    p = (4 / 5) ** 5
    assert abs(iv.undefined / n_boot - p) < 4 * math.sqrt(p * (1 - p) / n_boot)
    d = iv.to_dict()
    assert d["undefined"] == iv.undefined and d["low"] is None and "constant" in d["reason"]


def test_an_undefined_or_perfect_resample_counts_beyond_each_end():
    """The spread of z is half the range between its 15.87 % and 84.13 % quantiles (numpy's linear
    rule). An undefined resample (NaN) counts below every value for the low quantile and above for
    the high one; one at r = +-1 has z = +-inf and counts where that puts it. Either moves the ends
    only outward, and where one reaches a quantile the spread is unbounded."""
    z = np.arange(1.0, 41.0)
    lo_p, hi_p = sps.norm.cdf(-1), sps.norm.cdf(1)
    assert stats.robust_sd_z(np.tanh(z / 10)) == pytest.approx(
        (np.quantile(z, hi_p) - np.quantile(z, lo_p)) / 20, rel=1e-9
    )
    with_nan = np.concatenate([[np.nan], np.tanh(z / 10)])
    stand_in_low, stand_in_high = np.concatenate([[-99.0], z]), np.concatenate([z, [99.0]])
    want = (np.quantile(stand_in_high, hi_p) - np.quantile(stand_in_low, lo_p)) / 20
    assert stats.robust_sd_z(with_nan) == pytest.approx(want, rel=1e-9)
    assert stats.robust_sd_z(np.concatenate([[1.0, -1.0], np.tanh(z / 10)])) > stats.robust_sd_z(
        np.tanh(z / 10)
    )
    assert stats.robust_sd_z(np.concatenate([np.full(8, np.nan), np.tanh(z / 10)])) == math.inf


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
    assert "cannot tell the sign" in res["sentence"]  # not "95% interval 0.10 to 0.10."
    assert "too few runs for an interval" in res["sentence"]
    assert rho["low"] is None and rho["reason"].startswith("too few runs for an interval")
    assert res["association"]["resampling"] == rho["resampling"] == "configurations"
    assert (res["association"]["configurations"], res["association"]["distinct_lambdas"]) == (5, 5)


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
    """Eval sets are told apart by their recorded contents, not by run.json's --eval resolved against
    compare's own folder: two projects' `--eval dev.csv` are two eval sets, and the same file named
    two ways is one."""
    args = ["--out", tmp_path / "out", "--quiet"]
    make_run(tmp_path / "p1" / "a", lam=0.0, sha="1" * 64)
    make_run(tmp_path / "p2" / "b", lam=1.0, acc=0.7, iso=0.5, sha="2" * 64)
    code, out, err = cli(["compare", tmp_path / "p1" / "a", tmp_path / "p2" / "b", *args])
    assert_one_line_error(code, out, err, "different eval sets", "sha256 111111111111", exit_code=2)
    make_run(tmp_path / "p3" / "c", lam=0.0, sha="1" * 64, eval_="data/dev.csv")
    make_run(tmp_path / "p3" / "d", lam=1.0, acc=0.7, iso=0.5, sha="1" * 64, eval_="../dev.csv")
    code, out, err = cli(["compare", tmp_path / "p3" / "c", tmp_path / "p3" / "d", *args])
    assert code == 0, err
    # runs that record no contents: their paths as recorded, not as resolved here
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
    """lambda = +-1e308 cannot be put on an axis: refused before compare.json and compare.csv are
    replaced: the outputs already there stay as they are."""
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
    """A reg name is drawn as itself: never parsed as mathtext (a traceback for "$\\frac{x$", maths for
    "a$b$"), and one starting with "_" stays in the legend."""
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
    """The figure's band always used 1000 resamples and seed 0. (The paired differences' t
    intervals draw no resamples.)"""
    import geomscope.plot.study

    calls = []
    real_band, real_corr = stats.line_fit_band, stats.cluster_correlation

    def band(*a, **kw):
        calls.append(("band", kw.get("n_boot"), kw.get("seed")))
        return real_band(*a, **kw)

    def corr(*a, **kw):
        calls.append(("correlation", kw.get("n_boot"), kw.get("seed")))
        return real_corr(*a, **kw)

    monkeypatch.setattr(geomscope.plot.study.stats, "line_fit_band", band)
    monkeypatch.setattr(stats, "cluster_correlation", corr)
    runs = make_runs(tmp_path / "runs", grid_runs())
    code, out, err = cli(["compare", runs, "--json", "--quiet", "--bootstrap", "150", "--seed", "3"])
    assert code == 0, err
    assert {c[1:] for c in calls} == {(150, 3)} and {c[0] for c in calls} == {"band", "correlation"}
    assoc = json.loads(out)["association"]
    assert (assoc["n_boot"], assoc["seed"]) == (150, 3)


def test_refusals_come_before_the_comparison(cli, tmp_path, monkeypatch):
    """A user's file at an output name, and several DIRs without --out, are refused before either
    bootstrap runs."""

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
    table = err.split("└")[0]  # (the paired differences' table follows)
    cells = [ln.split("│")[2].strip() for ln in table.splitlines() if ln.startswith("│ istar")]
    assert cells == ["0", "1e-06", "1.000001e-06"]


def test_compare_says_what_the_design_supports(cli, tmp_path, monkeypatch):
    """3 lambdas x 2 seeds printed "rho = 0.43, 95% interval 0.41 to 0.94" (seed noise around three
    fixed configuration means) and kept the paired differences, with "intervals" from 2 pairs, in
    the JSON only. Now the estimate stands alone with its reason, the design it rests on is said,
    and the paired differences are printed with n."""
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = cli(
        ["compare", make_runs(tmp_path / "runs", grid_runs()), "--json", "--bootstrap", "200"]
    )
    assert code == 0, err
    res = json.loads(out)
    a = res["association"]
    assert (a["configurations"], a["distinct_lambdas"], a["seeds_per_configuration"]) == (
        3,
        3,
        {"min": 2, "max": 2},
    )
    assert a["resampling"] == "configurations" and a["method"] == stats.CLUSTER_METHOD
    for key in ("spearman", "pearson"):
        assert a[key]["estimate"] is not None and (a[key]["low"], a[key]["high"]) == (None, None)
        assert a[key]["reason"].startswith("too few runs for an interval")
    assert "interval 0." not in res["sentence"] and "too few runs for an interval" in res["sentence"]
    assert "3 configurations (3 distinct lambda values)" in res["sentence"]
    for p in res["paired_vs_lambda_0"]:
        assert p["n_pairs"] == 2 and p["accuracy"]["n"] == 2 and p["accuracy"]["low"] is None
        assert p["accuracy"]["reason"].startswith("too few pairs for an interval")
    assert res["paired_vs_lambda_0"][0]["accuracy"]["estimate"] == pytest.approx(-0.285)
    text = " ".join(err.split())
    assert "Spearman rho │ 0.429 │ too few runs for an interval" in text
    assert "paired differences against lambda = 0" in text and "Δ accuracy" in text and "Δ IsoScore*" in text
    assert "│ istar │ -1 │ 2 │ -0.285 │ -0.184 │" in text and "too few pairs for an interval" in text
    assert "3 configurations, 3 distinct lambda values, 2 seeds each" in text


def test_compare_gives_intervals_over_configurations(cli, tmp_path, monkeypatch):
    """4 lambdas x 3 seeds: an interval for each correlation, over configurations, and a t interval
    for each paired difference (3 pairs), all printed."""
    monkeypatch.setenv("COLUMNS", "200")
    runs = [
        ("istar", lam, s, 0.6 + 0.05 * i + 0.01 * s * (-1) ** i, 0.1 * i + 0.02 * s)
        for i, lam in enumerate([0.0, 0.5, 1.0, 2.0])
        for s in range(3)
    ]
    code, out, err = cli(["compare", make_runs(tmp_path / "runs", runs), "--json", "--bootstrap", "500"])
    assert code == 0, err
    res = json.loads(out)
    rho = res["association"]["spearman"]
    assert rho["low"] < rho["estimate"] < rho["high"] and rho["reason"] is None and rho["units"] == 4
    assert f"95% interval {rho['low']:.2f} to {rho['high']:.2f}, resampling configurations" in res["sentence"]
    diff = res["paired_vs_lambda_0"][0]["accuracy"]
    d = [0.65 + 0.01 * s * -1 - 0.6 - 0.01 * s for s in range(3)]
    assert (diff["low"], diff["high"]) == pytest.approx(
        sps.t.interval(0.95, 2, loc=np.mean(d), scale=sps.sem(d))
    )
    text = " ".join(err.split())
    assert f"95%: {rho['low']:.3f} to {rho['high']:.3f}" in text
    assert f"95%: {diff['low']:.3f} to {diff['high']:.3f}" in text and "│ istar │ 0.5 │ 3 │" in text


@pytest.mark.parametrize("columns", ["80", "100"])
def test_the_table_keeps_isoscore_star_whole(cli, tmp_path, monkeypatch, columns):
    """At 80 columns the header read "IsoScor…"."""
    monkeypatch.setenv("COLUMNS", columns)
    code, out, err = cli(["compare", make_runs(tmp_path / "runs", grid_runs()), "--bootstrap", "100"])
    assert code == 0, err
    assert "…" not in err and "IsoScore*" in err.split("\n")[2]
    assert max(len(ln) for ln in err.splitlines() if not ln.startswith("wrote")) <= int(columns)


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


def test_the_scatter_is_labelled_with_the_outcome_where_a_band_is_drawn(tmp_path):
    """3 configurations x 3 seeds draw the band; the y axis still names the outcome."""
    from geomscope.plot.study import study_figure
    from geomscope.study.compare import compare

    runs = [
        ("istar", lam, s, 0.6 + 0.1 * lam + 0.01 * s, 0.2 + 0.1 * lam + 0.003 * s)
        for lam in (-1.0, 0.0, 1.0)
        for s in range(3)
    ]
    result = compare([make_runs(tmp_path / "runs", runs)], n_boot=200)
    fig = study_figure(result)
    scatter = fig.axes[0]
    assert scatter.get_ylabel() == "eval accuracy"
    assert any("95% band" in t.get_text() for t in scatter.get_legend().get_texts())


@pytest.mark.parametrize("sign", [1, -1])
def test_perplexity_is_an_outcome_where_lower_is_better(tmp_path, sign):
    """Causal-LM runs: perplexity is the outcome, and the sentence names the better (lower) side."""
    from geomscope.study.compare import compare

    for i, (lam, seed) in enumerate((x, s) for x in (-1.0, 0.0, 1.0) for s in (0, 1, 2)):
        iso = 0.1 + 0.1 * i
        final = {"perplexity": 50.0 + sign * 3.0 * i, "eval_loss": 4.0, "isoscore_star": iso}
        final.update(isoscore=0.1, avgcos=0.2)
        d = make_run(tmp_path / f"r{i}", lam=lam, seed=seed, final=final)
        summary = json.loads((d / "summary.json").read_text())
        (d / "summary.json").write_text(json.dumps({**summary, "task": "causal-lm"}))
    res = compare([tmp_path], n_boot=200)
    assert res["outcome"] == "perplexity" and res["outcome_direction"] == "lower is better"
    assert res["association"]["spearman"]["estimate"] == pytest.approx(sign)
    side = "lower" if sign > 0 else "higher"
    assert f"{side} isotropy went with lower perplexity (better)" in res["sentence"]
