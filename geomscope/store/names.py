"""The names a run directory gives its files, and the format tags those files carry.

A run directory holds ``manifest.json`` (its ``"format"`` is :data:`RUN_FORMAT`, its
``"format_version"`` :data:`FORMAT_VERSION`), ``shard-NNNNN.h5`` files (their ``format`` attribute
is :data:`SHARD_FORMAT`), while it is written each process's shard log and a lock file, and
geomscope's temporary files. Every name is declared once, here: the writers give these names, the
readers accept only these names (a manifest's shard ``file`` must be a plain shard name, never a
path), and :func:`run_reserved` says which names an output a user names may not take inside a run.
"""

from __future__ import annotations

import re

from geomscope.fileio import TEMP_PREFIX

#: the manifest's ``"format"`` and the newest ``"format_version"`` this geomscope reads and writes
RUN_FORMAT = "geomscope-run"
FORMAT_VERSION = 1
#: a shard file's ``format`` attribute
SHARD_FORMAT = "geomscope-shard"

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".geomscope.lock"
#: every process records its finished shards in its own shard log (manifest.ShardLog), which
#: process 0 folds into the manifest (at the end, and when a run is resumed); a ``.json`` part file
#: (one JSON document, rewritten per shard, as a run without shard logs leaves it) is read too
PART_RE = re.compile(r"\.geomscope-rank-\d{5}\.jsonl?")
#: the only names geomscope gives shards, and their temporary names while being written
SHARD_FILE_RE = re.compile(r"shard-\d{5,}\.h5")
SHARD_TEMP_RE = re.compile(r"\.shard-\d{5,}\.h5(\.[0-9a-f]+)?\.tmp")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.h5"


def part_name(rank: int) -> str:
    return f".geomscope-rank-{rank:05d}.jsonl"


def run_reserved(name: str) -> bool:
    """Whether a run directory keeps ``name`` for its own files: the manifest, the lock, the shard
    logs, the shards and their temporary names, geomscope's temporary files. An output of that name
    inside a run would be read, replaced or deleted by a later ``extract`` (a resume folds and
    removes the shard logs), so outputs.ensure_replaceable refuses it there."""
    return (
        name in (MANIFEST_NAME, LOCK_NAME)
        or name.startswith(TEMP_PREFIX)
        or any(r.fullmatch(name) for r in (PART_RE, SHARD_FILE_RE, SHARD_TEMP_RE))
    )
