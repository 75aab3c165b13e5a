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

from __future__ import annotations

from geomscope.lazy import lazy_names

#: each public name -> the module that defines it: imported on first use, so that the options
#: (what ``geomscope inspect --help`` is built from) import no h5py
_HOMES = {
    "FORMAT_VERSION": "names",
    "InspectOptions": "options",
    "MANIFEST_NAME": "names",
    "Run": "reader",
    "RunWriter": "manifest",
    "ShardChunk": "reader",
    "ShardInfo": "shard",
    "ShardWriter": "shard",
    "describe_run": "describe",
    "identity_differences": "manifest",
    "iter_shard": "reader",
    "nonfinite_rows": "shard",
    "read_shard_index": "reader",
    "shard_dim": "reader",
    "shard_name": "names",
    "verify_shard": "integrity",
}

__getattr__, __all__ = lazy_names(__name__, _HOMES)
