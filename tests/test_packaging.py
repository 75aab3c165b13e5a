"""Packaging: one version, a license file that matches the metadata."""

from __future__ import annotations

from importlib.metadata import metadata, version
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_one_version_source(cli):
    import geomscope

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "geomscope.__version__"}
    assert version("geomscope") == geomscope.__version__
    code, out, _ = cli(["--version"])
    assert code == 0 and out.strip() == f"geomscope {geomscope.__version__}"


def test_license_file_matches_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert metadata("geomscope").get("License-Expression") in ("MIT", None)  # None: an older editable install
