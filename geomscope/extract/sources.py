"""Text inputs: files, JSON lines, CSV/TSV, ``datasets.save_to_disk`` directories and stdin.

Every input is a sequence of *records*; each record is one document's text.  Records of several
inputs are numbered in order, across inputs, from 0: that number is the ``doc_id`` stored with
every row, so a row maps back to its source (``inputs[i].first_doc_id`` + record number).

- ``*.txt`` and any other file: one document per line (UTF-8; the line break is not part of it);
- ``*.jsonl`` / ``*.ndjson`` / ``*.json``: one JSON object per line, the text in ``text_field``
  (dotted for nesting: ``meta.body``); blank lines are not records; ``null`` is an empty document;
- ``*.csv`` / ``*.tsv``: a header row, the text in ``text_column``;
- a directory written by ``datasets.save_to_disk`` (one split): the text in ``text_field``;
- ``-``: standard input, one document per line (spooled to a temporary file so it can be hashed
  and read twice).
``.gz`` files are read decompressed.  Documents whose text is empty or only whitespace are skipped
(and counted) by the extraction.  Nothing is held in memory beyond the current record.
"""

from __future__ import annotations

import csv
import errno
import gzip
import io
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from geomscope.errors import InputError, first_line_of
from geomscope.fileio import input_digest, loads_json, regular_files_below

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = {".csv": ",", ".tsv": "\t", ".tab": "\t"}


@dataclass
class InputFile:
    """One input: what the user gave, where it is, what kind, its content hash."""

    arg: str
    path: Path
    kind: str  # "text" | "jsonl" | "csv" | "tsv" | "dataset" | "stdin"
    gzip: bool = False
    spooled: bool = False  # ``path`` is geomscope's temporary copy of a stream (stdin, a pipe): removed after
    sha256: str | None = None
    bytes: int = 0
    first_doc_id: int = 0
    records: int = 0

    def identity(self) -> dict:
        return {
            "path": self.arg if self.spooled else str(self.path),
            "kind": self.kind,
            "sha256": self.sha256,
            "bytes": self.bytes,
        }


def _kind_of(path: Path) -> tuple[str, bool]:
    name = path.name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    suffix = os.path.splitext(name)[1]
    if suffix in JSONL_SUFFIXES:
        return "jsonl", gz
    if suffix in CSV_SUFFIXES:
        return ("csv" if CSV_SUFFIXES[suffix] == "," else "tsv"), gz
    return "text", gz


def _is_dataset_dir(path: Path) -> bool:
    return any((path / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def open_inputs(args: list[str], *, stdin=None) -> list[InputFile]:
    """Check that every input exists and is readable, decide its kind; spool ``-`` and pipes (a named
    FIFO, ``<(zcat x.gz)``) to a temp file, read to their end: they can be read only once, and
    extraction reads its input more than once (its hash, its documents).

    A spooled copy is removed on every exit path: by :func:`close_inputs` after the run, or here
    when a later input is refused (or reading is interrupted).
    """
    if not args:
        raise InputError(
            "no input given; pass text files, .jsonl, .csv/.tsv, a saved dataset directory, or -"
        )
    out: list[InputFile] = []
    try:
        for a in args:
            out.append(_spool_stdin(stdin) if str(a) == "-" else _open_input(str(a)))
    except BaseException:
        close_inputs(out)
        raise
    return out


def is_stream(arg) -> bool:
    """Whether an input can be read only once: ``-`` (stdin), a pipe, a device (not a file or a
    directory, which a second reader -- another revision, another process -- reads again)."""
    if str(arg) == "-":
        return True
    p = Path(str(arg)).expanduser()
    return p.exists() and not p.is_file() and not p.is_dir()


def _open_input(a: str) -> InputFile:
    p = Path(a).expanduser()
    if p.is_symlink() and not p.exists():
        raise InputError(f"input {a} is a link to nothing (a missing target, or a loop); check the path")
    if not p.exists():
        raise InputError(f"input {a} does not exist; check the path")
    if p.is_dir():
        if not _is_dataset_dir(p):
            raise InputError(
                f"input {a} is a directory but not a dataset saved by datasets.save_to_disk; "
                "give text files or a saved dataset directory"
            )
        regular_files_below(p, a)  # (a pipe among its data files: datasets would wait on it)
        return InputFile(arg=a, path=p.resolve(), kind="dataset")
    if not os.access(p, os.R_OK):
        raise InputError(f"input {a} is not readable (permission denied); fix its permissions")
    if not p.is_file():  # a pipe: its bytes, once
        if not stat.S_ISFIFO(p.stat().st_mode):  # /dev/zero would be copied until the disk is full
            raise InputError(
                f"input {a} is a device, not a file or a pipe; give text files, a saved dataset, a "
                "pipe, or - for standard input"
            )
        kind, gz = _kind_of(p)
        try:
            with open(p, "rb") as stream:
                return _spool(stream, a, kind, gz)
        except OSError as e:
            raise InputError(f"input {a} cannot be read ({e.strerror or e}); check the file") from e
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise InputError(f"input {a} cannot be read ({e.strerror or e}); check the file") from e
    kind, gz = _kind_of(p)
    return InputFile(arg=a, path=p.resolve(), kind=kind, gzip=gz)


def _spool_stdin(stdin) -> InputFile:
    """``-``: standard input spooled. Python has no ``sys.stdin`` where the process started with
    descriptor 0 closed (``<&-``); that, or a read that fails, is InputError (one line)."""
    src = stdin if stdin is not None else sys.stdin
    if src is None:
        raise InputError("input - is standard input, but it is closed; pipe the text in, or give a file")
    try:
        return _spool(getattr(src, "buffer", None) or src, "-", "stdin", False)
    except OSError as e:
        raise InputError(f"input - (standard input) cannot be read ({e.strerror or e}); give a file") from e


#: the most bytes one line of a spooled stream (stdin, a pipe) may hold. A document is read from its
#: first max_length x batching.MAX_CHARS_PER_TOKEN characters at most: 64M characters for a model of
#: 65,536 tokens, at most 256 MiB of UTF-8; a longer line is no text geomscope can read more of,
#: and a stream that never ends its line (``- < /dev/zero``) is refused once it passes this, not
#: copied until the temporary folder is full.
MAX_STREAM_LINE_BYTES = 4 * 1024 * 65536


def _spool(src, arg: str, kind: str, gz: bool) -> InputFile:
    """A stream (binary, or text encoded as UTF-8) copied to a temporary file to its end, every line
    within :data:`MAX_STREAM_LINE_BYTES` (InputError, the copy removed, once one is not)."""
    fd, name = tempfile.mkstemp(prefix="geomscope-stdin-" if arg == "-" else "geomscope-pipe-", suffix=".txt")
    try:
        with os.fdopen(fd, "wb") as f:
            _copy_lines(src, f, arg)
    except BaseException as e:
        Path(name).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise InputError(
                f"{arg} did not fit in the temporary folder {Path(name).parent} ({e.strerror}); it is "
                "copied there to be read twice: set TMPDIR to a folder with room, or give the text as a file"
            ) from None
        raise
    return InputFile(arg=arg, path=Path(name), kind=kind, gzip=gz, spooled=True)


def _copy_lines(src, dest, arg: str) -> None:
    """``src`` copied into ``dest`` to its end, reads of at most :data:`MAX_STREAM_LINE_BYTES` (so a
    line a read holds whole is within it); InputError once the line being read passes it."""
    bound = MAX_STREAM_LINE_BYTES
    open_line = 0  # bytes of the line not yet ended
    while chunk := src.read(min(1 << 20, bound)):
        chunk = chunk.encode("utf-8") if isinstance(chunk, str) else chunk
        last = chunk.rfind(b"\n")
        first = chunk.find(b"\n")
        inner = chunk[first + 1 : last] if len(chunk) > bound and last > first else b""  # (text reads)
        if open_line + (len(chunk) if first < 0 else first) > bound or _longest_line(inner) > bound:
            where = "input - (standard input)" if arg == "-" else f"input {arg}"
            raise InputError(
                f"{where} holds a line longer than {bound} bytes, more than any document is read of "
                "(a stream of NUL bytes, or text without line breaks?); give one document per line"
            )
        open_line = open_line + len(chunk) if last < 0 else len(chunk) - last - 1
        dest.write(chunk)


def _longest_line(data: bytes) -> int:
    return max((len(line) for line in data.split(b"\n")), default=0)


def check_out_outside_inputs(inputs: list[InputFile], out) -> None:
    """InputError (one line) where the run directory ``out`` would lie inside a dataset directory
    given as input: the dataset's identity hashes every file under it, the run's own included, so
    the run could never be resumed (its input would seem to change with every shard written)."""
    target = Path(out).expanduser().resolve()
    for inp in inputs:
        if inp.kind == "dataset" and (target == inp.path or inp.path in target.parents):
            raise InputError(f"--out {out} lies inside the input dataset {inp.arg}; write the run elsewhere")


def close_inputs(inputs: list[InputFile]) -> None:
    """Remove the temporary copies of stdin and pipes, if any."""
    for inp in inputs:
        if inp.spooled:
            try:
                inp.path.unlink()
            except OSError:
                pass


def hash_input(inp: InputFile) -> None:
    """Set ``inp.sha256`` and ``inp.bytes``: of the file's bytes, or of a dataset directory's files
    (:func:`geomscope.fileio.input_digest`)."""
    inp.sha256, inp.bytes = input_digest(inp.path, inp.arg, directory=inp.kind == "dataset")


def _open_text(inp: InputFile):
    raw = gzip.open(inp.path, "rb") if inp.gzip else open(inp.path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="strict", newline="")


def _lines(inp: InputFile) -> Iterator[tuple[int, str]]:
    """``(line number, text)``; lines end at ``\\n`` (a ``\\r`` before it is dropped), decoded one by one so
    that an undecodable byte is reported on its own line."""
    lineno = 0
    try:
        with gzip.open(inp.path, "rb") if inp.gzip else open(inp.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.endswith(b"\n"):
                    raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InputError(
                        f"input {inp.arg} is not UTF-8 text (undecodable byte on line {lineno}); "
                        "convert it to UTF-8 (e.g. iconv -t utf-8)"
                    ) from None
    except (OSError, EOFError) as e:  # gzip errors are OSError
        raise InputError(
            f"input {inp.arg} cannot be read near line {lineno + 1} ({e}); check the file"
        ) from e


def _field(obj, field: str):
    cur = obj
    for part in field.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return KeyError
        cur = cur[part]
    return cur


def _jsonl_records(inp: InputFile, field: str) -> Iterator[str]:
    for lineno, line in _lines(inp):
        if not line.strip():
            continue
        try:
            obj = loads_json(line)
        except ValueError as e:  # bad JSON, a huge integer, nesting too deep
            hint = (
                " (a JSON array, not JSON lines: write one object per line)"
                if line.lstrip().startswith("[")
                else ""
            )
            why = getattr(e, "msg", None) or e
            raise InputError(
                f"input {inp.arg} line {lineno} is not valid JSON ({why}){hint}; "
                "give one JSON object per line"
            ) from None
        if not isinstance(obj, dict):
            what = "a JSON array, not JSON lines" if isinstance(obj, list) else f"a JSON {type(obj).__name__}"
            raise InputError(f"input {inp.arg} line {lineno} is {what}; give one JSON object per line")
        val = _field(obj, field)
        if val is KeyError:
            keys = ", ".join(list(obj)[:8]) or "none"
            raise InputError(
                f"input {inp.arg} line {lineno} has no field {field!r} (it has: {keys}); "
                "choose the text with --text-field"
            )
        yield _as_text(val, f"input {inp.arg} line {lineno}: field {field!r}")


def _csv_records(inp: InputFile, column: str) -> Iterator[str]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    delim = "," if inp.kind == "csv" else "\t"
    try:
        with _open_text(inp) as f:
            reader = csv.reader(f, delimiter=delim)
            header = next(reader, None)
            if header is None:
                return
            header = [h.strip() for h in header]
            if column not in header:
                raise InputError(
                    f"input {inp.arg} has no column {column!r} (columns: {', '.join(header[:12])}); "
                    "choose the text with --text-field"
                )
            idx = header.index(column)
            for row in reader:
                yield row[idx] if idx < len(row) else ""
    except UnicodeDecodeError as e:
        raise InputError(
            f"input {inp.arg} is not UTF-8 text; convert it to UTF-8 (e.g. iconv -t utf-8)"
        ) from e
    except csv.Error as e:
        raise InputError(f"input {inp.arg} is not valid {inp.kind.upper()} ({e}); check the file") from e
    except (OSError, EOFError) as e:  # a damaged or truncated .gz (gzip's errors are OSError)
        raise InputError(f"input {inp.arg} cannot be read ({e}); check the file") from e


def _as_text(val, where: str) -> str:
    """A record's text: None is an empty document; anything else that is not a string is refused."""
    if val is None:
        return ""
    if not isinstance(val, str):
        raise InputError(f"{where} holds a {type(val).__name__}, not text; choose the text with --text-field")
    return val


def _dataset_records(inp: InputFile, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise InputError(
            f"input {inp.arg} is a saved dataset; install the datasets package "
            "(pip install datasets) to read it"
        ) from None
    try:
        ds = datasets.load_from_disk(str(inp.path))
    except Exception as e:
        raise InputError(
            f"input {inp.arg} cannot be loaded as a saved dataset ({type(e).__name__}: "
            f"{first_line_of(str(e), limit=200)}); check the directory"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        raise InputError(
            f"input {inp.arg} holds several splits ({', '.join(splits)}); give one split's "
            f"directory, e.g. {Path(inp.arg) / splits[0]}"
        )
    if field not in ds.column_names:
        raise InputError(
            f"input {inp.arg} has no column {field!r} (columns: {', '.join(ds.column_names[:12])}); "
            "choose the text with --text-field"
        )
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for val in batch[field]:
            yield _as_text(val, f"input {inp.arg}: column {field!r}")


def iter_records(inp: InputFile, *, text_field: str = "text", text_column: str = "text") -> Iterator[str]:
    """The texts of one input's records, in order (empty ones included)."""
    if inp.kind in ("text", "stdin"):
        for _, line in _lines(inp):
            yield line
    elif inp.kind == "jsonl":
        yield from _jsonl_records(inp, text_field)
    elif inp.kind in ("csv", "tsv"):
        yield from _csv_records(inp, text_column)
    else:
        yield from _dataset_records(inp, text_field)


def iter_all(
    inputs: list[InputFile], *, text_field: str = "text", text_column: str = "text"
) -> Iterator[tuple[int, str]]:
    """``(doc_id, text)`` over every record of every input in order; ``doc_id`` counts from 0 across inputs.

    Sets each input's ``first_doc_id`` and ``records`` as it goes.
    """
    doc_id = 0
    for inp in inputs:
        inp.first_doc_id = doc_id
        inp.records = 0
        for text in iter_records(inp, text_field=text_field, text_column=text_column):
            inp.records += 1
            yield doc_id, text
            doc_id += 1


def uses_field(inputs: list[InputFile]) -> bool:
    return any(i.kind in ("jsonl", "dataset") for i in inputs)


def uses_column(inputs: list[InputFile]) -> bool:
    return any(i.kind in ("csv", "tsv") for i in inputs)


def _jsonl_labels(inp: InputFile, field: str) -> Iterator[object]:
    for lineno, line in _lines(inp):
        if not line.strip():
            continue
        val = _field(loads_json(line), field)  # the text pass has already validated every line
        if val is KeyError:
            raise InputError(
                f"input {inp.arg} line {lineno} has no label field {field!r}; give every record a "
                "label, or choose it with --label-field"
            )
        yield val


def _csv_labels(inp: InputFile, column: str) -> Iterator[object]:
    delim = "," if inp.kind == "csv" else "\t"
    try:
        with _open_text(inp) as f:
            reader = csv.reader(f, delimiter=delim)
            header = [h.strip() for h in (next(reader, None) or [])]
            if header and column not in header:
                raise InputError(
                    f"input {inp.arg} has no label column {column!r} (columns: {', '.join(header[:12])}); "
                    "choose it with --label-field"
                )
            idx = header.index(column) if header else 0
            for row in reader:
                yield row[idx] if idx < len(row) else None
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"input {inp.arg} cannot be read as {inp.kind.upper()} ({e}); check the file") from e


def _dataset_labels(inp: InputFile, field: str) -> Iterator[object]:
    import datasets

    ds = datasets.load_from_disk(str(inp.path))
    if field not in ds.column_names:
        raise InputError(
            f"input {inp.arg} has no label column {field!r} (columns: {', '.join(ds.column_names[:12])}); "
            "choose it with --label-field"
        )
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        yield from batch[field]


def iter_labels(inputs: list[InputFile], label_field: str) -> Iterator[object]:
    """Each record's raw label, in the order of :func:`iter_all` (a sequence classifier's loss needs
    one per document). Plain text has no fields, so it cannot carry labels."""
    for inp in inputs:
        if inp.kind in ("text", "stdin"):
            raise InputError(
                f"input {inp.arg} is plain text, which has no labels; give .jsonl, .csv/.tsv or a saved "
                f"dataset with a {label_field!r} field for the classification loss"
            )
        if inp.kind == "jsonl":
            yield from _jsonl_labels(inp, label_field)
        elif inp.kind in ("csv", "tsv"):
            yield from _csv_labels(inp, label_field)
        else:
            yield from _dataset_labels(inp, label_field)
