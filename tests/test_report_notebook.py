"""Reports in notebooks and pandas: load_report, to_frame, _repr_html_, plotting into a user's Axes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_plot_factory import make_report, pythia_reports, write_report

import geomscope
from geomscope.report import Report, to_csv

SMALL = {"n_layers": 4, "hidden": 24}


def test_load_report_is_a_dict_with_a_frame(tmp_path):
    pd = pytest.importorskip("pandas")
    rep = make_report(**SMALL, null_twonn_layer=2)
    path = write_report(tmp_path / "r.json", rep)
    got = geomscope.load_report(path)
    assert isinstance(got, Report) and isinstance(got, dict) and got["layers"] == rep["layers"]
    wide = got.to_frame()
    assert list(wide["layer"]) == [e["layer"] for e in rep["layers"]]
    assert wide.loc[1, "isoscore_star"] == rep["layers"][1]["isoscore_star"]
    assert wide.loc[1, "se_isoscore_star"] == rep["layers"][1]["se"]["isoscore_star"]
    assert pd.isna(wide.loc[2, "twonn"])
    # the frame holds exactly what the CSV holds
    from io import StringIO

    csv = pd.read_csv(StringIO(to_csv(rep)))
    assert list(csv.columns) == list(wide.columns)
    num = [c for c in wide.columns if c not in ("layer", "outliers")]
    np.testing.assert_allclose(csv[num].to_numpy(float), wide[num].to_numpy(float), equal_nan=True)
    long = got.to_frame(long=True)
    assert list(long.columns) == ["layer", "index", "n_rows", "metric", "value", "se"]
    row = long[(long.layer == rep["layers"][0]["layer"]) & (long.metric == "avgcos")].iloc[0]
    assert row.value == rep["layers"][0]["avgcos"] and row.se == rep["layers"][0]["se"]["avgcos"]
    assert len(long) == len(rep["layers"]) * long.metric.nunique()


def test_to_frame_without_pandas_says_how_to_get_it(tmp_path, monkeypatch):
    """pandas is not one of geomscope's dependencies: a frame asked for without it is one line."""
    from geomscope.errors import InputError

    got = geomscope.load_report(write_report(tmp_path / "r.json", make_report(**SMALL)))
    monkeypatch.setitem(__import__("sys").modules, "pandas", None)  # import pandas -> ImportError
    with pytest.raises(InputError, match="pip install pandas"):
        got.to_frame()


def test_repr_html_is_the_layer_table(tmp_path):
    rep = geomscope.load_report(write_report(tmp_path / "r.json", make_report(**SMALL)))
    page = rep._repr_html_()
    assert page.startswith("<table") and page.count("<tr>") == 1 + len(rep["layers"])
    assert "IsoScore*" in page and "±" in page


def test_plotting_into_the_callers_axes():
    from matplotlib.figure import Figure

    from geomscope.errors import InputError
    from geomscope.plot import plot_layers, plot_outliers, plot_spectrum, plot_trajectory

    reps = [make_report(**SMALL)]
    fig = Figure()
    axes = fig.subplots(1, 4)
    assert plot_layers(reps, ["isoscore_star", "avgcos"], ax=axes[:2]) is fig
    assert axes[0].get_title().startswith("IsoScore*") and axes[0].lines
    assert plot_spectrum(reps, ax=axes[2]) is fig and axes[2].get_yscale() == "log"
    assert plot_outliers(reps, ax=axes[3]) is fig and axes[3].images
    assert fig._suptitle is None  # the caller's figure keeps its own title
    traj = pythia_reports(steps=(0, 1000, 7000), **SMALL)
    fig2 = Figure()
    ax = fig2.subplots()
    assert plot_trajectory(traj, ["isoscore_star"], ax=ax) is fig2 and len(ax.lines) == SMALL["n_layers"]
    with pytest.raises(InputError, match="2 panel"):
        plot_layers(reps, ["isoscore_star", "avgcos"], ax=ax)


def test_report_object_survives_plot_and_json(tmp_path):
    """A Report is still a plain dict to everything that takes one."""
    from geomscope.plot import make_figures
    from geomscope.report import to_json

    rep = geomscope.load_report(write_report(tmp_path / "r.json", make_report(**SMALL)))
    assert json.loads(to_json(rep))["layers"] == rep["layers"]
    assert set(make_figures([rep])) == {"layers", "spectrum", "outliers"}
