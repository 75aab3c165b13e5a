"""Bad arguments to the metric functions raise a one-line InputError (never numpy's or scipy's
TypeError/ValueError, never a silently truncated value); odd-but-valid spellings work."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.errors import InputError
from geomscope.metrics.subspace import gradient_energy, top_eigenpairs


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def _cov(d, seed=4):
    return np.cov(np.random.default_rng(seed).standard_normal((50, d)), rowvar=False)


@pytest.mark.parametrize("k", [7, 0, -1, 2.7, "3", True, None])
def test_top_eigenpairs_refuses_a_bad_count(k):
    # D + 1 and 0 reached scipy's ValueError, 2.7 was truncated to 2
    with pytest.raises(InputError) as e:
        top_eigenpairs(_cov(6), k)
    assert "1 to" in _one_line(e)


def test_top_eigenpairs_accepts_every_count_from_1_to_d():
    c = _cov(6)
    w, v = np.linalg.eigh(c)
    for k in (1, np.int64(3), np.array(6)):
        lam, vecs = top_eigenpairs(c, k)
        n = int(k)
        np.testing.assert_allclose(lam, w[::-1][:n], rtol=1e-12)
        np.testing.assert_allclose(np.abs(vecs.T @ v[:, ::-1][:, :n]), np.eye(n), atol=1e-10)


def test_act_eig_of_another_matrix_is_an_input_error():
    d = 6
    c = _cov(d)
    for bad in (
        top_eigenpairs(np.eye(d + 2), 3),  # eigenvectors of another size (numpy's matmul ValueError)
        top_eigenpairs(c, 2),  # too few pairs for max(ranks) + 1 = 3
        (np.ones(3), np.ones((d, 2))),  # eigenvalues and eigenvectors that do not pair up
        "eig",  # not a pair
    ):
        with pytest.raises(InputError) as e:
            gradient_energy(c, None, c, [2], controls=0, act_eig=bad)
        assert "top_eigenpairs" in _one_line(e)
    (row,) = gradient_energy(c, None, c, [2], controls=0, act_eig=top_eigenpairs(c, 3))
    assert row["energy"] == pytest.approx(
        gradient_energy(c, None, c, [2], controls=0)[0]["energy"], rel=1e-12
    )


def test_one_rank_as_a_0d_array():
    # np.array(2) raised "iteration over a 0-d array"
    c = _cov(6)
    assert gradient_energy(c, None, c, np.array(2), controls=0) == gradient_energy(
        c, None, c, [2], controls=0
    )
    with pytest.raises(InputError):
        gradient_energy(c, None, c, np.array(2.5), controls=0)
