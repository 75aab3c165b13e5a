"""Figures from score reports (and, through :mod:`geomscope.plot.training`, from training logs).

Every function takes loaded reports (dicts in the ``geomscope-report`` format) and returns a
:class:`matplotlib.figure.Figure` on its own Agg canvas; nothing touches pyplot's global state.

    from geomscope.plot import read_report, plot_layers, save_figure
    fig = plot_layers([read_report("a.json"), read_report("b.json")], ["isoscore_star", "avgcos"])
    save_figure(fig, "layers.png")
"""

from geomscope.plot._reports import available_metrics, parse_step, read_report, report_labels
from geomscope.plot.energy import plot_energy
from geomscope.plot.figures import KINDS, auto_kinds, make_figures, plot_files, save_figure
from geomscope.plot.layers import plot_layers
from geomscope.plot.outliers import outlier_matrix, plot_outliers
from geomscope.plot.spectrum import plot_spectrum
from geomscope.plot.trajectory import plot_trajectory, trajectory_steps

__all__ = [
    "KINDS",
    "auto_kinds",
    "available_metrics",
    "make_figures",
    "outlier_matrix",
    "parse_step",
    "plot_energy",
    "plot_files",
    "plot_layers",
    "plot_outliers",
    "plot_spectrum",
    "plot_trajectory",
    "read_report",
    "report_labels",
    "save_figure",
    "trajectory_steps",
]
