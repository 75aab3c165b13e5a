"""`geomscope score`: what is refused before any work (clashing run names, an output that cannot be
written, an empty --out, a name a run keeps for its own files, absurd --workers and --memory-mb),
the processes a pool starts, and names from data printed as themselves (no terminal escapes, no
rich markup applied)."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error
from test_score import make_run

from geomscope.errors import InputError
from geomscope.score import ScoreOptions
from geomscope.score.resources import MAX_WORKERS

#: a name a crafted run or report may hold: clear the screen, retitle the window (OSC ... BEL), and
#: rich markup that would recolour the rest
HOSTILE = "x\x1b[2J\x1b]0;owned\x07[bold red]y[/]"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("guards") / "run"
    make_run(d, n_shards=3, rows=200)
    return d


@pytest.fixture
def no_work(monkeypatch):
    """Scoring fails the test: a refusal must come before any run is scored."""

    def boom(*a, **k):
        raise AssertionError("score() was called: the refusal came after the work started")

    monkeypatch.setattr("geomscope.score.score", boom)


def _copy(run_dir, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run_dir, dest)
    return dest


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------ 1. clashing runs
def test_runs_sharing_a_folder_name_are_refused_before_any_work(cli, run_dir, tmp_path, no_work):
    a, b = _copy(run_dir, tmp_path / "a" / "run"), _copy(run_dir, tmp_path / "b" / "run")
    # into one --out: one <run>.json for both (without --out each report lies beside its run, and
    # trajectory.csv's model column tells runs of other models apart: not refused)
    code, out, err = cli(["score", a, b, "-q", "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, f"{a} and {b}", "'run'", "rename one", exit_code=2)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("out", [True, False])
def test_the_same_run_twice_is_refused(cli, run_dir, tmp_path, no_work, out):
    a = _copy(run_dir, tmp_path / "run")
    extra = ["--out", tmp_path / "o"] if out else []
    code, o, err = cli(["score", a, a, "-q", *extra])
    assert_one_line_error(code, o, err, f"{a} is given twice", "give each run once", exit_code=2)
    code, o, err = cli(["score", a, f"{a}{os.sep}", "-q", *extra])  # the same folder, spelt otherwise
    assert_one_line_error(code, o, err, "given twice", exit_code=2)
    link = tmp_path / "link"
    link.symlink_to(a, target_is_directory=True)  # other names, one folder: one report.json
    code, o, err = cli(["score", a, link, "-q"])
    assert_one_line_error(code, o, err, "would both be", "report.json", exit_code=2)


def test_a_run_named_like_the_trajectory_table_is_refused(cli, run_dir, tmp_path, no_work):
    a = _copy(run_dir, tmp_path / "trajectory")
    b = _copy(run_dir, tmp_path / "other")
    code, out, err = cli(["score", a, b, "-q", "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, "trajectory.csv", exit_code=2)


def test_distinct_names_into_one_out_keep_every_report(cli, run_dir, tmp_path):
    a, b = _copy(run_dir, tmp_path / "a" / "step1"), _copy(run_dir, tmp_path / "b" / "step2")
    code, out, err = cli(["score", a, b, "-q", "--metrics", "isoscore", "--out", tmp_path / "o", "--json"])
    assert code == 0, err
    assert _listing(tmp_path / "o") == [
        "step1.csv",
        "step1.json",
        "step2.csv",
        "step2.json",
        "trajectory.csv",
    ]
    dirs = {json.loads((tmp_path / "o" / f"{n}.json").read_text())["run"]["dir"] for n in ("step1", "step2")}
    assert dirs == {str(a), str(b)}


# ------------------------------------------------------------------------------ 2. unwritable outputs
@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's /sys")
def test_an_out_that_cannot_be_written_is_refused_before_the_work(cli, run_dir, no_work):
    # os.access says yes to root here; only creating a file says no
    code, out, err = cli(["score", run_dir, "--out", "/sys/kernel/report", "-q"])
    assert_one_line_error(code, out, err, "cannot write in /sys/kernel", "choose another --out", exit_code=2)


def _read_only(monkeypatch, folder: Path) -> None:
    """``folder`` as on a read-only mount (the sessions run as root: a mode is no obstacle to them)."""
    real_open = os.open

    def ro_open(path, flags, *a, **k):
        if flags & os.O_CREAT and Path(os.fspath(path)).parent == folder:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", ro_open)


def test_a_read_only_run_directory_is_refused_before_the_work(cli, run_dir, tmp_path, monkeypatch, no_work):
    run = _copy(run_dir, tmp_path / "run")
    _read_only(monkeypatch, run)
    code, out, err = cli(["score", run, "-q"])  # the default output: the run directory itself
    assert_one_line_error(code, out, err, f"cannot write in {run}", "Read-only file system", exit_code=2)


def test_an_array_in_a_read_only_folder_reports_in_the_working_directory(cli, tmp_path, monkeypatch):
    src, here = tmp_path / "ro", tmp_path / "here"
    src.mkdir(), here.mkdir()
    np.save(src / "emb.npy", np.random.default_rng(0).normal(size=(300, 5)))
    _read_only(monkeypatch, src)
    monkeypatch.chdir(here)
    code, out, err = cli(["score", src / "emb.npy", "--metrics", "isoscore", "-q"])
    assert code == 0, err
    assert _listing(here) == ["emb_report.csv", "emb_report.json"]
    assert _listing(src) == ["emb.npy"]


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    from geomscope.fileio import ensure_writable, write_denied

    (tmp_path / "keep.txt").write_text("mine")
    assert write_denied(tmp_path) is None
    assert write_denied(tmp_path / "not" / "yet") is None  # probed where make_dirs would create it
    ensure_writable(tmp_path / "not" / "yet")
    assert _listing(tmp_path) == ["keep.txt"]
    assert write_denied(tmp_path / "keep.txt" / "x") is not None  # a file on the way


# ------------------------------------------------------------------------------ 3. empty --out
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_out_is_refused(cli, run_dir, tmp_path, monkeypatch, no_work, value):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["score", run_dir, "--out", value, "-q"])
    assert_one_line_error(code, out, err, "--out is empty", exit_code=2)
    b = _copy(run_dir, tmp_path / "b")
    code, out, err = cli(["score", run_dir, b, "--out", value, "-q"])
    assert_one_line_error(code, out, err, "--out is empty", exit_code=2)
    assert _listing(tmp_path) == ["b"]


# ------------------------------------------------------------------------------ 4. a run's own names
@pytest.mark.parametrize(
    "name, taken",
    [
        (".geomscope-rank-00000", ".geomscope-rank-00000.json"),  # extract's shard log (older form)
        (".geomscope-tmp-0a1b2c-x", ".geomscope-tmp-0a1b2c-x.json"),  # removed by extract --overwrite
        (".geomscope-rank-00001.jsonl/", ".geomscope-rank-00001.jsonl"),  # a folder at a log's name
    ],
)
def test_an_out_at_a_name_the_run_keeps_is_refused(cli, run_dir, tmp_path, no_work, name, taken):
    run = _copy(run_dir, tmp_path / "run")
    before = _listing(run)
    code, out, err = cli(["score", run, "--out", f"{run}{os.sep}{name}", "-q"])
    assert_one_line_error(code, out, err, repr(taken), f"run directory {run}", exit_code=2)
    assert _listing(run) == before


def test_the_names_are_a_runs_only_inside_a_run(tmp_path):
    from geomscope.report import check_report_out

    check_report_out(tmp_path / ".geomscope-rank-00000")  # a folder that is no run: any name
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(InputError, match="keeps the name"):
        check_report_out(tmp_path / ".geomscope-rank-00000")


# ------------------------------------------------------------------------------ 5. --workers
def test_absurd_workers_are_refused(cli, run_dir, no_work):
    code, out, err = cli(["score", run_dir, "--workers", "100000", "-q"])
    needle = f"--workers must be a positive whole number up to {MAX_WORKERS}, not 100000"
    assert_one_line_error(code, out, err, needle, exit_code=2)
    code, out, err = cli(["score", "--help"])
    assert str(MAX_WORKERS) in out and "core count" in out


def test_the_pool_starts_at_most_one_process_per_shard(run_dir, monkeypatch):
    from concurrent.futures import ProcessPoolExecutor

    from geomscope.score import executor, score

    started = []

    class Counted(ProcessPoolExecutor):
        def __init__(self, max_workers=None, *a, **k):
            started.append(max_workers)
            super().__init__(max_workers, *a, **k)

    from geomscope.score import engine, resources

    planned = {}

    def remember(self, *args):
        planned.update(threads=self.threads, in_flight=self.ex.in_flight)
        return original(self, *args)

    original = engine._Scorer.run
    monkeypatch.setattr(engine._Scorer, "run", remember)
    monkeypatch.setattr(executor, "ProcessPoolExecutor", Counted)
    rep = score(run_dir, ScoreOptions(workers=30, metrics=("isoscore",)))
    assert started == [3]  # 3 shards: 3 processes, not 30
    assert rep["params"]["workers"] == 30
    # the memory plan (2 results in flight per process) and the threads count the 3, not the 30
    assert planned == {"threads": max(1, resources.usable_cores() // 3), "in_flight": 6}


# ------------------------------------------------------------------------------ 6. --memory-mb
@pytest.mark.parametrize("value", ["1e308", "inf", "2e12"])
def test_memory_budget_beyond_any_machine_is_refused(cli, run_dir, no_work, value):
    code, out, err = cli(["score", run_dir, "--memory-mb", value, "-q"])
    assert_one_line_error(code, out, err, "--memory-mb must be in (0, 2^40] MiB", exit_code=2)


def test_the_library_bounds_the_memory_budget(run_dir):
    from geomscope.score import score

    with pytest.raises(InputError, match="--memory-mb"):
        score(run_dir, ScoreOptions(memory_mb=1e308, metrics=("isoscore",)))


# ------------------------------------------------------------------------------ 7. names from data
def _assert_inert(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, repr(text)
    assert "\\x1b[2J" in text and "\\x07" in text  # shown, as escapes


def test_report_table_shows_names_as_text():
    from rich.console import Console

    from geomscope.report import report_table

    rep = {
        "source": {"path": "p"},
        "model": {"name": HOSTILE, "revision": HOSTILE},
        "params": {"metrics": ["isoscore"]},
        "layers": [{"layer": HOSTILE, "index": 0, "n_rows": 10, "isoscore": 0.5, "se": {"isoscore": 0.01}}],
    }
    buf = io.StringIO()
    Console(file=buf, width=400, color_system=None).print(report_table(rep))
    text = buf.getvalue()
    _assert_inert(text)
    assert "[bold red]y[/]" in text  # the markup as text, not applied
    assert text.count("owned") == 3  # the title (model and revision; wrapped) and the layer's row


@pytest.fixture(scope="module")
def crafted_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("crafted") / "run"
    # the layer: markup only (a manifest may refuse control characters in layer names)
    make_run(run, n_shards=2, rows=150, model_name=HOSTILE, layers=("x[bold red]z", "layer_01"))
    return run


def test_score_prints_a_crafted_run_as_text(cli, crafted_run):
    code, out, err = cli(["score", crafted_run, "--metrics", "isoscore"])
    assert code == 0, err
    _assert_inert(err)
    assert "x[bold red]z" in err


def test_inspect_prints_a_crafted_run_as_text(cli, crafted_run):
    code, out, err = cli(["inspect", crafted_run])
    assert code == 0, err
    _assert_inert(out)
    assert "[bold red]y[/]" in out and "x[bold red]z" in out


def test_shown_escapes_every_control_character():
    from geomscope.formatting import shown

    assert shown("a\x00b\x9bc\u202ed\n", markup=False) == "a\\x00b\\x9bc\\u202ed\\x0a"
    assert shown("[b]x[/b]") == "\\[b]x\\[/b]"
    assert shown("plain layer_01/é") == "plain layer_01/é"


# ------------------------------------------------------------------------------ 8. empty selections
@pytest.mark.parametrize("args", [["--layers=,"], ["--layers", " "], ["--layers", ""], ["-l", ",,"]])
def test_an_empty_layers_is_refused_not_read_as_every_layer(cli, run_dir, tmp_path, no_work, args):
    code, out, err = cli(["score", run_dir, "-q", "--metrics", "isoscore", "--out", tmp_path / "o", *args])
    assert_one_line_error(code, out, err, "--layers is empty", exit_code=2)


def test_an_empty_column_is_refused(cli, tmp_path, no_work):
    np.savez(tmp_path / "x.npz", a=np.random.default_rng(0).normal(size=(50, 4)))
    code, out, err = cli(["score", tmp_path / "x.npz", "-q", "--column", ",", "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, "--column is empty", exit_code=2)


# ------------------------------------------------------------------------------ 9. --columns before the work
@pytest.mark.parametrize(
    "extra, columns, said",
    [
        ([], "isoscroe", "--columns 'isoscroe' has no values"),  # a typo
        (["--metrics", "isoscore"], "pr", "--columns 'pr' has no values"),  # a metric not computed
        (["--avgcos-variants", "plain"], "avgcos_centred", "'avgcos_centred' has no values"),
        ([], "all,pr", "--columns 'all' has no values"),  # all stands alone
        ([], ",", "--columns is empty"),
    ],
)
@pytest.mark.parametrize("quiet", [True, False])
def test_columns_are_checked_before_the_work(cli, run_dir, tmp_path, no_work, extra, columns, said, quiet):
    # refused before the pass, with or without -q (no_work: nothing is computed)
    args = ["score", run_dir, "--out", tmp_path / "o", "--columns", columns, *extra]
    code, out, err = cli(args + (["-q"] if quiet else []))
    assert_one_line_error(code, out, err, said, exit_code=2)
    assert not (tmp_path / "o.json").exists()


def test_columns_that_the_options_compute_are_shown(cli, run_dir, tmp_path):
    code, out, err = cli(
        ["score", run_dir, "--metrics", "isoscore,spectrum", "--columns", "pr,erank", "-o", tmp_path / "o"]
    )
    assert code == 0, err
    assert "PR" in err and "erank" in err


# ------------------------------------------------------------------------------ 10. --seed, --id-repeats
def test_a_seed_beyond_64_bits_is_refused(cli, run_dir, tmp_path, no_work):
    from geomscope.choices import MAX_SEED
    from geomscope.score.options import MAX_SEED as LIBRARY_MAX_SEED

    assert MAX_SEED == LIBRARY_MAX_SEED == 2**64 - 1  # one bound, for the CLI and the library
    code, out, err = cli(["score", run_dir, "-q", "--seed", str(2**64), "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, "--seed", "2^64 - 1", exit_code=2)
    code, out, err = cli(["score", "--help"])
    assert "0 <= N < 2^64" in out and "18446744073709551615" not in out


@pytest.mark.parametrize("repeats, most", [("99999999999999", "1666"), ("2000", "1666")])
def test_more_id_repeats_than_the_sample_fills_are_refused_before_the_work(
    cli, run_dir, tmp_path, no_work, repeats, most
):
    # 10^14 parts ended, after the whole pass, in "out of memory"
    code, out, err = cli(["score", run_dir, "-q", "--id-repeats", repeats, "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, f"--id-repeats {repeats}", f"give at most {most}", exit_code=2)


def test_the_float32_products_help_does_not_promise_1e_8_for_every_metric(cli):
    code, out, err = cli(["score", "--help"])
    text = " ".join(out.split())
    assert "the metrics from it" not in text
    assert "more in metrics near 0 such as IsoScore" in text
