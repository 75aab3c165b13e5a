"""benchmarks/bench_realistic.py, smoke-run on the CPU at tiny shapes (what a GPU lease runs at full
size: every contender and the I-STAR step), and benchmarks/cost_model.py's arithmetic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_realistic as br  # noqa: E402
import cost_model as cm  # noqa: E402

CONTENDERS = ["plain", "common", "extract one", "extract sample", "extract sample split", "score"]


def test_quick_cpu_run_of_every_contender(tmp_path):
    """Every contender of one model runs over the same text: the plain forward, the common loop and
    each extract measure the same tokens; the sample runs and the common loop leave files."""
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--quick", "--in-process", "--only", "extract", "--models", "pythia-1.4b"]
    assert br.main([*argv, "--tokens", "600", "--json", str(out), "--markdown", str(tmp_path / "t.md")]) == 0
    got = json.loads(out.read_text())
    assert got["failed"] == []
    rows = {r["contender"]: r for r in got["rows"]}
    assert list(rows) == CONTENDERS
    tokens = rows["plain"]["tokens"]
    assert tokens >= 600
    for k in CONTENDERS[:5]:
        assert rows[k]["measured tokens"] == tokens, k
        assert rows[k]["tokens/s"] > 0 and rows[k]["host peak GiB"] > 0
    assert rows["plain"]["vs plain"] == 1
    assert rows["extract sample"]["on disk GB"] > 0 and rows["common"]["on disk GB"] > 0
    assert "extract sample split" in (tmp_path / "t.md").read_text()


def test_quick_cpu_istar_step(tmp_path):
    out = tmp_path / "rows.json"
    assert br.main(["--device", "cpu", "--quick", "--only", "istar", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["istar"]
    assert len(rows) == 4 and all(r["geomscope"] > 0 and r["alternative"] > 0 for r in rows)
    assert rows[0]["target"] == "<= 1.05"


def test_documents_have_the_lengths_asked(tmp_path):
    path = br.make_documents(tmp_path / "d.txt", 5000, 20, 40, seed=3)
    lines = path.read_text().splitlines()
    assert all(18 <= len(line.split()) <= 38 for line in lines)
    assert sum(len(line.split()) + 2 for line in lines) >= 5000


def test_cost_model_forward_and_fit():
    """The forward's flops by hand, and an efficiency fitted on a plain row reproduces that row."""
    shape = cm.Shape("s", params=1e9, layers=10, hidden=1000, causal=True)
    dev = cm.Device("d", bf16=100.0, f32=10.0, f64=1.0, memory=1000.0, disk=1.0, eta_fwd={"bf16": 0.5})
    assert cm.forward_seconds(shape, dev, 100.0) == pytest.approx((2e9 + 2 * 10 * 100 * 1000) / 50e12)
    eta = cm.fitted_eta(dev, shape, 100.0, 12345.0)
    fitted = cm.Device(**{**cm.asdict(dev), "eta_fwd": eta})
    assert 1 / cm.forward_seconds(shape, fitted, 100.0) == pytest.approx(12345.0)
    assert cm.triangle(4096) == pytest.approx(17 / 32) and cm.triangle(100) == 1.0


def test_cost_model_tables():
    rows = cm.check_rows()
    assert len(rows) == len(cm.CPU_ROWS) + len(cm.GPU_ROWS)
    assert all(r["model tok/s"] > 0 for r in rows)
    proj = {r["what"]: r for r in cm.projection()}
    assert proj["plain forward"]["x forward"] == 1
    assert (
        proj["extract --keep sample --products split"]["hours"]
        <= proj["extract --keep sample, float64 products"]["hours"]
    )
