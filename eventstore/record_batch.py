"""Record batches: the unit of append, fsync, checksum, compression and read.

Byte layout (little-endian, 72-byte header, then the payload)::

    pos  size  field              meaning
      0     8  base_offset        int64   offset of the first record; filled in under the partition lock
      8     4  batch_length       int32   bytes after this field (whole batch = 12 + batch_length)
     12     4  header_crc         uint32  CRC32C of bytes [0, 12): guards the two fields above, which
                                          the main checksum cannot cover (see "Why two checksums")
     16     4  crc                uint32  CRC32C of bytes [20, end of batch): everything after it
     20     1  magic              int8    format version, = 1
     21     1  attributes         uint8   bits 0-2 codec (0 none, 1 gzip, 3 lz4, 4 zstd: Kafka's numbers),
                                          bit 3 has_headers, bit 4 transactional, bit 5 control,
                                          bit 6 delete_horizon set (by compaction)
     22     2  reserved           uint16  0
     24     4  last_offset_delta  int32   last record's offset - base_offset (>= record_count - 1:
                                          compaction leaves gaps but keeps the batch's offset span)
     28     4  record_count       int32
     32     8  first_timestamp    int64   ms since the epoch; record timestamp = first_timestamp + delta
     40     8  max_timestamp      int64   ms, the largest record timestamp in the batch
     48     8  producer_id        int64   -1 when the producer is not idempotent
     56     2  producer_epoch     int16   -1 likewise
     58     2  reserved           int16   0
     60     4  base_sequence      int32   -1 likewise; sequence of the first record
     64     8  delete_horizon_ms  int64   -1; set by compaction on batches holding tombstones: after
                                          this time a later cleaning pass may drop them
     72     …  payload            codec(one Arrow IPC record-batch message, without the schema)

Codecs: gzip is zlib's stream (level 6); lz4 the LZ4 frame format with independent 64 KiB blocks
(as Kafka's producers write it: librdkafka's and Java's — blocks that may refer back to earlier
ones compress a batch of capture envelopes 1.5 % smaller and 30 % slower); zstd a zstd frame
(level 3). Decompression reads any valid frame of the codec.

Payload: an Arrow IPC *record batch message* of one of two fixed schemas
(:data:`RECORD_SCHEMA`, or :data:`RECORD_SCHEMA_WITH_HEADERS` when bit 3 is set)::

    offset_delta     int32  not null   record offset - base_offset
    timestamp_delta  int64  not null   record timestamp - first_timestamp
    key              binary nullable
    value            binary nullable   null = tombstone
    headers          list<struct<key: string, value: binary>>   (only with has_headers)

Columns mean that encode and decode never loop over records in Python: the whole batch
is built from (or turned into) Arrow arrays, and readers get the Arrow batch zero-copy
when the codec is ``none``.

Why two checksums: ``crc`` covers everything after itself, as in Kafka. The base offset
and the length are outside it (the offset is assigned when the batch is appended), so a
flipped bit in the length could make a batch in the middle of a segment look like a
torn write at the end of it. ``header_crc`` makes the length trustworthy: recovery only
ever truncates when the header is intact and the batch runs past the end of the file,
or when the bytes from the bad header to the end of the file are all zero.
"""

from __future__ import annotations

import enum
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import crc32c
import lz4.frame
import numpy as np
import pyarrow as pa
import zstandard

from eventstore.errors import ConfigError

MAGIC = 1
HEADER = struct.Struct("<qiIIbBHiiqqqhhiq")
HEADER_SIZE = HEADER.size  # 72
LENGTH_PREFIX = 12  # base_offset + batch_length: batch_length counts the bytes after these
HEADER_CRC_OFFSET = 12
CRC_OFFSET = 16
CRC_START = 20  # the main checksum covers [CRC_START, end)
MAX_BATCH_BYTES = 1 << 30

CODEC_MASK = 0x07
HAS_HEADERS = 0x08
TRANSACTIONAL = 0x10
CONTROL = 0x20
DELETE_HORIZON = 0x40

NO_PRODUCER_ID = -1
NO_TIMESTAMP = -1

assert HEADER_SIZE == 72

# An encoded batch, as appended: a writable view of memory from Arrow's pool (mimalloc by default). Not a
# bytearray: a batch of a MiB or more from Python's allocator (glibc malloc) was mapped fresh and zeroed by
# the kernel page by page on each append (glibc hands such blocks back to the system when they are freed),
# which made encoding a 1 MiB batch cost about 1 ms, ten times its serialization and checksum.
EncodedBatch = memoryview


class Codec(enum.IntEnum):
    """Compression of a batch payload; numbers are Kafka's."""

    NONE = 0
    GZIP = 1
    LZ4 = 3
    ZSTD = 4

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.strip().upper()]
        except KeyError:
            choices = ", ".join(c.name.lower() for c in cls)
            raise ConfigError(f"unknown compression codec {name!r} (choose {choices})") from None


HEADERS_TYPE = pa.list_(pa.struct([pa.field("key", pa.string(), nullable=False), pa.field("value", pa.binary())]))
RECORD_SCHEMA = pa.schema(
    [
        pa.field("offset_delta", pa.int32(), nullable=False),
        pa.field("timestamp_delta", pa.int64(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
    ]
)
RECORD_SCHEMA_WITH_HEADERS = RECORD_SCHEMA.append(pa.field("headers", HEADERS_TYPE))



def _numbers(values: np.ndarray[Any, Any], type_: pa.DataType) -> pa.Array:
    """A numpy array as an Arrow array (``pa.array`` would import pandas, 0.2 s, in processes that never use it)."""
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


# Slices of these are zero-copy: dense offset deltas and equal timestamps are the common case.
_DENSE_CHUNK = 1 << 16
_dense_deltas = _numbers(np.arange(_DENSE_CHUNK, dtype="<i4"), pa.int32())
_zero_deltas = _numbers(np.zeros(_DENSE_CHUNK, dtype="<i8"), pa.int64())


def dense_offset_deltas(n: int) -> pa.Array:
    """``0, 1, …, n-1`` as int32, without a Python loop."""
    global _dense_deltas
    if n > len(_dense_deltas):
        _dense_deltas = _numbers(np.arange(max(n, 2 * len(_dense_deltas)), dtype="<i4"), pa.int32())
    return _dense_deltas.slice(0, n)


def zero_timestamp_deltas(n: int) -> pa.Array:
    global _zero_deltas
    if n > len(_zero_deltas):
        _zero_deltas = _numbers(np.zeros(max(n, 2 * len(_zero_deltas)), dtype="<i8"), pa.int64())
    return _zero_deltas.slice(0, n)


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The fixed header of one stored batch (see the module docstring for each field)."""

    base_offset: int
    batch_length: int
    header_crc: int
    crc: int
    magic: int
    attributes: int
    last_offset_delta: int
    record_count: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    delete_horizon_ms: int

    @property
    def size(self) -> int:
        """Bytes the whole batch occupies in the segment."""
        return LENGTH_PREFIX + self.batch_length

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def codec(self) -> Codec:
        return Codec(self.attributes & CODEC_MASK)

    @property
    def has_headers(self) -> bool:
        return bool(self.attributes & HAS_HEADERS)

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & CONTROL)


def unpack_header(buf: Any, pos: int = 0) -> BatchHeader:
    """Parse the header at ``buf[pos:pos+72]`` (caller checked there are 72 bytes)."""
    (
        base_offset,
        batch_length,
        header_crc,
        crc,
        magic,
        attributes,
        _reserved,
        last_offset_delta,
        record_count,
        first_timestamp,
        max_timestamp,
        producer_id,
        producer_epoch,
        _reserved2,
        base_sequence,
        delete_horizon_ms,
    ) = HEADER.unpack_from(buf, pos)
    return BatchHeader(
        base_offset,
        batch_length,
        header_crc,
        crc,
        magic,
        attributes,
        last_offset_delta,
        record_count,
        first_timestamp,
        max_timestamp,
        producer_id,
        producer_epoch,
        base_sequence,
        delete_horizon_ms,
    )


def header_problem(buf: Any, pos: int, header: BatchHeader) -> str | None:
    """Why the header at ``pos`` cannot be trusted, or None when it is sound."""
    view = memoryview(buf)[pos : pos + LENGTH_PREFIX]
    if crc32c.crc32c(view) != header.header_crc:
        return "header checksum mismatch"
    if header.magic != MAGIC:
        return f"unknown batch format version {header.magic}"
    if not HEADER_SIZE - LENGTH_PREFIX <= header.batch_length <= MAX_BATCH_BYTES:
        return f"implausible batch length {header.batch_length}"
    if header.record_count < 0 or header.last_offset_delta < header.record_count - 1:
        return f"record count {header.record_count} exceeds offset span"
    return None


def crc_matches(buf: Any, pos: int, header: BatchHeader) -> bool:
    """Whether the main checksum over ``[pos+20, pos+size)`` matches."""
    view = memoryview(buf)[pos + CRC_START : pos + header.size]
    return bool(crc32c.crc32c(view) == header.crc)


def set_base_offset(buf: EncodedBatch | bytearray, base_offset: int) -> None:
    """Write the base offset and the header checksum of an encoded batch (under the lock)."""
    struct.pack_into("<q", buf, 0, base_offset)
    struct.pack_into("<I", buf, HEADER_CRC_OFFSET, crc32c.crc32c(memoryview(buf)[:LENGTH_PREFIX]))


_codec_state = threading.local()


def _compress(codec: Codec, data: Any) -> Any:
    if codec is Codec.NONE:
        return data
    raw = memoryview(data)
    if codec is Codec.ZSTD:
        comp = getattr(_codec_state, "zstd_c", None)
        if comp is None:
            comp = _codec_state.zstd_c = zstandard.ZstdCompressor(level=3)
        return comp.compress(raw)
    if codec is Codec.LZ4:
        return lz4.frame.compress(raw, block_linked=False)  # see "Codecs" above
    return zlib.compress(raw, 6)


def _decompress(codec: Codec, data: Any) -> Any:
    if codec is Codec.NONE:
        return data
    raw = memoryview(data)
    if codec is Codec.ZSTD:
        dec = getattr(_codec_state, "zstd_d", None)
        if dec is None:
            dec = _codec_state.zstd_d = zstandard.ZstdDecompressor()
        return dec.decompress(raw)
    if codec is Codec.LZ4:
        return lz4.frame.decompress(raw)
    return zlib.decompress(raw)


def build_records(
    keys: Any,
    values: Any,
    timestamp_deltas: Any = None,
    headers: Any = None,
    offset_deltas: Any = None,
) -> pa.RecordBatch:
    """Assemble the record columns of a batch from Python lists or Arrow arrays.

    ``keys``/``values``: sequences of ``bytes | None`` or binary Arrow arrays.
    ``timestamp_deltas``: None (all equal to the first timestamp) or int64 deltas.
    ``headers``: None, or per record a list of ``(str, bytes | None)`` pairs (or None).
    ``offset_deltas``: None (dense ``0..n-1``) or explicit int32 deltas (compaction).
    """
    key_arr = keys if isinstance(keys, pa.Array) else pa.array(keys, pa.binary())
    value_arr = values if isinstance(values, pa.Array) else pa.array(values, pa.binary())
    if key_arr.type != pa.binary():
        key_arr = key_arr.cast(pa.binary())
    if value_arr.type != pa.binary():
        value_arr = value_arr.cast(pa.binary())
    n = len(value_arr)
    if len(key_arr) != n:
        raise ValueError(f"{len(key_arr)} keys for {n} values")
    if offset_deltas is None:
        od = dense_offset_deltas(n)
    else:
        od = offset_deltas if isinstance(offset_deltas, pa.Array) else pa.array(offset_deltas, pa.int32())
    if timestamp_deltas is None:
        td = zero_timestamp_deltas(n)
    else:
        td = timestamp_deltas if isinstance(timestamp_deltas, pa.Array) else pa.array(timestamp_deltas, pa.int64())
    columns = [od, td, key_arr, value_arr]
    if headers is None:
        return pa.RecordBatch.from_arrays(columns, schema=RECORD_SCHEMA)
    return pa.RecordBatch.from_arrays([*columns, headers_array(headers)], schema=RECORD_SCHEMA_WITH_HEADERS)


def headers_array(headers: Any) -> pa.Array:
    """Per-record headers (``None`` or a list of ``(str, bytes | None)``) as the batch's headers column."""
    if isinstance(headers, pa.Array):
        return headers
    return pa.array([None if h is None else [{"key": k, "value": v} for k, v in h] for h in headers], HEADERS_TYPE)


def encode_batch(
    records: pa.RecordBatch,
    *,
    first_timestamp: int,
    max_timestamp: int,
    codec: Codec = Codec.NONE,
    last_offset_delta: int | None = None,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    transactional: bool = False,
    control: bool = False,
    delete_horizon_ms: int = -1,
) -> EncodedBatch:
    """Serialize ``records`` into a complete batch with base offset 0 (see :func:`set_base_offset`)."""
    n = records.num_rows
    if last_offset_delta is None:
        last_offset_delta = n - 1
    has_headers = records.num_columns == len(RECORD_SCHEMA_WITH_HEADERS)
    payload = _compress(codec, records.serialize())
    attributes = int(codec)
    if has_headers:
        attributes |= HAS_HEADERS
    if transactional:
        attributes |= TRANSACTIONAL
    if control:
        attributes |= CONTROL
    if delete_horizon_ms >= 0:
        attributes |= DELETE_HORIZON
    size = HEADER_SIZE + len(payload)
    buf = memoryview(pa.allocate_buffer(size)).cast("B")  # see EncodedBatch
    HEADER.pack_into(
        buf,
        0,
        0,
        size - LENGTH_PREFIX,
        0,
        0,
        MAGIC,
        attributes,
        0,
        last_offset_delta,
        n,
        first_timestamp,
        max_timestamp,
        producer_id,
        producer_epoch,
        0,
        base_sequence,
        delete_horizon_ms,
    )
    buf[HEADER_SIZE:] = memoryview(payload).cast("B")
    struct.pack_into("<I", buf, CRC_OFFSET, crc32c.crc32c(buf[CRC_START:]))
    set_base_offset(buf, 0)
    return buf


def decode_records(buf: pa.Buffer, pos: int, header: BatchHeader) -> pa.RecordBatch:
    """The record columns of the batch at ``pos`` of ``buf`` (zero-copy for codec none)."""
    start = pos + HEADER_SIZE
    end = pos + header.size
    schema = RECORD_SCHEMA_WITH_HEADERS if header.has_headers else RECORD_SCHEMA
    codec = header.codec
    if codec is Codec.NONE:
        payload = buf.slice(start, end - start)
    else:
        payload = pa.py_buffer(_decompress(codec, buf.slice(start, end - start)))
    return pa.ipc.read_record_batch(payload, schema)


def timestamp_deltas_for(timestamps: Any) -> tuple[int, int, Any]:
    """``(first, max, deltas or None)`` for a list/array of record timestamps in ms."""
    import pyarrow.compute as pc  # here, not at import: the log's readers (`tideline log topics`) never need it

    arr = timestamps if isinstance(timestamps, pa.Array) else pa.array(timestamps, pa.int64())
    first = arr[0].as_py()
    mm = pc.min_max(arr)
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    if lo == hi:
        return first, hi, None
    return first, hi, pc.subtract(arr, pa.scalar(first, pa.int64()))
