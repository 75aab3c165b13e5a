"""`geomscope inspect` on the command line: table on stderr, --json on stdout, --verify exit codes; a
run being written, edited totals and hand-edited manifest fields."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import assert_one_line_error, quiet_extract
from helpers_models import SAMPLE_TEXTS, make_tiny_model, make_tiny_run

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


@pytest.mark.parametrize("verify", [False, True], ids=["describe", "verify"])
def test_a_shard_that_is_a_link_loop_is_named_not_a_traceback(cli, run_dir, tmp_path, verify):
    """A shard replaced by a link to itself: its size is not read through the link (that would be
    ELOOP, a traceback); it is the run's own entry that counts, and --verify names the shard."""
    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    (bad / "shard-00001.h5").unlink()
    (bad / "shard-00001.h5").symlink_to("shard-00001.h5")
    code, out, err = cli(["inspect", bad, "--json", *(["--verify"] if verify else [])])
    assert "Traceback" not in err
    if not verify:
        assert code == 0 and json.loads(out)["shards"] == 3, err
        return
    (bad_shard,) = json.loads(out)["verify"]["bad"]
    assert code == 3 and bad_shard["file"] == "shard-00001.h5" and "symbolic link" in bad_shard["error"]
    assert err.strip().splitlines()[-1].startswith("error: 1 of 3 shards")


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


@pytest.mark.parametrize(
    "where, value, needle",
    [
        (("model", "commit"), 12345, "identity.model.commit is 12345"),
        (("model", "revision"), {"a": 1}, "identity.model.revision is {'a': 1}"),
        (("inputs",), "abc", "identity.inputs is 'abc'"),
        (("keep",), 5, "identity.keep is 5"),
        (("layers", -1, "tensor"), 7, "identity.layers[2].tensor is 7"),
    ],
    ids=["commit", "revision", "inputs", "keep", "tensor"],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_inspect_refuses_mistyped_manifest_fields(
    where, value, needle, as_json, tmp_path_factory, cli, capsys
):
    run = make_tiny_run(tmp_path_factory.mktemp("inspect") / "runs", "bert")
    capsys.readouterr()  # (what loading the model printed: not inspect's output)
    m = json.loads((run / "manifest.json").read_text())
    holder = m["identity"]
    for key in where[:-1]:
        holder = holder[key]
    holder[where[-1]] = value
    (run / "manifest.json").write_text(json.dumps(m))
    code, out, err = cli(["inspect", run, *(["--json"] if as_json else [])])
    assert_one_line_error(code, out, err, "manifest.json is damaged", needle, exit_code=2)


def test_inspect_verify_checks_edited_totals(cli, tiny_bert, twelve_docs, tmp_path):
    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    m = json.loads((run / "manifest.json").read_text())
    m["totals"]["rows"] += 5
    m["shards"][0]["rows"] += 5  # an entry edited to match a forged total: the shard itself disagrees
    (run / "manifest.json").write_text(json.dumps(m))
    code, out, err = cli(["inspect", run, "--verify", "--json"])
    # the forged total disagrees with the stored one (totals.rows_stored), and the shard with its entry
    assert code == 3 and "disagrees with itself" in err and "1 of 3 shards are damaged" in err, err
    bad = json.loads(out)["verify"]["bad"]
    assert any("stores" in b["error"] for b in bad)


def test_a_run_being_written_shows_in_progress(cli, tiny_bert, twelve_docs, tmp_path):
    from geomscope.store import RunWriter

    run = tmp_path / "run"
    assert quiet_extract(cli, tiny_bert, twelve_docs, run)[0] == 0
    ident = json.loads((run / "manifest.json").read_text())["identity"]
    with RunWriter(run, ident):
        code, out, _ = cli(["inspect", run])
        assert code == 0 and "IN PROGRESS" in out
        code, out, err = quiet_extract(cli, tiny_bert, twelve_docs, run)
        assert_one_line_error(code, out, err, "another geomscope process is writing", exit_code=2)
