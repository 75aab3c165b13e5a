"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def cli(capsys):
    """Run the geomscope CLI in-process: ``code, out, err = cli([...])``."""

    def run(args):
        from geomscope.cli import main

        code = 0
        try:
            main([str(a) for a in args])
        except SystemExit as e:  # typer/click exit
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
