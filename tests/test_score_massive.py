"""score --metrics massive: the largest |x| entries (Sun et al. 2024) against a sort of every entry
of the rows read here, the median |x| against numpy's, on random data, a synthetic run with planted
massive activations and the bundled MiniLM (whose [CLS] token carries them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_runs import minilm_run, run_rows
from test_score import make_run

from geomscope.errors import DataError, InputError
from geomscope.metrics.massive import TopAbs, bin_edges
from geomscope.report import load_report, save_report, to_csv
from geomscope.score import ScoreOptions, score
from geomscope.store.sample import run_keys


def top_reference(x, keys, k):
    """The k entries of largest |x|, ties by (key, dimension): (value, dim, key) of a full sort."""
    rows, dims = np.indices(x.shape)
    order = np.lexsort((dims.ravel(), keys[rows.ravel()], -np.abs(x).ravel()))[:k]
    return [(float(x.ravel()[i]), int(dims.ravel()[i]), int(keys[rows.ravel()[i]])) for i in order]


def lower_median(a):
    s = np.sort(np.abs(a).ravel())
    return s[(s.size + 1) // 2 - 1]


@pytest.mark.parametrize("seed", [0, 1])
def test_top_entries_and_median_bounds_on_random_data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(2, size=(900, 12))
    x[5, 3] = x[6, 3] = 80.0  # a tie: the smaller key comes first
    x[rng.random(x.shape) < 0.1] = 0.0
    keys = rng.permutation(900).astype(np.uint64)
    whole = TopAbs(7).update(x, keys)
    parts = [TopAbs(7).update(x[i : i + 200], keys[i : i + 200]) for i in range(0, 900, 200)]
    merged = parts[3]
    for p in (parts[1], parts[4], parts[0], parts[2]):  # any order: the same entries
        merged.merge(p)
    ref = top_reference(x, keys, 7)
    for top in (whole, merged):
        assert [(e["value"], e["dim"], e["key"]) for e in top.entries()] == ref
        low, high = top.median_bounds()
        assert low <= lower_median(x) < high and high / low < 1.011
        assert top.n == x.size
    np.testing.assert_array_equal(whole.counts, merged.counts)


def test_median_edges_and_bad_input():
    low, high = bin_edges(0)
    assert high / low == pytest.approx(2 ** (1 / 64))
    half_zero = np.zeros((4, 2))
    half_zero[0] = 1.0
    assert TopAbs(1).update(half_zero, np.arange(4)).median_bounds() == (0.0, 0.0)
    with pytest.raises(DataError, match="no entries"):
        TopAbs(3).median_bounds()
    with pytest.raises(DataError, match="at least 1"):
        TopAbs(0)


def _check_layer(e, x, meta, k):
    keys = run_keys(meta["doc_id"], meta["position"])
    ref = top_reference(x, keys, k)
    got = e["massive"]["entries"]
    assert [(g["value"], g["dim"]) for g in got] == [(v, d) for v, d, _ in ref]
    for g, (_, _, key) in zip(got, ref, strict=True):
        row = np.flatnonzero(keys == key)[0]
        assert (g["doc_id"], g["position"], g["token_id"]) == (
            meta["doc_id"][row],
            meta["position"][row],
            meta["token_id"][row],
        )
        assert g["special"] == bool(meta["is_special"][row])
    low, high = e["massive"]["median_abs_bounds"]
    med = lower_median(x)
    assert low <= med < high
    assert e["massive_max_abs"] == abs(ref[0][0])
    assert e["massive_ratio"] == pytest.approx(abs(ref[0][0]) / med, rel=0.011)
    lo_r, hi_r = e["massive"]["ratio_bounds"]
    assert lo_r <= abs(ref[0][0]) / med <= hi_r
    assert e["massive"]["first_token"] == sum(g["position"] == 0 for g in got)
    assert e["se"]["massive_ratio"] is None and "maximum" in e["notes"]["se.massive_ratio"]


def test_top_entries_of_a_run(tmp_path):
    make_run(tmp_path / "run", n_shards=3, rows=200)
    rep = score(tmp_path / "run", ScoreOptions(metrics="massive", massive_k=6, workers=2))
    for e in rep["layers"]:
        x, meta = run_rows(tmp_path / "run", e["layer"])
        _check_layer(e, x, meta, 6)
    save_report(rep, tmp_path / "r")
    back = load_report(tmp_path / "r.json")
    assert back["layers"][0]["massive"] == rep["layers"][0]["massive"]
    assert "massive_ratio" in to_csv(rep).splitlines()[0]
    damaged = json.loads((tmp_path / "r.json").read_text())
    damaged["layers"][0]["massive"]["entries"] = "top"
    (tmp_path / "r.json").write_text(json.dumps(damaged))
    with pytest.raises(InputError, match="damaged report"):
        load_report(tmp_path / "r.json")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_run(tmp_path_factory.mktemp("minilm_massive"), sentences=30)


def test_bundled_minilm(minilm):
    rep = score(minilm, ScoreOptions(metrics="massive", layers="0,3,6", massive_k=10))
    for e in rep["layers"]:
        x, meta = run_rows(minilm, e["layer"])
        _check_layer(e, x, meta, 10)
        # MiniLM's massive activations sit on the [CLS] token (position 0, special)
        assert e["massive"]["first_token"] == 10 and e["massive"]["special"] == 10
        assert e["massive_ratio"] > 20
    rest = score(minilm, ScoreOptions(metrics="massive", layers="3", massive_k=10, exclude_special=True))
    x, meta = run_rows(minilm, "layer_03")
    ordinary = ~meta["is_special"].astype(bool)
    _check_layer(rest["layers"][0], x[ordinary], {k: v[ordinary] for k, v in meta.items()}, 10)
    assert rest["layers"][0]["massive"]["special"] == 0


def test_cli(cli, minilm, tmp_path):
    code, out, err = cli(
        [
            "score",
            str(minilm),
            "-m",
            "massive",
            "-l",
            "2",
            "--columns",
            "massive_ratio",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert code == 0, err
    assert "max/med" in err


# ------------------------------------------------------------------ --keep sample runs
@pytest.fixture(scope="module")
def kept_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("massive_kept")
    full = minilm_run(root, sentences=30, layers="0,3")
    (root / "kept").mkdir()
    return full, minilm_run(root / "kept", sentences=30, layers="0,3", keep="sample:10")


@pytest.mark.parametrize("exclude_special", [False, True])
def test_keep_sample_run_keeps_the_same_entries_and_histogram(kept_pair, exclude_special):
    full, kept = kept_pair
    opts = dict(metrics="massive", massive_k=15, id_sample=10, exclude_special=exclude_special)
    a, b = score(full, ScoreOptions(**opts)), score(kept, ScoreOptions(**opts))
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        assert eb["massive"] == ea["massive"] and eb["massive_ratio"] == ea["massive_ratio"]


def _rewrite_shard(run, edit):
    """Edit shard 0 of ``run`` in place and make its manifest entry match the file again."""
    import json

    import h5py

    from geomscope.store.checksum import digests

    entry = json.loads((run / "manifest.json").read_text())["shards"][0]
    path = run / entry["file"]
    with h5py.File(path, "a") as f:
        edit(f)
    m = json.loads((run / "manifest.json").read_text())
    m["shards"][0]["bytes"] = path.stat().st_size
    m["shards"][0].update(digests(path))
    (run / "manifest.json").write_text(json.dumps(m))


def test_keep_sample_run_without_or_with_damaged_entries(kept_pair, tmp_path):
    import shutil

    from geomscope.errors import GeomscopeError

    _, kept = kept_pair
    with pytest.raises(InputError, match="--massive-k 100 or less"):
        score(kept, ScoreOptions(metrics="massive", massive_k=101, id_sample=10))
    old = tmp_path / "old"
    shutil.copytree(kept, old)
    _rewrite_shard(old, lambda f: f.__delitem__("massive"))
    e = score(old, ScoreOptions(metrics="massive", id_sample=10, layers="0"))["layers"][0]
    assert e["massive"] is None and e["massive_ratio"] is None
    assert "extract it again" in e["notes"]["massive_ratio"]
    bad = tmp_path / "bad"
    shutil.copytree(kept, bad)

    def out_of_range(f):
        d = f["massive/layer_00/regular/dim"]
        d[0] = 9999

    _rewrite_shard(bad, out_of_range)
    with pytest.raises(GeomscopeError, match="dimension outside") as err:
        score(bad, ScoreOptions(metrics="massive", id_sample=10, layers="0"))
    assert "\n" not in str(err.value)
