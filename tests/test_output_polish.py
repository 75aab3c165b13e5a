"""How counts, rates, the score table's notes, --seed's range and values with standard errors read:
nouns agree with their counts, a resumed extract states what it did, the table's notes wrap on
words, --help states the seed's range plainly, and an SE has two significant digits with its value
rounded to the same place (the terminal table and the HTML page alike)."""

from __future__ import annotations

import io

import pytest


# ------------------------------------------------------------------------- counts agree with nouns
@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from helpers_models import make_tiny_model

    return make_tiny_model("bert", tmp_path_factory.mktemp("polish-models"))


@pytest.fixture(scope="module")
def one_doc(tmp_path_factory):
    p = tmp_path_factory.mktemp("polish-text") / "one.txt"
    p.write_text("A single document of a few words.\n")
    return p


def _summary(**changes) -> dict:
    """An extract summary (the keys done_line reads): 4 shards, 3 of them written by this call."""
    base = {
        "rows": 15492,
        "docs": 400,
        "shards": 4,
        "bytes": 119_400_000,
        "shards_resumed": 1,
        "shards_written": 3,
        "rows_this_run": 11000,
        "tokens_per_second": 556.2,
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    "n, noun, plural, expected",
    [
        (1, "shard", None, "1 shard"),
        (0, "shard", None, "0 shards"),
        (4, "document", None, "4 documents"),
        (1234, "row", None, "1,234 rows"),
        (1, "process", "processes", "1 process"),
        (2, "process", "processes", "2 processes"),
    ],
)
def test_counted_agrees_with_its_number(n, noun, plural, expected):
    from geomscope.formatting import counted

    assert counted(n, noun, plural) == expected


def test_extract_of_one_document_and_one_layer_says_so(cli, tiny_bert, one_doc, tmp_path):
    run = tmp_path / "run"
    code, out, err = cli(["extract", tiny_bert, one_doc, "--out", run, "--layers", "0"])
    assert code == 0, err
    opening = " ".join(next(ln for ln in err.splitlines() if ln.startswith("extract:")).split())
    assert "1 document in 1 shard, 1 layer x" in opening, err
    code, out, err = cli(["inspect", run, "--verify"])
    assert code == 0, err
    assert "(1 document in 1 shard)" in " ".join(out.split()), out


# -------------------------------------------------------------- a resumed extract states what it did
def test_done_line_of_one_document_in_one_shard_is_singular():
    from geomscope.extract.shards import done_line

    line = done_line(_summary(rows=1, docs=1, shards=1, shards_resumed=0, shards_written=1, rows_this_run=1))
    assert "1 row of 1 document in 1 shard," in line, line
    for wrong in ("1 rows", "1 documents", "1 shards"):
        assert wrong not in line, line


def test_done_line_of_a_finished_run_gives_no_rate():
    from geomscope.extract.shards import done_line

    line = done_line(_summary(shards_resumed=4, shards_written=0, rows_this_run=0, tokens_per_second=None))
    assert line.startswith("done: nothing to do") and "tokens/s" not in line, line
    assert "15,492 rows of 400 documents in 4 shards" in line, line


def test_done_line_of_a_resumed_run_rates_the_new_rows_only():
    from geomscope.extract.shards import done_line

    line = done_line(_summary())
    assert "1 shard kept from an earlier run, 3 written now (11,000 rows, 556 tokens/s)" in line, line


def test_rerunning_a_finished_extract_prints_no_rate(cli, tiny_bert, one_doc, tmp_path):
    import json

    args = ["extract", tiny_bert, one_doc, "--out", tmp_path / "run", "--layers", "0"]
    code, _, err = cli(args)
    assert code == 0, err
    code, _, err = cli(args)
    assert code == 0, err
    done = next(ln for ln in err.splitlines() if ln.startswith("done:"))
    assert done.startswith("done: nothing to do") and "tokens/s" not in done, err
    code, out, err = cli([*args, "--json", "--quiet"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["shards_written"] == 0 and summary["tokens_per_second"] is None


# ------------------------------------------------------------- the score table's notes wrap on words
def _report_with_long_notes() -> dict:
    layers = [
        {"layer": f"layer_{i:02d}", "index": i, "n_rows": 2000, "isoscore": 0.25 + i / 10, "se": {}}
        for i in range(3)
    ]
    return {
        "source": {"kind": "run", "path": "/tmp/run"},
        "model": {"name": "tiny"},
        "params": {
            "metrics": ["isoscore", "isoscore_star"],
            "zeta": 0.2,
            "target": "file:/data/targets/reference_covariance.npy",  # wider than the table
            "uncertainty": {"moments": "delete-one-group jackknife over 10 document groups (doc_id % G)"},
        },
        "layers": layers,
    }


@pytest.mark.parametrize("width", [60, 80, 120])
def test_score_table_notes_wrap_on_words(width):
    from rich.console import Console

    from geomscope.report import _caption, report_table

    rep = _report_with_long_notes()
    words = set(" ".join(_caption(rep)).split())
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(report_table(rep))
    lines = buf.getvalue().splitlines()
    bottom = max(i for i, ln in enumerate(lines) if ln.startswith("└"))
    shown_words = [w for ln in lines[bottom + 1 :] for w in ln.split()]
    assert shown_words and set(shown_words) <= words, lines[bottom + 1 :]
    assert max(map(len, lines)) <= width


# --------------------------------------------------------------------------------- --seed's range
def test_score_help_states_the_seed_range_readably(cli):
    code, out, _ = cli(["score", "--help"])
    assert code == 0
    seed_help = " ".join(out.split("--seed N", 1)[1].split("--exclude-special", 1)[0].split())
    assert "0 <= N < 2^64" in seed_help and "18446744073709551615" not in out, seed_help


@pytest.mark.parametrize("seed, said", [(str(2**64), "2^64 - 1"), ("-1", "2^64 - 1"), ("seven", "'--seed'")])
def test_score_refuses_a_seed_out_of_range_in_one_line(cli, tmp_path, seed, said):
    from conftest import assert_one_line_error

    code, out, err = cli(["score", tmp_path / "nowhere", "--seed", seed, "--out", tmp_path / "o"])
    assert_one_line_error(code, out, err, "--seed", said, exit_code=2)


def test_the_seed_bound_has_one_definition():
    from geomscope import choices
    from geomscope.options import SEED
    from geomscope.score.options import MAX_SEED

    assert MAX_SEED is choices.MAX_SEED == 2**64 - 1
    assert SEED.reason(2**64 - 1) is None and SEED.reason(0) is None and SEED.reason(2**64) is not None


# ----------------------------------------------------------------------- values with their SEs
@pytest.mark.parametrize(
    "value, se, expected",
    [
        (0.4123, 0.0157, ("0.412", "0.016")),
        (12.345, 1.2, ("12.3", "1.2")),
        (0.0996, 0.0996, ("0.10", "0.10")),  # the SE rounds up a decade: still two digits
        (101.3, 2.14, ("101.3", "2.1")),
        (12345.0, 157.0, ("12340", "160")),
        (-0.0003, 0.02, ("0.000", "0.020")),  # no "-0.000"
        (1.234e-6, 3.2e-8, ("1.234e-06", "3.2e-08")),  # small: scientific
        (1.5e7, 2.3e5, ("1.500e+07", "2.3e+05")),  # large: scientific
        (0.5, 0.0, ("0.5", "0")),
        (0.5, None, ("0.5", None)),
        (0.5, float("nan"), ("0.5", None)),
        (None, 0.1, ("-", None)),
        (float("nan"), 0.1, ("nan", None)),
    ],
)
def test_value_and_se_round_to_the_se(value, se, expected):
    from geomscope.formatting import value_and_se

    assert value_and_se(value, se) == expected


def test_value_and_se_read_numpy_scalars():
    import numpy as np

    from geomscope.formatting import value_and_se

    assert value_and_se(np.float32(0.4123), np.float32(0.0157)) == ("0.412", "0.016")
    assert value_and_se(np.float64(2.0), np.float64("nan")) == ("2", None)


def _report_with_ses() -> dict:
    rows = [(0.4123, 0.0157), (12.345, 1.2), (0.3, float("nan"))]
    layers = [
        {"layer": f"layer_{i:02d}", "index": i, "n_rows": 100, "isoscore": v, "se": {"isoscore": s}}
        for i, (v, s) in enumerate(rows)
    ]
    return {"source": {"path": "p"}, "params": {"metrics": ["isoscore"]}, "layers": layers}


def test_terminal_table_rounds_each_value_to_its_se():
    from rich.console import Console

    from geomscope.report import report_table

    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(report_table(_report_with_ses()))
    cells = buf.getvalue().replace("│", " ").split()
    assert "0.412" in cells and "±0.016" in cells and "12.3" in cells and "±1.2" in cells
    assert "±0.02" not in cells and "±1" not in cells and not any("nan" in c for c in cells)


def test_html_table_rounds_each_value_to_its_se():
    from geomscope.htmltable import report_table_html

    page = report_table_html(_report_with_ses())
    assert "0.412<br><span class='se'>±0.016</span>" in page
    assert "12.3<br><span class='se'>±1.2</span>" in page
    assert "±nan" not in page and "0.4123" not in page and "0.0157" not in page
    assert "<td>0.3</td>" in page  # a NaN SE: the value alone
