"""finetune's data and models that are one line, never a traceback or a silent guess: a lone surrogate,
texts and labels that are no text or no class, a column given twice, a text the tokenizer makes nothing
of, an encoder-decoder checkpoint, CSVs that are not UTF-8 or hold huge fields, damaged saved datasets
and QA answers; and IStar's C0, of which only the symmetric part acts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_one_line_error
from helpers_models import make_tiny_model
from helpers_train import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.errors import InputError
from geomscope.train.data import Encoded, load_table


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"sentence": "\ud800 lone", "label": "a"}, "lone surrogate"),
        ({"sentence": ["a", "list"], "label": "a"}, "is a list, not text"),
        ({"sentence": 3.5, "label": "a"}, "is a float, not text"),
        ({"sentence": "fine", "label": float("nan")}, "not a class label"),
        ({"sentence": "fine", "label": 0.5}, "not a class label"),
        ({"sentence": "fine", "label": ["a"]}, "not a class label"),
        ({"sentence": "fine", "label": {"x": 1}}, "not a class label"),
    ],
)
def test_rows_that_are_no_text_or_no_class_are_refused(tmp_path, row, needle):
    """A lone surrogate raised a TypeError in the tokenizer (a traceback, and a whole sweep stopped);
    NaN, 1e400, 0.5, lists and objects became classes 'nan', 'inf', '0.5', "['a']"."""
    path = _jsonl(tmp_path / "d.jsonl", [{"sentence": "ok", "label": "b"}, row])
    with pytest.raises(InputError, match="row 2") as e:
        load_table(path)
    assert needle in str(e.value)


def test_whole_number_labels_still_load(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"sentence": "a", "label": 1.0}, {"sentence": "b", "label": True}])
    assert load_table(path).labels == ["1", "1"]


def test_a_column_given_twice_is_refused(tmp_path):
    """csv.DictReader keeps the last of two columns of one name, silently."""
    path = tmp_path / "d.csv"
    path.write_text("sentence,label,label\nhello,a,b\nworld,b,a\n")
    with pytest.raises(InputError, match="'label' twice"):
        load_table(path)


def test_a_text_of_no_tokens_is_refused_before_training(tmp_path):
    """GPT-2 adds no special tokens: an empty text is no token at all, which would crash after a
    whole epoch (cannot reshape a tensor of 0 elements) or, among others, train on a pad token's
    state."""
    from transformers import AutoTokenizer

    model = make_tiny_model("gpt2", tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(model)
    path = tmp_path / "d.csv"
    path.write_text('sentence,label\nhello there,a\n"",b\n')
    table = load_table(path)
    with pytest.raises(InputError, match="row 2 has no tokens"):
        Encoded(tok, table, {"a": 0, "b": 1}, 32)


def test_an_encoder_decoder_checkpoint_is_refused(tmp_path):
    """T5 is refused when loaded, not after: its classifier's output has no hidden_states."""
    from geomscope.model.classifier import load_classifier

    model = make_tiny_model("t5", tmp_path / "m")
    with pytest.raises(InputError, match="encoder-decoder"):
        load_classifier(model, {"a": 0, "b": 1}, lambda m: None)


def test_istar_counts_only_the_symmetric_part_of_c0():
    """target_on, the cross term and the squared norm all use C0's symmetric part: adding an
    antisymmetric part leaves IsoScore* where it is (counting the whole in the norm would move it
    from 0.504 to 0.455)."""
    from geomscope.train.regularizers import IStar

    torch.manual_seed(0)
    d = 6
    h = (torch.randn(2, 5, d, dtype=torch.float64),)
    a = torch.randn(d, d, dtype=torch.float64)
    c0 = a @ a.T
    skew = torch.randn(d, d, dtype=torch.float64)
    skew = skew - skew.T
    mask = torch.ones(2, 5, dtype=torch.long)
    plain = IStar([0], 0.5, c0)(h, mask)[1]
    with_skew = IStar([0], 0.5, c0 + 0.5 * skew)(h, mask)[1]
    assert float(with_skew) == pytest.approx(float(plain), rel=1e-12)


def test_a_finetune_csv_with_trailing_commas_loads(tmp_path):
    """Excel's trailing commas give blank column names: not 'the column '' twice'."""
    from geomscope.train.data import load_table

    path = tmp_path / "d.csv"
    path.write_text("sentence,label,,\nhello,a,,\nworld,b,,\n")
    assert load_table(path).labels == ["a", "b"]


def test_finetune_bad_csvs_are_one_line(cli, tmp_path):
    model = make_checkpoint(tmp_path / "m", words_of([]))
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("sentence,label\ncaf\xe9 cr\xe8me,pos\n".encode("latin-1"))
    huge = tmp_path / "huge.csv"
    huge.write_text("sentence,label\n" + '"' + "word " * 40_000 + '",pos\n"fine",neg\n')
    ok = write_csv(tmp_path / "ok.csv", synthetic_rows(8, 0))
    code, out, err = cli(["finetune", model, "--train", latin, "--eval", ok, "--out", tmp_path / "a"])
    assert_one_line_error(code, out, err, "is not UTF-8 text", exit_code=2)
    # a field past the csv module's default limit (131,072 characters) is read, not a traceback
    code, out, err = cli(
        [
            "finetune",
            model,
            "--train",
            huge,
            "--eval",
            ok,
            "--out",
            tmp_path / "b",
            "--epochs",
            "1",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--quiet",
            "--reg",
            "none",
        ]
    )
    assert "Traceback" not in err
    assert code == 0 or err.strip().startswith("error:"), err


def test_damaged_training_inputs_are_one_line(cli, tmp_path):
    """A saved dataset whose dataset_dict.json or state.json was damaged, a QA answer_start that is not
    a finite number, a --revisions file that is not text: one line each, not a traceback."""
    from geomscope.model.revisions import resolve_revisions
    from geomscope.train.data import load_table
    from geomscope.train.qa import load_qa

    dsdict = tmp_path / "dsdict"
    dsdict.mkdir()
    (dsdict / "dataset_dict.json").write_text("{bad")
    with pytest.raises(InputError, match="DatasetDict"):
        load_table(dsdict)
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text("{}")
    (state / "dataset_info.json").write_text("{}")
    with pytest.raises(InputError, match="not a readable datasets save_to_disk directory"):
        load_table(state)
    for start in ("NaN", "Infinity", "1e400"):
        qa = tmp_path / f"qa-{start}.jsonl"
        qa.write_text(
            '{"id": "1", "question": "q?", "context": "the answer is here", '
            f'"answers": {{"text": ["answer"], "answer_start": [{start}]}}}}\n'
        )
        with pytest.raises(InputError, match="not a whole number"):
            load_qa(qa)
    revs = tmp_path / "revs.txt"
    revs.write_bytes(b"step1\n\xff\xfe\n")
    with pytest.raises(InputError, match="cannot be read as UTF-8"):
        resolve_revisions(str(tmp_path), str(revs))
