"""`geomscope inspect` on the command line: table on stderr, --json on stdout, --verify exit codes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers_models import SAMPLE_TEXTS, make_tiny_model

from geomscope.extract.run import extract


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("inspect-cli")
    src = root / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS) + "\n")
    extract(str(make_tiny_model("bert", root)), [src], root / "run", shard_docs=4)
    torch.set_num_threads(n)
    return root / "run"


def test_table_on_stdout(cli, run_dir):
    code, out, err = cli(["inspect", run_dir])
    assert code == 0 and err == ""
    for word in (
        "complete",
        "tiny-bert",
        "layer_00, layer_01, layer_02",
        "stored float16",
        "size on disk",
        "shards",
    ):
        assert word in out, word


def test_json_and_verify(cli, run_dir):
    code, out, err = cli(["inspect", run_dir, "--json", "--verify"])
    assert code == 0, err
    d = json.loads(out)
    assert d["complete"] and d["shards"] == 3 and d["verify"]["ok"] and d["rows"] > 0
    assert d["model"]["name"].endswith("tiny-bert") and d["model"]["revision"] is None


def test_verify_damaged_exits_nonzero(cli, run_dir, tmp_path):
    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    p = bad / "shard-00000.h5"
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 0x01
    p.write_bytes(bytes(raw))
    code, out, err = cli(["inspect", bad, "--verify", "--json"])
    assert code == 3 and json.loads(out)["verify"]["bad"][0]["file"] == "shard-00000.h5"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 3 shards") and "shard-00000.h5" in last and "Traceback" not in err


def test_incomplete_and_not_a_run(cli, run_dir, tmp_path):
    part = tmp_path / "part"
    shutil.copytree(run_dir, part)
    m = json.loads((part / "manifest.json").read_text())
    m["complete"] = False
    m["shards"] = m["shards"][:1]
    (part / "manifest.json").write_text(json.dumps(m))
    code, out, err = cli(["inspect", part])
    assert code == 0 and "INCOMPLETE (1 of 3 shards)" in out and "resume" in out
    code, out, err = cli(["inspect", tmp_path / "nothing"])
    assert code == 2 and err.strip().startswith("error: ") and "does not exist" in err
