"""Before any work: one pass over the inputs (validation, counts), the token and disk estimates.

The scan reads every record once (stopping after ``max_docs`` non-empty documents), so malformed
input (a missing field, undecodable bytes, bad JSON) is reported before the model is even loaded.
It keeps only counts, a 64-bin histogram of document lengths in characters and the first few
hundred texts; the token estimate tokenizes that sample for the tokens-per-character ratio and
applies it bin by bin, capped at the truncation length.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geomscope.errors import InputError
from geomscope.extract.sources import InputFile, iter_all

SAMPLE_DOCS = 128
SAMPLE_CHARS = 10_000  # characters of each sampled document that are tokenized
META_BYTES_PER_ROW = 3 * 8 + 1  # token_id, doc_id, position (int64) + is_special


@dataclass
class Scan:
    records: int = 0
    docs: int = 0  # non-empty documents (at most max_docs)
    empty: int = 0  # empty / whitespace-only records among those read
    chars: int = 0
    hist_count: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    hist_chars: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    sample: list[str] = field(default_factory=list)


def scan_inputs(inputs: list[InputFile], *, text_field: str, text_column: str, max_docs: int | None) -> Scan:
    s = Scan()
    for _, text in iter_all(inputs, text_field=text_field, text_column=text_column):
        s.records += 1
        if not text.strip():
            s.empty += 1
            continue
        s.docs += 1
        n = len(text)
        b = min(63, n.bit_length())
        s.hist_count[b] += 1
        s.hist_chars[b] += n
        s.chars += n
        if len(s.sample) < SAMPLE_DOCS:
            s.sample.append(text[:SAMPLE_CHARS])  # the ratio needs text, not whole huge documents
        if max_docs is not None and s.docs >= max_docs:
            break
    return s


def estimate_tokens(scan: Scan, tokenizer, max_length: int | None, max_tokens: int | None) -> int:
    """Estimated rows: sample tokens per character, applied per length bin, capped by truncation."""
    if scan.docs == 0:
        return 0
    # (verbose=False: the sample's full lengths are what is counted, truncation is applied per bin
    # below; transformers would warn of "indexing errors" that no forward will meet)
    lens = [len(x) for x in tokenizer(scan.sample, add_special_tokens=True, verbose=False)["input_ids"]]
    specials = len(tokenizer("", add_special_tokens=True, verbose=False)["input_ids"])
    chars = sum(len(t) for t in scan.sample)
    ratio = max(0.0, sum(lens) - specials * len(lens)) / max(1, chars)
    per_bin = scan.hist_count * specials + scan.hist_chars * ratio
    if max_length:
        per_bin = np.minimum(per_bin, scan.hist_count * max_length)
    est = int(np.ceil(per_bin.sum()))
    return min(est, max_tokens) if max_tokens else est


def bytes_per_row(n_layers: int, dim: int, store_dtype: str) -> int:
    return n_layers * (dim * np.dtype(store_dtype).itemsize + 1) + META_BYTES_PER_ROW


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).free)


def _total_bytes(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).total)


def check_disk(out: Path, needed: int) -> int:
    """Refuse (InputError) when the file system of ``out`` has fewer than ``needed`` bytes free."""
    free = free_bytes(out)
    if needed > free and _total_bytes(out) == 0:  # /proc, /sys: no disk at all
        raise InputError(f"--out {out} is on a file system that stores no files; choose another --out")
    if needed > free:
        raise InputError(
            f"not enough disk space for {out}: the run needs about {human_bytes(needed)}, "
            f"{human_bytes(free)} are free; free space, choose another --out, or store less "
            "(--layers, --max-tokens, --max-docs, --store-dtype float16)"
        )
    return free


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
