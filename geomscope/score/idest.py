"""Intrinsic dimension of a layer's seeded row sample, with a standard error.

The sample is the ``--id-sample`` rows with the smallest seeded hashes among the rows the layer
uses (bottom-k sampling while streaming: see select.py). Exact duplicate rows are removed before
any estimator (counted per layer as ``twonn_duplicates_removed`` and in
``params.duplicates_removed``).

- TwoNN (key ``twonn``): as :func:`geomscope.metrics.twonn.twonn_error` with ``method="decimation"``
  (the same numbers): the distinct points are split at random into ``--id-repeats`` disjoint parts,
  TwoNN on each, SE = std(ddof=1)/sqrt(parts) of the part estimates; the value is the full-sample
  TwoNN.
- Other estimators (keys ``id_<name>``, from ``geomscope.metrics.intrinsic``): the same decimation
  scheme around :func:`estimate_id`.

The value and its standard error are apart: where the sample cannot be split into parts of >= 3
distinct rows the value stands and the SE is null with a note (``se.<key>``), for every estimator.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError, InputError, first_line
from geomscope.metrics.twonn import decimation_se
from geomscope.schema import EXTRA_ID_PREFIX
from geomscope.score.options import ROWS_PER_PART, ScoreOptions


def uncertainty_methods(o: ScoreOptions) -> dict[str, str]:
    out = {}
    for name in o.id_names:
        key = "twonn" if name == "twonn" else f"{EXTRA_ID_PREFIX}{name}"
        out[key] = (
            f"repeated decimation: the de-duplicated sample split at random into {o.id_repeats} disjoint "
            f"parts (seed {o.seed}), the estimator on each, SE = std(ddof=1)/sqrt({o.id_repeats}) of "
            "the part estimates; value = the full-sample estimate"
        )
    return out


def _dedup(sample: np.ndarray) -> tuple[np.ndarray, int]:
    from geomscope.metrics.twonn import dedup_rows

    x, removed, _ = dedup_rows(sample)
    return x, removed


def estimate(sample, o: ScoreOptions, notes: dict) -> dict:
    """{"values": {key: float|None}, "se": {key: float|None}, "n_used", "duplicates_removed"}."""
    out = {"values": {}, "se": {}, "n_used": 0, "duplicates_removed": 0}
    keys = {n: ("twonn" if n == "twonn" else f"{EXTRA_ID_PREFIX}{n}") for n in o.id_names}
    if sample is None or len(sample) < 3:
        n = 0 if sample is None else len(sample)
        for k in keys.values():
            out["values"][k] = None
            out["se"][k] = None
            notes.setdefault(k, f"{n} sampled row(s); intrinsic dimension needs at least 3")
        return out
    x = np.asarray(sample, dtype=np.float32 if sample.dtype.itemsize <= 4 else np.float64)
    x, removed = _dedup(x)
    out["duplicates_removed"] = int(removed)
    out["n_used"] = int(x.shape[0])
    for name, key in keys.items():
        fn = _estimator(name, o)
        try:
            out["values"][key] = fn(x)
        except (DataError, InputError, ValueError, np.linalg.LinAlgError) as e:
            out["values"][key] = None
            out["se"][key] = None
            notes.setdefault(key, first_line(e))
            continue
        # the standard error is apart from the value: too few distinct rows for the parts (TwoNN
        # itself is null at --id-sample 3..11), or a part its estimator refuses, leave the
        # full-sample value standing
        out["se"][key] = None
        if x.shape[0] < ROWS_PER_PART * o.id_repeats:  # asked before splitting: each part costs memory
            notes.setdefault(
                f"se.{key}",
                f"{x.shape[0]} distinct sampled rows are too few to split into --id-repeats "
                f"{o.id_repeats} parts of >= {ROWS_PER_PART} for the standard error; use a larger "
                "--id-sample or fewer --id-repeats",
            )
            continue
        try:
            out["se"][key] = decimation_se(x, fn, o.id_repeats, np.random.default_rng(o.seed))
        except (DataError, InputError, ValueError, np.linalg.LinAlgError) as e:
            notes.setdefault(f"se.{key}", f"no standard error: a part's estimate failed ({first_line(e)})")
    return out


def _estimator(name: str, o: ScoreOptions):
    """points -> the estimate (float) of ``name``: the full sample's value and each decimation part's.
    TwoNN as :func:`geomscope.metrics.twonn.twonn_error` (method="decimation") runs it: the points are
    de-duplicated already, and the same seeded split gives the same standard error."""
    if name == "twonn":
        from geomscope.metrics.twonn import twonn

        def fn(a):
            return float(twonn(a, o.discard_fraction, o.twonn_fit, dedup=False).dimension)

    else:
        from geomscope.metrics.intrinsic import estimate_id

        def fn(a):
            return float(estimate_id(a, name).dimension)

    return fn
