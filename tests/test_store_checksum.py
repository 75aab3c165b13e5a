"""Shard checksums (store/checksum.py): both recorded, xxh3_128 checked, sha256 where no xxh3_128 is
recorded, and a manifest's checksum text never trusted unchecked."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import xxhash

from geomscope.errors import DataError, InputError
from geomscope.score import ScoreOptions, score
from geomscope.store import Run, RunWriter, describe_run, verify_shard

IDENT = {"model": {"name": "toy", "hidden_size": 8}, "layers": [{"name": "layer_00", "index": 0}]}


def _write(run_dir, n_shards=2, rows=300):
    rng = np.random.default_rng(0)
    with RunWriter(run_dir, IDENT) as w:
        for i in range(n_shards):
            sw = w.shard_writer(
                i,
                layer_names=["layer_00"],
                dim=8,
                store_dtype="float32",
                doc_start=10 * i,
                doc_stop=10 * i + 10,
            )
            sw.append(
                {"layer_00": rng.normal(size=(rows, 8))},
                token_id=np.arange(rows),
                doc_id=i * 10 + np.arange(rows) // 30,
                position=np.arange(rows) % 30,
                is_special=np.zeros(rows, bool),
            )
            w.add_shard(sw.close())
        w.finalize({"docs": 10 * n_shards})
    return run_dir


def _edit_manifest(run_dir, fn):
    p = run_dir / "manifest.json"
    m = json.loads(p.read_text())
    for entry in m["shards"]:
        fn(entry)
    p.write_text(json.dumps(m))


def _flip_byte(path):
    """One byte of the activations flipped: same size, so only the checksum can tell."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture
def run(tmp_path):
    return _write(tmp_path / "run")


def test_both_digests_recorded_against_the_libraries(run):
    for info in Run(run).shards:
        raw = (run / info.file).read_bytes()
        assert info.sha256 == hashlib.sha256(raw).hexdigest()
        assert info.xxh3_128 == xxhash.xxh3_128_hexdigest(raw)
        assert info.digest == ("xxh3_128", info.xxh3_128)


def test_the_recorded_xxh3_is_what_is_checked(run):
    """A wrong sha256 beside the right xxh3_128 passes; a wrong xxh3_128 beside the right sha256 fails:
    the fast digest is the one read back (and a flipped byte is caught by it)."""
    _edit_manifest(run, lambda e: e.update(sha256="0" * 64))
    for info in Run(run).shards:
        verify_shard(run / info.file, info)
    score(run, ScoreOptions(metrics=("isoscore",)))
    _edit_manifest(run, lambda e: e.update(xxh3_128="0" * 32))
    info = Run(run).shards[0]
    with pytest.raises(DataError, match="shard-00000.h5.*checksum differs"):
        verify_shard(run / info.file, info)


@pytest.mark.parametrize("workers", [1, 2])
def test_flipped_byte_stops_score_and_verify(run, workers):
    _flip_byte(run / "shard-00001.h5")
    with pytest.raises(DataError, match="shard-00001.h5.*checksum"):
        score(run, ScoreOptions(metrics=("isoscore",), workers=workers))
    bad = describe_run(run, verify=True)["verify"]["bad"]
    assert [b["file"] for b in bad] == ["shard-00001.h5"] and "checksum" in bad[0]["error"]


def test_runs_from_before_xxh3_are_checked_by_sha256(run):
    _edit_manifest(
        run, lambda e: e.pop("xxh3_128") if e["index"] else e.update(xxh3_128=None)
    )  # null: absent
    infos = Run(run).shards
    assert all(i.xxh3_128 is None and i.digest == ("sha256", i.sha256) for i in infos)
    assert describe_run(run, verify=True)["verify"]["ok"]
    score(run, ScoreOptions(metrics=("isoscore",)))
    _flip_byte(run / "shard-00000.h5")
    with pytest.raises(DataError, match="shard-00000.h5.*checksum"):
        score(run, ScoreOptions(metrics=("isoscore",)))
    assert not describe_run(run, verify=True)["verify"]["ok"]
    with RunWriter(run, IDENT) as w:  # a resume redoes the shard whose sha256 fails, keeps the other
        assert set(w.finished) == {1}


@pytest.mark.parametrize(
    "field, value",
    [
        ("xxh3_128", "ZZ" * 16),
        ("xxh3_128", "0" * 31),
        ("xxh3_128", "AB" * 16),  # upper case: never what geomscope writes
        ("xxh3_128", "ab" * 16 + "\n"),
        ("xxh3_128", ["ab" * 16]),
        ("xxh3_128", 12),
        ("xxh3_128", "f" * 1_000_000),  # named in a short line, not echoed whole
        ("sha256", "abc"),
        ("sha256", None),
    ],
)
def test_malformed_checksums_are_refused(run, cli, field, value):
    """A malformed digest is refused, never passed over for the other one (the sha256 beside each
    bad xxh3_128 here is right)."""
    _edit_manifest(run, lambda e: e.update({field: value}) if value is not None else e.pop(field))
    with pytest.raises(InputError, match=rf"damaged \(shards\[0\]\.{field} is .*not an {field} digest") as e:
        Run(run)
    assert len(str(e.value)) < 400
    code, out, err = cli(["score", run, "--metrics", "isoscore", "--out", run.parent / "r.json"])
    assert code != 0 and err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert not (run.parent / "r.json").exists()


def test_a_digest_not_of_its_form_fails_closed(run):
    """A ShardInfo built by hand (no manifest check) with a malformed xxh3_128 is not checked against
    its sha256 instead: the check fails."""
    info = dataclasses.replace(Run(run).shards[0], xxh3_128="not hex")
    assert info.digest is None
    with pytest.raises(DataError, match="shard-00000.h5.*checksum differs"):
        verify_shard(run / info.file, info)


class _ReadOnly:
    """A file object with ``read`` and no ``readinto`` (as some fsspec file systems give)."""

    def __init__(self, path):
        self._f = open(path, "rb")  # noqa: SIM115

    def read(self, n=-1):
        return self._f.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("readinto", [True, False], ids=["readinto", "read"])
@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 10_007])
def test_digests_over_a_reused_buffer_equal_the_libraries(tmp_path, monkeypatch, readinto, size):
    """The file is read into one reused buffer (here 1000 bytes): every length around it, through
    ``readinto`` or through ``read`` where a file object has no ``readinto``, hashes as the libraries do."""
    from geomscope import fileio
    from geomscope.store import checksum, remote

    path = tmp_path / "f.bin"
    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(raw)
    monkeypatch.setattr(fileio, "HASH_READ_BYTES", 1000)
    if not readinto:
        monkeypatch.setattr(remote, "open_binary", _ReadOnly)
    got = checksum.digests(path)
    assert got == {"sha256": hashlib.sha256(raw).hexdigest(), "xxh3_128": xxhash.xxh3_128_hexdigest(raw)}
