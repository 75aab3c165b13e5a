"""Reading back (geomscope/fileio.py): a regular file only, and every JSON document geomscope reads
-- a manifest, a shard log, a report, a trainer state, a finetune summary or log, a scheduler file,
a model's index, a datasets state -- through the one reader, bounded in size and nesting depth.

A named pipe at a file's name blocks a plain read until a writer comes (a hang), a link to /dev/zero
never ends, and JSON nested deeper than the interpreter's recursion limit (or deep enough to break a
recursive walk over what was read) is a RecursionError traceback to a plain reader. Each reader here
is handed those files and must refuse them in one line (or, where the file is optional, go without
it), at once. A reader that blocks on a pipe is released after :data:`BLOCKED_AFTER` seconds by a
writer that opens and closes it, so the test fails instead of hanging."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import one_line_message

from geomscope.errors import InputError
from geomscope.fileio import (
    MAX_JSON_DEPTH,
    JSONLimitError,
    NotRegularFileError,
    json_depth,
    loads_json,
    read_json,
)

#: seconds a read may wait on a named pipe before the test writes to it (a generous bound: the
#: readers refuse a pipe at once)
BLOCKED_AFTER = 10.0


def nested(depth: int, inner="0") -> str:
    """JSON text of ``depth`` nested arrays around ``inner``."""
    return "[" * depth + inner + "]" * depth


#: deep enough that Python's parser itself ends in a RecursionError
DEEPER_THAN_PARSER = nested(100_000)
#: parsed by Python, but far deeper than anything geomscope writes (a recursive walk over it, in a
#: caller already some hundred frames deep, ends in a RecursionError)
DEEP = nested(500)


@contextmanager
def fifo(path: Path):
    """A named pipe at ``path``; yields a dict whose ``"blocked"`` is set when a reader still waited
    on it after BLOCKED_AFTER seconds (it is then released with an empty write, never left hanging)."""
    os.mkfifo(path)
    state = {"blocked": False}
    done = threading.Event()

    def release():
        if done.wait(BLOCKED_AFTER):
            return
        while not done.is_set():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader has it open (yet, or any more)
                time.sleep(0.05)
                continue
            state["blocked"] = True
            os.close(fd)  # the reader sees the end of the file

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        done.set()
        thread.join()
    assert not state["blocked"], f"a read waited on the named pipe {path}"


# ------------------------------------------------------------------------------ the one reader
def test_read_json_reads_what_geomscope_writes(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"layers": [{"name": "x", "se": {"a": [1, 2]}}]}))
    assert read_json(p) == {"layers": [{"name": "x", "se": {"a": [1, 2]}}]}
    p.write_bytes(b"\xef\xbb\xbf[1]")
    assert read_json(p, encoding="utf-8-sig") == [1]
    (tmp_path / "link.json").symlink_to(p)  # a link to a regular file is read
    assert read_json(tmp_path / "link.json", encoding="utf-8-sig") == [1]


def test_read_json_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    (tmp_path / "dir.json").mkdir()
    for name, kind in (("zero.json", "a device"), ("dir.json", "a folder")):
        with pytest.raises(NotRegularFileError, match=f"^{kind}, not a regular file$"):
            read_json(tmp_path / name)
    with fifo(tmp_path / "pipe.json"), pytest.raises(NotRegularFileError, match="a named pipe"):
        read_json(tmp_path / "pipe.json")
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        read_json(tmp_path / "loop.json")


def test_read_json_bounds_the_bytes_before_reading_them(tmp_path):
    """A file over the bound is refused from its size (a sparse file of 256 MiB + 1 is not read)."""
    from geomscope.fileio import MAX_JSON_BYTES

    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(JSONLimitError, match="larger than 256 MiB"):
        read_json(p)
    p.write_text("[" + "0," * 20 + "0]")
    with pytest.raises(JSONLimitError, match="larger than 16 bytes"):
        read_json(p, max_bytes=16)


def test_nesting_is_bounded(tmp_path):
    assert loads_json(nested(MAX_JSON_DEPTH - 1, "{}")) is not None  # MAX_JSON_DEPTH levels in all
    for text in (nested(MAX_JSON_DEPTH, "{}"), DEEP, DEEPER_THAN_PARSER):
        with pytest.raises(JSONLimitError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
            loads_json(text)
    assert isinstance(JSONLimitError("x"), ValueError)  # what every reader already says in one line
    assert (json_depth(1), json_depth([]), json_depth({"a": [{}]}), json_depth(json.loads(DEEP))) == (
        0,
        1,
        3,
        500,
    )


# ------------------------------------------------------------------------------ every reader
def _report(p: Path):
    from geomscope.report import load_report

    return load_report(p)


def _manifest(p: Path):
    from geomscope.store.manifest import read_manifest

    return read_manifest(p)


def _run_writer(p: Path):
    """extract into the run directory holding ``p`` (its manifest)."""
    from geomscope.store.manifest import RunWriter

    RunWriter(p.parent, {"layers": []}).release()


def _shard_log(p: Path):
    """The shards a run's logs record: a damaged line loses its own shard (it is redone)."""
    from geomscope.store.manifest import read_logs

    return [entry for _, _, entries in read_logs(p.parent) for entry in entries]


def _state(p: Path):
    from geomscope.train.checkpoint import read_state

    return read_state(p.parent.parent)


def _marker(p: Path):
    from geomscope.train.checkpoint import read_marker

    return read_marker(p.parent)


def _steps_log(p: Path):
    """finetune --resume cuts its logs back to the checkpoint."""
    from geomscope.train.checkpoint import truncate_jsonl

    return truncate_jsonl(p, lambda record: True)


def _compare_run(p: Path):
    """compare of a run whose summary.json is intact and whose run.json is ``p``."""
    from geomscope.study.compare import find_runs

    summary = {"final": {"accuracy": 0.5}, "reg": "none", "lambda": 0.0, "seed": 0}
    (p.parent / "summary.json").write_text(json.dumps(summary))
    return find_runs([p.parent])


def _training_log(p: Path):
    from geomscope.plot.training import read_training_log

    return read_training_log(p.parent)


def _training_run_json(p: Path):
    """plot of a finetune log beside a run.json that is ``p``: only the legend reads it."""
    from geomscope.plot.training import read_training_log

    (p.parent / "steps.jsonl").write_text(json.dumps({"step": 1, "task_loss": 0.5}) + "\n")
    return read_training_log(p.parent)["run"]


def _scheduler_file(p: Path):
    from geomscope.score.dask_executor import parse_scheduler

    return parse_scheduler(p)


def _report_layers(p: Path):
    """Shell completion of --layers from a report: nothing to offer from a damaged one."""
    from geomscope.cli._complete import _report_layers

    return _report_layers(p)


def _tokenizer_code(p: Path):
    from geomscope.model.load import _tokenizer_has_code

    return _tokenizer_has_code(str(p.parent))


def _dataset_dict(p: Path):
    from geomscope.train.data import read_rows

    return read_rows(p.parent)


#: (reader, the file name it reads, what it gives for a file it cannot use: InputError, or the
#: value it goes without; whether its line says why -- a DatasetDict is refused as such, whatever
#: its dataset_dict.json holds)
READERS = [
    (_report, "report.json", InputError, True),
    (_manifest, "manifest.json", InputError, True),
    (_run_writer, "manifest.json", InputError, True),
    (_shard_log, ".geomscope-rank-00000.jsonl", [], False),
    (_state, "checkpoint/state.json", InputError, True),
    (_marker, ".geomscope-finetune.json", None, False),
    (_steps_log, "steps.jsonl", InputError, True),
    (_compare_run, "run.json", InputError, True),
    (_training_log, "steps.jsonl", InputError, True),
    (_training_run_json, "run.json", {}, False),
    (_scheduler_file, "scheduler.json", InputError, True),
    (_report_layers, "report.json", [], False),
    (_tokenizer_code, "tokenizer_config.json", False, False),
    (_dataset_dict, "dataset_dict.json", InputError, False),
]
IDS = [r[0].__name__.lstrip("_") for r in READERS]


def _outcome(reader, path: Path, expected):
    """What ``reader`` made of ``path``: the InputError's one line where ``expected`` is InputError
    (checked to be one), else None, the reader having gone without the file (its value checked to
    be ``expected``)."""
    if expected is InputError:
        with pytest.raises(InputError) as e:
            reader(path)
        return one_line_message(e)
    assert reader(path) == expected
    return None


@pytest.mark.parametrize("text", [DEEP, DEEPER_THAN_PARSER], ids=["deep", "deeper-than-the-parser"])
@pytest.mark.parametrize(("reader", "name", "expected", "says_why"), READERS, ids=IDS)
def test_every_reader_refuses_json_nested_too_deep(tmp_path, reader, name, expected, says_why, text):
    """JSON nested past MAX_JSON_DEPTH, at every name geomscope reads back, inside a document that
    is otherwise what belongs there: one line saying so (or the reader goes without the file)."""
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    if name.endswith(".jsonl"):  # a log: an intact first line, then the deep one
        first = (
            {"identity_sha256": "0" * 64} if name.startswith(".geomscope") else {"step": 1, "task_loss": 1}
        )
        p.write_text(json.dumps(first) + "\n" + text + "\n")
    else:
        p.write_text('{"format": "geomscope-report", "deep": ' + text + "}")
    line = _outcome(reader, p, expected)
    assert not says_why or f"nested deeper than {MAX_JSON_DEPTH} levels" in line, line


@pytest.mark.parametrize(("reader", "name", "expected", "says_why"), READERS, ids=IDS)
def test_every_reader_refuses_a_named_pipe_at_once(tmp_path, reader, name, expected, says_why):
    """A named pipe at the file's name is refused (or gone without) at once: a plain read blocked
    until a writer came, for ever in practice."""
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    with fifo(p):
        _outcome(reader, p, expected)


@pytest.mark.parametrize(("reader", "name", "expected", "says_why"), READERS, ids=IDS)
def test_every_reader_refuses_a_link_to_a_device(tmp_path, reader, name, expected, says_why):
    """A link to /dev/zero at the file's name: refused (or gone without), never read to no end (a
    reader that reads it fails on the capped address space, not by taking the machine's memory)."""
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.symlink_to("/dev/zero")
    with address_space_capped():
        _outcome(reader, p, expected)


@contextmanager
def address_space_capped(extra: int = 2 * 2**30):
    """This process's address space limited to what it maps now plus ``extra`` bytes, for the
    block's duration (Linux; elsewhere nothing is capped): a read that never ends is a MemoryError."""
    import resource

    try:
        status = Path("/proc/self/status").read_text()
        mapped = int(re.search(r"VmSize:\s+(\d+) kB", status)[1]) * 1024
    except (OSError, TypeError):
        yield
        return
    before = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


# ------------------------------------------------------------------------------ input folders
@pytest.fixture
def saved_dataset(tmp_path) -> Path:
    """A datasets.save_to_disk folder of four labelled rows."""
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "ds"
    data = {"sentence": ["a b", "c d", "e f", "g h"], "label": [0, 1, 0, 1]}
    datasets.Dataset.from_dict(data).save_to_disk(str(d))
    return d


def test_a_pipe_among_a_saved_datasets_files_is_refused_by_its_readers(saved_dataset):
    """A named pipe in place of a data file of a save_to_disk folder: extract's and finetune's loader
    (datasets) waited on it for ever, and the input's digest (extract's identity, finetune's
    fingerprint) left it out. Each refuses it in one line naming the file; nothing is read from it."""
    from geomscope.extract.sources import open_inputs
    from geomscope.fileio import input_digest
    from geomscope.train.data import read_rows

    before = input_digest(saved_dataset, "ds", directory=True)
    data_file = next(saved_dataset.glob("*.arrow"))
    data_file.unlink()
    readers = (
        lambda: read_rows(saved_dataset),
        lambda: open_inputs([str(saved_dataset)]),
        lambda: input_digest(saved_dataset, "ds", True),
    )
    with fifo(data_file):
        for read in readers:
            with pytest.raises(InputError, match=f"{data_file.name}, a named pipe, not a regular file") as e:
                read()
            one_line_message(e)
    (saved_dataset / "gone.arrow").symlink_to(saved_dataset / "nowhere")  # a link to nothing: left out
    data_file.unlink()
    assert input_digest(saved_dataset, "ds", directory=True) != before  # (the data file is missing)


def test_a_data_file_that_is_a_pipe_is_not_called_empty(tmp_path):
    from geomscope.train.data import read_rows

    with fifo(tmp_path / "train.csv"), pytest.raises(InputError, match="is not a regular file") as e:
        read_rows(tmp_path / "train.csv")
    assert "empty" not in one_line_message(e)


#: the json.load(s) calls left outside geomscope/fileio.py, each on what geomscope itself made in
#: this process (a JSON round trip of a dict it built, bytes one of its processes broadcast)
NOT_READ_BACK = {
    "geomscope/extract/plan.py": 2,  # identities compared through a JSON round trip
    "geomscope/extract/run.py": 1,  # the run request made JSON-shaped
    "geomscope/extract/ranks.py": 1,  # process 0's plan, broadcast to the others
}


def test_every_json_file_is_read_through_the_one_reader():
    """No JSON parse outside fileio.py but those of NOT_READ_BACK: a file read by ``json.load`` or
    ``json.loads(path.read_text())`` escapes the regular-file check and both bounds."""
    root = Path(__file__).resolve().parent.parent
    found = {}
    for py in sorted((root / "geomscope").rglob("*.py")):
        rel = str(py.relative_to(root))
        n = len(re.findall(r"\bjson\.loads?\(", py.read_text(encoding="utf-8")))
        if n and rel != "geomscope/fileio.py":
            found[rel] = n
    assert found == NOT_READ_BACK
