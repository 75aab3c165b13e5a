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
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error
from helpers_models import make_tiny_model
from test_train_helpers import make_checkpoint, synthetic_rows, words_of, write_csv

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


# ------------------------------------------------------------------------------ one line, not a traceback
def test_max_length_below_the_special_tokens(cli, bert, text, tmp_path):
    code, out, err = _extract(cli, bert, text, tmp_path / "run", "--max-length", "1")
    assert_one_line_error(code, out, err, "leaves no room for text", exit_code=2)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ smaller


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
