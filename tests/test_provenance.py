"""What a run records of the software that made it (geomscope/provenance.py)."""

from __future__ import annotations


def test_package_versions():
    from geomscope import __version__
    from geomscope.provenance import package_versions

    v = package_versions()
    assert v["geomscope"] == __version__ and set(v) == {"geomscope", "torch", "transformers"}
