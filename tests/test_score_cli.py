"""`geomscope score` (CLI): outputs, --json purity, CSV columns, and every bad-input path: an --out
onto a directory or a full disk, rows too wide for the machine's memory, a shrinkage target that is
no covariance, a --scheduler's bound; --help states the seed's range plainly and a seed out of it is
one line."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from test_score import make_run

from geomscope.errors import InputError
from geomscope.schema import LAYER_KEYS, REPORT_KEYS
from geomscope.schema import SCALAR_METRIC_NAMES as CSV_METRICS


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("score_cli") / "run"
    make_run(d, n_shards=2, rows=300)
    return d


def test_json_stdout_is_pure_and_files_written(cli, run_dir, tmp_path):
    code, out, err = cli(
        [
            "score",
            run_dir,
            "--json",
            "--metrics",
            "isoscore,avgcos,twonn",
            "--id-sample",
            "200",
            "--out",
            tmp_path / "rep",
        ]
    )
    assert code == 0, err
    rep = json.loads(out)  # the whole of stdout is one JSON document
    assert tuple(rep) == REPORT_KEYS
    assert [tuple(e) for e in rep["layers"]] == [LAYER_KEYS] * 3
    assert (tmp_path / "rep.json").exists() and (tmp_path / "rep.csv").exists()
    assert json.loads((tmp_path / "rep.json").read_text())["layers"] == rep["layers"]
    assert "IsoScore" in err and "wrote" in err  # the table and the paths go to stderr


def test_default_output_in_run_dir_and_csv_columns(cli, run_dir):
    code, out, err = cli(["score", run_dir, "--metrics", "isoscore,spectrum", "--quiet"])
    assert code == 0, err
    assert out == "" and err == ""
    with open(run_dir / "report.csv") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    assert header == ["layer", "index", "n_rows", *CSV_METRICS, "outliers", *[f"se_{m}" for m in CSV_METRICS]]
    assert [r[0] for r in rows[1:]] == ["layer_00", "layer_01", "layer_02"]
    rep = json.loads((run_dir / "report.json").read_text())
    for r, e in zip(rows[1:], rep["layers"], strict=True):
        assert float(r[header.index("isoscore")]) == e["isoscore"]
        assert float(r[header.index("se_pr")]) == e["se"]["pr"]
        assert r[header.index("avgcos")] == ""  # not requested: empty cell


def test_array_default_output_next_to_file(cli, tmp_path):
    X = np.random.default_rng(0).normal(size=(500, 6))
    np.save(tmp_path / "emb.npy", X)
    code, out, err = cli(["score", tmp_path / "emb.npy", "--metrics", "isoscore,avgcos", "--json"])
    assert code == 0, err
    rep = json.loads(out)
    assert rep["source"]["kind"] == "array" and rep["layers"][0]["n_rows"] == 500
    assert (tmp_path / "emb_report.json").exists() and (tmp_path / "emb_report.csv").exists()


def test_float32_products_are_recorded_and_captioned(cli, tmp_path):
    X = np.random.default_rng(1).normal(size=(3000, 12)) + 50.0
    np.save(tmp_path / "emb.npy", X)
    reports = {}
    for dtype in ("float64", "float32"):
        out_prefix = tmp_path / dtype
        code, out, err = cli(
            [
                "score",
                tmp_path / "emb.npy",
                "-m",
                "isoscore,spectrum",
                "--product-dtype",
                dtype,
                "-o",
                out_prefix,
            ]
        )
        assert code == 0, err
        said = "float32 block products" in " ".join(err.split())  # the table's caption (wrapped)
        assert said == (dtype == "float32")
        reports[dtype] = json.loads(out_prefix.with_suffix(".json").read_text())
        assert reports[dtype]["params"]["product_dtype"] == dtype
    a, b = (reports[k]["layers"][0]["isoscore"] for k in ("float64", "float32"))
    assert a == pytest.approx(b, rel=1e-6)


def test_warnings_for_transposed_and_nan_arrays(cli, tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "wide.npy", rng.normal(size=(8, 30)))
    code, out, err = cli(["score", tmp_path / "wide.npy", "--metrics", "isoscore", "--quiet"])
    assert code == 0 and "transposed" in err
    X = rng.normal(size=(100, 5))
    X[7, 2] = np.inf
    np.save(tmp_path / "nan.npy", X)
    code, out, err = cli(["score", tmp_path / "nan.npy", "--metrics", "isoscore", "--json", "--quiet"])
    assert code == 0 and "NaN/Inf dropped" in err
    assert json.loads(out)["layers"][0]["dropped"]["nonfinite"] == 1


@pytest.mark.parametrize(
    "args, match",
    [
        (["--metrics", "isoscore,bogus"], "--metrics must be a comma list of metric names"),
        (["--zeta", "abc"], "zeta"),
        (["--zeta", "1.5"], "zeta"),
        (["--layers", "layer_42"], "not in this run"),
        (["--workers", "two"], "Invalid value for '--workers'"),
        (["--seed", "-1"], "--seed must be a whole number from 0"),
        (["--id-sample", "2"], "--id-sample must be a whole number >= 3"),
        (["--outlier-rule", "nope"], "outlier-rule"),
        (["--product-dtype", "float16"], "product-dtype"),
        (["--shrinkage-target", "layer:missing"], "not in this run"),
    ],
)
def test_bad_options(cli, run_dir, tmp_path, args, match):
    code, out, err = cli(["score", run_dir, "--out", tmp_path / "x", "--json", *args])
    assert_one_line_error(code, out, err, match)
    assert not (tmp_path / "x.json").exists()


def test_bad_sources(cli, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "t.txt").write_text("x")
    np.save(tmp_path / "flat.npy", np.zeros(5))
    np.save(tmp_path / "cube.npy", np.zeros((3, 4, 5)))
    np.save(tmp_path / "one.npy", np.zeros((1, 4)))
    cases = [
        (tmp_path / "d", "not a geomscope run directory"),
        (tmp_path / "t.txt", "not a format score reads"),
        (tmp_path / "nope", "does not exist"),
        (tmp_path / "flat.npy", "2-D (N, D)"),
        (tmp_path / "cube.npy", "2-D (N, D)"),
        (tmp_path / "one.npy", "at least 2 rows"),
    ]
    for path, match in cases:
        code, out, err = cli(["score", path, "--json"])
        assert_one_line_error(code, out, err, match)


def test_h5_dataset_choice(cli, tmp_path):
    import h5py

    with h5py.File(tmp_path / "two.h5", "w") as f:
        f.create_dataset("a", data=np.zeros((4, 3)))
        f.create_dataset("b", data=np.ones((5, 3)))
    code, out, err = cli(["score", tmp_path / "two.h5", "--json"])
    assert_one_line_error(code, out, err, "--dataset")
    code, out, err = cli(["score", tmp_path / "two.h5", "--dataset", "c", "--json"])
    assert_one_line_error(code, out, err, "no dataset 'c'")


def test_incomplete_and_corrupt_runs_keep_old_report(cli, tmp_path):
    make_run(tmp_path / "r", n_shards=2, rows=100, finalize=False)
    code, out, err = cli(["score", tmp_path / "r", "--json"])
    assert_one_line_error(code, out, err, "--partial")
    code, out, err = cli(["score", tmp_path / "r", "--partial", "--metrics", "isoscore", "--quiet"])
    assert code == 0 and "incomplete" in err
    before = (tmp_path / "r" / "report.json").read_bytes()
    shard = tmp_path / "r" / "shard-00001.h5"
    shard.write_bytes(shard.read_bytes()[:2000])
    code, out, err = cli(["score", tmp_path / "r", "--partial", "--metrics", "isoscore", "--json"])
    assert_one_line_error(code, out, err, "shard-00001.h5")
    assert (tmp_path / "r" / "report.json").read_bytes() == before  # nothing already written is lost


def test_too_few_rows(cli, tmp_path):
    make_run(tmp_path / "r", n_shards=1, rows=10, doc_len=1)
    code, out, err = cli(["score", tmp_path / "r", "--exclude-special", "--json"])
    assert_one_line_error(code, out, err, "at least 2")


def test_dask_local_workers_are_bounded_like_workers():
    from geomscope.score.dask_executor import parse_scheduler

    assert parse_scheduler("local:4") == "local:4"
    with pytest.raises(InputError, match="at most 1024"):
        parse_scheduler("local:100000")


def test_score_out_onto_a_directory_or_a_failing_disk(cli, tmp_path, monkeypatch):
    X = np.random.default_rng(0).normal(size=(50, 4))
    np.save(tmp_path / "x.npy", X)
    (tmp_path / "p.json").mkdir()
    code, out, err = cli(["score", tmp_path / "x.npy", "--out", tmp_path / "p", "--quiet"])
    assert_one_line_error(code, out, err, "is a directory", exit_code=2)
    import errno

    import geomscope.report as report

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_text_atomic", disk_full)  # any write error, e.g. a full disk
    code, out, err = cli(["score", tmp_path / "x.npy", "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "cannot write the report", "No space left", exit_code=2)


def test_rows_too_wide_for_this_machine_are_one_line_before_any_allocation(cli, tmp_path, monkeypatch):
    """D x D accumulators larger than the machine's memory: said with the numbers, not numpy's 74.5 GiB
    allocation error after the rows are read."""
    import geomscope.score.resources as resources

    monkeypatch.setattr(resources, "physical_memory", lambda: 40 * 2**20)  # a 40 MiB machine
    wide = tmp_path / "wide.npy"
    np.save(wide, np.random.default_rng(0).normal(size=(20, 2000)).astype(np.float32))  # 2000^2 x 16 B
    code, out, err = cli(["score", wide, "--metrics", "twonn", "--quiet"])
    assert_one_line_error(code, out, err, "D = 2000 is too wide", "GiB", exit_code=2)
    mid = tmp_path / "mid.npy"
    np.save(mid, np.random.default_rng(0).normal(size=(40, 1000)).astype(np.float32))  # 16 MB, 10 groups: not
    code, out, err = cli(["score", mid, "--metrics", "avgcos", "--quiet"])
    assert_one_line_error(code, out, err, "D = 1000", "--jackknife-groups", exit_code=2)
    code, out, err = cli(
        ["score", mid, "--metrics", "avgcos", "--jackknife-groups", "2", "--out", tmp_path / "r", "--quiet"]
    )
    assert code == 0, err


@pytest.mark.parametrize("target", [-np.eye(8), np.zeros((8, 8)), np.diag([1.0, 1, 1, 1, 1, 1, 1, -0.5])])
def test_a_shrinkage_target_that_is_no_covariance_is_refused(cli, tmp_path, target):
    """IsoScore* shrinks toward C0: a matrix with negative eigenvalues (or none above 0) is refused, not
    scored."""
    np.save(tmp_path / "c0.npy", target)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(100, 8)))
    code, out, err = cli(
        [
            "score",
            tmp_path / "x.npy",
            "--metrics",
            "isoscore_star",
            "--shrinkage-target",
            tmp_path / "c0.npy",
            "--quiet",
        ]
    )
    assert_one_line_error(code, out, err, "is not a covariance", exit_code=2)


def test_score_help_states_the_seed_range_readably(cli):
    code, out, _ = cli(["score", "--help"])
    assert code == 0
    seed_help = " ".join(out.split("--seed N", 1)[1].split("--exclude-special", 1)[0].split())
    assert "0 <= N < 2^64" in seed_help and "18446744073709551615" not in out, seed_help


@pytest.mark.parametrize("seed, said", [(str(2**64), "2^64 - 1"), ("-1", "2^64 - 1"), ("seven", "'--seed'")])
def test_score_refuses_a_seed_out_of_range_in_one_line(cli, tmp_path, seed, said):
    code, out, err = cli(["score", tmp_path / "nowhere", "--seed", seed, "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, "--seed", said, exit_code=2)
