"""Scoring options: one validated, typed config (the CLI builds it; the library takes it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from geomscope.choices import OUTLIER_RULES
from geomscope.errors import InputError

MOMENT_METRICS = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers")
CORE_METRICS = (*MOMENT_METRICS, "twonn", "partition")
DEFAULT_METRICS = CORE_METRICS
AVGCOS_VARIANTS = ("plain", "centred", "standardised")
_VARIANT_ALIASES = {"centered": "centred", "standardized": "standardised", "raw": "plain"}
DEFAULT_OUTLIER_THRESHOLD = {"variance": 5.0, "zscore": 3.0, "quantile": 0.99, "magnitude": 6.0}


def id_estimator_names() -> tuple[str, ...]:
    """Names of the intrinsic-dimension estimators (TwoNN first), from the metrics registry."""
    from geomscope.metrics.intrinsic import ID_ESTIMATORS

    names = [str(n) for n in ID_ESTIMATORS]
    return tuple(["twonn"] + [n for n in names if n != "twonn"])


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
    id_repeats: int = 4
    memory_mb: float = 2048
    verify: bool = True
    dataset: str | None = None
    block_rows: int | None = None
    extra_id: tuple[str, ...] = field(default=(), repr=False)  # filled by validate()

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> ScoreOptions:
        """A normalised copy; InputError (one line) for anything out of range or unknown."""
        ids = id_estimator_names()
        known = (*CORE_METRICS, *[n for n in ids if n != "twonn"])
        metrics = []
        for m in self.metrics:
            m = str(m).strip().lower()
            if not m:
                continue
            if m == "all":
                metrics.extend(CORE_METRICS)
                continue
            if m not in known:
                raise InputError(f"unknown metric {m!r}; choose among {', '.join(known)}")
            metrics.append(m)
        metrics = list(dict.fromkeys(metrics))
        if not metrics:
            raise InputError("--metrics is empty; name at least one metric, e.g. --metrics isoscore")
        est = []
        for e in self.id_estimator:
            e = str(e).strip().lower()
            if e and e not in ids:
                raise InputError(f"unknown --id-estimator {e!r}; choose among {', '.join(ids)}")
            if e:
                est.append(e)
        run_ids = [m for m in metrics if m in ids] + est
        if "twonn" in run_ids and "twonn" not in metrics:
            metrics.append("twonn")
        extra = [e for e in dict.fromkeys(run_ids) if e != "twonn"]
        variants = []
        for v in self.avgcos_variants:
            v = _VARIANT_ALIASES.get(str(v).strip().lower(), str(v).strip().lower())
            if v not in AVGCOS_VARIANTS:
                raise InputError(f"unknown --avgcos-variants entry {v!r}; "
                             f"choose among {', '.join(AVGCOS_VARIANTS)}")
            variants.append(v)
        if "avgcos" in metrics and not variants:
            raise InputError("--avgcos-variants is empty; give plain, centred and/or standardised")
        try:
            zeta = float(self.zeta)
        except (TypeError, ValueError):
            raise InputError(f"--zeta must be a number in [0, 1]; got {self.zeta!r}") from None
        if not 0.0 <= zeta <= 1.0:
            raise InputError(f"--zeta must be in [0, 1] (the weight on the shrinkage target); got {self.zeta}")
        rule = str(self.outlier_rule).strip().lower()
        rules = OUTLIER_RULES
        if rule not in rules:
            raise InputError(f"unknown --outlier-rule {rule!r}; choose among {', '.join(rules)}")
        thr = DEFAULT_OUTLIER_THRESHOLD.get(rule) if self.outlier_threshold is None else float(self.outlier_threshold)
        if thr is None or not thr == thr:
            raise InputError("--outlier-threshold must be a number")
        if rule == "quantile" and not 0.0 < thr < 1.0:
            raise InputError(f"--outlier-threshold for the quantile rule is a quantile in (0, 1); got {thr}")
        if rule != "quantile" and thr <= 0:
            raise InputError(f"--outlier-threshold must be > 0; got {thr}")
        if self.outlier_stat not in ("variance", "mean_abs"):
            raise InputError(f"--outlier-stat must be variance or mean_abs; got {self.outlier_stat!r}")
        if not 0.0 <= float(self.discard_fraction) < 1.0:
            raise InputError(f"--discard-fraction must be in [0, 1); got {self.discard_fraction}")
        if int(self.id_sample) < 3:
            raise InputError(f"--id-sample must be at least 3 points; got {self.id_sample}")
        if self.max_rows is not None and int(self.max_rows) < 2:
            raise InputError(f"--max-rows must be at least 2; got {self.max_rows}")
        if int(self.workers) < 1:
            raise InputError(f"--workers must be >= 1; got {self.workers}")
        if int(self.jackknife_groups) < 0 or int(self.jackknife_groups) == 1:
            raise InputError(f"--jackknife-groups must be 0 (off) or >= 2; got {self.jackknife_groups}")
        if not float(self.memory_mb) > 0:
            raise InputError(f"--memory-mb must be > 0; got {self.memory_mb}")
        if self.twonn_fit not in ("linear", "mle"):
            raise InputError(f"--twonn-fit must be linear or mle; got {self.twonn_fit!r}")
        if int(self.id_repeats) < 2:
            raise InputError(f"--id-repeats must be >= 2; got {self.id_repeats}")
        if int(self.seed) < 0:
            raise InputError(f"--seed must be >= 0; got {self.seed}")
        return replace(self, metrics=tuple(metrics), zeta=zeta, avgcos_variants=tuple(dict.fromkeys(variants)),
                       outlier_rule=rule, outlier_threshold=float(thr), id_estimator=tuple(est),
                       extra_id=tuple(extra), jackknife_groups=int(self.jackknife_groups),
                       max_rows=None if self.max_rows is None else int(self.max_rows),
                       layers=tuple(self.layers) if self.layers else None,
                       shrinkage_target=normalise_target(self.shrinkage_target))

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


def normalise_target(t) -> str:
    """"trace" | "identity" | "file:<path>" | "run:<dir>" | "layer:<name>" (schema's params.target)."""
    s = str(t).strip()
    low = s.lower()
    if low in ("trace", "identity"):
        return low
    for prefix in ("layer:", "file:", "run:"):
        if low.startswith(prefix):
            rest = s[len(prefix):]
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
    raise InputError(f"--shrinkage-target {s!r} is not trace, identity, a .npy covariance, a run directory "
                     "or layer:NAME")
