"""Confluent's wire format: a framed Avro value names the schema it was written with.

Layout of one framed value (big-endian)::

    0  magic      uint8   = 0
    1  schema_id  uint32  global id in the schema registry
    5  payload    Avro binary encoding of the datum (no container, no schema)

:class:`AvroWire` encodes and decodes with fastavro's schemaless writer/reader, parsing
each schema once (cached by id). The batch paths :meth:`AvroWire.encode_many` and
:meth:`AvroWire.decode_many` look up each distinct schema id once per call, so a
100k-event batch costs one lookup per schema, not per event.

``logical_types=False`` decodes logical types as their underlying values (``date`` as
days, ``timestamp-micros`` as µs, ``decimal`` as unscaled big-endian bytes) — what
:mod:`schemas.pgvalues` converts to Tideline's JSON form, and cheaper than building
Python objects. With ``logical_types=True`` a value Python's ``datetime`` cannot hold
(±infinity, BC, years after 9999, ``24:00:00``) fails to decode with WireFormatError;
decode captured rows with ``logical_types=False``.

Errors (:class:`~schemas.errors.WireFormatError`, or UnknownSchemaError for an id the
registry lacks) name what is wrong: the magic byte found, the id, the byte count.

Thread-safety: thread-safe (the caches are dicts whose races are benign: two threads may
parse the same schema).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from io import BytesIO
from typing import Any

from fastavro import schemaless_reader, schemaless_writer

from schemas.canonical import parse, schema_json, strip_logical_types
from schemas.errors import WireFormatError

MAGIC_BYTE = 0
HEADER = struct.Struct(">BI")  # magic, schema id
HEADER_SIZE = HEADER.size  # 5


def frame(schema_id: int, payload: bytes) -> bytes:
    """The framed value of an already encoded Avro payload."""
    return HEADER.pack(MAGIC_BYTE, schema_id) + payload


def parse_header(value: bytes | bytearray | memoryview) -> int:
    """The schema id of a framed value; WireFormatError if the header is missing or foreign."""
    if len(value) < HEADER_SIZE:
        raise WireFormatError(f"truncated value: {len(value)} bytes, a framed Avro value has ≥ {HEADER_SIZE}")
    magic, schema_id = HEADER.unpack_from(value)
    if magic != MAGIC_BYTE:
        raise WireFormatError(f"unknown magic byte {magic} (expected {MAGIC_BYTE}): not a Confluent-framed Avro value")
    return int(schema_id)


class AvroWire:
    """Encode and decode framed values, schemas resolved through ``schema_of(id) -> schema text``.

    >>> wire = AvroWire(registry.schema_by_id)                         # doctest: +SKIP
    >>> wire.decode(wire.encode(1, {"id": 7}))
    {'id': 7}
    """

    def __init__(self, schema_of: Callable[[int], str], *, logical_types: bool = True) -> None:
        self.schema_of = schema_of
        self.logical_types = logical_types
        self._parsed: dict[int, Any] = {}
        self._resolved: dict[tuple[int, str], Any] = {}

    def parsed(self, schema_id: int) -> Any:
        """The parsed writer schema of ``schema_id`` (UnknownSchemaError if the registry lacks it)."""
        found = self._parsed.get(schema_id)
        if found is None:
            text = self.schema_of(schema_id)
            found = parse(text if self.logical_types else strip_logical_types(schema_json(text)))
            self._parsed[schema_id] = found
        return found

    def encode(self, schema_id: int, datum: Any) -> bytes:
        return self.encode_many(schema_id, [datum])[0]

    def encode_many(self, schema_id: int, datums: Iterable[Any]) -> list[bytes]:
        """Framed values of ``datums``, all written with schema ``schema_id``."""
        schema = self.parsed(schema_id)
        header = HEADER.pack(MAGIC_BYTE, schema_id)
        out: list[bytes] = []
        buffer = BytesIO()
        for index, datum in enumerate(datums):
            buffer.seek(0)
            buffer.truncate()
            buffer.write(header)
            try:
                schemaless_writer(buffer, schema, datum)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise WireFormatError(f"datum {index} does not fit schema id {schema_id}: {e}") from e
            out.append(buffer.getvalue())
        return out

    def decode(self, value: bytes, *, reader_schema: str | None = None) -> Any:
        return self.decode_many([value], reader_schema=reader_schema)[0]

    def decode_many(self, values: Sequence[bytes], *, reader_schema: str | None = None) -> list[Any]:
        """The datums of framed ``values`` (any mix of schema ids).

        ``reader_schema``: resolve every value into this schema (Avro schema resolution),
        e.g. the version a consumer was written against.
        """
        schemas: dict[int, Any] = {}
        out: list[Any] = []
        for index, value in enumerate(values):
            schema_id = parse_header(value)
            schema = schemas.get(schema_id)
            if schema is None:
                schema = schemas[schema_id] = self.parsed(schema_id)
            reader = self._reader(schema_id, reader_schema) if reader_schema is not None else None
            stream = BytesIO(value)
            stream.seek(HEADER_SIZE)
            try:
                datum = schemaless_reader(stream, schema, reader)
            except (EOFError, StopIteration, IndexError, struct.error) as e:
                raise WireFormatError(
                    f"value {index}: truncated Avro payload for schema id {schema_id} ({len(value)} bytes)"
                ) from e
            except (ValueError, TypeError, KeyError, UnicodeDecodeError, OverflowError) as e:
                raise WireFormatError(f"value {index}: not decodable with schema id {schema_id}: {e}") from e
            if stream.tell() != len(value):
                raise WireFormatError(
                    f"value {index}: {len(value) - stream.tell()} bytes left after the datum of schema id {schema_id}"
                )
            out.append(datum)
        return out

    def _reader(self, schema_id: int, reader_schema: str) -> Any:
        key = (schema_id, reader_schema)
        found = self._resolved.get(key)
        if found is None:
            text = reader_schema if self.logical_types else strip_logical_types(schema_json(reader_schema))
            found = self._resolved[key] = parse(text)
        return found
