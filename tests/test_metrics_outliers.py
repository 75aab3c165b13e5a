"""Outlier-dimension rules: planted outliers found, thresholds as documented, registry, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from geomscope.errors import DataError, InputError
from geomscope.metrics import (
    OUTLIER_INPUTS,
    OUTLIER_RULES,
    Moments,
    outliers_magnitude,
    outliers_quantile,
    outliers_variance,
    outliers_zscore,
    rule_defaults,
)


def _acts(n=2000, d=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    x[:, 5] = 8.0 + rng.standard_normal(n)  # large-magnitude dimension (Dettmers-like), variance 1
    x[:, 17] *= 3.0  # high-variance dimension: 9x the others, |x| >= 6 in only 4.6 % of tokens
    return x


def test_variance_rule_threshold_and_principal():
    v = np.array([1.0, 1.0, 1.0, 1.0, 10.0, 5.0, 4.9, 1.0])
    r = outliers_variance(v, k=1.5)
    mean = v.mean()
    assert r.rule == "variance" and r.threshold == 1.5
    assert r.dims == [4, 5, 6] and r.details["principal"] == 4  # sorted by variance, largest first
    assert r.details["cutoff"] == pytest.approx(1.5 * mean)
    assert outliers_variance(v).dims == []  # k = 5: cutoff 5 * 3.1125 = 15.6 > 10
    assert outliers_variance(np.array([1.0] * 9 + [100.0])).dims == [9]


def test_variance_rule_on_activations():
    m = Moments().update(_acts())
    r = outliers_variance(m.variance())
    assert r.dims == [17] and r.details["principal"] == 17


def test_zscore_rule():
    x = _acts()
    m = Moments().update(x)
    r = outliers_zscore(m.mean_abs(), stat_name="mean_abs")
    assert r.dims == [5] and r.details["stat_name"] == "mean_abs"
    s = r.statistic
    assert r.details["cutoff"] == pytest.approx(s.mean() + 3 * s.std())
    assert outliers_zscore(m.variance()).dims == [17]
    assert outliers_zscore(np.ones(6)).dims == []  # no spread, no outlier
    with pytest.raises(InputError):
        outliers_zscore(np.ones(6), stat_name="kurtosis")


def test_quantile_rule():
    x = _acts(d=256)  # the rule assumes outliers are a small fraction of all entries
    r = outliers_quantile(x, q=0.99)
    assert r.dims == [5]
    assert r.details["cutoff"] == pytest.approx(np.quantile(np.abs(x), 0.99))
    np.testing.assert_allclose(r.statistic, np.median(np.abs(x), axis=0))
    assert outliers_quantile(np.random.default_rng(1).standard_normal((500, 16))).dims == []


def test_magnitude_rule():
    layers = []
    for seed in range(8):
        m = Moments(abs_threshold=6.0).update(_acts(n=500, seed=seed))
        layers.append(m.frac_abs_ge())
    f = np.stack(layers)
    r = outliers_magnitude(f)
    assert r.dims == [5] and r.details["n_layers"] == 8
    # planted: dimension 3 hits 10 % of tokens in exactly 2 of 8 layers (25 %: in), dim 4 in 1 of 8 (out)
    f2 = np.zeros((8, 6))
    f2[:2, 3] = 0.10
    f2[:1, 4] = 0.50
    f2[:, 1] = 0.059  # below the 6 % token fraction everywhere
    r2 = outliers_magnitude(f2)
    assert r2.dims == [3]
    np.testing.assert_allclose(r2.statistic, [0, 0, 0, 0.25, 0.125, 0])
    assert outliers_magnitude(f2[0]).dims == [3, 4]  # one layer


def test_registry_and_json():
    assert set(OUTLIER_RULES) == {"variance", "zscore", "quantile", "magnitude"} == set(OUTLIER_INPUTS)
    assert rule_defaults("variance") == {"k": 5.0}
    assert rule_defaults("magnitude")["token_frac"] == 0.06
    assert rule_defaults("quantile") == {"q": 0.99}
    with pytest.raises(InputError, match="unknown outlier rule"):
        rule_defaults("iqr")
    d = outliers_variance(np.array([1.0] * 9 + [50.0])).to_dict()
    assert json.loads(json.dumps(d))["dims"] == [9]


def test_bad_input():
    with pytest.raises(DataError, match="1-D"):
        outliers_variance(np.ones((3, 3)))
    with pytest.raises(DataError, match="NaN"):
        outliers_variance(np.array([1.0, np.nan]))
    with pytest.raises(DataError, match="all per-dimension variances are 0"):
        outliers_variance(np.zeros(4))
    with pytest.raises(DataError, match="fractions"):
        outliers_magnitude(np.full((2, 3), 1.5))
    with pytest.raises(InputError, match="q must be"):
        outliers_quantile(np.ones((3, 3)), q=1.0)
    bad = np.ones((4, 3))
    bad[1, 1] = np.nan
    with pytest.raises(DataError, match="1 of 4 rows"):
        outliers_quantile(bad)


# ------------------------------------------------- score: the zero-variance rule of IsoScore and cosines
def _scored(tmp_path, x, **kw) -> dict:
    from geomscope.score import ScoreOptions, score

    path = tmp_path / "x.npy"
    np.save(path, x)
    opts = {"metrics": ("isoscore", "outliers"), **kw}
    return score(path, ScoreOptions(**opts), log=lambda m: None)["layers"][0]


def _row() -> np.ndarray:
    row = np.random.default_rng(0).normal(size=16)
    row[3] = 40.0  # the largest |x|: the dimension rounding residue made an outlier
    return row


@pytest.mark.parametrize("rule", ["variance", "zscore"])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_identical_rows_have_no_outlier_dimension(tmp_path, rule, offset):
    x = np.tile(_row() + offset, (3000, 1))
    assert (x == x[0]).all()  # no variance at all: the reference answer is "undefined"
    e = _scored(tmp_path, x, outlier_rule=rule)
    # not [3] with support [1.0] from variances of 1e-27, as IsoScore refuses the layer
    assert e["isoscore"] is None and "zero total variance" in e["notes"]["isoscore"]
    assert e["outliers"] == [] and e["outlier_statistic"] == [] and e["outlier_support"] == []
    assert "zero total variance" in e["notes"]["outliers"]


def test_mean_abs_is_no_spread_and_keeps_its_outliers_on_identical_rows(tmp_path):
    row = _row()
    e = _scored(tmp_path, np.tile(row, (3000, 1)), outlier_rule="zscore", outlier_stat="mean_abs")
    s = np.abs(row)  # numpy: mean |x| of identical rows is |row|; z-scores over dimensions, ddof=0
    assert e["outliers"] == list(np.flatnonzero((s - s.mean()) / s.std() > 3.0)) == [3]
    np.testing.assert_allclose(e["outlier_statistic"], s, rtol=1e-12)


@pytest.mark.parametrize("rule, thr", [("variance", 5.0), ("zscore", 3.0)])
def test_a_constant_dimension_has_exactly_zero_variance(tmp_path, rule, thr):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3000, 16))
    x[:, 3] *= 8.0
    x[:, 5] = 1e8 + 0.1  # accumulating it left a variance of 2e-13: rounding of its mean, no spread
    x[:, 7] = 3.0
    e = _scored(tmp_path, x, outlier_rule=rule)
    ref = np.var(x, axis=0, ddof=1)
    ref[[5, 7]] = 0.0  # constant by construction
    stat = np.asarray(e["outlier_statistic"])
    assert stat[5] == 0.0 and stat[7] == 0.0
    np.testing.assert_allclose(stat, ref, rtol=1e-9)
    flagged = ref >= thr * ref.mean() if rule == "variance" else (ref - ref.mean()) / ref.std() > thr
    assert e["outliers"] == list(np.flatnonzero(flagged)) == [3]


def test_support_counts_only_replicates_where_the_rule_is_defined(tmp_path):
    # two document groups (contiguous halves), each constant: leaving either out leaves no variance
    x = np.repeat(np.stack([_row(), _row() + np.arange(16.0) ** 3]), 500, axis=0)
    assert np.ptp(x[:500], axis=0).max() == 0 and np.ptp(x[500:], axis=0).max() == 0
    e = _scored(tmp_path, x, jackknife_groups=2)
    ref = np.var(x, axis=0, ddof=1)
    assert e["outliers"] == list(np.flatnonzero(ref >= 5.0 * ref.mean()))  # the full layer has variance
    # not [0.0]: each replicate's rounding residues would flag some other dimension
    assert e["outliers"] and e["outlier_support"] == []
    assert "every jackknife replicate" in e["notes"]["outlier_support"]
