"""Hostile and broken inputs, as an adversary would try them: run directories, checkpoints and model
directories someone else made, huge inputs, interrupted commands. Each case: nothing lost, nothing
run, nothing written outside what was asked, and one `error:` line where the input is bad."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import make_tiny_model
from test_train_helpers import make_checkpoint, synthetic_rows, words_of, write_csv

from geomscope.errors import InputError

TEXT = "\n".join(f"the quick brown fox number {i} jumps over the lazy dog" for i in range(12)) + "\n"


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_tiny_model("bert", tmp_path_factory.mktemp("models") / "bert")


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    return p


def _extract(cli, model, text, run, *extra):
    return cli(["extract", model, text, "--out", run, "--quiet", "--shard-docs", "4", *extra])


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ data loss
def test_extract_overwrite_removes_only_what_the_manifest_lists(cli, bert, text, tmp_path):
    run = tmp_path / "run"
    assert _extract(cli, bert, text, run)[0] == 0
    (run / "shard-notes.txt").write_text("mine")
    (run / "shards_backup").mkdir()
    (run / "shards_backup" / "old.h5").write_text("mine too")
    code, _, err = _extract(cli, bert, text, run, "--overwrite", "--layers", "0")
    assert code == 0, err
    assert (run / "shard-notes.txt").read_text() == "mine"
    assert (run / "shards_backup" / "old.h5").read_text() == "mine too"


def test_extract_overwrite_checks_before_deleting(cli, bert, text, tmp_path):
    run = tmp_path / "run"
    assert _extract(cli, bert, text, run)[0] == 0
    before = _files(run)
    (run / "shard-00001.h5").unlink()
    (run / "shard-00001.h5").mkdir()  # a directory where a listed shard should be
    (run / "shard-00001.h5" / "x").write_text("x")
    code, out, err = _extract(cli, bert, text, run, "--overwrite")
    assert_one_line_error(code, out, err, "is a directory, not a file geomscope wrote", exit_code=2)
    after = _files(run)
    assert all(after[k] == v for k, v in before.items() if k in after and not k.startswith(".geomscope.lock"))
    assert (run / "manifest.json").exists() and (run / "shard-00000.h5").exists()  # nothing half-deleted
    shutil.rmtree(run / "shard-00001.h5")
    code, _, err = _extract(cli, bert, text, run, "--overwrite")  # once moved away, --overwrite works
    assert code == 0, err


def test_finetune_refuses_an_out_it_did_not_write(cli, tmp_path):
    model = make_checkpoint(tmp_path / "m", words_of([]))
    train = write_csv(tmp_path / "train.csv", synthetic_rows(16, 0))
    before = _files(model)
    for flags in ([], ["--overwrite"]):
        code, out, err = cli(["finetune", model, "--train", train, "--eval", train, "--out", model, *flags])
        assert_one_line_error(code, out, err, "holds files geomscope did not write", exit_code=2)
    assert _files(model) == before


def _finetune(cli, tmp_path, out, *extra):
    model = tmp_path / "m"
    if not model.exists():
        make_checkpoint(model, words_of([]))
    train = tmp_path / "train.csv"
    if not train.exists():
        write_csv(train, synthetic_rows(16, 0))
    args = ["--epochs", "1", "--batch-size", "8", "--device", "cpu", "--quiet", "--reg", "cosreg"]
    return cli(["finetune", model, "--train", train, "--eval", train, "--out", out, *args, *extra])


def test_finetune_overwrite_replaces_only_its_own_output(cli, tmp_path):
    out = tmp_path / "ft"
    code, _, err = _finetune(cli, tmp_path, out)
    assert code == 0, err
    (out / "my-notes.txt").write_text("keep")
    code, o, err = _finetune(cli, tmp_path, out)
    assert_one_line_error(code, o, err, "already holds a finetune run", exit_code=2)
    code, _, err = _finetune(cli, tmp_path, out, "--overwrite")
    assert code == 0, err
    assert (out / "my-notes.txt").read_text() == "keep" and (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------ security
class _Planted:
    """A pickle that runs a command when loaded: it must never be loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_never_unpickles_trainer_state(cli, tmp_path):
    out = tmp_path / "ft"
    assert _finetune(cli, tmp_path, out)[0] == 0
    marker = tmp_path / "PWNED"
    with open(out / "checkpoint" / "trainer.pt", "wb") as f:
        pickle.dump(_Planted(marker), f)
    code, o, err = _finetune(cli, tmp_path, out, "--resume", "--epochs", "2")
    assert_one_line_error(code, o, err, "trainer.pt, a pickle", exit_code=2)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "state-json", "missing"])
def test_resume_with_damaged_trainer_state_is_one_line(cli, tmp_path, damage):
    out = tmp_path / "ft"
    assert _finetune(cli, tmp_path, out)[0] == 0
    ck = out / "checkpoint"
    if damage == "truncate":
        data = (ck / "trainer.safetensors").read_bytes()
        (ck / "trainer.safetensors").write_bytes(data[: len(data) // 3])
    elif damage == "state-json":
        (ck / "state.json").write_text("{not json")
    else:
        (ck / "trainer.json").unlink()
    code, o, err = _finetune(cli, tmp_path, out, "--resume", "--epochs", "2")
    assert_one_line_error(
        code, o, err, "damaged" if damage != "missing" else "missing or damaged", exit_code=2
    )


def test_links_in_a_run_directory_are_never_written_through(cli, bert, text, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".geomscope.lock").symlink_to(outside)  # the lock would be opened (and truncated) through it
    code, out, err = _extract(cli, bert, text, run)
    assert_one_line_error(code, out, err, ".geomscope.lock is not a plain file", exit_code=2)
    assert outside.read_text() == "precious"
    (run / ".geomscope.lock").unlink()
    assert _extract(cli, bert, text, run)[0] == 0
    (run / "report.json").symlink_to(outside)  # score's report would be written through it
    (run / "report.csv").symlink_to(outside)
    code, out, err = cli(["score", run, "--metrics", "isoscore", "--quiet"])  # refused, link kept
    assert_one_line_error(code, out, err, "report.json exists and is a link", exit_code=2)
    assert outside.read_text() == "precious" and (run / "report.json").is_symlink()
    (run / "report.json").unlink()
    (run / "report.csv").unlink()
    code, _, err = cli(["score", run, "--metrics", "isoscore", "--quiet"])
    assert code == 0, err
    assert json.loads((run / "report.json").read_text())["format"] == "geomscope-report"


def test_a_manifest_naming_paths_outside_the_run_is_refused(cli, bert, text, tmp_path):
    run = tmp_path / "run"
    assert _extract(cli, bert, text, run)[0] == 0
    victim = tmp_path / "victim.h5"
    victim.write_text("keep")
    m = json.loads((run / "manifest.json").read_text())
    m["shards"][0]["file"] = "../victim.h5"
    (run / "manifest.json").write_text(json.dumps(m))
    for args in (["score", run, "--quiet"], ["inspect", run]):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, "is not a shard name geomscope writes", exit_code=2)
    code, out, err = _extract(cli, bert, text, run)  # resume would trust the entries: refused
    assert_one_line_error(code, out, err, "is not a shard name geomscope writes", exit_code=2)
    code, _, err = _extract(cli, bert, text, run, "--overwrite")  # starts over, deleting by no listed name
    assert code == 0, err
    assert victim.read_text() == "keep"


# ------------------------------------------------------------------------------ silent wrong results


def test_resume_redoes_a_shard_whose_checksum_fails(cli, bert, text, tmp_path):
    from geomscope.store import Run, verify_shard

    run = tmp_path / "run"
    assert _extract(cli, bert, text, run, "--store-dtype", "float32")[0] == 0
    clean = {p.name: p.read_bytes() for p in run.glob("shard-*.h5")}
    target = run / "shard-00001.h5"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    target.write_bytes(bytes(data))
    code, out, err = cli(
        [
            "extract",
            bert,
            text,
            "--out",
            run,
            "--quiet",
            "--shard-docs",
            "4",
            "--store-dtype",
            "float32",
            "--json",
        ]
    )
    assert code == 0, err
    s = json.loads(out)
    assert s["shards_written"] == 1 and s["shards_resumed"] == len(clean) - 1
    r = Run(run)
    for info in r.shards:
        verify_shard(r.shard_path(info), info)
    assert target.read_bytes() == clean[target.name]  # the redone shard equals the clean one


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m.pop("identity"), "no identity object"),
        (lambda m: m.__setitem__("shards", {"a": 1}), "shards is not a list"),
        (lambda m: m["shards"][0].__setitem__("rows", "many"), "shards[0].rows"),
        (lambda m: m.__setitem__("format_version", "1"), "format_version"),
        (lambda m: m["identity"].__setitem__("layers", "all"), "identity.layers"),
    ],
)
def test_structurally_broken_manifest_is_one_line_everywhere(cli, bert, text, tmp_path, edit, needle):
    run = tmp_path / "run"
    assert _extract(cli, bert, text, run)[0] == 0
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))
    for args in (
        ["score", run, "--quiet"],
        ["inspect", run],
        ["extract", bert, text, "--out", run, "--quiet"],
    ):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, needle, exit_code=2)
    code, _, err = _extract(
        cli, bert, text, run, "--overwrite"
    )  # ours, though damaged: --overwrite starts over
    assert code == 0, err
    assert json.loads((run / "manifest.json").read_text())["complete"] is True


# ------------------------------------------------------------------------------ resources and leftovers
def test_a_huge_document_keeps_memory_flat(tmp_path, bert):
    """A 20 MB line, truncated to 16 tokens: the tokenizer sees a bounded prefix (the original bug took
    3.4 GB), and the stored tokens are those of the document's start."""
    big = tmp_path / "big.txt"
    words = ("lorem ipsum dolor sit amet " * 800_000)[:20_000_000]
    big.write_text("short first document\n" + words + "\n")
    code = (
        "import resource, sys, json\n"
        "from geomscope.extract.run import extract\n"
        f"s = extract({str(bert)!r}, [{str(big)!r}], {str(tmp_path / 'run')!r}, max_length=16)\n"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(json.dumps({'rss_mb': rss, 'rows': s['rows']}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    short = len(AutoTokenizer.from_pretrained(bert)("short first document")["input_ids"])
    assert got["rows"] == short + 16  # the short document whole, 16 tokens of the huge one
    assert got["rss_mb"] < 1500, got  # the whole-line tokenization alone took over 3,000 MB


def test_bounded_prefix_gives_the_tokens_of_the_whole_document(bert):
    from transformers import AutoTokenizer

    from geomscope.extract.batching import tokenize

    tok = AutoTokenizer.from_pretrained(bert)
    long_doc = " ".join(["the quick brown fox jumps over the lazy dog"] * 5000)
    [doc] = tokenize(tok, [(0, long_doc)], 64)
    whole = tok(long_doc, truncation=True, max_length=64)["input_ids"]
    assert doc.ids.tolist() == whole and len(whole) == 64


def test_stdin_copy_is_removed_when_a_later_input_is_bad(tmp_path, monkeypatch, bert):
    import io

    from geomscope.extract.run import extract

    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    stdin = io.TextIOWrapper(io.BytesIO(TEXT.encode()))
    with pytest.raises(InputError, match="does not exist"):
        extract(bert, ["-", str(tmp_path / "missing.txt")], tmp_path / "run", stdin=stdin)
    assert list(spool.iterdir()) == []


# ------------------------------------------------------------------------------ one line, not a traceback
def test_max_length_below_the_special_tokens(cli, bert, text, tmp_path):
    code, out, err = _extract(cli, bert, text, tmp_path / "run", "--max-length", "1")
    assert_one_line_error(code, out, err, "leaves no room for text", exit_code=2)
    assert not (tmp_path / "run").exists()


def test_score_out_onto_a_directory_or_a_failing_disk(cli, tmp_path, monkeypatch):
    X = np.random.default_rng(0).normal(size=(50, 4))
    np.save(tmp_path / "x.npy", X)
    (tmp_path / "p.json").mkdir()
    code, out, err = cli(["score", tmp_path / "x.npy", "--out", tmp_path / "p", "--quiet"])
    assert_one_line_error(code, out, err, "is a directory", exit_code=2)
    import errno

    import geomscope.report as report

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_text_atomic", disk_full)  # any write error, e.g. a full disk
    code, out, err = cli(["score", tmp_path / "x.npy", "--out", tmp_path / "r", "--quiet"])
    assert_one_line_error(code, out, err, "cannot write the report", "No space left", exit_code=2)


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


# ------------------------------------------------------------------------------ smaller
def test_csv_byte_order_mark(cli, bert, tmp_path):
    csv_in = tmp_path / "bom.csv"
    csv_in.write_bytes(b"\xef\xbb\xbftext,other\nhello there,1\nsecond row,2\n")
    code, _, err = cli(["extract", bert, csv_in, "--out", tmp_path / "run", "--quiet"])
    assert code == 0, err
    from geomscope.train.data import load_table

    ft = tmp_path / "bom-train.csv"
    ft.write_bytes(b"\xef\xbb\xbfsentence,label\ngood film,pos\nbad film,neg\n")
    t = load_table(ft)
    assert list(t.labels) == ["pos", "neg"]


@pytest.mark.parametrize(
    "array, needle",
    [
        (np.zeros((3, 4, 5)), "shape (3, 4, 5)"),
        (np.array([["a", "b"], ["c", "d"]]), "dtype <U1"),
        (np.zeros((10, 4), complex), "dtype complex128"),
    ],
)
def test_score_wrong_array_shape_or_dtype_exits_2(cli, tmp_path, array, needle):
    np.save(tmp_path / "a.npy", array)
    code, out, err = cli(["score", tmp_path / "a.npy", "--quiet"])
    assert_one_line_error(code, out, err, needle, exit_code=2)


def test_score_never_unpickles_an_object_array(cli, tmp_path):
    marker = tmp_path / "PWNED"
    arr = np.empty((2, 2), dtype=object)
    arr[0, 0] = _Planted(marker)
    np.save(tmp_path / "obj.npy", arr, allow_pickle=True)
    code, out, err = cli(["score", tmp_path / "obj.npy", "--quiet"])
    assert_one_line_error(code, out, err, exit_code=2)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "empty or cut short"),
        (b"\x93NUMPY\x01", "empty or cut short"),
        (bytes(range(256)) * 4, "never unpickles"),
    ],
)
def test_a_broken_npy_is_one_line_that_never_suggests_unpickling(cli, tmp_path, content, needle):
    """An empty or cut .npy is not a Ctrl-C (numpy's EOFError reads as one to click), and random bytes
    are not "pickled data you may load unsafely"."""
    bad = tmp_path / "bad.npy"
    bad.write_bytes(content)
    code, out, err = cli(["score", bad, "--quiet"])
    line = assert_one_line_error(code, out, err, "bad.npy", needle, exit_code=2)
    assert "unsafe" not in line and "interrupted" not in line
    ok = tmp_path / "ok.npy"
    np.save(ok, np.random.default_rng(0).normal(size=(50, 4)))
    code, out, err = cli(["score", ok, "--metrics", "isoscore_star", "--shrinkage-target", bad, "--quiet"])
    line = assert_one_line_error(code, out, err, "--shrinkage-target", needle, exit_code=2)
    assert "interrupted" not in line


def test_an_empty_pt_file_is_one_line(cli, tmp_path):
    (tmp_path / "zero.pt").write_bytes(b"")
    code, out, err = cli(["score", tmp_path / "zero.pt", "--quiet"])
    assert_one_line_error(code, out, err, "zero.pt", exit_code=2)


def test_a_cut_gzip_csv_is_one_line(cli, bert, tmp_path):
    import gzip

    whole = gzip.compress(("text\n" + TEXT).encode() * 50)
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    code, out, err = cli(["extract", bert, cut, "--text-field", "text", "--out", tmp_path / "run", "--quiet"])
    line = assert_one_line_error(code, out, err, "cut.csv.gz", exit_code=2)
    assert "interrupted" not in line


def test_score_refuses_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "rows.npy"
    os.mkfifo(fifo)
    ok = tmp_path / "ok.npy"
    np.save(ok, np.zeros((5, 3)))
    for args in (["score", fifo], ["score", ok, "--metrics", "isoscore_star", "--shrinkage-target", fifo]):
        p = subprocess.run(
            [sys.executable, "-m", "geomscope", *map(str, args), "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,  # a read of the FIFO would block until then
        )
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith("error:") and "rows.npy" in p.stderr


def test_extract_reads_a_pipe_to_its_end_once(cli, bert, tmp_path):
    """A named FIFO (or ``<(zcat x.gz)``) is spooled like stdin: its bytes are read once, to their end,
    and give the rows the same text in a file gives; the spooled copy is removed."""
    import threading

    fifo = tmp_path / "docs.txt"
    os.mkfifo(fifo)

    def writer():
        with open(fifo, "w") as f:
            f.write(TEXT)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    spool = tmp_path / "spool"
    spool.mkdir()
    old = tempfile.tempdir
    tempfile.tempdir = str(spool)
    try:
        code, _o, e = _extract(cli, bert, fifo, tmp_path / "piped")
    finally:
        tempfile.tempdir = old
    th.join(timeout=10)
    assert code == 0, e
    assert not list(spool.iterdir())  # the spooled copy is gone
    plain = tmp_path / "docs-file.txt"
    plain.write_text(TEXT)
    assert _extract(cli, bert, plain, tmp_path / "filed")[0] == 0
    from geomscope.store import Run

    piped, filed = Run(tmp_path / "piped"), Run(tmp_path / "filed")
    assert piped.total_rows == filed.total_rows > 0
    manifest = json.loads((tmp_path / "piped" / "manifest.json").read_text())
    assert str(fifo) in json.dumps(manifest)  # the input is recorded as given


@pytest.mark.parametrize("case", ["chunked", "contiguous", "external"])
def test_an_h5_array_that_does_not_store_its_rows_is_refused_at_once(cli, tmp_path, case):
    """10^12 declared rows in a kilobyte file would be read as fill values for hours; external raw
    storage would read another file (here /etc/passwd's stand-in) as rows."""
    import h5py

    path = tmp_path / "a.h5"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(160, dtype=np.uint8).tobytes())
    with h5py.File(path, "w") as f:
        if case == "chunked":
            f.create_dataset("x", shape=(10**12, 8), dtype="f4", chunks=(1024, 8))
        elif case == "contiguous":
            f.create_dataset("x", shape=(10**9, 8), dtype="f4")
        else:
            f.create_dataset("x", shape=(5, 8), dtype="f4", external=[(str(secret), 0, 160)])
    code, out, err = cli(["score", path, "--metrics", "avgcos", "--max-rows", "100", "--quiet"])
    needle = "other files" if case == "external" else "declares shape"
    assert_one_line_error(code, out, err, "a.h5", needle, exit_code=2)


def test_an_h5_array_partly_compressed_and_whole_scores(cli, tmp_path):
    import h5py

    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "x", data=np.random.default_rng(0).normal(size=(3000, 8)), chunks=(1000, 8), compression="gzip"
        )
    assert cli(["score", path, "--metrics", "avgcos", "--out", tmp_path / "r", "--quiet"])[0] == 0


def test_rows_too_wide_for_this_machine_are_one_line_before_any_allocation(cli, tmp_path, monkeypatch):
    """D x D accumulators larger than the machine's memory: said with the numbers, not numpy's 74.5 GiB
    allocation error after the rows were read."""
    import geomscope.score.resources as resources

    monkeypatch.setattr(resources, "physical_memory", lambda: 40 * 2**20)  # a 40 MiB machine
    wide = tmp_path / "wide.npy"
    np.save(wide, np.random.default_rng(0).normal(size=(20, 2000)).astype(np.float32))  # 2000^2 x 16 B
    code, out, err = cli(["score", wide, "--metrics", "twonn", "--quiet"])
    assert_one_line_error(code, out, err, "D = 2000 is too wide", "GiB", exit_code=2)
    mid = tmp_path / "mid.npy"
    np.save(mid, np.random.default_rng(0).normal(size=(40, 1000)).astype(np.float32))  # 16 MB, 10 groups: not
    code, out, err = cli(["score", mid, "--metrics", "avgcos", "--quiet"])
    assert_one_line_error(code, out, err, "D = 1000", "--jackknife-groups", exit_code=2)
    code, out, err = cli(
        ["score", mid, "--metrics", "avgcos", "--jackknife-groups", "2", "--out", tmp_path / "r", "--quiet"]
    )
    assert code == 0, err


@pytest.mark.parametrize(
    "raised, needles, exit_code",
    [
        (
            EOFError("Compressed file ended before the end-of-stream marker was reached"),
            ("ended before its end", "end-of-stream"),
            2,
        ),
        (
            MemoryError("Unable to allocate 74.5 GiB for an array with shape (100000, 100000)"),
            ("out of memory", "74.5 GiB"),
            1,
        ),
    ],
)
def test_what_no_check_foresaw_is_still_one_line(cli, tmp_path, monkeypatch, raised, needles, exit_code):
    """Whatever reader lets an EOFError through (click would call it Ctrl-D: "interrupted"), and a
    MemoryError no check foresaw: main says what each is, in one line."""
    import geomscope.score

    def fail(*a, **k):
        raise raised

    monkeypatch.setattr(geomscope.score, "score", fail)
    ok = tmp_path / "ok.npy"
    np.save(ok, np.zeros((5, 3)))
    code, out, err = cli(["score", ok, "--quiet"])
    line = assert_one_line_error(code, out, err, *needles, exit_code=exit_code)
    assert "interrupted" not in line


def test_resume_with_a_damaged_log_or_planted_links(cli, tmp_path):
    out = tmp_path / "ft"
    assert _finetune(cli, tmp_path, out)[0] == 0
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (out / ".checkpoint.tmp").symlink_to(outside, target_is_directory=True)
    (out / ".export.tmp").symlink_to(outside, target_is_directory=True)
    code, _, err = _finetune(cli, tmp_path, out, "--resume", "--epochs", "2")
    assert code == 0, err
    assert (outside / "keep.txt").read_text() == "keep" and sorted(p.name for p in outside.iterdir()) == [
        "keep.txt"
    ]
    with open(out / "steps.jsonl", "a") as f:
        f.write("{half a line\n")
    code, o, err = _finetune(cli, tmp_path, out, "--resume", "--epochs", "3")
    assert_one_line_error(code, o, err, "steps.jsonl line", "is not JSON", exit_code=2)


def _damaged(rep: dict, case: str):
    """A report dict edited as the damage ``case`` says (layers[0] unless named)."""
    import copy

    rep = copy.deepcopy(rep)
    lay = rep["layers"][0]
    edits = {
        "version_text": lambda: rep.update(format_version="abc"),
        "version_null": lambda: rep.update(format_version=None),
        "model_text": lambda: rep.update(model="bert"),
        "params_list": lambda: rep.update(params=[1]),
        "source_list": lambda: rep.update(source=[1, 2]),
        "notes_list": lambda: rep.update(notes=["x"]),
        "se_list": lambda: lay.update(se=[1, 2]),
        "layer_int": lambda: [e.update(layer=i) for i, e in enumerate(rep["layers"])],
        "metric_text": lambda: lay.update(isoscore="high"),
        "eig_negative": lambda: lay.update(eigenvalues=[-1, 0, -5]),
        "eig_ragged": lambda: lay.update(eigenvalues=[[1, 2], [3]]),
        "layer_notes_text": lambda: lay.update(notes="zz"),
        "final_norm_text": lambda: rep.update(final_norm="hello"),
        "final_norm_partial": lambda: rep.update(final_norm={"before": "x"}),
    }
    edits[case]()
    return rep


@pytest.mark.parametrize(
    "case",
    [
        "version_text",
        "version_null",
        "model_text",
        "params_list",
        "source_list",
        "notes_list",
        "se_list",
        "layer_int",
        "metric_text",
        "eig_negative",
        "eig_ragged",
        "layer_notes_text",
        "final_norm_text",
        "final_norm_partial",
        "deep",
        "huge_int",
    ],
)
def test_a_damaged_report_is_one_line_for_report_and_plot(cli, tmp_path, case):
    from test_plot_factory import make_report

    path = tmp_path / "r.json"
    if case == "deep":
        path.write_text('{"format": "geomscope-report", "layers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "huge_int":
        path.write_text('{"format": "geomscope-report", "format_version": ' + "9" * 5000 + ', "layers": []}')
    else:
        path.write_text(json.dumps(_damaged(make_report(n_layers=3, hidden=16), case)))
    for args in (
        ["plot", path, "--out", f"{tmp_path}/figs/"],
        ["report", path, "--html", tmp_path / "p.html"],
    ):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, "r.json", exit_code=2)
    assert not (tmp_path / "figs").exists() or not list((tmp_path / "figs").iterdir())


@pytest.mark.parametrize(
    "edit",
    [
        lambda row: row.update(step="abc"),
        lambda row: row.update(isoscore="high"),
        lambda row: row.update(n_rows="inf"),
        lambda row: row.update(n_rows="2.5"),
        "extra_cell",
    ],
)
def test_a_damaged_trajectory_is_one_line_for_plot(cli, tmp_path, edit):
    import csv

    from test_plot_factory import make_report

    from geomscope.score.trajectory import to_trajectory_csv

    reps = []
    for step in (0, 1000):
        rep = make_report(n_layers=3, hidden=16)
        rep["model"]["revision"] = f"step{step}"
        reps.append(rep)
    path = tmp_path / "trajectory.csv"
    path.write_text(to_trajectory_csv(reps))
    assert cli(["plot", path, "--out", f"{tmp_path}/ok/", "--quiet"])[0] == 0
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for i, row in enumerate(rows):
            if i == 2 and edit != "extra_cell":
                edit(row)
            w.writerow(row)
    if edit == "extra_cell":
        with path.open("a") as f:
            f.write(",".join(["x"] * (len(rows[0]) + 3)) + "\n")
    code, out, err = cli(["plot", path, "--out", f"{tmp_path}/figs/", "--quiet"])
    assert_one_line_error(code, out, err, "trajectory.csv line", exit_code=2)


def test_an_out_under_a_file_is_one_line(cli, bert, text, tmp_path):
    """--out a/sub where a is a file: NotADirectoryError was a traceback in extract and finetune."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    code, out, err = _extract(cli, bert, text, afile / "sub")
    assert_one_line_error(code, out, err, "afile/sub", "Not a directory", exit_code=2)
    code, out, err = _finetune(cli, tmp_path, afile / "sub")
    assert_one_line_error(code, out, err, "afile/sub", "Not a directory", exit_code=2)
    assert afile.read_text() == "mine"


def test_damaged_training_inputs_are_one_line(cli, tmp_path):
    """A saved dataset whose dataset_dict.json or state.json was damaged, a QA answer_start that is not
    a finite number, a --revisions file that is not text: one line each (they were tracebacks)."""
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


@pytest.mark.parametrize("target", [-np.eye(8), np.zeros((8, 8)), np.diag([1.0, 1, 1, 1, 1, 1, 1, -0.5])])
def test_a_shrinkage_target_that_is_no_covariance_is_refused(cli, tmp_path, target):
    """IsoScore* shrinks toward C0: a matrix with negative eigenvalues (or none above 0) gave a number."""
    np.save(tmp_path / "c0.npy", target)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(100, 8)))
    code, out, err = cli(
        [
            "score",
            tmp_path / "x.npy",
            "--metrics",
            "isoscore_star",
            "--shrinkage-target",
            tmp_path / "c0.npy",
            "--quiet",
        ]
    )
    assert_one_line_error(code, out, err, "is not a covariance", exit_code=2)


def test_a_pipe_read_by_several_readers_is_refused_before_anyone_reads(tmp_path):
    """Several revisions, or several processes, read their input each: a pipe gives its bytes to one
    of them only (a second `<(...)` read is empty; a named FIFO blocks). Refused like stdin."""
    from types import SimpleNamespace

    from geomscope.extract.ranks import check_options
    from geomscope.extract.revisions import extract_revisions
    from geomscope.extract.sources import is_stream

    fifo = tmp_path / "docs.txt"
    os.mkfifo(fifo)
    plain = tmp_path / "plain.txt"
    plain.write_text(TEXT)
    assert is_stream("-") and is_stream(fifo) and not is_stream(plain) and not is_stream(tmp_path)
    with pytest.raises(InputError, match="docs.txt can be read once"):
        extract_revisions("model", [str(plain), str(fifo)], tmp_path / "out", ["a", "b"], None)
    with pytest.raises(InputError, match="cannot share .*docs.txt"):
        check_options(SimpleNamespace(max_tokens=None), [str(fifo)])
