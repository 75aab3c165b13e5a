"""``extract --revisions`` skips a complete run only when it was asked for as now (the request the
run recorded, compared without loading the model); otherwise the revision is extracted as a single
``extract`` would: other inputs, other layers or a replaced checkpoint are never "skipped" with exit
0 over runs that hold the first request's rows."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, hf_cache_with, make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return [make_tiny_model("bert", root / f"seed{i}", seed=i) for i in range(3)]


@pytest.fixture
def ck(models, tmp_path):
    """``ck/step1`` and ``ck/step2``: two checkpoints, and two small inputs."""
    for step, src in zip(("step1", "step2"), models[:2], strict=True):
        shutil.copytree(src, tmp_path / "ck" / step)
    (tmp_path / "small.txt").write_text("\n".join(SAMPLE_TEXTS[:8]) + "\n")
    (tmp_path / "other.txt").write_text("\n".join(SAMPLE_TEXTS[8:16]) + "\n")
    return tmp_path


def _extract(cli, root, text, *more):
    args = ["extract", "x", root / text, "--revisions", str(root / "ck" / "*"), "--out", root / "rev"]
    code, out, err = cli([*args, "--json", *more])
    runs = json.loads(out)["runs"] if out.strip() else None
    return code, runs, err


def _statuses(runs):
    return [r["status"] for r in runs]


def _manifest(root, step):
    return json.loads((root / "rev" / step / "manifest.json").read_text())


def test_rerun_asked_differently_is_extracted_not_skipped(ck, cli):
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0")
    assert code == 0 and _statuses(runs) == ["done", "done"], err
    held = _manifest(ck, "step1")["identity"]
    code, runs, same = _extract(cli, ck, "small.txt", "--layers", "0")  # the same request: no load
    assert code == 0 and _statuses(runs) == ["skipped", "skipped"], same
    # other inputs and other layers: extracted, so refused with the differences
    code, runs, err = _extract(cli, ck, "other.txt", "--layers", "all")
    assert code == 2 and _statuses(runs) == ["failed", "failed"], err
    assert "complete, but asked differently: dataset: 'small.txt' in the run, 'other.txt' now" in err
    assert all("holds a run made with different options" in r["error"] for r in runs)
    assert _manifest(ck, "step1")["identity"] == held
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "all")
    assert code == 2 and _statuses(runs) == ["failed", "failed"] and "layers" in runs[0]["error"], err
    code, runs, err = _extract(cli, ck, "other.txt", "--layers", "all", "--overwrite")
    assert code == 0 and _statuses(runs) == ["done", "done"], err
    assert _manifest(ck, "step1")["identity"]["dataset"] == "other.txt"
    assert "complete and asked for as now" in same


def test_same_rows_asked_another_way_resume_and_are_then_skipped(ck, cli):
    """A request that differs but names the same rows (layer 0 as ``layer_00``): extracted, which
    finds the run complete with nothing to do, and records this request."""
    assert _extract(cli, ck, "small.txt", "--layers", "0")[0] == 0
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "layer_00")
    assert code == 0 and _statuses(runs) == ["done", "done"], err
    assert "options.layers" in err
    assert _manifest(ck, "step1")["request"]["options"]["layers"] == "layer_00"
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "layer_00")
    assert code == 0 and _statuses(runs) == ["skipped", "skipped"], err


def test_replaced_checkpoint_is_not_skipped(ck, models, cli):
    assert _extract(cli, ck, "small.txt", "--layers", "0")[0] == 0
    shutil.rmtree(ck / "ck" / "step1")
    shutil.copytree(models[2], ck / "ck" / "step1")  # another checkpoint at the same place
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0")
    assert code == 2 and _statuses(runs) == ["failed", "skipped"], err
    assert "model.weights" in err  # the request's difference, named in the log line
    assert "holds a run made with different options" in runs[0]["error"]


def test_run_without_a_request_is_extracted_once(ck, cli):
    """A complete run that records no request: extracted (nothing to do), then skipped."""
    from geomscope.fileio import write_text_atomic

    assert _extract(cli, ck, "small.txt", "--layers", "0")[0] == 0
    for step in ("step1", "step2"):
        m = _manifest(ck, step)
        m.pop("request", None)
        write_text_atomic(ck / "rev" / step / "manifest.json", json.dumps(m))
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0")
    assert code == 0 and _statuses(runs) == ["done", "done"] and "no request recorded" in err, err
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0")
    assert code == 0 and _statuses(runs) == ["skipped", "skipped"], err


def test_nonfinite_rows_are_skipped_only_with_allow_nonfinite(ck, cli):
    """A single extract of a complete run with NaN rows exits 3 without --allow-nonfinite: so does
    the rerun of --revisions (never skipped with exit 0)."""
    from helpers_models import poison_token

    for step in ("step1", "step2"):
        poison_token(ck / "ck" / step)
    (ck / "small.txt").write_text("the poison word\n" + "\n".join(SAMPLE_TEXTS[:4]) + "\n")
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0", "--allow-nonfinite")
    assert code == 0 and _manifest(ck, "step1")["totals"]["nonfinite_rows"] > 0, err
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0", "--allow-nonfinite")
    assert code == 0 and _statuses(runs) == ["skipped", "skipped"], err
    code, runs, err = _extract(cli, ck, "small.txt", "--layers", "0")
    assert code == 3 and _statuses(runs) == ["failed", "failed"], err
    assert "NaN/Inf rows and no --allow-nonfinite" in err


REPO = "tiny-org/tiny-bert"


def test_hub_revision_compared_by_the_commit_the_cache_resolves(models, tmp_path, cli, monkeypatch):
    cache = tmp_path / "cache"
    hf_cache_with(models[0], cache, REPO, commit="a" * 40, ref="step1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(SAMPLE_TEXTS[:6]) + "\n")
    args = ["extract", REPO, text, "--revisions", "step1", "--out", tmp_path / "rev", "--cache-dir", cache]
    args += ["--layers", "0", "--json"]

    def status():
        code, out, err = cli(args)
        return code, _statuses(json.loads(out)["runs"]), err

    assert status()[:2] == (0, ["done"])
    assert status()[:2] == (0, ["skipped"])
    m = _manifest(tmp_path, "step1")
    # the revision now resolves to another commit in the cache: extracted, and refused (other weights)
    hf_cache_with(models[1], cache, REPO, commit="b" * 40, ref="step1")
    code, got, err = status()
    assert code == 2 and got == ["failed"] and "model.commit" in err, err
    assert m["request"]["model"]["commit"] == "a" * 40 == m["identity"]["model"]["commit"]
    # not in the cache at all (--drop-weights removed it): compared by name, not downloaded again
    shutil.rmtree(cache / ("models--" + REPO.replace("/", "--")) / "snapshots")
    hf_cache_with(models[0], tmp_path / "other-cache", REPO, commit="a" * 40, ref="step1")
    code, got, err = status()
    assert code == 0 and got == ["skipped"] and "compared by name" in err, err


def test_one_line_error_for_a_failed_revision_still(ck, cli):
    """The failure contract holds for a refused revision (one error: line, exit 2)."""
    assert _extract(cli, ck, "small.txt", "--layers", "0")[0] == 0
    args = ["extract", "x", ck / "other.txt", "--revisions", str(ck / "ck" / "*"), "--out", ck / "rev", "-q"]
    code, out, err = cli(args)
    assert_one_line_error(code, out, err, "2 of 2 revisions failed", "holds a run made with", exit_code=2)
