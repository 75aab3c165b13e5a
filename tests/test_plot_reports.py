"""Figures that draw what the reports hold, and one error line for what they cannot draw: gradient
layers beside their activations, layers placed by name when indices disagree, trajectory.csv files
of several models or datasets, text from the reports drawn as itself (no mathtext), crafted reports
and logs, the page and --dpi guards. Each case would otherwise be a wrong figure or a traceback."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from conftest import assert_one_line_error
from matplotlib import cbook
from matplotlib.text import Text
from test_plot_energy import energy_report
from test_plot_factory import make_report, pythia_reports, write_report

from geomscope.choices import DPI_RANGE
from geomscope.errors import InputError
from geomscope.plot import make_figures, plot_layers, plot_spectrum, plot_trajectory
from geomscope.plot._reports import is_number
from geomscope.plot._style import plain_text
from geomscope.schema import report_defect

SMALL = {"n_layers": 4, "hidden": 24}
FAST = ["--dpi", "40"]


def _panels(fig):
    return [a for a in fig.axes if a.get_visible() and not hasattr(a, "_colorbar")]


def _with_gradients(rep: dict, scale: float = 0.5) -> dict:
    """``rep`` with a ``<layer>.grad`` entry per layer, at its activation's index (as extract
    --capture activations,gradients names and numbers them), with different metric values."""
    rep = copy.deepcopy(rep)
    grads = []
    for lay in rep["layers"]:
        g = copy.deepcopy(lay)
        g["layer"] = lay["layer"] + ".grad"
        g["isoscore"] = lay["isoscore"] * scale
        g["eigenvalues"] = [v * scale for v in lay["eigenvalues"]]
        grads.append(g)
    rep["layers"] += grads
    return rep


# ---------------------------------------------------------------- 1. gradient layers


def test_layers_draws_gradient_layers_as_their_own_dashed_series():
    rep = _with_gradients(make_report(**SMALL))
    fig = plot_layers([rep], ["isoscore"])
    (ax,) = _panels(fig)
    acts, grads = rep["layers"][:4], rep["layers"][4:]
    assert len(ax.containers) == 2  # not one line through both, zig-zagging at every index
    act_line, grad_line = (c.lines[0] for c in ax.containers)
    assert list(act_line.get_xdata()) == [0, 1, 2, 3] == list(grad_line.get_xdata())
    np.testing.assert_allclose(act_line.get_ydata(), [lay["isoscore"] for lay in acts])
    np.testing.assert_allclose(grad_line.get_ydata(), [lay["isoscore"] for lay in grads])
    assert act_line.get_linestyle() == "-" and grad_line.get_linestyle() == "--"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [
        "sentence-transformers/all-MiniLM-L6-v2",
        "sentence-transformers/all-MiniLM-L6-v2 (gradients)",
    ]


def test_trajectory_and_spectrum_dash_and_name_gradient_layers():
    reps = [_with_gradients(r) for r in pythia_reports(steps=(0, 1000), **SMALL)]
    fig = plot_trajectory(reps, ["isoscore"])
    ax = _panels(fig)[0]
    styles = {ln.get_label(): ln.get_linestyle() for ln in ax.get_lines()}
    assert styles["layer_01"] == "-" and styles["layer_01.grad"] == "--"
    grad = next(ln for ln in ax.get_lines() if ln.get_label() == "layer_01.grad")
    np.testing.assert_allclose(grad.get_ydata(), [r["layers"][5]["isoscore"] for r in reps])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["activations", "gradients (.grad)"]

    fig = plot_spectrum(reps[:1])
    ax = _panels(fig)[0]
    curves = {ln.get_label(): ln for ln in ax.get_lines()}
    assert curves["layer_02"].get_linestyle() == "-" and curves["layer_02.grad"].get_linestyle() == "--"
    np.testing.assert_allclose(curves["layer_02.grad"].get_ydata(), reps[0]["layers"][6]["eigenvalues"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["activations", "gradients (.grad)"]


# ---------------------------------------------------------------- 2. trajectory.csv of several


def _trajectory_csv(tmp_path, reps):
    from geomscope.score.trajectory import to_trajectory_csv

    path = tmp_path / "trajectory.csv"
    path.write_text(to_trajectory_csv(json.loads(json.dumps(reps))))  # as loaded: plain floats
    return path


def test_read_trajectory_of_two_models_and_a_repeated_checkpoint(tmp_path, cli):
    from geomscope.score.trajectory import read_trajectory

    one = pythia_reports(steps=(0, 1000), **SMALL)
    got = read_trajectory(_trajectory_csv(tmp_path, one))
    assert [r["step"] for r in got] == [0, 1000]
    assert [lay["isoscore"] for lay in got[1]["layers"]] == [lay["isoscore"] for lay in one[1]["layers"]]

    # model B at the same revisions: one report per (model, revision), drawn one colour per model
    other = [make_report(name="bert", revision=f"step{s}", seed=5 + s, **SMALL) for s in (0, 1000)]
    got = read_trajectory(_trajectory_csv(tmp_path, [*one, *other]))
    assert sorted((r["model"]["name"], r["step"]) for r in got) == [
        ("EleutherAI/pythia-70m", 0),
        ("EleutherAI/pythia-70m", 1000),
        ("bert", 0),
        ("bert", 1000),
    ]
    code, out, err = cli(["plot", tmp_path / "trajectory.csv", "--out", tmp_path / "t.png", "-q"])
    assert code == 0, err

    # one checkpoint scored on two datasets: the same (model, revision, layer) twice
    twice = make_report(name="EleutherAI/pythia-70m", revision="step0", dataset="news", seed=9, **SMALL)
    with pytest.raises(
        InputError, match="repeats layer 'layer_00' of EleutherAI/pythia-70m at revision 'step0'"
    ):
        read_trajectory(_trajectory_csv(tmp_path, [*one, twice]))


# ---------------------------------------------------------------- 3. indices that disagree


def _columns(rep: dict, names: list[str]) -> dict:
    """``rep`` as `score b.npz --column <names>` writes it: those layers, indexed by their position."""
    rep = copy.deepcopy(rep)
    by_name = {lay["layer"]: lay for lay in rep["layers"]}
    rep["layers"] = [{**by_name[n], "index": i} for i, n in enumerate(names)]
    return rep


def test_layers_are_placed_by_name_when_indices_disagree():
    full = make_report(name=None, n_layers=3, hidden=24)
    part = _columns(full, ["layer_02", "layer_00"])
    fig = plot_layers([full, part], ["isoscore"])
    ax = _panels(fig)[0]
    a, b = (c.lines[0] for c in ax.containers)
    x_of = {t.get_text(): t.get_position()[0] for t in ax.get_xticklabels()}
    assert list(x_of) == ["layer_00", "layer_01", "layer_02"] and ax.get_xlabel() == "layer"
    # each value at its layer's name, in both reports (not layer_02 of `part` at index 0)
    assert dict(zip(b.get_xdata(), b.get_ydata(), strict=True)) == {
        x_of["layer_00"]: full["layers"][0]["isoscore"],
        x_of["layer_02"]: full["layers"][2]["isoscore"],
    }
    np.testing.assert_allclose(a.get_ydata(), [lay["isoscore"] for lay in full["layers"]])
    assert list(a.get_xdata()) == [x_of[n] for n in ("layer_00", "layer_01", "layer_02")]


def test_one_index_for_two_layers_is_placed_by_name_and_agreeing_indices_stay():
    rep = make_report(n_layers=3, hidden=24)
    rep["layers"][2]["index"] = 1
    ax = _panels(plot_layers([rep], ["isoscore"]))[0]
    assert list(ax.containers[0].lines[0].get_xdata()) == [0, 1, 2]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["layer_00", "layer_01", "layer_02"]
    ax = _panels(plot_layers([make_report(n_layers=3, hidden=24)], ["isoscore"]))[0]
    assert ax.get_xlabel() == "layer index"


# ---------------------------------------------------------------- 4. crafted reports and logs


def _craft(case: str) -> dict:
    rep = make_report(n_layers=3, hidden=16)
    lay, params = rep["layers"][0], rep["params"]
    huge = 10**400
    edits = {
        "name_int": lambda: rep["model"].update(name=7),
        "name_list": lambda: rep["model"].update(name=["a", "b"]),
        "path_int": lambda: rep["source"].update(path=5),
        "zeta_text": lambda: params.update(zeta="abc"),
        "discard_text": lambda: params.update(discard_fraction="abc"),
        "threshold_text": lambda: params.update(outlier_threshold="five"),
        "threshold_huge": lambda: params.update(outlier_threshold=huge),
        "uncertainty_text": lambda: params.update(uncertainty="jackknife"),
        "rule_list": lambda: params.update(outlier_rule=["variance"]),
        "metric_huge": lambda: lay.update(isoscore=huge),
        "se_huge": lambda: lay["se"].update(isoscore=huge),
        "eig_huge": lambda: lay["eigenvalues"].__setitem__(0, huge),
        "stat_huge": lambda: lay["outlier_statistic"].__setitem__(0, huge),
        "rows_huge": lambda: lay.update(n_rows=huge),
        "index_huge": lambda: lay.update(index=huge),
    }
    edits[case]()
    return rep


CRAFTED = {
    "name_int": "model.name",
    "name_list": "model.name",
    "path_int": "source.path",
    "zeta_text": "params.zeta",
    "discard_text": "params.discard_fraction",
    "threshold_text": "params.outlier_threshold",
    "threshold_huge": "params.outlier_threshold",
    "uncertainty_text": "params.uncertainty",
    "rule_list": "params.outlier_rule",
    "metric_huge": "layers[0].isoscore",
    "se_huge": "layers[0].se",
    "eig_huge": "layers[0].eigenvalues",
    "stat_huge": "layers[0].outlier_statistic",
    "rows_huge": "layers[0].n_rows",
    "index_huge": "layers[0].index",
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_report_is_one_line_for_plot_and_report(cli, tmp_path, case):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_craft(case)))
    for args in (
        ["plot", path, "--out", f"{tmp_path}/figs/"],
        ["report", path, "--html", tmp_path / "p.html"],
    ):
        code, out, err = cli([*args, *(FAST if args[0] == "plot" else [])])
        assert_one_line_error(code, out, err, "r.json", "damaged", CRAFTED[case], exit_code=2)
    assert not (tmp_path / "p.html").exists() and not (tmp_path / "figs").exists()


def test_integers_beyond_float_range_are_not_numbers():
    big = 10**400
    assert not is_number(big) and not is_number(-big) and is_number(2**1000) and not is_number(True)
    entry = {"layer": "x", "index": 0, "foo": big}  # not a schema metric: not drawn, not refused
    assert report_defect({"layers": [entry]}) is None
    assert "foo" not in __import__("geomscope.plot", fromlist=["x"]).available_metrics([{"layers": [entry]}])


@pytest.mark.parametrize("value", [0.0, None])
def test_a_spectrum_with_no_positive_eigenvalue(cli, tmp_path, value):
    rep = make_report(**SMALL)
    for lay in rep["layers"]:
        lay["eigenvalues"] = [value] * 24
    path = write_report(tmp_path / "z.json", rep)
    code, out, err = cli(["plot", path, "--kind", "spectrum", "--out", tmp_path / "s.png", *FAST])
    assert_one_line_error(code, out, err, "z.json has no positive eigenvalue", exit_code=2)
    # auto leaves the spectrum out and draws the rest; the page likewise
    code, out, err = cli(["plot", path, "--out", f"{tmp_path}/figs/", "--json", *FAST])
    assert code == 0, err
    assert json.loads(out)["kinds"] == ["layers", "outliers"]
    code, out, err = cli(["report", path, "--html", tmp_path / "p.html", "-q"])
    assert code == 0, err


def _log(tmp_path, steps: list[dict], config: dict):
    run = tmp_path / "ft"
    run.mkdir(exist_ok=True)
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "run.json").write_text(json.dumps({"config": config}))
    return run


def test_training_log_with_a_text_zeta_or_a_non_ascii_rank(cli, tmp_path):
    good = [{"step": s, "task_loss": 1.0 / s, "penalty": 0.5, "isoscore_star": 0.4} for s in (1, 2, 3)]
    run = _log(tmp_path, good, {"reg": "istar", "lam": 0.1, "zeta": "x"})  # the legend's: left out
    code, out, err = cli(["plot", run, "--out", tmp_path / "t.png", *FAST])
    assert code == 0, err
    geometry = {"layer_1": {"energy": {"²": 0.1}, "isoscore_star": 0.3}}
    run = _log(
        tmp_path, [*good, {"step": 4, "task_loss": 0.2, "geometry": geometry}], {"reg": "istar", "lam": 0.1}
    )
    code, out, err = cli(["plot", run, "--out", tmp_path / "u.png", *FAST])
    assert_one_line_error(code, out, err, "steps.jsonl line 4", "keyed by rank", exit_code=2)


# ---------------------------------------------------------------- 5. text drawn as itself


def _drawn_texts(fig) -> list[str]:
    """Every text the figure shows, as matplotlib renders it; fails on one it would read as math."""
    fig.canvas.draw()  # makes the tick labels; a mathtext parse error would raise here
    shown = []
    for t in fig.findobj(Text):
        s = t.get_text()
        if s.startswith(r"$\mathdefault{"):  # a log axis's tick, matplotlib's own mathtext
            continue
        assert not cbook.is_math_text(s), s
        shown.append(t._preprocess_math(s)[0])
    return shown


def test_plain_text_escapes_every_dollar():
    assert plain_text("exp$A$") == r"exp\$A\$" and plain_text("no dollars") == "no dollars"
    assert not cbook.is_math_text(plain_text(r"$\foo{$")) and plain_text(7) == "7"


def test_dollars_in_names_are_drawn_as_written():
    a = make_report(name="exp$A$", dataset="d$x$", **SMALL)
    b = make_report(name="exp$A$", dataset="d$y$", seed=2, **SMALL)
    for rep in (a, b):
        for lay in rep["layers"]:
            lay["layer"] = lay["layer"].replace("layer_", "l$") + "$"
        rep["layers"][1]["notes"] = {"twonn": "cost $5$"}
        rep["layers"][1]["twonn"] = None
    figs = make_figures([a, b], ["layers", "spectrum", "outliers"])
    text = " ".join(s for fig in figs.values() for s in _drawn_texts(fig))
    assert "exp$A$ [d$x$]" in text and "exp$A$ [d$y$]" in text  # legend, panel titles
    assert "l$00$" in text and "cost $5$" in text  # outlier ticks, the caption's reason

    steps = [make_report(name=r"$\foo{$", revision=f"step{s}", **SMALL) for s in (0, 1000)]
    for rep in steps:
        rep["layers"][0]["layer"] = "exp$A$"
    fig = plot_trajectory(steps, ["isoscore"])
    shown = _drawn_texts(fig)
    assert any(s.startswith(r"$\foo{$ over training") for s in shown)
    assert "exp$A$" in [ln.get_label().replace(r"\$", "$") for ln in _panels(fig)[0].get_lines()]

    rep = energy_report(name="m$x$")
    rep["gradient_energy"]["layers"] = {
        f"a${k.removesuffix('.grad')}$.grad": v for k, v in rep["gradient_energy"]["layers"].items()
    }
    fig = make_figures([rep], ["energy"])["energy"]
    assert "a$layer_01$" in " ".join(_drawn_texts(fig))  # legend and kappa ticks


def test_dollars_in_a_training_log_name(cli, tmp_path):
    steps = [{"step": s, "task_loss": 1.0 / s, "isoscore_star": 0.4} for s in (1, 2)]
    run = tmp_path / r"run$\foo{$"
    run.mkdir()
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    code, out, err = cli(["plot", run, "--out", tmp_path / "t.png", *FAST])
    assert code == 0, err  # no mathtext ParseFatalException: the legend is the directory's name


# ---------------------------------------------------------------- 6. the page a user wrote


def test_report_html_replaces_only_geomscopes_page(cli, tmp_path):
    from geomscope.htmlreport import html_page

    rep = write_report(tmp_path / "r.json", make_report(**SMALL))
    notes = tmp_path / "mynotes.html"
    mine = "<html><body><p>my notes, quoting a page:</p><section class='report'><h2>bert</h2></body></html>"
    notes.write_text(mine)
    code, out, err = cli(["report", rep, "--html", notes, "-q"])
    assert_one_line_error(code, out, err, "mynotes.html", exit_code=2)
    assert notes.read_text() == mine

    page = tmp_path / "page.html"
    page.write_text("<p>old</p>" + html_page([make_report(**SMALL)], kinds=["layers"]))  # not at byte 0
    code, out, err = cli(["report", rep, "--html", page, "-q"])
    assert code != 0 and page.read_text().startswith("<p>old</p>")

    page.unlink()
    assert cli(["report", rep, "--html", page, "-k", "layers", "-q"])[0] == 0
    first = page.read_text()
    assert cli(["report", rep, "--html", page, "-k", "layers", "-q", "--title", "again"])[0] == 0
    assert page.read_text() != first and "again" in page.read_text()  # its own page: replaced
    # a page without the generator mark: the same opening without it, and report sections
    old = first.replace("<meta name='generator' content='geomscope'>", "")
    page.write_text(old)
    assert cli(["report", rep, "--html", page, "-k", "layers", "-q"])[0] == 0


# ---------------------------------------------------------------- 7. --dpi


def test_dpi_range_is_plot_files_range(cli, tmp_path, monkeypatch):
    import geomscope.plot.figures as figures

    rep = write_report(tmp_path / "r.json", make_report(**SMALL))
    used = []

    def record(fig, path, *, dpi):
        used.append(dpi)
        figures.close_figure(fig)
        return path

    monkeypatch.setattr(figures, "save_figure", record)
    low, high = DPI_RANGE  # (a value beyond them: tests/test_options.py)
    for dpi in (low, high):
        code, out, err = cli(["plot", rep, "--out", tmp_path / "f.png", "--dpi", dpi])
        assert code == 0, err
    assert used == [low, high]
