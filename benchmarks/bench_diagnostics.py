"""The anisotropy diagnostics of ``score`` vs what a user would otherwise run, on the bundled MiniLM.

    python benchmarks/bench_diagnostics.py [--quick]

Data: ``extract bundled:minilm`` over sample_data/sentences.txt (the first 100 sentences with
``--quick``, all 400 otherwise), every layer, into a temporary run (not timed).

Rows (ratio = alternative seconds / geomscope seconds, > 1 means geomscope is faster; the note gives
the largest difference between the two sides' values). geomscope: ``score(run, --metrics FAMILY
--jackknife-groups 0)``, which reads the shards and streams them (moments pass, and the family's own
work); the alternative: what a user's script does with numpy/scipy on every layer's rows loaded from
the run (reading not timed), the values only:
- all-but-the-top (k = 1, 5, 10) and whitening: rows centred, projected off the top right singular
  vectors of an SVD (Mu & Viswanath's code), IsoScore by the ``isoscore`` package's steps in float64,
  the average cosine by the sum of unit vectors (the cheap exact form, which flatters the
  alternative: the pairwise matrix a script usually builds does not fit for the larger run), ZCA
  whitening from the same SVD; a second row with the 10-group jackknife SE (geomscope's one pass of
  replicates vs the alternative's delete-one-group loop);
- rogue dimensions: each dimension's E[u_d v_d] over distinct pairs from the unit rows, divided by
  the average cosine, the top shares;
- massive activations: the largest |x| by a partial sort of every entry, numpy's median of |x|;
- similarity: linear CKA in its feature-space form (``torch_cka``-style, ||Y_c^T X_c||^2 / ...) and
  RSA by scipy's ``pdist`` + ``spearmanr`` between every pair of layers, on the same 1000 sample rows;
- stratified: token counts, equal-mass frequency bins and position bins, then numpy's covariance,
  IsoScore and average cosine of each bin's rows;
- contextuality: the types, occurrences and sentences drawn as geomscope draws them, then
  Ethayarajh's loop: each type's pairwise cosines and SVD, each sentence's cosines to its mean, the
  baselines;
- local isotropy: scikit-learn's ``KMeans`` (k = 3, 4 starts) on the 5000-row sample, then each
  cluster's IsoScore, average cosines and TwoNN (scikit-dimension's would refuse duplicates;
  geomscope's is used for both); the clusterings differ (other starts), so the note gives the
  difference of the weighted means, not a check.
Timings alternate the sides (``_common.alternate``), medians of several repeats after a warm-up.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import alternate, bench_args, print_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 5, 10)


def minilm_run(sentences: int) -> Path:
    """A run of the bundled MiniLM over the first ``sentences`` lines of sample_data (every layer)."""
    from geomscope.extract.run import extract

    work = Path(tempfile.mkdtemp(prefix="bench-diagnostics-"))
    text = work / "sentences.txt"
    text.write_text("\n".join((ROOT / "sample_data" / "sentences.txt").read_text().splitlines()[:sentences]))
    extract("bundled:minilm", [text], work / "run", device="cpu")
    return work / "run"


def run_rows(run: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{layer: (rows as float64, doc ids)}, read from the shards as a user's script would."""
    from geomscope.store import Run, iter_shard

    r = Run(run)
    out = {}
    for name in r.layer_names:
        xs, docs = [], []
        for s in r.shards:
            for ch in iter_shard(r.shard_path(s), [name]):
                xs.append(np.asarray(ch.layers[name], np.float64))
                docs.append(ch.doc_id)
        out[name] = (np.concatenate(xs), np.concatenate(docs))
    return out


# ------------------------------------------------------------------ the alternative, by hand
def _isoscore(z: np.ndarray) -> float:
    """The isoscore package's steps in float64: covariance, eigenvalues normalised to sqrt(D), defect,
    dimensions used."""
    lam = np.linalg.eigvalsh(np.cov(z.T))
    d = float(z.shape[1])
    hat = lam * np.sqrt(d) / np.linalg.norm(lam)
    defect = np.linalg.norm(hat - 1.0) / np.sqrt(2.0 * (d - np.sqrt(d)))
    k = (d - defect**2 * (d - np.sqrt(d))) ** 2 / d
    return float((k - 1.0) / (d - 1.0))


def _avgcos(z: np.ndarray) -> float:
    norms = np.linalg.norm(z, axis=1)
    u = z[norms > 0] / norms[norms > 0, None]
    s = u.sum(axis=0)
    n = len(u)
    return float((s @ s - n) / (n * (n - 1)))


def numpy_abtt_whitened(x: np.ndarray) -> dict[str, float]:
    """All-but-the-top (Mu & Viswanath) and ZCA whitening of rows ``x``, IsoScore and average cosine."""
    y = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(y, full_matrices=False)
    out = {}
    for k in KS:
        z = y - (y @ vt[:k].T) @ vt[:k]
        out[f"abtt{k}_isoscore"], out[f"abtt{k}_avgcos"] = _isoscore(z), _avgcos(z)
    keep = s**2 > s[0] ** 2 * x.shape[1] * np.finfo(np.float64).eps
    w = y @ vt[keep].T @ np.diag(np.sqrt(len(x) - 1) / s[keep]) @ vt[keep]
    out["whitened_avgcos"] = _avgcos(w)
    return out


def numpy_side(rows: dict, groups: int) -> dict[str, dict[str, float]]:
    """Every layer's values, and with ``groups`` >= 2 the delete-one-group replicates as well."""
    out = {}
    for name, (x, docs) in rows.items():
        out[name] = numpy_abtt_whitened(x)
        for r in range(groups):
            numpy_abtt_whitened(x[docs % groups != r])
    return out


def geomscope_side(run: Path, groups: int) -> dict:
    from geomscope.score import ScoreOptions, score

    rep = score(run, ScoreOptions(metrics="abtt,whitened", abtt_k=KS, jackknife_groups=groups, verify=False))
    return {e["layer"]: e for e in rep["layers"]}


def abtt_rows(run: Path, rows: dict, repeats: int, size: str) -> list[dict]:
    out = []
    for groups, what in ((0, "values"), (10, "values + 10-group jackknife SE")):
        ours, theirs = geomscope_side(run, groups), numpy_side(rows, 0)
        diff = max(abs(ours[n][k] - v) for n, vals in theirs.items() for k, v in vals.items())
        t = alternate(
            {"g": lambda g=groups: geomscope_side(run, g), "n": lambda g=groups: numpy_side(rows, g)},
            repeats=repeats,
        )
        out.append(
            {
                "benchmark": f"all-but-the-top (k = 1, 5, 10) + whitening, {what}, {size}",
                "geomscope": t["g"],
                "alternative": t["n"],
                "ratio": t["n"] / t["g"],
                "target": ">= 1",
                "note": f"median s of {repeats}; max |geomscope - numpy| = {diff:.1e}; numpy on the rows "
                "already in memory (reading not timed), geomscope streams the shards",
            }
        )
    return out


def _score(run: Path, metrics: str, **kw) -> dict:
    from geomscope.score import ScoreOptions, score

    rep = score(run, ScoreOptions(metrics=metrics, jackknife_groups=0, verify=False, **kw))
    return {"layers": {e["layer"]: e for e in rep["layers"]}, "report": rep}


def _row(name: str, size: str, t: dict, repeats: int, diff: float | None, note: str = "") -> dict:
    shown = "n/a" if diff is None else f"{diff:.1e}"
    return {
        "benchmark": f"{name}, {size}",
        "geomscope": t["g"],
        "alternative": t["n"],
        "ratio": t["n"] / t["g"],
        "target": ">= 1",
        "note": f"median s of {repeats}; max |geomscope - alternative| = {shown}"
        + (f"; {note}" if note else ""),
    }


def _meta(run: Path) -> dict[str, np.ndarray]:
    """token_id, doc_id, position, is_special of every row (the same in every layer)."""
    from geomscope.store import Run, iter_shard

    r = Run(run)
    name = r.layer_names[0]
    out = {k: [] for k in ("token_id", "doc_id", "position", "is_special")}
    for s in r.shards:
        for ch in iter_shard(r.shard_path(s), [name]):
            for k in out:
                out[k].append(np.asarray(getattr(ch, k)))
    return {k: np.concatenate(v) for k, v in out.items()}


def _rogue_numpy(rows: dict) -> dict:
    out = {}
    for name, (x, _) in rows.items():
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        n = len(u)
        s = u.sum(axis=0)
        cc = (s * s - (u * u).sum(axis=0)) / (n * (n - 1))
        share = np.sort(cc / cc.sum())[::-1]
        out[name] = {"rogue_top1_share": share[0], "rogue_top3_share": share[:3].sum()}
    return out


def _massive_numpy(rows: dict) -> dict:
    out = {}
    for name, (x, _) in rows.items():
        a = np.abs(x).ravel()
        top = a[np.argpartition(a, a.size - 20)[a.size - 20 :]].max()
        out[name] = {"massive_max_abs": top, "massive_ratio": top / np.median(a)}
    return out


def _cka(x, y):
    xc, yc = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(yc.T @ xc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))


def _similarity_numpy(rows: dict, meta: dict, n: int = 1000) -> dict:
    from scipy.spatial.distance import pdist
    from scipy.stats import spearmanr

    from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash, run_keys

    keys = run_keys(meta["doc_id"], meta["position"])
    order = np.argsort(row_hash(keys, 0, STREAM_ID_SAMPLE), kind="stable")[:n]
    names = list(rows)
    xs = [rows[k][0][order] for k in names]
    dist = [np.round(pdist(x, "correlation"), 12) for x in xs]
    out = {}
    for i in range(1, len(names)):
        out[names[i]] = {
            "cka_prev": _cka(xs[i - 1], xs[i]),
            "rsa_prev": spearmanr(dist[i - 1], dist[i]).statistic,
        }
    return out


def _iso(c):
    d = c.shape[0]
    return (np.trace(c) ** 2 / (c * c).sum() - 1) / (d - 1)


def _avgcos(z):
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    s = u.sum(axis=0)
    return (s @ s - len(u)) / (len(u) * (len(u) - 1))


def _strata_numpy(rows: dict, meta: dict, bins: int = 4, edges=(1, 8, 32, 128)) -> dict:
    counts = np.bincount(meta["token_id"])
    order = np.lexsort((np.arange(counts.size), -counts))
    order = order[counts[order] > 0]
    before = np.cumsum(counts[order]) - counts[order]
    bin_of = np.full(counts.size, bins - 1)
    bin_of[order] = np.minimum(bins - 1, before * bins // counts.sum())
    labels = {"freq": bin_of[meta["token_id"]], "pos": np.searchsorted(edges, meta["position"], side="right")}
    out = {}
    for name, (x, _) in rows.items():
        vals = {}
        for short, lab in labels.items():
            for b in range(lab.max() + 1):
                z = x[lab == b]
                if len(z) > 2 and np.ptp(z, axis=0).any():
                    c = np.cov(z.T)
                    vals[f"{short}{b + 1}_isoscore"] = _iso(c)
                    vals[f"{short}{b + 1}_avgcos"] = _avgcos(z)
        out[name] = vals
    return out


def _context_numpy(rows: dict, meta: dict, o) -> dict:
    """Ethayarajh's loop over the types, occurrences and sentences geomscope draws."""
    from geomscope.score.contextuality import chosen_types
    from geomscope.store.sample import (
        STREAM_CONTEXT_DOCS,
        STREAM_CONTEXT_POOL,
        STREAM_CONTEXT_ROWS,
        row_hash,
        run_keys,
    )

    tokens, special = meta["token_id"], meta["is_special"].astype(bool)
    keys = run_keys(meta["doc_id"], meta["position"])
    counts = np.bincount(tokens)
    types = chosen_types(counts, np.bincount(tokens[special], minlength=counts.size), o)
    ordinary = np.flatnonzero(~special)
    occ = []
    for t in types:
        r = ordinary[tokens[ordinary] == t]
        occ.append(r[np.argsort(row_hash(keys[r], o.seed, STREAM_CONTEXT_ROWS))][: o.context_occurrences])
    docs = np.unique(meta["doc_id"][ordinary])
    docs = docs[np.argsort(row_hash(docs.astype(np.uint64), o.seed, STREAM_CONTEXT_DOCS))][: o.context_docs]
    pool = ordinary[np.argsort(row_hash(keys[ordinary], o.seed, STREAM_CONTEXT_POOL))][
        : 64 * o.context_occurrences
    ]
    out = {}
    for name, (x, _) in rows.items():
        selfs, mevs = [], []
        for r in occ:
            u = x[r] / np.linalg.norm(x[r], axis=1, keepdims=True)
            g = u @ u.T
            selfs.append((g.sum() - np.trace(g)) / (len(r) * (len(r) - 1)))
            sv = np.linalg.svd(x[r], compute_uv=False)
            mevs.append(sv[0] ** 2 / (sv**2).sum())
        intra = []
        for d in docs:
            y = x[ordinary[meta["doc_id"][ordinary] == d]]
            m = y.mean(axis=0)
            intra.append(np.mean(y @ m / (np.linalg.norm(y, axis=1) * np.linalg.norm(m))))
        base = _avgcos(x[ordinary])
        size = o.context_occurrences
        pm = []
        for i in range(0, len(pool) - size + 1, size):
            sv = np.linalg.svd(x[pool[i : i + size]], compute_uv=False)
            pm.append(sv[0] ** 2 / (sv**2).sum())
        out[name] = {
            "selfsim_adj": np.mean(selfs) - base,
            "intrasim_adj": np.mean(intra) - base,
            "mev_adj": np.mean(mevs) - np.mean(pm),
        }
    return out


def _local_numpy(rows: dict, meta: dict, k: int = 3, n: int = 5000) -> dict:
    from sklearn.cluster import KMeans

    from geomscope.metrics.twonn import twonn
    from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash, run_keys

    order = np.argsort(row_hash(run_keys(meta["doc_id"], meta["position"]), 0, STREAM_ID_SAMPLE))[:n]
    out = {}
    for name, (x, _) in rows.items():
        z = x[order]
        labels = KMeans(k, n_init=4, random_state=0).fit_predict(z)
        parts = [z[labels == j] for j in range(k)]
        w = np.array([len(p) for p in parts], float)
        out[name] = {
            "local_isoscore": float(np.dot(w, [_iso(np.cov(p.T)) for p in parts]) / w.sum()),
            "local_avgcos_centred": float(np.dot(w, [_avgcos(p - p.mean(0)) for p in parts]) / w.sum()),
            "local_twonn": float(np.dot(w, [twonn(p).dimension for p in parts]) / w.sum()),
        }
    return out


def _diff(ours: dict, theirs: dict) -> float:
    return max(
        abs(ours[n][k] - v) for n, vals in theirs.items() for k, v in vals.items() if ours[n][k] is not None
    )


def family_rows(path: Path, rows: dict, meta: dict, repeats: int, size: str) -> list[dict]:
    from geomscope.score import ScoreOptions

    ctx = ScoreOptions(metrics="contextuality").validate()
    cases = [
        ("rogue dimensions", "rogue", {}, lambda: _rogue_numpy(rows), ""),
        (
            "massive activations (k = 20)",
            "massive",
            {},
            lambda: _massive_numpy(rows),
            "geomscope brackets the median within 1.09 % (its histogram bin), numpy sorts every entry",
        ),
        (
            "linear CKA + RSA between layers, 1000 sample rows",
            "similarity",
            {"similarity_rows": 1000},
            lambda: _similarity_numpy(rows, meta),
            "",
        ),
        (
            "stratified (4 frequency, 5 position bins)",
            "stratified",
            {},
            lambda: _strata_numpy(rows, meta),
            "",
        ),
        ("contextuality (Ethayarajh)", "contextuality", {}, lambda: _context_numpy(rows, meta, ctx), ""),
        (
            "local isotropy (k = 3)",
            "local",
            {"clusters": 3},
            lambda: _local_numpy(rows, meta),
            "scikit-learn's k-means starts differ from geomscope's: the difference is of two clusterings",
        ),
    ]
    out = []
    for name, metric, kw, alt, note in cases:
        ours = _score(path, metric, **kw)["layers"]
        diff = _diff(ours, alt())
        t = alternate({"g": lambda m=metric, k=kw: _score(path, m, **k), "n": alt}, repeats=repeats)
        out.append(_row(name, size, t, repeats, diff, note))
    return out


def run(quick: bool = False) -> list[dict]:
    sentences = 100 if quick else 400
    repeats = 2 if quick else 3
    path = minilm_run(sentences)
    rows = run_rows(path)
    meta = _meta(path)
    n = len(next(iter(rows.values()))[0])
    size = f"bundled MiniLM, {len(rows)} layers x {n:,} rows x 384"
    return abtt_rows(path, rows, repeats, size) + family_rows(path, rows, meta, repeats, size)


if __name__ == "__main__":
    args = bench_args(__doc__)
    print_rows(run(quick=args.quick), "anisotropy diagnostics vs numpy")
