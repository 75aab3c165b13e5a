"""Extraction: model + tokenizer loading, text sources, batching, hidden-state capture, the orchestration.

The public entry point is :func:`geomscope.extract.run.extract` (re-exported here lazily so that
importing the package stays light).
"""

from __future__ import annotations

__all__ = ["ExtractOptions", "extract", "load_model", "resolve_model", "parse_layers"]


def __getattr__(name):
    if name == "extract":
        from geomscope.extract.run import extract

        return extract
    if name in ("load_model", "resolve_model"):
        from geomscope.extract import models

        return getattr(models, name)
    if name == "ExtractOptions":
        from geomscope.extract.options import ExtractOptions

        return ExtractOptions
    if name == "parse_layers":
        from geomscope.extract.layers import parse_layers

        return parse_layers
    raise AttributeError(name)
