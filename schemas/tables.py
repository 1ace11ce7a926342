"""Schemas of captured tables in the registry: columns in, key and value schema ids out.

:class:`TableSchemas` is what a connector writing Avro needs per table: given the
table's columns (as the catalog or wal2json names them) it builds the key and envelope
schemas (:mod:`schemas.pgavro`), registers them under ``<topic>-key`` and
``<topic>-value``, and returns the ids with the converters for the rows. The same
columns give the same ids without asking the registry again (a per-instance cache keyed
by the column list); changed columns (ALTER TABLE) register a new version, which the
subject's compatibility level may refuse with :class:`~schemas.errors.IncompatibleSchemaError`
naming the column — before anything is written.

Thread-safety: thread-safe (the cache is filled under ``_lock``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.pgavro import PgColumn, TableAvroSchemas, table_schemas
from schemas.pgvalues import RowCodec
from schemas.registry import SchemaRegistry, subject_for


@dataclass(frozen=True, slots=True)
class TableSchemaIds:
    """A table's registered schemas: ids to frame keys and values with, and the row converters."""

    topic: str
    key_id: int
    value_id: int
    key_version: int
    value_version: int
    schemas: TableAvroSchemas
    key_codec: RowCodec  # key columns only
    row_codec: RowCodec  # every column (before/after images)


class TableSchemas:
    """Register and cache the schemas of captured tables.

    >>> tables = TableSchemas(registry, prefix="shop")                  # doctest: +SKIP
    >>> ids = tables.for_table("public", "orders", columns, key_columns=["id"])
    >>> wire.encode(ids.value_id, ids.row_codec.envelope_to_avro(op="c", before=None, after=row, ...))
    """

    def __init__(self, registry: SchemaRegistry, *, prefix: str) -> None:
        self.registry = registry
        self.prefix = prefix
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str, tuple[PgColumn, ...], tuple[str, ...]], TableSchemaIds] = {}
        self._key_cache: dict[tuple[str, str, tuple[PgColumn, ...], tuple[str, ...]], tuple[int, RowCodec]] = {}

    def topic(self, schema: str, table: str) -> str:
        return f"{self.prefix}.{schema}.{table}"

    def key_for_table(
        self, schema: str, table: str, columns: Sequence[PgColumn], *, key_columns: Sequence[str]
    ) -> tuple[int, RowCodec]:
        """The key schema's id and converter alone (``<topic>-key``), registering it when new: a key can be
        written without registering the value schema of the same columns (a change's value may be written under
        another shape's schema)."""
        cache_key = (schema, table, tuple(c for c in columns if c.name in key_columns), tuple(key_columns))
        with self._lock:
            found = self._key_cache.get(cache_key)
        if found is not None:
            return found
        built = table_schemas(self.prefix, schema, table, columns, key_columns)
        key = self.registry.register(subject_for(self.topic(schema, table), is_key=True), built.key)
        key_cols = {k: i for i, k in enumerate(key_columns)}
        out = (key.id, RowCodec(sorted((c for c in columns if c.name in key_cols), key=lambda c: key_cols[c.name])))
        with self._lock:
            self._key_cache[cache_key] = out
        return out

    def for_table(
        self, schema: str, table: str, columns: Sequence[PgColumn], *, key_columns: Sequence[str]
    ) -> TableSchemaIds:
        """The ids of this column list, registering new versions when it changed."""
        cache_key = (schema, table, tuple(columns), tuple(key_columns))
        with self._lock:
            found = self._cache.get(cache_key)
        if found is not None:
            return found
        built = table_schemas(self.prefix, schema, table, columns, key_columns)
        topic = self.topic(schema, table)
        key = self.registry.register(subject_for(topic, is_key=True), built.key)
        value = self.registry.register(subject_for(topic, is_key=False), built.envelope)
        key_cols = {k: i for i, k in enumerate(key_columns)}
        ids = TableSchemaIds(
            topic, key.id, value.id, key.version, value.version, built,
            RowCodec(sorted((c for c in columns if c.name in key_cols), key=lambda c: key_cols[c.name])),
            RowCodec(columns),
        )  # fmt: skip
        with self._lock:
            self._cache[cache_key] = ids
        return ids
