"""Hostile and broken inputs, as an adversary would try them: run directories, checkpoints and model
directories someone else made, huge inputs, interrupted commands. Each case: nothing lost, nothing
run, nothing written outside what was asked, and one `error:` line where the input is bad."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import make_tiny_model
from test_train_helpers import make_checkpoint, synthetic_rows, words_of, write_csv

TEXT = "\n".join(f"the quick brown fox number {i} jumps over the lazy dog" for i in range(12)) + "\n"


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_tiny_model("bert", tmp_path_factory.mktemp("models") / "bert")


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    return p


def _extract(cli, model, text, run, *extra):
    return cli(["extract", model, text, "--out", run, "--quiet", "--shard-docs", "4", *extra])


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ data loss


def _finetune(cli, tmp_path, out, *extra):
    model = tmp_path / "m"
    if not model.exists():
        make_checkpoint(model, words_of([]))
    train = tmp_path / "train.csv"
    if not train.exists():
        write_csv(train, synthetic_rows(16, 0))
    args = ["--epochs", "1", "--batch-size", "8", "--device", "cpu", "--quiet", "--reg", "cosreg"]
    return cli(["finetune", model, "--train", train, "--eval", train, "--out", out, *args, *extra])


# ------------------------------------------------------------------------------ security
class _Planted:
    """A pickle that runs a command when loaded: it must never be loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------------------------ silent wrong results


# ------------------------------------------------------------------------------ resources and leftovers


# ------------------------------------------------------------------------------ one line, not a traceback


# ------------------------------------------------------------------------------ smaller


@pytest.mark.parametrize(
    "array, needle",
    [
        (np.zeros((3, 4, 5)), "shape (3, 4, 5)"),
        (np.array([["a", "b"], ["c", "d"]]), "dtype <U1"),
        (np.zeros((10, 4), complex), "dtype complex128"),
    ],
)
def test_score_wrong_array_shape_or_dtype_exits_2(cli, tmp_path, array, needle):
    np.save(tmp_path / "a.npy", array)
    code, out, err = cli(["score", tmp_path / "a.npy", "--quiet"])
    assert_one_line_error(code, out, err, needle, exit_code=2)


def test_score_never_unpickles_an_object_array(cli, tmp_path):
    marker = tmp_path / "PWNED"
    arr = np.empty((2, 2), dtype=object)
    arr[0, 0] = _Planted(marker)
    np.save(tmp_path / "obj.npy", arr, allow_pickle=True)
    code, out, err = cli(["score", tmp_path / "obj.npy", "--quiet"])
    assert_one_line_error(code, out, err, exit_code=2)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "empty or cut short"),
        (b"\x93NUMPY\x01", "empty or cut short"),
        (bytes(range(256)) * 4, "never unpickles"),
    ],
)
def test_a_broken_npy_is_one_line_that_never_suggests_unpickling(cli, tmp_path, content, needle):
    """An empty or cut .npy is not a Ctrl-C (numpy's EOFError reads as one to click), and random bytes
    are not "pickled data you may load unsafely"."""
    bad = tmp_path / "bad.npy"
    bad.write_bytes(content)
    code, out, err = cli(["score", bad, "--quiet"])
    line = assert_one_line_error(code, out, err, "bad.npy", needle, exit_code=2)
    assert "unsafe" not in line and "interrupted" not in line
    ok = tmp_path / "ok.npy"
    np.save(ok, np.random.default_rng(0).normal(size=(50, 4)))
    code, out, err = cli(["score", ok, "--metrics", "isoscore_star", "--shrinkage-target", bad, "--quiet"])
    line = assert_one_line_error(code, out, err, "--shrinkage-target", needle, exit_code=2)
    assert "interrupted" not in line


def test_an_empty_pt_file_is_one_line(cli, tmp_path):
    (tmp_path / "zero.pt").write_bytes(b"")
    code, out, err = cli(["score", tmp_path / "zero.pt", "--quiet"])
    assert_one_line_error(code, out, err, "zero.pt", exit_code=2)


def test_score_refuses_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "rows.npy"
    os.mkfifo(fifo)
    ok = tmp_path / "ok.npy"
    np.save(ok, np.zeros((5, 3)))
    for args in (["score", fifo], ["score", ok, "--metrics", "isoscore_star", "--shrinkage-target", fifo]):
        p = subprocess.run(
            [sys.executable, "-m", "geomscope", *map(str, args), "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,  # a read of the FIFO would block until then
        )
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith("error:") and "rows.npy" in p.stderr


@pytest.mark.parametrize("case", ["chunked", "contiguous", "external"])
def test_an_h5_array_that_does_not_store_its_rows_is_refused_at_once(cli, tmp_path, case):
    """10^12 declared rows in a kilobyte file would be read as fill values for hours; external raw
    storage would read another file (here /etc/passwd's stand-in) as rows."""
    import h5py

    path = tmp_path / "a.h5"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(160, dtype=np.uint8).tobytes())
    with h5py.File(path, "w") as f:
        if case == "chunked":
            f.create_dataset("x", shape=(10**12, 8), dtype="f4", chunks=(1024, 8))
        elif case == "contiguous":
            f.create_dataset("x", shape=(10**9, 8), dtype="f4")
        else:
            f.create_dataset("x", shape=(5, 8), dtype="f4", external=[(str(secret), 0, 160)])
    code, out, err = cli(["score", path, "--metrics", "avgcos", "--max-rows", "100", "--quiet"])
    needle = "other files" if case == "external" else "declares shape"
    assert_one_line_error(code, out, err, "a.h5", needle, exit_code=2)


def test_an_h5_array_partly_compressed_and_whole_scores(cli, tmp_path):
    import h5py

    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "x", data=np.random.default_rng(0).normal(size=(3000, 8)), chunks=(1000, 8), compression="gzip"
        )
    assert cli(["score", path, "--metrics", "avgcos", "--out", tmp_path / "r", "--quiet"])[0] == 0


def _damaged(rep: dict, case: str):
    """A report dict edited as the damage ``case`` says (layers[0] unless named)."""
    import copy

    rep = copy.deepcopy(rep)
    lay = rep["layers"][0]
    edits = {
        "version_text": lambda: rep.update(format_version="abc"),
        "version_null": lambda: rep.update(format_version=None),
        "model_text": lambda: rep.update(model="bert"),
        "params_list": lambda: rep.update(params=[1]),
        "source_list": lambda: rep.update(source=[1, 2]),
        "notes_list": lambda: rep.update(notes=["x"]),
        "se_list": lambda: lay.update(se=[1, 2]),
        "layer_int": lambda: [e.update(layer=i) for i, e in enumerate(rep["layers"])],
        "metric_text": lambda: lay.update(isoscore="high"),
        "eig_negative": lambda: lay.update(eigenvalues=[-1, 0, -5]),
        "eig_ragged": lambda: lay.update(eigenvalues=[[1, 2], [3]]),
        "layer_notes_text": lambda: lay.update(notes="zz"),
        "final_norm_text": lambda: rep.update(final_norm="hello"),
        "final_norm_partial": lambda: rep.update(final_norm={"before": "x"}),
    }
    edits[case]()
    return rep


@pytest.mark.parametrize(
    "case",
    [
        "version_text",
        "version_null",
        "model_text",
        "params_list",
        "source_list",
        "notes_list",
        "se_list",
        "layer_int",
        "metric_text",
        "eig_negative",
        "eig_ragged",
        "layer_notes_text",
        "final_norm_text",
        "final_norm_partial",
        "deep",
        "huge_int",
    ],
)
def test_a_damaged_report_is_one_line_for_report_and_plot(cli, tmp_path, case):
    from test_plot_factory import make_report

    path = tmp_path / "r.json"
    if case == "deep":
        path.write_text('{"format": "geomscope-report", "layers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "huge_int":
        path.write_text('{"format": "geomscope-report", "format_version": ' + "9" * 5000 + ', "layers": []}')
    else:
        path.write_text(json.dumps(_damaged(make_report(n_layers=3, hidden=16), case)))
    for args in (
        ["plot", path, "--out", f"{tmp_path}/figs/"],
        ["report", path, "--html", tmp_path / "p.html"],
    ):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, "r.json", exit_code=2)
    assert not (tmp_path / "figs").exists() or not list((tmp_path / "figs").iterdir())


@pytest.mark.parametrize(
    "edit",
    [
        lambda row: row.update(step="abc"),
        lambda row: row.update(isoscore="high"),
        lambda row: row.update(n_rows="inf"),
        lambda row: row.update(n_rows="2.5"),
        "extra_cell",
    ],
)
def test_a_damaged_trajectory_is_one_line_for_plot(cli, tmp_path, edit):
    import csv

    from test_plot_factory import make_report

    from geomscope.score.trajectory import to_trajectory_csv

    reps = []
    for step in (0, 1000):
        rep = make_report(n_layers=3, hidden=16)
        rep["model"]["revision"] = f"step{step}"
        reps.append(rep)
    path = tmp_path / "trajectory.csv"
    path.write_text(to_trajectory_csv(reps))
    assert cli(["plot", path, "--out", f"{tmp_path}/ok/", "--quiet"])[0] == 0
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for i, row in enumerate(rows):
            if i == 2 and edit != "extra_cell":
                edit(row)
            w.writerow(row)
    if edit == "extra_cell":
        with path.open("a") as f:
            f.write(",".join(["x"] * (len(rows[0]) + 3)) + "\n")
    code, out, err = cli(["plot", path, "--out", f"{tmp_path}/figs/", "--quiet"])
    assert_one_line_error(code, out, err, "trajectory.csv line", exit_code=2)
