"""The CLI's start-up path stays light and lists every command."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "h5py", "matplotlib", "scipy", "skdim", "datasets")


def test_help_imports_nothing_heavy():
    code = (
        "import sys, json\n"
        "from geomscope.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded == [], f"--help imported {loaded}"


def test_help_lists_commands(cli):
    code, out, err = cli(["--help"])
    assert code == 0
    for cmd in ("extract", "score", "plot", "finetune", "inspect"):
        assert cmd in out, f"{cmd} missing from --help"


def test_every_command_help(cli):
    for cmd in ("extract", "score", "plot", "finetune", "inspect"):
        code, out, err = cli([cmd, "--help"])
        assert code == 0 and "Usage" in out, (cmd, err)


def test_version(cli):
    code, out, _ = cli(["--version"])
    assert code == 0 and out.startswith("geomscope ")


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "geomscope", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "extract" in r.stdout


def test_score_without_id_estimators_imports_no_sklearn(tmp_path):
    """scikit-learn takes about a second to import: scoring (and every worker process it spawns) loads
    it only when a scikit-dimension estimator runs."""
    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((300, 8)))
    code = (
        "import sys, json\n"
        "from geomscope.score import ScoreOptions, score\n"
        f"score({str(tmp_path / 'x.npy')!r}, ScoreOptions(metrics=('isoscore', 'twonn', 'avgcos')))\n"
        "print(json.dumps([m for m in ('sklearn', 'skdim') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_id_estimator_names_are_the_registry():
    from geomscope.metrics.intrinsic import ID_ESTIMATORS
    from geomscope.score.options import id_estimator_names

    assert id_estimator_names() == tuple(ID_ESTIMATORS)
