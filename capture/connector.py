"""The CDC connector: snapshot, then stream, into the log — exactly once.

**Exactly once into the log.** Events go into the log through one transactional producer
(``transactional_id = capture.<prefix>.<slot>``). Every log transaction carries, besides
the events, one record on the compacted topic ``__tideline_capture_offsets`` (key: the
connector) holding the *source position* of the last event in it: ``(commit_lsn,
event_index)`` plus whether that Postgres transaction is complete. Events and position
commit atomically (Kafka Connect's offsets topic, made transactional). A log transaction
spans many Postgres transactions and, for a huge Postgres transaction, ends in the
middle of it (memory stays bounded). It commits at a transaction boundary once it is
``linger_ms`` old and the next message has not arrived yet (caught up: latency is about
``linger_ms`` plus one commit), or once it is ``max_linger_ms`` old while messages keep
waiting (behind: one commit's fixed cost — a dozen fsyncs — is spread over more
events), or when it holds ``batch_bytes``, or when the stream is idle.

On (re)start the connector reads its position (read_committed), starts replication at
the slot's confirmed position, and skips every event at or before the stored position:
the server may resend a whole transaction, never less. ``init_transactions`` first
aborts whatever a killed predecessor left open. Postgres learns a new ``flush_lsn`` (the
slot may then recycle WAL) only for commit ends of transactions whose log transaction
has committed, never mid-transaction (the server would resend the whole transaction
anyway). While captured tables are idle, the keepalive's WAL end is confirmed when no
transaction is in flight (so WAL does not pile up); an optional heartbeat query writes
to the source so that such confirmations happen at all on a database with no traffic.

**Snapshot** (``initial`` when no position is stored yet, ``always``, ``when_needed``
when the position or the slot is unusable, ``never``): the slot is created with an
exported snapshot; every captured table is read in that snapshot (``REPEATABLE READ``,
``SET TRANSACTION SNAPSHOT``, a server-side cursor, values as text converted like the
stream's) and emitted as ``op=r`` events inside **one** log transaction that ends with
the position "snapshot done at the slot's consistent point". A crash during the snapshot
leaves that transaction open: the next start aborts it (read_committed consumers never
see a partial snapshot), drops the slot the interrupted snapshot created, and starts
over.

Topics: ``<prefix>.<schema>.<table>`` (compacted, created on first sight),
``<prefix>.transaction`` (BEGIN/END with per-table counts, when ``transaction_metadata``
is on), ``<prefix>.message``
(logical messages). Values and keys: see capture.events.

Failures: a dropped connection or a Postgres restart → the open log transaction is
aborted, and the connector reconnects with exponential backoff (0.5 s … 30 s) and
resumes from the stored position. A missing slot, or a slot whose WAL was recycled past
the stored position → :class:`SlotLostError`, which says to restart with
``--snapshot when_needed``. A payload that cannot be decoded, or a table without a key
→ the connector stops; nothing partial is visible.

Thread-safety: one connector runs in one thread; ``stop()`` may be called from another
thread or a signal handler.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from capture.avro import AvroEncoder
from capture.events import Event, EventBuilder, ToastCache, TxnContext, table_topic
from capture.messages import ChangeMessage, Column, DecodeError, Kind, Plugin
from capture.pgtypes import SESSION_OPTIONS, JsonNumber
from capture.replication import Keepalive, ReplicationConnection, XLogData, format_lsn, parse_lsn
from capture.tables import TableCatalog, TableFilter, TableInfo, result_rows, select_columns_sql
from capture.wal2json import Wal2JsonDecoder
from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import ConfigError, TidelineError, TopicExistsError
from eventstore.log import Log
from eventstore.partitioner import partitions_for_keys
from eventstore.producer import Producer
from eventstore.schema_store import LogSchemaStore
from eventstore.topic import TopicConfig, now_ms, validate_topic_name
from schemas.registry import SchemaRegistry

log = logging.getLogger(__name__)

OFFSETS_TOPIC = "__tideline_capture_offsets"
SNAPSHOT_FETCH_ROWS = 5_000
MAX_BACKOFF_S = 30.0
WAL_CHECK_S = 30.0


class SnapshotMode(enum.Enum):
    INITIAL = "initial"
    ALWAYS = "always"
    NEVER = "never"
    WHEN_NEEDED = "when_needed"

    @classmethod
    def parse(cls, text: str) -> SnapshotMode:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"--snapshot must be one of initial, always, never, when_needed; not {text!r}") from None


class ValueFormat(enum.Enum):
    JSON = "json"
    AVRO = "avro"

    @classmethod
    def parse(cls, text: str) -> ValueFormat:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"--value-format must be json or avro, not {text!r}") from None


class SlotLostError(TidelineError):
    """The replication slot is gone, or no longer holds the WAL after our stored position."""


@dataclass(slots=True)
class CaptureConfig:
    dsn: str
    slot: str = "tideline"
    topic_prefix: str = "tideline"
    plugin: Plugin = Plugin.WAL2JSON
    snapshot: SnapshotMode = SnapshotMode.INITIAL
    table_filter: TableFilter = field(default_factory=TableFilter)
    partitions: int = 1
    batch_bytes: int = 4 << 20
    linger_ms: int = 10  # caught up: commit a batch this old at the first gap in the stream
    max_linger_ms: int = 50  # messages waiting (behind): let the batch grow this long
    status_interval_s: float = 1.0
    heartbeat_query: str | None = None
    heartbeat_interval_s: float = 10.0
    retained_wal_warn_bytes: int = 1 << 30
    toast_cache_bytes: int = 64 << 20
    exit_when_caught_up: bool = False
    # BEGIN/END records on <prefix>.transaction (Debezium's provide.transaction.metadata, off
    # by default there too): one more partition in every log transaction, two events per
    # Postgres transaction. Events carry their ``transaction`` block either way.
    transaction_metadata: bool = False
    value_format: ValueFormat = ValueFormat.JSON  # avro: table topics through the schema registry (capture.avro)
    # Outbox routing (capture.events): rows inserted into this table ("schema.table", e.g. the
    # commands' "public.events") become records on <outbox_topic_prefix>.<stream_type>.
    outbox_table: str | None = None
    outbox_topic_prefix: str = "events"

    def validate(self) -> None:
        validate_topic_name(f"{self.topic_prefix}.transaction")
        if not self.slot.replace("_", "").isalnum() or self.slot.lower() != self.slot:
            raise ConfigError(f"slot name {self.slot!r}: use lower-case letters, digits and _")
        if self.plugin is not Plugin.WAL2JSON:
            raise ConfigError(f"plugin {self.plugin.value} is not implemented yet (wal2json is)")
        if self.partitions < 1 or self.batch_bytes < 1 or self.linger_ms < 0:
            raise ConfigError("partitions and batch_bytes must be ≥ 1, linger_ms ≥ 0")
        if self.outbox_table is not None:
            validate_topic_name(f"{self.outbox_topic_prefix}.x")
            if self.outbox_table.count(".") != 1:
                raise ConfigError(f"outbox table {self.outbox_table!r}: write it as schema.table (e.g. public.events)")
        if self.max_linger_ms < self.linger_ms:
            raise ConfigError(f"max_linger_ms ({self.max_linger_ms}) must be ≥ linger_ms ({self.linger_ms})")


@dataclass(frozen=True, slots=True)
class Position:
    """How far the log is, in source terms: up to ``event_index`` of the transaction committed at ``commit_lsn``."""

    commit_lsn: int
    event_index: int
    complete: bool  # the whole transaction is stored
    confirm_lsn: int  # the last commit end whose transaction is wholly stored (what the slot may confirm)
    snapshot_done: bool = True

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "commit_lsn": self.commit_lsn,
                "event_index": self.event_index,
                "complete": self.complete,
                "confirm_lsn": self.confirm_lsn,
                "snapshot_done": self.snapshot_done,
                "commit_lsn_text": format_lsn(self.commit_lsn),
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Position:
        d = orjson.loads(raw)
        return cls(int(d["commit_lsn"]), int(d["event_index"]), bool(d["complete"]), int(d["confirm_lsn"]),
                   bool(d.get("snapshot_done", True)))  # fmt: skip

    def covers(self, commit_lsn: int, index: int) -> bool:
        """Whether the event ``(commit_lsn, index)`` is already stored."""
        if commit_lsn != self.commit_lsn:
            return commit_lsn < self.commit_lsn
        return self.complete or index <= self.event_index


@dataclass(slots=True)
class Stats:
    events: int = 0
    transactions: int = 0
    batches: int = 0
    snapshot_rows: int = 0
    last_commit_ts_ms: int = 0
    last_stored_lsn: int = 0
    server_wal_end: int = 0
    outbox_violations: int = 0  # updates/deletes/truncates of outbox rows seen (and not routed)
    retained_wal_bytes: int = -1  # the slot's, at the last check (WAL_CHECK_S); -1: not checked yet
    started: float = field(default_factory=time.monotonic)

    stored_lag_ms: int = 0  # when the last position was stored: that moment − its transaction's commit time

    def lag_ms(self) -> int:
        """Debezium's MilliSecondsBehindSource: how long after its commit the last stored change was stored."""
        return self.stored_lag_ms

    def lag_bytes(self) -> int:
        return max(0, self.server_wal_end - self.last_stored_lsn)

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "transactions": self.transactions,
            "batches": self.batches,
            "snapshot_rows": self.snapshot_rows,
            "events_per_s": round(self.events / max(1e-9, time.monotonic() - self.started), 1),
            "last_stored_lsn": format_lsn(self.last_stored_lsn),
            "lag_ms": self.lag_ms(),
            "lag_bytes": self.lag_bytes(),
            "outbox_violations": self.outbox_violations,
        }


class _Batch:
    """Events waiting for the next log commit, per topic, in order."""

    def __init__(self) -> None:
        self.keys: dict[str, list[bytes | None]] = {}
        self.values: dict[str, list[bytes | None]] = {}
        self.headers: dict[str, list[list[tuple[str, bytes | None]] | None]] = {}  # topics with any headers
        self.bytes = 0
        self.events = 0
        self.started = 0.0

    def add(self, e: Event) -> None:
        if not self.events:
            self.started = time.monotonic()
        keys = self.keys.setdefault(e.topic, [])
        if e.headers is not None and e.topic not in self.headers:
            self.headers[e.topic] = [None] * len(keys)
        keys.append(e.key)
        self.values.setdefault(e.topic, []).append(e.value)
        if e.topic in self.headers:
            self.headers[e.topic].append(e.headers)
        self.bytes += (len(e.key) if e.key else 0) + (len(e.value) if e.value else 0) + 24
        self.events += 1

    def clear(self) -> None:
        self.keys.clear()
        self.values.clear()
        self.headers.clear()
        self.bytes = self.events = 0


class Connector:
    """One capture connector: ``run()`` until stopped (or caught up)."""

    def __init__(self, config: CaptureConfig, log_: Log) -> None:
        config.validate()
        self.config = config
        self.log = log_
        self.stats = Stats()
        self._stop = threading.Event()
        self.catalog = TableCatalog(config.dsn, config.table_filter)
        self.decoder = Wal2JsonDecoder()
        self.key = orjson.dumps({"connector": config.topic_prefix, "slot": config.slot})
        self.producer: Producer | None = None
        self.position: Position | None = None
        self._known_topics: set[str] = set()
        self._batch = _Batch()
        self._batch_position: Position | None = None
        self._in_txn = False
        self._wal_checked = 0.0
        self._status_logged = 0.0
        db = psycopg.conninfo.conninfo_to_dict(config.dsn).get("dbname") or "postgres"
        self.avro: AvroEncoder | None = None
        if config.value_format is ValueFormat.AVRO:
            self.avro = AvroEncoder(SchemaRegistry(LogSchemaStore(log_)), config.topic_prefix, config.table_filter)
        self.builder = EventBuilder(
            config.topic_prefix,
            str(db),
            config.table_filter,
            ToastCache(config.toast_cache_bytes),
            self._latest_in_log,
            self._live_keys_in_log,
            self.avro,
        )

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Ask ``run`` to finish the current batch, confirm and return."""
        self._stop.set()

    def run(self) -> Stats:
        """Snapshot if needed, then stream; reconnect on connection failures."""
        backoff = 0.5
        self._ensure_topic(OFFSETS_TOPIC, compact=True, partitions=1)
        try:
            while not self._stop.is_set():
                try:
                    self._run_once()
                    return self.stats
                except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                    self._abort_open()
                    if self._stop.is_set():
                        break
                    log.warning("capture: connection lost (%s); reconnecting in %.1f s", str(e).strip(), backoff)
                    self._stop.wait(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
                except BaseException:
                    self._abort_open()
                    raise
            return self.stats
        finally:
            if self.producer is not None:
                self.producer.close()
                self.producer = None

    def _producer(self) -> Producer:
        if self.producer is None:
            tid = f"capture.{self.config.topic_prefix}.{self.config.slot}"
            self.producer = Producer(self.log, transactional_id=tid, linger_ms=0)
            self.producer.init_transactions()  # aborts what a killed predecessor left open
        return self.producer

    def _abort_open(self) -> None:
        self._batch.clear()
        self._batch_position = None
        if self.producer is not None and self._in_txn:
            try:
                self.producer.abort_transaction()
            except TidelineError as e:
                log.warning("capture: abort after failure failed (%s); the next start aborts it", e)
        self._in_txn = False

    # ------------------------------------------------------------------ position

    def read_position(self) -> Position | None:
        """The last committed source position (read_committed)."""
        if OFFSETS_TOPIC not in self.log.topics():
            return None
        found: Position | None = None
        with Consumer(self.log, enable_auto_commit=False) as consumer:
            consumer.assign([TopicPartition(OFFSETS_TOPIC, 0)])
            consumer.seek_to_beginning()
            while records := consumer.poll(timeout_ms=0):
                for batch in records.batches:
                    keys = batch.records.column(2)
                    values = batch.records.column(3)
                    mask = pc.equal(keys, pa.scalar(self.key, pa.binary()))
                    hits = values.filter(mask)
                    if len(hits):
                        last = hits[len(hits) - 1].as_py()
                        found = Position.from_json(last) if last is not None else None
        return found

    # ------------------------------------------------------------------ one connection

    def _run_once(self) -> None:
        self._producer()
        self.position = self.read_position()
        repl = ReplicationConnection(self.config.dsn)
        try:
            slot = self._slot_state()
            start_lsn = self._prepare_slot(repl, slot)
            if self._stop.is_set():
                return
            target = self._current_wal_lsn() if self.config.exit_when_caught_up else None
            repl.start(self.config.slot, start_lsn, self.decoder.slot_options())
            log.info(
                "capture: streaming slot %s from %s (stored position %s)",
                self.config.slot,
                format_lsn(start_lsn),
                self.position,
            )
            self._stream(repl, target)
        finally:
            repl.close()

    def _slot_state(self) -> dict[str, Any] | None:
        with psycopg.connect(self.config.dsn, autocommit=True) as c:
            row = c.execute(
                "SELECT plugin, confirmed_flush_lsn::text, restart_lsn::text, wal_status FROM pg_replication_slots "
                "WHERE slot_name = %s AND database = current_database()",
                (self.config.slot,),
            ).fetchone()
        if row is None:
            return None
        return {"plugin": row[0], "confirmed": row[1], "restart": row[2], "wal_status": row[3]}

    def _drop_slot(self) -> None:
        with psycopg.connect(self.config.dsn, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(%s)", (self.config.slot,))

    def _prepare_slot(self, repl: ReplicationConnection, slot: dict[str, Any] | None) -> int:
        """Create the slot and snapshot as the mode says; return where streaming starts."""
        mode = self.config.snapshot
        pos = self.position
        lost = slot is not None and slot["wal_status"] == "lost"
        if slot is not None and slot["plugin"] != self.config.plugin.value:
            raise ConfigError(f"slot {self.config.slot} uses plugin {slot['plugin']}, not {self.config.plugin.value}")
        interrupted = pos is not None and not pos.snapshot_done
        if slot is not None and pos is not None and not interrupted and not lost and mode is not SnapshotMode.ALWAYS:
            return 0  # the server resumes at the slot's confirmed position; we skip what is stored
        if slot is not None and pos is None and mode is SnapshotMode.INITIAL:
            raise ConfigError(
                f"slot {self.config.slot} exists but this connector stored no position: stream it without a "
                "snapshot (--snapshot never), take a new one (--snapshot when_needed), or drop the slot"
            )
        needs_snapshot = (
            mode is SnapshotMode.ALWAYS
            or interrupted
            or (pos is None and mode in (SnapshotMode.INITIAL, SnapshotMode.WHEN_NEEDED))
            or (mode is SnapshotMode.WHEN_NEEDED and (slot is None or lost))
        )
        if pos is not None and not interrupted and (slot is None or lost) and mode is not SnapshotMode.WHEN_NEEDED:
            what = "is missing" if slot is None else "lost the WAL after the stored position"
            raise SlotLostError(
                f"slot {self.config.slot} {what} (stored position {format_lsn(pos.commit_lsn)}): changes since then "
                "cannot be streamed; restart with --snapshot when_needed to take a new snapshot"
            )
        if not needs_snapshot:
            if slot is None:
                repl.create_slot(self.config.slot, self.config.plugin, export_snapshot=False)
                log.info("capture: created slot %s (no snapshot)", self.config.slot)
            return 0
        # Remember that a snapshot is under way (its own small transaction) *before* the slot
        # exists: if anything from here on is interrupted, the next start knows the slot is
        # ours to drop and re-create, and that the snapshot must be taken again.
        if pos is None or pos.snapshot_done:
            self._begin()
            self._batch_position = Position(0, -1, False, 0, snapshot_done=False)
            self._commit()
        if slot is not None:
            log.warning("capture: dropping slot %s to take a consistent snapshot (%s)", self.config.slot, mode.value)
            self._drop_slot()
        created = repl.create_slot(self.config.slot, self.config.plugin, export_snapshot=True)
        assert created.snapshot_name is not None
        self._snapshot(created.snapshot_name, created.consistent_point)
        return created.consistent_point

    def _current_wal_lsn(self) -> int:
        with psycopg.connect(self.config.dsn, autocommit=True) as c:
            row = c.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        return parse_lsn(row[0])

    # ------------------------------------------------------------------ snapshot

    def _snapshot(self, snapshot_name: str, consistent_point: int) -> None:
        """Every captured table in the exported snapshot, in one log transaction."""
        producer = self._producer()
        tables = self.catalog.load()
        ctx = TxnContext(None, consistent_point, now_ms(), snapshot="true")
        index = 0
        held: tuple[TableInfo, list[Column]] | None = None  # the latest read, emitted when the next one comes
        held_index = 0
        routed: set[Any] | None = None  # outbox event ids already in the events topics
        self._begin()
        # Values are read uncast in text format: the type's output function, as wal2json prints
        # it (``::text`` differs: char(n) padding, inet netmasks), under the same session settings.
        with psycopg.connect(self.config.dsn, options=SESSION_OPTIONS) as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            c.execute(f"SET TRANSACTION SNAPSHOT '{snapshot_name}'")
            for t_i, table in enumerate(tables):
                select = select_columns_sql(table)
                if table.qualified == self.config.outbox_table:
                    select += " ORDER BY " + ", ".join(f'"{k}"' for k in table.key)
                else:
                    self._ensure_topic(table_topic(self.config.topic_prefix, table.schema, table.name), compact=True)
                cursor = f"tideline_snapshot_{t_i}"
                c.execute(f"DECLARE {cursor} NO SCROLL CURSOR FOR {select}")
                while True:
                    res = c.execute(f"FETCH {SNAPSHOT_FETCH_ROWS} FROM {cursor}").pgresult
                    if res is None or res.ntuples == 0:
                        break
                    outbox = table.qualified == self.config.outbox_table
                    if outbox and routed is None:
                        routed = self._routed_outbox_ids()
                    for columns in result_rows(res, table):
                        if outbox:  # events already in the outbox: routed in key (id) order, once
                            image = {col.name: col.value for col in columns}
                            if routed and image.get("id") in routed:
                                index += 1
                                continue  # routed before (a new snapshot): the events topics keep every fact once
                            self._batch.add(self._outbox_event(table, image, ctx, index))
                        else:
                            if held is not None:  # one read held back: the last one says snapshot "last"
                                self._batch.add(self.builder.snapshot_read(*held, ctx, held_index, now_ms()))
                            held, held_index = (table, columns), index
                        index += 1
                        self.stats.snapshot_rows += 1
                    if self._batch.bytes >= self.config.batch_bytes:
                        self._send_batch(producer)  # appended, not committed: one transaction for all
                    if self._stop.is_set():
                        raise KeyboardInterrupt("stopped during the snapshot")
            if held is not None:
                last = TxnContext(None, consistent_point, ctx.ts_ms, snapshot="last")
                self._batch.add(self.builder.snapshot_read(*held, last, held_index, now_ms()))
            log.info("capture: snapshot of %d tables, %d rows", len(tables), index)
        # Transactions committing at or after the consistent point are streamed, not in the snapshot.
        self._batch_position = Position(consistent_point - 1, -1, True, consistent_point, snapshot_done=True)
        self._commit()

    # ------------------------------------------------------------------ stream

    def _stream(self, repl: ReplicationConnection, target: int | None) -> None:
        ctx: TxnContext | None = None
        index = 0
        last_heartbeat = time.monotonic()
        confirmed = self.position.confirm_lsn if self.position else 0
        while True:
            if self._stop.is_set():  # commit what we have (the position says how far, even mid-transaction)
                self._commit()
                self._confirm(repl)
                return
            age_ms = (time.monotonic() - self._batch.started) * 1000 if self._batch.events else 0.0
            linger_left = self.config.linger_ms - age_ms
            timeout = max(0.001, linger_left / 1000) if self._batch.events else 0.1
            msg = repl.read(timeout)
            if msg is None and target is not None and ctx is None and not self._batch.events:
                repl.send_status(confirmed, reply=True)  # ask for a keepalive: how far is the server?
            if msg is None or isinstance(msg, Keepalive):
                if self._batch.events and ctx is None and (msg is None or self._batch_due(repl)):
                    # idle (a read timed out) or the batch is due. A keepalive alone is no sign
                    # of idleness: under load the server sends one after nearly every transaction.
                    self._commit()
                if isinstance(msg, Keepalive):
                    self.stats.server_wal_end = max(self.stats.server_wal_end, msg.wal_end)
                    if ctx is None and not self._batch.events and not self._in_txn:
                        confirmed = max(confirmed, self._confirm(repl), msg.wal_end)
                        repl.send_status(confirmed)
                        if target is not None and msg.wal_end >= target:
                            return
                    elif msg.reply_requested:
                        repl.send_status(confirmed)
                now = time.monotonic()
                self._log_status()
                if self.config.heartbeat_query and now - last_heartbeat >= self.config.heartbeat_interval_s:
                    last_heartbeat = now
                    self._heartbeat()
                continue
            assert isinstance(msg, XLogData)
            self.stats.server_wal_end = max(self.stats.server_wal_end, msg.wal_end)
            for m in self.decoder.decode(msg.payload):
                if m.kind is Kind.BEGIN:
                    ctx = TxnContext(m.xid, m.lsn, m.timestamp_ms or 0, per_table={})
                    ctx_next = m.next_lsn or m.lsn
                    index = 0
                    if self.config.transaction_metadata and not self._stored(ctx.commit_lsn, -1):
                        self._add(self.builder.transaction_begin(ctx))
                    continue
                if m.kind is Kind.COMMIT:
                    if ctx is None:
                        raise DecodeError(f"COMMIT without BEGIN at {format_lsn(m.lsn)}")
                    if not self._stored(ctx.commit_lsn, 1 << 62):
                        if self.config.transaction_metadata:
                            self._add(self.builder.transaction_end(ctx))
                        self.stats.transactions += 1
                    self._batch_position = Position(ctx.commit_lsn, index - 1, True, m.next_lsn or ctx_next)
                    self.stats.last_commit_ts_ms = ctx.ts_ms
                    ctx = None
                    if target is not None and (m.next_lsn or 0) >= target:
                        self._commit()
                        self._confirm(repl)
                        return
                    continue
                if m.kind is Kind.MESSAGE and (not m.transactional or ctx is None):
                    one = TxnContext(None, m.lsn, now_ms())
                    if not self._stored(m.lsn, 0):
                        self._add(self.builder.message(m, one, 0, now_ms()))
                        self._batch_position = Position(m.lsn, 0, True, self._confirm_floor())
                    continue
                if ctx is None:
                    raise DecodeError(f"{m.kind.name} outside a transaction at {format_lsn(m.lsn)}")
                i = index
                index += 1
                if self._stored(ctx.commit_lsn, i):
                    self._count_skipped(m, ctx)  # stored before a restart: counts in the metadata all the same
                    continue
                for e in self._events_for(m, ctx, i):
                    self._add(e)
                self._batch_position = Position(ctx.commit_lsn, i, False, self._confirm_floor())
                if self._batch.bytes >= self.config.batch_bytes:
                    self._commit()  # mid-transaction: bounded memory; the position says how far
            if self._batch.events and (
                self._batch.bytes >= self.config.batch_bytes or (ctx is None and self._batch_due(repl))
            ):
                self._commit()
                confirmed = max(confirmed, self._confirm(repl))

    def _batch_due(self, repl: ReplicationConnection) -> bool:
        """At a transaction boundary: is the batch old enough to commit now? (see the module docstring)

        Past ``linger_ms`` it commits unless the next message is already waiting, and then
        at ``max_linger_ms`` at the latest. Measured on this 2-core machine: holding for up
        to 250 ms gave p99 ≈ 150 ms at a steady 10k changes/s (a waiting message is the
        normal case there); requiring the last transaction to be ≥ 100 ms old as well
        drained backlogs slower (more, smaller commits). 50 ms keeps both short.
        """
        age_ms = (time.monotonic() - self._batch.started) * 1000
        if age_ms < self.config.linger_ms:
            return False
        return age_ms >= self.config.max_linger_ms or not repl.pending()

    def _confirm_floor(self) -> int:
        """The confirm position carried by positions inside a transaction: the last complete one."""
        if self._batch_position is not None:
            return self._batch_position.confirm_lsn
        return self.position.confirm_lsn if self.position is not None else 0

    def _stored(self, commit_lsn: int, index: int) -> bool:
        return self.position is not None and self.position.snapshot_done and self.position.covers(commit_lsn, index)

    def _events_for(self, m: ChangeMessage, ctx: TxnContext, index: int) -> list[Event]:
        if m.kind is Kind.MESSAGE:
            self._ensure_topic(self.builder.message_topic, compact=False)
            return [self.builder.message(m, ctx, index, now_ms())]
        assert m.schema is not None and m.table is not None
        table = self.catalog.get(m.schema, m.table)
        if table is None:
            return []  # not captured
        table = self._check_columns(table, m)
        if table.qualified == self.config.outbox_table:
            return self._route_outbox(m, table, ctx, index)
        topic = table_topic(self.config.topic_prefix, table.schema, table.name)
        self._ensure_topic(topic, compact=True)
        return self.builder.change(m, table, ctx, index, now_ms())

    def _route_outbox(self, m: ChangeMessage, table: TableInfo, ctx: TxnContext, index: int) -> list[Event]:
        if m.kind is not Kind.INSERT:
            self.stats.outbox_violations += 1
            log.warning(
                "capture: outbox table %s is append-only, but a %s at %s changed it: not routed (%d so far)",
                table.qualified, m.kind.name, format_lsn(m.lsn), self.stats.outbox_violations,
            )  # fmt: skip
            return []
        self.builder.count(table, ctx)
        return [self._outbox_event(table, {c.name: c.value for c in m.columns}, ctx, index)]

    def _outbox_event(self, table: TableInfo, image: dict[str, Any], ctx: TxnContext, index: int) -> Event:
        event = self.builder.outbox(table, self.config.outbox_topic_prefix, image, ctx, index)
        self._ensure_topic(event.topic, compact=False, overrides={"retention_ms": "-1"})
        return event

    def _count_skipped(self, m: ChangeMessage, ctx: TxnContext) -> None:
        """Advance the transaction's counters past an event stored before a restart."""
        if m.kind is Kind.MESSAGE or m.schema is None or m.table is None:
            return
        table = self.catalog.get(m.schema, m.table)
        if table is not None and (table.qualified != self.config.outbox_table or m.kind is Kind.INSERT):
            self.builder.count(table, ctx)

    def _check_columns(self, table: TableInfo, m: ChangeMessage) -> TableInfo:
        """The table changed (ALTER TABLE) if a change has a column the catalog does not know, an
        INSERT lacks one (it carries every column), or, when the schema matters (Avro), a column
        has another type: read the catalog again."""
        known = table.column_names
        changed = (
            any(c.name not in known for c in m.columns)
            or any(c.name not in known for c in m.identity)
            or (m.kind is Kind.INSERT and len(m.columns) != len(known))
        )
        if not changed and self.avro is not None:
            types = table.column_types
            changed = any((c.name, c.type_oid) not in types for c in m.columns)
        if changed:
            refreshed = self.catalog.refresh(table.schema, table.name)
            if refreshed is not None:
                return refreshed
        return table

    def _add(self, e: Event) -> None:
        if not self._in_txn:
            self._begin()
        self._batch.add(e)
        self.stats.events += 1

    def _begin(self) -> None:
        self._producer().begin_transaction()
        self._in_txn = True

    def _send_batch(self, producer: Producer, *, extra: tuple[tuple[str, int], ...] = ()) -> None:
        partitions = set(extra)
        for topic, keys in self._batch.keys.items():
            n = self.log.topic(topic).partitions if topic in self._known_topics else self.config.partitions
            if n == 1:
                partitions.add((topic, 0))
            else:
                parts = set(partitions_for_keys(pa.array(keys, pa.binary()), n).tolist())
                partitions.update((topic, p) for p in (range(n) if -1 in parts else parts))
        producer.add_partitions_to_transaction(partitions)  # one coordinator write for all of them
        for topic, keys in self._batch.keys.items():
            self._ensure_topic(topic, compact=not topic.endswith((".transaction", ".message")))  # ensured before
            producer.send_batch(topic, self._batch.values[topic], keys, headers=self._batch.headers.get(topic))
        self._batch.clear()

    def _commit(self) -> None:
        """Append the batch and its position in the open log transaction, and commit it."""
        if not self._in_txn:
            return
        producer = self._producer()
        position = self._batch_position
        self._send_batch(producer, extra=((OFFSETS_TOPIC, 0),) if position is not None else ())
        if position is not None:
            producer.send_batch(OFFSETS_TOPIC, [position.to_json()], [self.key])
        producer.commit_transaction()
        self._in_txn = False
        self.stats.batches += 1
        if position is not None:
            self.position = position
            self.stats.last_stored_lsn = position.commit_lsn
            if self.stats.last_commit_ts_ms:
                self.stats.stored_lag_ms = max(0, now_ms() - self.stats.last_commit_ts_ms)
        self._batch_position = None
        self._log_status()

    def _confirm(self, repl: ReplicationConnection) -> int:
        """Tell the server what is durable: the last complete transaction's commit end."""
        lsn = self.position.confirm_lsn if self.position is not None else 0
        if lsn:
            repl.send_status(lsn)
        return lsn

    # ------------------------------------------------------------------ log helpers

    def _ensure_topic(
        self, topic: str, *, compact: bool, partitions: int | None = None, overrides: dict[str, str] | None = None
    ) -> None:
        if topic in self._known_topics:
            return
        if topic not in self.log.topics():
            config = TopicConfig()
            overrides = {**({"cleanup_policy": "compact"} if compact else {}), **(overrides or {})}
            try:
                self.log.create_topic(topic, partitions or self.config.partitions, config, overrides=overrides)
                log.info("capture: created topic %s", topic)
            except TopicExistsError:
                pass
        self._known_topics.add(topic)

    def _read_topic(self, topic: str) -> list[tuple[bytes | None, bytes | None]]:
        """Every (key, value) of a topic, read_committed, plus this batch's pending ones (oldest first)."""
        out: list[tuple[bytes | None, bytes | None]] = []
        if topic in self.log.topics():
            meta = self.log.topic(topic)
            with Consumer(self.log, enable_auto_commit=False) as consumer:
                consumer.assign([TopicPartition(topic, p) for p in range(meta.partitions)])
                consumer.seek_to_beginning()
                while records := consumer.poll(timeout_ms=0):
                    for b in records.batches:
                        out.extend(zip(b.records.column(2).to_pylist(), b.records.column(3).to_pylist(), strict=True))
        out.extend(zip(self._batch.keys.get(topic, []), self._batch.values.get(topic, []), strict=True))
        return out

    def _latest_in_log(self, table: TableInfo, topic: str, key: bytes) -> dict[str, Any] | None:
        """The key's last ``after`` image in the log (TOAST fill after a cache miss: rare, O(topic))."""
        latest: bytes | None = None
        for k, v in self._read_topic(topic):
            if k == key:
                latest = v
        if latest is None:
            return None
        if self.avro is not None and latest[:1] == b"\x00":
            return self.avro.after_image(table, latest)
        # Exact: fractions inside json/jsonb stay JsonNumber (written back as the same bare
        # number), integers stay ints of any size, everything else is already a JSON string.
        after: dict[str, Any] | None = json.loads(latest, parse_float=JsonNumber).get("after")
        return after

    def _routed_outbox_ids(self) -> set[Any]:
        """Ids of the outbox events already routed (read_committed): a snapshot after the first
        one (``always``, ``when_needed``) must not route them again — the events topics are
        never compacted, so a second copy would stay forever."""
        prefix = f"{self.config.outbox_topic_prefix}."
        ids: set[Any] = set()
        for topic in [t for t in self.log.topics() if t.startswith(prefix)]:
            for _, value in self._read_topic(topic):
                if value is not None:
                    ids.add(orjson.loads(value).get("id"))
        if ids:
            log.info("capture: %d outbox events are routed already: the snapshot skips them", len(ids))
        return ids

    def _live_keys_in_log(self, topic: str) -> list[bytes]:
        """Keys whose latest record is not a tombstone (what a TRUNCATE removes)."""
        live: dict[bytes, bool] = {}
        for k, v in self._read_topic(topic):
            if k is not None:
                live[k] = v is not None
        return [k for k, alive in live.items() if alive]

    # ------------------------------------------------------------------ observability

    def _log_status(self) -> None:
        """Every ``status_interval_s``: a structured status line; every ``WAL_CHECK_S``: the slot's retained WAL."""
        now = time.monotonic()
        if now - self._status_logged < self.config.status_interval_s:
            return
        self._status_logged = now
        log.info("capture status %s", orjson.dumps(self.stats.to_json()).decode())
        if now - self._wal_checked < WAL_CHECK_S:
            return
        try:
            info = slot_status(self.config.dsn, self.config.slot)
        except psycopg.Error as e:
            self._wal_checked = now
            log.warning("capture: cannot read slot status: %s", e)
            return
        if info is None:
            return  # no slot yet (a snapshot is starting): look again at the next status line
        self._wal_checked = now
        self.stats.retained_wal_bytes = int(info["retained_wal_bytes"] or 0)
        if info["retained_wal_bytes"] > self.config.retained_wal_warn_bytes:
            log.warning(
                "capture: slot %s retains %d bytes of WAL (threshold %d): is the connector keeping up, "
                "or are captured tables idle while others are busy (use --heartbeat-query)?",
                self.config.slot,
                info["retained_wal_bytes"],
                self.config.retained_wal_warn_bytes,
            )

    def _heartbeat(self) -> None:
        assert self.config.heartbeat_query is not None
        try:
            with psycopg.connect(self.config.dsn, autocommit=True) as c:
                c.execute(self.config.heartbeat_query.encode())
        except psycopg.Error as e:
            log.warning("capture: heartbeat query failed: %s", e)


def slot_status(dsn: str, slot: str) -> dict[str, Any] | None:
    """The slot as the server sees it, with retained WAL in bytes."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT plugin, active, confirmed_flush_lsn::text, restart_lsn::text, wal_status, "
            "pg_current_wal_lsn()::text, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    if row is None:
        return None
    return {
        "slot": slot,
        "plugin": row[0],
        "active": row[1],
        "confirmed_flush_lsn": row[2],
        "restart_lsn": row[3],
        "wal_status": row[4],
        "current_wal_lsn": row[5],
        "retained_wal_bytes": int(row[6] or 0),
        "unconfirmed_bytes": int(row[7] or 0),
    }
