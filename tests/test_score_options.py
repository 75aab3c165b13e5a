"""ScoreOptions from the library: numpy scalars are numbers, a str is a comma list (not its
characters), seeds stay within the 64 bits the row samples hash, --id-repeats within what
--id-sample can fill; and an intrinsic dimension whose sample is too small to split keeps its value
with a null standard error."""

from __future__ import annotations

import numpy as np
import pytest

from geomscope.errors import InputError
from geomscope.options import OptionError
from geomscope.score import ScoreOptions, score


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------ numpy scalars
def test_numpy_scalars_are_numbers():
    o = ScoreOptions(
        max_rows=np.int64(500),
        zeta=np.float32(0.25),
        seed=np.uint64(7),
        id_sample=np.int32(300),
        workers=np.int16(1),
        jackknife_groups=np.int64(5),
        outlier_threshold=np.float64(4.0),
        discard_fraction=np.float32(0.5),
        memory_mb=np.int64(512),
        ranks=(np.int64(8), 32),
    ).validate()
    assert (o.max_rows, o.seed, o.id_sample, o.workers, o.jackknife_groups) == (500, 7, 300, 1, 5)
    assert o.zeta == 0.25 and o.outlier_threshold == 4.0 and o.discard_fraction == 0.5 and o.ranks == (8, 32)
    # plain Python numbers, as the JSON report writes them
    assert type(o.max_rows) is int and type(o.seed) is int and type(o.zeta) is float


@pytest.mark.parametrize(
    "field, value",
    [("max_rows", True), ("max_rows", np.bool_(True)), ("zeta", np.bool_(False)), ("seed", np.float64(3.0))],
)
def test_bools_and_fractions_are_still_refused(field, value):
    with pytest.raises(InputError, match=f"--{field.replace('_', '-')} must be a"):
        ScoreOptions(**{field: value}).validate()


def test_the_library_scores_with_numpy_scalars(tmp_path):
    x = np.random.default_rng(0).normal(size=(800, 6))
    np.save(tmp_path / "x.npy", x)
    rep = score(
        tmp_path / "x.npy", ScoreOptions(metrics="isoscore", max_rows=np.int64(500), seed=np.int64(1))
    )
    assert rep["params"]["max_rows"] == 500 and rep["layers"][0]["n_rows"] == 500


# ------------------------------------------------------------------------------ a str is a comma list
def test_a_str_is_a_comma_list():
    o = ScoreOptions(
        metrics="isoscore, avgcos",
        avgcos_variants="centred",
        id_estimator="mle",
        layers="layer_01,layer_02",
        columns="a",
    ).validate()
    assert o.metrics == ("isoscore", "avgcos")
    assert o.avgcos_variants == ("centred",) and o.id_estimator == ("mle",) and o.extra_id == ("mle",)
    assert o.layers == ("layer_01", "layer_02") and o.columns == ("a",)
    # one name, not split into characters ("unknown metric 'i'", layers 'l', 'a', ...)
    assert ScoreOptions(metrics="isoscore").validate().metrics == ("isoscore",)
    assert ScoreOptions(layers="layer_01").validate().layers == ("layer_01",)


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("metrics", "", "--metrics is empty"),
        ("metrics", " , ", "--metrics is empty"),
        ("layers", "", "--layers is empty"),
        ("layers", ",", "--layers is empty"),
        ("layers", (), "--layers is empty"),
        ("columns", " ", "--column is empty"),
        ("avgcos_variants", ",", "--avgcos-variants is empty"),
    ],
)
def test_an_empty_selection_is_refused_not_read_as_everything(field, value, said):
    with pytest.raises(InputError, match=said) as e:
        ScoreOptions(**{field: value}).validate()
    _one_line(e)


def test_a_str_selects_layers_and_arrays(tmp_path):
    from test_score import make_run

    run = tmp_path / "run"
    make_run(run, n_shards=1, rows=200, layers=("layer_00", "layer_01", "layer_02"))
    rep = score(run, ScoreOptions(metrics="isoscore", layers="layer_01,layer_02"), log=lambda m: None)
    assert [e["layer"] for e in rep["layers"]] == ["layer_01", "layer_02"]
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "x.npz", a=rng.normal(size=(300, 5)), b=rng.normal(size=(300, 5)))
    rep = score(tmp_path / "x.npz", ScoreOptions(metrics="isoscore", columns="b"), log=lambda m: None)
    assert [e["layer"] for e in rep["layers"]] == ["b"]


# ------------------------------------------------------------------------------ --seed
def test_seeds_are_bounded_by_the_64_bit_hash():
    from geomscope.score.options import MAX_SEED
    from geomscope.store.sample import STREAM_MAX_ROWS, row_hash

    keys = np.arange(1000, dtype=np.uint64)
    # why: the hash reduces the seed mod 2^64, so 2^64 + s drew the rows of s (the decimation's
    # numpy generator does not reduce it: the same rows, another split)
    assert (row_hash(keys, 2**64 + 5, STREAM_MAX_ROWS) == row_hash(keys, 5, STREAM_MAX_ROWS)).all()
    assert MAX_SEED == 2**64 - 1
    assert ScoreOptions(seed=MAX_SEED).validate().seed == MAX_SEED
    with pytest.raises(InputError, match=r"--seed must be a whole number from 0 to 2\^64 - 1") as e:
        ScoreOptions(seed=2**64 + 5).validate()
    _one_line(e)


# ------------------------------------------------------------------------------ --id-repeats
@pytest.mark.parametrize("id_sample, repeats", [(5000, 4), (12, 4), (11, 3), (8, 2), (6, 2), (5, 2), (3, 2)])
def test_the_default_repeats_are_what_the_sample_can_fill(id_sample, repeats):
    assert ScoreOptions(id_sample=id_sample).validate().id_repeats == repeats


@pytest.mark.parametrize(
    "id_sample, repeats, most", [(5000, 99999999999999, 1666), (5000, 2000, 1666), (8, 3, 2)]
)
def test_more_repeats_than_the_sample_can_fill_are_refused(id_sample, repeats, most):
    # 10^14 parts ran the decimation out of memory ("out of memory", after the whole pass)
    with pytest.raises(InputError, match=f"give at most {most}, or a larger --id-sample") as e:
        ScoreOptions(id_sample=id_sample, id_repeats=repeats).validate()
    assert f"--id-repeats {repeats}" in _one_line(e)
    assert ScoreOptions(id_sample=id_sample, id_repeats=most).validate().id_repeats == most


@pytest.mark.parametrize(
    "kept, id_sample, repeats", [(None, 5000, 4), (60, 60, 4), (9000, 5000, 4), (8, 8, 2), (11, 11, 3)]
)
def test_a_left_out_id_sample_is_what_a_kept_sample_can_serve(kept, id_sample, repeats):
    """--id-sample left out: 5000, or a --keep sample:N run's N where fewer (5000 refused such a run
    unless --id-sample N was given), with the --id-repeats that sample fills; a given one stays."""
    o = ScoreOptions().validate().for_kept_sample(kept)
    assert (o.id_sample, o.id_repeats) == (id_sample, repeats)
    assert ScoreOptions(id_sample=7000).validate().for_kept_sample(kept).id_sample == 7000
    with pytest.raises(InputError, match="give at most 2, or a larger --id-sample"):
        ScoreOptions(id_repeats=3).validate().for_kept_sample(8)


# ------------------------------------------------------------------------------ ID value apart from its SE
def _sample_order(n: int, seed: int) -> np.ndarray:
    """The rows of an n-row array in the order of the ID sample (the smallest seeded hashes first)."""
    from geomscope.store.sample import STREAM_ID_SAMPLE, row_hash

    return np.argsort(row_hash(np.arange(n, dtype=np.uint64), seed, STREAM_ID_SAMPLE), kind="stable")


@pytest.mark.parametrize("id_sample", [3, 5, 11])
def test_a_small_id_sample_keeps_its_twonn_value(tmp_path, id_sample):
    skdim = pytest.importorskip("skdim")
    x = np.random.default_rng(2).normal(size=(400, 6))
    np.save(tmp_path / "x.npy", x)
    # --id-sample 3..11 nulled TwoNN itself: 4 parts of >= 3 rows cannot be cut from 11
    opts = ScoreOptions(metrics=("twonn", "mle"), id_sample=id_sample)
    e = score(tmp_path / "x.npy", opts, log=lambda m: None)["layers"][0]
    sample = x[_sample_order(400, 0)[:id_sample]]
    assert e["twonn"] == pytest.approx(skdim.id.TwoNN().fit(sample).dimension_, rel=1e-9)
    assert e["id_mle"] == pytest.approx(skdim.id.MLE().fit(sample).dimension_, rel=1e-9)
    if id_sample < 6:  # not even 2 parts: the value stands, its SE is null with the reason
        assert e["se"]["twonn"] is None and e["se"]["id_mle"] is None
        for key in ("twonn", "id_mle"):
            assert "too few to split into --id-repeats 2 parts of >= 3" in e["notes"][f"se.{key}"]
    else:  # the default parts shrink to what the sample fills (3 of 11 rows)
        assert e["se"]["twonn"] is not None and e["se"]["id_mle"] is not None


def test_fewer_distinct_rows_than_the_parts_need_keep_the_value(tmp_path):
    skdim = pytest.importorskip("skdim")
    base = np.random.default_rng(3).normal(size=(9, 5))
    x = np.repeat(base, 40, axis=0)  # 360 rows, 9 distinct: 4 parts of >= 3 need 12
    np.save(tmp_path / "x.npy", x)
    e = score(tmp_path / "x.npy", ScoreOptions(metrics=("twonn",)), log=lambda m: None)["layers"][0]
    assert e["twonn_n_used"] == 9 and e["twonn_duplicates_removed"] == 351
    assert e["twonn"] == pytest.approx(skdim.id.TwoNN().fit(base).dimension_, rel=1e-9)
    assert e["se"]["twonn"] is None
    assert e["notes"]["se.twonn"].startswith("9 distinct sampled rows are too few to split")


def test_the_twonn_standard_error_is_the_decimation_of_the_sample(tmp_path):
    skdim = pytest.importorskip("skdim")
    x = np.random.default_rng(4).normal(size=(60, 6))
    np.save(tmp_path / "x.npy", x)
    e = score(tmp_path / "x.npy", ScoreOptions(metrics=("twonn",), seed=3), log=lambda m: None)["layers"][0]
    sample = x[_sample_order(60, 3)]
    parts = np.array_split(np.random.default_rng(3).permutation(60), 4)  # the seeded split, 4 parts
    reps = [skdim.id.TwoNN().fit(sample[np.sort(p)]).dimension_ for p in parts]
    assert e["twonn"] == pytest.approx(skdim.id.TwoNN().fit(sample).dimension_, rel=1e-9)
    assert e["se"]["twonn"] == pytest.approx(np.std(reps, ddof=1) / 2, rel=1e-9)


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("ranks", "", "--rank must be a comma list of ranks"),
        ("abtt_k", " , ", "--abtt-k must be a comma list of directions"),
        ("position_edges", (), "--position-edges must be a comma list of positions"),
        ("metrics", "isoscore,nope", "--metrics must be a comma list of metric names (all, isoscore,"),
        ("id_estimator", "twonn,bogus", "--id-estimator must be a comma list of estimator names (twonn,"),
        ("avgcos_variants", "centred,x", "--avgcos-variants must be a comma list of average cosine"),
    ],
)
def test_lists_are_refused_by_their_declarations(field, value, said):
    with pytest.raises(OptionError) as e:
        ScoreOptions(**{field: value}).validate()
    assert str(e.value).startswith(said)
    _one_line(e)


def test_names_are_read_in_any_case_and_spelling():
    o = ScoreOptions(metrics="IsoScore,AVGCOS", avgcos_variants="Centered,raw,plain", id_estimator="MLE")
    o = o.validate()
    assert o.metrics == ("isoscore", "avgcos") and o.avgcos_variants == ("centred", "plain")
    assert o.id_estimator == ("mle",) and o.extra_id == ("mle",)
