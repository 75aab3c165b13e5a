"""geomscope.report: paths, JSON/CSV round trip, atomic replacement, loading errors, the rich table
(its notes wrap on words, each value rounded to its SE, as in the HTML table); a damaged report is
one line for `report` and `plot` alike."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest
from conftest import assert_one_line_error

from geomscope.errors import InputError
from geomscope.report import (
    load_report,
    report_paths,
    report_table,
    save_report,
    to_csv,
)
from geomscope.schema import LAYER_KEYS
from geomscope.schema import SCALAR_METRIC_NAMES as CSV_METRICS


def _report(n_layers=2, extra_id=False):
    layers = []
    for i in range(n_layers):
        e = dict.fromkeys(LAYER_KEYS)
        e.update(
            layer=f"layer_{i:02d}",
            index=i,
            n_rows=100 + i,
            isoscore=0.1 * (i + 1),
            avgcos=np.float64(0.5),
            pr=float("nan"),
            outliers=[3, 7],
            se={"isoscore": 0.01, "avgcos": 0.002},
            eigenvalues=np.array([2.0, 1.0]),
            outlier_statistic=[],
            outlier_support=[],
            flags=[],
            notes={"pr": "undefined"},
            dropped={"nonfinite": 0, "special": 0, "not_sampled": 0},
        )
        if extra_id:
            e["id_mle"] = 7.5
            e["se"]["id_mle"] = 0.3
        layers.append(e)
    return {
        "format": "geomscope-report",
        "format_version": 1,
        "geomscope_version": "0.1.0",
        "created": "now",
        "source": {"kind": "run", "path": "/x", "dataset": None},
        "model": {"name": "m", "revision": "step1000", "commit": None, "hidden_size": 2},
        "run": None,
        "params": {"metrics": ["isoscore", "avgcos"], "uncertainty": {"moments": "jackknife"}},
        "layers": layers,
        "embeddings": None,
        "notes": {},
    }


def test_paths(tmp_path):
    assert report_paths(tmp_path) == (tmp_path / "report.json", tmp_path / "report.csv")
    assert report_paths(str(tmp_path / "new") + "/") == (
        tmp_path / "new" / "report.json",
        tmp_path / "new" / "report.csv",
    )
    assert report_paths(tmp_path / "a" / "pre") == (tmp_path / "a" / "pre.json", tmp_path / "a" / "pre.csv")
    assert report_paths(tmp_path / "r.json") == (tmp_path / "r.json", tmp_path / "r.csv")


def test_round_trip_and_nan_to_null(tmp_path):
    j, c = save_report(_report(), tmp_path / "sub" / "pre")
    assert j.exists() and c.exists() and not list((tmp_path / "sub").glob(".*.tmp"))
    rep = load_report(j)
    assert rep["layers"][0]["pr"] is None  # NaN is written as null, never as an invalid JSON token
    assert rep["layers"][0]["eigenvalues"] == [2.0, 1.0] and rep["layers"][1]["avgcos"] == 0.5
    assert load_report(tmp_path / "sub" / "pre.json") == rep
    save_report(_report(), tmp_path)
    assert load_report(tmp_path)["model"]["revision"] == "step1000"  # a directory reads its report.json


def test_csv_columns_and_cells(tmp_path):
    rows = list(csv.reader(to_csv(_report(extra_id=True)).splitlines()))
    metrics = [*CSV_METRICS, "id_mle"]
    assert rows[0] == ["layer", "index", "n_rows", *metrics, "outliers", *[f"se_{m}" for m in metrics]]
    r = dict(zip(rows[0], rows[1], strict=True))
    assert r["layer"] == "layer_00" and r["n_rows"] == "100" and float(r["isoscore"]) == 0.1
    assert r["pr"] == "" and r["outliers"] == "3 7" and float(r["se_avgcos"]) == 0.002
    assert float(r["id_mle"]) == 7.5 and float(r["se_id_mle"]) == 0.3 and r["se_pr"] == ""


def test_failed_save_keeps_old_report(tmp_path):
    save_report(_report(), tmp_path)
    before = (tmp_path / "report.json").read_text()
    bad = _report()
    bad["layers"][0]["isoscore"] = object()  # not serialisable: fails before anything is replaced
    with pytest.raises(TypeError):
        save_report(bad, tmp_path)
    assert (tmp_path / "report.json").read_text() == before


def test_load_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_report(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_report(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something"}))
    with pytest.raises(InputError, match="not a geomscope report"):
        load_report(tmp_path / "other.json")
    future = _report()
    future["format_version"] = 2
    (tmp_path / "future.json").write_text(json.dumps(future, default=lambda o: None))
    with pytest.raises(InputError, match="format_version 2"):
        load_report(tmp_path / "future.json")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        save_report(_report(), tmp_path / "file" / "pre")


def test_table(tmp_path):
    from rich.console import Console

    rep = json.loads(json.dumps(_report(), default=lambda o: o.tolist() if hasattr(o, "tolist") else None))
    for e in rep["layers"]:
        e["pr"] = None if isinstance(e["pr"], float) and math.isnan(e["pr"]) else e["pr"]
    t = report_table(rep)
    assert t.row_count == 2
    headers = [c.header for c in t.columns]
    assert headers[:2] == ["layer", "rows"] and "IsoScore" in headers and "cos" in headers
    assert "PR" not in headers  # a metric that is null everywhere gets no column
    con = Console(record=True, width=120)
    con.print(t)
    text = con.export_text()
    assert "m@step1000" in text and "±0.01" in text and "3 7" in text


def test_terminal_table_fits_80_columns_and_names_what_is_hidden():
    from rich.console import Console

    from geomscope.schema import LAYER_KEYS, SCALAR_METRIC_NAMES

    layers = []
    for i in range(12):
        e = dict.fromkeys(LAYER_KEYS)
        e.update(
            layer=f"layer_{i:02d}",
            index=i,
            n_rows=123456,
            se={m: 0.00123 for m in SCALAR_METRIC_NAMES},
            outliers=[1, 2, 3, 4, 5, 6, 7, 8],
            notes={},
            flags=[],
        )
        e.update({m: 0.123456 + i for m in SCALAR_METRIC_NAMES})
        layers.append(e)
    rep = {**_report(), "layers": layers}
    c = Console(width=80, record=True, force_terminal=False)
    c.print(report_table(rep))
    text = c.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert all(f"layer_{i:02d}" in text for i in range(12))
    header = next(ln for ln in text.splitlines() if "IsoScore*" in ln)
    assert "TwoNN" in header and "top10" not in header
    assert "--columns all" in text and "top10_share" in text  # the caption names what is hidden
    wide = Console(width=250, record=True, force_terminal=False)
    wide.print(report_table(rep, ["all"]))
    assert "top10" in next(ln for ln in wide.export_text().splitlines() if "IsoScore*" in ln)
    with pytest.raises(InputError, match="--columns 'nope'"):
        report_table(rep, ["nope"])


def test_report_shapes_score_writes_are_not_called_damaged():
    """Shapes a real report takes that a strict reading could refuse: a gradient layer without
    usable rows (null), an eigenvalue that overflowed (null), no format_version."""
    from geomscope.schema import report_defect

    assert report_defect({"layers": [], "gradient_energy": {"layers": {"layer_01.grad": None}}}) is None
    entry = {"layer": "layer_00", "index": 0, "eigenvalues": [3.0, None, 0.0], "isoscore": None}
    assert report_defect({"format_version": 1, "layers": [entry]}) is None
    assert report_defect({"format_version": 1, "layers": [{**entry, "eigenvalues": [3.0, -1.0]}]})


# ------------------------------------------------------------------ the table's notes; values with their SEs


def _report_with_long_notes() -> dict:
    layers = [
        {"layer": f"layer_{i:02d}", "index": i, "n_rows": 2000, "isoscore": 0.25 + i / 10, "se": {}}
        for i in range(3)
    ]
    return {
        "source": {"kind": "run", "path": "/tmp/run"},
        "model": {"name": "tiny"},
        "params": {
            "metrics": ["isoscore", "isoscore_star"],
            "zeta": 0.2,
            "target": "file:/data/targets/reference_covariance.npy",  # wider than the table
            "uncertainty": {"moments": "delete-one-group jackknife over 10 document groups (doc_id % G)"},
        },
        "layers": layers,
    }


@pytest.mark.parametrize("width", [60, 80, 120])
def test_score_table_notes_wrap_on_words(width):
    from rich.console import Console

    from geomscope.report import _caption, report_table

    rep = _report_with_long_notes()
    words = set(" ".join(_caption(rep)).split())
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(report_table(rep))
    lines = buf.getvalue().splitlines()
    bottom = max(i for i, ln in enumerate(lines) if ln.startswith("└"))
    shown_words = [w for ln in lines[bottom + 1 :] for w in ln.split()]
    assert shown_words and set(shown_words) <= words, lines[bottom + 1 :]
    assert max(map(len, lines)) <= width


def _report_with_ses() -> dict:
    rows = [(0.4123, 0.0157), (12.345, 1.2), (0.3, float("nan"))]
    layers = [
        {"layer": f"layer_{i:02d}", "index": i, "n_rows": 100, "isoscore": v, "se": {"isoscore": s}}
        for i, (v, s) in enumerate(rows)
    ]
    return {"source": {"path": "p"}, "params": {"metrics": ["isoscore"]}, "layers": layers}


def test_terminal_table_rounds_each_value_to_its_se():
    from rich.console import Console

    from geomscope.report import report_table

    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(report_table(_report_with_ses()))
    cells = buf.getvalue().replace("│", " ").split()
    assert "0.412" in cells and "±0.016" in cells and "12.3" in cells and "±1.2" in cells
    assert "±0.02" not in cells and "±1" not in cells and not any("nan" in c for c in cells)


def test_html_table_rounds_each_value_to_its_se():
    from geomscope.htmltable import report_table_html

    page = report_table_html(_report_with_ses())
    assert "0.412<br><span class='se'>±0.016</span>" in page
    assert "12.3<br><span class='se'>±1.2</span>" in page
    assert "±nan" not in page and "0.4123" not in page and "0.0157" not in page
    assert "<td>0.3</td>" in page  # a NaN SE: the value alone


# ------------------------------------------------------------------ a damaged report


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


def test_a_megabyte_name_is_shown_cut_in_tables_pages_and_figures(tmp_path):
    """A report whose model name, revision, dataset and first layer name are 1 MB each: the page and
    every figure are made at the speed of a real report's (matplotlib lays a 1 MB legend out in over
    a minute; the page would be 109 MB), each name shown cut to SHOWN_NAME_CHARS around an ellipsis."""
    import subprocess
    import sys

    from test_plot_factory import make_report

    from geomscope.formatting import SHOWN_NAME_CHARS, shown_name
    from geomscope.report import report_table

    huge = {k: k[0].upper() * 1_000_000 for k in ("model", "revision", "dataset", "layer")}
    rep = make_report(name=huge["model"], revision=huge["revision"], n_layers=3, hidden=16)
    rep["source"]["dataset"] = huge["dataset"]
    rep["layers"][0]["layer"] = huge["layer"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    for args in (
        ["report", path, "--html", tmp_path / "p.html"],
        ["plot", path, "--out", f"{tmp_path}/figs/"],
    ):
        try:  # (a subprocess: the uncut names took minutes)
            r = subprocess.run(
                [sys.executable, "-m", "geomscope", *map(str, args), "-q"], capture_output=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"geomscope {args[0]} of a report with 1 MB names ran over 60 s")
        assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "p.html").read_text()
    assert len(page) < 2_000_000
    for name in huge.values():
        assert shown_name(name) in page and name[: SHOWN_NAME_CHARS + 1] not in page
    title = report_table(rep).title
    assert shown_name(huge["model"]) in title and len(title) < 3 * SHOWN_NAME_CHARS
