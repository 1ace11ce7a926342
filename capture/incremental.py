"""Incremental snapshots while streaming: DBLog's watermark algorithm (Debezium's incremental snapshots).

A table is read in **chunks** in primary-key order (keyset pagination: ``WHERE (k…) >
(last key…) ORDER BY k… LIMIT chunk_size``) by the streaming thread itself, between two
transactions of the stream, while streaming goes on. Each chunk is bracketed by two
**watermarks** written through the WAL: transactional logical messages (prefix
:data:`WATERMARK_PREFIX`, content ``{"connector", "chunk", "mark": "low"|"high"}``)::

    p   the stream's position when the chunk is read (every message before it is processed)
    lw  SELECT pg_logical_emit_message(true, 'tideline.watermark', '{…"mark":"low"}')   (commits)
    S   REPEATABLE READ: pg_current_snapshot(), then the chunk's SELECT                 (in memory)
    hw  SELECT pg_logical_emit_message(true, 'tideline.watermark', '{…"mark":"high"}')  (commits)

The stream then goes on from ``p``. A change of the chunk's table whose key is in the chunk
drops that row from the chunk when it comes **after lw**, or before lw from a transaction
that ``S`` does not see (PostgreSQL makes a commit visible a little after writing its
commit record, so a transaction just ahead of lw in the WAL can still be invisible to S).
The same lag could hide from ``S`` a transaction the stream has already passed (before
``p``: its changes are in the log, the chunk would hold older rows): a read whose snapshot
still has in progress one of the last :data:`RECENT_XIDS` transactions the stream
committed is thrown away and taken again (rare: under synchronous replication a commit
stays invisible until the standby answers, while logical decoding already sends it).
At **hw** the rows left are emitted as ``op=r`` events (``source.snapshot =
"incremental"``) in hw's transaction. So a row is emitted only if no change of its key lies
between the read and hw: the ``r`` is exactly the row as of hw, every change after it
follows it, and a dropped row's own change carries its newer value — nothing lost, nothing
reordered. Watermarks are not events; watermarks of another connector or of a chunk this
connector no longer holds (read before a restart) are ignored.

**Progress** (:class:`schemas.position.IncrementalProgress`: tables left, the last key of
the last completed chunk, the rows so far) is part of the stored position
(capture.offsets): the ``r`` events of a chunk and the progress past it commit in one log
transaction. After a crash (kill -9 included) the chunk that was open is read again from
the stored last key, with new watermarks; its old ones in the stream are ignored.

**Control** comes from signals (capture.signals: ``execute-snapshot``, ``pause-snapshot``,
``resume-snapshot``, ``stop-snapshot``), acted on where they are in the stream, their effect
stored with their transaction's position. A new ``execute-snapshot`` while one runs adds its
tables to it. At start, a captured table that has no topic in the log yet (it joined the
include list since the last run) is snapshotted this way (:meth:`IncrementalSnapshot.include_new_tables`),
unless its whole history is in the stream: created since the stored position (capture.table_history).

Tables need a unique key to page by: a primary key or a replica identity index; others
are refused with a warning naming the fix. Memory: O(chunk).

Thread-safety: none; run by the connector thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import psycopg

from capture.config import CaptureConfig
from capture.events import Event, EventBuilder, TxnContext
from capture.messages import ChangeMessage, Column, Kind
from capture.offsets import OffsetContext
from capture.pgtypes import SESSION_OPTIONS
from capture.signals import Signal, SignalError, SignalType, signal_from_insert
from capture.status import Stats
from capture.table_history import NewTables
from capture.tables import TableCatalog, TableInfo, qualified_name, result_rows, select_columns_sql
from capture.writer import LogWriter
from eventstore.topic import now_ms
from schemas.position import IncrementalProgress

log = logging.getLogger("capture.connector")

WATERMARK_PREFIX = "tideline.watermark"
PAGEABLE_KEYS = ("primary key", "replica identity index")  # unique, ordered: keyset pagination works
XID_SPACE = 1 << 32
RECENT_XIDS = 8192  # transactions the stream committed lately, checked against a chunk read's snapshot


@dataclass(slots=True)
class ReadSnapshot:
    """``pg_current_snapshot()`` of a chunk's read: which transactions it sees."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> ReadSnapshot:
        """``"xmin:xmax:xip,…"`` (64-bit transaction ids)."""
        xmin, xmax, xip = text.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))

    def sees(self, xid: int | None) -> bool:
        """Whether a committed transaction with this 32-bit xid is visible in the snapshot.

        The stream's xids are 32 bits; the one meant is the nearest to ``xmax`` (the
        transaction committed close to the read)."""
        if xid is None:
            return True
        diff = (xid - self.xmax) % XID_SPACE
        full = self.xmax + diff if diff < XID_SPACE // 2 else self.xmax - (XID_SPACE - diff)
        return full < self.xmax and full not in self.xip


@dataclass(slots=True)
class OpenChunk:
    """A chunk read and held until its high watermark arrives in the stream."""

    id: str  # in both watermarks
    table: TableInfo
    topic: str
    rows: dict[bytes | None, list[Column]]  # record key → row, in key order
    read: int  # rows the SELECT returned
    last_key: tuple[str | None, ...] | None  # text of the key of the last row read (None: no row)
    more: bool  # the chunk was full: the table may hold more rows after last_key
    snapshot: ReadSnapshot
    low_seen: bool = False
    dropped: int = 0


@dataclass(slots=True)
class IncrementalSnapshot:
    """The incremental snapshot of one connector run (capture.connector makes one per connection)."""

    config: CaptureConfig
    catalog: TableCatalog
    builder: EventBuilder
    writer: LogWriter
    offsets: OffsetContext
    stats: Stats
    chunk: OpenChunk | None = None
    recent_xids: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_XIDS))
    _conn: psycopg.Connection[Any] | None = None
    _rate_since: tuple[float, int] | None = None  # (when, rows) this run's rate counts from

    def __post_init__(self) -> None:
        self._report(self.offsets.incremental)  # a snapshot resumed from the stored position

    # ------------------------------------------------------------------ state

    @property
    def progress(self) -> IncrementalProgress | None:
        return self.offsets.incremental

    @property
    def reading(self) -> bool:
        """Chunks are being read: a chunk is open, or one is due (an active snapshot that is not paused)."""
        p = self.progress
        return self.chunk is not None or (p is not None and not p.paused)

    def wants_chunk(self) -> bool:
        """Time to read the next chunk: one is due and none is open."""
        p = self.progress
        return p is not None and not p.paused and self.chunk is None

    def _store(self, progress: IncrementalProgress | None) -> None:
        """The open batch stores ``progress`` (a batch is opened if none is: it must reach the log)."""
        self.writer.begin()
        self.offsets.incremental_changed(progress)
        self._report(progress)

    def _report(self, progress: IncrementalProgress | None) -> None:
        if progress is None:
            self.stats.incremental = None
            return
        if self._rate_since is None:
            self._rate_since = (time.monotonic(), progress.rows)
        started, rows = self._rate_since
        elapsed = time.monotonic() - started
        self.stats.incremental = {
            "id": progress.id,
            "table": progress.tables[0] if progress.tables else None,
            "tables_left": len(progress.tables),
            "tables_done": progress.tables_done,
            "rows": progress.rows,
            "percent": progress.percent,
            "rows_per_s": round((progress.rows - rows) / elapsed, 1) if elapsed > 0 and progress.rows > rows else 0.0,
            "paused": progress.paused,
        }

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ requests

    def request(self, snapshot_id: str, tables: list[str], filters: dict[str, str], chunk_size: int | None) -> None:
        """Snapshot these tables (added to the snapshot under way, if any): refused ones are logged and left out."""
        accepted = [name for name in dict.fromkeys(tables) if self._eligible(name, filters.get(name))]
        current = self.progress
        if current is None:
            if not accepted:
                return
            progress = IncrementalProgress(
                snapshot_id,
                tuple(accepted),
                filters={k: v for k, v in filters.items() if k in accepted},
                chunk_size=chunk_size or self.config.incremental_chunk_size,
                started_ms=now_ms(),
            )
            self._rate_since = (time.monotonic(), 0)  # a new snapshot's rate
        else:
            new = [t for t in accepted if t not in current.tables]
            if not new:
                return
            merged = {**current.filters, **{k: v for k, v in filters.items() if k in new}}
            progress = replace(current, tables=current.tables + tuple(new), filters=merged)
        log.info("capture: incremental snapshot %s: tables %s (chunks of %d rows)", progress.id,
                 ", ".join(progress.tables), progress.chunk_size)  # fmt: skip
        self._store(progress)

    def request_rows(self, snapshot_id: str, name: str, condition: str) -> None:
        """Snapshot the rows of table ``name`` that meet ``condition`` (a partition attached to it: capture.
        partitions). Added to the snapshot under way: a table it has still to read takes the condition too (or'ed
        with its own); the table it is reading is read again from its start with both (its rows read so far may
        not meet the new one); a table it reads whole already needs nothing more."""
        current = self.progress
        if current is None or name not in current.tables:
            self.request(snapshot_id, [name], {name: condition}, None)
            return
        own = current.filters.get(name)
        if own is None:
            return  # read whole, the new rows with it
        filters = {**current.filters, name: f"({own}) OR ({condition})"}
        if current.tables[0] == name:
            if self.chunk is not None and self.chunk.table.qualified == name:
                self.chunk = None  # its high watermark is ignored when it comes
            self._store(replace(current, filters=filters, last_key=None, table_rows=0, table_estimate=0))
        else:
            self._store(replace(current, filters=filters))
        log.info("capture: incremental snapshot %s: %s also reads %s", current.id, name, condition)

    def connection(self) -> psycopg.Connection[Any]:
        """The snapshot's own connection to the source (autocommit): for other short queries of the stream's
        thread too."""
        return self._connection()

    def _eligible(self, name: str, condition: str | None) -> bool:
        schema, _, table_name = name.partition(".")
        table = self.catalog.get(schema, table_name)
        if table is None:
            log.warning("capture: incremental snapshot: table %s is not captured (check --tables and that it "
                        "exists): left out", name)  # fmt: skip
            return False
        if name == self.config.outbox_table:
            log.warning("capture: incremental snapshot: %s is the outbox table (its rows are routed once, as they "
                        "are inserted): left out", name)  # fmt: skip
            return False
        if table.key_source not in PAGEABLE_KEYS:
            log.warning("capture: incremental snapshot: table %s has no primary key (nor a replica identity index) "
                        "to read it in key order: left out (add a primary key)", name)  # fmt: skip
            return False
        if condition is not None:
            try:
                self._connection().execute(f"EXPLAIN SELECT 1 FROM {qualified_name(table)} WHERE ({condition})"
                                           .encode())  # fmt: skip
            except psycopg.DatabaseError as e:
                log.warning("capture: incremental snapshot: condition %r on %s does not work (%s): table left out",
                            condition, name, " ".join(str(e).split()))  # fmt: skip
                return False
        return True

    def include_new_tables(
        self, tables: list[TableInfo], topic_exists: Any, decide: Callable[[list[TableInfo]], NewTables]
    ) -> None:
        """At start: captured tables that have no topic yet are new to the connector; ``decide``
        (capture.table_history) says which of them the stream holds whole, the others are snapshotted
        incrementally (stored at once, in a log transaction of its own)."""
        candidates = [t for t in tables if t.qualified != self.config.outbox_table and not t.keyless
                      and not topic_exists(self.builder.topic(t))
                      and (self.progress is None or t.qualified not in self.progress.tables)]  # fmt: skip
        if not candidates:
            return
        decision = decide(candidates)
        if decision.streamed:
            log.info("capture: tables created since the stored position: %s; their whole history is in the stream "
                     "from there: streamed, not snapshotted", ", ".join(decision.streamed))  # fmt: skip
        new = [t.qualified for t in candidates if t.qualified in decision.read]
        if not new:
            return
        log.info("capture: tables new to the include list: %s; snapshotting them incrementally",
                 "; ".join(f"{name} ({decision.read[name]})" for name in new))  # fmt: skip
        self.request(f"include-{uuid.uuid4().hex[:12]}", new, {}, None)
        if self.writer.in_txn:
            position = self.offsets.take_pending()
            self.writer.commit(position)
            self.offsets.committed(position)
            self.stats.batch_stored(None if position is None else position.commit_lsn)

    def on_signal(self, m: ChangeMessage) -> None:
        """An INSERT into the signal table (capture.signals): act on it (a malformed one is logged)."""
        try:
            self._apply(signal_from_insert(m))
        except SignalError as e:
            log.warning("capture: signal ignored: %s", e)

    def _apply(self, signal: Signal) -> None:
        log.info("capture: signal %s %s %s", signal.id, signal.type.value, orjson.dumps(signal.data).decode())
        p = self.progress
        if signal.type is SignalType.EXECUTE_SNAPSHOT:
            kind = signal.data.get("type", "incremental")
            if str(kind).lower() != "incremental":
                raise SignalError(f"signal {signal.id}: snapshot type {kind!r}: only incremental snapshots run "
                                  "while streaming (restart with --snapshot always for a blocking one)")  # fmt: skip
            if not signal.tables:
                raise SignalError(f"signal {signal.id}: execute-snapshot names no data-collections")
            self.request(signal.id, signal.tables, signal.filters, signal.chunk_size)
        elif p is None:
            log.info("capture: signal %s: no incremental snapshot is under way", signal.id)
        elif signal.type is SignalType.PAUSE_SNAPSHOT:
            self._store(replace(p, paused=True))
        elif signal.type is SignalType.RESUME_SNAPSHOT:
            self._store(replace(p, paused=False))
        elif signal.type is SignalType.STOP_SNAPSHOT:
            stop = set(signal.tables)
            left = tuple(t for t in p.tables if stop and t not in stop)
            if self.chunk is not None and self.chunk.table.qualified not in left:
                self.chunk = None  # its high watermark is ignored when it comes
            if not left:
                log.info("capture: incremental snapshot %s stopped after %d rows", p.id, p.rows)
                self._store(None)
            elif left[0] != p.tables[0]:  # the table being read was stopped: the next one starts from its beginning
                self._store(replace(p, tables=left, last_key=None, table_rows=0, table_estimate=0))
            else:
                self._store(replace(p, tables=left))

    # ------------------------------------------------------------------ chunks

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            # synchronous_commit=local: a watermark must not wait for a synchronous standby, which may be
            # this very connector (its walsender confirms only after the watermark was streamed)
            self._conn = psycopg.connect(self.config.dsn, autocommit=True,
                                         options=f"{SESSION_OPTIONS} -c synchronous_commit=local")  # fmt: skip
        return self._conn

    def _watermark(self, c: psycopg.Connection[Any], chunk_id: str, mark: str) -> None:
        content = orjson.dumps({"connector": self.config.connector_id, "chunk": chunk_id, "mark": mark})
        c.execute("SELECT pg_logical_emit_message(true, %s, %s::text)", (WATERMARK_PREFIX, content.decode()))

    def read_chunk(self) -> None:
        """Low watermark, the chunk's read, high watermark (module docstring); the chunk waits for its hw."""
        p = self.progress
        assert p is not None and self.chunk is None
        name = p.tables[0]
        schema, _, table_name = name.partition(".")
        table = self.catalog.get(schema, table_name)
        if table is None or table.key_source not in PAGEABLE_KEYS:
            log.warning("capture: incremental snapshot: table %s is no longer captured with a key: skipped", name)
            self._table_done(p, skipped=True)
            return
        c = self._connection()
        if p.last_key is None and p.table_rows == 0 and p.table_estimate == 0:
            p = replace(p, table_estimate=self._estimate(c, table, p.filters.get(name)))
            self.offsets.incremental_changed(p)
        select, params = self._chunk_sql(table, p)
        chunk_id = uuid.uuid4().hex
        try:
            self._watermark(c, chunk_id, "low")
            with c.transaction():
                c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                row = c.execute("SELECT pg_current_snapshot()::text").fetchone()
                assert row is not None
                snapshot = ReadSnapshot.parse(row[0])
                res = c.execute(select.encode(), params).pgresult
            self._watermark(c, chunk_id, "high")
        except (
            psycopg.errors.UndefinedTable,
            psycopg.errors.UndefinedColumn,
            psycopg.errors.SyntaxError,
            psycopg.errors.InsufficientPrivilege,
        ) as e:
            log.warning("capture: incremental snapshot: reading %s failed (%s): table skipped", name,
                        " ".join(str(e).split()))  # fmt: skip
            self._table_done(p, skipped=True)
            return
        assert res is not None
        passed = {x & (XID_SPACE - 1) for x in snapshot.xip}.intersection(self.recent_xids)
        if passed:
            self.stats.incremental_rereads += 1
            log.info("capture: incremental snapshot: the read of %s did not see transaction(s) %s the stream has "
                     "passed already (visible a moment after their commit record): reading the chunk again", name,
                     sorted(passed))  # fmt: skip
            return  # no chunk open: the next boundary reads it again (its watermarks are ignored)
        key_positions = [i for i, col in enumerate(table.columns) if col.name in table.key]
        last_key: tuple[str | None, ...] | None = None
        if res.ntuples:
            raw = [res.get_value(res.ntuples - 1, i) for i in key_positions]
            last_key = tuple(None if v is None else v.decode() for v in raw)
        rows: dict[bytes | None, list[Column]] = {}
        for columns in result_rows(res, table):
            rows[self.builder.row_key(table, columns)] = columns
        self.chunk = OpenChunk(chunk_id, table, self.builder.topic(table), rows, res.ntuples, last_key,
                               res.ntuples >= p.chunk_size, snapshot)  # fmt: skip

    @staticmethod
    def _estimate(c: psycopg.Connection[Any], table: TableInfo, condition: str | None) -> int:
        """Rows the table holds, roughly: the planner's estimate, or a count when it has none yet."""
        row = c.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                        (qualified_name(table),)).fetchone()  # fmt: skip
        if row is not None and row[0] is not None and row[0] >= 0 and condition is None:
            return int(row[0])
        where = "" if condition is None else f" WHERE ({condition})"
        counted = c.execute(f"SELECT count(*) FROM {qualified_name(table)}{where}".encode()).fetchone()
        return int(counted[0]) if counted is not None else 0

    @staticmethod
    def _chunk_sql(table: TableInfo, p: IncrementalProgress) -> tuple[str, list[str | None]]:
        """The chunk's SELECT: the table's filters, keys after the last one, in key order."""
        types = {col.name: col.type_name for col in table.columns}
        keys = ", ".join(_quote(k) for k in table.key)
        conditions = []
        condition = p.filters.get(table.qualified)
        if condition is not None:
            conditions.append(f"({condition})")
        params: list[str | None] = []
        if p.last_key is not None:
            placeholders = ", ".join(f"%s::{types[k]}" for k in table.key)
            conditions.append(f"({keys}) > ({placeholders})" if len(table.key) > 1 else f"{keys} > {placeholders}")
            params.extend(p.last_key)
        select = select_columns_sql(table)  # with the publication's row filter (pgoutput), if any
        if conditions:
            select += (" AND " if table.row_filter is not None else " WHERE ") + " AND ".join(conditions)
        return f"{select} ORDER BY {keys} LIMIT {p.chunk_size}", params

    # ------------------------------------------------------------------ the stream

    def committed(self, xid: int | None) -> None:
        """The stream passed the commit of transaction ``xid`` (stored or skipped as stored)."""
        if xid is not None:
            self.recent_xids.append(xid)

    def seen(self, m: ChangeMessage, table: TableInfo, events: list[Event], xid: int | None) -> None:
        """A streamed change of a captured table: drop the chunk's rows it supersedes (module docstring)."""
        chunk = self.chunk
        if chunk is None or table.qualified != chunk.table.qualified:
            return
        if not chunk.low_seen and chunk.snapshot.sees(xid):
            return  # before lw, and the read saw it: the chunk's row is as new or newer
        if m.kind is Kind.TRUNCATE:
            chunk.dropped += len(chunk.rows)
            chunk.rows.clear()
            return
        for e in events:
            if chunk.rows.pop(e.key, None) is not None:
                chunk.dropped += 1

    def on_watermark(self, m: ChangeMessage, ctx: TxnContext | None) -> None:
        """A watermark message: the low one opens the chunk's window, the high one emits what is left."""
        try:
            mark = orjson.loads(m.content or b"")
            chunk_id, which, connector = mark["chunk"], mark["mark"], mark["connector"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as e:
            log.warning("capture: watermark message that is not one of ours (%s): ignored", e)
            return
        chunk = self.chunk
        if connector != self.config.connector_id or chunk is None or chunk.id != chunk_id:
            return  # another connector's, or a chunk read before a restart (read again since)
        if which == "low":
            chunk.low_seen = True
            return
        if which != "high" or ctx is None:
            return
        self._emit(chunk, ctx)

    def _emit(self, chunk: OpenChunk, ctx: TxnContext) -> None:
        p = self.progress
        assert p is not None
        self.chunk = None
        marked = TxnContext(ctx.xid, ctx.commit_lsn, ctx.ts_ms, snapshot="incremental")
        if chunk.rows:
            self.writer.ensure_table_topic(chunk.table, chunk.topic)
        for i, columns in enumerate(chunk.rows.values()):
            self.writer.add(self.builder.snapshot_read(chunk.table, columns, marked, i, now_ms()))
        emitted = len(chunk.rows)
        log.debug("capture: incremental snapshot %s: chunk of %s: %d rows read, %d superseded by the stream, "
                  "%d emitted", p.id, chunk.table.qualified, chunk.read, chunk.dropped, emitted)  # fmt: skip
        self.stats.snapshot_rows += emitted  # as the initial snapshot counts its rows (not in events)
        p = replace(p, rows=p.rows + emitted, table_rows=p.table_rows + chunk.read,
                    last_key=chunk.last_key if chunk.last_key is not None else p.last_key)  # fmt: skip
        if chunk.more:
            self._store(p)
        else:
            self._table_done(p, skipped=False)

    def _table_done(self, p: IncrementalProgress, *, skipped: bool) -> None:
        name = p.tables[0]
        left = p.tables[1:]
        if not skipped:
            log.info("capture: incremental snapshot %s: table %s done (%d rows read)", p.id, name, p.table_rows)
        if not left:
            log.info("capture: incremental snapshot %s done: %d rows", p.id, p.rows)
            self._store(None)
            return
        self._store(replace(p, tables=left, last_key=None, table_rows=0, table_estimate=0,
                            tables_done=p.tables_done + (0 if skipped else 1)))  # fmt: skip


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
