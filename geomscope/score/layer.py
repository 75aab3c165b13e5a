"""A layer's report entry: from its merged accumulators and sample to the numbers, SEs and notes."""

from __future__ import annotations

import numpy as np

from geomscope.metrics.moments import MAX_THREADED_M2_BYTES, map_in_order
from geomscope.schema import EXTRA_ID_PREFIX, SCALAR_METRIC_NAMES
from geomscope.score import (
    compute,
    contextuality,
    idest,
    local,
    massive,
    outliers,
    postprocess,
    rogue,
    similarity,
    strata,
)
from geomscope.score.options import ScoreOptions
from geomscope.score.sources import SourceInfo

#: the diagnostic families measured on every Moments (the full data's and each jackknife replicate's):
#: each module has ``wanted(o)``, ``keys(o)`` (its scalar keys) and ``measure(m, o, c0, notes)`` ->
#: (values, what the layer keeps of that Moments for the family's later steps)
MOMENT_FAMILIES = (postprocess, rogue)


def _measured(m, o: ScoreOptions, c0, notes: dict) -> tuple[dict, dict]:
    """(values, pieces by family module name) of the diagnostic families ``o`` requests."""
    values, pieces = {}, {}
    for family in MOMENT_FAMILIES:
        if family.wanted(o):
            v, pieces[family.__name__] = family.measure(m, o, c0, notes)
            values.update(v)
    return values, pieces


#: every diagnostic family with scalar keys in a layer entry, in the entry's order
LAYER_FAMILIES = (*MOMENT_FAMILIES, massive, similarity, strata, contextuality, local)


def _family_keys(o: ScoreOptions) -> list[str]:
    return [k for family in LAYER_FAMILIES for k in family.keys(o)]


class LayerResult:
    """One layer's numbers as they are computed, and its report entry (:meth:`entry`).

    The scoring passes fill it in order: :meth:`moments` (every moment metric and its jackknife
    replicates), :meth:`cosine_variants` (the second pass's centred/standardised cosine), then
    :meth:`finish` (intrinsic dimension and outliers on the sample). compute.py, outliers.py and
    idest.py hold the arithmetic; this class is where a layer's parts become its entry.
    """

    def __init__(self, name, index, lp, src: SourceInfo, opts: ScoreOptions, G: int, c0):
        self.name, self.index, self.lp, self.opts, self.G, self.c0 = name, index, lp, opts, G, c0
        self.counts = dict(lp.counts) if lp is not None else {}
        self.n = int(self.counts.get("used", 0))
        self.values: dict = {}
        self.reps: dict[str, list] = {}
        self.notes: dict[str, str] = {}
        self.flags: list[str] = list(src.flags)
        self.unit_spec = None
        self.post_spec = None  # the second pass's all-but-the-top / whitening spec (postprocess.py)
        self.post_have: set = set()  # the replicates whose covariance gave that spec its pieces
        self.full = None
        self.live: list[int] = []
        self.n_live = 0
        self.rep_stats: list = []
        self.extra: dict = {}
        self.listed: dict = {}  # the families' per-layer lists (rogue_dims), in the entry after the scalars
        self.family_se: dict = {}  # SEs a family computes itself (the strata's bins, contextuality)
        self.context_bins = None  # each token id's frequency bin (contextuality's by_frequency)
        self.dim = src.width(name)
        self.keep_groups = False  # True: the groups outlive moments() (score --basis: energy SEs)
        self.threads = 1  # threads for the jackknife replicates (the scorer: its cores per layer at a time)
        if self.counts.get("nonfinite"):
            self.flags.append("nonfinite_rows_dropped")

    def _groups(self):
        return self.lp.groups if self.lp is not None and self.lp.groups else None

    def moments(self) -> None:
        o, c0 = self.opts, self.c0
        groups = self._groups()
        if not o.moment_metrics:
            return
        if groups is None or self.n < 2:
            why = f"{self.n} usable row(s); at least 2 are needed"
            for k in (*_moment_keys(o), *_family_keys(o)):
                self.values[k] = None
                self.notes.setdefault(k, why)
            return
        self.full = full = compute.merged(groups)
        self.values = compute.moment_values(full, o, c0, self.notes, full=True)
        family_values, full_pieces = _measured(full, o, c0, self.notes)
        self.values.update(family_values)
        if full.n <= full.dim and (o.wants("isoscore") or o.wants("isoscore_star") or o.wants("spectrum")):
            self.flags.append("rank_limited")
        if o.wants("avgcos") and full.n_zero_norm:
            self.flags.append("zero_norm_rows")
        self.extra["count_abs_ge"] = (
            [g.count_abs_ge if g.n else np.zeros(full.dim, np.int64) for g in groups] if full.extras else None
        )
        self.extra["variance"] = full.variance() if full.n >= 2 else None  # the final norm's effect
        self.extra["n_groups"] = [g.n for g in groups]
        live = compute.nonempty(groups) if self.G >= 2 else []
        self.n_live = len(live)
        if len(live) < 2:  # leaving out the only group leaves nothing: no replicates
            live = []
        self.live = live
        replicate_shifts, rep_pieces = self._jackknife_replicates(groups)
        if replicate_shifts:
            self.unit_spec = self._unit_spec(replicate_shifts)
        self._family_pieces(full_pieces, rep_pieces)
        if strata.wanted(o):
            self._strata()
        if not self.keep_groups:  # every number needing them is computed: free G x D x D floats now
            self.lp.groups = None

    def _strata(self) -> None:
        """Each frequency and position bin's metrics and their SEs (strata.py), from the bins'
        accumulators, which are freed."""
        parts = self.lp.strata if self.lp is not None else None
        got, listed = strata.summary(parts, self.opts, self.c0, self.G, self.notes)
        self.values.update(got["values"])
        self.family_se.update(got["se"])
        self.listed["strata"] = listed
        if self.lp is not None:
            self.lp.strata = None

    def _family_pieces(self, full: dict, replicates: dict[int, dict]) -> None:
        """What the diagnostic families make of the full data's and the replicates' pieces: the second
        pass's all-but-the-top / whitening spec, the rogue contributors' list."""
        post = full.get(postprocess.__name__)
        if post:
            by_r = {r: p.get(postprocess.__name__) or {} for r, p in replicates.items()}
            self.post_have = {r for r, pieces in by_r.items() if pieces}
            self.post_spec = postprocess.pass_spec(post, by_r, self.G if self.G >= 2 else 0)
        if rogue.wanted(self.opts):
            reps = [replicates[r].get(rogue.__name__) for r in self.live]
            self.listed["rogue_dims"] = rogue.listed(full.get(rogue.__name__), reps)

    def _jackknife_replicates(self, groups) -> tuple[dict[str, list], dict[int, dict]]:
        """The delete-one-group jackknife replicates of the moment metrics (``reps``) and of the outlier
        statistic (``rep_stats``), one per live group in order; return, per second-pass cosine variant,
        each replicate's (shift, scale) of the rows (empty when no second pass is needed), and each
        replicate's pieces of the diagnostic families (:func:`_measured`)."""
        o, c0 = self.opts, self.c0
        shifts = {v: [] for v in o.second_pass_variants}
        self.rep_stats = []

        def replicate(r, _scratch):  # replicate r's numbers (an eigensolve each: threads pay)
            m = compute.merged(groups, skip=r)
            shift_scale = {v: compute.unit_shift_scale(m, v) for v in shifts}
            values = compute.moment_values(m, o, c0, {}, full=False)
            family_values, pieces = _measured(m, o, c0, {})
            values.update(family_values)
            return values, outliers.replicate_statistic(m, o), shift_scale, pieces

        # each replicate in flight holds a merged D x D scatter: large ones one at a time, as in moments.py
        threads = self.threads if 8 * self.full.dim**2 <= MAX_THREADED_M2_BYTES else 1
        rep_pieces = {}
        for r, (vals, stat, shift_scale, pieces) in zip(
            self.live, map_in_order(replicate, self.live, threads), strict=True
        ):
            for k, v in vals.items():
                self.reps.setdefault(k, []).append(v)
            self.rep_stats.append(stat)
            for v in shifts:
                shifts[v].append(shift_scale[v])
            rep_pieces[r] = pieces
        return shifts, rep_pieces

    def _unit_spec(self, replicate_shifts: dict[str, list]) -> dict[str, tuple]:
        """The second pass's spec per cosine variant: (shifts, scales) stacked over the G jackknife
        replicates (the full data's for a replicate not computed) and the full data last; scales
        None when none of them has any."""
        full = self.full
        spec = {}
        for v, lst in replicate_shifts.items():
            sh_full, sc_full = compute.unit_shift_scale(full, v)
            by_r = dict(zip(self.live, lst, strict=True))
            rows = [by_r.get(r, (sh_full, sc_full)) for r in range(self.G if self.G >= 2 else 0)]
            rows.append((sh_full, sc_full))
            sh = np.stack([a for a, _ in rows])
            # the centred cosine has no scales unless some replicate has a constant dimension
            scales = [b for _, b in rows]
            sc = (
                None
                if all(b is None for b in scales)
                else np.stack([_ones_if_none(b, full.dim) for b in scales])
            )
            spec[v] = (sh, sc)
        return spec

    def cosine_variants(self, unit: dict) -> None:
        from geomscope.metrics import avgcos_from_sum

        for v, mus in unit.items():
            key = compute.AVGCOS_KEY[v]
            last = mus.replicates - 1
            self.values[key] = compute.value_or_note(
                lambda m=mus, r=last: float(avgcos_from_sum(m.sum_unit[r], m.n_unit(r))), self.notes, key
            )
            if self.live:
                self.reps[key] = [
                    compute.value_or_note(
                        lambda m=mus, r=r: float(avgcos_from_sum(m.sum_unit[r], m.n_unit(r))), {}, key
                    )
                    for r in self.live
                ]

    def post_cosines(self, sums: dict) -> None:
        """The second pass's all-but-the-top and whitened average cosines, and their replicates."""
        values, reps = postprocess.cosine_values(sums, self.opts, self.live, self.post_have, self.notes)
        self.values.update(values)
        self.reps.update(reps)

    def post_cosines_unavailable(self, why: str) -> None:
        postprocess.unavailable(self.opts, why, self.values, self.notes)
        self.post_spec = None

    def cosine_variants_unavailable(self, why: str) -> None:
        """The centred/standardised cosines cannot be served from what the source kept: null, with why."""
        for v in self.unit_spec or {}:
            key = compute.AVGCOS_KEY[v]
            self.values[key] = None
            self.notes[key] = why
        self.unit_spec = None

    def finish(self) -> None:
        self.intrinsic()
        self.outliers_moment()
        self.massive_activations()
        self.contexts()
        self.local_isotropy()

    def local_isotropy(self) -> None:
        """IsoScore, average cosines and TwoNN within k-means clusters of the sample (local.py)."""
        if not local.wanted(self.opts):
            return
        values, ses, entry = local.summary(self.sample, self.sample_groups, self.opts, self.notes)
        self.values.update(values)
        self.family_se.update(ses)
        self.listed["local"] = entry

    def contexts(self) -> None:
        """Self-similarity, intra-sentence similarity and MEV with their baselines (contextuality.py)."""
        if not contextuality.wanted(self.opts):
            return
        part = self.lp.context if self.lp is not None else None
        values, ses, entry = contextuality.summary(part, self.opts, self.G, self.context_bins, self.notes)
        self.values.update(values)
        self.family_se.update(ses)
        self.listed["contextuality"] = entry
        if self.lp is not None:
            self.lp.context = None

    def massive_activations(self) -> None:
        """The largest |x| entries the pass kept, and their ratio to the median |x| (massive.py)."""
        if not massive.wanted(self.opts):
            return
        top = self.lp.massive if self.lp is not None else None
        values, section = massive.summary(top, self.notes)
        self.values.update(values)
        self.listed["massive"] = section

    def intrinsic(self) -> None:
        o = self.opts
        self.sample = self.sample_groups = None
        if self.lp is not None and self.lp.reservoir is not None:
            kept = self.lp.reservoir.sample_with_meta()
            if kept is not None:
                self.sample, self.sample_groups = kept[1], kept[2].get("group")
                if similarity.wanted(o):  # (held until every layer is scored)
                    self.extra["similarity_sample"] = (kept[0], kept[1], kept[2].get("group"))
        self.id_info = idest.estimate(self.sample, o, self.notes) if o.id_names else {}

    def outliers_moment(self) -> None:
        o = self.opts
        self.out = None
        if not o.wants("outliers") or o.outlier_rule == "magnitude":
            return
        self.out = outliers.layer_outliers(self.full, self.sample, self.rep_stats, o, self.notes)

    def entry(self) -> dict:
        o = self.opts
        v = self.values
        se = {}
        for k in scalar_keys(o):  # every requested scalar metric has an se entry (null: see notes)
            if k in self.reps:
                se[k] = compute.jackknife_se(self.reps[k])
            elif k in self.family_se:
                se[k] = self.family_se[k]
            else:
                se[k] = self.id_info.get("se", {}).get(k)
        if self.G < 2 and o.moment_metrics:
            self.notes.setdefault(
                "se", "jackknife off (--jackknife-groups 0): no standard errors for moment metrics"
            )
        elif o.moment_metrics and self.full is not None and self.n_live < 2:
            self.notes.setdefault(
                "se",
                f"rows fall in {self.n_live} jackknife group(s); at least 2 are needed "
                "for standard errors of moment metrics",
            )
        for k in scalar_keys(o):
            general = "se" in self.notes and k not in self.id_info.get("se", {})
            if not general and se[k] is None and v.get(k, self.id_info.get("values", {}).get(k)) is not None:
                self.notes.setdefault(
                    f"se.{k}", "standard error undefined: a replicate has no value or too few groups/points"
                )
        id_values = self.id_info.get("values", {})
        e = {
            "layer": self.name,
            "index": self.index,
            "n_rows": self.n,
            **{m: id_values.get(m) if m == "twonn" else v.get(m) for m in SCALAR_METRIC_NAMES},
            "outliers": self.out["dims"] if self.out else [],
            "se": se,
            "eigenvalues": v.get("eigenvalues", []),
            "outlier_statistic": self.out["statistic"] if self.out else [],
            "outlier_support": self.out["support"] if self.out else [],
            "twonn_n_used": self.id_info.get("n_used", 0),
            "twonn_duplicates_removed": self.id_info.get("duplicates_removed", 0),
            "dropped": {k: int(self.counts.get(k, 0)) for k in ("nonfinite", "special", "not_sampled")},
            "flags": sorted(set(self.flags)),
            "notes": self.notes,
        }
        for name in o.extra_id:
            e[f"{EXTRA_ID_PREFIX}{name}"] = id_values.get(f"{EXTRA_ID_PREFIX}{name}")
        for key in _family_keys(o):
            e[key] = v.get(key)
        e.update(self.listed)
        _fill_null_notes(e, o)
        return e


def _moment_keys(o: ScoreOptions) -> list[str]:
    keys = []
    if o.wants("isoscore"):
        keys.append("isoscore")
    if o.wants("isoscore_star"):
        keys.append("isoscore_star")
    if o.wants("avgcos"):
        keys += [compute.AVGCOS_KEY[v] for v in o.avgcos_variants]
    if "standardised" in o.second_pass_variants and compute.AVGCOS_KEY["standardised"] not in keys:
        keys.append(compute.AVGCOS_KEY["standardised"])  # rogue: the cosine with them standardised away
    if o.wants("spectrum"):
        keys += list(compute.SPECTRUM_KEYS)
    return keys


def scalar_keys(o: ScoreOptions) -> list[str]:
    """The scalar metric keys ``o`` requests, in report order (each with an ``se`` entry)."""
    keys = _moment_keys(o)
    if "twonn" in o.id_names:
        keys.append("twonn")
    keys += [f"{EXTRA_ID_PREFIX}{n}" for n in o.extra_id]
    return keys + _family_keys(o)


def _fill_null_notes(e: dict, o: ScoreOptions) -> None:
    wanted = set(scalar_keys(o))
    for k in (*SCALAR_METRIC_NAMES, *[f"{EXTRA_ID_PREFIX}{n}" for n in o.extra_id], *_family_keys(o)):
        if e.get(k) is None and k not in e["notes"]:
            e["notes"][k] = (
                "not requested (--metrics / --avgcos-variants)"
                if k not in wanted
                else "undefined for this layer"
            )


def _ones_if_none(scale: np.ndarray | None, dim: int) -> np.ndarray:
    """A replicate's cosine scale, or ones for one without (centred, no constant dimension)."""
    return np.ones(dim) if scale is None else scale
