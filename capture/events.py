"""Change messages → Debezium-compatible change events (key, value, topic).

Value (JSON, UTF-8, one envelope per record; DESIGN.md §2)::

    {"before": {...} | null, "after": {...} | null, "op": "c|u|d|r|t|m", "ts_ms": <capture time>,
     "source": {"version", "connector": "postgresql", "name": <prefix>, "ts_ms": <commit time>,
                "snapshot": "false|true|last", "db", "schema", "table", "txId", "lsn",
                "commit_lsn", "event_index"},
     "transaction": {"id": "<txId>:<commit_lsn>", "total_order", "data_collection_order"} | null}

Key: JSON ``{<key column>: value, …}`` in key order (see capture.tables for which columns).
Values are converted by capture.pgtypes (its table lists every type's JSON form).

Rules, Debezium's unless noted:

* DELETE → the ``d`` event, then a **tombstone** (same key, null value).
* UPDATE that changes the key → ``d`` (old key) + tombstone (old key) + ``c`` (new key).
  The ``d`` event and its tombstone carry the header ``__debezium.newkey`` (the new
  key), the ``c`` event ``__debezium.oldkey`` (the old key), as Debezium writes them;
  the three events also share ``source.event_index``.
* TRUNCATE → a ``t`` event with key ``{}`` (the whole table), then a tombstone for every
  key still live in the table's topic (ours: so that compaction, and "latest value per
  key", forget truncated rows as they forget deleted ones).
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
  {"prefix", "content": base64}}``, keyed by prefix.
* **Unchanged TOAST columns** (wal2json omits them from an UPDATE): filled from the old
  row image when the table has REPLICA IDENTITY FULL, else from the key's last known
  image (an LRU cache of the TOAST-able columns of rows over 1 KB — smaller rows are
  never TOASTed — bounded in bytes, and on a miss the
  key's latest value in the log), else set to the marker
  :data:`UNAVAILABLE` (Debezium's ``__debezium_unavailable_value``).

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from capture.avro import UNAVAILABLE, AvroEncoder
from capture.messages import ChangeMessage, Column, Kind
from capture.pgtypes import dumps, dumps_values
from capture.tables import TableFilter, TableInfo
from eventstore.errors import ConfigError

NEWKEY_HEADER = "__debezium.newkey"  # on the d event (and tombstone) of a key change: the new key
OLDKEY_HEADER = "__debezium.oldkey"  # on its c event: the old key

# The outbox table's columns (commands/schema.py creates it): what routing needs, and what the value carries.
OUTBOX_COLUMNS = ("stream_id", "stream_type", "version", "event_type", "payload")
OUTBOX_VALUE_COLUMNS = (
    "id", "stream_id", "stream_type", "version", "event_type", "schema_version", "payload", "metadata", "recorded_at",
)  # fmt: skip

__all__ = ["OUTBOX_COLUMNS", "UNAVAILABLE", "Event", "EventBuilder", "ToastCache", "TxnContext", "table_topic"]
# Postgres TOASTs a row only when it exceeds TOAST_TUPLE_THRESHOLD (≈ 2 KB by default), so
# smaller rows are never cached (a table with a lower toast_tuple_target falls back to the log).
TOAST_MIN_ROW_BYTES = 1024
ENTRY_OVERHEAD = 400  # Python objects per cache entry (dict, tuple, key), for the byte bound
VERSION = "tideline-0.1"


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
    snapshot: str = "false"  # "true" / "last" for snapshot reads
    total_order: int = 0
    per_table: dict[str, int] | None = None
    source_prefix: dict[str, bytes] = field(default_factory=dict)  # rendered once per table


def table_topic(prefix: str, schema: str, table: str) -> str:
    return f"{prefix}.{schema}.{table}"


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
            if isinstance(v, (str, bytes)):
                total += len(v)
            elif isinstance(v, (dict, list)):
                total += len(dumps(v))
            else:
                total += 16
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

    def drop_topic(self, topic: str) -> None:
        for k in [k for k in self._entries if k[0] == topic]:
            self.drop(*k)


class EventBuilder:
    """Builds the events of change messages for one connector."""

    def __init__(
        self,
        prefix: str,
        db: str,
        table_filter: TableFilter,
        toast_cache: ToastCache,
        latest_in_log: Callable[[TableInfo, str, bytes], dict[str, Any] | None],
        live_keys_in_log: Callable[[str], list[bytes]],
        avro: AvroEncoder | None = None,
    ) -> None:
        self.avro = avro  # None: JSON keys and values (the default value format)
        self.prefix = prefix
        self.db = db
        self.filter = table_filter
        self.toast = toast_cache
        self.latest_in_log = latest_in_log
        self.live_keys_in_log = live_keys_in_log
        self.message_topic = f"{prefix}.message"
        self.transaction_topic = f"{prefix}.transaction"
        self.unavailable_filled = 0

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

    def key_of(self, table: TableInfo, image: dict[str, Any]) -> bytes:
        if self.avro is not None:
            return self.avro.key(table, image)
        return dumps_values({k: image.get(k) for k in table.key})

    def _source(self, m: ChangeMessage | None, table: TableInfo | None, ctx: TxnContext, index: int) -> bytes:
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
                "schema": table.schema if table else None,
                "table": table.name if table else None,
                "txId": ctx.xid,
                "commit_lsn": ctx.commit_lsn,
            }
            prefix = ctx.source_prefix[name] = dumps(shared)[:-1]
        lsn = m.lsn if m is not None else ctx.commit_lsn
        return prefix + b',"lsn":%d,"event_index":%d}' % (lsn, index)

    def count(self, table: TableInfo, ctx: TxnContext) -> int:
        """Count one change of ``table`` in its transaction; its order within the table."""
        ctx.total_order += 1
        if ctx.per_table is None:
            ctx.per_table = {}
        n = ctx.per_table[table.qualified] = ctx.per_table.get(table.qualified, 0) + 1
        return n

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

    def _envelope(
        self,
        table: TableInfo,
        op: bytes,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        transaction: bytes | None,
        now_ms: int,
    ) -> bytes:
        """The envelope, concatenated from its JSON parts (the same JSON as one ``dumps`` of it, faster)."""
        if self.avro is not None:
            return self.avro.envelope(table, op.decode(), before, after, source, transaction, now_ms)
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

    # ------------------------------------------------------------------ events

    def snapshot_read(self, table: TableInfo, columns: list[Column], ctx: TxnContext, index: int, now_ms: int) -> Event:
        topic = table_topic(self.prefix, table.schema, table.name)
        after = self._image(table, columns)
        key = self.key_of(table, after)
        self._remember(table, topic, key, after)
        value = self._envelope(table, b"r", None, after, self._source(None, table, ctx, index), None, now_ms)
        return Event(topic, key, value)

    def change(self, m: ChangeMessage, table: TableInfo, ctx: TxnContext, index: int, now_ms: int) -> list[Event]:
        topic = table_topic(self.prefix, table.schema, table.name)
        source = self._source(m, table, ctx, index)
        if m.kind is Kind.INSERT:
            after = self._image(table, m.columns)
            key = self.key_of(table, after)
            self._remember(table, topic, key, after)
            txn = self._transaction(table, ctx)
            return [Event(topic, key, self._envelope(table, b"c", None, after, source, txn, now_ms))]
        if m.kind is Kind.DELETE:
            before = self._image(table, m.identity)
            key = self.key_of(table, before)
            self.toast.drop(topic, key)
            txn = self._transaction(table, ctx)
            return [
                Event(topic, key, self._envelope(table, b"d", before, None, source, txn, now_ms)),
                Event(topic, key, None),
            ]
        if m.kind is Kind.UPDATE:
            return self._update(m, table, topic, source, ctx, now_ms)
        if m.kind is Kind.TRUNCATE:
            return self._truncate(table, topic, source, ctx, now_ms)
        raise ValueError(f"not a row change: {m.kind}")

    def _update(
        self, m: ChangeMessage, table: TableInfo, topic: str, source: bytes, ctx: TxnContext, now_ms: int
    ) -> list[Event]:
        after = self._image(table, m.columns)
        identity = self._image(table, m.identity) if m.identity else None
        old_key = self.key_of(table, identity if identity is not None else after)
        # ``before`` is the old row only under REPLICA IDENTITY FULL (Debezium's rule); otherwise
        # the identity holds just the old key, which decides whether the key changed.
        before = identity if table.replica_identity == "f" else None
        missing = [c for c in table.toastable_columns if c not in after and self._kept(table, c)]
        if missing:
            self._fill_toast(table, topic, old_key, after, before, missing)
        key = self.key_of(table, after)
        self._remember(table, topic, key, after)
        txn = self._transaction(table, ctx)
        if key == old_key:
            return [Event(topic, key, self._envelope(table, b"u", before, after, source, txn, now_ms))]
        self.toast.drop(topic, old_key)
        to_new: list[tuple[str, bytes | None]] = [(NEWKEY_HEADER, key)]
        from_old: list[tuple[str, bytes | None]] = [(OLDKEY_HEADER, old_key)]
        return [
            Event(topic, old_key, self._envelope(table, b"d", before, None, source, txn, now_ms), to_new),
            Event(topic, old_key, None, to_new),
            Event(topic, key, self._envelope(table, b"c", None, after, source, txn, now_ms), from_old),
        ]

    def _kept(self, table: TableInfo, column: str) -> bool:
        return self.filter.column_action(table.schema, table.name, column) != "drop"

    def _fill_toast(
        self,
        table: TableInfo,
        topic: str,
        key: bytes,
        after: dict[str, Any],
        before: dict[str, Any] | None,
        missing: list[str],
    ) -> None:
        known: dict[str, Any] | None = None
        if before is not None and all(c in before for c in missing):
            known = before  # REPLICA IDENTITY FULL: the old row has them
        if known is None:
            known = self.toast.get(topic, key)
        if known is None or not all(c in known for c in missing):
            known = self.latest_in_log(table, topic, key)
        for c in missing:
            if known is not None and c in known:
                after[c] = known[c]
            else:
                after[c] = UNAVAILABLE
                self.unavailable_filled += 1

    def _remember(self, table: TableInfo, topic: str, key: bytes, after: dict[str, Any]) -> None:
        """Cache the TOAST-able values of rows big enough to have been TOASTed at all.

        The row's size is judged by its TOAST-able (variable-length) columns alone: the
        others are a few bytes each, far below the threshold's margin.
        """
        cols = table.toastable_columns
        if not cols:
            return
        values = {c: after[c] for c in cols if c in after and after[c] != UNAVAILABLE}
        if ToastCache.size_of(values) < TOAST_MIN_ROW_BYTES:
            self.toast.drop(topic, key)  # a small row is stored inline: nothing to fill later
            return
        self.toast.put(topic, key, values)

    def _truncate(self, table: TableInfo, topic: str, source: bytes, ctx: TxnContext, now_ms: int) -> list[Event]:
        txn = self._transaction(table, ctx)
        events = [Event(topic, b"{}", self._envelope(table, b"t", None, None, source, txn, now_ms))]
        events += [Event(topic, key, None) for key in self.live_keys_in_log(topic) if key != b"{}"]
        self.toast.drop_topic(topic)
        return events

    def outbox(self, table: TableInfo, topic_prefix: str, image: dict[str, Any], ctx: TxnContext, index: int) -> Event:
        """An inserted row of the outbox table → the event on ``<topic_prefix>.<stream_type>`` (see capture.outbox)."""
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
            f"{topic_prefix}.{stream_type}",
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
        return Event(self.message_topic, dumps(m.prefix), value)

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
