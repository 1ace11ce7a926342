"""The snapshot source: decides whether a snapshot is due, creates the slot, and reads every captured table.

Modes (``initial`` when no position is stored yet, ``always``, ``when_needed`` when the
position or the slot is unusable, ``never``): the slot is created with an exported
snapshot; every captured table is read in that snapshot (``REPEATABLE READ``, ``SET
TRANSACTION SNAPSHOT``, a server-side cursor, values as text converted like the
stream's) and emitted as ``op=r`` events inside **one** log transaction that ends with
the position "snapshot done at the slot's consistent point". Events are appended in
chunks as they are read (memory stays O(chunk)), each by a worker thread while the next is
read (capture.writer.BackgroundAppends: one append in flight, in order); nothing is visible
until the commit.
With ``snapshot_workers`` > 1, tables of at least ``2 × MIN_RANGE_BLOCKS`` blocks are read
in ctid ranges by reader processes sharing the exported snapshot (capture.snapshot_readers);
their encoded batches join the same transaction, numbered and marked by :class:`SnapshotReads`
as a single reader's rows are. This connection still locks and checks every table first.
A table whose topic has live keys already (a snapshot taken again) also gets, in that
transaction, a delete and a tombstone for each of them the snapshot did not read
(capture.recovery: rows deleted while the slot was lost).

A table truncated or rewritten between the slot's consistent point and its read (TRUNCATE is
not MVCC-safe: the snapshot would read it empty while the stream replays what followed) is
noticed before it is read (``REWRITTEN_SQL``); that snapshot is aborted and taken again with a
new slot, at most ``SNAPSHOT_ATTEMPTS`` times. Each read locks its table (ACCESS SHARE) until
the snapshot ends, as any SELECT in a transaction does.

A crash during the snapshot leaves that transaction open: the next start aborts it
(read_committed consumers never see a partial snapshot), drops the slot the interrupted
snapshot created, and starts over — the position "snapshot under way" is committed in a
small transaction *before* the slot exists, so the next start knows the slot is ours.

Outbox rows already in the table are routed in key (id) order; a snapshot taken again
(``always``, ``when_needed``) skips the events the key state says are routed already
(the highest version per stream: versions of one stream commit in order).

Thread-safety: none; run by the connector thread (its appends by one worker thread, never while this
thread uses the sink: see capture.writer.BackgroundAppends).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa

from capture.config import CaptureConfig, CoreChoice, SnapshotMode
from capture.errors import PermanentCaptureError
from capture.events import EventBuilder, TxnContext
from capture.messages import Column
from capture.native import extension
from capture.offsets import OffsetContext
from capture.pgtypes import SESSION_OPTIONS
from capture.recovery import Reconciliation
from capture.replication import ReplicationConnection
from capture.slots import SlotState, drop_slot
from capture.snapshot_readers import (
    NATIVE_BATCH_BYTES,
    NATIVE_BATCH_ROWS,
    SNAPSHOT_FETCH_ROWS,
    NativeBatch,
    PythonPath,
    RangeBatch,
    ReaderLockTimeout,
    ReaderSpec,
    SnapshotReaderDied,
    SnapshotReaders,
    TidRange,
    copy_batches,
    native_encoder,
    tid_ranges,
)
from capture.status import Stats
from capture.tables import TableCatalog, TableInfo, qualified_name, result_rows, select_columns_sql
from capture.writer import BackgroundAppends, LogWriter
from eventstore.errors import ConfigError
from eventstore.topic import now_ms

log = logging.getLogger("capture.connector")

SNAPSHOT_MARKERS = ("first", "first_in_data_collection", "true", "last_in_data_collection", "last")


def snapshot_marker(*, first: bool, last: bool, first_in_table: bool, last_in_table: bool) -> str:
    """``source.snapshot`` of a snapshot read, as Debezium marks them (its setSnapshotMarker): ``last``
    for the snapshot's last read, else ``first`` for its first, else ``last_in_data_collection`` /
    ``first_in_data_collection`` for a table's last / first read, else ``true``. One difference:
    Debezium's first and last are those of its first and last *table*, so an empty first or last table
    leaves the snapshot without one; here they are the first and last read, whichever table they are of."""
    if last:
        return "last"
    if first:
        return "first"
    if last_in_table:
        return "last_in_data_collection"
    if first_in_table:
        return "first_in_data_collection"
    return "true"


class SnapshotStopped(Exception):
    """``stop()`` was called during the snapshot: its transaction is aborted, the next start takes it again."""


class TableRewritten(Exception):
    """A captured table was truncated or rewritten after the snapshot's consistent point (see REWRITTEN_SQL)."""


# TRUNCATE (and the rewrites of ALTER TABLE, CLUSTER, VACUUM FULL) are not MVCC-safe: a transaction
# whose snapshot predates one that committed sees the table empty (or as rewritten), not as it was.
# The snapshot's own reads lock each table (ACCESS SHARE, to the snapshot's end), so such a commit can
# only fall between the slot's consistent point and the table's read. Then the table's file differs
# from the one pg_class held in the snapshot (the catalog as of the snapshot vs the relation cache,
# current once the lock is held); a table created since has no pg_class row in the snapshot at all.
# Such a read would lose the table's rows as of the consistent point, while the stream replays what
# came after (updates of rows the snapshot never emitted, a TRUNCATE removing none of them): the
# snapshot is taken again, with a new slot, up to SNAPSHOT_ATTEMPTS times.
REWRITTEN_SQL = (
    "SELECT c.relfilenode = 0 OR c.relfilenode = pg_relation_filenode(c.oid) "
    "FROM pg_class c WHERE c.oid = %s::regclass"
)
SNAPSHOT_ATTEMPTS = 5
STOP_SIGNAL_WAIT_S = 2.0  # a reader died: how long a stop asked at the same time (the same signal) may take
# The table's heap blocks now (not as of the snapshot: pages added since hold only rows it cannot see).
BLOCKS_SQL = "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::bigint"


class SnapshotReads:
    """The snapshot's table reads in the order they enter the log: their event indexes and ``source.snapshot``.

    Indexes count every read (outbox rows too) from 0 in append order. The latest read is held
    back until the next one comes: only then is it known whether it was the last of its table,
    or of the snapshot (see :func:`snapshot_marker`). Reads encoded by reader processes
    (:class:`capture.snapshot_readers.RangeBatch`) sit between two rows of their table, so are
    never a table's first or last: they keep ``"true"`` and get only their index here.
    """

    def __init__(self, builder: EventBuilder, writer: LogWriter, stats: Stats, consistent_point: int,
                 ts_ms: int) -> None:  # fmt: skip
        self.builder = builder
        self.writer = writer
        self.stats = stats
        self.ts_ms = ts_ms
        # one context per source.snapshot marker: each renders its source prefix once
        self.marked = {m: TxnContext(None, consistent_point, ts_ms, snapshot=m) for m in SNAPSHOT_MARKERS}
        self.index = 0  # the next read's event index
        self._held: tuple[TableInfo, list[Column], int, bool] | None = None  # (table, row, index, first in table)
        self._table: str | None = None  # the latest read's table
        self._first = True  # no read emitted yet

    def row(self, table: TableInfo, columns: list[Column]) -> None:
        """One row read, in the order of the log."""
        self._release(table)
        self._held = (table, columns, self.index, table.qualified != self._table)
        self._table = table.qualified
        self.index += 1
        self.stats.snapshot_rows += 1

    def skip(self) -> None:
        """An outbox row: routed by the caller with :attr:`index`, which it consumes."""
        self.index += 1
        self.stats.snapshot_rows += 1

    def batch(self, table: TableInfo, topic: str, batch: RangeBatch) -> None:
        """A reader's batch: its first row, the encoded rows between (indexes joined in), its last row."""
        self.row(table, batch.first)
        n = len(batch.keys)
        if n:
            self._release(table)
            start = self.index
            indexes = range(start, start + n)
            values: list[bytes | None] = [
                b"%b%d%b" % (head, i, tail) for i, head, tail in zip(indexes, batch.heads, batch.tails, strict=True)
            ]
            self.writer.add_many(topic, batch.keys, values, batch.nbytes + 8 * n)  # 8: about the digits
            if not table.keyless:
                self.builder.remember_reads(topic, batch.keys, batch.big)  # type: ignore[arg-type]
            self.index += n
            self.stats.snapshot_rows += n
        if batch.last is not None:
            self.row(table, batch.last)

    def native_batch(self, table: TableInfo, topic: str, batch: NativeBatch) -> None:
        """A reader's natively encoded batch: its first row, the images between made whole envelopes (their
        indexes joined in, compiled code: no Python object per row), its last row."""
        splice_reads = extension.splice_reads
        if splice_reads is None:  # a reader sends native batches only when it is built, as it is here
            raise PermanentCaptureError("a natively encoded snapshot batch came, but this process has no extension")
        self.row(table, batch.first)
        n = batch.between
        if n:
            self._release(table)
            lead, mid, tail = self.builder.read_parts(table, self.marked["true"], now_ms())
            data, offsets = splice_reads(lead, batch.afters, batch.after_offsets, mid, self.index, tail)
            values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
            if batch.keys is None or batch.key_offsets is None:
                keys = pa.nulls(n, pa.binary())
            else:
                key_buffers = [None, pa.py_buffer(batch.key_offsets), pa.py_buffer(batch.keys)]
                keys = pa.Array.from_buffers(pa.binary(), n, key_buffers)
            self.writer.add_arrays(topic, keys, values, len(data) + (len(batch.keys) if batch.keys else 0))
            if not table.keyless:
                self.builder.remember_read_keys(table, topic, keys, batch.big)
            self.index += n
            self.stats.snapshot_rows += n
        if batch.last is not None:
            self.row(table, batch.last)

    def finish(self) -> None:
        """After the last table: the held read is the snapshot's last."""
        self._release(None)

    def _release(self, next_table: TableInfo | None) -> None:
        if self._held is None:
            return
        table, columns, index, first_in_table = self._held
        last = next_table is None
        last_in_table = next_table is None or next_table.qualified != table.qualified
        marker = snapshot_marker(first=self._first, last=last, first_in_table=first_in_table,
                                 last_in_table=last_in_table)  # fmt: skip
        self.writer.add(self.builder.snapshot_read(table, columns, self.marked[marker], index, now_ms()))
        self._first = False
        self._held = None


@dataclass(slots=True)
class SnapshotSource:
    config: CaptureConfig
    catalog: TableCatalog
    builder: EventBuilder
    writer: LogWriter
    offsets: OffsetContext
    stats: Stats
    stop: threading.Event
    _appends: BackgroundAppends = field(init=False)  # the running snapshot's appends (see run)
    _prestarted: SnapshotReaders | None = field(init=False, default=None)  # reader processes started early

    def prepare(self, repl: ReplicationConnection, slot: SlotState | None, *, resnapshot: bool = False) -> int:
        """Create the slot and snapshot as the mode says; return where streaming starts (0: the slot's position).

        A slot gone or lost while a position is stored was checked before (capture.recovery); so
        was ``resnapshot``: the slot cannot serve the stored position, take a new one regardless of mode.
        """
        mode = self.config.snapshot
        name = self.config.slot
        pos = self.offsets.stored
        lost = slot is not None and (slot.lost or resnapshot)
        if slot is not None and slot.plugin != self.config.plugin.value:
            raise ConfigError(f"slot {name} uses plugin {slot.plugin}, not {self.config.plugin.value}")
        interrupted = self.offsets.snapshot_interrupted
        if slot is not None and pos is not None and not interrupted and not lost and mode is not SnapshotMode.ALWAYS:
            return 0  # the server resumes at the slot's confirmed position; we skip what is stored
        if slot is not None and pos is None and mode is SnapshotMode.INITIAL:
            raise ConfigError(
                f"slot {name} exists but this connector stored no position: stream it without a "
                "snapshot (--snapshot never), take a new one (--snapshot when_needed), or drop the slot"
            )
        needs_snapshot = (
            mode is SnapshotMode.ALWAYS
            or interrupted
            or (pos is None and mode in (SnapshotMode.INITIAL, SnapshotMode.WHEN_NEEDED))
            or (mode is SnapshotMode.WHEN_NEEDED and (slot is None or lost))
            or resnapshot
        )
        if not needs_snapshot:
            if slot is None:
                repl.create_slot(name, self.config.plugin, export_snapshot=False)
                log.info("capture: created slot %s (no snapshot; %s)", name, _failover_note(repl))
            return 0
        if self.config.snapshot_workers > 1:  # their imports run meanwhile (see SnapshotReaders)
            try:
                self._prestarted = SnapshotReaders(self.config.snapshot_workers)
            except OSError as e:  # no table may need them: started (or failed) again where one does
                log.warning("capture: could not start snapshot reader processes early (%s)", e)
        try:
            return self._snapshot(repl, slot, resnapshot=resnapshot)
        finally:
            if self._prestarted is not None:  # not used (no table big enough, or a failure before): ended
                self._prestarted.close(wait_s=0)
                self._prestarted = None

    def _snapshot(self, repl: ReplicationConnection, slot: SlotState | None, *, resnapshot: bool) -> int:
        """Drop the slot if any, create it with an exported snapshot and snapshot every table in it; again with a
        new slot when a table was rewritten meanwhile (up to SNAPSHOT_ATTEMPTS times)."""
        name = self.config.slot
        mode = self.config.snapshot
        pos = self.offsets.stored
        # Remember that a snapshot is under way (its own small transaction) *before* the slot
        # exists: if anything from here on is interrupted, the next start knows the slot is
        # ours to drop and re-create, and that the snapshot must be taken again.
        if pos is None or pos.snapshot_done:
            log.info("capture: storing 'snapshot under way' before creating slot %s", name)
            self.writer.begin()
            self.offsets.snapshot_started()
            self._commit()
        if slot is not None:
            why = "--offset-mismatch trust_offset" if resnapshot else f"--snapshot {mode.value}"
            log.warning("capture: dropping slot %s to take a consistent snapshot (%s)", name, why)
            drop_slot(self.config.dsn, name)
        for attempt in range(1, SNAPSHOT_ATTEMPTS + 1):
            created = repl.create_slot(name, self.config.plugin, export_snapshot=True)
            log.info("capture: created slot %s (%s)", name, _failover_note(repl))
            assert created.snapshot_name is not None
            try:
                self.run(created.snapshot_name, created.consistent_point)
                return created.consistent_point
            except TableRewritten as e:
                self.writer.abort()  # nothing of this snapshot becomes visible
                for table in self.catalog.load():  # the aborted reads' TOAST values
                    self.builder.toast.drop_topic(self.builder.topic(table))
                if attempt == SNAPSHOT_ATTEMPTS:
                    raise PermanentCaptureError(
                        f"{e}; {SNAPSHOT_ATTEMPTS} snapshots in a row met this: stop truncating or rewriting "
                        "captured tables while the snapshot starts, then restart"
                    ) from e
                log.warning("capture: %s: taking the snapshot again with a new slot (attempt %d of %d)",
                            e, attempt + 1, SNAPSHOT_ATTEMPTS)  # fmt: skip
                drop_slot(self.config.dsn, name)
        raise AssertionError("unreachable")

    def _commit(self) -> None:
        position = self.offsets.take_pending()
        self.writer.commit(position)
        self.offsets.committed(position)
        self.stats.batch_stored(None if position is None else position.commit_lsn)

    def run(self, snapshot_name: str, consistent_point: int) -> None:
        """Every captured table in the exported snapshot, in one log transaction."""
        tables = self.catalog.load()
        reads = SnapshotReads(self.builder, self.writer, self.stats, consistent_point, now_ms())
        self.writer.begin()
        reconciliation = Reconciliation(self.builder, self.writer.keystate)
        readers: SnapshotReaders | None = None
        done = False
        self._appends = BackgroundAppends(self.writer)
        try:
            # Values are read uncast in text format: the type's output function, as wal2json prints
            # it (``::text`` differs: char(n) padding, inet netmasks), under the same session settings.
            with psycopg.connect(self.config.dsn, options=SESSION_OPTIONS) as c:
                c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                c.execute(f"SET TRANSACTION SNAPSHOT '{snapshot_name}'")
                spec = self._reader_spec(snapshot_name, consistent_point, reads)
                for t_i, table in enumerate(tables):
                    outbox = table.qualified == self.config.outbox_table
                    self._appends.wait()  # the sink is this thread's again (a topic may be created)
                    if not outbox:
                        topic = self.builder.topic(table)
                        self.writer.ensure_table_topic(table, topic)
                        reconciliation.table_started(table, topic)  # keys live before: deleted if not read again
                        self.builder.shapes.snapshot_read(table, topic, consistent_point)  # its shape from here on
                    self._check_not_rewritten(c, table)
                    ranges = [] if outbox else self._ranges(c, table)
                    if not ranges:
                        native = None if outbox else self._native_encoder(spec, table)
                        if native is not None:
                            self._read_native(c, table, native, reads, spec)
                        else:
                            self._read(c, table, t_i, outbox, reads)
                        continue
                    if readers is None:
                        readers, self._prestarted = self._prestarted, None
                        if readers is None:
                            readers = SnapshotReaders(self.config.snapshot_workers, spec)
                        else:
                            readers.begin(spec)
                    self._read_ranges(readers, table, ranges, reads)
                reads.finish()
                log.info("capture: snapshot of %d tables, %d rows", len(tables), reads.index)
            done = True
        finally:
            try:
                self._appends.close()  # before the transaction goes on here, or is aborted by the caller
            finally:
                if readers is not None:
                    readers.close(wait_s=5.0 if done else 0.0)
        for chunk in reconciliation.deletes(consistent_point, reads.index, reads.ts_ms, now_ms()):
            for event in chunk:
                self.writer.add(event)
            self.stats.events += len(chunk)
            if self.writer.full:
                self.writer.send_pending()
        self.offsets.snapshot_done(consistent_point)
        self._commit()

    def _read(self, c: psycopg.Connection[Any], table: TableInfo, t_i: int, outbox: bool, reads: SnapshotReads) -> None:
        """One table through the connector's own connection (a server-side cursor)."""
        select = select_columns_sql(table)
        if outbox:
            select += " ORDER BY " + ", ".join(f'"{k}"' for k in table.key)
        cursor = f"tideline_snapshot_{t_i}"
        c.execute(f"DECLARE {cursor} NO SCROLL CURSOR FOR {select}".encode())
        while True:
            res = c.execute(f"FETCH {SNAPSHOT_FETCH_ROWS} FROM {cursor}".encode()).pgresult
            if res is None or res.ntuples == 0:
                break
            for columns in result_rows(res, table):
                if outbox:
                    self._route_outbox(table, columns, reads.marked["true"], reads.index)
                    reads.skip()
                else:
                    reads.row(table, columns)
            self._batch_done()

    def _native_encoder(self, spec: ReaderSpec, table: TableInfo) -> Any | None:
        """The compiled encoder for reading ``table`` on the connector's connection (None: the Python path): as a
        reader process decides (capture.snapshot_readers.native_encoder), in a value format it writes (JSON)."""
        if not self.config.value_format.capabilities.native_snapshot_reads:
            return None
        return native_encoder(spec, table)

    def _read_native(self, c: psycopg.Connection[Any], table: TableInfo, native: Any, reads: SnapshotReads,
                     spec: ReaderSpec) -> None:  # fmt: skip
        """One table through the connector's own connection, as a reader process reads a range (``COPY``, the
        compiled encoder, batches of NATIVE_BATCH_ROWS spliced and appended as Arrow arrays)."""
        topic = self.builder.topic(table)
        python = PythonPath.of(self.builder, reads.marked["true"])  # the rows the encoder leaves to Python
        for batch in copy_batches(c, python, native, table, select_columns_sql(table), 0, spec.batch_rows,
                                  spec.batch_bytes):  # fmt: skip
            reads.native_batch(table, topic, batch)
            self._batch_done()

    def _ranges(self, c: psycopg.Connection[Any], table: TableInfo) -> list[TidRange]:
        """The table's ctid ranges for the reader processes ([]: read it here; capture.snapshot_readers)."""
        if self.config.snapshot_workers < 2 or c.info.server_version < 140000:  # TID range scans: PostgreSQL 14
            return []
        if table.partitioned:  # no blocks of its own: its partitions' ctids repeat (read whole, here)
            return []
        row = c.execute(BLOCKS_SQL.encode(), (qualified_name(table),)).fetchone()
        return tid_ranges(table, int(row[0]) if row else 0, self.config.snapshot_workers)

    def _reader_spec(self, snapshot_name: str, consistent_point: int, reads: SnapshotReads) -> ReaderSpec:
        """What the readers need; a native batch is bounded by the connector's own batch (``batch_events``,
        ``batch_bytes`` — of COPY text here), so memory follows the configuration as on the Python path."""
        return ReaderSpec(self.config.dsn, snapshot_name, self.builder.prefix, self.builder.db,
                          self.config.table_filter, consistent_point, reads.ts_ms,
                          native=self.config.core is not CoreChoice.PYTHON,
                          batch_rows=min(NATIVE_BATCH_ROWS, self.config.batch_events),
                          batch_bytes=min(NATIVE_BATCH_BYTES, self.config.batch_bytes))  # fmt: skip

    def _read_ranges(self, readers: SnapshotReaders, table: TableInfo, ranges: list[TidRange],
                     reads: SnapshotReads) -> None:  # fmt: skip
        """One big table through the reader processes: their batches appended as they come."""
        topic = self.builder.topic(table)
        try:
            for batch in readers.read(ranges):
                if isinstance(batch, NativeBatch):
                    reads.native_batch(table, topic, batch)
                elif batch is not None:
                    reads.batch(table, topic, batch)
                self._batch_done()
        except ReaderLockTimeout as e:
            raise TableRewritten(f"table {table.qualified}: {e} (a TRUNCATE or ALTER waiting?)") from e
        except SnapshotReaderDied as e:
            # A supervisor stopping every process of the service (a cgroup's SIGTERM) ends the readers too; the
            # connector got the signal as well, and its handler sets the stop flag about now. Asked to stop, the
            # snapshot is aborted either way: a stop, not a failure.
            if self.stop.wait(STOP_SIGNAL_WAIT_S):
                raise SnapshotStopped(f"stopped during the snapshot ({e})") from e
            raise

    def _batch_done(self) -> None:
        if self.writer.full:
            self._appends.submit()  # appended while the next batch is read; not committed: one transaction for all
        if self.stop.is_set():
            raise SnapshotStopped("stopped during the snapshot")

    @staticmethod
    def _check_not_rewritten(c: psycopg.Connection[Any], table: TableInfo) -> None:
        """Lock the table for the rest of the snapshot, then make sure the snapshot can read it as it was."""
        name = qualified_name(table)
        c.execute(f"LOCK TABLE {name} IN ACCESS SHARE MODE".encode())
        row = c.execute(REWRITTEN_SQL.encode(), (name,)).fetchone()
        if row is None or not row[0]:
            raise TableRewritten(
                f"table {table.qualified} was truncated, rewritten or created after the snapshot's consistent point"
            )

    def _route_outbox(self, table: TableInfo, columns: list[Column], ctx: TxnContext, index: int) -> None:
        """An event already in the outbox table: routed once (a new snapshot skips what is routed)."""
        image = {col.name: col.value for col in columns}
        event = self.builder.outbox(table, self.config.outbox_topic_prefix, image, ctx, index)
        self._appends.wait()  # the sink is this thread's again (the topic may be created)
        self.writer.ensure_outbox_topic(event.topic)
        assert event.key is not None
        version = int(image["version"])
        routed = self.writer.keystate.routed_version(event.topic, event.key)
        if routed is not None and version <= routed:
            return  # routed before (a new snapshot): the events topics keep every fact once
        self.writer.keystate.route(event.topic, event.key, version)
        self.writer.add(event)


def _failover_note(repl: ReplicationConnection) -> str:
    if repl.supports_failover_slots:
        return "a failover slot: standbys with sync_replication_slots = on keep it for a promotion"
    if repl.in_recovery:
        return ("on a standby: a promotion keeps it, the failover of another server to primary does not (this "
                "standby's slot is not synchronized anywhere)")  # fmt: skip
    return ("no failover slots before PostgreSQL 17: a promoted standby has no such slot, and capture stops "
            "naming it and the recovery")  # fmt: skip
