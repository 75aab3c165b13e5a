"""The argument checks the metric functions share (geomscope/metrics/validate.py): what counts as a
whole number."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.metrics.validate import whole_number


@pytest.mark.parametrize("bad", [True, np.bool_(False), 2.0, np.float64(3.0), "2", None, [2]])
def test_whole_number_refuses_what_is_not_a_count(bad):
    assert whole_number(bad) is None


@pytest.mark.parametrize("good", [0, 7, np.int64(7), np.uint8(7), np.array(7)])
def test_whole_number_takes_python_and_numpy_integers(good):
    got = whole_number(good)
    assert got == int(good) and type(got) is int
