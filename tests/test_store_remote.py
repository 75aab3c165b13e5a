"""Runs read through fsspec URLs (``memory://``, ``file://``): same report as the local directory,
inspect and --verify, one-line errors for unknown schemes and missing packages, hostile manifests."""

from __future__ import annotations

import json
import math

import pytest
from conftest import assert_one_line_error
from helpers_models import SAMPLE_TEXTS, make_tiny_model

from geomscope.errors import DataError, InputError
from geomscope.extract.run import extract
from geomscope.score import ScoreOptions, score
from geomscope.store import describe_run, remote

fsspec = pytest.importorskip("fsspec")

OPTS = dict(
    metrics=("isoscore", "isoscore_star", "avgcos", "spectrum", "outliers", "twonn"),
    id_sample=200,
    jackknife_groups=4,
)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    model = make_tiny_model("gpt2", root)
    src = root / "in.txt"
    src.write_text("\n".join(SAMPLE_TEXTS) + "\n")
    extract(str(model), [src], root / "run", layers="0,-1", shard_docs=4, store_dtype="float32")
    return root / "run"


@pytest.fixture
def mem():
    """A fresh memory:// filesystem (one per process: tests scoring it use --workers 1)."""
    fs = fsspec.filesystem("memory")
    yield fs
    for top in ("/runs",):
        if fs.exists(top):
            fs.rm(top, recursive=True)


def _copy_to_memory(fs, local, dest="/runs/x") -> str:
    for p in sorted(local.iterdir()):
        if p.is_file() and not p.name.startswith(".geomscope"):
            fs.pipe(f"{dest}/{p.name}", p.read_bytes())
    return f"memory:/{dest}"


@pytest.fixture(scope="module")
def reference(local_run):
    return score(local_run, ScoreOptions(workers=1, **OPTS))


def _same(a, b, where="report"):
    """Every number of ``a`` equals ``b``'s to 1e-12 (relative), every other leaf is equal."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12), where
    else:
        assert a == b, where


def _compare(ref: dict, got: dict, url: str):
    assert len(ref["layers"]) == len(got["layers"]) == 2
    for ea, eb in zip(ref["layers"], got["layers"], strict=True):
        _same(ea, eb, f"layers.{ea['layer']}")
    assert got["source"]["path"] == url and got["run"]["dir"] == url
    assert got["source"]["kind"] == "run"


def test_is_url_and_location(tmp_path):
    assert remote.is_url("memory://runs/x") and remote.is_url("s3://b/k") and remote.is_url("file:///a")
    assert not remote.is_url("runs/x") and not remote.is_url(tmp_path) and not remote.is_url("C:/x")
    from pathlib import Path

    # a URL that went through Path() (a CLI argument typed as a path) is recovered
    assert remote.location(Path("memory://runs/x")) == "memory://runs/x"
    assert remote.location(Path("file:///tmp/a/b")) == "file:///tmp/a/b"
    assert remote.location(str(tmp_path)) == tmp_path and remote.location(tmp_path) == tmp_path
    assert remote.join("memory://runs/x/", "manifest.json") == "memory://runs/x/manifest.json"


def test_memory_url_scores_like_the_local_run(local_run, reference, mem):
    url = _copy_to_memory(mem, local_run)
    assert url == "memory://runs/x"
    got = score(url, ScoreOptions(workers=1, **OPTS))  # memory:// lives in this process only
    _compare(reference, got, url)


def test_score_cli_on_memory_url(local_run, mem, cli, tmp_path):
    url = _copy_to_memory(mem, local_run)
    out = tmp_path / "rep"
    code, stdout, err = cli(["score", url, "--workers", "1", "--out", out, "--json", "--quiet"])
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["source"]["path"] == url and len(rep["layers"]) == 2
    assert (tmp_path / "rep.json").exists() or any(tmp_path.iterdir())


def test_file_url_with_two_workers(local_run, reference):
    url = local_run.as_uri()
    assert url.startswith("file:///")
    got = score(url, ScoreOptions(workers=2, **OPTS))  # each worker re-opens the URL with fsspec
    _compare(reference, got, url)


def test_describe_and_verify_memory_url(local_run, mem, cli):
    url = _copy_to_memory(mem, local_run)
    d = describe_run(url, verify=True)
    local = describe_run(local_run)
    assert d["run_dir"] == url and d["in_progress"] is False
    for k in ("rows", "docs", "shards", "layers", "dim", "unlisted_shard_files", "interrupted_shard_files"):
        assert d[k] == local[k], k
    assert d["shards"] >= 3 and d["verify"]["ok"] and d["verify"]["checked"] == d["shards"]
    manifest_bytes = (local_run / "manifest.json").stat().st_size
    shard_bytes = sum(p.stat().st_size for p in local_run.glob("shard-*.h5"))
    assert d["bytes_on_disk"] == manifest_bytes + shard_bytes
    code, out, err = cli(["inspect", url, "--verify", "--json"])
    assert code == 0, err
    assert json.loads(out)["verify"]["ok"] and json.loads(out)["run_dir"] == url

    # one flipped byte of one shard in memory: same size, caught by the checksum
    path = "/runs/x/shard-00001.h5"
    raw = bytearray(mem.cat(path))
    raw[len(raw) // 2] ^= 0xFF
    mem.pipe(path, bytes(raw))
    v = describe_run(url, verify=True)["verify"]
    assert not v["ok"] and [b["file"] for b in v["bad"]] == ["shard-00001.h5"]
    assert "checksum" in v["bad"][0]["error"]
    code, out, err = cli(["inspect", url, "--verify"])
    assert_one_line_error(code, None, err, "shard-00001.h5", exit_code=3)
    with pytest.raises(DataError, match="checksum differs"):
        score(url, ScoreOptions(workers=1, **OPTS))
    mem.rm(path)
    with pytest.raises(DataError, match="missing"):
        score(url, ScoreOptions(workers=1, **OPTS))


def test_missing_run_and_not_a_run(mem, cli):
    with pytest.raises(InputError, match="does not exist"):
        score("memory://runs/nothing-here", ScoreOptions(workers=1))
    mem.pipe("/runs/notrun/readme.txt", b"hello")
    with pytest.raises(InputError, match="not a geomscope run directory"):
        score("memory://runs/notrun", ScoreOptions(workers=1))
    with pytest.raises(InputError, match="not a geomscope run directory"):
        describe_run("memory://runs/notrun")
    code, out, err = cli(["score", "memory://runs/nothing-here", "--workers", "1"])
    assert_one_line_error(code, out, err, "does not exist", exit_code=2)


def test_unknown_scheme_is_one_line(cli):
    code, out, err = cli(["score", "nosuch://x/run"])
    assert_one_line_error(code, out, err, "nosuch://", exit_code=2)
    code, out, err = cli(["inspect", "nosuch://x/run"])
    assert_one_line_error(code, out, err, "nosuch://", exit_code=2)


def test_missing_filesystem_package_names_it(cli, monkeypatch):
    """s3:// as if s3fs were not installed (whether or not it is here): fsspec's lookup raises."""
    import importlib

    registry = importlib.import_module("fsspec.registry")  # ``fsspec.registry`` is the mapping
    core = importlib.import_module("fsspec.core")
    real = registry.get_filesystem_class

    def not_installed(protocol):
        if protocol == "s3":
            raise ImportError("Install s3fs to access S3")
        return real(protocol)

    monkeypatch.setattr(registry, "get_filesystem_class", not_installed)
    monkeypatch.setattr(core, "get_filesystem_class", not_installed)
    for args in (["score", "s3://bucket/run"], ["inspect", "s3://bucket/run", "--verify"]):
        code, out, err = cli(args)
        assert_one_line_error(code, out, err, "pip install s3fs", exit_code=2)
    import importlib.util

    if importlib.util.find_spec("gcsfs") is None:  # really absent here: fsspec's own ImportError
        with pytest.raises(InputError, match="pip install gcsfs"):
            remote.filesystem("gcs://bucket/run")


@pytest.mark.parametrize(
    "file",
    ["../x.h5", "/etc/passwd", "sub/shard-00000.h5", "shard-00000.h5/../../x.h5", "memory://runs/y/a.h5"],
)
def test_hostile_shard_name_refused(local_run, mem, cli, file):
    url = _copy_to_memory(mem, local_run)
    m = json.loads(mem.cat("/runs/x/manifest.json"))
    m["shards"][0]["file"] = file
    mem.pipe("/runs/x/manifest.json", json.dumps(m).encode())
    with pytest.raises(InputError, match="not a shard name geomscope writes"):
        score(url, ScoreOptions(workers=1))
    with pytest.raises(InputError, match="not a shard name geomscope writes"):
        describe_run(url)
    code, out, err = cli(["inspect", url])
    assert_one_line_error(code, out, err, "not a shard name", exit_code=2)


def test_unreadable_manifest_in_memory(local_run, mem):
    url = _copy_to_memory(mem, local_run)
    mem.pipe("/runs/x/manifest.json", b"{not json")
    with pytest.raises(InputError, match="unreadable"):
        score(url, ScoreOptions(workers=1))
    mem.pipe("/runs/x/manifest.json", json.dumps([1, 2]).encode())
    with pytest.raises(InputError, match="not a geomscope manifest"):
        describe_run(url)


def test_file_url_on_a_dask_cluster(local_run, reference):
    """Dask workers re-open the URL string each task carries (nothing open is pickled)."""
    pytest.importorskip("distributed")
    url = local_run.as_uri()
    got = score(url, ScoreOptions(scheduler="local:2", **OPTS))
    _compare(reference, got, url)


def _ftp_peer(reply: bytes):
    """A port whose every connection gets ``reply`` and is closed: an FTP server's first words."""
    import socket
    import threading

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)

    def serve():
        while True:
            try:
                conn, _ = s.accept()
            except OSError:  # closed at the end of the test
                return
            with conn:
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return s, s.getsockname()[1]


def test_a_server_that_cannot_be_reached_is_one_line(cli, tmp_path):
    """ftp:// connects as its filesystem is made: a refused connection or a peer that answers junk
    is one line, not a traceback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    code, out, err = cli(["score", f"ftp://127.0.0.1:{closed}/run", "--quiet"])
    assert_one_line_error(
        code, out, err, f"ftp://127.0.0.1:{closed}/run", "server can be reached", exit_code=2
    )
    junk, port = _ftp_peer(b"\xffnot an ftp server\r\n")
    try:
        for args in (
            ["score", f"ftp://127.0.0.1:{port}/run", "--quiet"],
            ["inspect", f"ftp://127.0.0.1:{port}/run"],
        ):
            code, out, err = cli(args)
            assert_one_line_error(code, out, err, f"ftp://127.0.0.1:{port}/run", exit_code=2)
    finally:
        junk.close()


def test_a_silent_server_is_one_line_within_the_network_timeout(monkeypatch):
    """An ftp:// server that accepts and never answers does not hold the score for fsspec's default;
    geomscope sets the filesystem's timeout (NETWORK_TIMEOUT_S) and says it in one line. The wait is
    bounded generously here (20 s against the 1 s set): it is a hang check, not a timing."""
    import socket
    import threading

    monkeypatch.setattr(remote, "NETWORK_TIMEOUT_S", 1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # the connection waits in its backlog: no banner ever comes
    url = f"ftp://127.0.0.1:{silent.getsockname()[1]}/run"
    said = {}

    def open_it():
        try:
            remote.filesystem(url)
        except InputError as e:
            said["line"] = str(e)

    th = threading.Thread(target=open_it, daemon=True)
    try:
        th.start()
        th.join(20)
        assert not th.is_alive(), "still waiting for the silent server"
    finally:
        silent.close()
    assert url in said["line"] and "timed out" in said["line"] and "\n" not in said["line"]


def test_the_network_filesystems_get_the_timeout():
    """Each network filesystem that takes a timeout gets NETWORK_TIMEOUT_S under its own option name;
    the others (local, memory, hf://) get none."""
    t = remote.NETWORK_TIMEOUT_S
    assert remote.timeout_options("FTP") == {"timeout": t}
    assert remote.timeout_options("smb") == {"timeout": t}
    assert remote.timeout_options("sftp") == {"timeout": t, "banner_timeout": t, "auth_timeout": t}
    assert remote.timeout_options("s3") == {"config_kwargs": {"connect_timeout": t, "read_timeout": t}}
    for scheme in ("file", "memory", "hf", "zip"):
        assert remote.timeout_options(scheme) == {}


def test_a_timeout_the_fsspec_configuration_sets_is_kept(monkeypatch):
    from fsspec.config import conf

    monkeypatch.setitem(conf, "ftp", {"timeout": 120})
    assert remote.timeout_options("ftp") == {}


@pytest.mark.parametrize("url", ["zip://run", "reference://run", "github://run"])
def test_a_url_without_what_its_filesystem_needs_is_one_line(cli, tmp_path, monkeypatch, url):
    """zip:// without its archive (fsspec opens the working directory as one), reference:// without
    its references, github:// without org and repo: tracebacks from the filesystem's constructor.
    The URL is named whether or not github://'s package (requests) is installed here."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["score", url, "--quiet"])
    assert_one_line_error(code, out, err, url, exit_code=2)


@pytest.mark.parametrize(
    "scheme, module, needle",
    [
        ("http", "aiohttp", "needs aiohttp, which is not installed: pip install aiohttp"),
        ("sftp", "paramiko", "needs paramiko, which is not installed: pip install paramiko"),
        ("smb", "smbclient", 'SMB requires "smbprotocol"'),
        ("github", "requests", "needs requests, which is not installed: pip install requests"),
    ],
)
def test_a_protocol_whose_package_is_missing_names_that_package(cli, monkeypatch, scheme, module, needle):
    """These live in fsspec itself, so the line names their own package, never "pip install fsspec"
    (installed). Here their package cannot be imported, whether or not it is installed on this machine."""
    import importlib
    import sys

    registry = importlib.import_module("fsspec.registry")
    impl = registry.known_implementations[scheme]["class"].rsplit(".", 1)[0]
    monkeypatch.delitem(registry._registry, scheme, raising=False)  # fsspec keeps classes it imported
    monkeypatch.delitem(sys.modules, impl, raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails
    code, out, err = cli(["score", f"{scheme}://127.0.0.1/share/run", "--quiet"])
    url = f"{scheme}://127.0.0.1/share/run"
    line = assert_one_line_error(code, out, err, needle, url, exit_code=2)
    assert "pip install fsspec" not in line


def test_url_text_read_back_is_bounded(mem):
    mem.pipe("/runs/big/manifest.json", b"[" * 64)
    assert remote.read_text("memory://runs/big/manifest.json", max_bytes=64) == "[" * 64
    with pytest.raises(ValueError, match="larger than 63 bytes"):
        remote.read_text("memory://runs/big/manifest.json", max_bytes=63)


def test_a_named_pipe_at_a_file_url_is_refused_not_waited_on(tmp_path):
    """file:// names a file on this machine: its manifest is read as a local one is, so a FIFO there
    is refused at once (fsspec's open waited for a writer without end)."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "manifest.json")
    proc = subprocess.run(
        [sys.executable, "-m", "geomscope", "score", run.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
    )
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "a named pipe", exit_code=2)
