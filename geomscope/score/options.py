"""Scoring options: one validated, typed config (the CLI builds it; the library takes it)."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from geomscope.choices import (
    MAX_SEED,
    MAX_SEED_TEXT,
    OUTLIER_RULES,
    OUTLIER_STATS,
    PRODUCT_DTYPES,
    TWONN_FITS,
)
from geomscope.errors import InputError

MOMENT_METRICS = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers")
CORE_METRICS = (*MOMENT_METRICS, "twonn", "partition")
DEFAULT_METRICS = CORE_METRICS
AVGCOS_VARIANTS = ("plain", "centred", "standardised")
_VARIANT_ALIASES = {"centered": "centred", "standardized": "standardised", "raw": "plain"}
DEFAULT_OUTLIER_THRESHOLD = {"variance": 5.0, "zscore": 3.0, "quantile": 0.99, "magnitude": 6.0}
DEFAULT_ID_REPEATS = 4
#: rows each decimation part needs (geomscope.metrics.twonn.decimation_se: fewer give no SE)
ROWS_PER_PART = 3


def id_estimator_names() -> tuple[str, ...]:
    """Names of the intrinsic-dimension estimators, TwoNN first (metrics.intrinsic.ID_ESTIMATORS's keys)."""
    from geomscope.choices import SKDIM_ESTIMATORS  # the registry's names, without importing sklearn

    return ("twonn", *SKDIM_ESTIMATORS)


@dataclass
class ScoreOptions:
    """Everything ``score`` needs besides the input path. See ``geomscope score --help``.

    metrics: names among isoscore, isoscore_star, avgcos, spectrum, outliers, twonn, partition and
    the intrinsic-dimension estimators of ``geomscope.metrics.intrinsic.ID_ESTIMATORS``.
    shrinkage_target: "trace" | "identity" | a .npy (D, D) covariance | a run directory (that run's
    covariance of the same layer) | "layer:NAME" (this run's layer NAME); "file:"/"run:" prefixes
    are accepted too.
    """

    metrics: tuple[str, ...] = DEFAULT_METRICS
    zeta: float = 0.2
    shrinkage_target: str = "trace"
    avgcos_variants: tuple[str, ...] = AVGCOS_VARIANTS
    outlier_rule: str = "variance"
    outlier_threshold: float | None = None
    outlier_stat: str = "variance"  # zscore rule: "variance" | "mean_abs"
    discard_fraction: float = 0.1
    id_sample: int = 5000
    id_estimator: tuple[str, ...] = ()  # extra ID estimators besides those named in metrics
    twonn_fit: str = "linear"
    seed: int = 0
    exclude_special: bool = False
    layers: tuple[str, ...] | None = None
    max_rows: int | None = None
    workers: int = 1
    partial: bool = False
    jackknife_groups: int = 10
    id_repeats: int | None = None  # None: DEFAULT_ID_REPEATS, fewer where --id-sample cannot fill them
    memory_mb: float = 2048
    verify: bool = True
    dataset: str | None = None
    columns: tuple[str, ...] | None = None  # arrays of an .npz/.safetensors/.pt/Arrow/Parquet source
    block_rows: int | None = None
    product_dtype: str = "float64"  # the covariance's block products (metrics/moments.py): float64 | float32
    basis: str | None = None  # a run of activations: gradient energy in its top-r subspaces (gradenergy.py)
    ranks: tuple[int, ...] = (8, 32, 128)
    controls: int = 20
    scheduler: str | None = None  # Dask: "local:N" | "tcp://HOST:PORT" | "FILE.json" (dask_executor.py)
    extra_id: tuple[str, ...] = field(default=(), repr=False)  # filled by validate()

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> ScoreOptions:
        """A normalised copy; InputError (one line) for anything out of range, unknown or mistyped.

        Lists (metrics, avgcos_variants, id_estimator, layers, columns) may be given as one comma
        string ("isoscore,avgcos"), as the CLI takes them; numbers may be numpy scalars."""
        metrics, est, extra = _checked_metrics(_listed(self.metrics), _listed(self.id_estimator))
        variants = _checked_variants(_listed(self.avgcos_variants), "avgcos" in metrics)
        rule, threshold = _checked_outlier_rule(self.outlier_rule, self.outlier_threshold, self.outlier_stat)
        n = _Numbers(self)
        id_sample = n.whole("id_sample", lo=3)
        return replace(
            self,
            metrics=metrics,
            zeta=n.real("zeta", lo=0.0, hi=1.0),
            avgcos_variants=variants,
            outlier_rule=rule,
            outlier_threshold=threshold,
            id_estimator=est,
            extra_id=extra,
            discard_fraction=n.real("discard_fraction", lo=0.0, hi=1.0, hi_open=True),
            id_sample=id_sample,
            max_rows=n.whole("max_rows", lo=2, optional=True),
            workers=n.whole("workers", lo=1),
            jackknife_groups=_checked_groups(n.whole("jackknife_groups", lo=0)),
            memory_mb=n.real("memory_mb", lo=0.0, lo_open=True),
            id_repeats=_checked_repeats(n.whole("id_repeats", lo=2, optional=True), id_sample),
            seed=n.whole(
                "seed", lo=0, hi=MAX_SEED, why=f" ({MAX_SEED_TEXT}: the row samples hash it in 64 bits)"
            ),
            twonn_fit=_one_of("--twonn-fit", self.twonn_fit, TWONN_FITS),
            product_dtype=_one_of("--product-dtype", self.product_dtype, PRODUCT_DTYPES),
            layers=_selection("--layers", self.layers, "layers: names, indices, ranges a-b, all or blocks"),
            columns=_selection("--column", self.columns, "array names"),
            shrinkage_target=normalise_target(self.shrinkage_target),
            ranks=_checked_ranks(self.ranks),
            controls=n.whole("controls", lo=0),
            scheduler=_checked_scheduler(self.scheduler, self.workers),
        )

    # -- convenience -------------------------------------------------------------------------
    def wants(self, metric: str) -> bool:
        return metric in self.metrics

    @property
    def moment_metrics(self) -> bool:
        return any(m in self.metrics for m in MOMENT_METRICS)

    @property
    def id_names(self) -> tuple[str, ...]:
        """ID estimators to run: twonn (key "twonn") then the others (keys "id_<name>")."""
        return (("twonn",) if "twonn" in self.metrics else ()) + self.extra_id

    @property
    def needs_second_pass(self) -> bool:
        return "avgcos" in self.metrics and any(v != "plain" for v in self.avgcos_variants)


def _one_of(option: str, value, allowed: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in allowed:
        raise InputError(f"{option} must be one of {', '.join(allowed)}; got {value!r}")
    return v


def _checked_metrics(names, id_estimators) -> tuple[tuple, tuple, tuple]:
    """(metrics, --id-estimator names, extra estimators run besides TwoNN); ``all`` = the core seven."""
    ids = id_estimator_names()
    known = (*CORE_METRICS, *[n for n in ids if n != "twonn"])
    metrics = []
    for m in (str(x).strip().lower() for x in names):
        if m == "all":
            metrics.extend(CORE_METRICS)
        elif m and m not in known:
            raise InputError(f"unknown metric {m!r}; choose among {', '.join(known)}")
        elif m:
            metrics.append(m)
    metrics = list(dict.fromkeys(metrics))
    if not metrics:
        raise InputError("--metrics is empty; name at least one metric, e.g. --metrics isoscore")
    est = [e for e in (str(x).strip().lower() for x in id_estimators) if e]
    for e in est:
        if e not in ids:
            raise InputError(f"unknown --id-estimator {e!r}; choose among {', '.join(ids)}")
    run_ids = [m for m in metrics if m in ids] + est
    if "twonn" in run_ids and "twonn" not in metrics:
        metrics.append("twonn")
    extra = [e for e in dict.fromkeys(run_ids) if e != "twonn"]
    return tuple(metrics), tuple(est), tuple(extra)


def _checked_variants(names, wanted: bool) -> tuple[str, ...]:
    variants = []
    for v in names:
        v = _VARIANT_ALIASES.get(str(v).strip().lower(), str(v).strip().lower())
        if v not in AVGCOS_VARIANTS:
            raise InputError(
                f"unknown --avgcos-variants entry {v!r}; choose among {', '.join(AVGCOS_VARIANTS)}"
            )
        variants.append(v)
    if wanted and not variants:
        raise InputError("--avgcos-variants is empty; give plain, centred and/or standardised")
    return tuple(dict.fromkeys(variants))


def _checked_outlier_rule(rule, threshold, stat) -> tuple[str, float]:
    """(rule, threshold): the rule's default threshold when none is given; quantiles lie in (0, 1)."""
    rule = _one_of("--outlier-rule", rule, OUTLIER_RULES)
    _one_of("--outlier-stat", stat, OUTLIER_STATS)
    if threshold is None:
        thr = DEFAULT_OUTLIER_THRESHOLD[rule]
    else:
        thr = _Numbers.as_real("--outlier-threshold", threshold)
    if not thr == thr:
        raise InputError("--outlier-threshold must be a number")
    if rule == "quantile" and not 0.0 < thr < 1.0:
        raise InputError(f"--outlier-threshold for the quantile rule is a quantile in (0, 1); got {thr}")
    if rule != "quantile" and thr <= 0:
        raise InputError(f"--outlier-threshold must be > 0; got {thr}")
    return rule, float(thr)


def _checked_ranks(ranks) -> tuple[int, ...]:
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
            raise InputError(f"--rank entries must be whole numbers >= 1; got {r!r}")
        out.append(int(r))
    if not out:
        raise InputError("--rank is empty; give ranks such as 8,32,128")
    return tuple(sorted(set(out)))


def _checked_scheduler(scheduler, workers) -> str | None:
    """``--scheduler``: well formed, Dask importable, and not with ``--workers N > 1`` (the Dask workers
    read the shards; a second pool size would be ignored silently, so it is refused)."""
    if scheduler is None:
        return None
    from geomscope.score.dask_executor import parse_scheduler, require_distributed

    s = parse_scheduler(scheduler)
    if workers != 1:
        raise InputError(
            f"--workers {workers} and --scheduler {s} both say where the shards are read; the Dask "
            "workers read them with --scheduler: drop --workers (or set the cluster's size, local:N)"
        )
    require_distributed()
    return s


def _listed(value) -> list:
    """A list option's items: a str is one comma list (iterating it would give its characters,
    metrics="isoscore" read as the metric 'i'); anything else is iterated as given."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def _selection(option: str, value, what: str) -> tuple | None:
    """None (everything) or the named items; a selection given but empty (``--layers=,``) is refused
    rather than read as everything."""
    if value is None:
        return None
    items = _listed(value)
    if not items:
        raise InputError(f"{option} is empty; give {what} (comma list), or leave it out for all of them")
    return tuple(items)


def _checked_repeats(repeats: int | None, id_sample: int) -> int:
    """--id-repeats: the decimation splits at most --id-sample distinct rows into parts of
    ROWS_PER_PART rows or more, so more parts than a third of it can never give a standard error
    (and 10^14 parts ran out of memory). Left out: DEFAULT_ID_REPEATS, or as many as the sample fills
    (at least 2: with --id-sample below 6 the estimates are kept and their SE is null)."""
    most = max(2, id_sample // ROWS_PER_PART)
    if repeats is None:
        return min(DEFAULT_ID_REPEATS, most)
    if repeats > most:
        raise InputError(
            f"--id-repeats {repeats} splits --id-sample {id_sample} into parts of fewer than "
            f"{ROWS_PER_PART} rows; give at most {most}, or a larger --id-sample"
        )
    return repeats


def _checked_groups(groups: int) -> int:
    if groups == 1:
        raise InputError("--jackknife-groups must be 0 (off) or >= 2; got 1")
    return groups


class _Numbers:
    """Typed, range-checked numeric fields of a ScoreOptions (library callers get the CLI's messages)."""

    def __init__(self, opts: ScoreOptions):
        self.opts = opts

    @staticmethod
    def option(field_name: str) -> str:
        return "--" + field_name.replace("_", "-")

    @staticmethod
    def as_real(option: str, value) -> float:
        # numbers.Real: numpy scalars too (np.float32(0.2)); a bool is no number here
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InputError(f"{option} must be a number; got {value!r}")
        return float(value)

    def real(
        self, name: str, *, lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
    ) -> float:
        option = self.option(name)
        v = self.as_real(option, getattr(self.opts, name))
        too_low = v <= lo if lo_open else v < lo
        too_high = hi is not None and (v >= hi if hi_open else v > hi)
        if too_low or too_high or v != v:
            left = "(" if lo_open else "["
            right = ")" if hi_open or hi is None else "]"
            span = f"{left}{lo:g}, {'inf' if hi is None else f'{hi:g}'}{right}"
            raise InputError(f"{option} must be in {span}; got {v}")
        return v

    def whole(
        self, name: str, *, lo: int, hi: int | None = None, why: str = "", optional: bool = False
    ) -> int | None:
        option = self.option(name)
        v = getattr(self.opts, name)
        if v is None and optional:
            return None
        # numbers.Integral: numpy integers too (np.int64(500)), kept as a plain int for the report
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InputError(f"{option} must be a whole number; got {v!r}")
        v = int(v)
        if v < lo:
            raise InputError(f"{option} must be >= {lo}; got {v}")
        if hi is not None and v > hi:
            raise InputError(f"{option} must be at most {hi}{why}; got {v}")
        return v


def normalise_target(t) -> str:
    """ "trace" | "identity" | "file:<path>" | "run:<dir>" | "layer:<name>" (schema's params.target)."""
    s = str(t).strip()
    low = s.lower()
    if low in ("trace", "identity"):
        return low
    for prefix in ("layer:", "file:", "run:"):
        if low.startswith(prefix):
            rest = s[len(prefix) :]
            if not rest:
                raise InputError(f"--shrinkage-target {s!r} names nothing after {prefix!r}")
            return prefix + rest
    p = Path(s)
    if p.is_dir():
        return f"run:{s}"
    if p.suffix == ".npy":
        if not p.exists():
            raise InputError(f"--shrinkage-target file {s} does not exist; give a (D, D) covariance .npy")
        return f"file:{s}"
    raise InputError(
        f"--shrinkage-target {s!r} is not trace, identity, a .npy covariance, a run directory or layer:NAME"
    )
