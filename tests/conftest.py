"""Shared test fixtures."""

from __future__ import annotations

import json
import os
from pathlib import Path

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

        capsys.readouterr()  # only the command's own output: not what the test's set-up printed
        code = 0
        try:
            main([str(a) for a in args])
        except SystemExit as e:  # typer/click exit
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A tiny random BERT checkpoint (helpers_models.make_tiny_model, seed 0), built once per
    process; tests copy it before they change it."""
    from helpers_models import make_tiny_model

    return make_tiny_model("bert", tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def twelve_docs(tmp_path) -> Path:
    """helpers_models.TWELVE_DOCS in a text file: three shards at ``--shard-docs 4``."""
    from helpers_models import TWELVE_DOCS

    p = tmp_path / "t.txt"
    p.write_text(TWELVE_DOCS)
    return p


def quiet_extract(cli, model, text, run, *extra):
    """``geomscope extract MODEL TEXT --out RUN --quiet --shard-docs 4 EXTRA...`` through ``cli``."""
    return cli(["extract", model, text, "--out", run, "--quiet", "--shard-docs", "4", *extra])


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models on a small shared machine: one intra-op thread avoids OpenMP barrier stalls
    (2 threads under load can be up to 100x slower); restored after each module."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_one_line_error(code, out, err, *needles, exit_code=None) -> str:
    """The CLI's failure contract: a non-zero exit (``exit_code`` when given), exactly one
    ``error:`` line on stderr and it is the last line, no traceback, and nothing on stdout (pass
    ``out=None`` where a command may print a partial JSON summary). Returns the error line."""
    assert code != 0, err
    if exit_code is not None:
        assert code == exit_code, (code, err)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert "Traceback" not in err and "╭" not in err, err
    if out is not None:
        assert out == "", out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def one_line_message(excinfo) -> str:
    """The message of the exception ``pytest.raises`` caught, checked to be one non-empty line."""
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def edit_manifest(run: Path, edit) -> None:
    """``run``'s manifest.json read, changed by ``edit(manifest)`` in place, and written back."""
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))


def files_of(d: Path) -> dict[str, bytes]:
    """Every file under ``d``, by its path relative to ``d``, with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class Planted:
    """A pickle that runs ``touch MARKER`` when loaded: it must never be loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="session")
def fuzz_runs(tmp_path_factory):
    """The clean runs the hostile-input tests mutate (helpers_fuzz.clean_runs), built once."""
    from helpers_fuzz import clean_runs

    return clean_runs(tmp_path_factory)


@pytest.fixture(scope="session")
def fuzz_sweep(tmp_path_factory):
    """The clean sweep the hostile-input tests mutate (helpers_fuzz.clean_sweep), built once."""
    from helpers_fuzz import clean_sweep

    return clean_sweep(tmp_path_factory)
