"""Runs for the diagnostic tests: the bundled MiniLM over sample_data's first sentences, and a run's
rows and row index read straight from its shards (the references never go through score)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from geomscope.store import Run, iter_shard

SENTENCES = Path(__file__).resolve().parents[1] / "sample_data" / "sentences.txt"


def minilm_run(root: Path, sentences: int = 40, **extract_options) -> Path:
    """extract ``bundled:minilm`` over the first ``sentences`` lines of sample_data/sentences.txt."""
    from geomscope.extract.run import extract

    src = root / "sentences.txt"
    src.write_text("\n".join(SENTENCES.read_text().splitlines()[:sentences]) + "\n")
    out = root / "minilm"
    extract("bundled:minilm", [src], out, **{"shard_docs": 16, **extract_options})
    return out


def run_rows(run_dir: Path, layer: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(rows as float64, {token_id, doc_id, position, is_special}) of one layer, in shard order."""
    r = Run(run_dir)
    xs, meta = [], {k: [] for k in ("token_id", "doc_id", "position", "is_special")}
    for s in sorted(r.shards, key=lambda s: s.index):
        for ch in iter_shard(r.shard_path(s), [layer]):
            xs.append(np.asarray(ch.layers[layer], np.float64))
            for k in meta:
                meta[k].append(np.asarray(getattr(ch, k)))
    return np.concatenate(xs), {k: np.concatenate(v) for k, v in meta.items()}


def jackknife_se(values) -> float:
    """The delete-one-group jackknife SE of replicate values: sqrt((G - 1)/G sum (v - mean)^2)."""
    a = np.asarray(values, np.float64)
    g = a.size
    return float(np.sqrt((g - 1) / g * ((a - a.mean()) ** 2).sum()))
