"""What a compressed Arrow IPC record batch or Parquet page decodes to, read from its own header
before anything is decompressed (formats.py holds each against ``--memory-mb``).

- Arrow IPC (the columnar format's ``Message.fbs``): every message's metadata is a flatbuffer
  ``Message`` whose header is a ``RecordBatch`` (or a ``DictionaryBatch`` holding one): its row
  count, its field nodes and its buffers' (offset, length) in the message body. In a compressed
  body (``BodyCompression``: LZ4 frame or ZSTD) each buffer starts with its decompressed length as
  a little-endian int64 (-1: stored as is). :func:`ipc_messages` walks a stream's messages without
  decoding one and gives each batch's rows and the bytes its decoded buffers hold.
- Parquet (``parquet.thrift``): a column chunk is a run of pages, each a Thrift compact-encoded
  ``PageHeader`` (field 2: ``uncompressed_page_size``, field 3: ``compressed_page_size``) and then
  its compressed bytes. :func:`parquet_pages` walks a chunk's page headers from the range its
  metadata gives, as the reader will.

Both parse what a file claims: every offset is checked against the bytes there, nesting is
bounded, and anything no writer makes is a :class:`HeaderError` (a ValueError).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass


class HeaderError(ValueError):
    """A header that no writer makes (an offset outside its bytes, a negative size ...)."""


# ------------------------------------------------------------------------------------ flatbuffers
class _Table:
    """A flatbuffer table at ``pos`` of ``buf``: its fields by index, each offset bounds-checked."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vtable = pos - _unpack(buf, "<i", pos)
        self.vtable_len = _unpack(buf, "<H", self.vtable)

    def _field(self, index: int) -> int:
        at = 4 + 2 * index
        return _unpack(self.buf, "<H", self.vtable + at) if at + 2 <= self.vtable_len else 0

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        at = self._field(index)
        return default if not at else _unpack(self.buf, fmt, self.pos + at)

    def table(self, index: int) -> _Table | None:
        at = self._field(index)
        if not at:
            return None
        ref = self.pos + at
        return _Table(self.buf, ref + _unpack(self.buf, "<I", ref))

    def structs(self, index: int, fmt: str) -> list[tuple]:
        """A vector of structs of ``fmt``."""
        at = self._field(index)
        if not at:
            return []
        ref = self.pos + at
        vec = ref + _unpack(self.buf, "<I", ref)
        n, size = _unpack(self.buf, "<I", vec), struct.calcsize(fmt)
        if vec + 4 + n * size > len(self.buf):
            raise HeaderError("a vector runs past the end of its metadata")
        return [struct.unpack_from(fmt, self.buf, vec + 4 + k * size) for k in range(n)]


def _unpack(buf: bytes, fmt: str, pos: int) -> int:
    if pos < 0 or pos + struct.calcsize(fmt) > len(buf):
        raise HeaderError("an offset points outside its metadata")
    return struct.unpack_from(fmt, buf, pos)[0]


_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # MessageHeader union tags


@dataclass(frozen=True)
class IpcBatch:
    """One record batch (``dictionary``: a dictionary batch) of an IPC stream, from its header."""

    rows: int
    decoded_bytes: int  # what its buffers hold once decompressed
    compressed: bool
    dictionary: bool = False


def ipc_batch(metadata: bytes, body) -> IpcBatch | None:
    """The batch a message's flatbuffer ``metadata`` and ``body`` (a pyarrow Buffer) declare; None
    for a message that holds none (the schema)."""
    message = _Table(metadata, _unpack(metadata, "<I", 0))
    kind = message.scalar(1, "<B")
    header = message.table(2)
    if kind not in (_RECORD_BATCH, _DICTIONARY_BATCH) or header is None:
        return None
    batch = header if kind == _RECORD_BATCH else header.table(1)
    if batch is None:
        raise HeaderError("a dictionary batch without its data")
    rows = batch.scalar(0, "<q")
    buffers = batch.structs(2, "<qq")
    compressed = batch.table(3) is not None
    total = 0
    for offset, length in buffers:
        if offset < 0 or length < 0 or offset + length > body.size:
            raise HeaderError("a buffer lies outside its message body")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise HeaderError("a compressed buffer without its length")
        declared = struct.unpack("<q", body[offset : offset + 8].to_pybytes())[0]
        if declared < -1:
            raise HeaderError(f"a compressed buffer declares {declared} bytes")
        total += length - 8 if declared == -1 else declared
    if rows < 0:
        raise HeaderError(f"a batch declares {rows} rows")
    return IpcBatch(rows, total, compressed, dictionary=kind == _DICTIONARY_BATCH)


def ipc_messages(source) -> Iterator[IpcBatch]:
    """The batches of the IPC stream read from ``source`` (a pyarrow file positioned at the
    stream's start), in order, each from its header alone (bodies of a memory-mapped file are not
    read: only each compressed buffer's 8-byte length)."""
    import pyarrow as pa

    reader = pa.ipc.MessageReader.open_stream(source)
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            return
        if message is None:
            return
        batch = ipc_batch(message.metadata.to_pybytes(), message.body or pa.py_buffer(b""))
        if batch is not None:
            yield batch


# ---------------------------------------------------------------------------------- Thrift compact
#: the deepest nesting of structs, lists and maps in a page header (a DataPageHeader's Statistics:
#: 3); a crafted one could otherwise recurse without end
_MAX_THRIFT_DEPTH = 32
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class _Compact:
    """A reader of Thrift's compact protocol over ``data`` (what it needs of a struct: its i32 fields
    by id; the rest skipped)."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise _Short
        self.at += 1
        return self.data[self.at - 1]

    def varint(self) -> int:
        out, shift = 0, 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 70:
                raise HeaderError("a page header holds a number longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip_bytes(self, n: int) -> None:
        if n < 0:
            raise HeaderError("a page header holds a negative length")
        if self.at + n > len(self.data):
            raise _Short
        self.at += n

    def skip(self, kind: int, depth: int, in_collection: bool = False) -> None:
        if depth > _MAX_THRIFT_DEPTH:
            raise HeaderError(f"a page header nested deeper than {_MAX_THRIFT_DEPTH}")
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            if in_collection:  # (a field's bool is in its type; an element's is a byte)
                self.byte()
        elif kind == _BYTE:
            self.byte()
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.skip_bytes(8)
        elif kind == _BINARY:
            self.skip_bytes(self.varint())
        elif kind in (_LIST, _SET):
            head = self.byte()
            n = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(n):
                self.skip(head & 0x0F, depth + 1, True)
        elif kind == _MAP:
            n = self.varint()
            kinds = self.byte() if n else 0
            for _ in range(n):
                self.skip(kinds >> 4, depth + 1, True)
                self.skip(kinds & 0x0F, depth + 1, True)
        elif kind == _STRUCT:
            self.struct(depth + 1)
        else:
            raise HeaderError(f"a page header holds a field of unknown type {kind}")

    def struct(self, depth: int = 0, wanted: tuple[int, ...] = ()) -> dict[int, int]:
        """The i32 fields ``wanted`` of the struct here (by field id); the others skipped."""
        if depth > _MAX_THRIFT_DEPTH:
            raise HeaderError(f"a page header nested deeper than {_MAX_THRIFT_DEPTH}")
        got, field = {}, 0
        while True:
            head = self.byte()
            if head == 0:
                return got
            kind, delta = head & 0x0F, head >> 4
            field = field + delta if delta else self.zigzag()
            if field in wanted and kind == _I32:
                got[field] = self.zigzag()
            else:
                self.skip(kind, depth)


class _Short(Exception):
    """The bytes read so far end inside the header: read more."""


@dataclass(frozen=True)
class ParquetPage:
    """One page of a column chunk, from its header."""

    header: int  # bytes of its header
    uncompressed: int
    compressed: int


#: the largest page header read (Parquet's C++ reader stops there too)
MAX_PAGE_HEADER_BYTES = 16 << 20


def parquet_pages(f, start: int, length: int) -> Iterator[ParquetPage]:
    """The pages of the column chunk at bytes [start, start + length) of the open binary file ``f``
    (the range its metadata gives: from its dictionary page, where it has one, else its first data
    page), from their headers, in order."""
    pos, end = start, start + length
    while pos < end:
        header, used = _page_header(f, pos)
        uncompressed, compressed = header.get(2), header.get(3)
        if uncompressed is None or compressed is None or uncompressed < 0 or compressed < 0:
            raise HeaderError(f"a page header at byte {pos} declares no sizes, or negative ones")
        yield ParquetPage(used, uncompressed, compressed)
        pos += used + compressed
    if pos != end:
        raise HeaderError("its pages run past the end of their column chunk")


def _page_header(f, pos: int) -> tuple[dict[int, int], int]:
    """(sizes by field id, bytes the header takes) of the page header at ``pos``; the bytes read
    grow from 4 KiB while the header runs on, up to :data:`MAX_PAGE_HEADER_BYTES`."""
    size = 4096
    while True:
        f.seek(pos)
        data = f.read(size)
        reader = _Compact(data)
        try:
            return reader.struct(wanted=(2, 3)), reader.at
        except _Short:
            if len(data) < size:
                raise HeaderError(f"a page header at byte {pos} runs past the end of the file") from None
            if size >= MAX_PAGE_HEADER_BYTES:
                raise HeaderError(f"a page header at byte {pos} is larger than 16 MiB") from None
            size *= 4
