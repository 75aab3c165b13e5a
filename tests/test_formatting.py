"""How numbers read (geomscope/formatting.py): nouns agree with their counts, and a value with its
standard error has two significant digits in the SE and the value rounded to the same place."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "n, noun, plural, expected",
    [
        (1, "shard", None, "1 shard"),
        (0, "shard", None, "0 shards"),
        (4, "document", None, "4 documents"),
        (1234, "row", None, "1,234 rows"),
        (1, "process", "processes", "1 process"),
        (2, "process", "processes", "2 processes"),
    ],
)
def test_counted_agrees_with_its_number(n, noun, plural, expected):
    from geomscope.formatting import counted

    assert counted(n, noun, plural) == expected


@pytest.mark.parametrize(
    "value, se, expected",
    [
        (0.4123, 0.0157, ("0.412", "0.016")),
        (12.345, 1.2, ("12.3", "1.2")),
        (0.0996, 0.0996, ("0.10", "0.10")),  # the SE rounds up a decade: still two digits
        (101.3, 2.14, ("101.3", "2.1")),
        (12345.0, 157.0, ("12340", "160")),
        (-0.0003, 0.02, ("0.000", "0.020")),  # no "-0.000"
        (1.234e-6, 3.2e-8, ("1.234e-06", "3.2e-08")),  # small: scientific
        (1.5e7, 2.3e5, ("1.500e+07", "2.3e+05")),  # large: scientific
        (0.5, 0.0, ("0.5", "0")),
        (0.5, None, ("0.5", None)),
        (0.5, float("nan"), ("0.5", None)),
        (None, 0.1, ("-", None)),
        (float("nan"), 0.1, ("nan", None)),
    ],
)
def test_value_and_se_round_to_the_se(value, se, expected):
    from geomscope.formatting import value_and_se

    assert value_and_se(value, se) == expected


def test_value_and_se_read_numpy_scalars():
    import numpy as np

    from geomscope.formatting import value_and_se

    assert value_and_se(np.float32(0.4123), np.float32(0.0157)) == ("0.412", "0.016")
    assert value_and_se(np.float64(2.0), np.float64("nan")) == ("2", None)


def test_shown_name_keeps_short_names_and_cuts_long_ones_in_the_middle():
    from geomscope.formatting import SHOWN_NAME_CHARS, shown_name

    hub = "sentence-transformers/all-MiniLM-L6-v2"
    assert shown_name(hub) == hub and shown_name(None) == "None"
    exact = "x" * SHOWN_NAME_CHARS
    assert shown_name(exact) == exact
    path = "/runs/" + "a" * 500 + "/checkpoints/step-1000"
    cut = shown_name(path)
    assert len(cut) == SHOWN_NAME_CHARS and cut.startswith("/runs/aaa") and cut.endswith("/step-1000")
    assert "…" in cut and shown_name(path, limit=11) == "/runs…-1000"
