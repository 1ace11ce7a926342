"""The value schema versions of a captured table's topic, for readers of a topic written under several.

A table altered while capture runs has its events written under several versions of its value
schema (capture.avro: each change under the schema of its table's columns at the change). The
``tideline`` source reads them all: with ``decodeAvro`` each value becomes the JSON of the columns
it was written with, and with ``includeSchemaIds`` each row carries ``valueSchemaId``, the version's
schema id. :func:`value_schema_versions` says what each id is::

    from projections.schema_versions import value_schema_versions

    versions = value_schema_versions("tideline-data", "shop.public.orders")
    for v in versions:                      # in version order
        print(v.version, v.schema_id, v.columns, v.started)
    rows = (spark.read.format("tideline").option("path", "tideline-data").option("topic", "shop.public.orders")
            .option("decodeAvro", "true").option("includeSchemaIds", "true").load())
    v1 = rows.where(rows.valueSchemaId == versions[0].schema_id)   # the events of version 1 only

``columns``: the row's columns then, each with its Postgres type name (the ``tideline.pg_type`` of
the row field: docs/schemas.md), in order; ``started``: where the version's first event is in the
source (schemas.starts; None when no connector recorded one).

Thread-safety: functions only; each call opens the log itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from schemas.pgavro import envelope_row_columns
from schemas.registry import SchemaRegistry, subject_for
from schemas.starts import STARTS_TOPIC, SchemaStart, latest_starts


@dataclass(frozen=True, slots=True)
class ValueSchemaVersion:
    """One version of a topic's value subject."""

    subject: str
    version: int
    schema_id: int
    columns: tuple[tuple[str, str | None], ...]  # (name, Postgres type name) of the row record's fields, in order
    schema: dict[str, Any]  # the Avro schema, parsed
    started: SchemaStart | None  # its first event's source position (schemas.starts)


def value_schema_versions(path: str | Path, topic: str) -> list[ValueSchemaVersion]:
    """Every version of ``<topic>-value`` in the log's registry at ``path``, in version order (empty when the
    subject has none: JSON capture, or nothing captured yet)."""
    subject = subject_for(topic, is_key=False)
    with Log(path, create=False) as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        if subject not in registry.subjects():
            return []
        starts = log_schema_starts(log)
        out = []
        for version in registry.versions(subject):
            found = registry.get_version(subject, version)
            schema = json.loads(found.schema)
            out.append(ValueSchemaVersion(subject, version, found.id, envelope_row_columns(schema) or (), schema,
                                          starts.get((subject, version))))  # fmt: skip
    return out


def log_schema_starts(log: Log) -> dict[tuple[str, int], SchemaStart]:
    """The committed records of :data:`schemas.starts.STARTS_TOPIC` in ``log``, per (subject, version)."""
    if STARTS_TOPIC not in log.topics():
        return {}
    records: list[tuple[bytes | None, bytes | None]] = []
    with Consumer(log, isolation_level="read_committed", enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(STARTS_TOPIC, p) for p in range(log.topic(STARTS_TOPIC).partitions)])
        consumer.seek_to_beginning()
        while batch := consumer.poll(timeout_ms=0):
            records.extend((r.key, r.value) for r in batch)
    return latest_starts(records)
