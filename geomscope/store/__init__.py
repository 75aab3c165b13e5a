"""The on-disk run format: a directory with ``manifest.json`` and HDF5 shards.

::

    run/
      manifest.json      identity (model, revision, layers, inputs, options), one entry per
                         finished shard (rows, documents, size, sha256 and xxh3_128 checksums:
                         checksum.py), totals, ``complete``
      .geomscope-rank-00000.jsonl   while a run is written: each process's shard log, one line per
                         shard it finished (manifest.py); folded into the manifest and removed
      shard-00000.h5     /layers/<name> (rows, D) float16|float32, chunked ~2 MiB, all of D per chunk
                         /token_id /doc_id /position (rows,) int64, /is_special (rows,) bool
                         /nonfinite/<name> (rows,) bool -- rows whose activations hold NaN/Inf

Writers: :class:`RunWriter` (manifest, identity check, resume, lock) and :class:`ShardWriter`
(one shard, appended batch by batch, written under a temporary name, fsynced, renamed).
Readers: :class:`Run` (reader.py: the manifest, layers, shards as tasks, blocks of rows, the
checks), :func:`iter_shard`; integrity.py holds the checks between the files and the reads;
names.py every file name and format tag; sample.py the seeded row keys of a sample (a
``--keep sample`` run's, ``score``'s). Nothing here imports torch.
"""

from geomscope.store.describe import describe_run
from geomscope.store.integrity import verify_shard
from geomscope.store.manifest import RunWriter, identity_differences
from geomscope.store.names import FORMAT_VERSION, MANIFEST_NAME, shard_name
from geomscope.store.reader import Run, ShardChunk, iter_shard, read_shard_index, shard_dim
from geomscope.store.shard import ShardInfo, ShardWriter, nonfinite_rows

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Run",
    "RunWriter",
    "ShardChunk",
    "ShardInfo",
    "ShardWriter",
    "describe_run",
    "identity_differences",
    "iter_shard",
    "shard_dim",
    "nonfinite_rows",
    "read_shard_index",
    "shard_name",
    "verify_shard",
]
