"""Names of a package imported from their modules on first use (PEP 562).

``__getattr__, __all__ = lazy_names(__name__, {"Run": "reader", ...})`` in a package's
``__init__`` makes ``package.Run`` import ``package.reader`` when first asked for, so that what a
command's ``--help`` is built from (its declared options) imports no h5py or matplotlib.
"""

from __future__ import annotations

from importlib import import_module
from typing import Callable


def lazy_names(package: str, homes: dict[str, str]) -> tuple[Callable[[str], object], list[str]]:
    """(the package's ``__getattr__``, its ``__all__``) for ``homes``: public name -> the submodule
    of ``package`` that defines it."""

    def __getattr__(name: str):
        if name in homes:
            return getattr(import_module(f"{package}.{homes[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, list(homes)
