"""extract's inputs and its disk: a device is refused (it was copied until the disk was full), a
stream that does not fit the temporary folder, a disk that fills up while shards are written and a
SIGTERM are each one line, with no copy of the input left behind; --out inside an input dataset is
refused (it could never be resumed)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_one_line_error

from geomscope.errors import InputError

GEOMSCOPE = [sys.executable, "-m", "geomscope"]


def test_a_device_is_refused(cli, tmp_path):
    code, out, err = cli(["extract", "bundled:minilm", "/dev/zero", "--out", tmp_path / "r"])
    assert_one_line_error(code, out, err, "/dev/zero is a device", exit_code=2)
    assert not (tmp_path / "r").exists()


def test_a_stream_larger_than_the_temporary_folder_allows_is_one_line(tmp_path):
    """A file-size limit (as a full disk would) on the spooled copy of stdin: EFBIG was a traceback."""
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


def test_the_cli_puts_the_previous_sigterm_handler_back(cli):
    before = signal.getsignal(signal.SIGTERM)
    cli(["--help"])
    assert signal.getsignal(signal.SIGTERM) is before


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


def test_an_out_through_a_link_to_nothing_says_so(cli, tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    src = tmp_path / "in.txt"
    src.write_text("a sentence\n")
    for out_dir in (tmp_path / "dangling", tmp_path / "dangling" / "sub"):
        code, out, err = cli(["extract", "bundled:minilm", src, "--out", out_dir, "-q"])
        assert_one_line_error(code, out, err, "dangling is a link to nothing", exit_code=2)


def test_long_documents_raise_no_false_warning_about_indexing(tmp_path, capfd):
    """The plan's token estimate tokenizes a sample at full length (truncation comes per bin after);
    transformers warned 'Token indices sequence length is longer ... indexing errors'."""
    from geomscope.extract import extract

    src = tmp_path / "long.txt"
    src.write_text(" ".join(["word"] * 2000) + "\n")
    extract("bundled:minilm", [src], tmp_path / "r", layers="0")
    assert "indexing errors" not in capfd.readouterr().err


def test_error_lines_show_control_characters_as_escapes(cli, tmp_path):
    """An error names files from the user's data; ESC in such a name drove the terminal."""
    name = tmp_path / "x\x1b]0;owned\x07.txt"
    code, out, err = cli(["extract", "bundled:minilm", name, "--out", tmp_path / "r"])
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b" in err


def test_dask_local_workers_are_bounded_like_workers():
    from geomscope.score.dask_executor import parse_scheduler

    assert parse_scheduler("local:4") == "local:4"
    with pytest.raises(InputError, match="at most 1024"):
        parse_scheduler("local:100000")


def test_progress_descriptions_are_shown_as_text():
    from rich.text import Text

    from geomscope.progress import _as_text

    # rendered with markup, it reads as written, the ESC as a visible escape
    assert Text.from_markup(_as_text("layer [bold red]x[/] \x1b[2J")).plain == "layer [bold red]x[/] \\x1b[2J"


def test_extract_refuses_an_out_inside_its_input_dataset(cli, tmp_path):
    """The dataset's hash covers every file under it, the run's own included: such a run could
    never be resumed ('inputs.0.bytes 3260 in the run, 3112652 now', blaming the input)."""
    datasets = pytest.importorskip("datasets")
    ds = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b c", "d e f"]}).save_to_disk(str(ds))
    code, out, err = cli(["extract", "bundled:minilm", ds, "--out", ds / "run", "-q"])
    assert_one_line_error(code, out, err, "lies inside the input dataset", exit_code=2)
    assert not (ds / "run").exists()


def test_a_finetune_csv_with_trailing_commas_loads(tmp_path):
    """Excel's trailing commas give blank column names: not 'the column '' twice'."""
    from geomscope.train.data import load_table

    path = tmp_path / "d.csv"
    path.write_text("sentence,label,,\nhello,a,,\nworld,b,,\n")
    assert load_table(path).labels == ["a", "b"]


def test_a_covariance_handed_over_in_half_precision_is_accepted():
    import numpy as np
    import torch

    import geomscope.metrics as gm

    x = np.random.default_rng(0).standard_normal((500, 64)).astype(np.float32)
    c = x.T @ x / 499
    want = gm.isoscore_from_cov(c)
    assert gm.isoscore_from_cov(c.astype(np.float16)) == pytest.approx(want, rel=1e-3)
    assert gm.isoscore_from_cov(torch.tensor(c).bfloat16()) == pytest.approx(want, rel=1e-2)
