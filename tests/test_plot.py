"""Library tests of geomscope.plot: the figures' content, read through matplotlib objects."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.image import AxesImage
from test_plot_factory import make_report, pythia_reports, write_report

from geomscope.errors import InputError
from geomscope.plot import (
    auto_kinds,
    available_metrics,
    make_figures,
    outlier_matrix,
    parse_step,
    plot_layers,
    plot_outliers,
    plot_spectrum,
    plot_trajectory,
    read_report,
    report_labels,
    save_figure,
)

SMALL = {"n_layers": 5, "hidden": 48}


def _panels(fig):
    """Visible data axes (not colorbars), in grid order."""
    return [a for a in fig.axes if a.get_visible() and not hasattr(a, "_colorbar")]


def _colorbars(fig):
    return [a for a in fig.axes if hasattr(a, "_colorbar")]


# ---------------------------------------------------------------- reading reports


def test_read_report_roundtrip(tmp_path):
    rep = make_report(**SMALL)
    got = read_report(write_report(tmp_path / "r.json", rep))
    assert got["layers"] == rep["layers"] and got["_path"] == str(tmp_path / "r.json")


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"format": "something-else", "layers": []}), "not a geomscope report"),
        (json.dumps([1, 2, 3]), "not a geomscope report"),
        (json.dumps({"format": "geomscope-report", "layers": []}), "without layers"),
        (json.dumps({"format": "geomscope-report", "layers": [{"index": 0}]}), 'no "layer" name'),
    ],
)
def test_read_report_rejects_bad_files(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(InputError, match=match):
        read_report(p)


def test_read_report_missing_and_directory(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_report(tmp_path / "nope.json")
    with pytest.raises(InputError, match="not found"):
        read_report(tmp_path)  # a directory without report.json
    write_report(tmp_path / "report.json", make_report(**SMALL))  # `geomscope score --out DIR/` layout
    assert read_report(tmp_path)["layers"][0]["layer"] == "layer_00"


def test_read_report_refuses_newer_format(tmp_path):
    rep = make_report(**SMALL)
    rep["format_version"] = 2
    with pytest.raises(InputError, match="format_version 2"):
        read_report(write_report(tmp_path / "r.json", rep))


@pytest.mark.parametrize(
    "revision, extra, step",
    [
        ("step0", {}, 0),
        ("step143000", {}, 143000),
        ("STEP_7000", {}, 7000),
        ("checkpoint-500", {}, 500),
        ("main", {}, None),
        (None, {"step": 42}, 42),
        ("main", {"step": 3}, 3),
        (None, {}, None),
        (None, {"step": True}, None),
        (None, {"step": -1}, None),
    ],
)
def test_parse_step(revision, extra, step):
    rep = make_report(revision=revision, **SMALL)
    rep.update(extra)
    assert parse_step(rep) == step


def test_step_from_model_or_run_key():
    rep = make_report(**SMALL)
    rep["run"]["step"] = 250
    assert parse_step(rep) == 250
    rep["model"]["step"] = 300
    assert parse_step(rep) == 300


def test_labels_model_revision_and_disambiguation():
    a = make_report(revision="step1000", **SMALL)
    b = make_report(name=None, **SMALL)
    assert report_labels([a, b]) == ["sentence-transformers/all-MiniLM-L6-v2@step1000", "0"]
    c, d = make_report(dataset="wiki", **SMALL), make_report(dataset="news", **SMALL)
    assert report_labels([c, d]) == [
        "sentence-transformers/all-MiniLM-L6-v2 [wiki]",
        "sentence-transformers/all-MiniLM-L6-v2 [news]",
    ]
    e, f = make_report(dataset=None, **SMALL), make_report(dataset=None, **SMALL)
    assert report_labels([e, f])[0].endswith("(1)") and report_labels([e, f])[1].endswith("(2)")


def test_available_metrics_skips_counts_and_nulls():
    rep = make_report(**SMALL)
    for lay in rep["layers"]:
        lay["twonn"] = None
    avail = available_metrics([rep])
    assert "twonn" not in avail and "n_rows" not in avail and "twonn_n_used" not in avail
    assert {"isoscore", "isoscore_star", "avgcos", "avgcos_centred", "pr", "erank", "top5_share"} <= set(
        avail
    )


# ---------------------------------------------------------------- metric against layer


def test_layers_one_line_per_report_with_errorbars():
    a = make_report(**SMALL)
    b = make_report(name="EleutherAI/pythia-70m", revision="step1000", seed=4, **SMALL)
    fig = plot_layers([a, b])
    axes = _panels(fig)
    assert len(axes) == 4  # default metrics: isoscore_star, isoscore, avgcos, twonn
    titles = [ax.get_title() for ax in axes]
    assert titles[0] == "IsoScore* (ζ=0.2, target=trace)" and titles[1] == "IsoScore"
    assert titles[2] == "avg cosine (plain)" and titles[3].startswith("TwoNN intrinsic dimension")
    assert "discard 10%" in titles[3] and "sample 2000" in titles[3]
    for ax in axes:
        assert len(ax.get_lines()) == 2
        conts = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(conts) == 2 and all(c.has_yerr for c in conts)
        assert ax.get_xlabel() == "layer index" and ax.get_ylabel()
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [
        "sentence-transformers/all-MiniLM-L6-v2",
        "EleutherAI/pythia-70m@step1000",
    ]
    # the data: x = layer index, y = the report's values, bars = ±se
    line = axes[0].get_lines()[1]
    np.testing.assert_array_equal(line.get_xdata(), np.arange(5))
    np.testing.assert_allclose(line.get_ydata(), [lay["isoscore_star"] for lay in b["layers"]])
    bars = [c for c in axes[2].containers if isinstance(c, ErrorbarContainer)][0].lines[2][0]
    seg = bars.get_segments()[3]
    assert seg[1][1] - seg[0][1] == pytest.approx(2 * a["layers"][3]["se"]["avgcos"])
    assert "jackknife" in fig.get_supxlabel()


def test_layers_metrics_choice_and_null_values():
    a = make_report(null_twonn_layer=2, **SMALL)
    fig = plot_layers([a], ["avgcos_centred", "twonn", "top5_share"])
    axes = _panels(fig)
    assert [ax.get_title() for ax in axes][0] == "avg cosine (centred)"
    assert axes[2].get_title() == "top-5 variance share"
    y = axes[1].get_lines()[0].get_ydata()
    assert np.isnan(y[2]) and np.isfinite(np.delete(y, 2)).all()


def test_layers_titles_follow_the_estimator_params():
    a = make_report(**SMALL)
    a["params"]["twonn_fit"] = "mle"
    a["params"]["uncertainty"]["id_mle"] = "decimation into 5 parts"
    for lay in a["layers"]:
        lay["id_mle"], lay["se"]["id_mle"] = 12.0, 0.5
        lay["dropped"] = {"nonfinite": 0, "special": 3, "not_sampled": 0}
    assert "dropped" not in available_metrics([a]) and "id_mle" in available_metrics([a])
    fig = plot_layers([a], ["twonn", "id_mle"])
    axes = _panels(fig)
    assert axes[0].get_title() == "TwoNN intrinsic dimension\n(MLE, sample 2000)"
    assert axes[1].get_title() == "mle intrinsic dimension (sample 2000)"
    assert "mle intrinsic dimension: decimation into 5 parts" in fig.get_supxlabel()
    assert "moment metrics" not in fig.get_supxlabel()


def test_layers_without_se_draws_no_errorbars():
    a = make_report(**SMALL)
    for lay in a["layers"]:
        lay["se"] = {}
    fig = plot_layers([a], ["isoscore"])
    (cont,) = [c for c in _panels(fig)[0].containers if isinstance(c, ErrorbarContainer)]
    assert not cont.has_yerr


def test_layers_different_variants_go_into_the_legend():
    a, b = make_report(zeta=0.2, **SMALL), make_report(zeta=0.5, target="file:/data/c0.npy", seed=2, **SMALL)
    fig = plot_layers([a, b], ["isoscore_star", "isoscore"])
    ax = _panels(fig)[0]
    assert ax.get_title() == "IsoScore*"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "ζ=0.2, target=trace",
        "ζ=0.5, target=file:c0.npy",
    ]
    assert _panels(fig)[1].get_legend() is None


def test_unknown_metric_names_the_available():
    with pytest.raises(InputError, match=r"unknown metric 'isocore'.*available: .*isoscore_star"):
        plot_layers([make_report(**SMALL)], ["isocore"])


def test_metric_requested_but_not_scored():
    a = make_report(**SMALL)
    for lay in a["layers"]:
        lay["twonn"] = None
        lay["notes"]["twonn"] = "not requested (--metrics / --avgcos-variants)"
    with pytest.raises(InputError, match=r"metric 'twonn' has no values in these reports \(rescore"):
        plot_layers([a], ["twonn"])
    assert [ax.get_title() for ax in _panels(plot_layers([a]))] == [
        "IsoScore* (ζ=0.2, target=trace)",
        "IsoScore",
        "avg cosine (plain)",
    ]  # default skips it


def test_layers_caption_says_why_values_are_missing_and_flags():
    a = make_report(null_twonn_layer=2, **SMALL)
    a["layers"][0]["flags"] = ["rank_limited"]
    a["params"]["exclude_special"] = True
    cap = plot_layers([a], ["isoscore", "twonn"]).get_supxlabel().replace("\n", " ")
    assert "No value: twonn at layer_02 (fewer than 3 distinct rows after duplicate removal)" in cap
    assert "rank_limited (layer_00)" in cap and "duplicates (layer_02)" in cap
    assert "Special tokens excluded." in cap and "Rows per layer: 4,000–4,040." in cap


def test_reports_without_common_layer_are_refused():
    a, b = make_report(**SMALL), make_report(layer_prefix="block", seed=3, **SMALL)
    with pytest.raises(InputError, match="share no layer"):
        plot_layers([a, b])


def test_layer_selection_by_name_and_index():
    a = make_report(**SMALL)
    fig = plot_layers([a], ["isoscore"], layers=["layer_01", "3"])
    np.testing.assert_array_equal(_panels(fig)[0].get_lines()[0].get_xdata(), [1, 3])
    with pytest.raises(InputError, match="layer 'layer_99' is not in"):
        plot_layers([a], ["isoscore"], layers=["layer_99"])


# ---------------------------------------------------------------- eigenspectra


def test_spectrum_log_scale_one_curve_per_layer_and_colorbar():
    a = make_report(**SMALL)
    a["layers"][0]["eigenvalues"][-3:] = [0.0, 0.0, -1e-12]  # rank deficiency / rounding
    fig = plot_spectrum([a])
    (ax,) = _panels(fig)
    assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
    lines = ax.get_lines()
    assert len(lines) == 5 and [ln.get_label() for ln in lines] == [f"layer_{i:02d}" for i in range(5)]
    assert lines[0].get_xdata().size == 45  # non-positive eigenvalues dropped
    np.testing.assert_allclose(lines[2].get_ydata(), a["layers"][2]["eigenvalues"])
    np.testing.assert_array_equal(lines[2].get_xdata(), np.arange(1, 49))
    # colours follow depth: the colorbar's map of each layer index
    (cax,) = _colorbars(fig)
    cbar = cax._colorbar
    assert cbar.ax.get_ylabel() == "layer index (depth)"
    for i, ln in enumerate(lines):
        np.testing.assert_allclose(ln.get_color(), cbar.cmap(cbar.norm(i)))
    assert ax.get_xlabel() == "eigenvalue index" and "eigenvalue" in ax.get_ylabel()


def test_spectrum_numerical_zeros_run_off_the_axis():
    a = make_report(**SMALL)
    a["layers"][1]["eigenvalues"][-1] = 1e-17  # e.g. the direction LayerNorm removes
    fig = plot_spectrum([a])
    ax = _panels(fig)[0]
    assert ax.get_lines()[1].get_ydata()[-1] == 1e-17  # kept in the data ...
    low = min(min(v for v in lay["eigenvalues"] if v > 1e-10) for lay in a["layers"])
    assert ax.get_ylim()[0] == pytest.approx(low / 2)  # ... below the axis, and said so
    assert "numerical zeros" in fig.get_supxlabel()
    assert not plot_spectrum([make_report(**SMALL)]).get_supxlabel()


def test_spectrum_normalised_and_relative_depth():
    a = make_report(**SMALL)
    b = make_report(name="bert", n_layers=9, hidden=64, seed=1)
    fig = plot_spectrum([a, b], normalise=True, log_x=False)
    axes = _panels(fig)
    assert len(axes) == 2 and [len(ax.get_lines()) for ax in axes] == [5, 9]
    assert all(ax.get_yscale() == "log" and ax.get_xscale() == "linear" for ax in axes)
    y = axes[1].get_lines()[4].get_ydata()
    assert y.sum() == pytest.approx(1.0)
    assert axes[1].get_lines()[4].get_xdata()[-1] == pytest.approx(1.0)
    assert "relative depth" in _colorbars(fig)[0]._colorbar.ax.get_ylabel()


def test_spectrum_needs_eigenvalues():
    with pytest.raises(InputError, match="no eigenvalues.*spectrum"):
        plot_spectrum([make_report(spectrum=False, **SMALL)])


# ---------------------------------------------------------------- outlier dimensions


@pytest.mark.parametrize("top_k", [0, -3, 2.5])
def test_outlier_top_k_meets_the_plot_option_rule(top_k):
    """A library call's --top-k is refused in the words of PlotOptions' declaration."""
    with pytest.raises(InputError) as e:
        plot_outliers([make_report(n_layers=2, hidden=8)], top_k=top_k)
    assert str(e.value) == f"--top-k must be a positive whole number, not {top_k!r}"


def test_outlier_heatmap_shape_topk_and_marks():
    a = make_report(n_layers=6, hidden=96)
    fig = plot_outliers([a], top_k=20)
    (ax,) = _panels(fig)
    (im,) = [c for c in ax.get_children() if isinstance(c, AxesImage)]
    assert im.get_array().shape == (6, 20)
    assert ax.get_title().endswith("top 20 of 96 dimensions by statistic")
    stat, names, dims, flagged = outlier_matrix(a, 20)
    assert names == [f"layer_{i:02d}" for i in range(6)]
    all_flagged = {d for lay in a["layers"] for d in lay["outliers"]}
    assert all_flagged and all_flagged <= set(dims.tolist())  # flagged dims always shown
    assert list(dims) == sorted(dims)
    # the dots sit exactly on the flagged (layer, dim) cells
    offsets = {(int(x), int(y)) for x, y in ax.collections[0].get_offsets()}
    expected = {
        (int(np.nonzero(dims == d)[0][0]), r) for r, lay in enumerate(a["layers"]) for d in lay["outliers"]
    }
    assert offsets == expected and flagged.sum() == len(expected)
    # default colouring: statistic relative to its layer's mean over all D dimensions
    full = np.asarray(a["layers"][3]["outlier_statistic"])
    np.testing.assert_allclose(im.get_array()[3], full[dims] / full.mean())
    cax = _colorbars(fig)[0]
    assert "variance / layer mean" in cax.get_ylabel() and "rule=variance, threshold=5" in cax.get_ylabel()
    assert [ln.get_ydata()[0] for ln in cax.get_lines()] == [5.0, 5.0]  # the rule's k on the colorbar
    np.testing.assert_allclose(stat[3], full[dims])


def test_outlier_magnitude_rule_is_drawn_raw():
    a = make_report(n_layers=3, hidden=16)
    a["params"].update(outlier_rule="magnitude", outlier_threshold=6.0)
    for lay in a["layers"]:
        lay["outlier_statistic"] = [min(1.0, v / 10) for v in lay["outlier_statistic"]]
    fig = plot_outliers([a])
    im = [c for c in _panels(fig)[0].get_children() if isinstance(c, AxesImage)][0]
    np.testing.assert_allclose(im.get_array()[2], a["layers"][2]["outlier_statistic"])
    assert _colorbars(fig)[0].get_ylabel().startswith("fraction of tokens over threshold\n(rule=magnitude")


def test_outlier_heatmap_small_d_shows_all_dims_raw():
    a = make_report(n_layers=4, hidden=16)
    fig = plot_outliers([a, make_report(n_layers=3, hidden=16, seed=9)], top_k=40, relative=False)
    axes = _panels(fig)
    shapes = [[c for c in ax.get_children() if isinstance(c, AxesImage)][0].get_array().shape for ax in axes]
    assert shapes == [(4, 16), (3, 16)]
    assert axes[0].get_title().endswith("all 16 dimensions")
    norms = [[c for c in ax.get_children() if isinstance(c, AxesImage)][0].norm for ax in axes]
    assert (norms[0].vmin, norms[0].vmax) == (norms[1].vmin, norms[1].vmax)  # one scale: same rule
    im = [c for c in axes[0].get_children() if isinstance(c, AxesImage)][0]
    np.testing.assert_allclose(im.get_array()[1], a["layers"][1]["outlier_statistic"])


def test_outliers_need_the_statistic():
    with pytest.raises(InputError, match="no outlier_statistic"):
        plot_outliers([make_report(outliers=False, **SMALL)])


# ---------------------------------------------------------------- trajectories


def test_trajectory_x_is_the_parsed_steps():
    reps = pythia_reports(steps=(7000, 0, 143000, 1000), **SMALL)  # out of order on purpose
    fig = plot_trajectory(reps, ["isoscore_star", "avgcos"], log_x=False)
    axes = _panels(fig)
    assert len(axes) == 2
    for ax in axes:
        assert len(ax.get_lines()) == 5  # one per layer
        for ln in ax.get_lines():
            np.testing.assert_array_equal(ln.get_xdata(), [0, 1000, 7000, 143000])
        assert ax.get_xlabel() == "training step" and ax.get_xscale() == "linear"
    # values come from the report at that step
    by_step = {parse_step(r): r for r in reps}
    np.testing.assert_allclose(
        axes[1].get_lines()[2].get_ydata(),
        [by_step[s]["layers"][2]["avgcos"] for s in (0, 1000, 7000, 143000)],
    )
    assert [ln.get_label() for ln in axes[0].get_lines()] == [f"layer_{i:02d}" for i in range(5)]
    assert len(_colorbars(fig)) == 1 and len(axes[0].collections) == 5  # se bands
    assert "pythia-70m" in fig.get_suptitle()


def test_trajectory_log_x_keeps_step0():
    fig = plot_trajectory(pythia_reports(steps=(0, 1000, 143000), **SMALL), ["isoscore"], log_x=True)
    ax = _panels(fig)[0]
    assert ax.get_xscale() == "symlog"
    assert list(ax.get_xticks())[:2] == [0.0, 1000.0]
    fig2 = plot_trajectory(pythia_reports(steps=(10, 1000), **SMALL), ["isoscore"], log_x=True)
    assert _panels(fig2)[0].get_xscale() == "log"
    # default: log when the positive steps span two decades, else linear
    auto = plot_trajectory(pythia_reports(steps=(0, 1000, 143000), **SMALL), ["isoscore"])
    assert _panels(auto)[0].get_xscale() == "symlog" and "step 0–143k" in auto.get_suptitle()
    auto = plot_trajectory(pythia_reports(steps=(0, 1000, 5000), **SMALL), ["isoscore"])
    assert _panels(auto)[0].get_xscale() == "linear"


def test_trajectory_layers_subset_and_step_key():
    reps = [make_report(name="m", step_key=s, seed=s, **SMALL) for s in (0, 50, 100)]
    fig = plot_trajectory(reps, ["isoscore"], layers=["layer_00", "layer_04"])
    lines = _panels(fig)[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["layer_00", "layer_04"]
    np.testing.assert_array_equal(lines[0].get_xdata(), [0, 50, 100])


@pytest.mark.parametrize(
    "reps, match",
    [
        (
            lambda: [make_report(revision="step0", **SMALL), make_report(revision="main", **SMALL)],
            r"has no training step \(revision 'main'",
        ),
        (
            lambda: (
                pythia_reports(steps=(0, 5), **SMALL)
                + [make_report(name="EleutherAI/pythia-70m", revision="step5", **SMALL)]
            ),
            r"two reports are at step 5 \(of EleutherAI/pythia-70m\)",
        ),
        (lambda: pythia_reports(steps=(0, 0), **SMALL), "two reports are at step 0"),
        (
            lambda: [
                make_report(name="m", revision="step0", **SMALL),
                make_report(name="m", revision="step1", layer_prefix="blk", **SMALL),
            ],
            "share no layer",
        ),
    ],
)
def test_trajectory_bad_input(reps, match):
    with pytest.raises(InputError, match=match):
        plot_trajectory(reps(), ["isoscore"])


# ---------------------------------------------------------------- kinds and files


def test_auto_kinds():
    a = make_report(**SMALL)
    assert auto_kinds([a], single=True) == ["layers"]
    assert auto_kinds([a], single=False) == ["layers", "spectrum", "outliers"]
    assert auto_kinds([make_report(spectrum=False, outliers=False, **SMALL)], single=False) == ["layers"]
    reps = pythia_reports(steps=(0, 1000), **SMALL)
    assert auto_kinds(reps, single=True) == ["trajectory"]
    assert auto_kinds(reps, single=False) == ["layers", "spectrum", "outliers", "trajectory"]


def test_make_figures_one_file_takes_one_kind():
    a = make_report(**SMALL)
    with pytest.raises(InputError, match="one figure kind"):
        make_figures([a], ["layers", "spectrum"], single=True)
    with pytest.raises(InputError, match="unknown figure kind 'bars'"):
        make_figures([a], ["bars"])
    with pytest.raises(InputError, match="needs training logs"):
        make_figures([a], ["training"])


def test_figures_stay_out_of_pyplot():
    import matplotlib.pyplot as plt

    before, rc_before = plt.get_fignums(), dict(plt.rcParams)
    figs = make_figures(pythia_reports(steps=(0, 1000), **SMALL), ["auto"])
    assert set(figs) == {"layers", "spectrum", "outliers", "trajectory"}
    assert plt.get_fignums() == before and dict(plt.rcParams) == rc_before  # no global state touched
    assert all(ax.spines["top"].get_visible() is False for ax in _panels(figs["layers"]))  # our style
    assert all(type(f.canvas).__name__ == "FigureCanvasAgg" for f in figs.values())


@pytest.mark.parametrize("ext, magic", [("png", b"\x89PNG"), ("svg", b"<?xml"), ("pdf", b"%PDF")])
def test_save_figure_formats(tmp_path, ext, magic):
    fig = plot_layers([make_report(**SMALL)], ["isoscore"])
    out = save_figure(fig, tmp_path / f"f.{ext}", dpi=40)
    data = out.read_bytes()
    assert data.startswith(magic) and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == [f"f.{ext}"]  # no temporary left behind


def test_save_figure_rejects_extension(tmp_path):
    with pytest.raises(InputError, match=r"unsupported extension '\.jpg'"):
        save_figure(plot_layers([make_report(**SMALL)], ["isoscore"]), tmp_path / "f.jpg")
    assert not list(tmp_path.iterdir())
