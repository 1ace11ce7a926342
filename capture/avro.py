"""Avro values for table topics (``--value-format avro``): keys and envelopes through the registry.

With ``value_format=avro`` the connector registers, per captured table, a key schema
(``<topic>-key``: the key columns) and an envelope schema (``<topic>-value``: Debezium's
envelope with the table's row record as ``before``/``after``) in the log's schema
registry (``__schemas``, see :mod:`schemas.registry`), and writes keys and values in the
Confluent wire format: magic byte 0, the 4-byte big-endian schema id, Avro binary. Types
follow docs/schemas.md (the same table as capture's JSON mapping).

Column defaults: a column added with ``ADD COLUMN … DEFAULT <constant>`` (Postgres
keeps the value rows written before it read as, ``attmissingval``) gets that value as its
Avro field default, so events written before the column existed read, under the new
schema, as the row reads in Postgres — Debezium propagates defaults the same way.

Schema changes: the column list is read from the catalog (``capture.tables``), which the
connector refreshes when a change carries a column it does not know, lacks one it knows
(an INSERT has every column), or carries one under another type OID. A new column list
registers a new version under the subject's compatibility level (``BACKWARD`` by
default: ``ADD COLUMN`` and ``DROP COLUMN`` pass, since every column is a nullable
field with default null). A change the level refuses (e.g. ``ALTER COLUMN … TYPE text``
over an integer) raises :class:`SchemaChangeError` *before* anything of that change is
written: the connector stops with the reason (the table cannot go on silently — the
slot would move past its changes), and the operator chooses (set the subject's
compatibility to ``NONE`` with ``tideline schemas compatibility``, or capture that table
under a new topic prefix).

What stays JSON: the transaction metadata and logical message topics, and a TRUNCATE
event's key ``{}`` (no key record can say "the whole table"); readers tell the two
apart by the first byte (0 for Avro, ``{`` for JSON).

Columns that are dropped by the table filter are not in the schema; masked columns are
strings (their hash). An unchanged TOAST value that could not be filled
(:data:`capture.events.UNAVAILABLE`) is the placeholder text in string and JSON columns,
its UTF-8 bytes in bytea columns, and NULL in columns of other types (counted in
``unavailable_nulled``).

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Any

import orjson

from capture.pgtypes import text_converter
from capture.tables import TableFilter, TableInfo
from eventstore.errors import TidelineError
from schemas.errors import IncompatibleSchemaError, ValueConversionError, WireFormatError
from schemas.pgavro import Kind, PgColumn
from schemas.pgvalues import avro_default_json, to_json_converter
from schemas.registry import SchemaRegistry
from schemas.tables import TableSchemaIds, TableSchemas
from schemas.wire import AvroWire

UNAVAILABLE = "__debezium_unavailable_value"  # capture.events.UNAVAILABLE (imported there from here)
_TEXT_KINDS = (Kind.STRING, Kind.JSON)
parse_json = text_converter("jsonb", 3802)  # JSON text → the exact parsed value capture carries


class SchemaChangeError(TidelineError):
    """A table's new columns cannot be registered under its subject's compatibility level."""


class AvroEncoder:
    """Keys and envelope values of table change events, framed with registry schema ids."""

    def __init__(self, registry: SchemaRegistry, prefix: str, table_filter: TableFilter) -> None:
        self.registry = registry
        self.filter = table_filter
        self.tables = TableSchemas(registry, prefix=prefix)
        # Values are converted to Avro's underlying types by schemas.pgvalues: no logical types needed.
        self.wire = AvroWire(registry.schema_by_id, logical_types=False)
        self._ids: dict[TableInfo, TableSchemaIds] = {}
        self.unavailable_nulled = 0

    def columns(self, table: TableInfo) -> list[PgColumn]:
        """The table's columns as the events carry them: filtered out ones gone, masked ones text."""
        out = []
        for col in table.columns:
            action = self.filter.column_action(table.schema, table.name, col.name)
            if action == "drop":
                continue
            not_null = col.name in table.key
            if action == "mask":
                out.append(PgColumn(col.name, "text", 25, not_null=not_null))
                continue
            column = PgColumn(col.name, col.type_name, col.type_oid, not_null=not_null)
            if col.missing_value is not None and not not_null:
                value = text_converter(col.type_name, col.type_oid)(col.missing_value)
                column = replace(column, default_json=avro_default_json(column.column_type, value))
            out.append(column)
        return out

    def ids(self, table: TableInfo) -> TableSchemaIds:
        """The registered key and value schemas of ``table``'s current columns (registering a new version)."""
        found = self._ids.get(table)
        if found is None:
            try:
                found = self.tables.for_table(table.schema, table.name, self.columns(table), key_columns=table.key)
            except IncompatibleSchemaError as e:
                raise SchemaChangeError(
                    f"capture of {table.qualified} stops here: its columns changed in a way its schema subject "
                    f"refuses ({e}). Nothing of this change was written. To go on, allow the change "
                    f"(tideline schemas compatibility {e.subject} NONE) or capture the table under a new "
                    "--topic-prefix."
                ) from e
            self._ids[table] = found
        return found

    def key(self, table: TableInfo, image: dict[str, Any]) -> bytes:
        ids = self.ids(table)
        return self._encode(table, ids.key_id, ids.key_codec.to_avro(image))

    def envelope(
        self,
        table: TableInfo,
        op: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        transaction: bytes | None,
        ts_ms: int,
    ) -> bytes:
        """The Avro envelope; ``source`` and ``transaction`` come as the JSON the JSON path writes."""
        ids = self.ids(table)
        try:
            datum = ids.row_codec.envelope_to_avro(
                op=op,
                before=None if before is None else self._placeholders(ids, before),
                after=None if after is None else self._placeholders(ids, after),
                source=orjson.loads(source),
                ts_ms=ts_ms,
                transaction=None if transaction is None else orjson.loads(transaction),
            )
        except ValueConversionError as e:
            raise ValueConversionError(f"{table.qualified}: {e}") from e
        return self._encode(table, ids.value_id, datum)

    def read_change(self, table: TableInfo, value: bytes) -> tuple[str, dict[str, Any] | None]:
        """``(op, after image)`` of a stored Avro change event, the image as capture values, for TOAST filling.

        Only the TOAST-able kinds come back (the only ones an UPDATE can omit): text and
        bytea as they are, json/jsonb parsed exactly, numeric as Decimal; other columns
        (arrays among them) are left out, so they fall back to the placeholder.
        """
        datum = self.wire.decode(value)
        if not isinstance(datum, dict):
            return "", None
        op = str(datum.get("op"))
        after = datum.get("after")
        if not isinstance(after, dict):
            return op, None
        kinds = {c.name: c.column_type for c in self.ids(table).row_codec.columns}
        out: dict[str, Any] = {}
        for name, raw in after.items():
            ctype = kinds.get(name)
            if raw is None or ctype is None or ctype.dimensions:
                continue
            if ctype.kind in (Kind.STRING, Kind.BYTES):
                out[name] = raw
            elif ctype.kind is Kind.JSON:
                out[name] = parse_json(raw)  # exactly as a jsonb value from the stream
            elif ctype.kind in (Kind.DECIMAL, Kind.VARIABLE_DECIMAL):
                out[name] = Decimal(to_json_converter(ctype)(raw))
        return op, out

    def _placeholders(self, ids: TableSchemaIds, image: dict[str, Any]) -> dict[str, Any]:
        if UNAVAILABLE not in image.values():
            return image
        out = dict(image)
        for col in ids.row_codec.columns:
            if out.get(col.name) != UNAVAILABLE:
                continue
            ctype = col.column_type
            if ctype.dimensions == 0 and ctype.kind in _TEXT_KINDS:
                continue
            if ctype.dimensions == 0 and ctype.kind is Kind.BYTES:
                out[col.name] = UNAVAILABLE.encode()
            else:
                out[col.name] = None
                self.unavailable_nulled += 1
        return out

    def _encode(self, table: TableInfo, schema_id: int, datum: dict[str, Any]) -> bytes:
        try:
            return self.wire.encode(schema_id, datum)
        except WireFormatError as e:
            raise WireFormatError(f"{table.qualified}: {e}") from e
