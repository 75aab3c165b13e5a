"""Many checkpoints, one run each (``extract --revisions``), offline through a hub cache the test
writes itself, and through a glob of local checkpoint directories; then ``score`` of the directory
of runs writes ``trajectory.csv`` and ``plot`` draws it."""

from __future__ import annotations

import csv
import json
import re

import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, hf_cache_with, make_tiny_model

from geomscope.model.revisions import PRESETS, resolve_revisions

REPO = "tiny-org/tiny-neox"
STEPS = ("step0", "step1000", "step3000")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache holding three revisions of a tiny GPT-NeoX with different weights."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    for i, step in enumerate(STEPS):
        model = make_tiny_model("gpt_neox", root / step, seed=i)
        hf_cache_with(model, cache, REPO, commit=f"{i:040x}", ref=step)
    text = root / "t.txt"
    text.write_text("\n".join(SAMPLE_TEXTS[:8]) + "\n")
    return cache, text


def test_presets_and_resolution(tmp_path):
    mm = PRESETS["pythia-mm21"]
    assert len(mm) == 21 and mm[0] == "step0" and mm[1] == "step7000" and mm[-1] == "step143000"
    assert mm[10] == "step71000"  # int(10 * 143 / 20) = 71, as the released code computes it
    (tmp_path / "ckpt" / "step20").mkdir(parents=True)
    (tmp_path / "ckpt" / "step100").mkdir()
    revs = resolve_revisions("m", str(tmp_path / "ckpt" / "*"))
    assert [r.name for r in revs] == ["step20", "step100"] and revs[0].revision is None
    (tmp_path / "list.txt").write_text("# steps\nstep0\n\nstep5\n")
    assert [r.revision for r in resolve_revisions("org/m", str(tmp_path / "list.txt"))] == ["step0", "step5"]
    assert [r.name for r in resolve_revisions("org/m", "refs/pr/1,main")] == ["refs_pr_1", "main"]


def test_revisions_offline_then_trajectory(hub, tmp_path, cli, monkeypatch):
    from conftest import assert_one_line_error

    cache, text = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "traj"
    args = ["extract", REPO, text, "--revisions", ",".join(STEPS), "--out", out, "--cache-dir", cache, "-q"]
    code, _, err = cli([*args, "--json"])
    assert code == 0, err
    for i, step in enumerate(STEPS):
        m = json.loads((out / step / "manifest.json").read_text())
        assert m["complete"] and m["identity"]["model"]["revision"] == step
        assert m["identity"]["model"]["commit"] == f"{i:040x}"
    code, out_json, err = cli([*args, "--json"])  # rerun: all skipped, nothing reloaded
    assert code == 0 and [r["status"] for r in json.loads(out_json)["runs"]] == ["skipped"] * 3
    # an unknown revision names those the cache holds; the finished runs stay
    bad = ["extract", REPO, text, "--revisions", "step0,step9", "--out", out, "--cache-dir", cache, "-q"]
    code, o, err = cli(bad)
    line = assert_one_line_error(code, o, err, "1 of 2 revisions failed", "step9", exit_code=2)
    assert "step1000" in line and (out / "step0" / "manifest.json").exists()

    code, _, err = cli(["score", out, "-q", "--metrics", "isoscore,avgcos,partition"])
    assert code == 0, err
    rows = list(csv.DictReader((out / "trajectory.csv").open()))
    assert [r["revision"] for r in rows[:: len(rows) // 3]] == list(STEPS)
    assert sorted({int(r["step"]) for r in rows}) == [0, 1000, 3000]
    assert {"model", "revision", "step", "layer", "isoscore", "se_isoscore", "iw_input_raw"} <= set(rows[0])
    iw = {r["revision"]: float(r["iw_input_raw"]) for r in rows}  # per revision: its own checkpoint's I(W)
    assert all(0 < v <= 1 for v in iw.values()) and len(set(iw.values())) == 3
    one = json.loads((out / "step1000" / "report.json").read_text())
    got = [float(r["isoscore"]) for r in rows if r["revision"] == "step1000"]
    assert got == pytest.approx([e["isoscore"] for e in one["layers"]], rel=1e-12)
    code, _, err = cli(
        ["plot", out / "trajectory.csv", "--kind", "trajectory", "--out", tmp_path / "t.png", "-q"]
    )
    assert code == 0, err
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_glob_of_local_checkpoints(tmp_path, cli):
    ckpts = tmp_path / "ft" / "checkpoints"
    for i, step in enumerate(("step2", "step4")):
        make_tiny_model("bert", tmp_path / "m", seed=i)
        import shutil

        shutil.copytree(tmp_path / "m" / "tiny-bert", ckpts / step)
        shutil.rmtree(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(SAMPLE_TEXTS[:5]) + "\n")
    code, out, err = cli(
        ["extract", "ft", text, "--revisions", str(ckpts / "*"), "--out", tmp_path / "runs", "-q", "--json"]
    )
    assert code == 0, err
    assert [r["revision"] for r in json.loads(out)["runs"]] == [str(ckpts / "step2"), str(ckpts / "step4")]
    code, _, err = cli(["score", tmp_path / "runs", "-q", "--metrics", "isoscore"])
    assert code == 0, err
    rows = list(csv.DictReader((tmp_path / "runs" / "trajectory.csv").open()))
    assert sorted({(r["revision"], r["step"]) for r in rows}) == [("step2", "2"), ("step4", "4")]
    assert {r["model"] for r in rows} == {str(ckpts)}  # one fine-tuning run = one trajectory
    code, _, err = cli(
        ["plot", tmp_path / "runs" / "trajectory.csv", "-k", "trajectory", "-o", tmp_path / "t.png"]
    )
    assert code == 0, err


def _fake_hub_repo(root, commits_files: dict[str, dict[str, bytes]]):
    """A hub cache entry whose snapshots link to content-addressed blobs (as huggingface_hub lays
    them out): ``{commit: {file: bytes}}``; equal bytes share one blob."""
    import hashlib
    import os

    repo = root / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    for commit, files in commits_files.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, snap), snap / name)
    return repo


def test_drop_snapshot_frees_only_unshared_blobs(tmp_path):
    from geomscope.model.hub import drop_snapshot

    repo = _fake_hub_repo(
        tmp_path,
        {
            "a" * 40: {"config.json": b"same", "model.safetensors": b"A" * 1000},
            "b" * 40: {"config.json": b"same"},
        },
    )
    freed = drop_snapshot(repo / "snapshots" / ("a" * 40))
    assert freed == 1000 and not (repo / "snapshots" / ("a" * 40)).exists()
    assert (repo / "snapshots" / ("b" * 40) / "config.json").read_bytes() == b"same"  # shared blob kept
    assert len(list((repo / "blobs").iterdir())) == 1
    assert drop_snapshot(tmp_path) == 0 and tmp_path.exists()  # not a hub cache entry: left alone


def test_drop_weights_keeps_what_was_cached_and_drops_what_was_downloaded(hub, tmp_path, monkeypatch):
    import shutil

    from geomscope.extract import revisions as rv
    from geomscope.extract.options import ExtractOptions

    cache, text = hub
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine, symlinks=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    opts = ExtractOptions(cache_dir=str(mine))
    revs = resolve_revisions(REPO, "step0,step1000")
    res = rv.extract_revisions(REPO, [text], tmp_path / "kept", revs, opts, drop_weights=True)
    assert [r["dropped_bytes"] for r in res["runs"]] == [0, 0]  # in the cache before: never deleted
    snaps = mine / ("models--" + REPO.replace("/", "--")) / "snapshots"
    assert len(list(snaps.iterdir())) == 3
    # as if this call had downloaded step1000 (its snapshot folder absent before the run, written
    # while it loads): its snapshot goes once the run is complete
    from geomscope.extract import run as run_module

    commit = snaps / f"{1:040x}"
    aside = tmp_path / "aside"
    commit.rename(aside)
    real = run_module.extract

    def downloading(*args, **kwargs):
        aside.rename(commit)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "extract", downloading)
    res = rv.extract_revisions(REPO, [text], tmp_path / "dropped", revs[1:], opts, drop_weights=True)
    assert res["runs"][0]["dropped_bytes"] > 0
    assert len(list(snaps.iterdir())) == 2 and not commit.exists()
    assert json.loads((tmp_path / "dropped" / "step1000" / "manifest.json").read_text())["complete"]


def test_score_several_runs_into_one_out(tmp_path, cli):
    from helpers_models import make_tiny_run

    a = make_tiny_run(tmp_path / "a", "bert", name="step10")
    b = make_tiny_run(tmp_path / "b", "bert", name="step20")
    code, out, err = cli(["score", a, b, "--out", tmp_path / "rep", "-q", "--json", "--metrics", "isoscore"])
    assert code == 0, err
    got = json.loads(out)
    assert got["reports"] == [str(tmp_path / "rep" / "step10.json"), str(tmp_path / "rep" / "step20.json")]
    rows = list(csv.DictReader(open(got["trajectory"])))
    assert [r["step"] for r in rows[:: len(rows) // 2]] == ["10", "20"]
    assert not (a / "report.json").exists()  # --out given: nothing written into the runs


@pytest.mark.parametrize("spec", ["step1000\nstep2000", "step1000,step2\x1b[31m", "step1\tstep2"])
def test_a_revision_with_a_control_character_is_refused_whole(cli, tiny_bert, twelve_docs, tmp_path, spec):
    """A newline (or any control character) inside --revisions is named as such, never reported as
    if the part before it had failed."""
    from geomscope.errors import InputError

    with pytest.raises(InputError, match="control character") as e:
        resolve_revisions("EleutherAI/pythia-70m", spec)
    assert "\n" not in str(e.value)
    code, out, err = cli(["extract", tiny_bert, twelve_docs, "--out", tmp_path / "r", "--revisions", spec])
    line = assert_one_line_error(code, out, err, "--revisions", "control character", exit_code=2)
    assert "failed" not in line and not (tmp_path / "r").exists()


def test_the_library_refuses_what_the_command_line_refuses(cli, tiny_bert, twelve_docs, tmp_path):
    """--revision with --revisions, and --drop-weights without them: one rule, one line, in the
    library and on the command line alike, before anything is written."""
    from geomscope.errors import InputError
    from geomscope.extract.options import ExtractOptions
    from geomscope.extract.revisions import extract_revisions
    from geomscope.model.revisions import Revision

    both = "give either --revision (one checkpoint) or --revisions (many), not both"
    revs = [Revision("step0", REPO, "step0")]
    with pytest.raises(InputError, match=re.escape(both)):
        extract_revisions(REPO, [twelve_docs], tmp_path / "lib", revs, ExtractOptions(revision="main"))
    assert not (tmp_path / "lib").exists()
    args = ["extract", tiny_bert, twelve_docs, "--out", tmp_path / "r", "-q"]
    code, out, err = cli([*args, "--revisions", "step0", "--revision", "main"])
    assert_one_line_error(code, out, err, both, exit_code=2)
    code, out, err = cli([*args, "--drop-weights"])
    assert_one_line_error(code, out, err, "--drop-weights applies to --revisions runs", exit_code=2)
    assert not (tmp_path / "r").exists()
