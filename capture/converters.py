"""The value converter seam: how a change event's key and envelope become bytes (JSON or Avro).

The event builder (capture.events) decides *what* an event says — op, before, after,
source, transaction — and hands it to a :class:`ValueConverter`, which decides *how* it
is written. One class per format, chosen once by :func:`converter_for`:

* :class:`JsonConverter` — the default: keys ``{col: value}``, the envelope as JSON text
  (docs/capture.md, "Events"; capture.pgtypes has the value mapping).
* :class:`AvroConverter` — Confluent-framed Avro through a schema registry
  (capture.avro has the schemas and their evolution): the registry in the embedded
  log's ``__schemas`` by default, or any :class:`~schemas.registry.SchemaRegistry`
  given (in Kafka mode: ``SchemaRegistry(KafkaSchemaStore(bootstrap))``, topic
  ``_schemas``, what ``tideline --kafka … schemas serve`` serves).

A converter also reads back what it wrote (:meth:`ValueConverter.read_change`): the key
state is rebuilt from stored events (capture.keystate), and a TOAST fill needs the
values of a stored row.

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from capture.avro import AvroEncoder, StartBook
from capture.config import ValueFormat
from capture.pgtypes import JsonNumber, dumps_values
from capture.shapes import Shape
from capture.tables import TableFilter, TableInfo
from eventstore.errors import ConfigError
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from schemas.registry import SchemaRegistry


class ValueConverter(Protocol):
    """Keys and envelope values of table change events in one format."""

    # Whether a column's type (not only its name) is part of what is written: then a change
    # of a column's type OID makes the connector read the catalog again.
    types_matter: bool
    # Avro: where each value schema version's first event is (capture.avro.StartBook; capture.writer writes them
    # in the log transaction of that event); None: a format without schema versions (JSON)
    starts: StartBook | None

    def key(self, table: TableInfo, image: dict[str, Any]) -> bytes:
        """The record key of a row (its key columns)."""
        ...

    def envelope(
        self,
        table: TableInfo,
        op: bytes,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        transaction: bytes | None,
        now_ms: int,
        shape: Shape | None = None,
    ) -> bytes:
        """The change event's value; ``source`` and ``transaction`` come rendered as JSON. ``shape``: the table's
        columns at the change (capture.shapes) when they may differ from the catalog's (``table``); a format whose
        schema names the columns (Avro) writes the change under the schema of that shape."""
        ...

    def read_change(self, table: TableInfo, value: bytes) -> tuple[str, dict[str, Any] | None]:
        """``(op, after image)`` of a stored change event; the image holds at least the TOAST-able columns."""
        ...

    def key_image(self, table: TableInfo, key: bytes) -> dict[str, Any] | None:
        """The key columns of a stored record key as capture values (None: this format does not decode keys)."""
        ...

    def written_shape(self) -> tuple[tuple[int, int], tuple[str, ...], tuple[str, ...]] | None:
        """The position and the table's columns (names, type names) of the change :meth:`read_change` read last,
        when its format records them (Avro: the schema it was written with); None: it does not (JSON)."""
        ...


class JsonConverter:
    """JSON keys and envelopes (the default value format)."""

    types_matter = False
    starts: StartBook | None = None

    def key(self, table: TableInfo, image: dict[str, Any]) -> bytes:
        return dumps_values({k: image.get(k) for k in table.key})

    def envelope(
        self,
        table: TableInfo,
        op: bytes,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        transaction: bytes | None,
        now_ms: int,
        shape: Shape | None = None,
    ) -> bytes:
        """The envelope, concatenated from its JSON parts (the same JSON as one ``dumps`` of it, faster)."""
        return b"".join(
            (
                b'{"before":',
                b"null" if before is None else dumps_values(before),
                b',"after":',
                b"null" if after is None else dumps_values(after),
                b',"source":',
                source,
                b',"op":"',
                op,
                b'","ts_ms":%d,"transaction":' % now_ms,
                b"null" if transaction is None else transaction,
                b"}",
            )
        )

    def read_change(self, table: TableInfo, value: bytes) -> tuple[str, dict[str, Any] | None]:
        # Exact: fractions inside json/jsonb stay JsonNumber (written back as the same bare
        # number), integers stay ints of any size, everything else is already a JSON string.
        envelope = json.loads(value, parse_float=JsonNumber)
        after = envelope.get("after")
        return str(envelope.get("op")), after if isinstance(after, dict) else None

    def key_image(self, table: TableInfo, key: bytes) -> dict[str, Any] | None:
        image = json.loads(key, parse_float=JsonNumber)
        return image if isinstance(image, dict) else None

    def written_shape(self) -> tuple[tuple[int, int], tuple[str, ...], tuple[str, ...]] | None:
        return None  # the whole row images read back say it (capture.writer)


class AvroConverter:
    """Confluent-framed Avro keys and envelopes, schemas in a schema registry (capture.avro)."""

    types_matter = True

    def __init__(self, encoder: AvroEncoder) -> None:
        self.encoder = encoder
        self.starts: StartBook | None = encoder.starts

    def key(self, table: TableInfo, image: dict[str, Any]) -> bytes:
        return self.encoder.key(table, image)

    def envelope(
        self,
        table: TableInfo,
        op: bytes,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        transaction: bytes | None,
        now_ms: int,
        shape: Shape | None = None,
    ) -> bytes:
        return self.encoder.envelope(table, op.decode(), before, after, source, transaction, now_ms, shape)

    def read_change(self, table: TableInfo, value: bytes) -> tuple[str, dict[str, Any] | None]:
        if value[:1] != b"\x00":  # written before the table's topic went Avro: JSON
            return JsonConverter().read_change(table, value)
        return self.encoder.read_change(table, value)

    def key_image(self, table: TableInfo, key: bytes) -> dict[str, Any] | None:
        return None  # an Avro key decodes to Avro's values, not capture's: ``before`` stays null

    def written_shape(self) -> tuple[tuple[int, int], tuple[str, ...], tuple[str, ...]] | None:
        last = self.encoder.last_read
        if last is None:
            return None
        schema_id, position = last
        names, types = self.encoder.written_columns(schema_id)
        return position, names, types


def converter_for(
    value_format: ValueFormat,
    log: Log | None,
    topic_prefix: str,
    table_filter: TableFilter,
    *,
    registry: SchemaRegistry | None = None,
) -> ValueConverter:
    """The converter of a value format.

    Avro registers its schemas in ``registry``; without one, in the registry of ``log``
    (its ``__schemas`` topic). A Kafka sink passes ``log=None`` and
    ``registry=SchemaRegistry(KafkaSchemaStore(bootstrap))``.
    """
    if value_format is ValueFormat.AVRO:
        if registry is None:
            if log is None:
                raise ConfigError("--value-format avro needs a schema registry: give the embedded log or a registry")
            registry = SchemaRegistry(LogSchemaStore(log))
        return AvroConverter(AvroEncoder(registry, topic_prefix, table_filter))
    return JsonConverter()
