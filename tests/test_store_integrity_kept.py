"""One notion of a valid ``--keep sample`` shard (store/integrity.py's check_shard): ``score``,
``inspect --verify`` and resume refuse the same crafted shards, each in one line naming the shard. A
hostile run ships a manifest whose checksums match its shards, so every case here rewrites the
manifest's size and checksums to match the altered file (geomscope's own checksum functions): the
content checks themselves must catch it. The runs are written by the store and the sample keeper
(no model): two layers of D = 8, two shards of 600 measured rows, samples of 5 rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, edit_manifest

from geomscope.errors import DataError
from geomscope.extract.keep import SampleKeeper
from geomscope.score import ScoreOptions, score
from geomscope.store import RunWriter, describe_run
from geomscope.store.checksum import digests

D, TOKENS, DOC_ROWS = 8, 600, 20
LAYERS = ["layer_00", "layer_01"]
OPTS = ScoreOptions(metrics=("isoscore", "avgcos", "twonn"))


def sample_run(dest: Path, *, seed: int = 0, size: int = 5, complete: bool = True) -> Path:
    """A ``--keep sample:size`` run of two shards (the same rows whatever ``seed``: only the sample
    differs), written as extract writes one; layer_01 has 4 rows of NaN per shard."""
    ident = {
        "model": {"name": "synthetic", "hidden_size": D},
        "layers": [{"name": n, "index": i} for i, n in enumerate(LAYERS)],
        "keep": f"sample:{size}",
        "sample_seed": seed,
    }
    rng = np.random.default_rng(0)
    with RunWriter(dest, ident) as w:
        for s in range(2):
            doc_start = 100 * s
            meta = {
                "token_id": np.arange(TOKENS),
                "doc_id": doc_start + np.arange(TOKENS) // DOC_ROWS,
                "position": np.arange(TOKENS) % DOC_ROWS,
                "is_special": np.arange(TOKENS) % DOC_ROWS == 0,
            }
            rows = {n: rng.normal(size=(TOKENS, D)).astype(np.float16) for n in LAYERS}
            rows["layer_01"][[3, 50, 51, 400]] = np.nan
            keeper = SampleKeeper(LAYERS, D, torch.device("cpu"), size, seed)
            keeper.add({n: torch.from_numpy(x) for n, x in rows.items()}, meta)
            sw = w.shard_writer(
                s,
                layer_names=LAYERS,
                dim=D,
                store_dtype="float16",
                doc_start=doc_start,
                doc_stop=doc_start + TOKENS // DOC_ROWS,
            )
            sw.keep_accumulators(keeper, size, seed)
            w.add_shard(sw.close(), stats={"nonfinite_by_layer": dict(sw.nonfinite_by_layer)})
        if complete:
            w.finalize({"docs": 2 * TOKENS // DOC_ROWS})
    return dest


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return sample_run(tmp_path_factory.mktemp("kept") / "run")


@pytest.fixture
def run(clean, tmp_path) -> Path:
    shutil.copytree(clean, tmp_path / "run")
    return tmp_path / "run"


def match_manifest(run: Path, index: int = 1) -> None:
    """Shard ``index``'s manifest entry rewritten to the file's size and checksums."""

    def edit(m):
        entry = m["shards"][index]
        path = run / entry["file"]
        entry["bytes"] = path.stat().st_size
        entry.update(digests(path))

    edit_manifest(run, edit)


def edit_shard(run: Path, edit) -> None:
    """Shard 1 changed by ``edit(f)`` (an h5py file open for writing), its manifest entry made to match."""
    with h5py.File(run / "shard-00001.h5", "a") as f:
        edit(f)
    match_manifest(run)


def refused_alike(cli, run: Path, *needles: str) -> None:
    """``score`` and ``inspect --verify`` refuse the run in one line naming shard 1 and ``needles``;
    the verification lists that shard alone."""
    code, out, err = cli(["score", run, "--metrics", "isoscore,avgcos,twonn", "--quiet"])
    assert_one_line_error(code, None, err, "shard-00001.h5", *needles)
    code, out, err = cli(["inspect", run, "--verify"])
    assert_one_line_error(code, None, err, "shard-00001.h5")
    bad = describe_run(run, verify=True)["verify"]["bad"]
    assert [b["file"] for b in bad] == ["shard-00001.h5"]
    assert all(n in bad[0]["error"] for n in needles), bad[0]["error"]


def test_the_clean_run_scores_and_verifies(clean):
    assert describe_run(clean, verify=True)["verify"]["ok"]
    rep = score(clean, OPTS)
    assert [la["dropped"]["nonfinite"] for la in rep["layers"]] == [0, 8]
    assert rep["params"]["id_sample"] == 5  # --id-sample left out: what the run kept


# ------------------------------------------------------------------ R18: counts against row counts
def _lower_n(f):
    g = f["accumulators/layer_00/regular"]
    g.attrs["n"] = int(g.attrs["n"]) - 5


def test_an_accumulator_count_below_the_rows_measured_is_refused(cli, run):
    """n lowered by 5: scored as 5 NaN rows layer_00 does not have, its metrics divided by the wrong n.
    Its sums hold the rows they hold: 5 more than n."""
    edit_shard(run, _lower_n)
    refused_alike(cli, run, "layer_00/regular has n = 565", "unit sums hold 570 rows")


def test_nan_rows_an_entry_claims_beyond_the_accumulators_are_refused(cli, run):
    """The entry says 5 rows of layer_00 are NaN; its accumulators count all 600 as finite."""
    edit_manifest(run, lambda m: m["shards"][1]["stats"]["nonfinite_by_layer"].update(layer_00=5))
    refused_alike(cli, run, "layer_00 count 600 rows and its entry 5 with NaN or Inf, not the 600")


# ------------------------------------------------------------------ R19: the sample's seed and size
@pytest.fixture(scope="module")
def seed_one(tmp_path_factory) -> Path:
    return sample_run(tmp_path_factory.mktemp("kept-seed-1") / "run", seed=1)


def _graft(run: Path, other: Path) -> None:
    """Shard 1 of ``other`` (the same rows, another sample) put in ``run`` with its manifest entry."""
    shutil.copy(other / "shard-00001.h5", run / "shard-00001.h5")
    entry = json.loads((other / "manifest.json").read_text())["shards"][1]
    edit_manifest(run, lambda m: m["shards"].__setitem__(1, entry))


def test_a_shard_of_another_seed_is_refused(cli, run, seed_one):
    _graft(run, seed_one)
    refused_alike(cli, run, "kept the sample of seed 1, the run's is seed 0")


def test_a_shard_of_another_seed_that_says_it_is_of_this_one_is_refused(cli, run, seed_one):
    _graft(run, seed_one)
    edit_shard(run, lambda f: f.attrs.__setitem__("sample_seed", 0))
    refused_alike(cli, run, "drawn under another seed")


def test_a_manifest_that_claims_a_larger_sample_is_refused(cli, run):
    """keep sample:5000 over shards that kept 5: TwoNN from 5 rows a shard, said to be from 5000."""
    edit_manifest(run, lambda m: m["identity"].update(keep="sample:5000"))
    code, out, err = cli(["score", run, "--metrics", "isoscore,twonn", "--quiet"])
    assert_one_line_error(code, None, err, "shard-00000.h5", "samples of 5 rows", "sample:5000")


def test_shards_that_claim_the_larger_sample_too_are_refused(cli, run):
    edit_manifest(run, lambda m: m["identity"].update(keep="sample:5000"))
    for index in (0, 1):
        with h5py.File(run / f"shard-0000{index}.h5", "a") as f:
            f.attrs["sample_size"] = 5000
        match_manifest(run, index)
    code, out, err = cli(["score", run, "--metrics", "isoscore,twonn", "--quiet"])
    assert_one_line_error(code, None, err, "shard-00000.h5", "where a sample of 5000")


# ------------------------------------------------------------------ R20: verify = score
def test_verify_refuses_the_nan_mean_that_score_refuses(cli, run):
    def nan_mean(f):
        ds = f["accumulators/layer_00/regular/mean"]
        a = ds[()]
        a[2] = np.nan
        ds[...] = a

    edit_shard(run, nan_mean)
    refused_alike(cli, run, "NaN or Inf in mean")


def test_unflagged_nan_sample_rows_are_refused(cli, run):
    def unflag(f):
        f["nonfinite/layer_01"][...] = np.zeros(f["nonfinite/layer_01"].shape, bool)
        ds = f["layers/layer_01"]
        a = ds[()]
        a[0] = np.nan
        ds[...] = a

    edit_shard(run, unflag)
    with pytest.raises(DataError, match="shard-00001.h5.*layer_01 hold NaN or Inf that its non-finite"):
        score(run, OPTS)
    bad = describe_run(run, verify=True)["verify"]["bad"]
    assert [b["file"] for b in bad] == ["shard-00001.h5"]


def test_resume_redoes_a_shard_that_a_read_would_refuse(tmp_path):
    """A shard whose checksums match but whose accumulators score refuses is not kept on resume."""
    run = sample_run(tmp_path / "run", complete=False)
    edit_shard(run, _lower_n)
    ident = json.loads((run / "manifest.json").read_text())["identity"]
    with RunWriter(run, ident) as w:
        assert sorted(w.finished) == [0]


# ------------------------------------------------------------------ what the run says back
@pytest.mark.parametrize("seed", [-1, 2**64, "0", 1.5])
def test_a_damaged_seed_is_refused_not_given_as_advice(cli, run, seed):
    edit_manifest(run, lambda m: m["identity"].update(sample_seed=seed))
    code, out, err = cli(["score", run, "--metrics", "twonn", "--seed", "3", "--quiet"])
    line = assert_one_line_error(code, None, err, "identity.sample_seed is")
    assert "--seed -1" not in line and "--seed 3" not in line


def test_an_id_sample_larger_than_the_kept_sample_is_still_refused(cli, run):
    code, out, err = cli(["score", run, "--metrics", "twonn", "--id-sample", "6", "--quiet"])
    assert_one_line_error(code, None, err, "--id-sample 6 is larger than the sample of 5")
