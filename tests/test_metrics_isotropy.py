"""IsoScore / IsoScore*: agreement with the isoscore package and the published steps, analytic
truths, invariances, torch equivalence and gradients, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import one_line_message
from hypothesis import given, settings
from hypothesis import strategies as st
from IsoScore import IsoScore as isp

from geomscope.errors import DataError, InputError
from geomscope.metrics import (
    isoscore,
    isoscore_cap,
    isoscore_from_cov,
    isoscore_published,
    isoscore_star,
    isoscore_star_from_cov,
    isoscore_star_from_cov_torch,
    isoscore_star_torch,
    isoscore_torch,
    rank_limited,
    shrinkage_target,
)


def _cloud(n, d, seed, kind="aniso"):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, d))
    if kind == "iso":
        return z
    if kind == "aniso":  # decaying spectrum, random rotation, offset
        q, _ = np.linalg.qr(rng.standard_normal((d, d)))
        return (z * np.geomspace(10.0, 0.01, d)) @ q.T + rng.standard_normal(d) * 5
    if kind == "outlier":  # one rogue dimension, like LM activations
        z[:, 0] *= 50.0
        return z + 3.0
    raise ValueError(kind)


CASES = [
    (n, d, s, k)
    for s, (n, d) in enumerate(
        [(200, 10), (50, 80), (7, 30), (1000, 64), (3, 5), (120, 120), (40, 8), (2, 4)]
    )
    for k in ("iso", "aniso", "outlier")
]  # 24 cases, 9 with N <= D


@pytest.mark.parametrize("n,d,seed,kind", CASES)
def test_isoscore_agrees_with_package_and_published(n, d, seed, kind):
    x = _cloud(n, d, seed, kind)
    ours = isoscore(x)
    assert ours == pytest.approx(float(isp.IsoScore(x)), abs=1e-6)
    assert ours == pytest.approx(isoscore_published(x), abs=1e-10)
    assert ours == pytest.approx(isoscore_torch(torch.tensor(x)).item(), abs=1e-12)
    assert 0.0 <= ours <= isoscore_cap(n, d) + 1e-12


@pytest.mark.parametrize("n,d,seed,kind", CASES[::2])
@pytest.mark.parametrize("zeta", [0.0, 0.2, 0.75, 1.0])
def test_isoscore_star_agrees_with_package(n, d, seed, kind, zeta):
    x = _cloud(n, d, seed, kind)
    c0 = np.cov(_cloud(500, d, seed + 100, "aniso").T)
    c = np.cov(x.T)
    trace_c0 = np.eye(d) * np.trace(c) / d
    for target, c0_pkg in (("identity", np.eye(d)), ("trace", trace_c0), (c0, c0)):
        ours = isoscore_star(x, zeta, target)
        assert ours == pytest.approx(float(isp.IsoScore_star(x, c0_pkg, zeta)), abs=1e-6)
        assert ours == pytest.approx(isoscore_published(x, C0=c0_pkg, zeta=zeta), abs=1e-10)
        assert ours == pytest.approx(isoscore_star_from_cov(c, zeta, target), abs=1e-12)
        t0 = None if isinstance(target, str) and target == "trace" else torch.tensor(c0_pkg)
        assert ours == pytest.approx(isoscore_star_torch(torch.tensor(x), zeta, t0).item(), abs=1e-12)
        assert ours == pytest.approx(
            isoscore_star_from_cov_torch(torch.tensor(c), zeta, t0).item(), abs=1e-12
        )
    assert isoscore_star(x, 0.0) == pytest.approx(isoscore(x), abs=1e-13)


def test_float32_input_agrees_with_package():
    x = _cloud(2000, 64, 1, "aniso").astype(np.float32)
    assert isoscore(x) == pytest.approx(float(isp.IsoScore(x)), abs=1e-5)
    assert isoscore(x) == pytest.approx(isoscore_published(x), abs=1e-10)


def _sym(points):
    return np.asarray(points, dtype=np.float64)


def test_analytic_truths_in_r3():
    t = np.linspace(-1, 1, 11)[:, None]
    line = t * np.array([1.0, 2.0, 3.0])
    disk = _sym([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0]])
    ball = _sym([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]])
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((3, 3)))
    for rot in (np.eye(3), q):
        assert isoscore(line @ rot) == pytest.approx(0.0, abs=1e-12)
        assert isoscore(disk @ rot) == pytest.approx(0.5, abs=1e-12)
        assert isoscore(ball @ rot) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("k,d", [(1, 5), (2, 5), (4, 7), (10, 10), (3, 768)])
def test_k_equal_eigenvalues(k, d):
    e = np.eye(d)[:k]
    x = np.vstack([e, -e]) * 2.5
    assert isoscore(x) == pytest.approx((k - 1) / (d - 1), abs=1e-12)
    assert isoscore_from_cov(np.diag([3.0] * k + [0.0] * (d - k))) == pytest.approx((k - 1) / (d - 1))


def test_rank_limit_cap_is_reached_by_a_simplex():
    n, d = 6, 20
    x = np.eye(d)[:n] * 3.0  # n equidistant points: the centred cloud spans n-1 dims isotropically
    assert rank_limited(n, d) and not rank_limited(21, 20)
    assert isoscore(x) == pytest.approx(isoscore_cap(n, d), abs=1e-12)


def _orth(d, seed):
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 40),
    d=st.integers(2, 12),
    seed=st.integers(0, 10_000),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-1e3, 1e3),
    zeta=st.floats(0.0, 1.0),
)
def test_invariances(n, d, seed, scale, shift, zeta):
    x = _cloud(n, d, seed, "aniso")
    base = isoscore(x)
    q = _orth(d, seed + 1)
    assert isoscore(x @ q) == pytest.approx(base, abs=1e-9)
    assert isoscore(x + shift) == pytest.approx(base, abs=1e-9)
    assert isoscore(x * scale) == pytest.approx(base, abs=1e-9)
    star = isoscore_star(x, zeta, "trace")
    assert isoscore_star(x * scale + shift, zeta, "trace") == pytest.approx(star, abs=1e-9)
    assert isoscore_star(x @ q, zeta, "trace") == pytest.approx(star, abs=1e-9)
    assert base - 1e-12 <= star <= 1 + 1e-12  # shrinking toward isotropy never lowers the score


def test_identity_target_is_not_scale_invariant():
    x = _cloud(500, 10, 3, "outlier")
    small, large = isoscore_star(x * 1e-3, 0.2, "identity"), isoscore_star(x * 1e3, 0.2, "identity")
    assert small > 0.9999 and large < 0.2
    assert large == pytest.approx(isoscore(x), abs=1e-3)
    assert isoscore_star(x * 1e-3, 0.2) == pytest.approx(isoscore_star(x * 1e3, 0.2), abs=1e-12)


def test_shrinkage_target_forms():
    c = np.diag([4.0, 1.0, 1.0])
    np.testing.assert_array_equal(shrinkage_target(c, "identity"), np.eye(3))
    np.testing.assert_allclose(shrinkage_target(c, "trace"), 2.0 * np.eye(3))
    np.testing.assert_array_equal(shrinkage_target(c, c * 2), c * 2)
    with pytest.raises(InputError, match="unknown shrinkage target"):
        shrinkage_target(c, "ledoit")
    with pytest.raises(DataError, match="C0"):
        shrinkage_target(c, np.eye(4))
    assert isoscore_star_from_cov(c, 1.0, "trace") == pytest.approx(1.0)
    assert isoscore_star_from_cov(c, 1.0, np.diag([1.0, 1.0, 0.0])) == pytest.approx(0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_low_precision_computes_in_float64(dtype):
    x = torch.tensor(_cloud(64, 16, 4, "outlier")).to(dtype)
    ref = isoscore(x.double().numpy())
    got = isoscore_torch(x)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref, abs=1e-6)
    xr = x.clone().requires_grad_(True)
    isoscore_star_torch(xr, 0.2).backward()
    assert xr.grad.dtype == dtype and torch.isfinite(xr.grad.float()).all()


@pytest.mark.parametrize("n,d", [(12, 5), (4, 9)])  # N > D and N < D
def test_gradcheck(n, d):
    x = torch.tensor(_cloud(n, d, 5, "aniso"), requires_grad=True)
    c0 = torch.tensor(np.cov(_cloud(50, d, 6, "aniso").T))
    assert torch.autograd.gradcheck(isoscore_torch, (x,))
    assert torch.autograd.gradcheck(lambda a: isoscore_star_torch(a, 0.3), (x,))
    assert torch.autograd.gradcheck(lambda a: isoscore_star_torch(a, 0.3, c0), (x,))
    c = torch.tensor(np.cov(_cloud(30, d, 7, "aniso").T), requires_grad=True)
    assert torch.autograd.gradcheck(lambda m: isoscore_star_from_cov_torch(m, 0.3), (c,))
    assert torch.autograd.gradcheck(lambda m: isoscore_star_from_cov_torch(m, 0.0, c0), (c,))


def test_torch_gradient_pushes_toward_isotropy():
    x = torch.tensor(_cloud(100, 8, 8, "aniso"), requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.1)
    before = isoscore_torch(x).item()
    for _ in range(30):
        opt.zero_grad()
        (-isoscore_torch(x)).backward()
        opt.step()
    assert isoscore_torch(x).item() > before + 0.05


@pytest.mark.parametrize("fn", [isoscore, lambda x: isoscore_star(x, 0.2), isoscore_published])
def test_bad_input_numpy(fn):
    with pytest.raises(DataError, match="at least 2 points") as e:
        fn(np.ones((1, 5)))
    one_line_message(e)
    with pytest.raises(DataError, match="at least 2 dimensions"):
        fn(np.random.default_rng(0).standard_normal((10, 1)))
    with pytest.raises(DataError, match="zero total variance"):
        fn(np.full((50, 4), 0.1))
    bad = np.random.default_rng(0).standard_normal((10, 3))
    bad[2, 1] = np.nan
    with pytest.raises(DataError, match="1 of 10 rows"):
        fn(bad)
    with pytest.raises(DataError, match="2-D"):
        fn(np.ones(5))


@pytest.mark.parametrize("n", [100, 3])  # the Moments path and the N < D Gram path
def test_overflow_is_reported_not_silent(n):
    x = np.random.default_rng(0).standard_normal((n, 5)) * 1e200
    with pytest.raises(DataError, match="overflow"):
        isoscore(x)


def test_bad_input_cov_and_parameters():
    with pytest.raises(DataError, match="zero total variance"):
        isoscore_from_cov(np.zeros((3, 3)))
    with pytest.raises(DataError, match="square"):
        isoscore_from_cov(np.ones((3, 4)))
    with pytest.raises(DataError, match="NaN"):
        isoscore_from_cov(np.full((2, 2), np.nan))
    x = _cloud(20, 4, 0)
    for z in (-0.1, 1.5, float("nan")):
        with pytest.raises(InputError, match="zeta"):
            isoscore_star(x, z)
        with pytest.raises(InputError, match="zeta"):
            isoscore_star_torch(torch.tensor(x), z)


def test_bad_input_torch():
    with pytest.raises(DataError, match="not finite"):
        isoscore_torch(torch.ones(10, 4))
    x = torch.randn(10, 4, dtype=torch.float64)
    x[3, 0] = float("inf")
    with pytest.raises(DataError, match="not finite"):
        isoscore_star_torch(x, 0.2)
    with pytest.raises(DataError, match="at least 2"):
        isoscore_torch(torch.randn(1, 4))
    with pytest.raises(DataError, match="C0"):
        isoscore_star_torch(torch.randn(10, 4), 0.2, torch.eye(3))
    with pytest.raises(InputError):
        isoscore_torch(np.ones((3, 3)))
    assert not torch.isfinite(isoscore_torch(torch.ones(10, 4), check=False))


@pytest.mark.parametrize("scale", [1e-150, 1e-80, 1e-30, 1e40, 1e100, 1e150])
def test_participation_ratio_does_not_depend_on_the_scale(scale):
    """PR = tr(C)^2 / ||C||_F^2 is scale-free, but ||C||_F^2 squares C: at 1e-80 it fell among
    float64's subnormals (IsoScore* 4.5e-5 off, silently), beyond 1e+-78 it under- or overflowed
    (refused, or NaN from the spectrum). A power-of-two rescale keeps every digit."""
    from geomscope.metrics import participation_ratio, spectrum

    x = _cloud(500, 8, 0)
    c = np.cov(x.T)
    cs = np.cov((x * scale).T)
    assert isoscore(x * scale) == pytest.approx(isoscore(x), rel=1e-12)
    assert isoscore_from_cov(cs) == pytest.approx(isoscore_from_cov(c), rel=1e-12)
    assert isoscore_star(x * scale, 0.2) == pytest.approx(isoscore_star(x, 0.2), rel=1e-12)
    assert isoscore(x[:5] * scale) == pytest.approx(isoscore(x[:5]), rel=1e-12)  # N < D: the Gram path
    assert participation_ratio(cs) == pytest.approx(participation_ratio(c), rel=1e-12)
    assert spectrum(cs)["pr"] == pytest.approx(spectrum(c)["pr"], rel=1e-12)


def test_participation_terms_are_the_plain_ones_in_the_normal_range():
    """No rescale between 2^-400 and 2^400: the same bits as tr(C) and vdot(C, C)."""
    from geomscope.metrics.validate import participation_terms

    c = np.cov(_cloud(200, 6, 1).T) * 3.7
    assert participation_terms(c) == (float(np.trace(c)), float(np.vdot(c, c)))


@pytest.mark.parametrize(
    ("matrix", "match"),
    [
        ([[1.0, 5.0], [0.0, 1.0]], "not symmetric"),
        (np.diag([1.0, -0.5, 1.0]), "negative variance"),
        ([[1.0, 2.0], [2.0, 1.0]], "participation ratio"),  # eigenvalues 3 and -1
        ([["a", "b"], ["c", "d"]], "numeric"),
    ],
)
def test_a_matrix_that_is_no_covariance_is_refused(matrix, match):
    """Refused, where taking them would give plausible numbers (0.0, or a PR below 1 for the
    spectrum)."""
    with pytest.raises(DataError, match=match):
        isoscore_from_cov(matrix)
    with pytest.raises(DataError, match=match if match != "participation ratio" else "not a covariance"):
        isoscore_star_from_cov(matrix, 0.2)


def test_the_spectrum_refuses_negative_eigenvalues_beyond_rounding():
    from geomscope.metrics import spectrum

    with pytest.raises(DataError, match="eigenvalues run from -1 to 3"):
        spectrum(np.diag([3.0, 1.0, 1.0]) - np.array([[0, 0, 0], [0, 0, 2.0], [0, 2.0, 0]]))
    # rounding-sized negatives of a rank-deficient covariance are clipped and noted, as before
    x = _cloud(4, 8, 2)
    sp = spectrum(np.cov(x.T))
    assert sp["n_clipped"] >= 0 and sp["pr"] >= 1.0


def test_a_shrinkage_target_that_is_no_covariance_is_refused():
    x = _cloud(100, 6, 1)
    for c0, match in ((-np.eye(6), "negative variance"), (np.triu(np.ones((6, 6))), "not symmetric")):
        with pytest.raises(DataError, match=match):
            isoscore_star(x, 0.2, c0)


def test_the_zero_variance_message_says_what_to_do_when_rows_differ():
    """std / |mean| = 1e-13 is within the rounding margin the check allows; the message said 'below
    float64 resolution' of rows 670 ulps apart. It says the margin, and to subtract the mean."""
    x = 1e8 + 1e-5 * np.random.default_rng(0).standard_normal((2000, 8))
    with pytest.raises(DataError, match="subtract the mean row first"):
        isoscore(x)
    assert isoscore(x - x.mean(0)) == pytest.approx(isoscore_published(x - x.mean(0)), abs=1e-9)


def test_a_covariance_handed_over_in_half_precision_is_accepted():
    import geomscope.metrics as gm

    x = np.random.default_rng(0).standard_normal((500, 64)).astype(np.float32)
    c = x.T @ x / 499
    want = gm.isoscore_from_cov(c)
    assert gm.isoscore_from_cov(c.astype(np.float16)) == pytest.approx(want, rel=1e-3)
    assert gm.isoscore_from_cov(torch.tensor(c).bfloat16()) == pytest.approx(want, rel=1e-2)
