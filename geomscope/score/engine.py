"""``score(path, options)``: stream a run (or an array) through the accumulators into a report.

Passes over the data (each streams every task once, a few MiB of rows at a time; no layer is ever
held whole, memory does not depend on the number of rows):

0. ``--max-rows`` only: a metadata pass (run: token index and non-finite flags, no activations)
   fixing each layer's seeded bottom-k row sample.
1. Moments pass: per layer and jackknife group one float64 Moments (count, mean, scatter, unit-vector
   sums, |x| statistics), plus the seeded sample for intrinsic dimension. Every moment metric
   (IsoScore, IsoScore*, plain average cosine, spectrum, variance/zscore/magnitude outliers) comes
   from these.
2. Only for the centred / standardised average cosine: their definitions subtract the global mean
   (and divide by the standard deviation), known only after pass 1, so a second pass sums the unit
   vectors of the shifted rows (for every jackknife replicate and both variants at once: multiunit.py).

Memory: each layer holds G Moments of D x D float64 (G = jackknife groups) in every process and
in-flight result; layers are processed in batches so that G * D^2 * 8 bytes * (in-flight + 2) stays
under ``--memory-mb`` (one layer per batch at least); each batch repeats the passes for its layers.

Parallelism: ``--workers N`` reads shards in N processes (partial accumulators merged in shard order)
and finishes N layers at a time in threads; BLAS is single-threaded throughout (see executor.py).
Within a task, the float64 block statistics run in (usable cores / N) threads while the next block
is read (metrics/moments.py, accumulate.py); blocks are merged in row order, so the numbers do not
depend on the thread count.
``--scheduler`` runs the shard tasks on a Dask cluster instead (dask_executor.py), merged the same way.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace

import numpy as np

from geomscope.errors import DataError, InputError
from geomscope.progress import Log, Progress, log_to
from geomscope.schema import REPORT_FORMAT, REPORT_FORMAT_VERSION
from geomscope.score import compute, idest, outliers, postprocess, resources
from geomscope.score.accumulate import PassSpec
from geomscope.score.contextuality import params as context_params
from geomscope.score.executor import Executor, make_executor
from geomscope.score.layer import LayerResult
from geomscope.score.options import ID_SAMPLE_LEAST, ScoreOptions
from geomscope.score.sources import SourceInfo, open_source
from geomscope.score.strata import params as strata_params
from geomscope.store.accumulators import ABS_THRESHOLD as KEPT_ABS_THRESHOLD
from geomscope.store.accumulators import MASSIVE_KEPT

GROUPS_TEXT = {
    "documents": "document groups (doc_id % G)",
    "contiguous": "contiguous row blocks",
    "shards": "shard groups (shard index % G: a --keep sample run keeps one accumulator per shard)",
}


def _with_se(row: dict, se) -> dict:
    """A gradient-energy row with ``energy_se`` right after ``energy``."""
    out = {}
    for k, v in row.items():
        out[k] = v
        if k == "energy":
            out["energy_se"] = se
    return out


def _has_special_flags(src) -> bool:
    """Whether ``src``'s rows say which are special tokens: a run's always do; an array's only where
    its format has a ``special`` column (a .npy or .h5 array never has)."""
    return src.kind == "run" or all("special" in t.meta for t in src.tasks)


def score(
    path,
    options: ScoreOptions | None = None,
    *,
    progress: bool = False,
    log: Log | None = None,
) -> dict:
    """Score a run directory or an (N, D) array file; return the report dict (keys: geomscope.schema).

    ``progress`` and ``log`` follow :mod:`geomscope.progress`: a bar on stderr, and the warnings
    (layers left out, notes on the data) one line each to ``log``; both off by default.
    """
    opts = (options or ScoreOptions()).validate()
    log = log_to(log)
    src = open_source(
        path,
        dataset=opts.dataset,
        layers=opts.layers,
        columns=opts.columns,
        partial=opts.partial,
        block_rows=opts.block_rows,
        memory_mb=opts.memory_mb,
    )
    opts = opts.for_kept_sample(src.sample)
    for w in src.warnings:
        log(w)
    # processes beyond one per task would only wait, holding memory the plan counts (2 task results
    # each) and cores the threads below divide among them
    processes = max(1, min(opts.workers, len(src.tasks)))
    with (
        resources.one_blas_thread(),
        make_executor(processes, opts.scheduler) as ex,
        Progress(enabled=progress) as prog,
    ):
        return _Scorer(src, opts, ex, prog, log, processes).run()


def layer_samples(path, options: ScoreOptions | None = None, *, rows: int, layers=None) -> dict:
    """Each layer's seeded row sample of a source, from one pass that keeps nothing else: ``{layer:
    (hashes sorted, rows, jackknife groups) or None}``, the ``rows`` rows with the smallest
    ``hash(key; seed)`` the layer uses (the sample score's intrinsic dimension and similarity draw,
    store/sample.py). ``layers``: the layers to sample (None: ``options.layers``). A ``--keep
    sample`` run serves it from its kept sample (same seed, at most its N rows)."""
    opts = (options or ScoreOptions()).validate()
    src = open_source(
        path,
        dataset=opts.dataset,
        layers=opts.layers if layers is None else list(layers),
        columns=opts.columns,
        partial=opts.partial,
        block_rows=opts.block_rows,
        memory_mb=opts.memory_mb,
    )
    if src.sample is not None and (rows > src.sample or opts.seed != src.sample_seed):
        raise InputError(
            f"{src.path} kept a sample of {src.sample} rows per shard under seed {src.sample_seed}; "
            f"{rows} rows under seed {opts.seed} cannot be drawn from it"
        )
    groups = opts.jackknife_groups if opts.jackknife_groups >= 2 else 1
    if src.sample is not None and len(src.tasks) >= 2:
        groups = min(groups, len(src.tasks))
    processes = max(1, min(opts.workers, len(src.tasks)))
    spec = PassSpec(
        kind="sample",
        layers=list(src.layers),
        n_groups=groups,
        exclude_special=opts.exclude_special,
        seed=opts.seed,
        block_rows=opts.block_rows,
        id_k=int(rows),
        checksum=opts.verify,
        extras=False,
    )
    with resources.one_blas_thread(), make_executor(processes, opts.scheduler) as ex:
        parts = ex.run(src.tasks, spec)
    out = {}
    for n in src.layers:
        kept = parts[n].reservoir.sample_with_meta() if n in parts else None
        out[n] = None if kept is None else (kept[0], kept[1], kept[2].get("group"))
    return out


class _Scorer:
    def __init__(
        self, src: SourceInfo, opts: ScoreOptions, ex: Executor, prog: Progress, log, processes: int
    ):
        self.src, self.opts, self.ex, self.prog, self.log = src, opts, ex, prog, log
        self.G = opts.jackknife_groups if opts.jackknife_groups >= 2 else 1
        if src.sample is not None and len(src.tasks) >= 2:  # shard groups: no more groups than shards
            self.G = min(self.G, len(src.tasks))
        self.rows = src.run["rows"] if src.kind == "run" else sum(t.rows for t in src.tasks)
        self.checksum_pending = opts.verify
        # a --keep sample run's moments are float64 accumulators made at extraction: no products here
        self.product_dtype = "float64" if src.sample is not None else opts.product_dtype
        self.target, self.target_layer = self._parse_target()
        # the block statistics of a task run in threads (BLAS stays single-threaded in each): the
        # cores this process may use, shared among --workers processes; one per Dask task
        self.threads = 1 if opts.scheduler else max(1, resources.usable_cores() // processes)

    # -- passes ------------------------------------------------------------------------------
    def _pass(self, tasks, spec: PassSpec, desc: str, rows: int | None = None) -> dict:
        if self.checksum_pending and tasks is self.src.tasks:
            spec.checksum = True
            self.checksum_pending = False
        bar = self.prog.add(
            desc, rows if rows is not None else sum(t.rows for t in tasks), unit="rows", rate_unit="rows"
        )
        parts = self.ex.run(tasks, spec, bar.advance if self.prog.enabled else None)
        bar.complete()
        return parts

    def _spec(self, kind: str, layers: list[str], **kw) -> PassSpec:
        o = self.opts
        return PassSpec(
            kind=kind,
            layers=list(layers),
            n_groups=kw.pop("n_groups", self.G),
            exclude_special=o.exclude_special,
            seed=o.seed,
            block_rows=o.block_rows,
            product_dtype=self.product_dtype,
            threads=self.threads,
            **kw,
        )

    def _parse_target(self):
        t = self.opts.shrinkage_target
        if not t.startswith("layer:"):
            return t, None
        name = t[len("layer:") :]
        if self.src.kind != "run":
            raise InputError("--shrinkage-target layer:NAME needs a run directory; an array has one layer")
        picked = self.src.run_obj.resolve_layers([name])
        if len(picked) != 1:  # a range, a keyword, or an index a layer shares with its gradient
            raise InputError(
                f"--shrinkage-target layer:{name} picks {len(picked)} layers ({', '.join(picked)}); "
                "name one, e.g. layer:" + picked[0]
            )
        return f"layer:{picked[0]}", picked[0]

    # -- main --------------------------------------------------------------------------------
    def run(self) -> dict:
        o = self.opts
        self._prepare()
        layers, extras = self._score_layers()
        if o.wants("outliers") and o.outlier_rule == "magnitude":
            outliers.apply_magnitude(layers, extras, o)
        similar = self._similarity(layers, extras) if o.wants("similarity") else None
        embeddings, final_norm, top_notes = self._model_sections(layers, extras)
        norms = self._norms(layers, extras, top_notes)
        report = self._report(layers, embeddings, top_notes, final_norm, norms)
        if similar is not None:  # (a key of its own, before the notes, only when requested)
            report = _with_key_before(report, "notes", "similarity", similar[0])
            if similar[1]:
                report["notes"]["similarity"] = similar[1]
        return report

    def _similarity(self, layers: list[dict], extras: dict) -> tuple[dict | None, str | None]:
        """The similarity between every pair of layers (similarity.py) from each layer's sample, and
        each layer's similarity with the one before it."""
        from geomscope.score import similarity

        names = [e["layer"] for e in layers]
        samples = {n: extras[n].get("similarity_sample") for n in names}
        sec, why = similarity.section(samples, names, self.opts)
        similarity.fill_layers(layers, sec, why)
        return sec, why

    def _prepare(self) -> None:
        """What every batch of layers shares, before any is scored: a ``--keep sample`` run's limits
        checked, the rows ``--max-rows`` keeps (``thresholds``), the shrinkage reference (``c0_fixed``:
        a covariance file or a layer of this source; ``other``: a run whose layers are the references)
        and the ``--basis`` run of the captured gradient energy."""
        o, src = self.opts, self.src
        if src.sample is not None:
            self._check_sample_run()
            if o.product_dtype != self.product_dtype:
                self.log(
                    f"{src.path} kept float64 accumulators made at extraction, not rows: "
                    "--product-dtype float32 changes nothing there (the report records float64)"
                )
        if o.wants("abtt"):
            from geomscope.metrics.postprocess import check_ks

            check_ks(o.abtt_k, min(src.widths))  # (the narrowest layer scored)
        self.thresholds = self._select_rows() if o.max_rows else None
        self.c0_fixed = None
        if self.target.startswith("file:"):
            self.c0_fixed = compute.load_cov_file(self.target[5:], self._one_width())
        elif self.target_layer is not None and o.wants("isoscore_star"):
            self._one_width()
            self.c0_fixed = self._reference_cov(src, [self.target_layer], self.thresholds)[self.target_layer]
        self.other = None
        if self.target.startswith("run:") and o.wants("isoscore_star"):
            self.other = self._open_other_run(self.target[4:])
        self._counts = None
        self.strata_why = self.context_why = self.context_bins = None
        self.strata, self.strata_described = self._strata() if o.wants("stratified") else (None, None)
        self.context, self.context_described = self._contexts() if o.wants("contextuality") else (None, None)
        self.basis, self.energy, self.energy_notes = None, {}, {}
        if o.basis is not None:
            from geomscope.score.gradenergy import open_basis

            self.basis = open_basis(src, o.basis, o.ranks, o.partial, o.memory_mb)

    def _strata(self) -> tuple[dict | None, dict]:
        """The bins of ``--metrics stratified`` (strata.py): the frequency bins from ``--token-counts``
        or a metadata pass counting the run's token ids, the position edges; and their description
        (the report's ``params.strata``). A source without token ids and positions (an array) or
        without rows (a --keep sample run) has none, said per bin."""
        from geomscope.score import strata

        o = self.opts
        why = self._without_rows("token ids or positions", "the rows each bin needs")
        if why is not None:
            self.strata_why = why
            return None, {"why": why}
        bin_of, freq, source = self._frequency_bins()
        spec = {"frequency": bin_of, "frequency_bins": o.frequency_bins, "position": tuple(o.position_edges)}
        described = {
            "frequency_from": source,
            "frequency": freq,
            "position": strata.position_bins(o.position_edges),
        }
        return spec, described

    def _without_rows(self, array_lacks: str, sample_lacks: str) -> str | None:
        """Why a diagnostic that reads every row with its token id and key has nothing to read (an
        array source lacks ``array_lacks``; a --keep sample run kept accumulators, not
        ``sample_lacks``), or None for a run that kept its rows."""
        src = self.src
        if src.kind != "run":
            return f"an array source has no {array_lacks}"
        if src.sample is not None:
            return (
                f"this run kept accumulators and a sample (--keep sample:{src.sample}), not {sample_lacks}; "
                "extract with --keep all for it"
            )
        return None

    def _token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(occurrences of each token id in the run, and as a special token): one metadata pass over
        the run's token ids, made once for every diagnostic that needs it."""
        if self._counts is None:
            src = self.src
            part = self._pass(src.tasks, self._spec("count", [src.layers[0]]), "counting tokens")[
                src.layers[0]
            ]
            empty = np.zeros(0, np.int64)
            self._counts = (
                part.token_counts if part.token_counts is not None else empty,
                part.special_counts if part.special_counts is not None else empty,
            )
        return self._counts

    def _frequency_bins(self) -> tuple[np.ndarray, list[dict], str]:
        """(each token id's frequency bin, the bins' descriptions, where the counts come from): strata.py's
        bins over ``--token-counts`` or the run's own counts."""
        from geomscope.score import strata

        o = self.opts
        if o.token_counts is not None:
            counts, source = strata.read_counts(o.token_counts), f"file:{o.token_counts}"
        else:
            counts, source = self._token_counts()[0], "run"
        return (*strata.frequency_bins(counts, o.frequency_bins), source)

    def _contexts(self) -> tuple[dict | None, dict]:
        """What ``--metrics contextuality`` measures (contextuality.py): the token types chosen from the
        run's counts, the sizes of the samples; and the report's ``params.contextuality``. A source
        without token ids (an array) or rows (a --keep sample run) has none, said per layer."""
        from geomscope.score import contextuality

        o = self.opts
        why = self._without_rows("token ids or sentences", "the occurrences of each token")
        if why is not None:
            self.context_why = why
            return None, {"why": why}
        counts, special = self._token_counts()
        types = contextuality.chosen_types(counts, special, o)
        self.context_bins = self._frequency_bins()[0]
        spec = {
            "types": types,
            "per_type": o.context_occurrences,
            "docs": o.context_docs,
            "pool": contextuality.pool_rows(o),
        }
        eligible = contextuality.chosen_types(counts, special, replace(o, context_types=counts.size + 1))
        described = {
            "min_occurrences": o.context_min,
            "eligible_types": int(eligible.size),
            "types": int(types.size),
            "occurrences_per_type": o.context_occurrences,
            "sentences": o.context_docs,
            "baseline_pool": contextuality.pool_rows(o),
        }
        return spec, described

    def _one_width(self) -> int:
        """The width every scored layer has (and a ``--shrinkage-target`` file's or layer's one D x D
        covariance must have); InputError (one line) when the scored layers, or the target layer,
        are of several widths (a run of ``extract --modules``)."""
        src, t = self.src, self.opts.shrinkage_target
        widths = {src.width(n) for n in src.layers}
        if self.target_layer is not None:
            widths.add(src.width(self.target_layer))
        if len(widths) == 1:
            return widths.pop()
        named = dict.fromkeys(n for n in [*src.layers, self.target_layer] if n)
        shown = ", ".join(f"{n} ({src.width(n)})" for n in named)
        raise InputError(
            f"--shrinkage-target {t} is one D x D covariance, but the layers are of {len(widths)} widths "
            f"({shown[:200]}); score the layers of one width with --layers"
        )

    def _score_layers(self) -> tuple[list[dict], dict]:
        """(every layer's report entry in the source's order, each layer's extras), batch by batch;
        the rows dropped as non-finite are logged, and a source with fewer than 2 usable rows in
        every layer is refused."""
        o, src = self.opts, self.src
        entries, extras = {}, {}
        for batch in self._batches():
            entries.update(self._score_batch(batch, extras))
        layers = [entries[n] for n in src.layers]
        for e in layers:
            if e["dropped"]["nonfinite"]:
                self.log(
                    f"{e['layer']}: {e['dropped']['nonfinite']} row(s) with NaN/Inf dropped "
                    "(counted in the report)"
                )
        if all(e["n_rows"] < 2 for e in layers):
            n = max(e["n_rows"] for e in layers)
            raise DataError(
                f"{src.path}: {n} usable row(s) per layer after dropping non-finite"
                f"{', special' if o.exclude_special else ''} rows; at least 2 are needed"
            )
        return layers, extras

    def _model_sections(self, layers: list[dict], extras: dict) -> tuple[dict | None, dict | None, dict]:
        """(the embedding matrix's isotropy, the final norm's effect, the report's top-level notes):
        the sections about the model rather than one layer, each None with a note saying why when
        the source cannot give it."""
        o, src = self.opts, self.src
        embeddings, top_notes = None, {}
        if o.wants("partition"):
            from geomscope.score.embeddings import embedding_isotropy

            embeddings, why = embedding_isotropy(src)
            if embeddings is None:
                top_notes["embeddings"] = why
        else:
            top_notes["embeddings"] = "partition not requested (--metrics)"
        if o.exclude_special and not _has_special_flags(src):
            why = f"{src.path} has no special-token column: --exclude-special excluded no row"
            top_notes["exclude_special"] = why
            self.log(why)
        final_norm = None
        if src.kind == "run":
            from geomscope.score.finalnorm import final_norm_effect

            final_norm, why = final_norm_effect(layers, extras, src.run_obj.manifest.get("final_norm"))
            if why:
                top_notes["final_norm"] = why
        else:
            top_notes["final_norm"] = "an array source has no final norm"
        return embeddings, final_norm, top_notes

    def _norms(self, layers: list[dict], extras: dict, top_notes: dict) -> dict:
        """``{"norms": [...]}`` (each norm module's effect, score/finalnorm.py) for a run that stores
        a norm module, ``{"norms": None}`` with a note when none is scored on both sides, and ``{}``
        (no key) for any other source."""
        from geomscope.schema import NORMS_KEY
        from geomscope.score.finalnorm import norm_effects, stores_norms

        src = self.src
        if src.kind != "run" or not stores_norms(src.run_obj.layers):
            return {}
        norms, why = norm_effects(
            layers, extras, src.run_obj.layers, src.run_obj.manifest.get("module_norms")
        )
        if why:
            top_notes[NORMS_KEY] = why
        return {NORMS_KEY: norms}

    def _check_sample_run(self) -> None:
        """What a ``--keep sample:N`` run cannot serve is refused up front, in one line."""
        o, n = self.opts, self.src.sample
        redo = "extract with --keep all to score every row"
        if o.max_rows:
            raise InputError(
                f"--max-rows subsamples rows, but {self.src.path} kept accumulators of every row and "
                f"a sample of {n}, not the rows; drop --max-rows, or {redo}"
            )
        needs_sample = o.needs_sample
        if needs_sample and n < ID_SAMPLE_LEAST:
            raise InputError(
                f"{self.src.path} kept a sample of {n} rows per shard (--keep sample:{n}); the intrinsic "
                f"dimension and the quantile outliers need {ID_SAMPLE_LEAST} at least: leave them out of "
                f"--metrics, or extract again with --keep sample:{ID_SAMPLE_LEAST} or more"
            )
        if needs_sample and o.id_sample > n:
            raise InputError(
                f"--id-sample {o.id_sample} is larger than the sample of {n} rows per shard that "
                f"{self.src.path} kept (--keep sample:{n}); use --id-sample {n} or less"
            )
        if needs_sample and o.seed != self.src.sample_seed:
            raise InputError(
                f"{self.src.path} kept the sample of seed {self.src.sample_seed}; score it with "
                f"--seed {self.src.sample_seed}, or extract again with --seed {o.seed}"
            )
        if o.wants("massive") and o.massive_k > MASSIVE_KEPT:
            raise InputError(
                f"{self.src.path} kept the {MASSIVE_KEPT} largest |x| entries per layer and shard; "
                f"use --massive-k {MASSIVE_KEPT} or less, or {redo}"
            )
        if (
            o.wants("outliers")
            and o.outlier_rule == "magnitude"
            and o.outlier_threshold != KEPT_ABS_THRESHOLD
        ):
            raise InputError(
                f"{self.src.path} counted |x| >= {KEPT_ABS_THRESHOLD:g} per dimension while extracting; "
                f"the magnitude rule can use only --outlier-threshold {KEPT_ABS_THRESHOLD:g} on it, or {redo}"
            )

    def _batches(self) -> list[list[str]]:
        """The scored layers in batches, in order, each holding as many consecutive layers as fit in
        ``--memory-mb`` (one at least): a layer of width D holds G x D^2 x 8 bytes in each task result
        in flight and twice more meanwhile. ``batch_size`` (the report's ``layer_batch_size``) is how
        many layers of the widest fit in one."""
        o, src = self.opts, self.src
        in_flight = (
            self.ex.in_flight
        )  # task results held besides the accumulator (2 x workers or Dask threads)
        widest = max(src.widths)
        bins = 1 + (o.frequency_bins + len(o.position_edges) + 1 if self.strata else 0)  # (strata.py)
        scale = self.G * 8 * (in_flight + 2) * bins if o.moment_metrics else 0
        rows = (
            0
            if self.context is None
            # the rows contextuality.py holds per layer (float64)
            else (
                len(self.context["types"]) * o.context_occurrences + 2 * o.context_docs + self.context["pool"]
            )
        )
        per_layer = {n: scale * src.width(n) ** 2 + rows * 8 * src.width(n) for n in src.layers}
        budget = int(o.memory_mb * 1024 * 1024)
        largest = scale * widest**2
        size = len(src.layers) if largest == 0 else max(1, budget // largest)
        _check_fits_in_memory(widest, self.G)  # (every moment pass holds G accumulators)
        if largest > budget:
            self.log(
                f"one layer's jackknife accumulators need ~{largest / 2**20:.0f} MiB "
                f"(> --memory-mb {o.memory_mb:g}); scoring one layer at a time "
                "(lower --jackknife-groups or --workers to use less)"
            )
        self.batch_size = int(size)
        batches, held = [], budget + 1
        for n in src.layers:  # (layers of one width: consecutive runs of `size` layers)
            if held + per_layer[n] > budget:
                batches.append([])
                held = 0
            batches[-1].append(n)
            held += per_layer[n]
        return batches

    def _select_rows(self) -> dict[str, int]:
        layers = list(self.src.layers)
        if self.target_layer and self.target_layer not in layers:
            layers.append(self.target_layer)
        spec = self._spec("select", layers, max_rows=self.opts.max_rows)
        parts = self._pass(self.src.tasks, spec, "selecting rows (--max-rows)")
        return {n: parts[n].select.threshold for n in layers}

    def _reference_cov(self, src: SourceInfo, layers: list[str], thresholds) -> dict[str, np.ndarray]:
        spec = self._spec("moments", layers, n_groups=1, thresholds=thresholds, extras=False)
        parts = self._pass(src.tasks, spec, f"reference covariance ({', '.join(layers)})")
        out = {}
        for n in layers:
            m = parts[n].groups[0] if parts[n].groups else None
            if m is None or m.n < 2:
                raise DataError(f"shrinkage reference layer {n} has fewer than 2 usable rows")
            out[n] = m.covariance()
        return out

    def _open_other_run(self, path: str) -> SourceInfo:
        other = open_source(path, partial=self.opts.partial, memory_mb=self.opts.memory_mb)
        if other.kind != "run":
            raise InputError(f"--shrinkage-target {path} is not a run directory")
        missing = [n for n in self.src.layers if n not in other.layers]
        if missing:
            raise InputError(
                f"--shrinkage-target run {path} has no layer {missing[0]!r}; "
                "use a run of the same model and layers"
            )
        if other.dim != self.src.dim:
            raise InputError(
                f"--shrinkage-target run {path} has D = {other.dim}, this data D = {self.src.dim}"
            )
        for n in self.src.layers:
            if other.width(n) != self.src.width(n):
                raise InputError(
                    f"--shrinkage-target run {path} has layer {n} {other.width(n)} wide, this run "
                    f"{self.src.width(n)}; use a run of the same model and modules"
                )
        return other

    # -- one batch of layers ---------------------------------------------------------------------
    def _score_batch(self, batch: list[str], extras: dict) -> dict:
        o = self.opts
        c0_by_layer = {}
        if self.other is not None:
            c0_by_layer = self._reference_cov(self.other, batch, None)
        id_k = o.id_sample if o.needs_sample else 0
        spec = self._spec(
            "moments",
            batch,
            thresholds=self.thresholds,
            extras=o.wants("avgcos") or o.wants("outliers") or o.wants("rogue"),
            abs_threshold=o.outlier_threshold if o.outlier_rule == "magnitude" else 6.0,
            id_k=id_k,
            massive_k=o.massive_k if o.wants("massive") else 0,
            strata=self.strata,
            context=self.context,
        )
        label = batch[0] if len(batch) == 1 else f"{batch[0]}..{batch[-1]}"
        parts = self._pass(self.src.tasks, spec, f"moments {label}")
        entries = {}
        for name in batch:
            c0 = self.c0_fixed if self.c0_fixed is not None else c0_by_layer.get(name)
            entries[name] = state = LayerResult(
                name,
                self.src.indices.get(name),
                parts.get(name),
                self.src,
                o,
                self.G,
                c0 if c0 is not None else self.target,
            )
            state.keep_groups = self.basis is not None and name in self.basis.pairs
            if self.strata_why:
                state.notes["strata"] = self.strata_why
            if self.context_why:
                state.notes["contextuality"] = self.context_why
            state.context_bins = self.context_bins
            if o.wants("massive") and state.lp is not None and state.lp.massive_missing:
                state.lp.massive = None
                state.notes["massive"] = (
                    f"this run kept accumulators and a sample (--keep sample:{self.src.sample}) but not "
                    "the largest |x| entries (it was extracted before they were kept); extract it again"
                )
            state.threads = self.threads  # layers are finished one per --workers thread at a time
        self._each(entries.values(), LayerResult.moments)
        if self.basis is not None:
            self._gradient_energy(entries)
        self._second_pass(entries, label)
        self._each(entries.values(), LayerResult.finish)
        out = {}
        for name, state in entries.items():
            extras[name] = state.extra
            out[name] = state.entry()
        return out

    def _second_pass(self, entries: dict, label: str) -> None:
        """The average cosines of shifted, scaled or projected rows (centred, standardised,
        all-but-the-top, whitened): one more pass over the rows of the layers that need it, or null
        with why for a --keep sample run, which kept no rows to shift."""
        o = self.opts
        unit = {n: s for n, s in entries.items() if o.needs_second_pass and s.unit_spec is not None}
        post = {n: s for n, s in entries.items() if s.post_spec is not None}
        if (unit or post) and self.src.sample is not None:
            kept = (
                f"this run kept accumulators and a sample (--keep sample:{self.src.sample}); extract "
                "with --keep all for it"
            )
            for s in unit.values():
                s.cosine_variants_unavailable(
                    "needs every row (each is shifted by the mean of all rows, and scaled by their std, "
                    f"before it is normalised); {kept}"
                )
            for s in post.values():
                s.post_cosines_unavailable(
                    "needs every row (each is centred and projected or whitened with the covariance of "
                    f"all rows before it is normalised); {kept}"
                )
            return
        if not unit and not post:
            return
        spec = self._spec(
            "unit",
            list({**unit, **post}),
            thresholds=self.thresholds,
            unit={n: s.unit_spec for n, s in unit.items()},
            post={n: s.post_spec for n, s in post.items()},
            abtt_k=o.abtt_k,
        )
        parts = self._pass(self.src.tasks, spec, f"{'centred' if unit else 'processed'} cosine {label}")
        for n, s in unit.items():
            s.cosine_variants(parts[n].unit)
        for n, s in post.items():
            s.post_cosines(parts[n].post)

    def _gradient_energy(self, entries: dict) -> None:
        """Captured gradient energy of this batch's gradient layers (gradenergy.py) in the basis run's
        activation subspaces, from the moments already merged and one pass over the basis run."""
        from geomscope.metrics.subspace import gradient_energy, top_eigenpairs
        from geomscope.score.gradenergy import energy_se, removal_target, second_moment

        o = self.opts
        pairs = {n: self.basis.pairs[n] for n in entries if n in self.basis.pairs}
        if not pairs:
            return
        covs = self._reference_cov(self.basis.src, sorted(set(pairs.values())), None)

        def one(name: str) -> None:
            state = entries[name]
            groups = None
            if state.lp is not None:  # freed once this layer is done
                groups, state.lp.groups = state.lp.groups, None
            if state.full is None or state.full.n < 1:
                self.energy[name] = None
                self.energy_notes[name] = "no usable gradient rows"
                return
            S, mean = second_moment(state.full)
            C = covs[pairs[name]]
            eig = top_eigenpairs(C, max(o.ranks) + 1)  # once, for the energies and their SEs
            rows = gradient_energy(
                S,
                mean,
                C,
                o.ranks,
                controls=o.controls,
                seed=o.seed,
                zeta=o.zeta,
                target=removal_target(self.target),
                act_eig=eig,
            )
            ses = energy_se(groups or [], state.live, eig[1], o.ranks)
            # a rank beyond C_act's numerical rank has no energy (its U_r is arbitrary), and so no SE
            self.energy[name] = [
                _with_se(row, se if row["energy"] is not None else None)
                for row, se in zip(rows, ses, strict=True)
            ]

        self._each(list(pairs), one)

    def _each(self, states, method) -> None:
        """Run ``method(state)`` for every layer; with --workers N in N threads (eigensolvers, BLAS and
        the neighbour search release the GIL; each layer's numbers do not depend on the others)."""
        states = list(states)
        if self.opts.workers <= 1 or len(states) <= 1:
            for st in states:
                method(st)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(self.opts.workers, len(states))) as pool:
            for f in [pool.submit(method, st) for st in states]:
                f.result()

    # -- report ------------------------------------------------------------------------------
    def _energy_section(self) -> dict | None:
        if self.basis is None:
            return None
        from geomscope.score.gradenergy import section

        by_layer = {n: self.energy.get(n) for n in self.src.layers if n in self.basis.pairs}
        return section(self.basis, self.opts, by_layer, self.energy_notes)

    def _uncertainty(self) -> dict:
        """The report's ``params.uncertainty``: how each requested family's SE is estimated."""
        o = self.opts
        unc = {}
        if o.moment_metrics:
            unc["moments"] = (
                f"delete-one-group jackknife over {self.G} " + GROUPS_TEXT[self.src.groups]
                if self.G >= 2
                else "none (--jackknife-groups 0)"
            )
        if o.id_names:
            unc.update(idest.uncertainty_methods(o))
        if o.wants("similarity"):
            from geomscope.score.similarity import uncertainty

            unc.update(uncertainty(o))
        if o.wants("partition"):
            unc["partition"] = "none: I(W) is an exact function of the checkpoint's weights (no sampling)"
        return unc

    def _report(self, layers: list[dict], embeddings, top_notes, final_norm=None, norms=None) -> dict:
        from geomscope import __version__

        o, src = self.opts, self.src
        dup = {e["layer"]: e["twonn_duplicates_removed"] for e in layers}
        unc = self._uncertainty()
        return {
            "format": REPORT_FORMAT,
            "format_version": REPORT_FORMAT_VERSION,
            "geomscope_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": src.describe(),
            "model": src.model,
            "run": src.run,
            "params": {
                "metrics": list(o.metrics),
                "zeta": o.zeta,
                "target": self.target,
                "avgcos_variants": list(o.avgcos_variants),
                "outlier_rule": o.outlier_rule,
                "outlier_threshold": o.outlier_threshold,
                "id_estimator": ",".join(o.id_names) if o.id_names else None,
                "twonn_fit": o.twonn_fit,
                "discard_fraction": o.discard_fraction,
                "id_sample": o.id_sample,
                "seed": o.seed,
                "exclude_special": o.exclude_special,
                "max_rows": o.max_rows,
                "layers": list(src.layers),
                "duplicates_removed": dup,
                "uncertainty": unc,
                "jackknife_groups": self.G if self.G >= 2 else 0,
                "product_dtype": self.product_dtype,
                "workers": o.workers,
                "scheduler": o.scheduler,
                "layer_batch_size": self.batch_size,
                "rows_total": self.rows,
                **postprocess.params(o),
                **strata_params(o, self.strata_described),
                **context_params(o, self.context_described),
            },
            "layers": layers,
            "embeddings": embeddings,
            "final_norm": final_norm,
            **(norms or {}),  # only a run that stores norm modules has the key
            "gradient_energy": self._energy_section(),
            "notes": top_notes,
            "command": None,  # the CLI records its command line here
        }


def _with_key_before(d: dict, before: str, key: str, value) -> dict:
    """``d`` with ``key: value`` inserted just before ``before`` (the order JSON writes)."""
    out = {}
    for k, v in d.items():
        if k == before:
            out[key] = value
        out[k] = v
    return out


def _check_fits_in_memory(dim: int, groups: int) -> None:
    """A layer's D x D accumulators (one per jackknife group) and one block's D x D product are the
    least a pass holds, however the layers are batched and whatever is in flight: more than the
    machine's memory is one line before anything is allocated, not a MemoryError after minutes."""
    total = resources.physical_memory()
    if total is None:
        return
    matrix = dim * dim * 8
    if 2 * matrix > total:
        raise InputError(
            f"D = {dim} is too wide to score on this machine: one layer's D x D covariance needs "
            f"~{2 * matrix / 2**30:.1f} GiB of its {total / 2**30:.1f} GiB; score the rows projected onto "
            "fewer dimensions"
        )
    if (groups + 1) * matrix > total:
        raise InputError(
            f"D = {dim}: one layer's {groups} jackknife accumulators (D x D float64 each) need "
            f"~{(groups + 1) * matrix / 2**30:.1f} GiB, more than this machine's {total / 2**30:.1f} GiB; "
            "lower --jackknife-groups"
        )
