"""``compare``: does isotropy go with accuracy across fine-tuning runs?

Reads finetune outputs (single runs or sweeps), and reports per configuration (regulariser,
lambda) the mean ± SD over seeds of eval accuracy, macro-F1, IsoScore*, IsoScore and average
cosine; the Spearman and Pearson correlation of eval IsoScore* with accuracy across runs, with an
interval that resamples whole configurations and says how many configurations and distinct lambda
values it rests on -- none with fewer than 3 configurations or fewer than 3 seeds in one; the
per-seed paired difference of each lambda against lambda = 0 of the same regulariser, with n and a
t interval from 3 pairs up; and one plain sentence with the caveat of a small n. Statistics:
:mod:`geomscope.study.stats`, imported by the functions that compute (it imports numpy; importing
this module, as ``geomscope --help`` does through :mod:`geomscope.study`, stays light).

Runs are comparable when they share a task, a model and an eval set; the eval set is told by the
sha256 of its contents that finetune records in the run's checkpoint (``checkpoint/state.json``), or,
for a run whose checkpoint records none, by the path its run.json names, as it was given. Each
(regulariser, lambda, seed) may appear once.

Question-answering runs (``finetune --task qa``) are compared on their own metrics: exact match and
F1 (percent, SQuAD v1.1 normalisation) in place of accuracy and macro-F1, with F1 -- SQuAD's primary
score -- as the outcome IsoScore* is correlated with. Causal-LM runs (``finetune --task causal-lm``)
are compared on eval perplexity and the eval token loss, perplexity the outcome; lower is better
there (:data:`LOWER_IS_BETTER`, the result's ``outcome_direction``), and the sentence says which
way "better" lies. Runs of different tasks are not compared together.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, replace
from pathlib import Path

from geomscope.errors import InputError
from geomscope.fileio import read_json
from geomscope.schema import COMPARE_FORMAT
from geomscope.study.options import CompareOptions

#: the eval metrics of each task (the first is the outcome), then the geometry every run has
TASK_METRICS = {
    "classification": ("accuracy", "macro_f1"),
    "qa": ("f1", "exact_match"),
    "causal-lm": ("perplexity", "eval_loss"),
}
#: the outcomes a smaller value of which is the better result
LOWER_IS_BETTER = ("perplexity", "eval_loss")
GEOMETRY = ("isoscore_star", "isoscore", "avgcos")
METRICS = TASK_METRICS["classification"] + GEOMETRY  # a classification comparison's columns
#: how a metric is named in sentences, tables and figures
LABELS = {
    "accuracy": "accuracy",
    "macro_f1": "macro-F1",
    "f1": "F1 (%)",
    "exact_match": "exact match (%)",
    "perplexity": "perplexity",
    "eval_loss": "token loss",
    "isoscore_star": "IsoScore*",
    "isoscore": "IsoScore",
    "avgcos": "avg cos",
}


def metrics_of(task: str) -> tuple[str, ...]:
    return TASK_METRICS[task] + GEOMETRY


SMALL_N = 10  # below this many runs, the sentence says how little a correlation can show


@dataclass
class RunResult:
    dir: str
    reg: str
    lam: float
    seed: int
    model: str
    eval_data: str  # the --eval path as the run was given it (relative to where it ran)
    values: dict
    task: str = "classification"
    eval_sha256: str | None = None  # the eval file's contents, from the checkpoint's fingerprint

    @property
    def config(self) -> tuple[str, float]:
        return (self.reg, self.lam)


def _object(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise TypeError(f"{what} is not an object")
    return v


def _finite_or_none(v, what: str):
    """A final metric as finetune writes it: a finite number, or null."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} is {v!r}, not a finite number")
    return float(v)


def _eval_sha256(d: Path) -> str | None:
    """The sha256 of the eval data that finetune recorded in the run's fingerprint
    (:func:`geomscope.train.config.fingerprint`), or None for a run whose fingerprint records none."""
    from geomscope.train.checkpoint import CKPT

    path = d / CKPT / "state.json"
    if not path.is_file():
        return None
    state = _object(read_json(path), f"{CKPT}/state.json")
    identity = _object(state.get("fingerprint") or {}, "the checkpoint's fingerprint").get("eval_data")
    sha = identity.get("sha256") if isinstance(identity, dict) else None
    return sha if isinstance(sha, str) else None


def _read_run(d: Path) -> RunResult:
    try:
        summary = _object(read_json(d / "summary.json"), "summary.json")
        run = _object(read_json(d / "run.json"), "run.json")
        final = _object(summary.get("final") or {}, "summary.json's final")
        cfg = _object(run["config"], "run.json's config")
        task = str(summary.get("task", "classification"))
        if task not in TASK_METRICS:
            raise ValueError(f"unknown task {task!r}")
        lam = float(summary["lambda"])
        if not math.isfinite(lam):
            raise ValueError(f"lambda is {lam}")
        return RunResult(
            str(d),
            str(summary["reg"]),
            lam,
            int(summary["seed"]),
            str(cfg.get("model")),
            # not resolved here: a relative path names a file in the folder the run was started in,
            # which compare's own working directory says nothing about
            str(cfg.get("eval", "")),
            {m: _finite_or_none(final.get(m), f"final {m}") for m in metrics_of(task)},
            task,
            _eval_sha256(d),
        )
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
        raise InputError(
            f"{d} is not a readable finetune output ({type(e).__name__}: {e}); "
            "give directories written by `geomscope finetune`"
        ) from None


def find_runs(dirs) -> list[RunResult]:
    """Every finished finetune run in ``dirs`` (a run directory, a sweep, or a folder of runs)."""
    runs = []
    for d in map(Path, dirs):
        if (d / "summary.json").is_file():
            runs.append(_read_run(d))
            continue
        subs = sorted(p for p in d.iterdir() if (p / "summary.json").is_file()) if d.is_dir() else []
        if not subs:
            raise InputError(
                f"{d} is not a finetune output (no summary.json) and holds none; give directories "
                "written by `geomscope finetune`"
            )
        runs.extend(_read_run(p) for p in subs)
    seen: dict[str, str] = {}
    for r in runs:  # the same run reached twice (a run and its sweep, or a DIR given twice)
        key = str(Path(r.dir).resolve())
        if key in seen:
            raise InputError(f"{r.dir} is the same run as {seen[key]}; name each run once")
        seen[key] = r.dir
    _check_settings_once(runs)
    return runs


def _check_settings_once(runs: list[RunResult]) -> None:
    """Each (regulariser, lambda, seed) once: two runs of one setting (a rerun in another folder, or two
    sweeps that share a point) would count twice in the table and the correlations, and the paired
    differences would keep one of them at random."""
    from geomscope.study.sweep import lambda_text

    first: dict[tuple[str, float, int], RunResult] = {}
    for r in runs:
        other = first.setdefault((r.reg, r.lam, r.seed), r)
        if other is not r:
            raise InputError(
                f"{other.dir} and {r.dir} are both the run {r.reg!r} lambda {lambda_text(r.lam)} seed "
                f"{r.seed}; a comparison counts each setting once: compare them separately, or leave "
                "one of them out"
            )


def _check_comparable(runs: list[RunResult], allow_mixed: bool) -> None:
    tasks = sorted({r.task for r in runs})
    if len(tasks) > 1:
        raise InputError(
            f"these runs are of different tasks ({', '.join(tasks)}), measured on different scores; "
            "compare each task's runs on their own"
        )
    if allow_mixed:
        return
    models = sorted({r.model for r in runs})
    hashes = sorted({r.eval_sha256 for r in runs if r.eval_sha256 is not None})
    # the recorded paths say which eval set only where some run has no recorded contents
    paths = sorted({r.eval_data for r in runs}) if any(r.eval_sha256 is None for r in runs) else []
    for what, seen in (
        ("models", models),
        ("eval sets", [f"sha256 {h[:12]}" for h in hashes]),
        ("eval sets", paths),
    ):
        if len(seen) > 1:
            raise InputError(
                f"these runs use different {what} ({', '.join(seen[:3])}); compare like with like, "
                "or pass --allow-mixed"
            )


def _table(runs: list[RunResult], metrics: tuple[str, ...]) -> list[dict]:
    from geomscope.study import stats

    rows = []
    for reg, lam in sorted({r.config for r in runs}):
        mine = [r for r in runs if r.config == (reg, lam)]
        row = {"reg": reg, "lambda": lam, "n": len(mine), "seeds": sorted(r.seed for r in mine)}
        for m in metrics:
            row[f"{m}_mean"], row[f"{m}_sd"], _ = stats.mean_sd(r.values[m] for r in mine)
        rows.append(row)
    return rows


def _paired(runs: list[RunResult], outcome: str) -> list[dict]:
    """Per seed, each lambda's outcome (accuracy; F1 for QA; perplexity for a causal LM) and
    IsoScore* minus those of lambda = 0
    (same regulariser): the mean difference over the seeds both have, with n and a t interval
    (:func:`stats.mean_interval`; none below 3 pairs)."""
    from geomscope.study import stats

    out = []
    base = {(r.reg, r.seed): r for r in runs if r.lam == 0}
    for reg, lam in sorted({r.config for r in runs if r.lam != 0}):
        pairs = [(r, base[(reg, r.seed)]) for r in runs if r.config == (reg, lam) and (reg, r.seed) in base]
        rec = {"reg": reg, "lambda": lam, "n_pairs": len(pairs)}
        for m in (outcome, "isoscore_star"):
            diffs = [
                a.values[m] - b.values[m]
                for a, b in pairs
                if a.values[m] is not None and b.values[m] is not None
            ]
            rec[m] = stats.mean_interval(diffs).to_dict()
        out.append(rec)
    return out


def _direction(rho: float, outcome: str, lower_is_better: bool) -> str:
    """Which isotropy went with the better ``outcome``: higher accuracy, or lower perplexity."""
    if rho == 0:
        return "no association"
    if not lower_is_better:
        return f"{'higher' if rho > 0 else 'lower'} isotropy went with higher {outcome}"
    return f"{'lower' if rho > 0 else 'higher'} isotropy went with lower {outcome} (better)"


def _sentence(assoc: dict, n: int, outcome: str = "accuracy", lower_is_better: bool = False) -> str:
    from geomscope.study import stats

    rho = assoc["spearman"]
    if n < 3:  # before "constant": with 2 runs a rank correlation is undefined whatever the values
        return (
            f"Across {n} runs, the association between eval IsoScore* and {outcome} cannot be measured: "
            "a correlation needs at least 3 runs."
        )
    caveat = (
        f" With n = {n}, only a strong association could show; treat this as a pilot." if n < SMALL_N else ""
    )
    if rho["estimate"] is None:
        return (
            f"Across {n} runs, the association between eval IsoScore* and {outcome} is undefined "
            "(one of them is constant)." + caveat
        )
    direction = _direction(rho["estimate"], outcome, lower_is_better)
    k, lams = assoc["configurations"], assoc["distinct_lambdas"]
    text = (
        f"Across {n} runs in {k} configuration{'s' * (k != 1)} ({lams} distinct lambda "
        f"value{'s' * (lams != 1)}), {direction} (Spearman rho = {rho['estimate']:.2f}, "
    )
    if rho["low"] is None:
        reason = rho["reason"]
        if reason.startswith(stats.TOO_FEW_RUNS):  # (the JSON holds the design it found)
            reason = (
                f"{stats.TOO_FEW_RUNS}, which needs {stats.MIN_CONFIGURATIONS} configurations of "
                f"{stats.MIN_SEEDS} seeds"
            )
        return text + f"{reason}); without an interval, these runs cannot tell the sign." + caveat
    text += f"95% interval {rho['low']:.2f} to {rho['high']:.2f}, resampling configurations"
    spans_zero = rho["low"] <= 0 <= rho["high"]
    text += "); the interval includes zero, so these runs cannot tell the sign." if spans_zero else ")."
    return text + caveat


def _usable_runs(runs: list, outcome: str) -> list:
    """The runs that have both an eval IsoScore* and an eval ``outcome``; an InputError when fewer
    than 2 do."""
    usable = [r for r in runs if r.values[outcome] is not None and r.values["isoscore_star"] is not None]
    if len(usable) < 2:  # finetune writes null for a metric it could not compute (e.g. a diverged run)
        raise InputError(
            f"{len(usable)} of the {len(runs)} runs have both an eval IsoScore* and an eval "
            f"{LABELS[outcome]} (finetune writes null where it could not compute one); compare needs "
            "at least 2: add runs that have both"
        )
    return usable


def compare(dirs, options: CompareOptions | None = None, **overrides) -> dict:
    """The comparison of the finetune runs found in ``dirs`` (see the module docstring).
    ``options``: a :class:`~geomscope.study.options.CompareOptions`; keyword ``overrides`` replace
    its fields (``compare([d], n_boot=500)``)."""
    from geomscope.study import stats

    opts = replace(options or CompareOptions(), **overrides).validate()
    runs = find_runs(dirs)
    if len(runs) < 2:
        raise InputError(
            f"found {len(runs)} finished run(s) in {', '.join(map(str, dirs))}; compare needs at least 2"
        )
    _check_comparable(runs, opts.allow_mixed)
    task = runs[0].task
    metrics, outcome = metrics_of(task), TASK_METRICS[task][0]
    usable = _usable_runs(runs, outcome)
    x = [r.values["isoscore_star"] for r in usable]
    y = [r.values[outcome] for r in usable]
    configs = {c: i for i, c in enumerate(dict.fromkeys(r.config for r in usable))}
    groups = [configs[r.config] for r in usable]  # (a key, not text: a reg name may hold any character)
    assoc = {
        m: stats.cluster_correlation(x, y, groups, method=m, n_boot=opts.n_boot, seed=opts.seed).to_dict()
        for m in ("spearman", "pearson")
    }
    k, fewest = stats.design_of(groups)
    design = {
        "configurations": k,
        "distinct_lambdas": len({r.lam for r in usable}),
        "seeds_per_configuration": {"min": fewest, "max": max(groups.count(g) for g in set(groups))},
    }
    return {
        "format": COMPARE_FORMAT,
        "task": task,
        "metrics": list(metrics),
        "outcome": outcome,
        **({"outcome_direction": "lower is better"} if outcome in LOWER_IS_BETTER else {}),
        "runs": [{"dir": r.dir, "reg": r.reg, "lambda": r.lam, "seed": r.seed, **r.values} for r in runs],
        "table": _table(runs, metrics),
        "association": {
            "x": "eval isoscore_star",
            "y": f"eval {outcome}",
            "method": stats.CLUSTER_METHOD,
            "resampling": stats.CONFIGURATIONS,
            **design,
            "n_boot": opts.n_boot,
            "seed": opts.seed,  # (the figure's fit band is drawn with these too)
            **assoc,
        },
        "paired_vs_lambda_0": _paired(runs, outcome),
        "sentence": _sentence(
            {**assoc, **design},
            len(usable),
            LABELS[outcome].replace(" (%)", ""),
            outcome in LOWER_IS_BETTER,
        ),
    }


def to_csv(result: dict) -> str:
    """One row per configuration: mean and SD of every metric, with n."""
    rows = result["table"]
    metrics = result.get("metrics", METRICS)
    cols = ["reg", "lambda", "n"] + [f"{m}_{s}" for m in metrics for s in ("mean", "sd")]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in cols])
    return buf.getvalue()
