"""score --metrics all on the bundled MiniLM reports every diagnostic family with its SEs, and the
figures and the HTML page show them: the diagnostics panels, the similarity heat maps, the table of
every scalar and the per-layer lists."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error
from helpers_runs import minilm_run

from geomscope.report import load_report
from geomscope.schema import diagnostic_keys

FAMILY_KEYS = {
    "abtt": "abtt5_avgcos",
    "whitened": "whitened_avgcos",
    "rogue": "rogue_top1_share",
    "massive": "massive_ratio",
    "similarity": "cka_prev",
    "stratified": "freq1_isoscore",
    "contextuality": "selfsim_adj",
    "local": "local_isoscore",
}


@pytest.fixture(scope="module")
def scored(tmp_path_factory, cli_module):
    root = tmp_path_factory.mktemp("diagnostics")
    run = minilm_run(root, sentences=24, layers="0,3,6")
    code, out, err = cli_module(
        [
            "score",
            str(run),
            "--metrics",
            "all",
            "--id-sample",
            "400",
            "--similarity-rows",
            "200",
            "--context-min",
            "3",
            "--clusters",
            "2",
            "--out",
            str(root / "report"),
            "-q",
        ]
    )
    assert code == 0, err
    return root


@pytest.fixture(scope="module")
def cli_module():
    from geomscope.cli import main

    def run(args):
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return code, out.getvalue(), err.getvalue()

    return run


def test_all_reports_every_family_with_ses(scored):
    rep = load_report(scored / "report.json")
    assert set(FAMILY_KEYS) <= set(rep["params"]["metrics"])
    last = rep["layers"][-1]
    for family, key in FAMILY_KEYS.items():
        assert isinstance(last[key], float), (family, last["notes"].get(key))
        if family != "massive":  # (a maximum has no SE, and says so)
            assert isinstance(last["se"][key], float), (family, last["notes"].get(f"se.{key}"))
    assert last["se"]["massive_ratio"] is None and "maximum" in last["notes"]["se.massive_ratio"]
    assert rep["similarity"]["cka"] and all(k in last for k in ("rogue_dims", "massive", "strata", "local"))
    header = (scored / "report.csv").read_text().splitlines()[0].split(",")
    assert all(k in header and f"se_{k}" in header for k in diagnostic_keys(rep["layers"]))


def test_figures_and_page(scored, cli_module, tmp_path):
    code, out, err = cli_module(["plot", str(scored / "report.json"), "--out", str(tmp_path) + "/"])
    assert code == 0, err
    assert {p.name for p in tmp_path.iterdir()} >= {"diagnostics.png", "similarity.png", "layers.png"}
    code, out, err = cli_module(["report", str(scored / "report.json"), "--html", str(tmp_path / "p.html")])
    page = (tmp_path / "p.html").read_text()
    assert code == 0, err
    for needle in ("fig-diagnostics", "fig-similarity", "Diagnostics by layer", "rogue1", "self-b", "CKA-1"):
        assert needle in page, needle
    # a hand-edited list the page cannot read is a dash, not a traceback
    rep = json.loads((scored / "report.json").read_text())
    rep["layers"][0]["local"] = {"k": 2, "clusters": []}
    rep["layers"][0]["rogue_dims"] = [{"dim": 1}]
    (tmp_path / "edited.json").write_text(json.dumps(rep))
    code, out, err = cli_module(["report", str(tmp_path / "edited.json"), "--html", str(tmp_path / "q.html")])
    assert code == 0, err


def test_diagnostics_figure_needs_them(scored, cli_module, tmp_path):
    rep = json.loads((scored / "report.json").read_text())
    for e in rep["layers"]:
        for k in diagnostic_keys(rep["layers"]):
            e.pop(k, None)
    (tmp_path / "plain.json").write_text(json.dumps(rep))
    code, out, err = cli_module(
        ["plot", str(tmp_path / "plain.json"), "--kind", "diagnostics", "--out", str(tmp_path / "d.png")]
    )
    assert_one_line_error(code, out, err, "no diagnostics")
