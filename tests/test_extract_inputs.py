"""extract's inputs (extract/sources.py) and its disk: a device is refused (a copy of it would fill the
disk), a stream that does not fit the temporary folder, a disk that fills up while shards
are written and a SIGTERM are each one line, with no copy of the input left behind; --out inside an
input dataset is refused (it could never be resumed). stdin and named pipes are spooled and read
once, to their end, and refused where several readers would each need them; a CSV's byte order
mark is no part of its first column; a cut .csv.gz is one line."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import assert_one_line_error, quiet_extract
from helpers_models import TWELVE_DOCS

from geomscope.errors import InputError

GEOMSCOPE = [sys.executable, "-m", "geomscope"]


def test_a_device_is_refused(cli, tmp_path):
    code, out, err = cli(["extract", "bundled:minilm", "/dev/zero", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "/dev/zero is a device", exit_code=2)
    assert not (tmp_path / "r").exists()


def test_a_stream_larger_than_the_temporary_folder_allows_is_one_line(tmp_path):
    """A file-size limit (as a full disk would) on the spooled copy of stdin: EFBIG is one line, not a
    traceback."""
    import resource

    def limit():  # in the child: 1 MiB per file, and EFBIG instead of the SIGXFSZ that kills
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    text = ("A sentence about a cat that sat on the mat.\n" * 60_000).encode()  # 2.6 MB
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [*GEOMSCOPE, "extract", "bundled:minilm", "-", "--out", str(tmp_path / "r")],
        input=text,
        capture_output=True,
        preexec_fn=limit,
        env=env,
        timeout=300,
    )
    err = done.stderr.decode()
    assert_one_line_error(done.returncode, "", err, "did not fit in the temporary folder", "TMPDIR")
    assert not list(tmp_path.glob("geomscope-stdin-*")), "the partial copy was left behind"


def test_a_full_disk_while_writing_is_one_line(cli, tmp_path, monkeypatch):
    """ENOSPC from a shard write ended in a traceback; finished shards are kept and resumed."""
    from geomscope.store.shard import ShardWriter

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp_path))

    src = tmp_path / "in.txt"
    src.write_text("\n".join(f"sentence {i} of the test" for i in range(20)) + "\n")
    monkeypatch.setattr(ShardWriter, "append", full)
    code, out, err = cli(["extract", "bundled:minilm", src, "--out", tmp_path / "r", "--layers", "0", "-q"])
    line = assert_one_line_error(code, out, err, "no space left on device writing", "free some space")
    assert code == 1 and ".tmp" in line


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    """A scheduler's SIGTERM ended the process at once, leaving the spooled copy of stdin (as large
    as the corpus) in the temporary folder; now it is Ctrl-C: clean-up, one line, exit 130."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [*GEOMSCOPE, "extract", "bundled:minilm", "-", "--out", str(tmp_path / "r")],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    proc.stdin.write(b"a first sentence\n" * 1000)
    proc.stdin.flush()
    deadline = time.time() + 120
    while not list(tmp_path.glob("geomscope-stdin-*")) and time.time() < deadline:
        time.sleep(0.1)  # the copy has begun (stdin stays open: it waits for more)
    assert list(tmp_path.glob("geomscope-stdin-*"))
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines()[-1].startswith("error: interrupted")
    assert not list(tmp_path.glob("geomscope-stdin-*"))


def test_out_inside_an_input_dataset_is_refused(tmp_path):
    from geomscope.extract.sources import check_out_outside_inputs, open_inputs

    datasets = pytest.importorskip("datasets")
    ds = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b c", "d e f"]}).save_to_disk(str(ds))
    ins = open_inputs([str(ds)])
    with pytest.raises(InputError, match="lies inside the input dataset"):
        check_out_outside_inputs(ins, ds / "run")
    check_out_outside_inputs(ins, tmp_path / "run")  # beside it: fine
    assert Path(ds).is_dir()


def test_long_documents_raise_no_false_warning_about_indexing(tmp_path, capfd):
    """The plan's token estimate tokenizes a sample at full length (truncation comes per bin after);
    transformers warned 'Token indices sequence length is longer ... indexing errors'."""
    from geomscope.extract import extract

    src = tmp_path / "long.txt"
    src.write_text(" ".join(["word"] * 2000) + "\n")
    extract("bundled:minilm", [src], tmp_path / "r", layers="0")
    assert "indexing errors" not in capfd.readouterr().err


def test_extract_refuses_an_out_inside_its_input_dataset(cli, tmp_path):
    """The dataset's hash covers every file under it, the run's own included: such a run could
    never be resumed ('inputs.0.bytes 3260 in the run, 3112652 now', blaming the input)."""
    datasets = pytest.importorskip("datasets")
    ds = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b c", "d e f"]}).save_to_disk(str(ds))
    code, out, err = cli(["extract", "bundled:minilm", ds, "--out", ds / "run", "-q"])
    assert_one_line_error(code, out, err, "lies inside the input dataset", exit_code=2)
    assert not (ds / "run").exists()


# ------------------------------------------------------------------ stdin, pipes, CSV, gzip


def test_stdin_copy_is_removed_when_a_later_input_is_bad(tmp_path, monkeypatch, tiny_bert):
    import io

    from geomscope.extract.run import extract

    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    stdin = io.TextIOWrapper(io.BytesIO(TWELVE_DOCS.encode()))
    with pytest.raises(InputError, match="does not exist"):
        extract(tiny_bert, ["-", str(tmp_path / "missing.txt")], tmp_path / "run", stdin=stdin)
    assert list(spool.iterdir()) == []


class _UnreadableStdin:
    """A standard input whose descriptor is gone (``<&-`` after start-up): every read is EBADF."""

    def read(self, n=-1):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


@pytest.mark.parametrize("stdin", [None, _UnreadableStdin()], ids=["closed", "unreadable"])
def test_a_closed_stdin_is_one_line(cli, tmp_path, monkeypatch, stdin):
    """``extract MODEL -`` with standard input closed (``<&-``: Python then has no sys.stdin) or
    failing to read is one line, not an AttributeError or OSError traceback; no run directory is made."""
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code, out, err = cli(["extract", "bundled:minilm", "-", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "standard input", exit_code=2)
    assert not (tmp_path / "r").exists()
    assert not list(tmp_path.glob("geomscope-stdin-*"))


class _CountedStream:
    """A binary standard input of ``data``, counting the bytes read from it."""

    def __init__(self, data: bytes):
        self.data, self.read_bytes = data, 0

    def read(self, n=-1):
        n = len(self.data) - self.read_bytes if n < 0 else n
        chunk = self.data[self.read_bytes : self.read_bytes + n]
        self.read_bytes += len(chunk)
        return chunk


@pytest.mark.parametrize("data", [b"\0" * (1 << 20), b"one line " * 120_000, b"ok\n" + b"x" * (1 << 20)])
def test_a_stream_line_beyond_any_documents_bound_is_refused_as_it_comes(cli, tmp_path, monkeypatch, data):
    """`extract M - < /dev/zero` stops without filling the temporary folder: a stream is
    read line by line into its copy, and a line longer than any document's bounded prefix is
    refused once it passes MAX_STREAM_LINE_BYTES, its copy removed, the rest left unread."""
    from geomscope.extract import sources

    monkeypatch.setattr(sources, "MAX_STREAM_LINE_BYTES", 64 << 10)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stdin = _CountedStream(data)
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = cli(["extract", "bundled:minilm", "-", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "standard input", "longer than 65536 bytes", exit_code=2)
    assert stdin.read_bytes <= 2 * (64 << 10) and not (tmp_path / "r").exists()
    assert not list(tmp_path.glob("geomscope-stdin-*"))


def test_stream_lines_within_the_bound_are_spooled_whole(tmp_path, monkeypatch):
    """Many lines, each within the bound, make a stream of any length: nothing is refused."""
    from geomscope.extract import sources

    monkeypatch.setattr(sources, "MAX_STREAM_LINE_BYTES", 64 << 10)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = b"".join(b"y" * (64 << 10) + b"\n" for _ in range(20)) + b"z" * (64 << 10)  # no final newline
    (inp,) = sources.open_inputs(["-"], stdin=_CountedStream(data))
    try:
        assert inp.path.read_bytes() == data
    finally:
        sources.close_inputs([inp])


def test_csv_byte_order_mark(cli, tiny_bert, tmp_path):
    csv_in = tmp_path / "bom.csv"
    csv_in.write_bytes(b"\xef\xbb\xbftext,other\nhello there,1\nsecond row,2\n")
    code, _, err = cli(["extract", tiny_bert, csv_in, "--out", tmp_path / "run", "--quiet"])
    assert code == 0, err
    from geomscope.train.data import load_table

    ft = tmp_path / "bom-train.csv"
    ft.write_bytes(b"\xef\xbb\xbfsentence,label\ngood film,pos\nbad film,neg\n")
    t = load_table(ft)
    assert list(t.labels) == ["pos", "neg"]


def test_a_cut_gzip_csv_is_one_line(cli, tiny_bert, tmp_path):
    import gzip

    whole = gzip.compress(("text\n" + TWELVE_DOCS).encode() * 50)
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    code, out, err = cli(
        ["extract", tiny_bert, cut, "--text-field", "text", "--out", tmp_path / "run", "--quiet"]
    )
    line = assert_one_line_error(code, out, err, "cut.csv.gz", exit_code=2)
    assert "interrupted" not in line


def test_extract_reads_a_pipe_to_its_end_once(cli, tiny_bert, tmp_path):
    """A named FIFO (or ``<(zcat x.gz)``) is spooled like stdin: its bytes are read once, to their end,
    and give the rows the same text in a file gives; the spooled copy is removed."""
    import threading

    fifo = tmp_path / "docs.txt"
    os.mkfifo(fifo)

    def writer():
        with open(fifo, "w") as f:
            f.write(TWELVE_DOCS)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    spool = tmp_path / "spool"
    spool.mkdir()
    old = tempfile.tempdir
    tempfile.tempdir = str(spool)
    try:
        code, _o, e = quiet_extract(cli, tiny_bert, fifo, tmp_path / "piped")
    finally:
        tempfile.tempdir = old
    th.join(timeout=10)
    assert code == 0, e
    assert not list(spool.iterdir())  # the spooled copy is gone
    plain = tmp_path / "docs-file.txt"
    plain.write_text(TWELVE_DOCS)
    assert quiet_extract(cli, tiny_bert, plain, tmp_path / "filed")[0] == 0
    from geomscope.store import Run

    piped, filed = Run(tmp_path / "piped"), Run(tmp_path / "filed")
    assert piped.total_rows == filed.total_rows > 0
    manifest = json.loads((tmp_path / "piped" / "manifest.json").read_text())
    assert str(fifo) in json.dumps(manifest)  # the input is recorded as given


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
    plain.write_text(TWELVE_DOCS)
    assert is_stream("-") and is_stream(fifo) and not is_stream(plain) and not is_stream(tmp_path)
    with pytest.raises(InputError, match="docs.txt can be read once"):
        extract_revisions("model", [str(plain), str(fifo)], tmp_path / "out", ["a", "b"], None)
    with pytest.raises(InputError, match="cannot share .*docs.txt"):
        check_options(SimpleNamespace(max_tokens=None), [str(fifo)])
