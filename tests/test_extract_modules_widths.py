"""Layers of their own width in one run (extract --modules): the keys and values of a tiny Llama's
grouped-query attention (narrower than D) and MLP intermediates of GPT-NeoX and the bundled MiniLM
(wider) against forward hooks written here on a plain transformers forward (1e-6); each layer of
such a run scored as the array of its rows alone (1e-9), in batches or not; --keep sample against
the full run; gradients against torch.autograd and their energy in the activation subspace of the
same width against numpy; inspect --verify, a shard whose layer has another width, export; the
refusals, one line each."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, edit_manifest
from helpers_models import SAMPLE_TEXTS, make_tiny_head_model, make_tiny_model

from geomscope.errors import InputError
from geomscope.export import export_run
from geomscope.extract.run import extract
from geomscope.schema import SCALAR_METRIC_NAMES
from geomscope.score import ScoreOptions, score
from geomscope.store import Run, describe_run, iter_shard
from geomscope.store.checksum import digests

TEXTS = [t for t in SAMPLE_TEXTS if t.strip()] * 4
LLAMA_MODULES = "k,v,*.mlp.up_proj"
#: the tiny Llama's widths: D = 32, 2 query heads and 1 key/value head of 16, an MLP of 64
D, KV, MLP = 32, 16, 64
METRICS = ("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers", "twonn")


def _llama_expected(blocks: int = 2) -> dict[str, tuple[str, str]]:
    """{layer: (module path, side)} of LLAMA_MODULES, from transformers' Llama layout."""
    out = {}
    for b in range(blocks):
        for rel in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
            out[f"layers.{b}.{rel}"] = (f"layers.{b}.{rel}", "out")
    return out


def _hooked_rows(model, texts, expected, tok) -> dict[str, np.ndarray]:
    """Each expected layer's rows (a module's output), one document a forward (no padding), from
    hooks on ``model``."""
    got = {name: [] for name in expected}
    handles = []
    for name, (path, _) in expected.items():
        handles.append(
            model.get_submodule(path).register_forward_hook(
                lambda m, a, o, n=name: got[n].append(o[0].double().numpy())
            )
        )
    try:
        for text in texts:
            ids = torch.tensor([tok(text)["input_ids"]])
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    return {n: np.concatenate(v) for n, v in got.items()}


def _reference(model_dir, texts, expected) -> dict[str, np.ndarray]:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir).eval()
    return _hooked_rows(model, texts, expected, AutoTokenizer.from_pretrained(model_dir))


def _rows(run_dir, names=None) -> dict[str, np.ndarray]:
    """The run's layers (float64), in (document, position) order."""
    run = Run(run_dir)
    parts = [ch for s in run.shards for ch in iter_shard(run.shard_path(s), names)]
    doc = np.concatenate([c.doc_id for c in parts])
    pos = np.concatenate([c.position for c in parts])
    order = np.lexsort((pos, doc))
    return {
        n: np.concatenate([c.layers[n] for c in parts]).astype(np.float64)[order]
        for n in (names or run.layer_names)
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("widths")
    text = d / "in.txt"
    text.write_text("\n".join(TEXTS) + "\n")
    llama = make_tiny_model("llama", d)
    common = {"modules": LLAMA_MODULES, "layers": "-1", "store_dtype": "float32", "batch_tokens": 1}
    run = d / "gqa"
    extract(str(llama), [text], run, shard_docs=12, **common)
    return {"dir": d, "text": text, "llama": llama, "run": run, "common": common}


def test_grouped_query_keys_and_values_match_hooks(setup):
    run = Run(setup["run"])
    expected = _llama_expected()
    ref = _reference(setup["llama"], TEXTS, expected)
    got = _rows(setup["run"])
    for name in expected:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)
    entries = {la["name"]: la for la in run.layers}
    widths = {n: ref[n].shape[1] for n in expected}
    assert widths == {n: KV if "_proj" in n and "mlp" not in n else MLP for n in expected}
    for n, w in widths.items():
        assert entries[n]["dim"] == w  # the manifest's own width of each layer not D wide
    assert "dim" not in entries["layer_02"] and run.dim == D
    assert run.layer_dims == {**widths, "layer_02": D}
    with h5py.File(setup["run"] / run.shards[0].file) as f:
        assert {n: f["layers"][n].shape[1] for n in run.layer_names} == run.layer_dims


@pytest.mark.parametrize("kind", ["gpt_neox", "minilm"])
def test_mlp_intermediates_match_hooks(setup, tmp_path, kind):
    """GPT-NeoX's dense_h_to_4h and activation (its intermediate width, 64) beside its D-wide
    output; MiniLM's intermediate.dense and intermediate (1536 wide, D = 384)."""
    from geomscope.model.names import bundled_minilm_dir

    if kind == "gpt_neox":
        model, spec, texts = make_tiny_model("gpt_neox", setup["dir"]), "*.mlp.*", TEXTS[:12]
        expected = {
            f"layers.{b}.mlp.{m}": (f"layers.{b}.mlp.{m}", "out")
            for b in range(2)
            for m in ("dense_h_to_4h", "act", "dense_4h_to_h")
        }
        wide = {n: MLP if "4h_to_h" not in n else D for n in expected}
    else:
        model, spec = bundled_minilm_dir(), "*.intermediate.dense,*.intermediate"
        texts = ["A man is playing a guitar.", "The new movie is awesome, and everyone should see it.", "Hi"]
        expected = {
            f"encoder.layer.{b}.{m}": (f"encoder.layer.{b}.{m}", "out")
            for b in range(6)
            for m in ("intermediate.dense", "intermediate")
        }
        wide = dict.fromkeys(expected, 1536)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "run"
    extract(str(model), [src], out, modules=spec, layers="-1", store_dtype="float32", batch_tokens=1)
    ref = _reference(model, texts, expected)
    got = _rows(out)
    entries = {la["name"]: la for la in Run(out).layers}
    for name in expected:
        assert got[name].shape[1] == wide[name] == ref[name].shape[1], name
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)
        assert entries[name].get("dim") == (None if wide[name] == Run(out).dim else wide[name])


def _scores(report) -> dict[str, dict]:
    return {e["layer"]: e for e in report["layers"]}


def _same_numbers(a: dict, b: dict, what: str) -> None:
    keys = [k for k in SCALAR_METRIC_NAMES if a.get(k) is not None or b.get(k) is not None]
    assert keys, what
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), (what, k)
    np.testing.assert_allclose(a["eigenvalues"], b["eigenvalues"], rtol=1e-9, atol=1e-12, err_msg=what)
    assert a["outliers"] == b["outliers"], what


def test_each_layer_scores_as_its_rows_alone(setup, tmp_path):
    """Every layer of the mixed run against the array file of its rows (score's .npy path); scoring
    one layer at a time (--memory-mb) changes nothing; the plain average cosine and the
    participation ratio against numpy from their definitions."""
    rows = _rows(setup["run"])
    n = len(next(iter(rows.values())))
    opts = ScoreOptions(metrics=METRICS, id_sample=n)  # TwoNN on every row, whatever their keys
    whole = _scores(score(setup["run"], opts))
    tiny = score(setup["run"], ScoreOptions(metrics=METRICS, id_sample=n, memory_mb=0.05), log=lambda m: None)
    assert tiny["params"]["layer_batch_size"] == 1
    for name, x in rows.items():
        np.save(tmp_path / "x.npy", x.astype(np.float32))
        alone = _scores(score(tmp_path / "x.npy", opts))["array"]
        _same_numbers(whole[name], alone, name)
        _same_numbers(whole[name], _scores(tiny)[name], name)
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        cos = unit @ unit.T
        assert whole[name]["avgcos"] == pytest.approx((cos.sum() - n) / (n * (n - 1)), rel=1e-9)
        lam = np.linalg.eigvalsh(np.cov(x.T))
        assert whole[name]["pr"] == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-9)
        assert len(whole[name]["eigenvalues"]) == x.shape[1]


def test_magnitude_outliers_are_judged_among_the_layers_of_one_width(setup):
    opts = dict(metrics=("outliers",), outlier_rule="magnitude", outlier_threshold=0.5)
    whole = _scores(score(setup["run"], ScoreOptions(**opts)))
    dims = Run(setup["run"]).layer_dims
    for width in sorted(set(dims.values())):
        names = [n for n, w in dims.items() if w == width]
        alone = _scores(score(setup["run"], ScoreOptions(layers=names, **opts)))
        for name in names:
            assert whole[name]["outliers"] == alone[name]["outliers"]
            assert whole[name]["outlier_statistic"] == pytest.approx(
                alone[name]["outlier_statistic"], rel=1e-12
            )
            assert f"{width} wide" in whole[name]["notes"]["outlier_rule"]
            assert len(whole[name]["outlier_statistic"]) == width


def test_keep_sample_scores_like_the_full_run(setup):
    kept = setup["dir"] / "kept"
    summary = extract(
        str(setup["llama"]), [setup["text"]], kept, shard_docs=12, keep="sample:60", **setup["common"]
    )
    assert summary["rows_stored"] < summary["rows"]
    assert Run(kept).layer_dims == Run(setup["run"]).layer_dims
    opts = ScoreOptions(metrics=("isoscore", "isoscore_star", "avgcos", "spectrum", "twonn"), id_sample=60)
    a, b = (_scores(score(r, opts, log=lambda m: None)) for r in (kept, setup["run"]))
    assert list(a) == list(b)
    for name in a:
        assert a[name]["n_rows"] == b[name]["n_rows"]
        for key in ("isoscore", "isoscore_star", "avgcos", "pr"):
            assert a[name][key] == pytest.approx(b[name][key], rel=1e-9, abs=1e-12), (name, key)
    assert describe_run(kept, verify=True)["verify"]["ok"]


def _autograd(model_dir, texts, expected) -> tuple[list[int], dict, dict]:
    """Per document with a next-token prediction: each expected layer's rows and the gradient of
    the model's own ``labels=`` loss with respect to them (torch.autograd), from hooks."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    acts, grads, docs = {n: [] for n in expected}, {n: [] for n in expected}, []
    for doc_id, text in enumerate(texts):
        ids = torch.tensor([tok(text)["input_ids"]])
        if ids.shape[1] < 2:
            continue
        kept, handles = {}, []
        for name, (path, _) in expected.items():
            module = model.base_model.get_submodule(path)
            handles.append(
                module.register_forward_hook(lambda m, a, o, n=name, kept=kept: kept.__setitem__(n, o))
            )
        loss = model(input_ids=ids, labels=ids).loss
        for h in handles:
            h.remove()
        g = torch.autograd.grad(loss, [kept[n] for n in expected])
        for name, gt in zip(expected, g, strict=True):
            acts[name].append(kept[name][0].detach().double().numpy())
            grads[name].append(gt[0].double().numpy())
        docs.append(doc_id)
    return (
        docs,
        {n: np.concatenate(v) for n, v in acts.items()},
        {n: np.concatenate(v) for n, v in grads.items()},
    )


@pytest.fixture(scope="module")
def gradient_run(setup):
    model = make_tiny_head_model("llama", "causal-lm", setup["dir"])
    out = setup["dir"] / "grad"
    extract(
        str(model),
        [setup["text"]],
        out,
        capture="activations,gradients",
        loss="causal-lm",
        shard_docs=12,
        **setup["common"],
    )
    return model, out


def test_gradients_of_layers_of_other_widths_equal_autograd(gradient_run):
    model, out = gradient_run
    expected = _llama_expected()
    docs, acts, grads = _autograd(model, TEXTS, expected)
    run = Run(out)
    rows = _rows(out)
    doc_of_row = np.sort(
        np.concatenate([ch.doc_id for s in run.shards for ch in iter_shard(run.shard_path(s), [])])
    )
    sel = np.isin(doc_of_row, docs)
    for name in expected:
        assert run.layer_dims[name + ".grad"] == run.layer_dims[name] == acts[name].shape[1]
        scale = np.abs(grads[name]).max()
        assert scale > 0
        np.testing.assert_allclose(
            rows[name + ".grad"][sel], grads[name], atol=1e-6 * scale, rtol=0, err_msg=name
        )
        np.testing.assert_allclose(rows[name][sel], acts[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_gradient_energy_pairs_layers_of_one_width(gradient_run):
    """E = tr(U_r^T S U_r) / tr(S) and E_max of each gradient layer in the top-r activation subspace
    of its own layer, against numpy on the stored rows; r/D is the layer's own D."""
    _, out = gradient_run
    names = ["layers.1.self_attn.k_proj.grad", "layers.1.mlp.up_proj.grad", "layer_02.grad"]
    rep = score(
        out, ScoreOptions(metrics=("isoscore",), basis=str(out), ranks=(2, 8), controls=0, layers=names)
    )
    ge = rep["gradient_energy"]["layers"]
    rows = _rows(out)
    for name in names:
        g, a = rows[name], rows[name[: -len(".grad")]]
        S = g.T @ g
        lam, U = np.linalg.eigh(np.cov(a.T))
        U = U[:, np.argsort(lam)[::-1]]
        ev = np.sort(np.linalg.eigvalsh(S))[::-1]
        for row, r in zip(ge[name], (2, 8), strict=True):
            assert row["dim"] == g.shape[1] and row["baseline"] == pytest.approx(r / g.shape[1])
            want = np.trace(U[:, :r].T @ S @ U[:, :r]) / np.trace(S)
            assert row["energy"] == pytest.approx(want, rel=1e-9), (name, r)
            assert row["energy_max"] == pytest.approx(ev[:r].sum() / ev.sum(), rel=1e-9), (name, r)


def test_a_basis_of_another_width_and_a_rank_too_wide_are_one_line(gradient_run, tmp_path, cli):
    _, out = gradient_run
    other = tmp_path / "basis"
    shutil.copytree(out, other)
    layer = "layers.0.self_attn.k_proj"

    def narrower(m):
        for entry in m["identity"]["layers"]:
            if entry["name"] == layer:
                entry["dim"] = 8

    edit_manifest(other, narrower)
    args = ["score", out, "--basis", other, "--layers", f"{layer}.grad", "--out", tmp_path / "r", "--quiet"]
    code, o, e = cli(args)
    assert_one_line_error(code, o, e, f"layer {layer} 8 wide", f"{layer}.grad {KV}", exit_code=2)
    code, o, e = cli(
        [
            "score",
            out,
            "--basis",
            out,
            "--layers",
            f"{layer}.grad,layer_02.grad",
            "--rank",
            "20",
            "--out",
            tmp_path / "r2",
        ]
    )
    assert_one_line_error(
        code, o, e, f"--rank 20 is not below the width D = {KV} of layer {layer}.grad", exit_code=2
    )


def test_inspect_verifies_the_run_and_says_its_widths(setup, cli):
    d = describe_run(setup["run"], verify=True)
    assert d["verify"]["ok"] and d["dim"] == D
    assert d["layer_dims"] == {n: w for n, w in Run(setup["run"]).layer_dims.items() if w != D}
    code, out, err = cli(["inspect", setup["run"], "--verify"])
    assert code == 0, err
    assert "6 layers of another width: layers.0.self_attn.k_proj: 16" in " ".join(out.split())


def test_a_shard_whose_layer_has_another_width_is_refused(setup, tmp_path, cli):
    """A shard whose k_proj rows are D wide where the run records 16: refused by score and by
    inspect --verify in one line, even with the manifest's checksum matching the shard."""
    run = tmp_path / "run"
    shutil.copytree(setup["run"], run)
    m = json.loads((run / "manifest.json").read_text())
    entry = m["shards"][1]
    path = run / entry["file"]
    name = "layers.1.self_attn.k_proj"
    with h5py.File(path, "r+") as f:
        n = f["layers"][name].shape[0]
        del f["layers"][name]
        f["layers"].create_dataset(name, data=np.zeros((n, D), np.float32))
    entry["bytes"] = path.stat().st_size
    entry.update(digests(path))
    (run / "manifest.json").write_text(json.dumps(m))
    said = f"layer {name} is {D} wide, the run records it {KV} wide"
    code, o, e = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, o, e, entry["file"], said)
    code, o, e = cli(["inspect", run, "--verify"])
    assert_one_line_error(code, None, e, "1 of 4 shards", entry["file"], "damaged")
    (bad,) = describe_run(run, verify=True)["verify"]["bad"]
    assert bad["file"] == entry["file"] and said in bad["error"]


def test_a_width_no_writer_records_is_refused(setup, tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(setup["run"], run)
    edit_manifest(run, lambda m: m["identity"]["layers"][0].update(dim="wide"))
    code, o, e = cli(["score", run, "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, o, e, "identity.layers[0].dim is 'wide', not a positive integer", exit_code=2)


def test_export_round_trip(setup, tmp_path):
    """npy: one file per layer at its own width, each the run's rows (and the hooks' to 1e-6),
    scored as the run scores that layer; arrow: one column per layer at its width, scored together
    as the run scores them."""
    pytest.importorskip("pyarrow")
    run = setup["run"]
    export_run(run, tmp_path / "npy", to="npy")
    export_run(run, tmp_path / "arrow", to="arrow")
    rows = _rows(run)
    ref = _reference(setup["llama"], TEXTS, _llama_expected())
    order = np.lexsort((np.load(tmp_path / "npy" / "position.npy"), np.load(tmp_path / "npy" / "doc_id.npy")))
    opts = ScoreOptions(metrics=("isoscore", "avgcos", "spectrum"))
    whole = _scores(score(run, opts))
    for name, x in rows.items():
        exported = np.load(tmp_path / "npy" / f"{name}.npy")
        assert exported.shape == x.shape
        np.testing.assert_array_equal(exported[order].astype(np.float64), x)
        if name in ref:
            np.testing.assert_allclose(exported[order], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)
        _same_numbers(whole[name], _scores(score(tmp_path / "npy" / f"{name}.npy", opts))["array"], name)
    back = _scores(score(tmp_path / "arrow", opts))
    assert list(back) == list(whole)
    for name in whole:
        _same_numbers(whole[name], back[name], name)


def test_named_arrays_of_several_widths_score_as_each_alone(tmp_path):
    """Another tool's file of arrays of one row count and several widths (.npz): each array scored
    as the .npy of it alone; arrays of different row counts stay refused."""
    rng = np.random.default_rng(0)
    arrays = {
        "narrow": rng.normal(size=(300, 8)),
        "wide": rng.gamma(2.0, size=(300, 24)) @ rng.normal(size=(24, 24)),
    }
    np.savez(tmp_path / "x.npz", **arrays)
    opts = ScoreOptions(metrics=METRICS, id_sample=300)
    together = _scores(score(tmp_path / "x.npz", opts))
    for name, x in arrays.items():
        np.save(tmp_path / f"{name}.npy", x)
        _same_numbers(together[name], _scores(score(tmp_path / f"{name}.npy", opts))["array"], name)
    np.savez(tmp_path / "y.npz", a=np.zeros((5, 3)), b=np.zeros((6, 4)))
    with pytest.raises(InputError, match="differ in shape"):
        score(tmp_path / "y.npz", opts)


def test_outlier_heat_map_and_html_page_take_one_panel_per_width(setup, tmp_path, cli):
    from geomscope.plot import plot_outliers

    rep = score(setup["run"], ScoreOptions(metrics=("isoscore", "outliers", "spectrum")))
    fig = plot_outliers([rep])
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert [t.split(": ")[-2].rsplit(", ", 1)[-1] for t in titles] == ["16 wide", "32 wide", "64 wide"]
    assert [a.images[0].get_array().shape for a in fig.axes if a.images] == [(4, 16), (1, 32), (2, 40)]
    (tmp_path / "r.json").write_text(json.dumps(rep))
    code, _, err = cli(["report", tmp_path / "r.json", "--html", tmp_path / "r.html", "--quiet"])
    assert code == 0, err
    assert "layers.1.mlp.up_proj" in (tmp_path / "r.html").read_text()


def test_one_covariance_for_layers_of_several_widths_is_one_line(setup, tmp_path, cli):
    """--shrinkage-target file: or layer: is one D x D matrix: refused over layers of several widths,
    used over the layers of its width."""
    np.save(tmp_path / "c.npy", np.eye(KV))
    for target in (f"file:{tmp_path / 'c.npy'}", "layer:layer_02"):
        code, o, e = cli(["score", setup["run"], "--metrics", "isoscore_star", "--shrinkage-target", target])
        assert_one_line_error(code, o, e, "is one D x D covariance", "3 widths", "with --layers", exit_code=2)
    narrow = [n for n, w in Run(setup["run"]).layer_dims.items() if w == KV]
    opts = ScoreOptions(
        metrics=("isoscore_star",), shrinkage_target=f"file:{tmp_path / 'c.npy'}", layers=narrow
    )
    assert [e["layer"] for e in score(setup["run"], opts)["layers"]] == narrow
