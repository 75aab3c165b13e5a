"""``ExportOptions``: how ``export`` writes a run, besides the run and the directory it writes,
declared once (:mod:`geomscope.options`): ``geomscope export --help`` is built from these fields, and
:func:`geomscope.export.export_run` takes the same object. A light module: no numpy."""

from __future__ import annotations

from dataclasses import dataclass, replace

from geomscope.choices import EXPORT_FORMATS
from geomscope.layers import STORED_LAYERS_HELP, layer_items
from geomscope.options import REQUIRED, Choice, Layers, check, choice_metavar, option, verify_option


@dataclass(frozen=True)
class ExportOptions:
    """How ``export`` writes a run, declared once (:mod:`geomscope.options`).

    ``layers``: a selection in :mod:`geomscope.layers`' grammar (None: every layer).
    """

    to: str = option(
        REQUIRED,
        Choice(EXPORT_FORMATS),
        "arrow: a datasets.save_to_disk directory (Arrow IPC files); npy: one .npy per layer.",
        metavar=choice_metavar(EXPORT_FORMATS),
    )
    layers: tuple[str, ...] | list | str | None = option(
        None, Layers(), STORED_LAYERS_HELP, metavar="LIST", short="-l", optional=True
    )
    verify: bool = verify_option()

    def validate(self) -> ExportOptions:
        """A checked copy with ``layers`` as a list of names (None: every layer); OptionError (one
        line) naming the option otherwise."""
        check(self)
        return replace(self, layers=layer_items(self.layers) or None)
