"""Host memory of extract: the heap is trimmed at every shard boundary (capture.trim_heap), only
there, and the trim changes no stored row; off glibc the trim is a no-op."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from helpers_models import SAMPLE_TEXTS, make_tiny_model

import geomscope.extract.capture as capture
import geomscope.extract.run as run_mod
from geomscope.extract.models import load_model
from geomscope.extract.run import extract
from geomscope.store import Run, iter_shard

TEXTS = [t for t in SAMPLE_TEXTS if t.strip()] * 3  # enough documents for several shards


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: load_model(str(make_tiny_model(k, root))) for k in ("bert", "gpt2")}


def stored(run_dir) -> dict[str, np.ndarray]:
    """Every stored array of a run, in stored order (compared bitwise)."""
    run = Run(run_dir)
    parts = [ch for info in run.shards for ch in iter_shard(run.shard_path(info))]
    out = {k: np.concatenate([getattr(c, k) for c in parts]) for k in ("token_id", "doc_id", "position")}
    out |= {"L:" + n: np.concatenate([c.layers[n] for c in parts]) for n in run.layer_names}
    return out


def count_trims(monkeypatch, real: bool) -> list[int]:
    calls: list[int] = []

    def trim():
        calls.append(1)
        if real:
            capture.trim_heap()

    monkeypatch.setattr(run_mod, "trim_heap", trim)
    return calls


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_trim_once_per_written_shard_and_rows_unchanged(models, kind, tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    shard_docs = 4
    n_shards = -(-len(TEXTS) // shard_docs)
    calls = count_trims(monkeypatch, real=True)
    extract(models[kind], [src], tmp_path / "trim", shard_docs=shard_docs, batch_tokens=64)
    assert len(calls) == n_shards
    count_trims(monkeypatch, real=False)  # the trim replaced by nothing: the rows before this change
    extract(models[kind], [src], tmp_path / "plain", shard_docs=shard_docs, batch_tokens=64)
    a, b = stored(tmp_path / "trim"), stored(tmp_path / "plain")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_resumed_shards_are_not_trimmed(models, tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    extract(models["bert"], [src], tmp_path / "run", shard_docs=4)
    calls = count_trims(monkeypatch, real=False)
    s = extract(models["bert"], [src], tmp_path / "run", shard_docs=4)
    assert s["shards_resumed"] == s["shards"] and calls == []


def test_trim_is_a_no_op_off_glibc(monkeypatch):
    monkeypatch.setattr(capture, "_libc", False)
    monkeypatch.setattr(capture.sys, "platform", "darwin")
    assert capture._glibc() is None
    capture.trim_heap()  # nothing to call, nothing raised
    assert capture._libc is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_trim_is_found_and_runs(monkeypatch):
    monkeypatch.setattr(capture, "_libc", False)
    lib = capture._glibc()
    assert lib is not None and hasattr(lib, "malloc_trim")
    assert capture._glibc() is lib  # looked up once
    capture.trim_heap()
