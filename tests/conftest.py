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


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models on a small shared machine: one intra-op thread avoids OpenMP barrier stalls
    (measured up to 100x slower with 2 threads under load); restored after each module."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
