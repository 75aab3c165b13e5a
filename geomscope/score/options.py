"""``ScoreOptions``: everything ``score`` needs besides the input path, declared once
(:mod:`geomscope.options`): ``geomscope score --help`` is built from these fields, and the library
takes the same object."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from geomscope.choices import (
    DEFAULT_CONTROLS,
    DEFAULT_DISCARD_FRACTION,
    DEFAULT_ZETA,
    MAX_SEED,  # noqa: F401 (the seed bound of geomscope.options.SEED)
    OUTLIER_RULES,
    OUTLIER_STATS,
    PRODUCT_DTYPES,
    TWONN_FITS,
)
from geomscope.errors import InputError
from geomscope.layers import STORED_LAYERS_HELP
from geomscope.options import (
    POSITIVE_INT,
    SEED,
    SEED_RANGE,
    UNIT_INTERVAL,
    Choice,
    CommaList,
    Flag,
    Interval,
    Layers,
    OptionError,
    Parsed,
    Text,
    check,
    choice_metavar,
    comma_items,
    option,
    verify_option,
)
from geomscope.score.resources import CONNECT_TIMEOUT_S, MAX_WORKERS

MOMENT_METRICS = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers")
CORE_METRICS = (*MOMENT_METRICS, "twonn", "partition")
DEFAULT_METRICS = CORE_METRICS
#: the diagnostic families (docs/metrics.md, "Diagnostics"): named in --metrics, or by ``all``
DIAGNOSTIC_FAMILIES = (
    "abtt",
    "whitened",
    "rogue",
    "massive",
    "similarity",
    "stratified",
    "contextuality",
    "local",
)
#: the families computed from the moments' covariance and unit sums (their jackknife groups)
MOMENT_FAMILIES = ("abtt", "whitened", "rogue", "stratified")
#: what ``all`` names: the core metrics and every diagnostic family
ALL_METRICS = (*CORE_METRICS, *DIAGNOSTIC_FAMILIES)
AVGCOS_VARIANTS = ("plain", "centred", "standardised")
_VARIANT_ALIASES = {"centered": "centred", "standardized": "standardised", "raw": "plain"}
DEFAULT_OUTLIER_THRESHOLD = {"variance": 5.0, "zscore": 3.0, "quantile": 0.99, "magnitude": 6.0}
#: what --outlier-threshold is under each rule (its --help, with the rule's default)
_THRESHOLD_MEANS = {"variance": "k x mean variance", "zscore": "z", "quantile": "q", "magnitude": "|x|"}
DEFAULT_ID_REPEATS = 4
#: rows per layer of the intrinsic-dimension sample where --id-sample is left out: a --keep
#: sample:N run that kept fewer is scored from its N (ScoreOptions.for_kept_sample)
DEFAULT_ID_SAMPLE = 5000
#: the fewest rows an intrinsic-dimension sample may have (TwoNN needs a point and two neighbours)
ID_SAMPLE_LEAST = 3
#: rows each decimation part needs (geomscope.metrics.twonn.decimation_se: fewer give no SE)
ROWS_PER_PART = 3
#: the largest --memory-mb (2^40 MiB = 1 EiB, far beyond any machine's memory): a budget must be a
#: finite number of bytes (1e308 overflows the conversion)
MAX_MEMORY_MB = 2.0**40


def id_estimator_names() -> tuple[str, ...]:
    """Names of the intrinsic-dimension estimators, TwoNN first (metrics.intrinsic.ID_ESTIMATORS's keys)."""
    from geomscope.choices import SKDIM_ESTIMATORS  # the registry's names, without importing sklearn

    return ("twonn", *SKDIM_ESTIMATORS)


def _variant_name(word: str) -> str:
    """An --avgcos-variants word in its canonical spelling (any case; US spellings and raw too)."""
    low = word.lower()
    return _VARIANT_ALIASES.get(low, low)


#: --metrics: the core metrics, the diagnostic families, the estimators besides TwoNN, or all
METRIC_NAMES = ("all", *ALL_METRICS, *[n for n in id_estimator_names() if n != "twonn"])
_METRICS = CommaList(f"metric names ({', '.join(METRIC_NAMES)})", Choice(METRIC_NAMES), str.lower)
_ID_ESTIMATORS = CommaList(
    f"estimator names ({', '.join(id_estimator_names())})", Choice(id_estimator_names()), str.lower
)
_AVGCOS_VARIANTS = CommaList(
    f"average cosine variants ({', '.join(AVGCOS_VARIANTS)})", Choice(AVGCOS_VARIANTS), _variant_name
)


def _target(spec: str) -> str:
    return normalise_target(spec)


def _scheduler(spec: str) -> str:
    from geomscope.score.dask_executor import parse_scheduler

    return parse_scheduler(spec)


@dataclass
class ScoreOptions:
    """Everything ``score`` needs besides the input path, declared once (:mod:`geomscope.options`):
    ``geomscope score --help`` is built from these fields.

    metrics: names among isoscore, isoscore_star, avgcos, spectrum, outliers, twonn, partition and
    the intrinsic-dimension estimators of ``geomscope.metrics.intrinsic.ID_ESTIMATORS``.
    shrinkage_target: "trace" | "identity" | a .npy (D, D) covariance | a run directory (that run's
    covariance of the same layer) | "layer:NAME" (this run's layer NAME); "file:"/"run:" prefixes
    are accepted too. The lists (metrics, avgcos_variants, id_estimator, layers, columns, ranks)
    may be one comma string ("isoscore,avgcos") or a list of them, as the CLI takes them; numbers
    may be numpy scalars. ``block_rows`` has no declaration: it is the library's alone.
    """

    metrics: tuple[str, ...] | str = option(
        DEFAULT_METRICS,
        _METRICS,
        "Comma list of isoscore, isoscore_star, avgcos, spectrum, outliers, twonn, partition, the "
        "diagnostics abtt (all-but-the-top), whitened, rogue (each dimension's share of the average "
        "cosine), massive (the largest |x| entries), similarity (linear CKA and RSA between layers), "
        "stratified (by token-frequency and position bin), contextuality (self-similarity, "
        "intra-sentence similarity, MEV) and local (isotropy within k-means clusters), and "
        "scikit-dimension estimators (e.g. mle, lpca); 'all' = the seven core metrics and the "
        "diagnostics (the estimators only when named). Default: the seven core metrics.",
        metavar="LIST",
        short="-m",
    )
    zeta: float = option(
        DEFAULT_ZETA,
        UNIT_INTERVAL,
        "IsoScore* weight on the shrinkage target (0 = plain IsoScore).",
        metavar="FLOAT",
    )
    shrinkage_target: str = option(
        "trace",
        Parsed(_target, bad=("bogus", "layer:")),
        "trace (trace-matched identity), identity, FILE.npy (a D x D covariance), RUN_DIR (that run's "
        "covariance of the same layer) or layer:NAME (this run's layer, the paper's practice).",
        metavar="TARGET",
    )
    avgcos_variants: tuple[str, ...] | str = option(
        AVGCOS_VARIANTS,
        _AVGCOS_VARIANTS,
        "Average cosine variants: plain, centred, standardised.",
        metavar="LIST",
    )
    outlier_rule: str = option(
        "variance",
        Choice(OUTLIER_RULES),
        "Rule that flags outlier dimensions.",
        metavar=choice_metavar(OUTLIER_RULES),
    )
    outlier_threshold: float | None = option(
        None,
        Interval(whole=False, low=0, open_low=True),
        "; ".join(f"{r}: {m} ({DEFAULT_OUTLIER_THRESHOLD[r]:g})" for r, m in _THRESHOLD_MEANS.items()) + ".",
        metavar="FLOAT",
        optional=True,
    )
    outlier_stat: str = option(
        "variance",
        Choice(OUTLIER_STATS),
        "Statistic of the zscore rule.",
        metavar=choice_metavar(OUTLIER_STATS),
    )
    discard_fraction: float = option(
        DEFAULT_DISCARD_FRACTION,
        Interval(whole=False, low=0, high=1, open_high=True, words="a number in [0, 1)"),
        "TwoNN: fraction of the largest ratios dropped, in [0, 1).",
        metavar="FLOAT",
    )
    id_sample: int | None = option(
        None,
        Interval(whole=True, low=ID_SAMPLE_LEAST),
        f"Rows per layer sampled for intrinsic dimension (default: {DEFAULT_ID_SAMPLE}, or the N of a "
        "--keep sample:N run if fewer).",
        metavar="N",
        optional=True,
    )
    id_estimator: tuple[str, ...] | str = option(
        (), _ID_ESTIMATORS, "More intrinsic-dimension estimators (comma list).", metavar="LIST"
    )
    twonn_fit: str = option(
        "linear",
        Choice(TWONN_FITS),
        "TwoNN fit: linear (Facco et al.) or maximum likelihood.",
        metavar=choice_metavar(TWONN_FITS),
    )
    seed: int = option(
        0, SEED, f"Seed of every sample (rows, ID sample, decimation): {SEED_RANGE}.", metavar="N"
    )
    exclude_special: bool = option(False, Flag(), "Drop special tokens (CLS/SEP/BOS...) before measuring.")
    layers: tuple[str, ...] | str | None = option(
        None, Layers(), STORED_LAYERS_HELP, metavar="LIST", short="-l", optional=True
    )
    max_rows: int | None = option(
        None,
        Interval(whole=True, low=2),
        "Seeded uniform sample of rows per layer.",
        metavar="N",
        optional=True,
    )
    workers: int = option(
        1,
        Interval(whole=True, low=1, high=MAX_WORKERS, words=f"a positive whole number up to {MAX_WORKERS}"),
        "Processes reading shards (and threads finishing layers) in parallel, at most one per "
        f"shard and {MAX_WORKERS} in all; BLAS runs single-threaded in each. One process already computes on "
        "every usable core (threads over blocks); more pay where reading or many layers are the "
        "limit. Above the core count the processes share the cores (each holds its own "
        "accumulators): that pays only where reading waits on storage.",
        metavar="N",
        short="-w",
    )
    partial: bool = option(False, Flag(), "Score the finished shards of an incomplete run.")
    jackknife_groups: int = option(
        10,
        Interval(whole=True, low=0),
        "Document groups of the jackknife SE (0 = off; otherwise >= 2).",
        metavar="N",
    )
    id_repeats: int | None = option(
        None,
        Interval(whole=True, low=2),
        f"Parts of the ID sample for the decimation SE, each of >= {ROWS_PER_PART} rows: at most "
        f"--id-sample / {ROWS_PER_PART} (default: {DEFAULT_ID_REPEATS}, fewer where --id-sample is under "
        f"{DEFAULT_ID_REPEATS * ROWS_PER_PART}; below {2 * ROWS_PER_PART} the SE is null).",
        metavar="N",
        optional=True,
    )
    memory_mb: float = option(
        2048,
        Interval(whole=False, low=0, high=MAX_MEMORY_MB, open_low=True, words="in (0, 2^40] MiB"),
        "Memory budget of the per-layer accumulators, and of what one read decompresses (a band of an "
        ".h5 array's compressed chunks, a compressed Arrow batch, a Parquet page).",
        metavar="MIB",
    )
    dataset: str | None = option(
        None, Text(), "Dataset path inside an .h5 array file.", metavar="PATH", optional=True
    )
    columns: tuple[str, ...] | str | None = option(
        None,
        CommaList("array names"),
        "Arrays to score from an .npz, .safetensors, .pt, Arrow or Parquet source "
        "(members, tensors or columns; comma list or repeated; default: every 2-D numeric one).",
        metavar="NAME",
        flag="--column",
        optional=True,
    )
    block_rows: int | None = None
    product_dtype: str = option(
        "float64",
        Choice(PRODUCT_DTYPES),
        "Dtype of the covariance's block products. float32: each block, centred in float64, is "
        "multiplied in float32 and added in float64: ~1.5x faster on 2 cores, ~1e-8 relative error in "
        "the covariance (up to ~1e-7 on small samples) and more in metrics near 0 such as IsoScore "
        "(2e-7 measured; the isoscore package: ~1e-6).",
        metavar=choice_metavar(PRODUCT_DTYPES),
    )
    basis: str | None = option(
        None,
        Text(),
        "With a gradient run (extract --capture gradients): the run of activations of the same "
        "model whose top-r covariance eigenvectors U_r are the subspace; reports, per gradient "
        "layer and rank, the captured energy tr(U'SU)/tr(S) against r/D, its maximum, kappa, "
        "random normal controls and the removal test (report key gradient_energy). A directory of "
        "runs (extract --revisions, or one such directory per model) pairs each gradient run with "
        "the run there of its own checkpoint (the same weights).",
        metavar="ACTRUN",
        optional=True,
    )
    ranks: tuple[int, ...] | str = option(
        (8, 32, 128),
        CommaList("ranks (whole numbers >= 1)", POSITIVE_INT, int, nonempty=True),
        "Ranks r of the --basis subspaces (each below D).",
        metavar="LIST",
        flag="--rank",
    )
    controls: int = option(
        DEFAULT_CONTROLS,
        Interval(whole=True, low=0),
        "Random rank-r subspaces of U_r's complement per rank (seeded by --seed) for --basis.",
        metavar="K",
    )
    scheduler: str | None = option(
        None,
        Parsed(_scheduler, bad=("local:0", "tcp://nohost", "cluster")),
        "Run the shard reading as Dask tasks: local:N starts N single-threaded worker processes "
        "here for the call; tcp://HOST:PORT or a scheduler FILE.json uses a running Dask cluster (its "
        f"workers must read the run at the same path), waiting at most {CONNECT_TIMEOUT_S} s for the "
        f"scheduler and {CONNECT_TIMEOUT_S} s for its first worker. Same report as --workers (merged "
        "in shard order); not combined with --workers. Needs pip install 'geomscope[dask]'.",
        metavar="local:N|tcp://HOST:PORT|FILE.json",
        optional=True,
    )
    abtt_k: tuple[int, ...] | str = option(
        (1, 5, 10),
        CommaList("directions (whole numbers >= 1)", POSITIVE_INT, int, nonempty=True),
        "--metrics abtt: the numbers k of top principal directions removed (each below D); reports "
        "IsoScore, IsoScore* and the average cosine after each.",
        metavar="LIST",
        flag="--abtt-k",
    )
    massive_k: int = option(
        20,
        Interval(whole=True, low=1, high=100_000),
        "--metrics massive: the largest |x| entries (token, dimension) listed per layer.",
        metavar="K",
    )
    similarity_rows: int = option(
        1000,
        Interval(whole=True, low=4),
        "--metrics similarity: rows of the seeded sample (the same in every layer) that linear CKA "
        "and RSA compare (at most --id-sample).",
        metavar="N",
    )
    frequency_bins: int = option(
        4,
        Interval(whole=True, low=2, high=64),
        "--metrics stratified: token-frequency bins of about equal token mass, the most frequent types "
        "first.",
        metavar="B",
    )
    position_edges: tuple[int, ...] | str = option(
        (1, 8, 32, 128),
        CommaList("positions (whole numbers >= 1)", POSITIVE_INT, int, nonempty=True),
        "--metrics stratified: increasing positions that start the position bins after [0, first).",
        metavar="LIST",
    )
    token_counts: str | None = option(
        None,
        Text(),
        "--metrics stratified: token counts for the frequency bins (.json {token_id: count} or .npy "
        "indexed by token id); default: the run's own.",
        metavar="FILE",
        optional=True,
    )
    context_min: int = option(
        5,
        Interval(whole=True, low=2),
        "--metrics contextuality: the fewest occurrences in the run of a token type measured.",
        metavar="M",
    )
    context_types: int = option(
        500,
        POSITIVE_INT,
        "--metrics contextuality: the most token types measured (a seeded draw of those with M occurrences).",
        metavar="N",
    )
    context_occurrences: int = option(
        32,
        Interval(whole=True, low=2, high=4096),
        "--metrics contextuality: occurrences kept per token type (a seeded draw).",
        metavar="N",
    )
    context_docs: int = option(
        1000,
        POSITIVE_INT,
        "--metrics contextuality: sentences (documents) of the intra-sentence similarity (a seeded draw).",
        metavar="N",
    )
    clusters: int = option(
        0,
        Interval(whole=True, low=0, high=64),
        "--metrics local: k-means clusters of the sample (0: the k in 2..8 of largest silhouette).",
        metavar="K",
    )
    verify: bool = verify_option()
    extra_id: tuple[str, ...] = field(default=(), repr=False)  # filled by validate()

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> ScoreOptions:
        """A normalised copy (tuples, plain ints and floats); InputError (one line) naming the option
        otherwise: a selection given but empty, each option against its declaration (OptionError),
        then the names and the rules between options."""
        layers = _selection("--layers", self.layers, "layers: names, indices, ranges a-b, all or blocks")
        columns = _selection("--column", self.columns, "array names")
        check(self)
        metrics, est, extra = _checked_metrics(self.metrics, self.id_estimator)
        id_sample = None if self.id_sample is None else int(self.id_sample)
        repeats = None if self.id_repeats is None else int(self.id_repeats)
        return replace(
            self,
            metrics=metrics,
            zeta=float(self.zeta),
            avgcos_variants=_checked_variants(self.avgcos_variants, "avgcos" in metrics),
            outlier_threshold=_checked_threshold(self.outlier_rule, self.outlier_threshold),
            id_estimator=est,
            extra_id=extra,
            discard_fraction=float(self.discard_fraction),
            id_sample=id_sample,
            max_rows=None if self.max_rows is None else int(self.max_rows),
            workers=int(self.workers),
            jackknife_groups=_checked_groups(int(self.jackknife_groups)),
            memory_mb=float(self.memory_mb),
            # left out, --id-sample and the default --id-repeats wait for the source (for_kept_sample)
            id_repeats=_checked_repeats(repeats, id_sample or DEFAULT_ID_SAMPLE)
            if id_sample is not None or repeats is not None
            else None,
            seed=int(self.seed),
            layers=layers,
            columns=columns,
            shrinkage_target=normalise_target(self.shrinkage_target),
            ranks=_checked_ranks(self.ranks),
            abtt_k=_checked_abtt(self.abtt_k),
            massive_k=int(self.massive_k),
            similarity_rows=int(self.similarity_rows),
            frequency_bins=int(self.frequency_bins),
            context_min=int(self.context_min),
            context_types=int(self.context_types),
            context_occurrences=int(self.context_occurrences),
            context_docs=int(self.context_docs),
            clusters=_checked_clusters(int(self.clusters)),
            position_edges=_checked_edges(self.position_edges),
            controls=int(self.controls),
            scheduler=_checked_scheduler(self.scheduler, self.workers),
        )

    def for_kept_sample(self, kept: int | None) -> ScoreOptions:
        """These validated options for a source that kept a sample of ``kept`` rows per shard (None:
        every row): --id-sample left out is DEFAULT_ID_SAMPLE, or ``kept`` where fewer (what such a
        run can serve), and --id-repeats left out what that sample fills; a given --id-repeats is
        held to it."""
        if self.id_sample is not None:
            return self
        id_sample = DEFAULT_ID_SAMPLE if kept is None else min(DEFAULT_ID_SAMPLE, kept)
        return replace(self, id_sample=id_sample, id_repeats=_checked_repeats(self.id_repeats, id_sample))

    # -- convenience -------------------------------------------------------------------------
    def wants(self, metric: str) -> bool:
        return metric in self.metrics

    @property
    def moment_metrics(self) -> bool:
        return any(m in self.metrics for m in (*MOMENT_METRICS, *MOMENT_FAMILIES))

    @property
    def needs_sample(self) -> bool:
        """Whether the passes keep the seeded row sample: intrinsic dimension, the quantile outlier
        rule, the similarity between layers."""
        quantile = self.wants("outliers") and self.outlier_rule == "quantile"
        return bool(self.id_names) or quantile or self.wants("similarity") or self.wants("local")

    @property
    def postprocessed(self) -> bool:
        """All-but-the-top or whitening: an eigendecomposition per replicate and a second pass."""
        return self.wants("abtt") or self.wants("whitened")

    @property
    def id_names(self) -> tuple[str, ...]:
        """ID estimators to run: twonn (key "twonn") then the others (keys "id_<name>")."""
        return (("twonn",) if "twonn" in self.metrics else ()) + self.extra_id

    @property
    def second_pass_variants(self) -> tuple[str, ...]:
        """The cosine variants the second pass computes: the average cosine's shifted ones, and the
        standardised one for the rogue dimensions (the cosine with them standardised away)."""
        out = [v for v in self.avgcos_variants if v != "plain"] if self.wants("avgcos") else []
        if self.wants("rogue") and "standardised" not in out:
            out.append("standardised")
        return tuple(out)

    @property
    def needs_second_pass(self) -> bool:
        return bool(self.second_pass_variants)


def _checked_metrics(metrics, id_estimators) -> tuple[tuple, tuple, tuple]:
    """(metrics, --id-estimator names, extra estimators run besides TwoNN) of the declared lists (each
    name known, in lower case); ``all`` = the core seven and the diagnostic families."""
    ids = id_estimator_names()
    named = [n for m in _METRICS.items(metrics) for n in (ALL_METRICS if m == "all" else (m,))]
    metrics = list(dict.fromkeys(named))
    if not metrics:
        raise InputError("--metrics is empty; name at least one metric, e.g. --metrics isoscore")
    est = _ID_ESTIMATORS.items(id_estimators)
    run_ids = [m for m in metrics if m in ids] + est
    if "twonn" in run_ids and "twonn" not in metrics:
        metrics.append("twonn")
    extra = [e for e in dict.fromkeys(run_ids) if e != "twonn"]
    return tuple(metrics), tuple(est), tuple(extra)


def _checked_variants(names, wanted: bool) -> tuple[str, ...]:
    """--avgcos-variants (known names by its declaration) in canonical spelling, each once; empty
    only where the average cosine is not asked for."""
    variants = _AVGCOS_VARIANTS.items(names)
    if wanted and not variants:
        raise InputError("--avgcos-variants is empty; give plain, centred and/or standardised")
    return tuple(dict.fromkeys(variants))


def _checked_threshold(rule: str, threshold) -> float:
    """--outlier-threshold (> 0 by its declaration), or the rule's default when none is given; a
    quantile lies in (0, 1)."""
    if threshold is None:
        return DEFAULT_OUTLIER_THRESHOLD[rule]
    thr = float(threshold)
    if rule == "quantile" and not 0.0 < thr < 1.0:
        raise InputError(f"--outlier-threshold for the quantile rule is a quantile in (0, 1); got {thr}")
    return thr


def _checked_ranks(ranks) -> tuple[int, ...]:
    """--rank (whole numbers >= 1, at least one, by its declaration) as sorted distinct ints."""
    return tuple(sorted({int(r) for r in comma_items(ranks)}))


def _checked_clusters(k: int) -> int:
    if k == 1:
        raise InputError("--clusters must be 0 (chosen by silhouette) or >= 2; got 1")
    return k


def _checked_edges(edges) -> tuple[int, ...]:
    """--position-edges (whole numbers >= 1, at least one, by its declaration): strictly increasing."""
    out = tuple(int(e) for e in comma_items(edges))
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise InputError(f"--position-edges must increase; got {','.join(map(str, out))}")
    return out


def _checked_abtt(ks) -> tuple[int, ...]:
    """--abtt-k (whole numbers >= 1, at least one, by its declaration) as sorted distinct ints (each
    below D: checked against the source's width when scored)."""
    return tuple(sorted({int(k) for k in comma_items(ks)}))


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


def _selection(option: str, value, what: str) -> tuple | None:
    """None (everything) or the named items; a selection given but empty (``--layers=,``) is refused
    rather than read as everything."""
    if not isinstance(value, (str, list, tuple)):
        return value  # None (everything), or a value the declared constraint refuses next
    items = comma_items(value)
    if not items:
        raise OptionError(f"{option} is empty; give {what} (comma list), or leave it out for all of them")
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
