"""A batch without padding runs without an attention mask (transformers would read one back from the
GPU to find it all ones): its rows are bit for bit those of the same batch given the all-ones mask,
in every tiny architecture; a padded batch still gets its mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_models import SAMPLE_TEXTS, TINY_KINDS, make_tiny_model

from geomscope.extract.batching import Doc, tokenize
from geomscope.extract.capture import Capture
from geomscope.model.load import load_model


def _docs(lm, n: int, length: int | None) -> list[Doc]:
    """``n`` documents of the sample texts, each cut to ``length`` tokens (None: as they are)."""
    docs = tokenize(lm.tokenizer, list(enumerate(SAMPLE_TEXTS[:40])), None)
    if length is None:
        return docs[:n]
    long = [d for d in docs if len(d) >= length][:n]
    assert len(long) == n
    return [Doc(d.doc_id, d.ids[:length], d.special[:length]) for d in long]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_unpadded_batch_without_mask_gives_the_same_rows(kind, tmp_path, monkeypatch):
    lm = load_model(str(make_tiny_model(kind, tmp_path)), device="cpu")
    layers = [{"index": i, "name": f"layer_{i}"} for i in range(lm.n_hidden_states)]
    seen, ones = [], {"on": False}
    forward = lm.hidden_states

    def spy(ids, mask, wanted):
        seen.append(mask)
        if mask is None and ones["on"]:  # the reference: the same batch given its all-ones mask
            mask = torch.ones_like(ids)
        return forward(ids, mask, wanted)

    monkeypatch.setattr(lm, "hidden_states", spy)
    docs = _docs(lm, 4, 6)
    got, meta = Capture(lm, layers, "float32")(docs)
    assert seen[-1] is None and len(meta["token_id"]) == 24
    ones["on"] = True
    want, want_meta = Capture(lm, layers, "float32")(docs)
    for name, rows in want.items():
        np.testing.assert_array_equal(got[name], rows, err_msg=name)
    np.testing.assert_array_equal(meta["token_id"], want_meta["token_id"])
    Capture(lm, layers, "float32")(_docs(lm, 3, None))  # lengths differ: padded, with its mask
    assert seen[-1] is not None and not bool(seen[-1].all())
