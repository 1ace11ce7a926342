"""Confluent framing: round trips one by one and in batches, schema resolution, and every error case."""

from __future__ import annotations

import struct
from decimal import Decimal

import pytest

from schemas.errors import UnknownSchemaError, WireFormatError
from schemas.registry import MemorySchemaStore, SchemaRegistry
from schemas.wire import HEADER_SIZE, AvroWire, frame, parse_header

ORDER = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "long"}, {"name": "note", "type": ["null", "string"], "default": None},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
]}  # fmt: skip
OTHER = {"type": "record", "name": "Other", "fields": [{"name": "x", "type": "int"}]}


@pytest.fixture
def registry() -> SchemaRegistry:
    registry = SchemaRegistry(MemorySchemaStore())
    registry.register("orders-value", ORDER)
    registry.register("other-value", OTHER)
    return registry


def test_frame_layout(registry: SchemaRegistry) -> None:
    value = AvroWire(registry.schema_by_id).encode(2, {"x": 3})
    assert value[:HEADER_SIZE] == b"\x00" + struct.pack(">I", 2)
    assert value[HEADER_SIZE:] == b"\x06"  # zigzag varint of 3
    assert parse_header(value) == 2 and frame(2, b"\x06") == value


def test_round_trip_single_and_batch(registry: SchemaRegistry) -> None:
    wire = AvroWire(registry.schema_by_id)
    datums = [{"id": n, "note": None if n % 2 else f"n{n}", "amount": Decimal(n) / 100} for n in range(1000)]
    values = wire.encode_many(1, datums)
    assert wire.decode_many(values) == datums
    assert wire.decode(wire.encode(1, datums[5])) == datums[5]
    mixed = [values[0], wire.encode(2, {"x": 1}), values[1]]
    assert wire.decode_many(mixed) == [datums[0], {"x": 1}, datums[1]]


def test_batch_looks_up_each_schema_once(registry: SchemaRegistry) -> None:
    lookups: list[int] = []

    def schema_of(schema_id: int) -> str:
        lookups.append(schema_id)
        return registry.schema_by_id(schema_id)

    wire = AvroWire(schema_of)
    values = wire.encode_many(1, [{"id": n, "note": None, "amount": Decimal("1.00")} for n in range(500)])
    values += wire.encode_many(2, [{"x": n} for n in range(500)])
    assert len(wire.decode_many(values)) == 1000
    assert lookups == [1, 2]


def test_underlying_values_without_logical_types(registry: SchemaRegistry) -> None:
    plain = AvroWire(registry.schema_by_id, logical_types=False)
    value = AvroWire(registry.schema_by_id).encode(1, {"id": 1, "note": None, "amount": Decimal("12.30")})
    assert plain.decode(value)["amount"] == (1230).to_bytes(2, "big", signed=True)


def test_reader_schema_resolution(registry: SchemaRegistry) -> None:
    wire = AvroWire(registry.schema_by_id)
    value = wire.encode(2, {"x": 7})
    reader = '{"type": "record", "name": "Other", "fields": [{"name": "x", "type": "long"}, ' \
             '{"name": "y", "type": "string", "default": "d"}]}'  # fmt: skip
    assert wire.decode(value, reader_schema=reader) == {"x": 7, "y": "d"}


@pytest.mark.parametrize(
    ("mangle", "error", "message"),
    [
        (lambda v: b"\x01" + v[1:], WireFormatError, "unknown magic byte 1"),
        (lambda v: v[:3], WireFormatError, "truncated value: 3 bytes"),
        (lambda v: v[:-2], WireFormatError, "truncated Avro payload for schema id 1"),
        (lambda v: v + b"\x00", WireFormatError, "1 bytes left after the datum of schema id 1"),
        (lambda v: v[:1] + struct.pack(">I", 99) + v[5:], UnknownSchemaError, "schema id 99 not found"),
    ],
)
def test_decode_errors_name_the_problem(registry: SchemaRegistry, mangle, error, message) -> None:  # type: ignore[no-untyped-def]
    wire = AvroWire(registry.schema_by_id)
    value = wire.encode(1, {"id": 1, "note": "hello", "amount": Decimal("1.50")})
    with pytest.raises(error, match=message):
        wire.decode_many([value, mangle(value)])


def test_encode_error_names_the_datum(registry: SchemaRegistry) -> None:
    wire = AvroWire(registry.schema_by_id)
    with pytest.raises(WireFormatError, match="datum 1 does not fit schema id 2"):
        wire.encode_many(2, [{"x": 1}, {"x": "not an int"}])
