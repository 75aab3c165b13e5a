"""``extract --keep sample --products split``: the run records its products, scores like the float64
run to the split's precision, and is refused with one line where it cannot apply; and the keeper
that folds each batch in one batch late (as on a GPU) keeps exactly the same numbers and sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, bundled_minilm_dir

from geomscope.errors import InputError
from geomscope.extract.keep import SampleKeeper
from geomscope.extract.options import ExtractOptions
from geomscope.extract.run import extract
from geomscope.score import ScoreOptions, score

MOMENT_KEYS = ("isoscore", "isoscore_star", "avgcos", "pr", "erank", "top1_share")


def _batches(seed: int = 5):
    """Batches of float16 rows (two layers, one with non-finite rows), special tokens among them."""
    rng = np.random.default_rng(seed)
    doc = 0
    for m in (37, 1, 64, 20):
        meta = {
            "token_id": rng.integers(0, 100, m),
            "doc_id": np.arange(doc, doc + m) // 3,
            "position": np.arange(doc, doc + m),
            "is_special": rng.random(m) < 0.2,
        }
        doc += m
        rows = {n: torch.from_numpy((rng.standard_normal((m, 12)) + 5).astype(np.float16)) for n in "ab"}
        rows["b"][rng.random(m) < 0.1, 2] = float("nan")
        yield rows, meta


@pytest.mark.parametrize("products", ["float64", "split"])
def test_deferred_keeper_keeps_the_same_numbers(products):
    """On an accelerator each batch is folded in at the next add (its flags on their way meanwhile):
    forced on the CPU, every accumulator, count and sampled row is bit-identical to folding at once."""
    now = SampleKeeper(["a", "b"], 12, torch.device("cpu"), 10, seed=1, products=products)
    late = SampleKeeper(["a", "b"], 12, torch.device("cpu"), 10, seed=1, products=products)
    late.defer = True
    for rows, meta in _batches():
        now.add(rows, meta)
        late.add(rows, meta)
        assert late.pending is not None
    (acc_a, rows_a, meta_a), (acc_b, rows_b, meta_b) = now.result(), late.result()
    assert late.pending is None and late.tokens == now.tokens
    assert late.nonfinite_by_layer == now.nonfinite_by_layer and now.nonfinite_by_layer["b"] > 0
    for layer, parts in acc_a.items():
        assert parts.keys() == acc_b[layer].keys()
        for part, m in parts.items():
            other = acc_b[layer][part]
            assert m.n == other.n
            for key in ("mean", "M2", "sum_unit", "sum_unit_sq", "abs_sum", "abs_max", "count_abs_ge"):
                np.testing.assert_array_equal(getattr(m, key), getattr(other, key))
    for layer in rows_a:
        np.testing.assert_array_equal(rows_a[layer], rows_b[layer])
    for key in meta_a:
        np.testing.assert_array_equal(meta_a[key], meta_b[key])


@pytest.fixture(scope="module")
def split_pair(tmp_path_factory):
    """The bundled MiniLM over the sample sentences, --keep sample:60 with float64 and split products."""
    root = tmp_path_factory.mktemp("products")
    src = root / "in.txt"
    assert bundled_minilm_dir().exists()
    src.write_text("\n".join(SAMPLE_TEXTS * 3) + "\n")
    common = {"shard_docs": 12, "batch_tokens": 256, "keep": "sample:60"}
    exact, split = root / "float64", root / "split"
    extract("bundled:minilm", [src], exact, **common)
    extract("bundled:minilm", [src], split, products="split", **common)
    return exact, split


def test_split_run_records_its_products_and_scores_like_float64(split_pair):
    exact, split = split_pair
    ident = {p.name: json.loads((p / "manifest.json").read_text())["identity"] for p in split_pair}
    assert ident["split"]["products"] == "split" and "products" not in ident["float64"]
    a = score(split, ScoreOptions(id_sample=60), log=lambda m: None)
    b = score(exact, ScoreOptions(id_sample=60), log=lambda m: None)
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la["n_rows"] == lb["n_rows"] and la["twonn"] == lb["twonn"]
        for key in MOMENT_KEYS:
            assert la[key] == pytest.approx(lb[key], rel=1e-5, abs=1e-9), (la["layer"], key)


def test_resuming_with_other_products_is_refused(split_pair, tmp_path):
    """The products are part of the run's identity: a run made with split is not continued with float64."""
    _, split = split_pair
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 3) + "\n")
    with pytest.raises(InputError, match="products"):
        extract("bundled:minilm", [src], split, shard_docs=12, batch_tokens=256, keep="sample:60")


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"products": "split"}, "add --keep sample"),
        ({"products": "split", "keep": "sample:9", "store_dtype": "float32"}, "--store-dtype float16"),
    ],
)
def test_split_where_it_cannot_apply_is_refused(kw, needle):
    with pytest.raises(InputError, match=needle):
        ExtractOptions(**kw).validate()


def test_cli_split_without_keep_is_one_line(cli, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a sentence\n")
    code, out, err = cli(["extract", "bundled:minilm", src, "--out", tmp_path / "run", "--products", "split"])
    assert "--keep sample" in assert_one_line_error(code, out, err)
