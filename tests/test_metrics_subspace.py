"""Gradient energy in the activation subspace: analytic truths (confined and isotropic gradients, Ky Fan
maximum, the controls' exact expectation), the removal test against an explicit projection, invariances,
seeded controls and bad input (numpy's and scipy's errors never reach the user: top_eigenpairs' bad
counts, eigenpairs of another matrix, a rank as a 0-d array)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import one_line_message
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import null_space

from geomscope.errors import DataError, InputError
from geomscope.metrics.isotropy import isoscore_star_from_cov
from geomscope.metrics.subspace import gradient_energy, normal_controls, top_eigenpairs


def _orthogonal(d, rng):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diagonal(r))


def _cov(d, rng, top=5.0, bottom=0.05):
    """A covariance with distinct, decaying eigenvalues along random directions (no ties)."""
    q = _orthogonal(d, rng)
    return (q * np.geomspace(top, bottom, d)) @ q.T


def _top(c, r):
    w, v = np.linalg.eigh(c)
    return v[:, ::-1][:, :r]


def _second_moment(n, d, rng, scales):
    g = rng.standard_normal((n, d)) * scales @ _orthogonal(d, rng).T
    return g.T @ g, g.mean(axis=0)


def _by_rank(res):
    return {row["rank"]: row for row in res}


# -- analytic truths ---------------------------------------------------------------------------


def test_gradients_confined_to_the_activation_subspace():
    rng = np.random.default_rng(0)
    d, r, k = 40, 6, 30
    basis = _orthogonal(d, rng)
    u, w = basis[:, :r], basis[:, r:]
    c_act = (u * np.linspace(10, 5, r)) @ u.T + (w * np.linspace(1, 0.1, d - r)) @ w.T  # U_r = u
    a = rng.standard_normal((r, r))
    s = u @ (a @ a.T + 0.1 * np.eye(r)) @ u.T  # PSD, full rank r, inside span u
    gbar = u @ rng.standard_normal(r)
    (row,) = gradient_energy(s, gbar, c_act, [r], controls=k, seed=3)
    for key in ("energy", "kappa", "mean_energy", "overlap", "energy_max"):
        assert row[key] == pytest.approx(1.0, abs=1e-10), key
    assert row["baseline"] == r / d
    # control energies are >= 0, so a zero mean (and sd) means every control is 0
    assert row["control_energy_mean"] == pytest.approx(0.0, abs=1e-10)
    assert row["control_energy_sd"] == pytest.approx(0.0, abs=1e-10)
    assert row["control_energy_expected"] == pytest.approx(0.0, abs=1e-10)
    assert row["energy_ratio"] is None  # E / 0
    assert row["p_value"] == pytest.approx(1 / (k + 1))
    assert row["controls"] == k and row["controls_note"] is None


def test_isotropic_gradients_hold_r_over_d():
    # g_t ~ N(0, I_D) independently of U_r (C_act comes from another stream). Then
    # num = sum_t ||U_r^T g_t||^2 ~ chi2(N r) and the rest ~ chi2(N (D - r)) are independent, so
    # E = num / (num + rest) ~ Beta(N r / 2, N (D - r) / 2) exactly: mean r/D and
    # Var = (r/D)(1 - r/D) / (N D / 2 + 1) ~ 2 r (D - r) / (N D^3). 5 SD: fails with p < 1e-6.
    rng = np.random.default_rng(1)
    n, d = 20000, 64
    g = rng.standard_normal((n, d))
    s = g.T @ g
    c_act = _cov(d, np.random.default_rng(2))
    res = _by_rank(gradient_energy(s, g.mean(axis=0), c_act, [1, 8, 32], controls=40, seed=0))
    for r, row in res.items():
        sd = np.sqrt((r / d) * (1 - r / d) / (n * d / 2 + 1))
        assert abs(row["energy"] - r / d) < 5 * sd, r
        # a control is another fixed rank-r subspace, so the same Beta law holds for each; its mean
        # over K controls equals the exact conditional expectation r/(D - r) (1 - E) within 5 SE
        expected = r / (d - r) * (1 - row["energy"])
        assert row["control_energy_expected"] == pytest.approx(expected, rel=1e-12)
        assert abs(expected - r / d) < 5 * sd * r / (d - r) + 1e-15
        se = row["control_energy_sd"] / np.sqrt(row["controls"])
        # at r = D/2 a control spans the whole complement: its energy is exactly 1 - E, and the SD
        # is rounding (1e-17), hence the floor
        assert abs(row["control_energy_mean"] - expected) < 5 * se + 1e-12, r
        # the mean gradient of isotropic rows is isotropic too: e ~ Beta(r/2, (D - r)/2), loose
        assert 0.0 <= row["mean_energy"] <= 1.0


def test_controls_mean_matches_the_exact_expectation():
    rng = np.random.default_rng(4)
    d = 30
    s, gbar = _second_moment(500, d, rng, np.geomspace(4, 0.2, d))
    c_act = _cov(d, rng)
    res = _by_rank(gradient_energy(s, gbar, c_act, [2, 5, 10, 15], controls=200, seed=11))
    for r in (2, 5, 10):
        row = res[r]
        se = row["control_energy_sd"] / np.sqrt(200)
        assert abs(row["control_energy_mean"] - row["control_energy_expected"]) < 4 * se, r
        ratio = row["energy"] / row["control_energy_mean"]
        assert row["energy_ratio"] == pytest.approx(ratio, rel=1e-12)
    # r = D/2: the only rank-r subspace of the complement is the complement itself, E_k = 1 - E
    half = res[15]
    assert half["control_energy_mean"] == pytest.approx(1 - half["energy"], abs=1e-12)
    assert half["control_energy_sd"] == pytest.approx(0.0, abs=1e-12)
    assert half["control_energy_expected"] == pytest.approx(1 - half["energy"], abs=1e-15)


def test_energy_max_is_the_best_rank_r_subspace():
    rng = np.random.default_rng(5)
    d = 24
    s, gbar = _second_moment(300, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    ranks = list(range(1, d))
    w = np.linalg.eigvalsh(s)[::-1]
    for row in gradient_energy(s, gbar, c_act, ranks, controls=0):
        r = row["rank"]
        assert row["energy_max"] >= row["energy"] - 1e-12
        assert row["energy_max"] == pytest.approx(w[:r].sum() / w.sum(), rel=1e-12)
        assert row["kappa"] <= 1 + 1e-12
        assert row["kappa"] == pytest.approx((row["energy"] - r / d) / (row["energy_max"] - r / d), rel=1e-12)
    # U_r := V_r (activation covariance = S): E reaches E_max, kappa = overlap = 1
    for row in gradient_energy(s, gbar, s, ranks, controls=0):
        assert row["energy"] == pytest.approx(row["energy_max"], rel=1e-12)
        assert row["kappa"] == pytest.approx(1.0, abs=1e-10)
        assert row["overlap"] == pytest.approx(1.0, abs=1e-10)


def test_overlap_and_mean_energy_from_their_definitions():
    rng = np.random.default_rng(6)
    d, r = 20, 4
    s, _ = _second_moment(200, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    u, v = _top(c_act, r), _top(s, r)
    # g-bar along one top activation direction plus one orthogonal to all of U_r: e = 1/(1 + 4)
    gbar = u[:, 0] + 2 * null_space(u.T)[:, 0]
    (row,) = gradient_energy(s, gbar, c_act, [r], controls=0)
    assert row["mean_energy"] == pytest.approx(0.2, rel=1e-12)
    assert row["overlap"] == pytest.approx(np.linalg.norm(u.T @ v) ** 2 / r, rel=1e-12)
    assert row["energy"] == pytest.approx(np.trace(u.T @ s @ u) / np.trace(s), rel=1e-12)


# -- removal test against an explicit projection -----------------------------------------------


@pytest.mark.parametrize("target_kind", ["trace", "identity", "matrix"])
def test_removal_matches_explicit_projection(target_kind):
    rng = np.random.default_rng(7)
    d, k, seed, zeta = 12, 5, 9, 0.3
    s, gbar = _second_moment(100, d, rng, np.geomspace(2, 0.5, d))
    c_act = _cov(d, rng, top=8.0, bottom=0.1)
    c0 = _cov(d, rng)
    target = c0 if target_kind == "matrix" else target_kind

    def explicit(q):
        b = null_space(q.T)  # orthonormal basis of the complement, (D, D - r)
        assert b.shape == (d, d - q.shape[1])
        t = b.T @ c0 @ b if target_kind == "matrix" else target_kind
        return isoscore_star_from_cov(b.T @ c_act @ b, zeta, t)

    kw = {"controls": k, "seed": seed, "zeta": zeta, "target": target}
    res = _by_rank(gradient_energy(s, gbar, c_act, range(1, d - 1), **kw))
    assert res[1]["isoscore_star"] == pytest.approx(isoscore_star_from_cov(c_act, zeta, target), abs=1e-12)
    for r, row in res.items():
        u = _top(c_act, r)
        assert row["removal_isoscore_star"] == pytest.approx(explicit(u), abs=1e-12), r
        if 2 * r > d:
            assert row["removal_control_isoscore_star_mean"] is None
            continue
        vals = [explicit(q) for q in normal_controls(u, k, seed)]
        assert row["removal_control_isoscore_star_mean"] == pytest.approx(np.mean(vals), abs=1e-12), r
        assert row["removal_control_isoscore_star_sd"] == pytest.approx(np.std(vals, ddof=1), abs=1e-12), r


@pytest.mark.parametrize("target_kind", ["trace", "identity"])
def test_removal_of_u_r_keeps_precision_on_anisotropic_activations(target_kind):
    # eigenvalues from 1e3 to 1e-2: removing U_9 leaves ||C'||_F^2 ~ 1e-10 ||C||_F^2, where the
    # trace identities lose ~1e-7 (measured 9e-8); the explicit P C P keeps ~1e-12
    rng = np.random.default_rng(7)
    d = 12
    s, gbar = _second_moment(50, d, rng, np.ones(d))
    c_act = _cov(d, rng, top=1e3, bottom=1e-2)
    res = _by_rank(gradient_energy(s, gbar, c_act, [3, 6, 9], controls=0, zeta=0.3, target=target_kind))
    for r, row in res.items():
        b = null_space(_top(c_act, r).T)
        want = isoscore_star_from_cov(b.T @ c_act @ b, 0.3, target_kind)
        assert row["removal_isoscore_star"] == pytest.approx(want, abs=1e-10), r


def test_removal_undefined_cases():
    rng = np.random.default_rng(8)
    d = 10
    s, gbar = _second_moment(50, d, rng, np.ones(d))
    # C_act of rank 3: nothing left after removing U_3 (trace target), D - r = 1 for r = 9
    x = rng.standard_normal((3, d))
    c_act = x.T @ x
    res = _by_rank(gradient_energy(s, gbar, c_act, [3, 9], controls=2))
    assert res[3]["removal_isoscore_star"] is None and "no variance outside U_r" in res[3]["removal_note"]
    assert res[3]["removal_control_isoscore_star_mean"] is not None  # a control keeps U_3's variance
    assert res[9]["removal_isoscore_star"] is None and "D - r = 1" in res[9]["removal_note"]
    # with the identity target the remainder is defined even with C' = 0
    (row,) = gradient_energy(s, gbar, c_act, [3], controls=0, target="identity")
    assert row["removal_isoscore_star"] == pytest.approx(1.0)


# -- controls: definition, reproducibility, edge cases ------------------------------------------


def test_controls_are_the_documented_subspaces():
    rng = np.random.default_rng(10)
    d, r, k = 16, 3, 7
    s, gbar = _second_moment(80, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    u = _top(c_act, r)
    qs = normal_controls(u, k, seed=4)
    assert qs.shape == (k, d, r)
    for q in qs:
        assert np.allclose(q.T @ q, np.eye(r), atol=1e-12)
        assert np.abs(u.T @ q).max() < 1e-12
    energies = np.array([np.trace(q.T @ s @ q) / np.trace(s) for q in qs])
    (row,) = gradient_energy(s, gbar, c_act, [r], controls=k, seed=4)
    assert row["control_energy_mean"] == pytest.approx(energies.mean(), rel=1e-12)
    assert row["control_energy_sd"] == pytest.approx(energies.std(ddof=1), rel=1e-10)
    assert row["p_value"] == (1 + np.sum(energies >= row["energy"])) / (k + 1)
    # the first K controls of a larger K are the same subspaces
    assert np.allclose(normal_controls(u, k + 3, seed=4)[:k], qs, atol=1e-14)


def test_seeded_controls_are_reproducible_and_independent_of_other_ranks():
    rng = np.random.default_rng(12)
    d = 20
    s, gbar = _second_moment(100, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    a = _by_rank(gradient_energy(s, gbar, c_act, [2, 5, 8], controls=6, seed=1))
    b = _by_rank(gradient_energy(s, gbar, c_act, [5], controls=6, seed=1))
    c = _by_rank(gradient_energy(s, gbar, c_act, [5], controls=6, seed=2))
    # equal up to rounding: the eigensolver is asked for max(ranks) + 1 pairs, so its last bits differ
    assert a[5].keys() == b[5].keys()
    for key, value in b[5].items():
        plain = value is None or isinstance(value, str)
        assert a[5][key] == (value if plain else pytest.approx(value, rel=1e-12)), key
    again = _by_rank(gradient_energy(s, gbar, c_act, [5], controls=6, seed=1))
    assert again[5] == b[5]  # bitwise for the same call
    assert abs(c[5]["control_energy_mean"] - b[5]["control_energy_mean"]) > 1e-6
    assert c[5]["energy"] == b[5]["energy"]


def test_control_fields_when_there_are_none():
    rng = np.random.default_rng(13)
    d = 10
    s, gbar = _second_moment(50, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    res = _by_rank(gradient_energy(s, gbar, c_act, [5, 6], controls=1))
    assert res[5]["controls"] == 1 and res[5]["control_energy_sd"] is None  # sd needs K >= 2
    assert res[5]["removal_control_isoscore_star_sd"] is None
    assert res[5]["p_value"] in (0.5, 1.0)
    no_room = res[6]  # 2r > D: no rank-6 subspace in the 4-dimensional complement
    assert "2r <= D" in no_room["controls_note"]
    for key in ("control_energy_mean", "control_energy_expected", "energy_ratio", "p_value"):
        assert no_room[key] is None, key
    assert no_room["controls"] == 0
    (none,) = gradient_energy(s, gbar, c_act, [3], controls=0)
    assert none["control_energy_mean"] is None and none["p_value"] is None
    assert none["control_energy_expected"] == pytest.approx(3 / 7 * (1 - none["energy"]))
    assert "controls = 0" in none["controls_note"]


def test_undefined_kappa_and_mean_energy_and_json():
    rng = np.random.default_rng(14)
    d = 8
    c_act = _cov(d, rng)
    (row,) = gradient_energy(3.0 * np.eye(d), np.zeros(d), c_act, [2], controls=3)
    assert row["kappa"] is None  # isotropic S: E = E_max = r/D
    assert row["energy"] == pytest.approx(0.25, rel=1e-12)
    assert row["mean_energy"] is None
    (row,) = gradient_energy(3.0 * np.eye(d), None, c_act, [2], controls=3)
    assert row["mean_energy"] is None
    assert json.loads(json.dumps(row)) == row
    assert all(type(v) in (int, float, str, type(None)) for v in row.values())


# -- invariances -------------------------------------------------------------------------------

_INVARIANT = ("energy", "energy_max", "kappa", "overlap", "mean_energy", "activation_share")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-6, 1e6), r=st.integers(1, 7))
def test_invariant_to_scale_of_s_and_to_rotation(seed, scale, r):
    rng = np.random.default_rng(seed)
    d = 14
    s, gbar = _second_moment(60, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    (ref,) = gradient_energy(s, gbar, c_act, [r], controls=4, seed=5)
    (scaled,) = gradient_energy(s * scale, gbar * np.sqrt(scale), c_act, [r], controls=4, seed=5)
    o = _orthogonal(d, rng)
    (rot,) = gradient_energy(o @ s @ o.T, o @ gbar, o @ c_act @ o.T, [r], controls=0)
    for key in _INVARIANT + ("control_energy_mean", "p_value", "removal_isoscore_star"):
        assert scaled[key] == pytest.approx(ref[key], rel=1e-8, abs=1e-12), key
    for key in _INVARIANT + ("removal_isoscore_star", "isoscore_star"):
        assert rot[key] == pytest.approx(ref[key], rel=1e-8, abs=1e-12), key


# -- bad input ---------------------------------------------------------------------------------


def test_bad_input():
    rng = np.random.default_rng(15)
    d = 12
    s, gbar = _second_moment(40, d, rng, np.ones(d))
    c_act = _cov(d, rng)
    with pytest.raises(InputError) as e:
        gradient_energy(s, gbar, c_act, [4, d])
    assert one_line_message(e) == "--rank 12 is not below the hidden size D = 12; use ranks from 1 to 11"
    with pytest.raises(InputError) as e:
        gradient_energy(s, gbar, c_act, [0])
    assert "from 1 to 11" in one_line_message(e)
    for bad in ([], [2.5], [True]):
        with pytest.raises(InputError) as e:
            gradient_energy(s, gbar, c_act, bad)
        one_line_message(e)
    with pytest.raises(DataError) as e:
        gradient_energy(s, gbar, c_act[:-1, :-1], [2])
    assert "same layer" in one_line_message(e)
    with pytest.raises(DataError) as e:
        gradient_energy(s[:, :-1], gbar, c_act, [2])
    one_line_message(e)
    with pytest.raises(DataError) as e:
        gradient_energy(s, gbar[:-1], c_act, [2])
    one_line_message(e)
    with pytest.raises(DataError) as e:
        gradient_energy(np.zeros((d, d)), np.zeros(d), c_act, [2])
    assert "gradients are all zero" in one_line_message(e)
    with pytest.raises(DataError) as e:
        gradient_energy(s, gbar, np.zeros((d, d)), [2])
    one_line_message(e)
    for name in ("S", "C_act", "grad_mean"):
        args = {"S": s.copy(), "grad_mean": gbar.copy(), "C_act": c_act.copy()}
        args[name][0] = np.nan
        with pytest.raises(DataError) as e:
            gradient_energy(args["S"], args["grad_mean"], args["C_act"], [2])
        assert "NaN" in one_line_message(e)
    asym = s.copy()
    asym[0, 1] += 1.0
    with pytest.raises(DataError) as e:
        gradient_energy(asym, gbar, c_act, [2])
    assert "not symmetric" in one_line_message(e)
    for kwargs in ({"controls": -1}, {"seed": -1}, {"zeta": 1.5}, {"target": "eye"}):
        with pytest.raises(InputError) as e:
            gradient_energy(s, gbar, c_act, [2], **kwargs)
        one_line_message(e)
    with pytest.raises(DataError) as e:
        gradient_energy(s, gbar, c_act, [2], target=np.eye(d + 1))
    one_line_message(e)


# -- ranks past the numerical rank, PSD, precision at any scale, float32 covariances -------------

_U_FIELDS = (
    "energy",
    "kappa",
    "mean_energy",
    "overlap",
    "activation_gap",
    "control_energy_mean",
    "control_energy_sd",
    "control_energy_expected",
    "energy_ratio",
    "p_value",
)


def test_ranks_beyond_the_numerical_rank_of_c_act_are_undefined():
    # 5 rows in D = 12: C_act has rank 4, so U_5, U_6 end in arbitrary null-space directions; LAPACK
    # picked E(r = 6) 0.514 here and 0.507 for the same problem rotated, and gaps up to 1.3
    rng = np.random.default_rng(0)
    d = 12
    c_act = np.cov(rng.standard_normal((5, d)), rowvar=False)
    s, gbar = _second_moment(200, d, rng, np.linspace(3, 0.3, d))
    o = _orthogonal(d, rng)
    res = _by_rank(gradient_energy(s, gbar, c_act, [3, 4, 5, 6], controls=5))
    rot = _by_rank(gradient_energy(o @ s @ o.T, o @ gbar, o @ c_act @ o.T, [3, 4, 5, 6], controls=5))
    w = np.linalg.eigvalsh(c_act)[::-1]
    for r in (3, 4):  # defined: the definitions, and unchanged by the rotation
        row, u = res[r], _top(c_act, r)
        assert row["energy"] == pytest.approx(np.trace(u.T @ s @ u) / np.trace(s), rel=1e-10)
        assert row["subspace_note"] is None and row["controls"] == 5
        for key in ("energy", "kappa", "mean_energy", "overlap", "activation_share"):
            assert rot[r][key] == pytest.approx(row[key], rel=1e-8), (r, key)
    assert res[3]["activation_gap"] == pytest.approx((w[2] - w[3]) / w[2], rel=1e-10)
    assert res[4]["activation_gap"] == 1.0  # lambda_5 is rounding: 0
    for r in (5, 6):
        for row in (res[r], rot[r]):
            for key in _U_FIELDS:
                assert row[key] is None, (r, key)
            assert row["controls"] == 0
            assert "numerical rank k = 4" in row["subspace_note"] and "use r <= 4" in row["subspace_note"]
            assert "subspace_note" in row["controls_note"]
            assert row["activation_share"] == pytest.approx(1.0, abs=1e-12)
            assert row["energy_max"] == pytest.approx(np.linalg.eigvalsh(s)[::-1][:r].sum() / np.trace(s))
        # removing U_r leaves nothing of C_act, whichever null directions U_r holds
        assert res[r]["removal_isoscore_star"] is None and "no variance outside U_r" in res[r]["removal_note"]
    assert json.loads(json.dumps(res[6])) == res[6]


@pytest.mark.parametrize("seed", range(8))
def test_activation_gap_is_in_the_unit_interval_or_null(seed):
    # C_act of rank 9 in D = 40 with decaying scales: the gap at r = 10 read 0.83 to 1.30
    rng = np.random.default_rng(seed)
    d = 40
    c_act = np.cov(rng.standard_normal((10, d)) * np.geomspace(1e3, 1, d), rowvar=False)
    s = np.eye(d) + np.diag(np.arange(d))
    res = _by_rank(gradient_energy(s, None, c_act, [9, 10, 12, 15], controls=0))
    assert res[9]["activation_gap"] == 1.0
    for r in (10, 12, 15):
        assert res[r]["activation_gap"] is None and res[r]["energy"] is None, r


def test_overlap_is_null_when_r_exceeds_the_rank_of_s():
    # one gradient direction (rank-1 S), r = 3: V_2, V_3 are arbitrary null vectors of S; E and kappa
    # do not use V_r and stay defined
    rng = np.random.default_rng(0)
    d = 10
    c_act = _cov(d, rng, top=10.0, bottom=1.0)
    g = rng.standard_normal(d)
    s = np.outer(g, g)
    o = _orthogonal(d, rng)
    (row,) = gradient_energy(s, g, c_act, [3], controls=0)
    (rot,) = gradient_energy(o @ s @ o.T, o @ g, o @ c_act @ o.T, [3], controls=0)
    u = _top(c_act, 3)
    assert row["overlap"] is None and rot["overlap"] is None
    assert "S's numerical rank 1" in row["subspace_note"]
    assert row["energy"] == pytest.approx(np.sum((u.T @ g) ** 2) / (g @ g), rel=1e-10)
    assert row["energy_max"] == pytest.approx(1.0, abs=1e-12)
    for key in ("energy", "kappa", "mean_energy"):
        assert rot[key] == pytest.approx(row[key], rel=1e-8), key


@pytest.mark.parametrize("seed", range(10))
def test_overlap_never_exceeds_one(seed):
    # S's top subspace equals U_r to 1e-9 rad: ||U_r^T V_r||_F^2 / r read above 1 by rounding (seed 5)
    rng = np.random.default_rng(seed)
    d, r = 30, 5
    c_act = np.cov(rng.standard_normal((400, d)) * np.geomspace(10, 1, d), rowvar=False)
    u = _top(c_act, r)
    v = np.linalg.qr(u + 1e-9 * rng.standard_normal((d, r)))[0]
    s = v @ np.diag(np.geomspace(100, 50, r)) @ v.T + 1e-3 * np.eye(d)
    (row,) = gradient_energy(s, None, c_act, [r], controls=0)
    assert 1 - 1e-12 < row["overlap"] <= 1.0
    assert row["energy_max"] <= 1.0 and row["activation_share"] <= 1.0


def _not_psd(d, low, rng):
    """Symmetric, positive diagonal, one eigenvalue ``low`` < 0."""
    for _ in range(200):
        q = _orthogonal(d, rng)
        m = (q * np.r_[np.linspace(10, 1, d - 1), low]) @ q.T
        if np.diagonal(m).min() > 0:
            return (m + m.T) / 2
    raise AssertionError("no such matrix drawn")


@pytest.mark.parametrize("which", ["S", "C_act"])
def test_a_matrix_with_a_negative_eigenvalue_is_refused(which):
    rng = np.random.default_rng(2)
    d = 8
    s, gbar = _second_moment(100, d, rng, np.geomspace(3, 0.3, d))
    c_act = _cov(d, rng)
    bad = _not_psd(d, -2.0, rng)
    assert np.linalg.eigvalsh(bad).min() < -1 and np.diagonal(bad).min() > 0
    args = {"S": s, "C_act": c_act, which: bad}
    with pytest.raises(DataError) as e:
        gradient_energy(args["S"], gbar, args["C_act"], [2], controls=3)
    assert f"{which} is not a covariance" in one_line_message(e)
    # rounding-sized negative eigenvalues (a rank-deficient covariance) are not refused
    x = rng.standard_normal((3, d))
    gradient_energy(s, gbar, np.cov(x, rowvar=False), [2], controls=0)


def _iso_star_ref(c, zeta, target):
    """IsoScore* of (1 - zeta) C + zeta T straight from its definition: (PR - 1) / (D - 1)."""
    d = c.shape[0]
    t = (
        {"trace": np.trace(c) / d * np.eye(d), "identity": np.eye(d)}.get(target)
        if isinstance(target, str)
        else target
    )
    cz = (1 - zeta) * c + zeta * t
    return min(1.0, max(0.0, (np.trace(cz) ** 2 / np.sum(cz * cz) - 1) / (d - 1)))


@pytest.mark.parametrize("target_kind", ["trace", "identity0", "matrix"])
def test_removal_does_not_depend_on_the_scale_of_the_rows(target_kind):
    # rows at 1e-100 and 1e80 squared C's entries out of float64's range in ||C||_F^2: removal None
    # with a false "no variance outside U_r"; at 1e-80 (C ~ 1e-160) subnormals cost 5e-5
    rng = np.random.default_rng(1)
    d, r, zeta = 10, 3, (0.0 if target_kind == "identity0" else 0.3)
    x = rng.standard_normal((300, d)) * np.geomspace(5, 0.5, d)
    x0 = rng.standard_normal((300, d)) * np.geomspace(1, 2, d)
    s, gbar = _second_moment(300, d, rng, np.linspace(3, 0.3, d))
    seen = []
    for a in (1.0, 1e-100, 1e80, 1e-80):
        c_act = np.cov(x * a, rowvar=False)
        c0 = np.cov(x0 * a, rowvar=False)
        target = {"trace": "trace", "identity0": "identity", "matrix": c0}[target_kind]
        (row,) = gradient_energy(s, gbar, c_act, [r], controls=4, seed=2, zeta=zeta, target=target)
        # reference: an explicit basis of the complement, on the matrices brought back to scale 1
        b = null_space(_top(c_act, r).T)
        t = b.T @ (c0 / a**2) @ b if target_kind == "matrix" else target
        want = _iso_star_ref(b.T @ (c_act / a**2) @ b, zeta, t)
        assert row["removal_note"] is None, a
        assert row["removal_isoscore_star"] == pytest.approx(want, rel=1e-12), a
        seen.append(row["removal_control_isoscore_star_mean"])
    assert seen == pytest.approx([seen[0]] * 4, rel=1e-10)


def test_float32_covariances_are_accepted_as_as_covariance_accepts_them():
    # a float32 GEMM covariance is symmetric only to float32 rounding (2e-8 of its largest entry):
    # refused as "not symmetric ... a factor of it", though IsoScore* accepts it
    rng = np.random.default_rng(3)
    d = 256
    x = (rng.standard_normal((2000, d)) * np.geomspace(5, 0.5, d)).astype(np.float32)
    xc = x - x.mean(0)
    c32 = (xc.T @ xc) / (len(x) - 1)
    # whether a GEMM's result is bitwise symmetric depends on the BLAS kernel: build the case here,
    # an upper triangle one float32 ulp of the largest entry apart (what a kernel that sums the
    # halves in another order gives), so asym = ulp(max) / max, between 2^-24 and 2^-23
    upper = np.triu(np.ones((d, d), dtype=bool), 1) & (rng.random((d, d)) < 0.3)
    c32 = ((c32 + c32.T) / 2).astype(np.float32)
    c32[upper] += np.spacing(np.abs(c32).max())
    asym = np.abs(c32 - c32.T).max() / np.abs(c32).max()
    assert 1e-9 < asym < 1e-6  # above float64 rounding, within float32 rounding
    isoscore_star_from_cov(c32, 0.2, "trace")  # accepted there
    g = rng.standard_normal((300, d))
    s = g.T @ g
    (row,) = gradient_energy(s, None, c32, [4], controls=0)
    c = c32.astype(np.float64)
    u = _top((c + c.T) / 2, 4)
    assert row["energy"] == pytest.approx(np.trace(u.T @ s @ u) / np.trace(s), rel=1e-10)


def test_counts_and_seeds_are_checked_as_whole_numbers():
    rng = np.random.default_rng(16)
    d = 10
    s, gbar = _second_moment(40, d, rng, np.ones(d))
    c_act = _cov(d, rng)
    with pytest.raises(InputError) as e:
        gradient_energy(s, gbar, c_act, [2], controls=2.0)
    assert one_line_message(e) == "--controls must be a whole number >= 0; got 2.0"
    with pytest.raises(InputError) as e:
        gradient_energy(s, gbar, c_act, [2], seed=True)
    assert one_line_message(e) == "--seed must be a whole number >= 0; got True"
    with pytest.raises(InputError) as e:
        gradient_energy(s, gbar, c_act, ["3"])
    assert one_line_message(e) == "--rank must be a whole number; got '3'"
    numpy_ints = gradient_energy(s, gbar, c_act, [np.int64(2)], controls=np.int32(3), seed=np.uint16(5))
    assert numpy_ints == gradient_energy(s, gbar, c_act, [2], controls=3, seed=5)


# ------------------------------------------------------------------ top_eigenpairs and ranks: bad counts


def _sample_cov(d, seed=4):
    return np.cov(np.random.default_rng(seed).standard_normal((50, d)), rowvar=False)


@pytest.mark.parametrize("k", [7, 0, -1, 2.7, "3", True, None])
def test_top_eigenpairs_refuses_a_bad_count(k):
    # refused here: D + 1 and 0 would reach scipy's ValueError, 2.7 would be truncated to 2
    with pytest.raises(InputError) as e:
        top_eigenpairs(_sample_cov(6), k)
    assert "1 to" in one_line_message(e)


def test_top_eigenpairs_accepts_every_count_from_1_to_d():
    c = _sample_cov(6)
    w, v = np.linalg.eigh(c)
    for k in (1, np.int64(3), np.array(6)):
        lam, vecs = top_eigenpairs(c, k)
        n = int(k)
        np.testing.assert_allclose(lam, w[::-1][:n], rtol=1e-12)
        np.testing.assert_allclose(np.abs(vecs.T @ v[:, ::-1][:, :n]), np.eye(n), atol=1e-10)


def test_act_eig_of_another_matrix_is_an_input_error():
    d = 6
    c = _sample_cov(d)
    for bad in (
        top_eigenpairs(np.eye(d + 2), 3),  # eigenvectors of another size (numpy's matmul ValueError)
        top_eigenpairs(c, 2),  # too few pairs for max(ranks) + 1 = 3
        (np.ones(3), np.ones((d, 2))),  # eigenvalues and eigenvectors that do not pair up
        "eig",  # not a pair
    ):
        with pytest.raises(InputError) as e:
            gradient_energy(c, None, c, [2], controls=0, act_eig=bad)
        assert "top_eigenpairs" in one_line_message(e)
    (row,) = gradient_energy(c, None, c, [2], controls=0, act_eig=top_eigenpairs(c, 3))
    assert row["energy"] == pytest.approx(
        gradient_energy(c, None, c, [2], controls=0)[0]["energy"], rel=1e-12
    )


def test_one_rank_as_a_0d_array():
    # np.array(2) raised "iteration over a 0-d array"
    c = _sample_cov(6)
    assert gradient_energy(c, None, c, np.array(2), controls=0) == gradient_energy(
        c, None, c, [2], controls=0
    )
    with pytest.raises(InputError):
        gradient_energy(c, None, c, np.array(2.5), controls=0)
