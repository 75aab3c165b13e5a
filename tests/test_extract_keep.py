"""extract --keep sample:N: per-shard accumulators measured during the forward pass and a seeded
sample, scored like a full run of the same data (moment metrics to 1e-9, the same TwoNN sample),
against the float64 reference, brute-force selections, resume and bad input; and its stored
accumulators, crafted, refused before they are trusted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, edit_manifest
from helpers_models import SAMPLE_TEXTS, bundled_minilm_dir, make_tiny_model, poison_token

from geomscope.errors import DataError, InputError
from geomscope.extract.keep import SampleKeeper, parse_keep
from geomscope.extract.run import extract
from geomscope.metrics import Moments
from geomscope.metrics.moments_torch import HostMoments, TorchMoments, _syrk_upper, device_moments
from geomscope.score import ScoreOptions, score
from geomscope.store import Run, iter_shard
from geomscope.store.checksum import digests
from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash, run_keys

MOMENT_KEYS = ("isoscore", "isoscore_star", "avgcos", "pr", "erank", "top1_share")


def _close_moments(a: Moments, b: Moments, rtol=1e-12):
    assert a.n == b.n
    np.testing.assert_allclose(a.mean, b.mean, rtol=rtol, atol=rtol * np.abs(b.mean).max())
    np.testing.assert_allclose(a.M2, b.M2, rtol=rtol, atol=rtol * np.abs(b.M2).max())
    for k in ("sum_unit", "sum_unit_sq", "abs_sum", "abs_max"):
        np.testing.assert_allclose(getattr(a, k), getattr(b, k), rtol=rtol, atol=1e-300)
    np.testing.assert_array_equal(a.count_abs_ge, b.count_abs_ge)
    assert a.n_zero_norm == b.n_zero_norm
    assert a.sum_sq_norm == pytest.approx(b.sum_sq_norm, rel=rtol)


# ------------------------------------------------------------------ the device accumulator
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_torch_moments_equal_numpy_moments(blocked, dtype):
    """Several updates of rows with a 1e3 common offset (float16 cannot hold 1e4 finely), a zero
    row and values past the |x| threshold: the same statistics as numpy's Moments, and covariance
    equal to numpy.cov of the float64 rows."""
    rng = np.random.default_rng(0)
    offset = 1e3 if dtype == torch.float16 else 1e4
    x = (rng.standard_normal((700, 300)) * np.linspace(0.1, 9, 300) + offset).astype(np.float32)
    x[5] = 0.0
    xt = torch.from_numpy(x).to(dtype)
    tm = TorchMoments(300, torch.device("cpu"), 6.0, blocked=blocked)
    for lo, hi in ((0, 1), (1, 260), (260, 700)):
        tm.update(xt[lo:hi])
    ref = Moments(300, 6.0).update(xt.numpy())
    got = tm.to_moments()
    _close_moments(got, ref, rtol=1e-10)
    np.testing.assert_allclose(got.covariance(), np.cov(xt.double().numpy(), rowvar=False), rtol=1e-9)


def test_blocked_triangular_product_is_the_upper_triangle():
    b = torch.randn(50, 600, dtype=torch.float64)
    full = b.T @ b
    for blocked in (True, False):
        up = _syrk_upper(b, blocked=blocked)
        iu = np.triu_indices(600)
        np.testing.assert_allclose(up.numpy()[iu], full.numpy()[iu], rtol=1e-12, atol=1e-10)


def test_device_moments_choice():
    assert isinstance(device_moments(4, torch.device("cpu"), 6.0), HostMoments)
    assert isinstance(device_moments(4, torch.device("meta"), 6.0), TorchMoments)


@pytest.mark.parametrize(
    "spec,expected", [("all", None), ("sample", 5000), ("sample:17", 17), (" Sample:3 ", 3)]
)
def test_parse_keep(spec, expected):
    assert parse_keep(spec) == expected


@pytest.mark.parametrize("spec", ["sample:0", "sample:-1", "sample:x", "some", "sample:", "all:3"])
def test_parse_keep_refuses(spec):
    with pytest.raises(InputError):
        parse_keep(spec)


# ------------------------------------------------------------------ the sample keeper
def test_keeper_against_brute_force():
    """Batches with special rows and a layer with non-finite rows: the accumulators are the Moments
    of each layer's finite ordinary / special rows, and the kept sample holds, for every layer and
    both special settings, the k rows of smallest hash among those the layer may use."""
    rng = np.random.default_rng(1)
    names, d, k = ["a", "b"], 16, 25
    keeper = SampleKeeper(names, d, torch.device("cpu"), k, seed=3)
    all_rows = {n: [] for n in names}
    metas = []
    doc = 0
    for m in (40, 1, 90, 33):
        lens = rng.integers(1, 9, size=m)
        doc_id = np.repeat(np.arange(doc, doc + m), lens)[:m]
        doc += m
        pos = np.arange(m) % 7
        meta = {
            "token_id": rng.integers(0, 100, m),
            "doc_id": doc_id,
            "position": pos + 100 * np.arange(m),  # unique keys
            "is_special": rng.random(m) < 0.2,
        }
        rows = {n: torch.from_numpy(rng.standard_normal((m, d)).astype(np.float16)) for n in names}
        rows["b"][rng.random(m) < 0.15, 3] = float("inf")
        keeper.add(rows, meta)
        metas.append(meta)
        for n in names:
            all_rows[n].append(rows[n].numpy())
    acc, sample, smeta = keeper.result()
    meta = {key: np.concatenate([mm[key] for mm in metas]) for key in metas[0]}
    sp = meta["is_special"]
    h = row_hash(run_keys(meta["doc_id"], meta["position"]), 3, STREAM_ID_SAMPLE)
    want = np.zeros(len(h), bool)
    for n in names:
        x = np.concatenate(all_rows[n])
        ok = np.isfinite(x).all(1)
        _close_moments(acc[n]["regular"], Moments(d).update(x[ok & ~sp]), rtol=1e-12)
        _close_moments(acc[n]["special"], Moments(d).update(x[ok & sp]), rtol=1e-12)
        for elig in (ok, ok & ~sp):
            idx = np.flatnonzero(elig)
            want[idx[np.argsort(h[idx])[:k]]] = True
    assert keeper.nonfinite_by_layer["b"] == int((~np.isfinite(np.concatenate(all_rows["b"])).all(1)).sum())
    got_keys = set(zip(smeta["doc_id"].tolist(), smeta["position"].tolist(), strict=True))
    want_keys = set(zip(meta["doc_id"][want].tolist(), meta["position"][want].tolist(), strict=True))
    assert got_keys == want_keys
    order = np.lexsort((smeta["position"], smeta["doc_id"]))
    np.testing.assert_array_equal(order, np.arange(len(order)))
    x_all = np.concatenate(all_rows["a"])
    np.testing.assert_array_equal(
        sample["a"], x_all[want][np.lexsort((meta["position"][want], meta["doc_id"][want]))]
    )


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def minilm_pair(tmp_path_factory):
    """The bundled MiniLM over the sample sentences: a full run and a sample:60 run, same batches."""
    root = tmp_path_factory.mktemp("keep")
    src = root / "in.txt"
    assert bundled_minilm_dir().exists()
    src.write_text("\n".join(SAMPLE_TEXTS * 4) + "\n")
    common = {"shard_docs": 12, "batch_tokens": 256}
    full = root / "full"
    kept = root / "kept"
    extract("bundled:minilm", [src], full, **common)
    summary = extract("bundled:minilm", [src], kept, keep="sample:60", **common)
    return full, kept, summary


def _scores(path, **kw):
    return score(path, ScoreOptions(id_sample=60, **kw), log=lambda m: None)


def _assert_same_metrics(a, b, keys=MOMENT_KEYS, rtol=1e-9):
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la["layer"] == lb["layer"] and la["n_rows"] == lb["n_rows"]
        for key in keys:
            assert la[key] == pytest.approx(lb[key], rel=rtol, abs=1e-12), (la["layer"], key)
        assert la["twonn"] == lb["twonn"]
        assert la["outliers"] == lb["outliers"]
        np.testing.assert_allclose(la["eigenvalues"], lb["eigenvalues"], rtol=1e-8, atol=1e-12)
        assert la["dropped"] == lb["dropped"]


@pytest.mark.parametrize("exclude_special", [False, True])
def test_minilm_sample_run_scores_like_full_run(minilm_pair, exclude_special):
    full, kept, summary = minilm_pair
    a = _scores(kept, exclude_special=exclude_special)
    b = _scores(full, exclude_special=exclude_special)
    _assert_same_metrics(a, b)
    assert a["source"]["keep"] == "sample:60" and "keep" not in b["source"]
    assert "shard groups" in a["params"]["uncertainty"]["moments"]
    assert a["params"]["rows_total"] == b["params"]["rows_total"] == summary["rows"]
    for la in a["layers"]:
        assert la["avgcos_centred"] is None and "--keep all" in la["notes"]["avgcos_centred"]
        assert la["avgcos_standardised"] is None
        assert la["se"]["isoscore"] is not None  # from the shard groups
    assert summary["rows_stored"] < summary["rows"] and summary["keep"] == "sample:60"


def test_float32_products_change_nothing_on_a_sample_run_and_say_so(minilm_pair):
    """A sample run's moments are float64 accumulators made at extraction: --product-dtype float32
    has no products to make there; the report records float64 and a warning says why."""
    _, kept, _ = minilm_pair
    said = []
    a = score(kept, ScoreOptions(id_sample=60, product_dtype="float32"), log=said.append)
    b = _scores(kept)
    assert a["params"]["product_dtype"] == "float64"
    assert len(said) == 1 and "--product-dtype float32 changes nothing" in said[0]
    assert [la["isoscore"] for la in a["layers"]] == [lb["isoscore"] for lb in b["layers"]]


def test_sample_run_is_small_and_inspectable(minilm_pair, cli):
    full, kept, _ = minilm_pair
    code, out, err = cli(["inspect", kept, "--verify", "--json"])
    assert code == 0, err
    d = json.loads(out)
    assert d["keep"] == "sample:60" and d["verify"]["ok"]
    assert d["rows"] == Run(full).manifest["totals"]["rows"] and d["rows_stored"] < d["rows"]
    code, out, err = cli(["inspect", kept])
    assert "seeded sample of 60 rows" in out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-keep")
    return root, {k: make_tiny_model(k, root) for k in ("gpt2", "llama")}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_models_with_nonfinite_rows(tiny_models, kind):
    """A poisoned token makes later rows NaN (causal models): the sample run drops and counts them
    per layer exactly as a full run's score does; Llama's final norm effect is served too."""
    root, models = tiny_models
    model = poison_token(make_tiny_model(kind, root, name=f"poisoned-{kind}"), word="dog")
    src = root / f"{kind}.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 2) + "\n")
    kw = {"shard_docs": 5, "batch_tokens": 128, "allow_nonfinite": True}
    extract(str(model), [src], root / f"{kind}-full", **kw)
    s = extract(str(model), [src], root / f"{kind}-kept", keep="sample:40", seed=2, **kw)
    assert s["nonfinite_rows"] > 0
    a = score(root / f"{kind}-kept", ScoreOptions(id_sample=40, seed=2), log=lambda m: None)
    b = score(root / f"{kind}-full", ScoreOptions(id_sample=40, seed=2), log=lambda m: None)
    _assert_same_metrics(a, b)
    assert any(la["dropped"]["nonfinite"] for la in a["layers"])
    if kind == "llama":
        assert a["final_norm"] is not None and b["final_norm"] is not None
        ga, gb = a["final_norm"]["gain"], b["final_norm"]["gain"]
        assert ga["spearman_abs_gain_variance"] == pytest.approx(gb["spearman_abs_gain_variance"], abs=1e-12)
        assert a["final_norm"]["outliers"] == b["final_norm"]["outliers"]


def test_sample_does_not_depend_on_sharding_or_batching(tiny_models, tmp_path):
    """The rows score draws (--id-sample 30 of a sample:30 run) are the same (doc, position) set
    however the run is cut into shards and batches, and the ones it draws from a full run."""
    _, models = tiny_models
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 3) + "\n")

    def drawn(run, n=30):
        rows = []
        for info in Run(run).shards:
            for ch in iter_shard(Run(run).shard_path(info)):
                rows.append(np.stack([ch.doc_id, ch.position], 1))
        keys = np.concatenate(rows)
        h = row_hash(run_keys(keys[:, 0], keys[:, 1]), 0, STREAM_ID_SAMPLE)
        return {tuple(r) for r in keys[np.argsort(h)[:n]].tolist()}

    a = extract(str(models["gpt2"]), [src], tmp_path / "a", keep="sample:30", shard_docs=4, batch_tokens=64)
    b = extract(str(models["gpt2"]), [src], tmp_path / "b", keep="sample:30", shard_docs=11, batch_tokens=999)
    extract(str(models["gpt2"]), [src], tmp_path / "full", shard_docs=7)
    assert a["shards"] != b["shards"]
    assert drawn(tmp_path / "a") == drawn(tmp_path / "b") == drawn(tmp_path / "full")


def test_resume_after_crash_equals_clean_run(tiny_models, tmp_path, monkeypatch):
    from geomscope.extract import keep as keep_mod

    _, models = tiny_models
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS * 3) + "\n")
    kw = {"keep": "sample:20", "shard_docs": 4, "batch_tokens": 64}
    extract(str(models["gpt2"]), [src], tmp_path / "clean", **kw)
    real = keep_mod.SampleKeeper.add
    calls = {"n": 0}

    def flaky(self, rows, meta):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real(self, rows, meta)

    monkeypatch.setattr(keep_mod.SampleKeeper, "add", flaky)
    with pytest.raises(KeyboardInterrupt):
        extract(str(models["gpt2"]), [src], tmp_path / "run", **kw)
    monkeypatch.setattr(keep_mod.SampleKeeper, "add", real)
    assert 0 < len(Run(tmp_path / "run").shards) and not Run(tmp_path / "run").complete
    s = extract(str(models["gpt2"]), [src], tmp_path / "run", **kw)
    assert s["shards_resumed"] > 0 and s["shards_written"] > 0
    opts = ScoreOptions(id_sample=20)
    a, b = score(tmp_path / "clean", opts, log=print), score(tmp_path / "run", opts, log=print)
    _assert_same_metrics(a, b, rtol=1e-12)
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la["se"] == lb["se"]
    with pytest.raises(InputError, match="different|identity|--overwrite"):
        extract(str(models["gpt2"]), [src], tmp_path / "run", keep="sample:21", shard_docs=4)


# ------------------------------------------------------------------ bad input
def test_bad_input_one_line(minilm_pair, cli, tmp_path):
    _, kept, _ = minilm_pair
    src = tmp_path / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS) + "\n")
    cases = [
        (["extract", "bundled:minilm", src, "--out", tmp_path / "r", "--keep", "sample:0"], "at least 1 row"),
        (["extract", "bundled:minilm", src, "--out", tmp_path / "r", "--keep", "most"], "--keep must be"),
        (
            ["extract", "bundled:minilm", src, "--out", tmp_path / "r", "--keep", "sample:100000"],
            "keep them all",
        ),
        (["score", kept, "--max-rows", "100"], "--max-rows"),
        (["score", kept, "--id-sample", "5000"], "--id-sample 5000 is larger than the sample of 60"),
        (["score", kept, "--id-sample", "60", "--seed", "4"], "--seed 0"),
        (["score", kept, "--id-sample", "60", "--layers", "layer_07"], "layer_07"),
        (
            ["score", kept, "--id-sample", "60", "--outlier-rule", "magnitude", "--outlier-threshold", "3"],
            "--outlier-threshold 6",
        ),
        (["export", kept, "--to", "npy", "--out", tmp_path / "x", "-q"], "--keep all"),
    ]
    for args, needle in cases:
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, needle)
    assert not (tmp_path / "r").exists() and not (tmp_path / "x").exists()


def test_magnitude_rule_at_the_kept_threshold(minilm_pair):
    full, kept, _ = minilm_pair
    kw = {"outlier_rule": "magnitude", "metrics": ("outliers", "isoscore")}
    a, b = _scores(kept, **kw), _scores(full, **kw)
    assert [la["outliers"] for la in a["layers"]] == [lb["outliers"] for lb in b["layers"]]


# ------------------------------------------------------------------ stored accumulators, crafted
# A --keep sample shard's stored accumulators and the run's identity.keep are checked before they
# are trusted: never a number computed from a sample taken for the whole.


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    from geomscope.extract import extract
    from geomscope.model.names import bundled_minilm_dir

    assert bundled_minilm_dir().exists()
    root = tmp_path_factory.mktemp("kept")
    src = root / "in.txt"
    src.write_text("\n".join(f"Sentence number {i} is about a cat and a dog." for i in range(40)) + "\n")
    extract("bundled:minilm", [src], root / "run", keep="sample:30", shard_docs=20, layers="0,6")
    return root / "run"


def _damage_accumulator(run: Path, edit) -> None:
    """Shard 1's regular accumulator of layer_00 edited, the manifest made to match the file."""
    entry = json.loads((run / "manifest.json").read_text())["shards"][1]
    path = run / entry["file"]
    with h5py.File(path, "a") as f:
        edit(f, f["accumulators/layer_00/regular"])
    m = json.loads((run / "manifest.json").read_text())
    m["shards"][1]["bytes"] = path.stat().st_size
    m["shards"][1].update(digests(path))
    (run / "manifest.json").write_text(json.dumps(m))


def _set_attr(key, value):
    def edit(f, g):
        g.attrs[key] = value

    return edit


def _set_file_attr(key, value):
    def edit(f, g):
        f.attrs[key] = value

    return edit


def _replace(key, value):
    def edit(f, g):
        del g[key]
        g.create_dataset(key, data=value)

    return edit


def _nan_in(key):
    def edit(f, g):
        a = g[key][()]
        a[0] = np.nan
        g[key][...] = a

    return edit


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_set_attr("n", 10**15), "has n = 1000000000000000"),
        (_set_attr("n", -100), "has n = -100"),
        (_set_attr("n", "7"), "has n = 7"),
        (_set_file_attr("tokens", 5), "measured 5 rows"),
        (_nan_in("m2_upper"), "NaN or Inf in m2_upper"),
        (_replace("mean", np.zeros(3_000_000)), "mean of shape (3000000,)"),
        (_replace("mean", np.array([b"x"] * 384)), "mean of shape"),
        (_set_attr("abs_threshold", np.nan), "abs_threshold = nan"),
        (_set_file_attr("keep", "all"), "keeps every row"),
    ],
)
def test_stored_accumulators_are_checked_before_they_are_trusted(kept, tmp_path, edit, needle):
    """A crafted --keep sample shard (its checksums made to match) is not scored on its word: n of
    10^15 would give 10^15 rows and NaN/Inf 'dropped' counts below zero, a NaN would empty the
    IsoScore, a 3-million value mean would try a 65 TiB allocation, a tokens attribute of 5 would say
    -1,423 rows dropped."""
    run = tmp_path / "run"
    shutil.copytree(kept, run)
    _damage_accumulator(run, edit)
    with pytest.raises(DataError, match="is corrupt") as e:
        score(run, ScoreOptions(metrics=("isoscore", "avgcos")))
    assert needle in str(e.value) and "shard-00001.h5" in str(e.value)


def test_a_sample_run_whose_keep_was_removed_is_refused(kept, tmp_path):
    """Without identity.keep the samples would be scored as whole layers (IsoScore 0.211 for 0.270):
    refused."""
    run = tmp_path / "run"
    shutil.copytree(kept, run)
    edit_manifest(run, lambda m: m["identity"].pop("keep"))
    with pytest.raises(InputError, match="records no --keep sample"):
        score(run, ScoreOptions(metrics=("isoscore", "avgcos")))


def test_the_untouched_sample_run_still_scores(kept):
    e = score(kept, ScoreOptions(metrics=("isoscore", "avgcos")))["layers"][0]
    assert e["isoscore"] is not None and e["n_rows"] > 0
