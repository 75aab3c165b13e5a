"""Intrinsic dimension of a layer's seeded row sample, with a standard error.

The sample is the ``--id-sample`` rows with the smallest seeded hashes among the rows the layer
uses (bottom-k sampling while streaming: see select.py). Exact duplicate rows are removed before
any estimator (counted per layer as ``twonn_duplicates_removed`` and in
``params.duplicates_removed``).

- TwoNN (key ``twonn``): :func:`geomscope.metrics.twonn.twonn_error` with ``method="decimation"``:
  the distinct points are split at random into ``--id-repeats`` disjoint parts, TwoNN on each,
  SE = std(ddof=1)/sqrt(parts) of the part estimates; the value is the full-sample TwoNN.
- Other estimators (keys ``id_<name>``, from ``geomscope.metrics.intrinsic``): the same decimation
  scheme around :func:`estimate_id`.
"""

from __future__ import annotations

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.metrics.twonn import decimation_se
from geomscope.schema import EXTRA_ID_PREFIX
from geomscope.score.options import ScoreOptions


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
        try:
            if name == "twonn":
                from geomscope.metrics.twonn import twonn_error

                res = twonn_error(
                    x,
                    method="decimation",
                    n_splits=o.id_repeats,
                    discard_fraction=o.discard_fraction,
                    estimator=o.twonn_fit,
                    dedup=False,
                    seed=o.seed,
                )
                out["values"][key], out["se"][key] = float(res.estimate), float(res.standard_error)
            else:
                from geomscope.metrics.intrinsic import estimate_id

                def fn(a, name=name):
                    return float(estimate_id(a, name).dimension)

                out["values"][key] = fn(x)
                out["se"][key] = decimation_se(x, fn, o.id_repeats, np.random.default_rng(o.seed))
                if out["se"][key] is None:
                    notes.setdefault(f"se.{key}", "too few distinct points to split for the standard error")
        except (DataError, InputError, ValueError, np.linalg.LinAlgError) as e:
            out["values"][key] = None
            out["se"][key] = None
            notes.setdefault(key, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return out
