"""describe_run (what `geomscope inspect` shows) on complete, interrupted and damaged runs."""

from __future__ import annotations

import shutil

import pytest
from helpers_models import SAMPLE_TEXTS, make_tiny_model

from geomscope.errors import InputError
from geomscope.extract.run import extract
from geomscope.store import Run, describe_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A complete run and an interrupted copy of it (last shard dropped, a temp file left behind)."""
    root = tmp_path_factory.mktemp("inspect")
    model = make_tiny_model("gpt2", root)
    src = root / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS + ["", "  "]) + "\n")
    summary = extract(str(model), [src], root / "run", layers="0,-1", shard_docs=5, store_dtype="float32")
    part = root / "partial"
    shutil.copytree(root / "run", part)
    from geomscope.store.manifest import write_json_atomic

    m = Run(part).manifest
    dropped = m["shards"].pop()
    m["complete"] = False
    write_json_atomic(part / "manifest.json", m)
    (part / dropped["file"]).unlink()
    (part / ".shard-00002.h5.tmp").write_bytes(b"half")
    return {"run": root / "run", "partial": part, "summary": summary, "src": src}


def test_complete_run(runs):
    d = describe_run(runs["run"])
    s = runs["summary"]
    assert d["complete"] and d["rows"] == s["rows"] and d["docs"] == s["docs"] == len(SAMPLE_TEXTS)
    assert d["shards"] == d["planned_shards"] == 3 and d["layers"] == ["layer_00", "layer_02"]
    assert d["final_norm_layer"] is None and d["layer_indices"] == [0, 2]  # layer_02: the norm's input
    assert "input of the final norm ln_f" in d["layer_tensors"]["layer_02"]
    assert d["model"]["model_type"] == "gpt2" and d["model"]["attention"] == "causal" and d["dim"] == 32
    assert d["store_dtype"] == "float32" and d["docs_empty"] == 2 and d["nonfinite_rows"] == 0
    files = sum(p.stat().st_size for p in runs["run"].iterdir() if not p.name.startswith(".geomscope"))
    assert d["bytes_on_disk"] == files
    assert d["inputs"][0]["path"] == str(runs["src"]) and d["options"]["shard_docs"] == 5
    assert d["unlisted_shard_files"] == [] and d["interrupted_shard_files"] == []
    assert "verify" not in d
    v = describe_run(runs["run"], verify=True)["verify"]
    assert {k: v[k] for k in ("checked", "bad", "ok")} == {"checked": 3, "bad": [], "ok": True}
    assert v["documents"]["each_document_once"] and v["documents"]["missing_shards"] == []


def test_interrupted_run(runs):
    d = describe_run(runs["partial"])
    assert not d["complete"] and d["shards"] == 2 and d["planned_shards"] == 3
    assert d["interrupted_shard_files"] == [".shard-00002.h5.tmp"]


def test_damaged_shard_found_by_verify(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    p = run / "shard-00001.h5"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    p.write_bytes(bytes(raw))
    d = describe_run(run, verify=True)
    assert not d["verify"]["ok"] and [b["file"] for b in d["verify"]["bad"]] == ["shard-00001.h5"]
    assert "checksum" in d["verify"]["bad"][0]["error"]
    (run / "shard-00009.h5").write_bytes(b"stray")
    assert describe_run(run)["unlisted_shard_files"] == ["shard-00009.h5"]


def test_not_a_run(tmp_path):
    with pytest.raises(InputError, match="not a geomscope run directory"):
        describe_run(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        describe_run(tmp_path / "nope")


@pytest.mark.parametrize("edit", ["missing", "overlap", "outside"])
def test_verify_proves_each_document_in_one_shard(runs, tmp_path, edit):
    """inspect --verify's coverage check catches a complete run missing a shard, two shards claiming
    the same documents, and a shard storing documents outside its range."""
    from geomscope.store.manifest import write_json_atomic

    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    m = Run(run).manifest
    if edit == "missing":
        (run / m["shards"][1]["file"]).unlink()
        del m["shards"][1]
        want = "shard(s) [1] are missing"
    elif edit == "overlap":
        m["shards"][1]["doc_start"] = m["shards"][0]["doc_stop"] - 1
        want = "both claim documents"
    else:
        m["shards"][0]["doc_stop"] = m["shards"][0]["doc_start"] + 1
        want = "outside its range"
    write_json_atomic(run / "manifest.json", m)
    v = describe_run(run, verify=True)["verify"]
    # a manifest at odds with itself is its own finding (no shard to delete); a shard's rows, the shard's
    found = v["manifest"] if edit != "outside" else [b["error"] for b in v["bad"]]
    assert not v["ok"] and any(want in why for why in found), v
