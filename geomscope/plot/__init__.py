"""Figures from score reports (and, through :mod:`geomscope.plot.training`, from training logs).

Every function takes loaded reports (dicts in the ``geomscope-report`` format) and returns a
:class:`matplotlib.figure.Figure` on its own Agg canvas; nothing touches pyplot's global state.

    from geomscope.plot import read_report, plot_layers, save_figure
    fig = plot_layers([read_report("a.json"), read_report("b.json")], ["isoscore_star", "avgcos"])
    save_figure(fig, "layers.png")
"""

from __future__ import annotations

from geomscope.lazy import lazy_names

#: each public name -> the module that defines it: imported on first use, so that the options
#: (what ``geomscope plot --help`` is built from) import no matplotlib
_HOMES = {
    "KINDS": "figures",
    "PlotOptions": "options",
    "auto_kinds": "figures",
    "available_metrics": "_reports",
    "make_figures": "figures",
    "outlier_matrix": "outliers",
    "parse_step": "_reports",
    "plot_energy": "energy",
    "plot_files": "figures",
    "plot_layers": "layers",
    "plot_outliers": "outliers",
    "plot_spectrum": "spectrum",
    "plot_trajectory": "trajectory",
    "read_report": "_reports",
    "report_labels": "_reports",
    "save_figure": "figures",
    "trajectory_steps": "trajectory",
}

__getattr__, __all__ = lazy_names(__name__, _HOMES)
