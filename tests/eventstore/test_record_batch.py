"""Record batch encoding: layout constants, round trips, checksums, codecs."""

from __future__ import annotations

import pyarrow as pa
import pytest

from eventstore.record_batch import (
    CRC_START,
    HEADER_SIZE,
    Codec,
    build_records,
    crc_matches,
    decode_records,
    encode_batch,
    header_problem,
    set_base_offset,
    timestamp_deltas_for,
    unpack_header,
)


def _batch(n: int = 5, codec: Codec = Codec.NONE, headers: bool = False) -> bytearray:
    keys = [f"k{i}".encode() if i % 3 else None for i in range(n)]
    values = [None if i == 2 else b"v" * i for i in range(n)]
    hdrs = [[("h", b"x"), ("n", None)] if i % 2 else None for i in range(n)] if headers else None
    first, max_ts, deltas = timestamp_deltas_for([1000 + (i * 7) % 5 for i in range(n)])
    records = build_records(keys, values, deltas, hdrs)
    return encode_batch(records, first_timestamp=first, max_timestamp=max_ts, codec=codec)


def test_header_is_72_bytes_and_crc_covers_everything_after_it() -> None:
    assert HEADER_SIZE == 72
    buf = _batch()
    header = unpack_header(buf)
    assert header.size == len(buf)
    assert crc_matches(buf, 0, header)
    for pos in range(CRC_START, len(buf), 7):
        bad = bytearray(buf)
        bad[pos] ^= 0x01
        assert not crc_matches(bad, 0, unpack_header(bad)), pos


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("headers", [False, True])
def test_round_trip(codec: Codec, headers: bool) -> None:
    buf = _batch(50, codec, headers)
    set_base_offset(buf, 1234)
    header = unpack_header(buf)
    assert header.base_offset == 1234 and header.codec is codec and header.has_headers is headers
    assert header_problem(buf, 0, header) is None
    records = decode_records(pa.py_buffer(bytes(buf)), 0, header)
    assert records.column("value").to_pylist()[:3] == [b"", b"v", None]
    assert records.column("key").to_pylist()[:3] == [None, b"k1", b"k2"]
    assert records.column("offset_delta").to_pylist() == list(range(50))
    assert header.record_count == 50 and header.last_offset_delta == 49
    stamps = [header.first_timestamp + d for d in records.column("timestamp_delta").to_pylist()]
    assert stamps == [1000 + (i * 7) % 5 for i in range(50)]
    assert header.max_timestamp == 1004
    if headers:
        assert records.column("headers").to_pylist()[1] == [{"key": "h", "value": b"x"}, {"key": "n", "value": None}]


def test_header_checksum_guards_base_offset_and_length() -> None:
    buf = _batch()
    set_base_offset(buf, 99)
    for pos in range(12):
        bad = bytearray(buf)
        bad[pos] ^= 0x10
        assert header_problem(bad, 0, unpack_header(bad)) is not None


def test_unknown_codec_name_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="unknown compression codec 'snappy'"):
        Codec.parse("snappy")
