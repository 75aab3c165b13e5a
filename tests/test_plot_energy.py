"""`plot --kind energy`: the gradient_energy section of `score GRADRUN --basis ACTRUN` drawn as
E against rank and kappa against layer."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_one_line_error
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from test_plot_factory import make_report, write_report

from geomscope.errors import InputError
from geomscope.plot import auto_kinds, make_figures, plot_energy, plot_files
from geomscope.plot.energy import energy_layers, short_layer

RANKS = [8, 32, 128]
D = 256
GRAD_LAYERS = ["layer_01.grad", "layer_02.grad", "final_norm.grad"]
FAST = ["--dpi", "40"]


def _rank_entry(layer: int, rank: int, *, controls: bool = True, sd: bool = True, kappa=True) -> dict:
    base = rank / D
    energy = min(0.95, base + 0.2 + 0.1 * layer + 0.001 * rank)
    emax = min(0.99, energy + 0.05)
    mean = base * 1.02 if controls else None
    return {
        "rank": rank,
        "dim": D,
        "energy": energy,
        "baseline": base,
        "energy_max": emax,
        "kappa": (energy - base) / (emax - base) if kappa else None,
        "mean_energy": energy,
        "overlap": 0.5,
        "activation_share": 0.6,
        "activation_gap": 0.1,
        "controls": 20 if controls else 0,
        "control_energy_mean": mean,
        "control_energy_sd": 0.01 if controls and sd else None,
        "control_energy_expected": base,
        "energy_ratio": energy / mean if controls else None,
        "p_value": 1 / 21 if controls else None,
        "controls_note": None if controls else "2r > D",
        "isoscore_star": 0.3,
        "removal_isoscore_star": 0.5,
        "removal_control_isoscore_star_mean": 0.31 if controls else None,
        "removal_control_isoscore_star_sd": 0.01 if controls and sd else None,
        "removal_note": None,
    }


def energy_report(**kw) -> dict:
    """A gradient run's report (activation and gradient layers sharing indices) with a
    gradient_energy section of 3 layers x 3 ranks holding nulls: kappa None at layer_02 r=32,
    no controls at r=128 of layer_02, no SD at final_norm, layer_01.grad r=8 with kappa None."""
    rep = make_report(n_layers=3, hidden=32, **kw)
    acts = rep["layers"]
    grads = []
    for i, name in enumerate(GRAD_LAYERS):
        g = dict(acts[min(i + 1, len(acts) - 1)])
        g["layer"] = name
        g["index"] = i + 1
        grads.append(g)
    rep["layers"] = acts + grads
    rep["params"]["layers"] = [x["layer"] for x in rep["layers"]]
    rep["gradient_energy"] = {
        "basis": "/runs/act",
        "basis_model": "gpt2",
        "pairs": {"layer_01.grad": "layer_01", "layer_02.grad": "layer_02", "final_norm.grad": "final_norm"},
        "ranks": RANKS,
        "controls": 20,
        "seed": 0,
        "removal_zeta": 0.2,
        "removal_target": "trace",
        "layers": {
            "layer_01.grad": [_rank_entry(1, r, kappa=r != 8) for r in RANKS],
            "layer_02.grad": [_rank_entry(2, r, kappa=r != 32, controls=r != 128) for r in RANKS],
            "final_norm.grad": [_rank_entry(3, r, sd=False) for r in RANKS],
        },
        "notes": {},
    }
    return rep


def _lines(ax, gid):
    return [ln for ln in ax.get_lines() if ln.get_gid() == gid]


def test_plot_energy_panels_and_line_data():
    rep = energy_report()
    fig = plot_energy([rep])
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    e_ax, k_ax = fig.axes
    assert e_ax.get_xscale() == "log"
    energy = _lines(e_ax, "energy")
    assert [ln.get_label() for ln in energy] == GRAD_LAYERS
    for ln, name in zip(energy, GRAD_LAYERS, strict=True):
        rows = rep["gradient_energy"]["layers"][name]
        assert list(ln.get_xdata()) == RANKS
        np.testing.assert_allclose(ln.get_ydata(), [r["energy"] for r in rows])
    # colours follow depth: three distinct colours
    assert len({tuple(ln.get_color()) for ln in energy}) == 3
    (base,) = _lines(e_ax, "baseline")
    assert list(base.get_xdata()) == RANKS
    np.testing.assert_allclose(base.get_ydata(), [r / D for r in RANKS])
    assert base.get_color() == "black" and base.get_linestyle() == "--"
    assert len(_lines(e_ax, "energy_max")) == 3
    # control bands for the two layers with SDs, a mean-only line for final_norm (no SD)
    assert sum(c.get_gid() == "control" for c in e_ax.collections) == 2
    (mean_only,) = _lines(e_ax, "control_mean")
    np.testing.assert_allclose(mean_only.get_ydata(), [1.02 * r / D for r in RANKS])

    # panel 2: kappa by layer, one line per rank, None -> gap; 0 and 1 marked
    kappa = _lines(k_ax, "kappa")
    assert [ln.get_label() for ln in kappa] == [f"r = {r}" for r in RANKS]
    ys = {int(ln.get_label()[4:]): np.asarray(ln.get_ydata(), float) for ln in kappa}
    assert list(kappa[0].get_xdata()) == [0, 1, 2]
    assert np.isnan(ys[8][0]) and np.isfinite(ys[8][1:]).all()
    assert np.isnan(ys[32][1]) and np.isfinite(ys[32][[0, 2]]).all()
    assert np.isfinite(ys[128]).all()
    want = rep["gradient_energy"]["layers"]["final_norm.grad"][2]["kappa"]
    assert ys[128][2] == pytest.approx(want)
    refs = sorted(float(ln.get_ydata()[0]) for ln in _lines(k_ax, "kappa_ref"))
    assert refs == [0.0, 1.0]
    assert [t.get_text() for t in k_ax.get_xticklabels()] == ["1", "2", "fn"]
    fig.canvas.draw()  # lays out without error


def test_short_layer_names():
    assert short_layer("layer_01.grad") == "1"
    assert short_layer("layer_12.grad") == "12"
    assert short_layer("final_norm.grad") == "fn"
    assert short_layer("layer_00") == "0"


def test_layers_filter_and_null_layers():
    rep = energy_report()
    rep["gradient_energy"]["layers"]["layer_02.grad"] = None
    rep["gradient_energy"]["notes"] = {"layer_02.grad": "no basis layer"}
    fig = plot_energy([rep])
    assert len(_lines(fig.axes[0], "energy")) == 2
    ys = [np.asarray(ln.get_ydata(), float) for ln in _lines(fig.axes[1], "kappa")]
    assert all(np.isnan(y[1]) for y in ys)
    # by name, by activation pair and by index
    assert [n for n, _ in energy_layers(rep, ["layer_01.grad"])] == ["layer_01.grad"]
    assert [n for n, _ in energy_layers(rep, ["final_norm"])] == ["final_norm.grad"]
    assert [n for n, _ in energy_layers(rep, ["1", "3"])] == ["layer_01.grad", "final_norm.grad"]
    fig = plot_energy([rep], layers=["layer_01.grad", "3"])
    assert [ln.get_label() for ln in _lines(fig.axes[0], "energy")] == ["layer_01.grad", "final_norm.grad"]
    with pytest.raises(InputError, match="layer 'nope' is not in"):
        plot_energy([rep], layers=["nope"])
    with pytest.raises(InputError, match="selected layers have no gradient energy"):
        plot_energy([rep], layers=["layer_02.grad"])


def test_no_controls_and_all_kappa_none_do_not_crash():
    rep = energy_report()
    for rows in rep["gradient_energy"]["layers"].values():
        for r in rows:
            r.update(kappa=None, control_energy_mean=None, control_energy_sd=None, energy_max=None)
    fig = plot_energy([rep])
    assert not _lines(fig.axes[1], "kappa") and not fig.axes[0].collections
    fig.canvas.draw()


def test_several_reports_rows_and_ax():
    a, b = energy_report(), energy_report(name="EleutherAI/pythia-70m", seed=3)
    fig = plot_energy([a, b])
    assert len(fig.axes) == 4
    assert fig.axes[0].get_title(loc="left").startswith("sentence-transformers/all-MiniLM-L6-v2")
    assert fig.axes[2].get_title(loc="left").startswith("EleutherAI/pythia-70m")
    # the caller's Axes: two per report, drawn into, that figure returned
    from geomscope.plot._style import new_figure

    own = new_figure(8, 3)
    axes = own.subplots(1, 2)
    assert plot_energy([a], ax=axes) is own
    assert len(_lines(axes[0], "energy")) == 3
    with pytest.raises(InputError, match="pass 2 matplotlib Axes"):
        plot_energy([a], ax=axes[0])
    assert all(isinstance(x, Axes) for x in own.axes)


def test_missing_section_is_an_error():
    rep = make_report(n_layers=3, hidden=32)
    with pytest.raises(InputError, match="has no gradient_energy; score a gradient run with --basis ACTRUN"):
        plot_energy([rep])
    rep["gradient_energy"] = None
    with pytest.raises(InputError, match="has no gradient_energy"):
        plot_energy([rep])


def test_auto_kinds():
    lean = {"spectrum": False, "outliers": False}
    plain, grad = make_report(n_layers=3, hidden=32, **lean), energy_report(**lean)
    assert "energy" not in auto_kinds([plain], single=False)
    assert auto_kinds([plain], single=True) == ["layers"]
    assert auto_kinds([grad, plain], single=False)[-1] == "energy"
    assert auto_kinds([grad, plain], single=True) == ["layers"]
    assert auto_kinds([grad], single=True) == ["energy"]
    # auto draws only the reports that have the section; naming the kind needs it on every report
    figs = make_figures([grad, plain], single=False)
    assert list(figs)[-1] == "energy" and len(figs["energy"].axes) == 2
    with pytest.raises(InputError, match="has no gradient_energy"):
        make_figures([grad, plain], ["energy"])


def test_plot_files_auto_writes_energy(tmp_path):
    lean = {"spectrum": False, "outliers": False}  # auto draws layers (+ energy) only: fast
    grad = write_report(tmp_path / "g.json", energy_report(**lean))
    plain = write_report(tmp_path / "p.json", make_report(n_layers=3, hidden=32, **lean))
    written = plot_files([grad], f"{tmp_path / 'with'}/", dpi=40)
    assert [w["kind"] for w in written][-1] == "energy"
    assert (tmp_path / "with" / "energy.png").read_bytes().startswith(b"\x89PNG")
    written = plot_files([plain], f"{tmp_path / 'without'}/", dpi=40)
    assert "energy" not in [w["kind"] for w in written]
    assert not (tmp_path / "without" / "energy.png").exists()


def test_cli_kind_energy(cli, tmp_path):
    plain = write_report(tmp_path / "p.json", make_report(n_layers=3, hidden=32))
    code, out, err = cli(["plot", plain, "--out", tmp_path / "e.png", "--kind", "energy", *FAST])
    assert_one_line_error(code, out, err, "has no gradient_energy", "--basis ACTRUN")
    grad = write_report(tmp_path / "g.json", energy_report())
    code, out, err = cli(
        ["plot", grad, "--out", tmp_path / "e.png", "-k", "energy", "--layers", "1,2", *FAST]
    )
    assert code == 0, err
    assert (tmp_path / "e.png").read_bytes().startswith(b"\x89PNG")
