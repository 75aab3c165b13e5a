"""Extraction: text sources, batching, hidden-state capture, the orchestration (the model comes from
:mod:`geomscope.model`).

The public entry point is :func:`geomscope.extract.run.extract` (re-exported here lazily so that
importing the package stays light).
"""

from __future__ import annotations

__all__ = ["ExtractOptions", "extract"]


def __getattr__(name):
    if name == "extract":
        from geomscope.extract.run import extract

        return extract
    if name == "ExtractOptions":
        from geomscope.extract.options import ExtractOptions

        return ExtractOptions
    raise AttributeError(name)
