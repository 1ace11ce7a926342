"""Change messages → Debezium-compatible change events (key, value, topic).

Value (JSON, UTF-8, one envelope per record; docs/capture.md, "Events")::

    {"before": {...} | null, "after": {...} | null, "op": "c|u|d|r|t|m", "ts_ms": <capture time>,
     "source": {"version", "connector": "postgresql", "name": <prefix>, "ts_ms": <commit time>,
                "snapshot": "false|true|last", "db", "schema", "table", "txId", "lsn",
                "commit_lsn", "event_index"},
     "transaction": {"id": "<txId>:<commit_lsn>", "total_order", "data_collection_order"} | null}

Key: JSON ``{<key column>: value, …}`` in key order (see capture.tables for which columns);
null for a keyless table (capture.tables.KeylessPolicy). Topic: capture.topics.
Values are converted by capture.pgtypes (its table lists every type's JSON form); keys and
envelopes are written by a value converter (capture.converters: JSON or Avro).

Rules, Debezium's unless noted:

* DELETE → the ``d`` event (``before``: the old row image the replica identity carries —
  the key columns under DEFAULT, every column under FULL), then a **tombstone** (same
  key, null value).
* UPDATE → ``u``; ``before`` is the old row only under REPLICA IDENTITY FULL, else null.
* UPDATE that changes the key → ``d`` (old key; ``before`` = the old image the replica
  identity carries, as for a DELETE) + tombstone (old key) + ``c`` (new key).
  The ``d`` event and its tombstone carry the header ``__debezium.newkey`` (the new
  key), the ``c`` event ``__debezium.oldkey`` (the old key), as Debezium writes them;
  the three events also share ``source.event_index``.
* TRUNCATE → a ``t`` event with key ``{}`` (the whole table; Debezium's has a null key,
  which a compacted topic cannot hold), then a tombstone for every key still live in the
  table's topic (ours: so that compaction, and "latest value per key", forget truncated
  rows as they forget deleted ones). The live keys come from the key state
  (capture.keystate), in chunks, never from reading the topic.
* Keyless tables: inserts (and truncates) only, with a null key; no tombstones.
* **Outbox routing** (``outbox_table``, the commands' ``events`` table; Debezium's outbox
  event router): an inserted row becomes a record on ``<outbox prefix>.<stream_type>``
  (delete policy, infinite retention: events are facts), key = ``stream_id`` (UTF-8),
  value = the row's ``id, stream_id, stream_type, version, event_type, schema_version,
  payload, metadata, recorded_at`` plus ``source`` (``commit_lsn``, ``event_index``,
  ``txId``, ``ts_ms``: how far a reader is, for read-your-writes), headers
  ``event_type`` and ``id``. The table's own topic is not written. Updates, deletes
  and truncates of outbox rows are refused by the table's trigger; if one shows up
  anyway the connector logs it and counts it (``outbox_violations``), writing nothing.
* Logical messages → ``m`` events on ``<prefix>.message``: ``{"op": "m", "message":
  {"prefix", "content": base64}}``, key ``{"prefix": …}`` (Debezium's message key).
* **Unchanged TOAST columns** (wal2json omits them from an UPDATE, pgoutput marks them 'u'):
  the columns of the table's shape at the change (capture.shapes: pgoutput's Relation message
  in force, wal2json's tracked shape) that the UPDATE lacks, and only those — never a column
  the catalog has now but the table did not have then. Each is filled from the old row image
  when the table has REPLICA IDENTITY FULL, else from the key's last known image (an LRU
  cache of the TOAST-able columns of rows over 1 KB — smaller rows are never TOASTed —
  bounded in bytes, and on a miss the key state's copy of the same values,
  capture.keystate), under its name or, for a renamed column, an earlier one, else set to
  the marker :data:`UNAVAILABLE` (Debezium's ``__debezium_unavailable_value``).

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from capture.avro import UNAVAILABLE
from capture.converters import JsonConverter, ValueConverter
from capture.keystate import KeyState
from capture.messages import ChangeMessage, Column, Kind
from capture.pgtypes import JsonText, dumps, dumps_values
from capture.schema_changes import DdlMessage, table_change
from capture.shapes import Shape, ShapeTracker
from capture.tables import TableFilter, TableInfo
from capture.topics import TopicRouter, table_topic
from eventstore.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

UNIQUE_KEY_SOURCES = ("primary key", "replica identity index")  # TableInfo.key_source: no two rows share a key
NEWKEY_HEADER = "__debezium.newkey"  # on the d event (and tombstone) of a key change: the new key
OLDKEY_HEADER = "__debezium.oldkey"  # on its c event: the old key

# The outbox table's columns (commands/schema.py creates it): what routing needs, and what the value carries.
OUTBOX_COLUMNS = ("stream_id", "stream_type", "version", "event_type", "payload")
OUTBOX_VALUE_COLUMNS = (
    "id", "stream_id", "stream_type", "version", "event_type", "schema_version", "payload", "metadata", "recorded_at",
)  # fmt: skip

__all__ = [
    "OUTBOX_COLUMNS",
    "UNAVAILABLE",
    "Event",
    "EventBuilder",
    "EventEncoder",
    "ToastCache",
    "TxnContext",
    "table_topic",
]
# Postgres TOASTs a row only when it exceeds TOAST_TUPLE_THRESHOLD (≈ 2 KB by default), so
# smaller rows are never cached (a table with a lower toast_tuple_target falls back to the key state).
TOAST_MIN_ROW_BYTES = 1024
ENTRY_OVERHEAD = 400  # Python objects per cache entry (dict, tuple, key), for the byte bound
ENTRY_SCALAR_BYTES = 16  # what ToastCache.size_of counts for a value it does not measure by length
VERSION = "tideline-0.1"
TRUNCATE_KEY = b"{}"  # the t event's key: "the whole table"


@dataclass(frozen=True, slots=True)
class Event:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] | None = None


@dataclass(slots=True)
class TxnContext:
    """What the events of one transaction share."""

    xid: int | None
    commit_lsn: int
    ts_ms: int
    snapshot: str = "false"  # a snapshot read's marker: capture.snapshot.snapshot_marker
    total_order: int = 0
    per_table: dict[str, int] | None = None
    source_prefix: dict[str, bytes] = field(default_factory=dict)  # rendered once per table


class ToastCache:
    """Last known values of the TOAST-able columns per (topic, key): an LRU bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, bytes], tuple[dict[str, Any], int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    @staticmethod
    def size_of(values: dict[str, Any]) -> int:
        """Rough bytes of an image: strings and bytes by length, JSON and arrays by their JSON, else 16."""
        total = 0
        for v in values.values():
            if isinstance(v, (str, bytes, JsonText)):
                total += len(v)
            elif isinstance(v, (dict, list)):
                total += len(dumps(v))
            else:
                total += ENTRY_SCALAR_BYTES
        return total

    @classmethod
    def _size(cls, values: dict[str, Any]) -> int:
        return cls.size_of(values) + ENTRY_OVERHEAD

    def put(self, topic: str, key: bytes, values: dict[str, Any]) -> None:
        k = (topic, key)
        old = self._entries.pop(k, None)
        if old is not None:
            self._bytes -= old[1]
        size = self._size(values)
        if size > self.max_bytes:
            return
        self._entries[k] = (values, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, s) = self._entries.popitem(last=False)
            self._bytes -= s

    def get(self, topic: str, key: bytes) -> dict[str, Any] | None:
        entry = self._entries.get((topic, key))
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end((topic, key))
        self.hits += 1
        return entry[0]

    def drop(self, topic: str, key: bytes) -> None:
        old = self._entries.pop((topic, key), None)
        if old is not None:
            self._bytes -= old[1]

    @property
    def entries(self) -> int:
        return len(self._entries)

    def drop_many(self, topic: str, keys: list[bytes]) -> None:
        for key in keys if self._entries else ():
            self.drop(topic, key)

    def drop_topic(self, topic: str) -> None:
        for k in [k for k in self._entries if k[0] == topic]:
            self.drop(*k)


class EventEncoder:
    """The stateless part of building events: images, record keys, ``source``, snapshot reads as bytes.

    It needs no key state, so a snapshot reader process (capture.snapshot_readers) builds its
    reads with it exactly as the connector's :class:`EventBuilder` does.
    """

    def __init__(self, prefix: str, db: str, table_filter: TableFilter, converter: ValueConverter) -> None:
        self.prefix = prefix
        self.db = db
        self.filter = table_filter
        self.converter = converter
        self._key = converter.key  # bound once: called for every change
        self.json_values = isinstance(converter, JsonConverter)  # values hold ``after`` as JSON (toast_values)

    # ------------------------------------------------------------------ images

    def _image(self, table: TableInfo, columns: list[Column]) -> dict[str, Any]:
        if not self.filter.exclude_columns and not self.filter.mask_columns:
            return {col.name: col.value for col in columns}
        out: dict[str, Any] = {}
        for col in columns:
            action = self.filter.column_action(table.schema, table.name, col.name)
            if action == "drop":
                continue
            out[col.name] = self.filter.mask(col.value) if action == "mask" else col.value
        return out

    def key_of(self, table: TableInfo, image: dict[str, Any]) -> bytes | None:
        if not table.key:  # keyless
            return None
        return self._key(table, image)

    def row_key(self, table: TableInfo, columns: list[Column]) -> bytes | None:
        """The record key of a row read from the table (as :meth:`EventBuilder.snapshot_read` keys it)."""
        return self.key_of(table, self._image(table, columns))

    @staticmethod
    def toast_values(
        table: TableInfo, after: dict[str, Any], value_bytes: int | None = None,
        columns: frozenset[str] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """The TOAST-able values of a row big enough to have been TOASTed at all (None: a small row).

        The row's size is judged by its TOAST-able (variable-length) columns alone: the
        others are a few bytes each, far below the threshold's margin. ``value_bytes``: the
        length of the event value holding ``after`` (JSON), when known. Each value that
        :meth:`ToastCache.size_of` counts by length appears in that JSON at least half as long
        (strings as themselves or escaped, bytes in base64, json as its text, arrays as JSON that
        differs by a few characters per element at most), and the others count 16 each: a value
        shorter than half the threshold less those is a small row without looking at the values.
        """
        cols = table.toastable_columns if columns is None else columns  # columns: the change's shape's
        if not cols:
            return None
        if value_bytes is not None and 2 * value_bytes + ENTRY_SCALAR_BYTES * len(cols) < TOAST_MIN_ROW_BYTES:
            return None
        if columns is None:
            values = {c: after[c] for c in cols if c in after and after[c] != UNAVAILABLE}
        else:  # in the row's order (a shape's is the stream's, which may differ from one change to the next)
            values = {c: v for c, v in after.items() if c in columns and v != UNAVAILABLE}
        return values if ToastCache.size_of(values) >= TOAST_MIN_ROW_BYTES else None

    def _source(self, m: ChangeMessage | None, table: TableInfo | TableName | None, ctx: TxnContext,
                index: int) -> bytes:  # fmt: skip
        """``source`` as JSON: the part shared by a transaction's events of one table is rendered once."""
        name = table.qualified if table is not None else ""
        prefix = ctx.source_prefix.get(name)
        if prefix is None:
            shared = {
                "version": VERSION,
                "connector": "postgresql",
                "name": self.prefix,
                "ts_ms": ctx.ts_ms,
                "snapshot": ctx.snapshot,
                "db": self.db,
                "schema": table.schema if table else "",  # a logical message has none: "" as Debezium
                "table": table.name if table else "",
                "txId": ctx.xid,
                "commit_lsn": ctx.commit_lsn,
            }
            prefix = ctx.source_prefix[name] = dumps(shared)[:-1]
        lsn = m.lsn if m is not None else ctx.commit_lsn
        return prefix + b',"lsn":%d,"event_index":%d}' % (lsn, index)

    def read_record(
        self, table: TableInfo, columns: list[Column], ctx: TxnContext, index: int, now_ms: int
    ) -> tuple[bytes | None, bytes, dict[str, Any]]:
        """A snapshot read's record key and value, and its ``after`` image (for the key state)."""
        after = self._image(table, columns)
        key = self.key_of(table, after)
        source = self._source(None, table, ctx, index)
        return key, self.converter.envelope(table, b"r", None, after, source, None, now_ms), after

    def read_parts(self, table: TableInfo, ctx: TxnContext, now_ms: int) -> tuple[bytes, bytes, bytes]:
        """``(lead, mid, tail)`` of a snapshot read's value (JSON values): :meth:`read_record`'s value is
        ``lead + after image + mid + event index digits + tail`` (capture.snapshot joins natively encoded
        images this way)."""
        source = self._source(None, table, ctx, 0)
        value = self.converter.envelope(table, b"r", None, {}, source, None, now_ms)
        lead = b'{"before":null,"after":'
        at = b'{},"source":' + source
        if not value.startswith(lead + at) or not source.endswith(b"0}"):
            raise AssertionError(f"a snapshot read's value of {table.qualified} is not laid out as expected")
        rest = value[len(lead) + 2 :]
        cut = len(at) - 4  # where the index's digit 0 is, in rest
        return lead, rest[:cut], rest[cut + 1 :]


class EventBuilder(EventEncoder):
    """Builds the events of change messages for one connector.

    It keeps the key state (capture.keystate) in step with the events it builds: live keys,
    the TOAST-able values of big rows, routed outbox versions. The caller makes sure the
    table topics it builds for are tracked there (capture.writer).
    """

    def __init__(
        self,
        prefix: str,
        db: str,
        table_filter: TableFilter,
        router: TopicRouter,
        converter: ValueConverter,
        toast_cache: ToastCache,
        keystate: KeyState,
    ) -> None:
        super().__init__(prefix, db, table_filter, converter)
        self.router = router
        self.toast = toast_cache
        self.keystate = keystate
        self.message_topic = f"{prefix}.message"
        self.schema_changes_topic = f"{prefix}.schema_changes"
        self.transaction_topic = f"{prefix}.transaction"
        self.unavailable_filled = 0
        self.shapes = ShapeTracker(keystate)  # each table's shape at the stream's position (capture.shapes)

    def topic(self, table: TableInfo) -> str:
        return self.router.topic(table.schema, table.name)

    def count(self, table: TableInfo, ctx: TxnContext) -> int:
        """Count one change of ``table`` in its transaction; its order within the table."""
        ctx.total_order += 1
        if ctx.per_table is None:
            ctx.per_table = {}
        n = ctx.per_table[table.qualified] = ctx.per_table.get(table.qualified, 0) + 1
        return n

    def count_stored(self, m: ChangeMessage, table: TableInfo, ctx: TxnContext) -> None:
        """Advance the transaction's counters past a change stored before a restart, as :meth:`change`
        counted it: a primary-key change twice (its delete and its create)."""
        self.count(table, ctx)
        if m.kind is Kind.UPDATE and m.identity and table.key:
            after = self._image(table, m.columns)
            whole = all(k in after for k in table.key)  # a key column left out is an unchanged TOAST value
            if whole and self.key_of(table, after) != self.key_of(table, self._image(table, m.identity)):
                self.count(table, ctx)

    def _transaction(self, table: TableInfo, ctx: TxnContext) -> bytes | None:
        if ctx.xid is None:
            return None
        n = self.count(table, ctx)
        return b'{"id":"%d:%d","total_order":%d,"data_collection_order":%d}' % (
            ctx.xid,
            ctx.commit_lsn,
            ctx.total_order,
            n,
        )

    # ------------------------------------------------------------------ events

    def snapshot_read(self, table: TableInfo, columns: list[Column], ctx: TxnContext, index: int, now_ms: int) -> Event:
        topic = self.topic(table)
        key, value, after = self.read_record(table, columns, ctx, index, now_ms)
        self._remember(table, topic, key, after, value_bytes=len(value) if self.json_values else None)
        return Event(topic, key, value)

    def remember_reads(self, topic: str, keys: list[bytes], big: dict[int, dict[str, Any]]) -> None:
        """The key state of snapshot reads built elsewhere (capture.snapshot_readers), as :meth:`snapshot_read`
        keeps it: every key live; ``big``: position in ``keys`` → the TOAST-able values of a big row."""
        self.toast.drop_many(topic, keys)
        self.keystate.put_many(topic, keys, [None] * len(keys))
        for i, values in big.items():
            self.toast.put(topic, keys[i], values)
            self.keystate.put(topic, keys[i], values)

    def remember_read_keys(self, table: TableInfo, topic: str, keys: pa.Array, big: dict[int, dict[str, Any]]) -> None:
        """:meth:`remember_reads` of keys as an Arrow binary array (native snapshot batches): live keys go to the
        key state in bulk (:meth:`KeyState.put_run`) when the table's key is unique; otherwise (a configured key,
        or every column of a REPLICA IDENTITY FULL table: two rows may share one) as SQLite rows, once each."""
        if table.key_source not in UNIQUE_KEY_SOURCES:
            self.remember_reads(topic, keys.to_pylist(), big)
            return
        if self.toast.entries:
            self.toast.drop_many(topic, keys.to_pylist())
        self.keystate.put_run(topic, keys)
        for i, values in big.items():
            key = keys[i].as_py()
            self.toast.put(topic, key, values)
            self.keystate.put(topic, key, values)

    def change(
        self, m: ChangeMessage, table: TableInfo, ctx: TxnContext, index: int, now_ms: int, topic: str | None = None,
        shape: Shape | None = None,
    ) -> list[Event]:  # fmt: skip
        """The events of one row change (a TRUNCATE's tombstones come from :meth:`truncate_tombstones`).

        ``topic``: the table's topic when the caller has it already (:meth:`topic` otherwise). ``shape``: the
        table's columns at the change (capture.shapes); None: the catalog's (``table``), for a change that has
        every one of them (the native core's, checked again by capture.native.verify).
        """
        if topic is None:
            topic = self.topic(table)
        source = self._source(m, table, ctx, index)
        convert = self.converter.envelope
        if m.kind is Kind.INSERT:
            after = self._image(table, m.columns)
            key = self.key_of(table, after)
            self._remember(table, topic, key, after, toastable=None if shape is None else shape.toastable)
            txn = self._transaction(table, ctx)
            return [Event(topic, key, convert(table, b"c", None, after, source, txn, now_ms, shape))]
        if m.kind is Kind.DELETE:
            before = self._image(table, m.identity)
            key = self.key_of(table, before)
            txn = self._transaction(table, ctx)
            if key is None:  # a keyless table's delete (the plugin sends none; be safe): no tombstone
                return [Event(topic, None, convert(table, b"d", before, None, source, txn, now_ms, shape))]
            self._forget(topic, key)
            deleted = convert(table, b"d", before, None, source, txn, now_ms, shape)
            return [Event(topic, key, deleted), Event(topic, key, None)]
        if m.kind is Kind.UPDATE:
            return self._update(m, table, topic, source, ctx, now_ms, shape)
        if m.kind is Kind.TRUNCATE:
            txn = self._transaction(table, ctx)
            self.toast.drop_topic(topic)
            return [Event(topic, None if table.keyless else TRUNCATE_KEY,
                          convert(table, b"t", None, None, source, txn, now_ms))]  # fmt: skip
        raise ValueError(f"not a row change: {m.kind}")

    def _update(
        self, m: ChangeMessage, table: TableInfo, topic: str, source: bytes, ctx: TxnContext, now_ms: int,
        shape: Shape | None,
    ) -> list[Event]:  # fmt: skip
        convert = self.converter.envelope
        after = self._image(table, m.columns)
        identity = self._image(table, m.identity) if m.identity else None
        old_key = self.key_of(table, identity if identity is not None else after)
        # ``before`` of a ``u`` is the old row only under REPLICA IDENTITY FULL (Debezium's rule);
        # otherwise the identity holds just the old key, which decides whether the key changed.
        full_before = identity if table.replica_identity == "f" else None
        # unchanged TOASTed values: the columns the table had at the change that the UPDATE lacks
        columns = table.toastable_columns if shape is None else shape.names
        missing = [c for c in columns if c not in after and self._kept(table, c)]
        if missing and old_key is not None:
            self._fill_toast(topic, old_key, after, full_before, missing, None if shape is None else shape.aliases)
        key = self.key_of(table, after)
        txn = self._transaction(table, ctx)
        toastable = None if shape is None else shape.toastable
        if key == old_key or key is None:
            self._remember(table, topic, key, after, update=True, toastable=toastable)
            return [Event(topic, key, convert(table, b"u", full_before, after, source, txn, now_ms, shape))]
        assert old_key is not None
        self._forget(topic, old_key)
        self._remember(table, topic, key, after, toastable=toastable)
        # The delete of a key change carries the old image the replica identity provides (the
        # old key columns at least), as a plain DELETE does.
        before = identity
        to_new: list[tuple[str, bytes | None]] = [(NEWKEY_HEADER, key)]
        from_old: list[tuple[str, bytes | None]] = [(OLDKEY_HEADER, old_key)]
        # two events, each counted in the transaction metadata (total_order, data_collection_order, END's
        # event_count), as Debezium counts them
        created_txn = self._transaction(table, ctx)
        return [
            Event(topic, old_key, convert(table, b"d", before, None, source, txn, now_ms, shape), to_new),
            Event(topic, old_key, None, to_new),
            Event(topic, key, convert(table, b"c", None, after, source, created_txn, now_ms, shape), from_old),
        ]

    def _kept(self, table: TableInfo, column: str) -> bool:
        return self.filter.column_action(table.schema, table.name, column) != "drop"

    def _fill_toast(
        self, topic: str, key: bytes, after: dict[str, Any], before: dict[str, Any] | None, missing: list[str],
        aliases: dict[str, tuple[str, ...]] | None = None,
    ) -> None:  # fmt: skip
        """Each missing column from the first that has it: the old row (REPLICA IDENTITY FULL), the TOAST cache,
        the key state; under its name or an earlier one (``aliases``: RENAME COLUMN); else the placeholder."""
        cached: Any = _NOT_FOUND  # looked up once, when a column needs it
        stored: Any = _NOT_FOUND
        for c in missing:
            names = (c, *aliases[c]) if aliases and c in aliases else (c,)
            found = _find(before, names)
            if found is _NOT_FOUND:
                if cached is _NOT_FOUND:
                    cached = self.toast.get(topic, key)
                found = _find(cached, names)
            if found is _NOT_FOUND:
                if stored is _NOT_FOUND:
                    stored = self.keystate.toast(topic, key)
                found = _find(stored, names)
            if found is _NOT_FOUND:
                after[c] = UNAVAILABLE
                self.unavailable_filled += 1
            else:
                after[c] = found

    def _remember(
        self, table: TableInfo, topic: str, key: bytes | None, after: dict[str, Any], *, update: bool = False,
        value_bytes: int | None = None, toastable: frozenset[str] | None = None,
    ) -> None:  # fmt: skip
        """Record the key as live, with the TOAST-able values of rows big enough to have been TOASTed at all.

        The row's size is judged by its TOAST-able (variable-length) columns alone: the
        others are a few bytes each, far below the threshold's margin. An update of a small
        row changes nothing in the key state (the key is live already, and a value that is
        stored inline is never omitted from a later update).
        """
        if key is None:
            return  # keyless: nothing to fill or truncate by key
        values = self.toast_values(table, after, value_bytes, toastable)
        if values is None:
            self.toast.drop(topic, key)  # a small row is stored inline: nothing to fill later
            if not update:
                self.keystate.put(topic, key, None)
            return
        self.toast.put(topic, key, values)
        self.keystate.put(topic, key, values)

    def _forget(self, topic: str, key: bytes) -> None:
        self.toast.drop(topic, key)
        self.keystate.delete(topic, key)

    def truncate_tombstones(self, table: TableInfo) -> Iterator[list[Event]]:
        """After a TRUNCATE's ``t`` event: a tombstone for every live key of the table's topic, in chunks."""
        if table.keyless:
            return
        topic = self.topic(table)
        for keys in self.keystate.truncated_keys(topic):  # key order: the same after any crash
            yield [Event(topic, key, None) for key in keys if key != TRUNCATE_KEY]
        self.keystate.truncate(topic)

    def recovered_delete(self, table: TableInfo, key: bytes, ctx: TxnContext, index: int, now_ms: int) -> list[Event]:
        """A row gone from the table while no change could be streamed (capture.recovery): its ``d`` event
        and tombstone. ``before``: the key columns (JSON keys; null with Avro, whose keys are not decoded)."""
        topic = self.topic(table)
        self._forget(topic, key)
        before = self.converter.key_image(table, key)
        source = self._source(None, table, ctx, index)
        value = self.converter.envelope(table, b"d", before, None, source, None, now_ms)
        return [Event(topic, key, value), Event(topic, key, None)]

    def outbox(self, table: TableInfo, topic_prefix: str, image: dict[str, Any], ctx: TxnContext, index: int) -> Event:
        """An inserted row of the outbox table → the event on ``<topic_prefix>.<stream_type>``."""
        missing = [c for c in OUTBOX_COLUMNS if c not in image]
        if missing:
            raise ConfigError(
                f"outbox table {table.qualified} lacks column(s) {', '.join(missing)} "
                f"(needs {', '.join(OUTBOX_COLUMNS)}: create it with `tideline db upgrade`)"
            )
        stream_type, stream_id, event_type = image["stream_type"], image["stream_id"], image["event_type"]
        if not isinstance(stream_type, str) or not isinstance(stream_id, str) or not isinstance(event_type, str):
            raise ConfigError(f"outbox table {table.qualified}: stream_type, stream_id and event_type must be text")
        value = {c: image[c] for c in OUTBOX_VALUE_COLUMNS if c in image}
        value["source"] = {"commit_lsn": ctx.commit_lsn, "event_index": index, "txId": ctx.xid, "ts_ms": ctx.ts_ms}
        return Event(
            outbox_topic(topic_prefix, stream_type),
            stream_id.encode(),
            dumps_values(value),
            [("event_type", event_type.encode()), ("id", str(image.get("id")).encode())],
        )

    def message(self, m: ChangeMessage, ctx: TxnContext, index: int, now_ms: int) -> Event:
        source = self._source(m, None, ctx, index)
        value = dumps(
            {
                "op": "m",
                "ts_ms": now_ms,
                "source": orjson.Fragment(source),
                "message": {"prefix": m.prefix, "content": m.content or b""},
                "transaction": {"id": f"{ctx.xid}:{ctx.commit_lsn}"} if ctx.xid is not None else None,
            }
        )
        return Event(self.message_topic, dumps({"prefix": m.prefix}), value)

    def schema_change(self, ddl: DdlMessage, m: ChangeMessage, ctx: TxnContext, index: int, now_ms: int) -> Event:
        """The schema change event of one DDL on a captured table (capture.schema_changes)."""
        source = self._source(m, TableName(ddl.schema, ddl.table, ddl.qualified), ctx, index)

        def keep(column: str) -> bool:
            return self.filter.column_action(ddl.schema, ddl.table, column) != "drop"

        value = dumps({
            "source": orjson.Fragment(source), "ts_ms": now_ms, "databaseName": self.db, "schemaName": ddl.schema,
            "ddl": ddl.ddl, "tableChanges": [table_change(ddl, keep)],
        })  # fmt: skip
        return Event(self.schema_changes_topic, dumps({"table": ddl.qualified}), value)

    def transaction_begin(self, ctx: TxnContext) -> Event:
        txn_id = f"{ctx.xid}:{ctx.commit_lsn}"
        value = dumps(
            {"status": "BEGIN", "id": txn_id, "ts_ms": ctx.ts_ms, "event_count": None, "data_collections": None}
        )
        return Event(self.transaction_topic, dumps({"id": txn_id}), value)

    def transaction_end(self, ctx: TxnContext) -> Event:
        txn_id = f"{ctx.xid}:{ctx.commit_lsn}"
        counts = ctx.per_table or {}
        value = dumps(
            {
                "status": "END",
                "id": txn_id,
                "ts_ms": ctx.ts_ms,
                "event_count": sum(counts.values()),
                "data_collections": [{"data_collection": t, "event_count": n} for t, n in sorted(counts.items())],
            }
        )
        return Event(self.transaction_topic, dumps({"id": txn_id}), value)


class TableName(NamedTuple):
    """A table by name alone (what :meth:`EventEncoder._source` reads of a table), for one the catalog may not
    have: a schema change event's (the table may be dropped)."""

    schema: str
    name: str
    qualified: str


_NOT_FOUND: Any = object()


def _find(source: dict[str, Any] | None, names: tuple[str, ...]) -> Any:
    """The value of the first of ``names`` that ``source`` has (``_NOT_FOUND``: none)."""
    if source is not None:
        for name in names:
            if name in source:
                return source[name]
    return _NOT_FOUND


def outbox_topic(topic_prefix: str, stream_type: str) -> str:
    """The topic of an outbox event: ``<prefix>.<stream_type>``."""
    return f"{topic_prefix}.{stream_type}"
