"""The ``--layers`` grammar (geomscope.layers): every form and every refusal against a model, a run
and a report, the ``.grad`` names, and each command (extract, score, export, plot, finetune) picking
the same layers for the same selection."""

from __future__ import annotations

import json

import pytest

from geomscope.errors import InputError
from geomscope.layers import (
    FINAL_NORM_LAYER,
    activation_name,
    gradient_name,
    is_final_norm,
    is_gradient,
    is_hidden_state,
    layer_items,
    layer_name,
    layer_number,
    listed_layers,
    model_layers,
    module_layer_name,
    names_layer,
    parse_layers,
    select_names,
    stored_layers,
)

#: a model of 5 hidden states (embeddings, 4 blocks) whose final norm is a layer of its own (index 5)
MODEL = model_layers(5, final_norm=True)
ALL = ["layer_00", "layer_01", "layer_02", "layer_03", "layer_04", "final_norm"]
#: a gradient run of blocks 1 and 2 and the final norm: activations, then their gradients
GRAD_RUN = stored_layers(
    [
        {"name": n, "index": i}
        for n, i in [
            ("layer_01", 1),
            ("layer_02", 2),
            ("final_norm", 3),
            ("layer_01.grad", 1),
            ("layer_02.grad", 2),
            ("final_norm.grad", 3),
        ]
    ]
)
#: a run extracted with --layers 0,6: indices with a gap
SPARSE_RUN = stored_layers([{"name": "layer_00", "index": 0}, {"name": "layer_06", "index": 6}])


# ------------------------------------------------------------------------------ names
def test_gradient_names_are_added_and_stripped_by_one_helper():
    assert gradient_name("layer_06") == "layer_06.grad" == gradient_name("layer_06.grad")
    assert activation_name("layer_06.grad") == "layer_06" == activation_name("layer_06")
    assert is_gradient("final_norm.grad") and not is_gradient("layer_06")
    assert is_final_norm("final_norm") and is_final_norm("final_norm.grad") and not is_final_norm("layer_05")


def test_layer_names_are_padded_to_the_last_index():
    assert layer_name(6, 7) == "layer_06" and layer_name(0, 3) == "layer_00"
    assert layer_name(3, 13) == "layer_03" and layer_name(7, 101) == "layer_007"
    assert [la.name for la in model_layers(3).layers] == ["layer_00", "layer_01", "layer_02"]
    assert model_layers(3, final_norm=True).layers[-1].index == 3


# ------------------------------------------------------------------------------ every form
@pytest.mark.parametrize(
    "spec, want",
    [
        (None, ALL),
        ("", ALL),
        ("  ", ALL),
        ([], ALL),
        ("all", ALL),
        ("ALL", ALL),
        ("blocks", ALL[1:5]),
        ("blocks,final_norm", ALL[1:]),
        ("3", ["layer_03"]),
        ("0,4", ["layer_00", "layer_04"]),
        ("-1", ["layer_04"]),  # the last block, never final_norm
        ("-5", ["layer_00"]),
        ("1-3", ALL[1:4]),
        ("1 - 2", ALL[1:3]),
        ("-3--1", ALL[2:5]),
        ("0--4", ALL[0:2]),
        ("layer_01-layer_02", ALL[1:3]),
        ("layer_03", ["layer_03"]),
        ("layer_3", ["layer_03"]),  # any zero padding
        ("final_norm", ["final_norm"]),
        ("FINAL_NORM", ["final_norm"]),
        ("5", ["final_norm"]),  # its index, N + 1
        ("3-5", ["layer_03", "layer_04", "final_norm"]),
        ("3,1,3", ["layer_01", "layer_03"]),  # the thing's order, each once
        ([3, "1"], ["layer_01", "layer_03"]),
        (["0,1", " 2 "], ALL[0:3]),  # list items may hold commas (repeated CLI options)
        ("blocks,0", ALL[0:5]),
    ],
)
def test_every_form_against_a_model(spec, want):
    assert select_names(spec, MODEL) == want


@pytest.mark.parametrize(
    "spec, want",
    [
        ("1", ["layer_01", "layer_01.grad"]),  # an index: the activation and its gradient
        ("-1", ["layer_02", "layer_02.grad"]),
        ("-2", ["layer_01", "layer_01.grad"]),
        ("layer_01", ["layer_01"]),  # a name: that layer alone
        ("layer_1", ["layer_01"]),
        ("layer_01.grad", ["layer_01.grad"]),
        ("layer_1.grad", ["layer_01.grad"]),
        ("final_norm.grad", ["final_norm.grad"]),
        ("blocks", ["layer_01", "layer_02", "layer_01.grad", "layer_02.grad"]),
        ("1-2", ["layer_01", "layer_02", "layer_01.grad", "layer_02.grad"]),
        ("all", GRAD_RUN.names),
    ],
)
def test_every_form_against_a_gradient_run(spec, want):
    assert select_names(spec, GRAD_RUN) == want


def test_a_run_with_gaps_and_a_run_without_indices():
    assert select_names("-1", SPARSE_RUN) == ["layer_06"] == select_names("blocks", SPARSE_RUN)
    assert select_names("0,1-5", SPARSE_RUN) == ["layer_00"]  # a range may pass over absent indices
    assert select_names("0-6", SPARSE_RUN) == ["layer_00", "layer_06"]
    # a layer without an integer index takes its position (as a report's layer_key does)
    odd = stored_layers([{"name": "a"}, {"name": "b", "index": True}, {"name": "c", "index": "2"}])
    assert select_names("1-2", odd) == ["b", "c"] and select_names("-1", odd) == ["c"]


#: a run of 2 blocks with module layers (extract --modules): before, inside and after the blocks
MODULE_RUN = stored_layers(
    [
        {"name": "embeddings.LayerNorm", "index": 0, "kind": "module", "block": None},
        {"name": "layer_00", "index": 0},
        {"name": "h.0.ln_1:in", "index": 1, "kind": "module", "block": 0},
        {"name": "h.0.attn.c_attn:q", "index": 1, "kind": "module", "block": 0},
        {"name": "layer_01", "index": 1},
        {"name": "h.1.mlp", "index": 2, "kind": "module", "block": 1},
        {"name": "layer_02", "index": 2},
        {"name": "ln_f:in", "index": 3, "kind": "module", "block": None},
        {"name": "final_norm", "index": 3, "kind": "final_norm"},
        {"name": "h.1.mlp.grad", "index": 2, "kind": "module", "block": 1},
        {"name": "ln_f:in.grad", "index": 3, "kind": "module", "block": None},
    ]
)


def test_module_layers_have_their_block_s_index_and_names():
    assert module_layer_name("h.0.ln_1", "in") == "h.0.ln_1:in"
    assert module_layer_name("h.0.attn.c_attn", "out", "q") == "h.0.attn.c_attn:q"
    assert module_layer_name("h.0.mlp") == "h.0.mlp"
    assert select_names("h.0.ln_1:in,h.1.mlp.grad", MODULE_RUN) == ["h.0.ln_1:in", "h.1.mlp.grad"]
    assert select_names("1", MODULE_RUN) == ["h.0.ln_1:in", "h.0.attn.c_attn:q", "layer_01"]
    # -1 and blocks count the residual stream: a module after the blocks is not in it, as final_norm
    assert select_names("-1", MODULE_RUN) == ["h.1.mlp", "layer_02", "h.1.mlp.grad"]
    assert "ln_f:in" not in select_names("blocks", MODULE_RUN)
    assert "embeddings.LayerNorm" not in select_names("blocks", MODULE_RUN)
    assert select_names("3", MODULE_RUN) == ["ln_f:in", "final_norm", "ln_f:in.grad"]


def test_a_report_is_read_by_its_layers_and_their_indices():
    rep = listed_layers(["layer_00", "layer_06", "final_norm"], [0, 6, 7], "r.json")
    assert select_names("blocks", rep) == ["layer_06"]
    assert select_names("7", rep) == ["final_norm"] and select_names("-1", rep) == ["layer_06"]


def test_parse_layers_and_the_items_of_a_selection():
    assert parse_layers("blocks", 7) == [1, 2, 3, 4, 5, 6] and parse_layers(None, 3) == [0, 1, 2]
    assert parse_layers("0,2-3,-1", 7) == [0, 2, 3, 6]
    assert layer_items(" a, ,b ") == ["a", "b"] and layer_items(["1,2", 3]) == ["1", "2", "3"]
    assert layer_items(None) == [] and layer_items(",") == []
    assert names_layer("0,Final_Norm", FINAL_NORM_LAYER) and not names_layer("0", FINAL_NORM_LAYER)


# ------------------------------------------------------------------------------ every refusal
@pytest.mark.parametrize(
    "things, spec, needle",
    [
        (MODEL, "9", "layer 9 is out of range"),
        (MODEL, "-6", "layer -6 is out of range"),
        (MODEL, "0-9", "layer 9 is out of range"),
        (MODEL, "layer_42", "layer 'layer_42' is out of range"),
        (MODEL, "x", "layer 'x' is not in this model (not a layer index"),
        (MODEL, "1.grad", "layer '1.grad' is not in this model"),  # .grad follows names only
        (MODEL, "layer_04.grad", "which has no gradient layers"),
        (MODEL, "3-1", "range 3-1 runs backwards; write it low-high, e.g. 1-3"),
        (MODEL, ",", "',' selects no layer"),
        (MODEL, [","], "',' selects no layer"),
        (MODEL, "1+2", "layer '1+2' is not in this model"),
        (GRAD_RUN, "7", "layer 7 is not in this run"),
        (GRAD_RUN, "0", "layer 0 is not in this run"),
        (GRAD_RUN, "layer_42", "layer 'layer_42' is not in this run"),
        (GRAD_RUN, "layer_07.grad", "layer 'layer_07.grad' is not in this run"),
        (SPARSE_RUN, "3", "layer 3 is not in this run"),
        (SPARSE_RUN, "1-5", "'1-5' selects no layer"),
        (SPARSE_RUN, "-3", "layer -3 is not in this run"),
        (listed_layers(["layer_00"], [0], "r.json"), "layer_99", "layer 'layer_99' is not in r.json"),
    ],
)
def test_every_refusal_is_one_line_that_says_what_there_is(things, spec, needle):
    with pytest.raises(InputError) as e:
        select_names(spec, things)
    msg = str(e.value)
    assert needle in msg and msg.startswith("--layers: ") and "\n" not in msg
    assert f"{things.where} has " in msg and "use e.g. --layers " in msg


def test_the_refusal_names_the_option_and_the_model_s_hidden_states():
    with pytest.raises(InputError, match=r"^--shrinkage: .*5 hidden states: 0 = embeddings, 1\.\.4 = blocks"):
        select_names("9", model_layers(5, option="--shrinkage"))
    with pytest.raises(InputError, match=r"5 = final_norm.*use e\.g\. --layers all, blocks, 0,4 or 1-4"):
        select_names("9", MODEL)


# ------------------------------------------------------------------------------ every command
#: a selection -> the layers every command picks from a model of 5 hidden states with a final norm
SPECS = {
    "all": ALL,
    "blocks": ALL[1:5],
    "-1": ["layer_04"],
    "0,2-3": ["layer_00", "layer_02", "layer_03"],
    "layer_01-layer_02,-1": ["layer_01", "layer_02", "layer_04"],
    "-3--2": ["layer_02", "layer_03"],
    "final_norm,1": ["layer_01", "final_norm"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny GPT-2 of 4 blocks (5 hidden states and a final norm), extracted whole, and a tiny BERT
    classifier of 4 blocks (5 hidden states, no final norm) for finetune."""
    from helpers_models import SAMPLE_TEXTS, make_tiny_model
    from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

    from geomscope.extract.run import extract

    d = tmp_path_factory.mktemp("layers")
    gpt = make_tiny_model("gpt2", d, name="tiny-gpt2-4", n_layer=4)
    src = d / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS) + "\n")
    summary = extract(str(gpt), [src], d / "run", layers="all", store_dtype="float32")
    return {
        "dir": d,
        "gpt": gpt,
        "src": src,
        "run": d / "run",
        "all": summary["layers"],
        "bert": make_checkpoint(d / "bert", words_of([]), layers=4),
        "train": write_csv(d / "train.csv", synthetic_rows(16, 0)),
        "eval": write_csv(d / "dev.csv", synthetic_rows(8, 1)),
    }


@pytest.fixture(scope="module")
def whole_report(models):
    from geomscope.score import ScoreOptions, score

    return score(models["run"], ScoreOptions(metrics=("isoscore",), jackknife_groups=0))


def test_extract_keeps_what_the_grammar_selects(models, tmp_path):
    from geomscope.extract.run import extract

    assert models["all"] == SPECS["all"]
    for i, spec in enumerate(["layer_01-layer_02,-1", "final_norm,1"]):
        got = extract(str(models["gpt"]), [models["src"]], tmp_path / f"r{i}", layers=spec)
        assert got["layers"] == SPECS[spec], spec


@pytest.mark.parametrize("spec", list(SPECS))
def test_score_selects_the_same_layers(models, spec):
    from geomscope.score import ScoreOptions, score

    rep = score(models["run"], ScoreOptions(metrics=("isoscore",), jackknife_groups=0, layers=spec))
    assert [e["layer"] for e in rep["layers"]] == SPECS[spec]


@pytest.mark.parametrize("spec", list(SPECS))
def test_export_selects_the_same_layers(models, spec, tmp_path):
    from geomscope.export import export_run

    summary = export_run(models["run"], tmp_path / "e", to="npy", layers=[spec])
    assert summary["layers"] == SPECS[spec]


@pytest.mark.parametrize("spec", list(SPECS))
def test_plot_selects_the_same_layers(whole_report, spec):
    from geomscope.plot._reports import select_layers

    (kept,) = select_layers([whole_report], [spec])
    assert [e["layer"] for e in kept["layers"]] == SPECS[spec]


@pytest.mark.parametrize("spec", list(SPECS))
def test_finetune_selects_the_same_hidden_states(models, spec):
    """finetune reads a model without a final norm of its own: the same indices, and ``final_norm``
    refused as a layer the model lacks."""
    from geomscope.train import FinetuneConfig
    from geomscope.train.loop import planned_fingerprint

    cfg = FinetuneConfig(
        model=str(models["bert"]),
        train=str(models["train"]),
        eval=str(models["eval"]),
        out=str(models["dir"] / "ft"),
        device="cpu",
        layers=spec,
    )
    if FINAL_NORM_LAYER in SPECS[spec] and spec != "all":
        with pytest.raises(InputError, match="layer 'final_norm' is not in this model"):
            planned_fingerprint(cfg)
        return
    want = [int(n.removeprefix("layer_")) for n in SPECS[spec] if n != FINAL_NORM_LAYER]
    assert planned_fingerprint(cfg)["layers"] == want


def test_the_cli_takes_ranges_blocks_and_negative_indices(cli, models, whole_report, tmp_path):
    """score, export and plot accept what extract accepts (they refused ranges, ``blocks`` and, in
    plot, ``-1``)."""
    from test_plot_factory import write_report

    code, out, err = cli(
        ["score", models["run"], "--json", "-m", "isoscore", "-l", "1-2", "--out", tmp_path / "s"]
    )
    assert code == 0, err
    assert [e["layer"] for e in json.loads(out)["layers"]] == ALL[1:3]
    code, out, err = cli(
        ["export", models["run"], "--to", "npy", "--out", tmp_path / "x", "-l", "blocks", "-q"]
    )
    assert code == 0, err
    assert json.loads((tmp_path / "x" / "geomscope-export.json").read_text())["layers"] == ALL[1:5]
    rep = write_report(tmp_path / "r.json", whole_report)
    code, out, err = cli(
        ["plot", rep, "--kind", "layers", "-l", "-1", "--out", tmp_path / "p.png", "--dpi", "40"]
    )
    assert code == 0, err
    code, out, err = cli(["plot", rep, "--kind", "layers", "-l", "9", "--out", tmp_path / "q.png"])
    assert code == 2 and "layer 9 is not in" in err and "use e.g. --layers" in err


def test_a_shrinkage_target_layer_is_one_layer_of_the_grammar(models):
    from geomscope.score import ScoreOptions, score

    def opts(target):
        return ScoreOptions(
            metrics=("isoscore_star",), jackknife_groups=0, layers="1", shrinkage_target=target
        )

    rep = score(models["run"], opts("layer:-1"))
    assert "layer:layer_04" in json.dumps(rep["params"])
    with pytest.raises(InputError, match=r"layer:1-2 picks 2 layers \(layer_01, layer_02\); name one"):
        score(models["run"], opts("layer:1-2"))


def test_layer_number_reads_hidden_state_names_only():
    assert [layer_number(n) for n in ("layer_06", "layer_6", "LAYER_012", "layer_00")] == [6, 6, 12, 0]
    for other in ("final_norm", "layer_06.grad", "layers.3.mlp", "h.3", "layer_", "6"):
        assert layer_number(other) is None
        assert not is_hidden_state(other)
    assert is_hidden_state("layer_11")
