"""Shard checksums: what a run records to catch a corrupt or truncated shard, and how one is checked.

A finished shard's manifest entry records two digests of the file's bytes, computed in one read
when the shard is published:

- ``sha256``: the well-known content identity (``sha256sum`` gives the same), kept for provenance
  and for runs whose entries record no ``xxh3_128``;
- ``xxh3_128``: the 128-bit XXH3 hash, what ``score``, ``inspect --verify`` and a resumed
  ``extract`` check when it is recorded. It runs at ~10-25 GB/s on one core against sha256's ~1.7,
  and checking it is CPU work beside the scorer's: sha256 would cost about a ninth of the CPU time
  of a streaming IsoScore of 200k x 384 float16 rows on 2 cores (benchmarks/bench_score.py).

Neither digest is a defence against a hostile run: whoever can rewrite a shard can rewrite the
manifest beside it. They catch accidents (a truncated copy, a flipped bit, a shard of another run),
for which a 128-bit non-cryptographic hash is as good as sha256. Nothing here trusts the recorded
text: :func:`expected` returns only a digest of the right form.
"""

from __future__ import annotations

import re

import xxhash  # noqa: F401 -- imported here, not when a digest is due: a missing package is not a corrupt shard

from geomscope.fileio import file_digests
from geomscope.store import remote

FAST = "xxh3_128"
SLOW = "sha256"
_HEX_DIGITS = {FAST: 32, SLOW: 64}
_FORMS = {a: re.compile(f"[0-9a-f]{{{n}}}") for a, n in _HEX_DIGITS.items()}


def digests(loc, algorithms: tuple[str, ...] = (SLOW, FAST)) -> dict[str, str]:
    """Hex digests of the file at ``loc`` (a path or an fsspec URL) for each algorithm, in one read."""
    with remote.open_binary(loc) as f:
        return file_digests(f, algorithms)


def expected(entry) -> tuple[str, str] | None:
    """(algorithm, hex digest) to check for a manifest entry (a dict or an object with the digest
    attributes): ``xxh3_128`` when recorded (not None), else ``sha256``. None when the digest to
    check is not of its proper form -- never a quiet fall back to another one; the manifest's checks
    refuse such an entry before this is asked, and a check against None fails."""

    def get(algorithm):
        return entry.get(algorithm) if isinstance(entry, dict) else getattr(entry, algorithm, None)

    algorithm = FAST if get(FAST) is not None else SLOW
    value = get(algorithm)
    return (algorithm, value) if well_formed(algorithm, value) else None


def well_formed(algorithm: str, value) -> bool:
    """Whether ``value`` is a lower-case hex digest of ``algorithm``'s length."""
    return isinstance(value, str) and _FORMS[algorithm].fullmatch(value) is not None


def describe(algorithm: str) -> str:
    """What a well-formed digest of ``algorithm`` is, for error messages."""
    return f"an {algorithm} digest ({_HEX_DIGITS[algorithm]} lower-case hex digits)"


def matches(loc, digest: tuple[str, str]) -> bool:
    """Whether the file's ``digest[0]`` hash is ``digest[1]`` (OSError when it cannot be read)."""
    with remote.open_binary(loc) as f:
        return file_matches(f, digest)


def file_matches(f, digest: tuple[str, str]) -> bool:
    """:func:`matches` for an open binary file, read from where it stands."""
    algorithm, value = digest
    return file_digests(f, (algorithm,))[algorithm] == value
