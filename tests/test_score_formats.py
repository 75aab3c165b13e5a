"""Other tools' activation formats (score/formats.py): .npz, .safetensors, .pt, Arrow /
``datasets.save_to_disk`` / SAELens caches, Parquet.

Every format is checked against the same rows scored from a plain .npy (to 1e-10), read in small
blocks and large ones; bad columns and files give one-line errors and nothing is unpickled
(crafted and damaged files of every format: test_score_sources.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import Planted, assert_one_line_error

from geomscope.errors import DataError, InputError
from geomscope.score import ScoreOptions, score

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

METRICS = ("isoscore", "isoscore_star", "avgcos", "spectrum", "twonn")
N, D = 240, 12


def _layers():
    rng = np.random.default_rng(7)
    a = rng.standard_normal((N, D)).astype(np.float32)
    b = (a @ rng.standard_normal((D, D)) + 3.0).astype(np.float32)  # anisotropic, offset
    return {"l0": a, "l1": b}


def _numbers(rep: dict) -> dict:
    return {
        e["layer"]: [e[k] for k in ("isoscore", "isoscore_star", "avgcos", "twonn", "pr", "n_rows")]
        + [e["se"].get("isoscore")]
        for e in rep["layers"]
    }


def _opts(**kw) -> ScoreOptions:
    return ScoreOptions(metrics=METRICS, jackknife_groups=4, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    out = {}
    for name, x in _layers().items():
        np.save(d / f"{name}.npy", x)
        out[name] = _numbers(score(d / f"{name}.npy", _opts()))["array"]
    return out


def _write(fmt: str, d: Path) -> Path:
    layers = _layers()
    if fmt == "npz":
        np.savez(d / "x.npz", **layers)
        return d / "x.npz"
    if fmt == "npz-compressed":
        np.savez_compressed(d / "x.npz", **layers)
        return d / "x.npz"
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file(layers, str(d / "x.safetensors"))
        return d / "x.safetensors"
    if fmt == "pt":
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in layers.items()}, d / "x.pt")
        return d / "x.pt"
    table = pa.table(
        {
            "text": pa.array([f"t{i}" for i in range(N)]),  # not a layer: skipped by default
            "l0": pa.FixedSizeListArray.from_arrays(pa.array(layers["l0"].ravel()), D),
            "l1": pa.array([list(r) for r in layers["l1"]], type=pa.list_(pa.float32())),
        }
    )
    if fmt == "parquet":
        pq.write_table(table, d / "x.parquet", row_group_size=50)
        return d / "x.parquet"
    if fmt == "arrow-stream":
        with pa.ipc.new_stream(str(d / "x.arrow"), table.schema) as w:
            w.write_table(table, max_chunksize=70)
        return d / "x.arrow"
    if fmt == "arrow-file":
        with pa.ipc.new_file(str(d / "x.arrow"), table.schema) as w:
            w.write_table(table, max_chunksize=33)
        return d / "x.arrow"
    if fmt == "parquet-dir":
        (d / "pq").mkdir()
        pq.write_table(table.slice(0, 100), d / "pq" / "part-0.parquet")
        pq.write_table(table.slice(100), d / "pq" / "part-1.parquet")
        return d / "pq"
    if fmt == "datasets":
        datasets = pytest.importorskip("datasets")
        ds = datasets.Dataset.from_dict({"l0": list(layers["l0"]), "l1": list(layers["l1"])})
        ds.save_to_disk(str(d / "ds"), num_shards=3)
        return d / "ds"
    raise AssertionError(fmt)


FORMATS = (
    "npz",
    "npz-compressed",
    "safetensors",
    "pt",
    "parquet",
    "arrow-stream",
    "arrow-file",
    "parquet-dir",
    "datasets",
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_matches_the_npy_reference(fmt, tmp_path, reference):
    path = _write(fmt, tmp_path)
    for block_rows in (None, 17):
        rep = score(path, _opts(block_rows=block_rows))
        got = _numbers(rep)
        assert list(got) == ["l0", "l1"]
        for name in got:
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-10, atol=1e-12)
        assert rep["source"]["format"] == fmt.split("-")[0].replace("datasets", "arrow")
        assert rep["source"]["layers"] == ["l0", "l1"]
    one = score(path, _opts(columns=("l1",)))
    assert [e["layer"] for e in one["layers"]] == ["l1"]
    np.testing.assert_allclose(_numbers(one)["l1"], reference["l1"], rtol=1e-10, atol=1e-12)


def test_saelens_cache_matrix_cells_flatten_to_rows(tmp_path, reference):
    """SAELens' CacheActivationsRunner: a directory of ``shard_i`` datasets whose column (the hook
    name) holds a context_size x d_in matrix (datasets' Array2D) per row."""
    datasets = pytest.importorskip("datasets")
    x = _layers()["l0"]
    ctx = 8
    feats = datasets.Features({"blocks.0.hook_resid_pre": datasets.Array2D((ctx, D), "float32")})
    cache = tmp_path / "cache"
    per = N // ctx // 3
    for i in range(3):
        cells = x[i * per * ctx : (i + 1) * per * ctx].reshape(per, ctx, D)
        datasets.Dataset.from_dict({"blocks.0.hook_resid_pre": cells}, features=feats).save_to_disk(
            str(cache / f"shard_{i}")
        )
    rep = score(cache, _opts(block_rows=20))
    assert rep["source"]["files"] == 3 and rep["layers"][0]["layer"] == "blocks.0.hook_resid_pre"
    np.testing.assert_allclose(_numbers(rep)["blocks.0.hook_resid_pre"], reference["l0"], rtol=1e-10)


# ------------------------------------------------------------------------------ bad input
def test_bad_columns_are_one_line_errors(tmp_path, cli):
    path = _write("parquet", tmp_path)
    for args, needle in (
        (["--column", "text"], "not a vector of numbers"),
        (["--column", "nope"], "has no column 'nope'"),
        (["--layers", "0"], "--column"),
        (["--dataset", "x"], "--column"),
    ):
        code, out, err = cli(["score", path, "-q", "--out", tmp_path / "r", *args])
        assert_one_line_error(code, out, err, needle, exit_code=2)


def test_safetensors_missing_or_not_2d(tmp_path):
    from safetensors.numpy import save_file

    save_file(
        {"l0": np.zeros((4, 3, 2), np.float32), "ok": np.ones((5, 2), np.float32)},
        str(tmp_path / "x.safetensors"),
    )
    with pytest.raises(InputError, match="has no tensor 'l9'"):
        score(tmp_path / "x.safetensors", _opts(columns=("l9",)))
    with pytest.raises(InputError, match=r"shape \(4, 3, 2\).*reshape"):
        score(tmp_path / "x.safetensors", _opts(columns=("l0",)))


def test_pt_that_needs_pickle_is_refused_and_not_run(tmp_path, cli):
    import torch

    marker = tmp_path / "unpickled"
    torch.save({"l0": torch.zeros(3, 2), "evil": Planted(marker)}, tmp_path / "x.pt")
    code, out, err = cli(["score", tmp_path / "x.pt", "-q", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "never unpickles", "weights_only", exit_code=2)
    assert "Warning" not in err  # torch's warning about the pickle protocol is not shown
    assert not marker.exists()


def test_npz_with_objects_is_refused(tmp_path):
    np.savez(tmp_path / "x.npz", l0=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(InputError, match="never unpickles"):
        score(tmp_path / "x.npz", _opts())


def test_mismatched_layers_ragged_and_null_cells(tmp_path):
    np.savez(tmp_path / "m.npz", a=np.zeros((5, 3)), b=np.zeros((6, 3)))
    with pytest.raises(InputError, match="differ in shape"):
        score(tmp_path / "m.npz", _opts())
    ragged = pa.table({"v": pa.array([[1.0, 2.0], [3.0], [4.0, 5.0]])})
    pq.write_table(ragged, tmp_path / "r.parquet")
    with pytest.raises(DataError, match="different lengths"):
        score(tmp_path / "r.parquet", _opts())
    nulls = pa.table({"v": pa.array([[1.0, 2.0], None, [4.0, 5.0]])})
    pq.write_table(nulls, tmp_path / "n.parquet")
    with pytest.raises(DataError, match="null cell"):
        score(tmp_path / "n.parquet", _opts())


def test_datasets_state_cannot_point_outside(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../x.arrow"}]}))
    with pytest.raises(InputError, match="not in the directory"):
        score(d, _opts())


def test_datasets_state_listing_no_data_files_is_one_line(tmp_path, cli):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "state.json").write_text(json.dumps({"_data_files": [], "_fingerprint": "x"}))
    code, out, err = cli(["score", d, "--quiet"])
    assert_one_line_error(code, out, err, "state.json lists no data files", exit_code=2)


def test_truncated_files_are_one_line_errors(tmp_path, cli):
    for fmt, cut in (("npz", 0.6), ("arrow-stream", 0.6), ("safetensors", 0.6), ("parquet", 0.6)):
        d = tmp_path / fmt
        d.mkdir()
        path = _write(fmt, d)
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * cut)])
        code, out, err = cli(["score", path, "-q", "--out", d / "r"])
        assert_one_line_error(code, out, err)
        assert code in (2, 3), (fmt, err)
