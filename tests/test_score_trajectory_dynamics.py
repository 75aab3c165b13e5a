"""Dynamics in one table: two sizes of a tiny GPT-NeoX, three revisions each in an offline hub
cache, go through the documented four commands (extract, extract, ``score RUNS --basis RUNS``,
``plot --kind trajectory``); trajectory.csv holds every number of each revision's report.json
under the documented column rule, each revision's gradients are paired with its own activations,
and the figure draws both models."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, hf_cache_with, make_tiny_head_model

from geomscope.score.trajectory import read_trajectory, to_trajectory_csv

STEPS = ("step0", "step1000", "step143000")
MODELS = {"tiny-org/neox-s": {}, "tiny-org/neox-m": {"hidden_size": 48, "num_hidden_layers": 3}}
RANKS = (2, 8)


def _geomscope(args) -> None:
    """One command, in-process; the test fails with its exit status when it does not succeed."""
    from geomscope.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)


@pytest.fixture(scope="module")
def dynamics(tmp_path_factory):
    """The four documented commands on a hub cache of two models x three revisions (other weights
    at every revision)."""
    root = tmp_path_factory.mktemp("dynamics")
    cache = root / "hub"
    for k, (repo, sizes) in enumerate(MODELS.items()):
        for i, step in enumerate(STEPS):
            model = make_tiny_head_model(
                "gpt_neox", "causal-lm", root / "src" / repo, seed=10 * k + i, name=step, **sizes
            )
            hf_cache_with(model, cache, repo, commit=f"{10 * k + i:040x}", ref=step)
    text = root / "t.txt"
    text.write_text("\n".join(SAMPLE_TEXTS[:6]) + "\n")
    runs = root / "runs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        for repo in MODELS:
            _geomscope(
                ["extract", repo, text, "--revisions", ",".join(STEPS), "--capture", "activations,gradients"]
                + ["--modules", "norms,attn_out", "--out", runs / repo.split("/")[1], "-q"]
            )
        _geomscope(
            ["score", runs, "--basis", runs, "--metrics", "isoscore,isoscore_star,avgcos,partition"]
            + ["--rank", ",".join(map(str, RANKS)), "--controls", "5", "-q"]
        )
        _geomscope(
            ["plot", runs / "trajectory.csv", "--kind", "trajectory", "--layers", "final_norm,layer_01.grad"]
            + ["--metrics", "isoscore_star,gradient_energy_r8_energy_ratio,iw_input_raw"]
            + ["--out", root / "dynamics.png", "-q"]
        )
    return root


def _table(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _report(root: Path, model: str, revision: str) -> dict:
    return json.loads((root / "runs" / model.split("/")[1] / revision / "report.json").read_text())


def _leaves(obj, path=()):
    """(path, number) of every number in a section, lists of rank rows under ``r<rank>``; lists of
    other rows give their length and per-value counts (checked apart)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj and all(isinstance(r, dict) and "rank" in r for r in obj):
        for row in obj:
            yield from _leaves({k: v for k, v in row.items() if k != "rank"}, (*path, f"r{row['rank']}"))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def _expected_row_cells(rep: dict) -> dict[str, dict[str, float]]:
    """{layer: {column: value}} of a report, straight from the documented rule."""
    want: dict[str, dict] = {}
    for lay in rep["layers"]:
        cells = want.setdefault(lay["layer"], {})
        for k, v in lay.items():
            if k not in ("layer", "index", "n_rows") and isinstance(v, float):
                cells[k] = v
        cells.update({f"se_{k}": v for k, v in lay["se"].items() if v is not None})
        for side in ("input", "output"):
            for kind in ("raw", "centred"):
                cells[f"iw_{side}_{kind}"] = rep["embeddings"][side][kind]
    entries = [("final_norm", rep["final_norm"])] + [("norms", n) for n in rep.get("norms") or []]
    for section, entry in entries:
        cells = want[entry["after"]]
        outliers = entry.pop("outliers")
        for path, v in _leaves(entry):
            cells["_".join((section, *path))] = v
        cells[f"{section}_outliers_n"] = len(outliers)
        for field in ("effect", "measured_effect"):
            for value, n in Counter(o[field] for o in outliers if o.get(field)).items():
                cells[f"{section}_outliers_{field}_{value}"] = n
    for layer, rows in rep["gradient_energy"]["layers"].items():
        for path, v in _leaves(rows or []):
            want[layer]["_".join(("gradient_energy", *path))] = v
    return want


def test_the_table_holds_every_number_of_each_report(dynamics):
    """Every cell of trajectory.csv against its revision's report.json, and every number of the
    report's layers and sections in a cell: per-module metrics, the final norm's and every norm's
    gain statistics, gradient energies with their controls, I(W)."""
    rows = _table(dynamics / "runs" / "trajectory.csv")
    assert {(r["model"], r["revision"]) for r in rows} == {(m, s) for m in MODELS for s in STEPS}
    cols = list(rows[0])
    for col in ("gradient_energy_r8_energy", "gradient_energy_r8_control_energy_mean", "iw_input_raw"):
        assert col in cols
    assert {"gradient_energy_r8_energy_ratio", "gradient_energy_r8_p_value", "final_norm_outliers_n"} <= set(
        cols
    )
    checked = Counter()
    for model in MODELS:
        for step in STEPS:
            rep = _report(dynamics, model, step)
            blocks = MODELS[model].get("num_hidden_layers", 2)
            assert (
                rep["final_norm"]["before"] == f"layer_{blocks:02d}" and len(rep["norms"]) == 2 * blocks + 1
            )
            want = _expected_row_cells(json.loads(json.dumps(rep)))
            mine = {r["layer"]: r for r in rows if (r["model"], r["revision"]) == (model, step)}
            assert list(mine) == [lay["layer"] for lay in rep["layers"]]
            for lay in rep["layers"]:
                row = mine[lay["layer"]]
                assert (int(row["step"]), int(row["index"]), int(row["n_rows"])) == (
                    int(step[4:]),
                    lay["index"],
                    lay["n_rows"],
                )
                for col, v in want[lay["layer"]].items():
                    assert float(row[col]) == v, (model, step, lay["layer"], col)
                    checked[col.split("_")[0]] += 1
                for key, method in rep["params"]["uncertainty"].items():
                    assert row[f"uncertainty_{key}"] == method
                filled = {c for c, v in row.items() if v} - {"model", "revision", "step", "layer", "index"}
                extra = (
                    filled - set(want[lay["layer"]]) - {"n_rows"} - {c for c in cols if c.startswith("unc")}
                )
                assert not extra, (lay["layer"], sorted(extra)[:5])  # no cell the report does not hold
    mod = [r for r in rows if r["layer"] == "layers.0.attention"]  # a module's own metrics
    assert len(mod) == 6 and all(0 < float(r["isoscore_star"]) <= 1 for r in mod)
    assert checked["gradient"] > 0 and checked["final"] > 0 and checked["norms"] > 0 and checked["iw"] > 0
    assert {"norms_measured_gain_spearman_gain_variance", "norms_gain_median_abs_gain"} <= set(cols)


def test_each_revision_is_paired_with_its_own_activations(dynamics):
    """``score RUNS --basis RUNS`` gives each revision the gradient energy that scoring it alone
    with its own run as --basis gives."""
    from geomscope.score import ScoreOptions, score

    for model in MODELS:
        for step in STEPS:
            run = dynamics / "runs" / model.split("/")[1] / step
            alone = score(
                run,
                ScoreOptions(metrics=("isoscore",), basis=str(run), ranks=RANKS, controls=5),
            )["gradient_energy"]
            together = _report(dynamics, model, step)["gradient_energy"]
            assert Path(together["basis"]) == run
            _assert_same_numbers(together["layers"], json.loads(json.dumps(alone["layers"])))
            assert together["pairs"] == alone["pairs"]


def _assert_same_numbers(got, want, path="") -> None:
    """``got`` has ``want``'s structure, its texts and integers equal and its floats within 1e-12
    relative: two scoring passes over the same rows may sum in another order (threads, blocks)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            _assert_same_numbers(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_numbers(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300), path
    else:
        assert got == want, path


def test_a_basis_directory_pairs_by_checkpoint_not_by_name(dynamics, tmp_path, cli):
    """Activations in folders named otherwise are found by their weights; a directory without the
    revision, or with two runs of it, is one line."""
    acts = tmp_path / "acts"
    small = dynamics / "runs" / "neox-s"
    for src, name in zip(STEPS, ("zz", "aa", "mm"), strict=True):
        shutil.copytree(small / src, acts / name, ignore=shutil.ignore_patterns("report.*"))
    code, _, err = cli(
        ["score", small, "--basis", acts, "--rank", "2,8", "--controls", "5"] + _out_args(tmp_path)
    )
    assert code == 0, err
    for src, name in zip(STEPS, ("zz", "aa", "mm"), strict=True):
        got = json.loads((tmp_path / "o" / f"{src}.json").read_text())["gradient_energy"]
        assert Path(got["basis"]) == acts / name
        assert got["layers"] == _report(dynamics, "tiny-org/neox-s", src)["gradient_energy"]["layers"]
    shutil.copytree(acts / "aa", acts / "aa-again")
    code, out, err = cli(["score", small, "--basis", acts] + _out_args(tmp_path, "twice"))
    assert_one_line_error(code, out, err, "holds 2 runs of the checkpoint", exit_code=2)
    assert not (tmp_path / "twice").exists()  # said before step0, which has its run, is scored
    shutil.rmtree(acts / "aa")
    shutil.rmtree(acts / "aa-again")
    code, out, err = cli(["score", small, "--basis", acts] + _out_args(tmp_path, "none"))
    assert_one_line_error(code, out, err, "holds no run of the checkpoint", "tiny-org/neox-s@step1000")
    assert not (tmp_path / "none").exists()
    code, out, err = cli(["score", small / "step1000", "--basis", acts] + _out_args(tmp_path, "one"))
    assert_one_line_error(code, out, err, "holds no run of the checkpoint", "tiny-org/neox-s@step1000")


def _out_args(tmp_path, out: str = "o") -> list:
    return ["--metrics", "isoscore", "--rank", "2,8", "--controls", "5", "--out", tmp_path / out, "-q"]


def _line_data(ax) -> dict[str, tuple]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()), ln) for ln in ax.get_lines()}


def test_the_figure_draws_two_models_one_colour_each(dynamics):
    """Every line against trajectory.csv: one colour per model (its deeper layer in full colour,
    the shallower one lighter), each model over its own steps on a symlog axis that keeps step 0,
    the gradient energy with its jackknife band, I(W) as one line per model."""
    from matplotlib.colors import to_rgb

    from geomscope.plot import plot_trajectory
    from geomscope.plot._style import PALETTE

    assert (dynamics / "dynamics.png").read_bytes()[:4] == b"\x89PNG"
    table = _table(dynamics / "runs" / "trajectory.csv")
    reports = read_trajectory(dynamics / "runs" / "trajectory.csv")
    metrics = ["isoscore_star", "gradient_energy_r8_energy", "iw_input_raw"]
    fig = plot_trajectory(reports, metrics, layers=["final_norm", "layer_01.grad"])
    axes = [ax for ax in fig.axes if ax.get_visible()]
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert legend == ["tiny-org/neox-m", "tiny-org/neox-s", "activations", "gradients (.grad)"]
    models = {"tiny-org/neox-m": PALETTE[0], "tiny-org/neox-s": PALETTE[1]}

    def want(model, layer, col):
        rows = [r for r in table if r["model"] == model and r["layer"] == layer]
        return [float(r["step"]) for r in rows], [float(r[col]) for r in rows]

    iso = _line_data(axes[0])
    assert len(iso) == 4
    for model, colour in models.items():
        for layer, full in (("final_norm", True), ("layer_01.grad", False)):
            x, y, line = iso[f"{model}: {layer}"]
            assert (x, y) == want(model, layer, "isoscore_star") and x == [0.0, 1000.0, 143000.0]
            assert (to_rgb(line.get_color()) == pytest.approx(to_rgb(colour))) is full
            assert line.get_linestyle() == ("--" if layer.endswith(".grad") else "-")
    energy = _line_data(axes[1])
    assert sorted(energy) == [f"{m}: layer_01.grad" for m in sorted(models)]
    for model in models:
        assert energy[f"{model}: layer_01.grad"][:2] == want(
            model, "layer_01.grad", "gradient_energy_r8_energy"
        )
    assert len(axes[1].collections) == 2  # the energy's jackknife se bands
    iw = _line_data(axes[2])
    assert sorted(iw) == [f"{m}: per revision" for m in sorted(models)]
    for model in models:
        x, y, line = iw[f"{model}: per revision"]
        assert (x, y) == want(model, "final_norm", "iw_input_raw") and line.get_linestyle() == "-"
    assert all(ax.get_xscale() == "symlog" for ax in axes)
    assert axes[0].get_xlabel() == "training step (symlog)"
    assert fig.get_suptitle() == "2 models over training (6 checkpoints, step 0–143k)"
    caption = " ".join(fig.get_supxlabel().split())
    assert caption.startswith("Bands: ±1 standard error") and "shallower layers in lighter shades" in caption
    fig = plot_trajectory(reports, ["iw_input_raw"])  # no band drawn: the caption says none
    assert " ".join(fig.get_supxlabel().split()) == "One colour per model."


def test_reports_draw_as_their_table_does(dynamics):
    """The report.json files give the figure the same columns as trajectory.csv."""
    from geomscope.plot import plot_trajectory, read_report

    paths = sorted((dynamics / "runs").glob("*/step*/report.json"))
    reports = [read_report(p) for p in paths]
    metrics = ["final_norm_metrics_isoscore_after", "gradient_energy_r2_energy_ratio", "iw_output_raw"]
    from_json = plot_trajectory(reports, metrics, layers=["final_norm", "layer_00.grad"])
    table = read_trajectory(dynamics / "runs" / "trajectory.csv")
    from_csv = plot_trajectory(table, metrics, layers=["final_norm", "layer_00.grad"])
    for a, b in zip(from_json.axes, from_csv.axes, strict=True):
        lines_a, lines_b = _line_data(a), _line_data(b)
        assert sorted(lines_a) == sorted(lines_b)
        for label, (x, y, _) in lines_a.items():
            assert (x, y) == lines_b[label][:2], label
            assert np.isfinite(y).all(), label


# --------------------------------------------------------------------- the column rule, small
def _small_report(step: int, **sections) -> dict:
    from test_plot_factory import make_report

    rep = make_report(name="m", revision=f"step{step}", n_layers=3, hidden=16, seed=step)
    rep.update(sections)
    return rep


def test_a_report_without_sections_keeps_the_columns_it_had():
    from geomscope.schema import SCALAR_METRIC_NAMES

    text = to_trajectory_csv([_small_report(0), _small_report(5)])
    header = text.splitlines()[0].split(",")
    iw = ["iw_input_raw", "iw_input_centred", "iw_output_raw", "iw_output_centred"]
    se = [f"se_{m}" for m in SCALAR_METRIC_NAMES]
    head = ["model", "revision", "step", "layer", "index", "n_rows"]
    assert header == [*head, *SCALAR_METRIC_NAMES, *se, *iw, "uncertainty_moments", "uncertainty_twonn"]


def test_lists_of_rows_give_counts_and_ranks_give_columns():
    """Outlier rows are counted per effect, 0 where the list is present without that value and
    empty where the report has no such section; rank rows spread into r<rank> columns."""
    rows = [{"dim": 3, "effect": "damped"}, {"dim": 7, "effect": "damped"}, {"dim": 9, "effect": "amplified"}]
    fn = {"before": "layer_01", "after": "layer_02", "gain": {"spearman_abs_gain_variance": -0.5}}
    energy = {"layers": {"layer_01": [{"rank": 2, "energy": 0.25, "p_value": 0.5, "controls_note": None}]}}
    reps = [
        _small_report(0, final_norm={**fn, "outliers": rows}, gradient_energy=energy),
        _small_report(1, final_norm={**fn, "outliers": []}),
        _small_report(2, final_norm=None),
    ]
    got = {(r["step"], r["layer"]): r for r in csv.DictReader(to_trajectory_csv(reps).splitlines())}
    cols = (
        "final_norm_outliers_n",
        "final_norm_outliers_effect_damped",
        "final_norm_outliers_effect_amplified",
    )
    assert [got[("0", "layer_02")][c] for c in cols] == ["3", "2", "1"]
    assert [got[("1", "layer_02")][c] for c in cols] == ["0", "0", "0"]
    assert [got[("2", "layer_02")][c] for c in cols] == ["", "", ""]
    assert got[("0", "layer_02")]["final_norm_gain_spearman_abs_gain_variance"] == "-0.5"
    assert got[("0", "layer_01")]["final_norm_outliers_n"] == ""  # the section describes its after layer
    assert got[("0", "layer_01")]["gradient_energy_r2_energy"] == "0.25"
    assert got[("0", "layer_01")]["gradient_energy_r2_p_value"] == "0.5"
    assert got[("1", "layer_01")]["gradient_energy_r2_energy"] == ""
    assert not any("note" in c for c in got[("0", "layer_01")])  # texts stay in report.json


def test_one_trajectory_file_per_model_draws_as_one_file_of_both(dynamics, tmp_path, cli):
    """plot takes several trajectory.csv files (one per model, as `score` of each model's folder
    writes them) and draws the figure of the one file holding both."""
    from geomscope.plot import plot_trajectory

    paths = []
    for model in MODELS:
        reports = [_report(dynamics, model, step) for step in STEPS]
        paths.append(tmp_path / model.split("/")[1] / "trajectory.csv")
        paths[-1].parent.mkdir()
        paths[-1].write_text(to_trajectory_csv(reports))
    metrics = "isoscore_star,norms_measured_gain_spearman_gain_variance"
    code, _, err = cli(["plot", *paths, "-k", "trajectory", "-m", metrics, "-o", tmp_path / "two.png", "-q"])
    assert code == 0, err
    apart = [r for p in paths for r in read_trajectory(p)]
    together = read_trajectory(dynamics / "runs" / "trajectory.csv")
    a = plot_trajectory(apart, metrics.split(","), layers=["final_layer_norm"])
    b = plot_trajectory(together, metrics.split(","), layers=["final_layer_norm"])
    for ax_a, ax_b in zip(a.axes, b.axes, strict=True):
        lines_a, lines_b = _line_data(ax_a), _line_data(ax_b)
        assert sorted(lines_a) == sorted(lines_b) and len(lines_a) == 2
        assert all(lines_a[k][:2] == lines_b[k][:2] for k in lines_a)
