"""A factory of realistic score reports (the format of geomscope/schema.py) for the plot tests,
and tests that its reports are self-consistent (so the plot tests exercise real-looking input).

Metric values are computed from the synthetic eigenvalues exactly as docs/metrics.md defines them:
PR = (Σλ)²/Σλ², IsoScore = (PR − 1)/(D − 1), IsoScore* = IsoScore of (1 − ζ)λ + ζ·mean(λ)
(trace-matched identity target), top-k share = Σ_{i≤k} λ_i / Σλ, erank = exp H(λ/Σλ).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from geomscope.schema import LAYER_KEYS, REPORT_FORMAT, REPORT_FORMAT_VERSION


def _pr(lam: np.ndarray) -> float:
    return float(lam.sum() ** 2 / (lam**2).sum())


def make_report(
    *,
    name: str | None = "sentence-transformers/all-MiniLM-L6-v2",
    revision: str | None = None,
    n_layers: int = 7,
    hidden: int = 96,
    seed: int = 0,
    zeta: float = 0.2,
    target: str = "trace",
    spectrum: bool = True,
    outliers: bool = True,
    layer_prefix: str = "layer_",
    null_twonn_layer: int | None = None,
    step_key: int | None = None,
    dataset: str | None = "sample_data/sentences.txt",
) -> dict:
    """One report with ``n_layers`` layers of width ``hidden``; deeper layers (and later training
    steps, when ``revision`` is ``stepN``) are more anisotropic, with a few growing outlier dims."""
    rng = np.random.default_rng(seed)
    progress = 0.0
    if revision and revision.startswith("step"):
        progress = np.log1p(int(revision[4:])) / np.log1p(143000)
    outlier_dims = [7, hidden // 3, hidden - 5]
    layers = []
    for i in range(n_layers):
        depth = i / max(n_layers - 1, 1)
        alpha = 0.4 + 0.9 * depth * (0.3 + 0.7 * progress)
        lam = (np.arange(1, hidden + 1) ** -alpha) * (1.0 + 3.0 * depth) * rng.uniform(0.9, 1.1)
        var = rng.gamma(4.0, 0.25, size=hidden) * lam.mean()
        for j, d in enumerate(outlier_dims):
            var[d] *= 1.0 + (4 + 6 * j) * depth * (0.5 + progress)
        lam[: len(outlier_dims)] *= 1.0 + 5.0 * depth * (0.5 + progress)
        lam = np.sort(lam)[::-1]
        pr = _pr(lam)
        shrunk = (1 - zeta) * lam + zeta * lam.mean()
        p = lam / lam.sum()
        flagged = [int(d) for d in np.nonzero(var >= 5 * var.mean())[0]]
        n_rows = 4000 + 10 * i
        entry = {
            "layer": f"{layer_prefix}{i:02d}",
            "index": i,
            "n_rows": n_rows,
            "isoscore": (pr - 1) / (hidden - 1),
            "isoscore_star": (_pr(shrunk) - 1) / (hidden - 1),
            "avgcos": 0.05 + 0.6 * depth * (0.4 + 0.6 * progress) + rng.normal(0, 0.01),
            "avgcos_centred": 0.01 + 0.05 * depth,
            "avgcos_standardised": 0.02 + 0.1 * depth,
            "pr": pr,
            "erank": float(np.exp(-(p * np.log(p)).sum())),
            "top1_share": float(p[:1].sum()),
            "top5_share": float(p[:5].sum()),
            "top10_share": float(p[:10].sum()),
            "twonn": 18.0 - 8.0 * depth + rng.normal(0, 0.3),
            "outliers": flagged if outliers else [],
            "se": {
                "isoscore": 0.002 + 0.001 * depth,
                "isoscore_star": 0.003,
                "avgcos": 0.004 + 0.01 * depth,
                "avgcos_centred": 0.001,
                "avgcos_standardised": 0.002,
                "pr": 0.3,
                "erank": 0.5,
                "twonn": 0.4 + 0.2 * depth,
            },
            "twonn_n_used": 2000,
            "twonn_duplicates_removed": 3 * i,
            "outlier_support": [1.0] * len(flagged) if outliers else [],
            "dropped": {"nonfinite": 0, "special": 0, "not_sampled": 0},
            "flags": [],
            "notes": {},
        }
        entry["eigenvalues"] = entry["outlier_statistic"] = None
        if spectrum:
            entry["eigenvalues"] = [float(v) for v in lam]
        if outliers:
            entry["outlier_statistic"] = [float(v) for v in var]
        if null_twonn_layer == i:
            entry["twonn"] = None
            entry["se"].pop("twonn")
            entry["flags"] = ["duplicates"]
            entry["notes"] = {"twonn": "fewer than 3 distinct rows after duplicate removal"}
        layers.append(entry)
    rep = {
        "format": "geomscope-report",
        "format_version": 1,
        "geomscope_version": "0.1.0",
        "created": "2025-01-01T00:00:00+00:00",
        "source": {"kind": "run", "path": f"/runs/{seed}", "dataset": dataset},
        "model": None
        if name is None
        else {"name": name, "revision": revision, "commit": None, "hidden_size": hidden},
        "run": {"dir": f"/runs/{seed}", "complete": True, "partial": False, "rows": 28000, "docs": 300},
        "params": {
            "metrics": ["isoscore", "isoscore_star", "avgcos", "spectrum", "outliers", "twonn"],
            "zeta": zeta,
            "target": target,
            "avgcos_variants": ["plain", "centred", "standardised"],
            "outlier_rule": "variance",
            "outlier_threshold": 5.0,
            "id_estimator": "twonn",
            "discard_fraction": 0.1,
            "id_sample": 2000,
            "seed": 0,
            "exclude_special": False,
            "max_rows": None,
            "layers": [x["layer"] for x in layers],
            "duplicates_removed": {x["layer"]: x["twonn_duplicates_removed"] for x in layers},
            "uncertainty": {
                "moments": "delete-one-group jackknife over 10 document groups",
                "twonn": "repeated decimation (10 halves)",
            },
            "workers": 1,
        },
        "layers": layers,
        "embeddings": None,
    }
    if step_key is not None:
        rep["step"] = step_key
    return rep


def pythia_reports(steps=(0, 1000, 7000, 143000), **kw) -> list[dict]:
    """Reports of one model at several ``stepN`` revisions (Pythia style)."""
    return [
        make_report(name="EleutherAI/pythia-70m", revision=f"step{s}", seed=10 + k, **kw)
        for k, s in enumerate(steps)
    ]


def write_report(path: Path, rep: dict) -> Path:
    path.write_text(json.dumps(rep))
    return path


def test_factory_follows_schema():
    rep = make_report()
    assert rep["format"] == REPORT_FORMAT and rep["format_version"] == REPORT_FORMAT_VERSION
    for lay in rep["layers"]:
        assert set(lay) == set(LAYER_KEYS)
        lam = np.asarray(lay["eigenvalues"])
        assert np.all(np.diff(lam) <= 0)
        assert len(lay["outlier_statistic"]) == rep["model"]["hidden_size"]
        assert set(lay["se"]) >= {"isoscore", "isoscore_star", "avgcos", "twonn"}
    assert json.loads(json.dumps(rep)) == rep


def test_factory_metrics_are_consistent():
    rep = make_report(hidden=64)
    d = 64
    for lay in rep["layers"]:
        lam = np.asarray(lay["eigenvalues"])
        # the published IsoScore steps on these eigenvalues give the PR form used by the factory
        lam_hat = lam * np.sqrt(d) / np.linalg.norm(lam)
        delta = np.linalg.norm(lam_hat - 1) / np.sqrt(2 * (d - np.sqrt(d)))
        k = (d - delta**2 * (d - np.sqrt(d))) ** 2 / d
        assert abs(lay["isoscore"] - (k - 1) / (d - 1)) < 1e-10
        assert lay["isoscore"] < lay["isoscore_star"] <= 1.0  # shrinkage toward identity raises it
        assert 0 < lay["top1_share"] < lay["top5_share"] < lay["top10_share"] <= 1
    # deeper layers are more anisotropic in this factory
    iso = [lay["isoscore"] for lay in rep["layers"]]
    assert iso[0] > iso[-1]
    # flagged outliers satisfy the stated rule
    for lay in rep["layers"]:
        v = np.asarray(lay["outlier_statistic"])
        assert sorted(lay["outliers"]) == sorted(np.nonzero(v >= 5 * v.mean())[0].tolist())
