"""The CDC connector: a small coordinator that runs the snapshot source, then the streaming source.

The parts follow Debezium's seams (docs/capture.md, "How it is built"):

* a **decoder** per plugin (capture.decoders, built by its :class:`~capture.messages.Plugin`),
  and for pgoutput the slot's **publications** (capture.publications), created and
  altered to the captured tables at every start, before the slot,
* the **snapshot source** (capture.snapshot) and the **streaming source** (capture.streaming),
  with incremental snapshots while streaming (capture.incremental) started by signals
  (capture.signals) or by tables new to the include list whose history the stream cannot
  give (capture.table_history: each connection records the tables it starts with),
* the **offset context** (capture.offsets; the record itself is schemas.position),
* the **event builder** (capture.events) with a **value converter** (capture.converters),
* the **log writer** (capture.writer) over a **sink** (capture.sinks: the embedded log
  today) with the connector's **key state** (capture.keystate),

and this module only wires them and runs them in order, reconnecting after transient
failures.

**Exactly once into the log.** Events go into the log through one transactional producer
(``transactional_id = capture.<prefix>.<slot>``). Every log transaction carries, besides
the events, one record on the compacted topic ``__tideline_capture_offsets`` holding the
source position of the last event in it (schemas.position). Events and position commit
atomically. On (re)start the connector reads its position (read_committed), starts
replication at the slot's confirmed position, and skips every event at or before the
stored position; ``open`` first aborts whatever a killed predecessor left open. The slot
is confirmed only up to commit ends of wholly stored transactions.

**Failures** (capture.errors classifies them): permanent ones (authentication, missing
database or role, permission, ``wal_level``, plugin missing or not allowed, slot limit,
slot active elsewhere, a refused table, bad configuration) stop at once with one line
saying what to do. Transient ones (connection reset, server restart, admin shutdown)
abort the open log transaction and reconnect with exponential backoff (0.5 s … 30 s),
reset once streaming has resumed, for at most ``max_retry_time_s`` in a row (0: forever).
A first connection that fails is reported, not retried, unless ``retry_on_start``. A
missing slot, or a slot whose WAL was recycled past the stored position →
:class:`~capture.errors.SlotLostError`, which says to restart with ``--snapshot
when_needed``; a stored position the slot disagrees with → ``--offset-mismatch``
(capture.recovery). A payload that cannot be decoded stops the connector; nothing partial
is visible.

Thread-safety: one connector runs in one thread; ``stop()`` may be called from another
thread or a signal handler.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from capture import schema_changes
from capture.config import CaptureConfig, KeylessPolicy, PublicationMode, SnapshotMode, ValueFormat
from capture.converters import converter_for
from capture.decoders import decoder_for
from capture.errors import (
    PermanentCaptureError,
    RetriesExhaustedError,
    SlotLostError,
    is_connection_error,
    is_sink_transient,
    is_slot_busy,
    is_slot_missing,
    permanent_reason,
)
from capture.events import EventBuilder, ToastCache
from capture.incremental import IncrementalSnapshot
from capture.keystate import KeyState
from capture.messages import StreamingAmbiguous
from capture.native.core import core_report, native_core_for
from capture.offsets import OffsetContext
from capture.partitions import META_NAME as PARTITION_MAP
from capture.partitions import PartitionMap
from capture.publications import GENERATED_COLUMNS_SINCE, Publications, PublishableTable
from capture.recovery import check_start, move_position
from capture.replication import ReplicationConnection
from capture.signals import ensure_signal_table, split_table_name
from capture.sinks import Sink
from capture.sinks.embedded import EmbeddedLogSink
from capture.slots import current_wal_lsn, slot_state, slot_status
from capture.snapshot import SnapshotSource, SnapshotStopped
from capture.status import CoreReport, Stats, StatusReporter, write_core_report
from capture.streaming import StreamingSource
from capture.table_history import TableHistory
from capture.tables import KEYLESS_WARNING, TableCatalog
from capture.topics import TopicRouter
from capture.writer import LogWriter
from eventstore.errors import ConfigError
from eventstore.log import Log
from schemas.position import POSITIONS_TOPIC, SourcePosition, connector_key, format_lsn
from schemas.registry import SchemaRegistry

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
FIRST_BACKOFF_S = 0.5

# Names other modules and tests import from here.
OFFSETS_TOPIC = POSITIONS_TOPIC
Position = SourcePosition
__all__ = [
    "OFFSETS_TOPIC",
    "CaptureConfig",
    "Connector",
    "KeylessPolicy",
    "Position",
    "PublicationMode",
    "SlotLostError",
    "SnapshotMode",
    "Stats",
    "ValueFormat",
    "slot_status",
]


class Connector:
    """One capture connector: ``run()`` until stopped (or caught up)."""

    def __init__(self, config: CaptureConfig, log_: Log | None = None, *, sink: Sink | None = None) -> None:
        config.validate()
        # the signal table's rows are commands to the connector (capture.signals), never captured data
        signals = [config.signal_table] if config.signal_table else []
        config = dataclasses.replace(config, table_filter=dataclasses.replace(
            config.table_filter, exclude=[*config.table_filter.exclude, *signals]))  # fmt: skip
        self.signal_table = split_table_name(config.signal_table) if config.signal_table else None
        if sink is None:
            if log_ is None:
                raise ConfigError("a connector needs a log (or a sink) to write to")
            sink = EmbeddedLogSink(log_)
        if config.compression is not None:  # else the sink keeps its own (the log's default)
            sink.set_compression(config.compression)
        self.config = config
        self.sink = sink
        self.log = log_
        self.stats = Stats()
        self._stop = threading.Event()
        capabilities = config.plugin.capabilities
        self.publications: Publications | None = config.publications() if capabilities.needs_publication else None
        self.catalog = TableCatalog(
            config.dsn,
            config.table_filter,
            config.keyless_tables,
            publications=self.publications,
            generated_columns=capabilities.emits_generated_columns,
            partition_root=config.publish_via_partition_root,
        )
        self.partitions = PartitionMap(self.catalog) if config.publish_via_partition_root else None
        self.router = TopicRouter(config.topic_prefix, config.table_topics)
        self.history = TableHistory(config, self.publications, self.history_path())
        self.key = connector_key(config.topic_prefix, config.slot)
        self.keystate: KeyState | None = None
        self.writer: LogWriter | None = None
        self.offsets = OffsetContext(None)
        self._streaming_ok = False  # streaming started since the last failure (resets the backoff)
        self._ever_connected = False
        self._slot_busy_since: float | None = None
        self._streaming_allowed = True  # pgoutput: off for good once a streamed transaction was ambiguous
        self._core_logged: dict[str, object] | None = None  # the core report last logged (a reconnect: not again)

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Ask ``run`` to finish the current batch, confirm and return."""
        self._stop.set()

    def read_position(self) -> SourcePosition | None:
        """The last committed source position of this connector (read_committed)."""
        raw = self.sink.read_last(POSITIONS_TOPIC, 0, self.key)
        return None if raw is None else SourcePosition.from_json(raw)

    def state_path(self) -> Path:
        state_dir = self.config.state_dir or self.sink.default_state_dir()
        return state_dir / f"{self.config.connector_id}.keystate.sqlite"

    def history_path(self) -> Path:
        """The tables the connector's last connection started with (capture.table_history): next to its key state."""
        return self.state_path().with_name(f"{self.config.connector_id}.tables.json")

    def core_report_path(self) -> Path:
        """Where the connector writes its core report (capture.status): next to its key state."""
        return self.state_path().with_name(f"{self.config.connector_id}.core.json")

    def run(self) -> Stats:
        """Snapshot if needed, then stream; reconnect after transient failures (see the module docstring)."""
        self.sink.open(f"capture.{self.config.connector_id}")
        self.keystate = KeyState(self.state_path(), cache_bytes=self.config.key_state_cache_bytes)
        config = self.config
        registry = SchemaRegistry(self.sink.schema_store()) if config.value_format is ValueFormat.AVRO else None
        converter = converter_for(config.value_format, self.log, config.topic_prefix, config.table_filter,
                                  registry=registry)  # fmt: skip
        self.writer = LogWriter(self.config, self.sink, self.keystate, converter)
        self.writer.ensure_positions_topic()
        self.writer.load_schema_starts()
        db = psycopg.conninfo.conninfo_to_dict(self.config.dsn).get("dbname") or "postgres"
        builder = EventBuilder(
            self.config.topic_prefix,
            str(db),
            self.config.table_filter,
            self.router,
            converter,
            ToastCache(self.config.toast_cache_bytes),
            self.keystate,
        )
        builder.shapes.exact = self.config.schema_changes  # each DDL says how a shape changed (capture.shapes)
        backoff = FIRST_BACKOFF_S
        failing_since: float | None = None
        reopen = False
        try:
            while not self._stop.is_set():
                try:
                    if reopen:  # a new producer: init_transactions aborts what the failed one left open
                        self.sink.open(f"capture.{self.config.connector_id}")
                        reopen = False
                    self._run_once(builder)
                    return self.stats
                except SnapshotStopped:
                    self.writer.abort()
                    return self.stats
                except StreamingAmbiguous as e:  # the server can tell what the stream could not
                    self.writer.abort()
                    self._streaming_allowed = False
                    self.stats.reconnects += 1
                    log.warning("capture: %s: reconnecting without streaming in-progress transactions (the server "
                                "spills them and sends each whole at its commit)", e)  # fmt: skip
                except BaseException as e:
                    self.writer.abort()
                    if self._stop.is_set() and is_connection_error(e):
                        break
                    self._raise_unless_transient(e)
                    reopen = reopen or is_sink_transient(e)
                    if self._streaming_ok:  # it worked since the last failure: start counting afresh
                        backoff, failing_since = FIRST_BACKOFF_S, None
                    self._streaming_ok = False
                    now = time.monotonic()
                    failing_since = failing_since or now
                    limit = self.config.max_retry_time_s
                    if limit and now - failing_since + backoff > limit:
                        what = self.sink.describe() if reopen else "the source database"
                        raise RetriesExhaustedError(
                            f"{what} has been unreachable for {now - failing_since:.0f} s "
                            f"(--max-retry-time {limit:g} s); last error: {_one_line(e)}"
                        ) from e
                    self.stats.reconnects += 1
                    lost = f"{self.sink.describe()} failed" if reopen else "connection lost"
                    log.warning("capture: %s (%s); reconnecting in %.1f s", lost, _one_line(e), backoff)
                    self._stop.wait(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
            return self.stats
        finally:
            self.stats.key_state_caught_up = self.keystate.records_caught_up
            self.writer.close()
            self.sink.close()
            self.keystate.close()

    def _raise_unless_transient(self, e: BaseException) -> None:
        """Permanent failures leave here as one clear error; transient ones return (they are retried)."""
        if isinstance(e, (PermanentCaptureError, ConfigError)) or not isinstance(e, Exception):
            raise e
        if is_sink_transient(e):
            return
        if is_slot_missing(e) and self._ever_connected:
            # Dropped after the start checks saw it: the next attempt's checks say what that means (a loud
            # SlotLostError, or with --snapshot when_needed a new slot and snapshot), instead of a raw error.
            log.warning("capture: %s; checking the slot again", _one_line(e))
            return
        if is_slot_busy(e):
            now = time.monotonic()
            self._slot_busy_since = self._slot_busy_since or now
            if now - self._slot_busy_since < self.config.slot_busy_wait_s:
                return  # perhaps our own previous walsender, not gone yet: wait a little
        else:
            self._slot_busy_since = None
        reason = permanent_reason(e)
        if reason is not None:
            raise PermanentCaptureError(reason) from e
        if not is_connection_error(e):
            raise e
        if not self._ever_connected and not self.config.retry_on_start:
            raise PermanentCaptureError(
                f"cannot connect to the source database ({_one_line(e)}): check --dsn and that the server is up, "
                "or pass --retry-on-start to keep trying"
            ) from e

    # ------------------------------------------------------------------ one connection

    def _run_once(self, builder: EventBuilder) -> None:
        assert self.writer is not None
        self.offsets = OffsetContext(self.read_position())
        previous = self.history.read()  # the last connection's start, before this one records its own
        self._ensure_signal_table()
        self._ensure_schema_changes()
        self._sync_publications()
        tables = self.catalog.load()
        self._ever_connected = True
        self.router.check(
            [(t.schema, t.name) for t in tables if t.qualified != self.config.outbox_table],
            reserved=(builder.message_topic, builder.transaction_topic, builder.schema_changes_topic),
        )
        self._warn_keyless()
        self._report_core(core_report(self.config, builder.converter, tables))
        self.writer.catch_up_tracked(tables, builder.topic)
        assert self.keystate is not None
        if self.partitions is not None:
            stored_map = self.keystate.meta(PARTITION_MAP)
            self.partitions.load(stored_map)  # as of the stored position
            if stored_map is None:  # the catalog's now: stored with the next log transaction (a snapshot's)
                self.keystate.put_meta(PARTITION_MAP, self.partitions.dump())
        self.stats.key_state_caught_up = self.keystate.records_caught_up
        repl = ReplicationConnection(self.config.dsn)
        closing: list[Callable[[], None]] = []
        try:
            snapshot = SnapshotSource(
                self.config, self.catalog, builder, self.writer, self.offsets, self.stats, self._stop
            )
            slot = slot_state(self.config.dsn, self.config.slot)
            decision = check_start(self.config, slot, self.offsets.stored, current_wal_lsn(self.config.dsn))
            if decision.trust_slot_at is not None:
                move_position(self.writer, self.offsets, decision.trust_slot_at)
            start_lsn = snapshot.prepare(repl, slot, resnapshot=decision.resnapshot)
            if self._stop.is_set():
                return
            # The stream's start is fixed (slot, snapshot): the tables now are recorded before any position
            # of this connection is stored, and those positions name it (capture.table_history).
            stored = self.offsets.stored
            self.offsets.run_started(self.history.record(stored))
            incremental = IncrementalSnapshot(
                self.config, self.catalog, builder, self.writer, self.offsets, self.stats
            )
            closing.append(incremental.close)
            if not start_lsn and self.config.snapshot is not SnapshotMode.NEVER and stored is not None:
                incremental.include_new_tables(tables, lambda topic: self.sink.topic_incarnation(topic) is not None,
                                               lambda new: self.history.decide(previous, stored, new))  # fmt: skip
            target = current_wal_lsn(self.config.dsn) if self.config.exit_when_caught_up else None
            settings = self.config.decoder_settings(self.state_path().parent)
            if not self._streaming_allowed:
                settings = dataclasses.replace(settings, streaming=False)
            decoder = decoder_for(self.config.plugin, settings)
            closing.append(decoder.close)
            repl.start(self.config.slot, start_lsn, decoder.slot_options())
            self._streaming_ok = True
            log.info(
                "capture: streaming slot %s from %s into %s (stored position %s), core %s",
                self.config.slot,
                format_lsn(start_lsn),
                self.sink.describe(),
                self.offsets.stored,
                self.stats.core.summary() if self.stats.core is not None else "unknown",
            )
            status = StatusReporter(
                self.config.dsn,
                self.config.slot,
                self.stats,
                self.config.status_interval_s,
                self.config.retained_wal_warn_bytes,
                self.core_report_path(),
            )
            native = native_core_for(self.config, self.catalog, builder, self.writer, self.stats, decoder)
            streaming = StreamingSource(
                self.config, self.catalog, decoder, builder, self.writer, self.offsets, self.stats, status, self._stop,
                incremental, self.signal_table,
                native, self.partitions,
            )  # fmt: skip
            streaming.run(repl, target)
        finally:
            for close in closing:
                close()
            repl.close()

    def _report_core(self, report: CoreReport) -> None:
        """The per-change core, at start: into the stats (status line, metrics, ``--json``), the report file
        (``capture status``, the console) and the log — one line for the connector, and a warning per table on
        the Python path (one warning in all when every table is, for one reason ``--core`` did not ask for). The
        Kafka sink's producer is part of it (the sink logs its own choice when it opens)."""
        choice = getattr(self.sink, "producer_choice", None)
        report.producer = choice.to_json() if choice is not None else None
        self.stats.core = report
        try:
            write_core_report(self.core_report_path(), report)
        except OSError as e:
            log.warning("capture: cannot write the core report %s: %s", self.core_report_path(), _one_line(e))
        logged = report.to_json()
        if logged == self._core_logged:
            return  # a reconnect: said already
        self._core_logged = logged
        python = report.python_tables()
        if report.reason is not None and not report.chosen:
            log.warning(
                "capture: core python for every table: %s; every change takes the Python path, several times slower "
                "than the native core (docs/capture.md, 'The native core')",
                report.reason,
            )
        elif report.reason is not None:
            log.info("capture: core python for every table: %s", report.reason)
        else:
            native = len(report.tables) - len(python)
            log.info("capture: core native for %d of %d tables%s", native, len(report.tables),
                     f"; python for {', '.join(sorted(python))}" if python else "")  # fmt: skip
            for name, reason in sorted(python.items()):
                log.warning("capture: table %s takes the Python core: %s", name, reason)

    def _sync_publications(self) -> None:
        """pgoutput: the publications hold the captured tables (capture.publications), before the slot exists."""
        if self.publications is None:
            return
        table_filter, policy = self.config.table_filter, self.config.keyless_tables

        def wanted(table: PublishableTable) -> bool:
            if (table.schema, table.name) == self.signal_table:
                return True  # its INSERTs are signals: they must be streamed
            return table_filter.captures(table.schema, table.name) and (table.keyed or policy is KeylessPolicy.KEYLESS)

        result = self.publications.sync(wanted)
        for name in result.created:
            log.info("capture: created publication %s", name)
        for what, changes in (("added", result.added), ("dropped", result.dropped)):
            for name, tables in changes.items():
                log.info("capture: publication %s: %s %s", name, what, ", ".join(f"{s}.{t}" for s, t in tables))
        new = result.newly_published()
        stored = self.offsets.stored
        if new and stored is not None and stored.snapshot_done and self.config.snapshot is not SnapshotMode.ALWAYS:
            for schema, table in new:
                log.warning(
                    "capture: table %s.%s joined publication %s only now: PostgreSQL streams its changes from now "
                    "on, not those written since the stored position; a table new to the include list is "
                    "snapshotted incrementally, another one needs a signal (tideline capture snapshot --tables "
                    "%s.%s) if its earlier rows matter", schema, table, self.publications.name, schema, table,
                )  # fmt: skip

    def _ensure_signal_table(self) -> None:
        """The signal table exists (capture.signals): created when missing, before the publications are synced
        (only when one is configured: ``--signal-table``)."""
        if self.config.signal_table is None:
            return
        try:
            if ensure_signal_table(self.config.dsn, self.config.signal_table):
                log.info("capture: created signal table %s", self.config.signal_table)
        except psycopg.errors.InsufficientPrivilege as e:
            log.warning("capture: cannot create signal table %s (%s): signals are off until someone creates it "
                        "(see docs/capture.md, Signals)", self.config.signal_table, _one_line(e))  # fmt: skip

    def _ensure_schema_changes(self) -> None:
        """``--schema-changes``: the event triggers that write each DDL into the WAL are installed (capture.
        schema_changes); a role that may not create them stops the connector with one line saying what to do.
        ``--publish-via-partition-root`` without it installs them too (capture.partitions), and goes on without
        following partitions attached or detached, with a warning, where it may not."""
        if not self.config.schema_changes:
            if self.partitions is None:
                return
            try:
                installed = schema_changes.install(self.config.dsn)
            except ConfigError as e:
                log.warning("capture: --publish-via-partition-root: partitions attached, detached or dropped while "
                            "capture runs are not followed (their rows would stay in, or stay out of, the "
                            "partitioned table's topic): %s", _one_line(e))  # fmt: skip
                self.stats.partitions_not_followed = ["(event triggers missing: every partitioned table)"]
                self.partitions.followed = False
                return
            if installed:
                log.info("capture: installed the event triggers %s (--publish-via-partition-root): partitions "
                         "attached, detached or dropped are followed", ", ".join(schema_changes.TRIGGERS))  # fmt: skip
            return
        if schema_changes.install(self.config.dsn):
            log.info("capture: installed the event triggers %s (--schema-changes): each DDL on a captured table "
                     "becomes an event on %s.schema_changes", ", ".join(schema_changes.TRIGGERS),
                     self.config.topic_prefix)  # fmt: skip

    def _warn_keyless(self) -> None:
        if self.stats.keyless_tables != self.catalog.keyless:
            for name in self.catalog.keyless:
                if name not in self.stats.keyless_tables:
                    log.warning("capture: table %s %s", name, KEYLESS_WARNING)
            self.stats.keyless_tables = list(self.catalog.keyless)
        if self.stats.skipped_tables != self.catalog.skipped:
            for name in self.catalog.skipped:
                log.warning("capture: table %s has no primary key and no replica identity: skipped "
                            "(--keyless-tables skip)", name)  # fmt: skip
            self.stats.skipped_tables = list(self.catalog.skipped)
        # Managed publications hold every captured table but partitioned parents (published through
        # their partitions) and unlogged tables (no WAL): only a user's publication can miss one.
        pubs = self.publications
        if pubs is not None and pubs.mode is PublicationMode.DISABLED and self.stats.unpublished_tables != (
            self.catalog.unpublished
        ):
            for name in self.catalog.unpublished:
                if name not in self.stats.unpublished_tables:
                    log.warning("capture: table %s is not in publication %s: not captured (add it: "
                                "ALTER PUBLICATION %s ADD TABLE %s)", name, pubs.name, pubs.name, name)  # fmt: skip
            self.stats.unpublished_tables = list(self.catalog.unpublished)
        if self.stats.generated_columns_left_out != self.catalog.generated_left_out:
            new = [c for c in self.catalog.generated_left_out if c not in self.stats.generated_columns_left_out]
            if new:
                log.warning("capture: stored generated column%s %s not captured: %s", "s" if len(new) > 1 else "",
                            ", ".join(new), self._generated_left_out_reason())  # fmt: skip
            self.stats.generated_columns_left_out = list(self.catalog.generated_left_out)

    def _generated_left_out_reason(self) -> str:
        pubs = self.publications
        if self.catalog.server_version < GENERATED_COLUMNS_SINCE or pubs is None:
            return "pgoutput sends them from PostgreSQL 18 (publish_generated_columns), not before"
        return (f"publication {pubs.name} does not publish them (ALTER PUBLICATION {pubs.name} SET "
                "(publish_generated_columns = stored), or name them in its column list)")  # fmt: skip


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__
