"""The streaming source: replication messages → decoder → event builder → log writer, in one straight line.

Batching: a log transaction spans many source transactions and, for a huge one, ends in
the middle of it (memory stays bounded; the position says how far). It commits at a
transaction boundary once it is ``linger_ms`` old and the next message has not arrived
yet (caught up: latency is about ``linger_ms`` plus one commit), or once it is
``max_linger_ms`` old while messages keep waiting (behind: one commit's fixed cost — a
dozen fsyncs — is spread over more events), or when it holds ``batch_bytes`` or ``batch_events``, or when
the stream is idle. While it fills, what it holds is appended every ``APPEND_AHEAD_BYTES``
(capture.writer.LogWriter.append_ahead: the sink writes and syncs it in the background), so that the
commit waits for the last part only, not for the whole batch while nothing reads the stream.

Confirming: Postgres learns a new ``flush_lsn`` (the slot may then recycle WAL) only
for commit ends of transactions whose log transaction has committed, never
mid-transaction (the server would resend the whole transaction anyway). While captured
tables are idle, the keepalive's WAL end is stored as the position (at most every
:data:`IDLE_POSITION_S`, in a log transaction of its own) and then confirmed, when no
transaction is in flight (so WAL does not pile up): the slot is never confirmed beyond the
stored position, which is what lets a start tell a slot moved by someone else
(capture.recovery). An optional heartbeat query writes to the source so that such
confirmations happen at all on a database with no traffic.

The decoder gets each payload with its XLogData position (pgoutput's row messages carry
no LSN of their own). It usually returns a list; a pgoutput Stream Commit returns an
iterator that replays a whole streamed transaction from disk, which can take minutes:
while it is consumed, a standby status update goes out every :data:`KEEPALIVE_S`, so the
walsender (which stops a silent client after ``wal_sender_timeout``) keeps waiting.

Thread-safety: none; run by the connector thread.

Incremental snapshots (capture.incremental) ride on this loop: between two transactions it
reads the next chunk when one is due; watermark messages (prefix
``tideline.watermark``) and INSERTs into the signal table (capture.signals) are handed to
it instead of becoming events (a watermark takes no event index; a signal-table INSERT keeps the
index it was given, unused), and every change of a captured
table is shown to it so that it drops the chunk rows the change supersedes. With
``exit_when_caught_up`` the loop does not end while an incremental snapshot is reading
(paused: it may). While a chunk is open, every change takes the Python path (the native
core does not show its changes to the snapshot).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import psycopg

from capture.config import CaptureConfig, ValueFormat
from capture.events import Event, EventBuilder, TxnContext
from capture.incremental import WATERMARK_PREFIX, IncrementalSnapshot
from capture.messages import ChangeMessage, DecodeError, Decoder, Kind, Plugin
from capture.native.core import NativeCore
from capture.offsets import OffsetContext
from capture.partitions import META_NAME, Change, PartitionMap, chunks_in
from capture.replication import Keepalive, ReplicationConnection, XLogData, XLogRun
from capture.schema_changes import DDL_PREFIX, DdlMessage, DdlMessageError
from capture.schema_changes import parse as parse_ddl
from capture.status import Stats, StatusReporter
from capture.tables import Partition, TableCatalog, TableInfo
from capture.writer import LogWriter
from eventstore.topic import now_ms
from schemas.position import SourcePosition, format_lsn

log = logging.getLogger("capture.connector")

READ_AHEAD = 1024  # with the native core: messages that have arrived already, read ahead to give it runs
KEEPALIVE_S = 5.0  # while one payload's messages take long (a replayed streamed transaction)
IDLE_POSITION_S = 1.0  # idle: a keepalive's WAL end is stored (then confirmed) at most this often
COMMITTING_POLL_S = 0.002  # while a commit runs behind: the longest wait for a message before looking at it again


@dataclass(slots=True)
class StreamingSource:
    config: CaptureConfig
    catalog: TableCatalog
    decoder: Decoder
    builder: EventBuilder
    writer: LogWriter
    offsets: OffsetContext
    stats: Stats
    status: StatusReporter
    stop: threading.Event
    incremental: IncrementalSnapshot
    signal_table: tuple[str, str] | None  # (schema, table) whose INSERTs are signals (capture.signals); None: none
    native: NativeCore | None = None  # the native core (capture.native.core), None: every change takes the Python path
    partitions: PartitionMap | None = None  # --publish-via-partition-root: the roots' partitions (capture.partitions)
    # the stream's state between messages
    _ctx: TxnContext | None = None
    _ctx_next: int = 0
    _index: int = 0
    _confirmed: int = 0
    _refreshed_for: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...], bool]] = field(default_factory=dict)

    def run(self, repl: ReplicationConnection, target: int | None) -> None:
        """Stream until stopped, or until ``target`` (the WAL end at start) is stored when given."""
        self.writer.on_settled = self._stored
        try:
            self._stream(repl, target)
            self.writer.settle()  # the last commit behind, stored and confirmed before the stream ends
            self._confirm(repl)
        finally:
            self.writer.on_settled = None

    def _stream(self, repl: ReplicationConnection, target: int | None) -> None:
        self.builder.shapes.load()  # the tables' shapes at the stored position, where the stream starts
        self._ctx = None
        self._ctx_next = 0
        self._index = 0
        last_heartbeat = time.monotonic()
        idle_stored = 0.0  # when an idle position was last stored
        self._confirmed = self.offsets.confirm_lsn
        writer = self.writer
        native = self.native
        while True:
            if self.stop.is_set():  # commit what we have (the position says how far, even mid-transaction)
                self._commit()
                self._confirm(repl)
                return
            if writer.committing and writer.settle(wait=False):  # a commit behind returned: confirm it
                self._confirmed = max(self._confirmed, self._confirm(repl))
            if self._ctx is None and self.incremental.wants_chunk():
                self.incremental.read_chunk()  # at a transaction boundary: the stream's position is the read's
            linger_left = self.config.linger_ms - writer.age_ms()
            timeout = max(0.001, linger_left / 1000) if writer.in_txn else 0.1
            if writer.committing:
                timeout = min(timeout, COMMITTING_POLL_S)
            msg = repl.read(timeout)
            if msg is None and writer.committing and not writer.in_txn:
                writer.settle()  # nothing else to do: the commit behind, stored and confirmed now
                self._confirmed = max(self._confirmed, self._confirm(repl))
            if msg is None and target is not None and self._ctx is None and not writer.in_txn:
                repl.send_status(self._confirmed, reply=True)  # ask for a keepalive: how far is the server?
            if msg is None or isinstance(msg, Keepalive):
                # idle: a read timed out (while a commit runs behind, reads give up every COMMITTING_POLL_S:
                # idleness only once the batch is linger_ms old)
                idle = msg is None and (not writer.committing or writer.age_ms() >= self.config.linger_ms)
                if writer.in_txn and self._ctx is None and (idle or (msg is not None and self._batch_due(repl))):
                    # idle, or the batch is due. A keepalive alone is no sign of idleness: under load the
                    # server sends one after nearly every transaction.
                    self._commit(behind=True)
                now = time.monotonic()
                if isinstance(msg, Keepalive):
                    self.stats.server_wal_end = max(self.stats.server_wal_end, msg.wal_end)
                    if self._ctx is None and not writer.in_txn:
                        reached = target is not None and msg.wal_end >= target
                        if (reached or now - idle_stored >= IDLE_POSITION_S) and self.offsets.idle_at(msg.wal_end):
                            self._store_idle()  # stored before confirmed: the slot never passes the log
                            idle_stored = now
                        self._confirmed = max(self._confirmed, self._confirm(repl))
                        repl.send_status(self._confirmed)
                        if target is not None and msg.wal_end >= target and not self.incremental.reading:
                            return
                    elif msg.reply_requested:
                        repl.send_status(self._confirmed)
                self.status.tick()
                if self.config.heartbeat_query and now - last_heartbeat >= self.config.heartbeat_interval_s:
                    last_heartbeat = now
                    self._heartbeat()
                continue
            assert isinstance(msg, XLogData)
            # With the native core: the messages that have arrived already, so that it gets runs of them.
            batch = [msg] if native is None else repl.read_run(msg, READ_AHEAD)
            if self._handle(batch, repl, target):
                return

    def _handle(self, batch: Sequence[XLogData], repl: ReplicationConnection, target: int | None) -> bool:
        """XLogData messages in stream order: runs of them through the native core while it handles them,
        the others one by one through the Python path. True: ``target`` is stored, stop. With the core, the
        batch is an :class:`XLogRun` (:meth:`run` reads runs then), whose buffer the core reads."""
        writer = self.writer
        native = self.native
        p = 0
        while p < len(batch):
            ctx = self._ctx
            if (
                native is not None
                and ctx is not None
                and self.incremental.chunk is None  # an open chunk must see every change (IncrementalSnapshot.seen)
                and not self.offsets.covers(ctx.commit_lsn, self._index)
            ):
                assert isinstance(batch, XLogRun), "the native core reads runs"
                handled, self._index = native.run(batch, p, ctx, self._index)
                if handled:
                    p += handled
                    self.stats.server_wal_end = max(self.stats.server_wal_end, batch[p - 1].wal_end)
                    self.offsets.event_stored(ctx.commit_lsn, self._index - 1)
                    if writer.txn_full:
                        self._commit(behind=True)  # mid-transaction: bounded memory; the position says how far
                        self._confirmed = max(self._confirmed, self._confirm(repl))
                    else:
                        writer.append_ahead()
                    continue
            if self._xlog(batch[p], repl, target):
                return True
            p += 1
            if writer.in_txn and (
                writer.txn_full or (self._ctx is None and self._batch_due(repl, more=p < len(batch)))
            ):
                self._commit(behind=True)
                self._confirmed = max(self._confirmed, self._confirm(repl))
            elif writer.in_txn:
                writer.append_ahead()
        return False

    def _xlog(self, msg: XLogData, repl: ReplicationConnection, target: int | None) -> bool:
        """One XLogData message through the decoder and the event builder; True: ``target`` is stored, stop."""
        writer = self.writer
        self.stats.server_wal_end = max(self.stats.server_wal_end, msg.wal_end)
        try:  # name where: the operator can look at the WAL there
            messages = self.decoder.decode(msg.payload, msg.data_start)
        except DecodeError as e:
            raise DecodeError(f"at WAL {format_lsn(msg.data_start)}: {e}") from e
        if not isinstance(messages, (list, tuple)):  # a replay: let the server hear from us while it runs
            messages = self._keeping_alive(messages, repl, self._confirmed, msg.data_start)
        for m in messages:
            ctx = self._ctx
            if m.kind is Kind.BEGIN:
                ctx = self._ctx = TxnContext(m.xid, m.lsn, m.timestamp_ms or 0, per_table={})
                self._ctx_next = m.next_lsn or m.lsn
                self._index = 0
                if self.config.transaction_metadata and not self.offsets.covers(ctx.commit_lsn, -1):
                    self._add_one(self.builder.transaction_begin(ctx), compact=False)
                    # the BEGIN record is event -1 of its transaction: it may fill the log transaction, which then
                    # commits before any change of it (_handle), and a restart must find the BEGIN covered
                    self.offsets.event_stored(ctx.commit_lsn, -1)
                continue
            if m.kind is Kind.COMMIT:
                if ctx is None:
                    raise DecodeError(f"COMMIT without BEGIN at {format_lsn(m.lsn)}")
                if self._index == 0:  # no row change: a DDL, perhaps (wal2json sends such transactions)
                    self.builder.shapes.possible_ddl(ctx.commit_lsn)
                if not self.offsets.covers(ctx.commit_lsn, 1 << 62):
                    if self.config.transaction_metadata:
                        self._add_one(self.builder.transaction_end(ctx), compact=False)
                    self.stats.transactions += 1
                    self.offsets.transaction_stored(ctx.commit_lsn, self._index - 1, m.next_lsn or self._ctx_next)
                    self.stats.last_commit_ts_ms = ctx.ts_ms
                self.incremental.committed(ctx.xid)
                self._ctx = None
                if target is not None and (m.next_lsn or 0) >= target and not self.incremental.reading:
                    self._commit()
                    self._confirm(repl)
                    return True
                continue
            if m.kind is Kind.MESSAGE and (not m.transactional or ctx is None):
                one = TxnContext(None, m.lsn, now_ms())
                if not self.offsets.covers(m.lsn, 0):
                    self._add_one(self.builder.message(m, one, 0, now_ms()), compact=False)
                    self.offsets.message_stored(m.lsn, between_transactions=ctx is None)
                continue
            if ctx is None:
                raise DecodeError(f"{m.kind.name} outside a transaction at {format_lsn(m.lsn)}")
            if m.kind is Kind.MESSAGE and m.prefix == WATERMARK_PREFIX:
                if not self.offsets.covers(ctx.commit_lsn, 1 << 62):
                    self.incremental.on_watermark(m, ctx)
                continue  # not an event: takes no index
            if m.kind is Kind.MESSAGE and m.prefix == DDL_PREFIX:
                self.builder.shapes.possible_ddl(ctx.commit_lsn)  # a DDL: the tables' shapes may change here
                ddl, captured = self._ddl(m, ctx)
                event = captured and self.config.schema_changes
                change = self._partition_ddl(ddl) if ddl is not None and self.partitions is not None else None
                if ddl is None or not (event or change):
                    continue  # not an event: takes no index
                i = self._index
                self._index += 1
                if not self.offsets.covers(ctx.commit_lsn, i):
                    if event:
                        self._add_schema_change(self.builder.schema_change(ddl, m, ctx, i, now_ms()))
                    if change:
                        self._partitions_changed(change, m, ctx, i)
                    self.offsets.event_stored(ctx.commit_lsn, i)
                continue
            i = self._index
            self._index += 1
            if self.offsets.covers(ctx.commit_lsn, i):
                self._count_skipped(m, ctx)  # stored before a restart: counts in the metadata all the same
                continue
            self._change(m, ctx, i)
            self.offsets.event_stored(ctx.commit_lsn, i)
            if writer.txn_full:
                self._commit()  # mid-transaction: bounded memory; the position says how far
        return False

    def _ddl(self, m: ChangeMessage, ctx: TxnContext) -> tuple[DdlMessage | None, bool]:
        """A DDL message (capture.schema_changes) and whether it is about a captured table (None: unreadable).
        With wal2json, whose UPDATEs do not say which columns they left out, a captured table's shape follows
        it exactly (capture.shapes; pgoutput's Relation messages say so themselves), whether or not its events
        are written."""
        try:
            ddl = parse_ddl(m.content)
        except DdlMessageError as e:
            log.warning("capture: a %s message at %s is not a schema change (%s): ignored", DDL_PREFIX,
                        format_lsn(m.lsn), e)  # fmt: skip
            return None, False
        if not self.config.table_filter.captures(ddl.schema, ddl.table) or ddl.qualified in (
            self.config.outbox_table, self.config.signal_table
        ):
            return ddl, False
        if self.partitions is not None and ddl.partition_root is not None:
            return ddl, False  # a partition: captured through its root (its DDL is the root's business)
        if ddl.columns is not None and self.config.plugin is Plugin.WAL2JSON:
            table = self.catalog.get(ddl.schema, ddl.table)
            if table is not None:
                columns = [(str(c["name"]), str(c["type"]), int(c["position"])) for c in ddl.columns]
                self.builder.shapes.ddl(table, self.builder.topic(table), columns, ctx.commit_lsn)
        return ddl, True

    # ------------------------------------------------------------------ partitions (capture.partitions)

    def _partition_named(self, schema: str, name: str) -> Partition | None:
        """(Partition roots) the leaf ``schema.name`` as of the change: the partition map's, or where the map does
        not follow DDL (no event triggers) the catalog's as it is now."""
        parts = self.partitions
        if parts is None:
            return None
        part = parts.partition_of(schema, name)
        return part if part is not None or parts.followed else self.catalog.root_of(schema, name)

    def _table_of(self, schema: str, name: str) -> TableInfo | None:
        """The captured table a change of ``schema.name`` belongs to: a partition's is its root's as of the change
        (wal2json names partitions), another table's its own."""
        part = self._partition_named(schema, name)
        if part is not None:
            return self.catalog.current(*part.root) or self.catalog.get(*part.root)
        return self.catalog.get(schema, name, partitions=self.partitions is None or not self.partitions.followed)

    def _partition_ddl(self, ddl: DdlMessage) -> Change:
        """The map of the roots' partitions after ``ddl`` (kept with the position: the key state's meta)."""
        assert self.partitions is not None
        before = self.partitions.dump()
        change = self.partitions.on_ddl(ddl)
        after = self.partitions.dump()
        if after != before:
            self.catalog.load()  # the partitions' names and roots (wal2json's changes name them)
            self.partitions.regroup(change)
            self.builder.keystate.put_meta(META_NAME, self.partitions.dump())
        return change

    def _partitions_changed(self, change: Change, m: ChangeMessage, ctx: TxnContext, index: int) -> None:
        """Rows that joined a root (an incremental snapshot reads them) or left it (their deletes, here)."""
        for table, part in change.removed:
            log.info("capture: partition %s.%s left %s at %s: deleting its rows from %s", part.schema, part.name,
                     table.qualified, format_lsn(ctx.commit_lsn), self.builder.topic(table))  # fmt: skip
            self._delete_partition_rows(table, part, m, ctx, index)
        # A partition detached is a table of its own: wal2json streams its changes from here, so its rows are read
        # now; pgoutput streams it once the publications hold it, from the next start, which reads it (a table new
        # to the connector: capture.incremental.include_new_tables), as any table created while capture runs.
        assert self.partitions is not None
        for _, part in change.removed if self.config.plugin is Plugin.WAL2JSON else ():
            own = self.catalog.current(part.schema, part.name)
            if own is not None and not own.keyless and not self.partitions.holds(part.oid):
                log.info("capture: %s is a table of its own now: reading its rows into %s (incremental snapshot)",
                         own.qualified, self.builder.topic(own))  # fmt: skip
                self.incremental.request_rows(f"partition-{part.oid}-{ctx.commit_lsn:x}", own.qualified, "true")
        for table, part in change.attached:
            log.info("capture: partition %s.%s joined %s at %s: reading its rows (incremental snapshot)",
                     part.schema, part.name, table.qualified, format_lsn(ctx.commit_lsn))  # fmt: skip
            self.incremental.request_rows(f"partition-{part.oid}-{ctx.commit_lsn:x}", table.qualified,
                                          f"tableoid = {part.oid}")  # fmt: skip

    def _delete_partition_rows(self, table: TableInfo, part: Partition, m: ChangeMessage, ctx: TxnContext,
                               index: int) -> None:  # fmt: skip
        """A ``d`` event and a tombstone for each live key of the root's topic that was the partition's row."""
        if table.keyless:
            return
        topic = self.builder.topic(table)
        if self.config.value_format is not ValueFormat.JSON:  # the constraint is evaluated on JSON keys (jsonb)
            what = f"{part.schema}.{part.name} ({table.qualified})"
            if what not in self.stats.partitions_not_followed:
                self.stats.partitions_not_followed.append(what)
            log.warning("capture: partition %s left %s, but its rows stay in %s: Avro keys are not read back as "
                        "values to find them (docs/capture.md, Partitioned tables)", what, table.qualified, topic)
            return
        self.writer.ensure_table_topic(table, topic)
        conn = self.incremental.connection()
        for keys in chunks_in(conn, table, part, self.builder.keystate.truncated_keys(topic)):
            events: list[Event] = []
            for key in keys:
                events += self.builder.recovered_delete(table, key, ctx, index, now_ms())
            for e in events:
                self.writer.add(e)
            self.stats.events += len(events)
            self.incremental.seen(m, table, events, ctx.xid)
            if self.writer.full:
                self.writer.send_pending()  # inside the open transaction: O(chunk) memory

    def _add_schema_change(self, event: Event) -> None:
        self.writer.ensure_schema_changes_topic(event.topic)
        self.writer.add(event)
        self.stats.events += 1
        self.stats.schema_changes += 1

    def _keeping_alive(self, messages: Iterable[ChangeMessage], repl: ReplicationConnection,
                       confirmed: int, at: int) -> Iterator[ChangeMessage]:  # fmt: skip
        """The messages, with a status update (confirming nothing new) every KEEPALIVE_S; a decode error
        met on the way names the WAL position of the message that started the replay."""
        due = time.monotonic() + KEEPALIVE_S
        try:
            for i, m in enumerate(messages):
                if i & 1023 == 0 and time.monotonic() >= due:
                    repl.send_status(confirmed)
                    self.status.tick()
                    due = time.monotonic() + KEEPALIVE_S
                yield m
        except DecodeError as e:
            raise DecodeError(f"at WAL {format_lsn(at)}: {e}") from e

    # ------------------------------------------------------------------ one change

    def _change(self, m: ChangeMessage, ctx: TxnContext, index: int) -> None:
        """decoder → event builder → writer, for one change of a transaction."""
        if m.kind is Kind.MESSAGE:
            self._add_one(self.builder.message(m, ctx, index, now_ms()), compact=False)
            return
        assert m.schema is not None and m.table is not None
        if (m.schema, m.table) == self.signal_table:
            if m.kind is Kind.INSERT:
                self.incremental.on_signal(m)
            return
        table = self._table_of(m.schema, m.table)
        if table is None:
            return  # not captured
        table = self._check_columns(table, m)
        if table.qualified == self.config.outbox_table:
            if self.native is not None:
                self.native.sync(table)
            self._route_outbox(m, table, ctx, index)
            return
        if m.kind is Kind.TRUNCATE and table.partitioned and (m.schema, m.table) != (table.schema, table.name):
            part = self._partition_named(m.schema, m.table)
            if part is not None:  # one partition emptied (wal2json names it): its rows, not the root's
                self._delete_partition_rows(table, part, m, ctx, index)
            return
        topic = self.builder.topic(table)
        self.writer.ensure_table_topic(table, topic)
        # the table's columns at this change (capture.shapes; it may read the catalog again)
        shape = self.builder.shapes.at(m, table, topic, ctx.commit_lsn, self.catalog)
        table = self.catalog.current(table.schema, table.name) or table
        if self.native is not None:
            self.native.sync(table)  # its next changes may take the native core
        events = self.builder.change(m, table, ctx, index, now_ms(), topic, shape)
        for e in events:
            self.writer.add(e)
        self.stats.events += len(events)
        self.incremental.seen(m, table, events, ctx.xid)
        if m.kind is Kind.TRUNCATE:
            for chunk in self.builder.truncate_tombstones(table):
                for e in chunk:
                    self.writer.add(e)
                self.stats.events += len(chunk)
                if self.writer.full:
                    self.writer.send_pending()  # inside the open transaction: O(chunk) memory

    def _add_one(self, event: Event, *, compact: bool) -> None:
        self.writer.ensure_topic(event.topic, compact=compact)
        self.writer.add(event)
        self.stats.events += 1

    def _route_outbox(self, m: ChangeMessage, table: TableInfo, ctx: TxnContext, index: int) -> None:
        if m.kind is not Kind.INSERT:
            self.stats.outbox_violations += 1
            log.warning(
                "capture: outbox table %s is append-only, but a %s at %s changed it: not routed (%d so far)",
                table.qualified, m.kind.name, format_lsn(m.lsn), self.stats.outbox_violations,
            )  # fmt: skip
            return
        self.builder.count(table, ctx)
        image = {c.name: c.value for c in m.columns}
        event = self.builder.outbox(table, self.config.outbox_topic_prefix, image, ctx, index)
        self.writer.ensure_outbox_topic(event.topic)
        assert event.key is not None
        self.writer.keystate.route(event.topic, event.key, int(image["version"]))
        self.writer.add(event)
        self.stats.events += 1

    def _count_skipped(self, m: ChangeMessage, ctx: TxnContext) -> None:
        """Advance the transaction's counters past an event stored before a restart."""
        if m.kind is Kind.MESSAGE or m.schema is None or m.table is None:
            return
        table = self.catalog.get(m.schema, m.table)
        if table is None:
            return
        if table.qualified != self.config.outbox_table:
            self.builder.count_stored(m, table, ctx)
        elif m.kind is Kind.INSERT:
            self.builder.count(table, ctx)

    def _check_columns(self, table: TableInfo, m: ChangeMessage) -> TableInfo:
        """The table changed (ALTER TABLE) if a change has a column the catalog does not know, an
        INSERT lacks one (it carries every column), or, when the converter writes types (Avro),
        a column has another type: read the catalog again."""
        known = table.column_names
        changed = (
            any(c.name not in known for c in m.columns)
            or any(c.name not in known for c in m.identity)
            or (m.kind is Kind.INSERT and len(m.columns) != len(known))
        )
        if not changed and self.builder.converter.types_matter:
            types = table.column_types
            changed = any((c.name, c.type_oid) not in types for c in m.columns)
        if changed:
            # once per shape the stream shows: while a backlog of older changes is caught up, the catalog is
            # ahead of each of them (capture.shapes builds their events with the shape at the change)
            seen = (tuple(c.name for c in m.columns), tuple(c.name for c in m.identity), m.kind is Kind.INSERT)
            if self._refreshed_for.get((table.schema, table.name)) == seen:
                return table
            self._refreshed_for[(table.schema, table.name)] = seen
            refreshed = self.catalog.refresh(table.schema, table.name)
            if refreshed is not None:
                return refreshed
        return table

    # ------------------------------------------------------------------ commits

    def _batch_due(self, repl: ReplicationConnection, *, more: bool = False) -> bool:
        """At a transaction boundary: is the batch old enough to commit now? (see the module docstring)

        Past ``linger_ms`` it commits unless the next message is already waiting, and then
        at ``max_linger_ms`` at the latest. Measured on this 2-core machine: holding for up
        to 250 ms gave p99 ≈ 150 ms at a steady 10k changes/s (a waiting message is the
        normal case there); requiring the last transaction to be ≥ 100 ms old as well
        drained backlogs slower (more, smaller commits). 50 ms keeps both short. ``more``: messages read ahead
        (for the native core) are waiting.
        """
        age_ms = self.writer.age_ms()
        if age_ms < self.config.linger_ms:
            return False
        return age_ms >= self.config.max_linger_ms or not (more or repl.pending())

    def _commit(self, *, behind: bool = False) -> None:
        """Append the batch and its position in the open log transaction, and commit it. ``behind``: when the sink
        commits behind (capture.writer), the commit runs while the next batch is decoded, and the position is
        stored (:meth:`_stored`) once it returned."""
        position = self.offsets.take_pending()
        if behind and self.writer.sink.commits_behind:
            if self.writer.commit_behind(position):
                self.offsets.committing(position)
            return
        if self.writer.commit(position):
            self.offsets.committed(position)
            self._batch_stored(position)

    def _stored(self, position: SourcePosition | None) -> None:
        """A commit behind returned (capture.writer's ``on_settled``): ``position`` is stored."""
        self.offsets.settled(position)
        self._batch_stored(position)

    def _batch_stored(self, position: SourcePosition | None) -> None:
        self.stats.batch_stored(None if position is None else position.commit_lsn)
        self.status.tick()

    def _store_idle(self) -> None:
        """The idle position alone in a log transaction (capture.recovery relies on the slot never being
        confirmed past the log). The lag stays that of the last change: no change was stored."""
        position = self.offsets.take_pending()
        self.writer.begin()
        self.writer.commit(position)
        self.offsets.committed(position)
        self.stats.batches += 1
        if position is not None:
            self.stats.last_stored_lsn = position.commit_lsn

    def _confirm(self, repl: ReplicationConnection) -> int:
        """Tell the server what is durable: the last complete transaction's commit end."""
        lsn = self.offsets.confirm_lsn
        if lsn:
            repl.send_status(lsn)
        return lsn

    def _heartbeat(self) -> None:
        assert self.config.heartbeat_query is not None
        try:
            with psycopg.connect(self.config.dsn, autocommit=True) as c:
                c.execute(self.config.heartbeat_query.encode())
        except psycopg.Error as e:
            log.warning("capture: heartbeat query failed: %s", e)
