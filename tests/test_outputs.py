"""Outputs a user names replace only geomscope's own earlier output of that kind: a user's file, a link
or a directory at an output name is one `error:` line before anything is written, and stays as it was
(`score`'s report and trajectory, `plot`'s figures, `report --html`'s page; `compare`:
tests/test_study.py). Reruns over geomscope's own outputs still replace them. Links in a run
directory are never written through; an --out under a file or through a link to nothing is one
line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import assert_one_line_error, quiet_extract
from helpers_train import finetune_cosreg
from test_plot_factory import make_report, write_report

from geomscope.outputs import ensure_replaceable, json_format_is, starts_with

USER = b"my own notes, not geomscope's\n"


def _user_file(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(USER)
    return path


def _kept(path) -> bool:
    return path.read_bytes() == USER


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "emb.npy"
    np.save(path, np.random.default_rng(0).normal(size=(200, 8)))
    return path


def test_score_refuses_a_users_file_at_its_report_names(cli, rows, tmp_path):
    out = tmp_path / "r"
    assert cli(["score", rows, "--metrics", "avgcos", "--out", out, "--quiet"])[0] == 0
    assert cli(["score", rows, "--metrics", "avgcos", "--out", out, "--quiet"])[0] == 0  # rerun
    for name in ("r.json", "r.csv"):
        mine = _user_file(tmp_path / "mine" / name)
        other = mine.with_suffix(".csv" if name.endswith(".json") else ".json")
        code, o, e = cli(["score", rows, "--metrics", "avgcos", "--out", tmp_path / "mine" / "r", "--quiet"])
        assert_one_line_error(code, o, e, name, "geomscope did not write", exit_code=2)
        assert _kept(mine) and not other.exists()  # nothing written, not even the other half
        mine.unlink()
    # the default output beside the input
    mine = _user_file(tmp_path / "emb_report.csv")
    code, o, e = cli(["score", rows, "--metrics", "avgcos", "--quiet"])
    assert_one_line_error(code, o, e, "emb_report.csv", exit_code=2)
    assert _kept(mine) and not (tmp_path / "emb_report.json").exists()


def test_score_of_many_runs_refuses_a_users_trajectory_before_scoring(cli, tmp_path):
    from test_score import make_run

    runs = tmp_path / "runs"
    for name in ("a", "b"):
        make_run(runs / name, n_shards=1, rows=60)
    mine = _user_file(runs / "trajectory.csv")
    code, o, e = cli(["score", runs, "--metrics", "avgcos", "--quiet"])
    assert_one_line_error(code, o, e, "trajectory.csv", exit_code=2)
    assert _kept(mine)
    assert not list(runs.glob("*/report*")) and not list(runs.glob("*_report*"))  # nothing scored
    mine.unlink()
    assert cli(["score", runs, "--metrics", "avgcos", "--quiet"])[0] == 0
    assert cli(["score", runs, "--metrics", "avgcos", "--quiet"])[0] == 0  # its own trajectory: replaced


def test_plot_refuses_a_users_figure_and_writes_none(cli, tmp_path):
    rep = write_report(tmp_path / "r.json", make_report(n_layers=4, hidden=24))
    out = tmp_path / "figs"
    assert cli(["plot", rep, "--out", f"{out}/", "--quiet"])[0] == 0
    written = sorted(p.name for p in out.iterdir())
    assert len(written) >= 2
    assert cli(["plot", rep, "--out", f"{out}/", "--quiet"])[0] == 0  # its own figures: replaced
    shutil.rmtree(out)
    mine = _user_file(out / written[-1])
    code, o, e = cli(["plot", rep, "--out", f"{out}/", "--quiet"])
    assert_one_line_error(code, o, e, written[-1], "geomscope did not write", exit_code=2)
    assert _kept(mine) and sorted(p.name for p in out.iterdir()) == [written[-1]]  # none written
    one = _user_file(tmp_path / "one.svg")
    code, o, e = cli(["plot", rep, "--out", one, "--kind", "layers", "--quiet"])
    assert_one_line_error(code, o, e, "one.svg", exit_code=2)
    assert _kept(one)


def test_report_html_refuses_a_users_page(cli, tmp_path):
    rep = write_report(tmp_path / "r.json", make_report(n_layers=3, hidden=16))
    page = tmp_path / "page.html"
    assert cli(["report", rep, "--html", page])[0] == 0
    assert cli(["report", rep, "--html", page])[0] == 0  # its own page: replaced
    mine = _user_file(tmp_path / "mine.txt")
    code, o, e = cli(["report", rep, "--html", mine])
    assert_one_line_error(code, o, e, "mine.txt", "--html", exit_code=2)
    assert _kept(mine)
    (tmp_path / "adir").mkdir()
    code, o, e = cli(["report", rep, "--html", tmp_path / "adir"])
    assert_one_line_error(code, o, e, "adir is a directory", exit_code=2)


def test_a_link_at_an_output_name_is_refused_and_kept(tmp_path):
    target = _user_file(tmp_path / "target.json")
    link = tmp_path / "link.json"
    os.symlink(target, link)
    from geomscope.errors import InputError

    with pytest.raises(InputError, match="link.json exists and is a link"):
        ensure_replaceable(link, json_format_is("geomscope-report"))
    assert link.is_symlink() and _kept(target)


@pytest.mark.parametrize(
    "data, ours",
    [
        (b'{"format": "geomscope-report", "layers": []}', True),
        (b'{"format": "something-else"}', False),
        (b"[1, 2]", False),
        (b"{" * 100_000, False),  # not JSON: no crash
        (b"\xff\xfe", False),
    ],
)
def test_a_report_is_recognised_by_its_format(tmp_path, data, ours):
    from geomscope.errors import InputError

    path = tmp_path / "r.json"
    path.write_bytes(data)
    if ours:
        ensure_replaceable(path, json_format_is("geomscope-report"))
    else:
        with pytest.raises(InputError, match="geomscope did not write"):
            ensure_replaceable(path, json_format_is("geomscope-report"))
    ensure_replaceable(tmp_path / "absent.csv", starts_with(b"layer,"))  # nothing there: fine


def test_outputs_of_a_geomscope_from_before_the_marks(cli, tmp_path):
    """A page without the generator mark is still recognised (its report sections); a figure without
    a recorded creator cannot be told from a user's: refused, with the reason said."""
    from matplotlib.figure import Figure

    rep = write_report(tmp_path / "r.json", make_report(n_layers=3, hidden=16))
    page = tmp_path / "page.html"
    assert cli(["report", rep, "--html", page])[0] == 0
    old = page.read_text().replace("<meta name='generator' content='geomscope'>", "")
    page.write_text(old)
    assert cli(["report", rep, "--html", page])[0] == 0
    fig = Figure()
    fig.subplots().plot([1, 2], [3, 4])
    fig.savefig(tmp_path / "layers.png")  # Matplotlib's own metadata, as geomscope wrote before
    code, o, e = cli(["plot", rep, "--out", tmp_path / "layers.png", "--kind", "layers", "--quiet"])
    assert_one_line_error(code, o, e, "layers.png", "a figure of an older geomscope", exit_code=2)


def test_a_report_is_recognised_from_its_start_whatever_its_size(tmp_path, monkeypatch):
    import geomscope.outputs as outputs

    monkeypatch.setattr(outputs, "MAX_RECOGNISED_BYTES", 100)  # the report below is larger
    path = tmp_path / "r.json"
    path.write_text('{\n "format": "geomscope-report",\n "layers": [' + ", ".join(["1"] * 1000) + "]}")
    outputs.ensure_replaceable(path, json_format_is("geomscope-report"), head=outputs.HEAD_BYTES)


# ------------------------------------------------------------------ an --out that cannot be made


def test_an_out_through_a_link_to_nothing_says_so(cli, tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    src = tmp_path / "in.txt"
    src.write_text("a sentence\n")
    for out_dir in (tmp_path / "dangling", tmp_path / "dangling" / "sub"):
        code, out, err = cli(["extract", "bundled:minilm", src, "--out", out_dir, "-q"])
        assert_one_line_error(code, out, err, "dangling is a link to nothing", exit_code=2)


def test_links_in_a_run_directory_are_never_written_through(cli, tiny_bert, twelve_docs, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".geomscope.lock").symlink_to(outside)  # the lock would be opened (and truncated) through it
    code, out, err = quiet_extract(cli, tiny_bert, twelve_docs, run)
    assert_one_line_error(code, out, err, ".geomscope.lock is not a plain file", exit_code=2)
    assert outside.read_text() == "precious"
    (run / ".geomscope.lock").unlink()
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    (run / "report.json").symlink_to(outside)  # score's report would be written through it
    (run / "report.csv").symlink_to(outside)
    code, out, err = cli(["score", run, "--metrics", "isoscore", "--quiet"])  # refused, link kept
    assert_one_line_error(code, out, err, "report.json exists and is a link", exit_code=2)
    assert outside.read_text() == "precious" and (run / "report.json").is_symlink()
    (run / "report.json").unlink()
    (run / "report.csv").unlink()
    code, _, err = cli(["score", run, "--metrics", "isoscore", "--quiet"])
    assert code == 0, err
    assert json.loads((run / "report.json").read_text())["format"] == "geomscope-report"


def test_an_out_under_a_file_is_one_line(cli, tiny_bert, twelve_docs, tmp_path):
    """--out a/sub where a is a file: one line in extract and finetune, not a NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    code, out, err = quiet_extract(cli, tiny_bert, twelve_docs, afile / "sub")
    assert_one_line_error(code, out, err, "afile/sub", "Not a directory", exit_code=2)
    code, out, err = finetune_cosreg(cli, tmp_path, afile / "sub")
    assert_one_line_error(code, out, err, "afile/sub", "Not a directory", exit_code=2)
    assert afile.read_text() == "mine"
