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

Schema changes: a change is written under the schema of its table's columns *at the change*
(capture.shapes: pgoutput's Relation message in force, wal2json's tracked shape, the
snapshot's catalog), never today's catalog: a change written before an ``ADD COLUMN`` has no
such field, one written before ``ALTER COLUMN n TYPE numeric`` carries ``n`` as the integer it
was (:meth:`AvroEncoder.ids_at`). The first change of a new column list registers a new version
under the subject's compatibility level (``BACKWARD`` by default: ``ADD COLUMN`` and ``DROP
COLUMN`` pass, since every column is a nullable field with default null); a column list seen
before (a column dropped and added again) finds its earlier version. A change the level refuses
(e.g. ``ALTER COLUMN … TYPE text`` over an integer) raises :class:`SchemaChangeError` *before*
anything of that change is written: the connector stops with the reason (the table cannot go
on silently — the slot would move past its changes), and the operator chooses (set the
subject's compatibility to ``NONE`` with ``tideline schemas compatibility``, or capture that
table under a new topic prefix). Reading back (the key state's catch-up, TOAST fills) decodes
each record with the schema id it names and reads its values as the column types of that
schema (each row field carries its Postgres type name), not the catalog's of today.

Where each version starts: the first event written under a value schema version is recorded
on ``__tideline_schema_starts`` in the same log transaction (schemas.starts; :class:`StartBook`
collects them, capture.writer writes them), which ``tideline schemas`` shows.

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
from typing import TYPE_CHECKING, Any

import orjson

from capture.pgtypes import text_converter
from capture.tables import TableFilter, TableInfo
from eventstore.errors import TidelineError
from schemas.errors import IncompatibleSchemaError, ValueConversionError, WireFormatError
from schemas.pgavro import PG_TYPE_PROP, ColumnType, Kind, PgColumn, column_type
from schemas.pgvalues import RowCodec, avro_default_json, to_json_converter
from schemas.registry import SchemaRegistry, subject_for
from schemas.starts import SchemaStart
from schemas.tables import TableSchemaIds, TableSchemas
from schemas.wire import AvroWire, parse_header

if TYPE_CHECKING:
    from capture.shapes import Shape

UNAVAILABLE = "__debezium_unavailable_value"  # capture.events.UNAVAILABLE (imported there from here)
_TEXT_KINDS = (Kind.STRING, Kind.JSON)
parse_json = text_converter("jsonb", 3802)  # JSON text → the exact parsed value capture carries


class SchemaChangeError(TidelineError):
    """A table's new columns cannot be registered under its subject's compatibility level."""


class StartBook:
    """The value schema versions whose first event is written (schemas.starts): those stored (read at start)
    and those of the open log transaction, until it commits (then stored) or aborts (then forgotten: the
    changes read again after the abort record them again)."""

    def __init__(self) -> None:
        self.stored: set[int] = set()  # value schema ids whose start is in the log
        self._pending: dict[int, SchemaStart] = {}  # noted in the open log transaction, by schema id
        self._committing: dict[int, SchemaStart] = {}  # written in the log transaction being committed

    def load(self, starts: list[SchemaStart]) -> None:
        self.stored = {s.schema_id for s in starts}
        self._pending.clear()

    def note(self, ids: TableSchemaIds, source: dict[str, Any]) -> None:
        """An event is written under ``ids``' value schema, with this ``source`` block."""
        if ids.value_id in self.stored or ids.value_id in self._pending or ids.value_id in self._committing:
            return
        snapshot = source.get("snapshot")
        self._pending[ids.value_id] = SchemaStart(
            subject_for(ids.topic, is_key=False), ids.value_version, ids.value_id, ids.topic,
            int(source.get("commit_lsn") or 0), int(source.get("event_index") or 0),
            0 if snapshot not in (None, "false") else int(source.get("lsn") or 0),
            snapshot not in (None, "false"),
        )  # fmt: skip

    def committing(self) -> list[SchemaStart]:
        """The starts of the open log transaction, to write in it as it commits (capture.writer): until
        :meth:`committed`, the next transaction (decoded while this one commits) notes them no more."""
        self._committing.update(self._pending)
        self._pending.clear()
        return list(self._committing.values())

    def committed(self) -> None:
        self.stored.update(self._committing)
        self._committing.clear()

    def aborted(self) -> None:
        self._pending.clear()
        self._committing.clear()


class AvroEncoder:
    """Keys and envelope values of table change events, framed with registry schema ids."""

    def __init__(self, registry: SchemaRegistry, prefix: str, table_filter: TableFilter) -> None:
        self.registry = registry
        self.filter = table_filter
        self.tables = TableSchemas(registry, prefix=prefix)
        # Values are converted to Avro's underlying types by schemas.pgvalues: no logical types needed.
        self.wire = AvroWire(registry.schema_by_id, logical_types=False)
        self._ids: dict[TableInfo, TableSchemaIds] = {}
        self._keys: dict[TableInfo, tuple[int, RowCodec]] = {}  # the key schema's id and converter, per table
        self._kinds: dict[TableInfo, dict[str, ColumnType]] = {}  # the catalog's column → its representation
        self._shape_ids: dict[tuple[TableInfo, tuple[str, ...], tuple[str, ...]], TableSchemaIds] = {}
        self._written_kinds: dict[int, dict[str, ColumnType]] = {}  # envelope schema id → its columns' types
        self._written_columns: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # the last record read_change read: its schema id and position (commit LSN, event index)
        self.last_read: tuple[int, tuple[int, int]] | None = None
        self.starts = StartBook()  # where each value schema version's first event is (schemas.starts)
        self.unavailable_nulled = 0

    def columns(self, table: TableInfo, shape: Shape | None = None) -> list[PgColumn]:
        """The table's columns as the events carry them: filtered out ones gone, masked ones text.

        ``shape``: the columns the table had at the change (capture.shapes), in their order, with their types
        then; a column the catalog has under the same name and type takes the catalog's OID and default, any
        other (dropped, renamed or retyped since) its type name alone (schemas.pgavro maps it by name)."""
        catalog = {c.name: c for c in table.columns}
        kinds = self._catalog_kinds(table)
        wanted = (
            [(c.name, c.type_name) for c in table.columns]
            if shape is None
            else list(zip(shape.names, shape.types, strict=True))
        )
        out = []
        for name, type_name in wanted:
            action = self.filter.column_action(table.schema, table.name, name)
            if action == "drop":
                continue
            not_null = name in table.key
            if action == "mask":
                out.append(PgColumn(name, "text", 25, not_null=not_null))
                continue
            col = catalog.get(name)
            same = col is not None and (col.type_name == type_name or column_type(type_name) == kinds[name])
            if col is None or not same:
                out.append(PgColumn(name, type_name, 0, not_null=not_null))
                continue
            column = PgColumn(col.name, col.type_name, col.type_oid, not_null=not_null)
            if col.missing_value is not None and not not_null:
                value = text_converter(col.type_name, col.type_oid)(col.missing_value)
                column = replace(column, default_json=avro_default_json(column.column_type, value))
            out.append(column)
        return out

    def ids_at(self, table: TableInfo, shape: Shape | None) -> TableSchemaIds:
        """The registered schemas of the table's columns at a change: the catalog's (:meth:`ids`) when ``shape`` is
        theirs, else those of ``shape`` — the first change of a new shape registers its version (or stops capture
        with :class:`SchemaChangeError`) before anything of it is written."""
        if shape is None or self._is_catalog_shape(table, shape):
            return self.ids(table)
        found = self._shape_ids.get((table, shape.names, shape.types))
        if found is None:
            found = self._register(table, self.columns(table, shape))
            self._shape_ids[(table, shape.names, shape.types)] = found
        return found

    def ids(self, table: TableInfo) -> TableSchemaIds:
        """The registered key and value schemas of ``table``'s current columns (registering a new version)."""
        found = self._ids.get(table)
        if found is None:
            found = self._register(table, self.columns(table))
            self._ids[table] = found
        return found

    def _catalog_kinds(self, table: TableInfo) -> dict[str, ColumnType]:
        """The catalog's columns as the schema writes them (a type name the stream spells otherwise, with the same
        representation, is the same column: the catalog's schema, with its OIDs and defaults, is kept)."""
        found = self._kinds.get(table)
        if found is None:
            found = self._kinds[table] = {
                c.name: PgColumn(c.name, c.type_name, c.type_oid).column_type for c in table.columns
            }
        return found

    def _is_catalog_shape(self, table: TableInfo, shape: Shape) -> bool:
        kinds = self._catalog_kinds(table)
        if shape.name_set != kinds.keys():
            return False
        types = {c.name: c.type_name for c in table.columns}
        return all(types[n] == t or column_type(t) == kinds[n] for n, t in zip(shape.names, shape.types, strict=True))

    def _register(self, table: TableInfo, columns: list[PgColumn]) -> TableSchemaIds:
        try:
            return self.tables.for_table(table.schema, table.name, columns, key_columns=table.key)
        except IncompatibleSchemaError as e:
            raise SchemaChangeError(
                f"capture of {table.qualified} stops here: its columns changed in a way its schema subject "
                f"refuses ({e}). Nothing of this change was written. To go on, allow the change "
                f"(tideline schemas compatibility {e.subject} NONE) or capture the table under a new "
                "--topic-prefix."
            ) from e

    def key(self, table: TableInfo, image: dict[str, Any]) -> bytes:
        """The record key under ``<topic>-key`` alone: the value schema is registered by the value written (a
        change's may be another shape's than the catalog's, :meth:`ids_at`)."""
        found = self._keys.get(table)
        if found is None:
            try:
                found = self.tables.key_for_table(table.schema, table.name, self.columns(table), key_columns=table.key)
            except IncompatibleSchemaError as e:
                raise SchemaChangeError(
                    f"capture of {table.qualified} stops here: its key columns changed in a way the subject "
                    f"{e.subject} refuses ({e}). Nothing of this change was written."
                ) from e
            self._keys[table] = found
        key_id, codec = found
        return self._encode(table, key_id, codec.to_avro(image))

    def envelope(
        self,
        table: TableInfo,
        op: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        transaction: bytes | None,
        ts_ms: int,
        shape: Shape | None = None,
    ) -> bytes:
        """The Avro envelope; ``source`` and ``transaction`` come as the JSON the JSON path writes; under the
        schema of ``shape`` (the table's columns at the change, :meth:`ids_at`)."""
        ids = self.ids_at(table, shape)
        source_block = orjson.loads(source)
        try:
            datum = ids.row_codec.envelope_to_avro(
                op=op,
                before=None if before is None else self._placeholders(ids, before),
                after=None if after is None else self._placeholders(ids, after),
                source=source_block,
                ts_ms=ts_ms,
                transaction=None if transaction is None else orjson.loads(transaction),
            )
        except ValueConversionError as e:
            raise ValueConversionError(f"{table.qualified}: {e}") from e
        value = self._encode(table, ids.value_id, datum)
        self.starts.note(ids, source_block)
        return value

    def read_change(self, table: TableInfo, value: bytes) -> tuple[str, dict[str, Any] | None]:
        """``(op, after image)`` of a stored Avro change event, the image as capture values, for TOAST filling.

        Only the TOAST-able kinds come back (the only ones an UPDATE can omit): text and
        bytea as they are, json/jsonb parsed exactly, numeric as Decimal; other columns
        (arrays among them) are left out, so they fall back to the placeholder.
        """
        datum = self.wire.decode(value)
        if not isinstance(datum, dict):
            return "", None
        source = datum.get("source")
        if isinstance(source, dict):
            position = (int(source.get("commit_lsn") or 0), int(source.get("event_index") or 0))
            self.last_read = (parse_header(value), position)
        op = str(datum.get("op"))
        after = datum.get("after")
        if not isinstance(after, dict):
            return op, None
        kinds = self.written_kinds(parse_header(value))
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

    def written_columns(self, schema_id: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The column names and Postgres type names of the envelope schema ``schema_id``: the shape of its table
        when a record written with it changed (capture.shapes; an Avro change is written under that shape)."""
        self.written_kinds(schema_id)
        return self._written_columns[schema_id]

    def written_kinds(self, schema_id: int) -> dict[str, ColumnType]:
        """The column types of the envelope schema ``schema_id``, as written (not the catalog's of today).

        A record is decoded with the schema it was written with, and its values read as the types its
        columns had then: ``n`` stored as ``integer`` before an ``ALTER COLUMN n TYPE numeric`` is an int,
        not the bytes of a decimal. Each row field carries its Postgres type name (schemas.pgavro)."""
        found = self._written_kinds.get(schema_id)
        if found is None:
            envelope = orjson.loads(self.registry.schema_by_id(schema_id))
            row: dict[str, Any] = {}
            for field in envelope.get("fields", []):
                if field.get("name") == "before":  # the row record is defined there (``after`` names it)
                    branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
                    row = next((b for b in branches if isinstance(b, dict) and b.get("type") == "record"), {})
            fields = [f for f in row.get("fields", []) if PG_TYPE_PROP in f]
            found = {f["name"]: column_type(str(f[PG_TYPE_PROP])) for f in fields}
            self._written_kinds[schema_id] = found
            self._written_columns[schema_id] = (
                tuple(str(f["name"]) for f in fields), tuple(str(f[PG_TYPE_PROP]) for f in fields)
            )
        return found

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
