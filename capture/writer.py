"""The connector's open log transaction: events waiting for the sink, their position, and the key state.

Sources (snapshot, streaming) add events here as they build them; the writer keeps them
per topic in order, creates topics on first sight (and brings the key state of a topic
that already has data up to date before anything new is written to it), and on
:meth:`LogWriter.commit` hands the whole batch plus the position record to the sink in
one atomic commit, then commits the key state with the offsets the sink reported.

Memory is O(batch): :meth:`LogWriter.send_pending` appends what is buffered without
committing (a snapshot, a TRUNCATE's tombstones, a huge source transaction), and the
key state flushes its own buffer into its open SQLite transaction.

Committing behind: with a sink whose commit waits on a broker (Kafka: the flush of the batch's last records, then
EndTxn), streaming hands the commit to a committer thread (:meth:`LogWriter.commit_behind`) and decodes the next
batch meanwhile, into memory only: the sink is not touched until that commit returned (the next transaction's
first record is sent after it, so the positions follow commit order), the key state stages the next batch's
changes (capture.keystate, :meth:`~capture.keystate.KeyState.hold`), and the position is reported stored (and the
slot confirmed) only once the commit returned (:attr:`LogWriter.on_settled`). At most one commit is in flight; any
use of the sink or of the key state's SQLite first waits for it (:meth:`LogWriter.settle`), and its failure is
raised there, in the connector thread.

Thread-safety: none; owned by the connector thread (during a snapshot one worker thread appends for it, one batch
at a time, while it does not use the sink: :class:`BackgroundAppends`; while streaming into a sink that
``commits_behind``, one committer thread runs one commit at a time while the connector thread leaves the sink
alone).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import orjson
import pyarrow as pa

from capture.config import CaptureConfig
from capture.converters import ValueConverter
from capture.events import TOAST_MIN_ROW_BYTES, Event, ToastCache
from capture.keystate import OUTBOX_TOPIC, TABLE_TOPIC, Change, KeyState
from capture.shapes import Shape
from capture.sinks import Sink, TopicRecords, TopicSpec
from capture.tables import TableInfo
from eventstore.errors import ProducerFencedError
from schemas.position import POSITIONS_TOPIC, SourcePosition, connector_key
from schemas.starts import STARTS_TOPIC, SchemaStart, latest_starts

Settled = Callable[[SourcePosition | None], None]

log = logging.getLogger("capture.writer")

RECORD_OVERHEAD = 24  # rough bytes per record beyond key and value, for batch sizing
# Streaming: the open batch is appended (queued: the sink writes and syncs it in the background) each time it
# holds this much, rather than all at once at the commit, which then waits only for the last part (see
# :meth:`LogWriter.append_ahead`). 0: appended at the commit only.
APPEND_AHEAD_BYTES = 1 << 20
# where a JSON envelope's ``source`` ends (capture.events renders it so): its commit LSN and event index
_SOURCE_POSITION = re.compile(rb'"source":\{.*?"commit_lsn":(\d+),"lsn":\d+,"event_index":(\d+)\}')


def read_schema_starts(sink: Sink) -> dict[tuple[str, int], SchemaStart]:
    """Where each value schema version started, per (subject, version): the committed records of
    :data:`STARTS_TOPIC` (none when the topic does not exist)."""
    records: list[tuple[bytes | None, bytes | None]] = []
    for partition, end in sorted(sink.end_offsets(STARTS_TOPIC).items()):
        for batch in sink.read(STARTS_TOPIC, partition, 0, end):
            records.extend(zip(batch.keys, batch.values, strict=True))
    return latest_starts(records)


class LogWriter:
    """Batches events into log transactions through a :class:`capture.sinks.Sink`."""

    def __init__(self, config: CaptureConfig, sink: Sink, keystate: KeyState, converter: ValueConverter) -> None:
        self.config = config
        self.sink = sink
        self.keystate = keystate
        self.converter = converter
        self.position_key = connector_key(config.topic_prefix, config.slot)
        self._records: dict[str, TopicRecords] = {}
        self._tables_by_topic: dict[str, TableInfo] = {}
        self._known: set[str] = set()
        self._written: dict[tuple[str, int], int] = {}
        # catch-up: per table topic, the latest whole row image read back ((commit LSN, event index), its columns)
        # (Avro: and their types as written; JSON: None, the catalog's)
        self._shapes_read: dict[str, tuple[tuple[int, int], tuple[str, ...], tuple[str, ...] | None]] = {}
        self.in_txn = False  # a transaction is open: events buffered or appended, not committed
        self.bytes = 0  # buffered since the last append
        self.events = 0
        self.appended_bytes = 0  # appended in the open transaction before what is buffered (append_ahead)
        self.appended_events = 0
        self.started = 0.0
        self.commits = 0
        # committing behind (see the module docstring): the commit in flight, the position and offsets it stores
        self.on_settled: Settled | None = None  # told each position committed behind, once it is stored
        self._behind: Future[dict[tuple[str, int], int]] | None = None
        self._behind_position: SourcePosition | None = None
        self._behind_written: dict[tuple[str, int], int] = {}
        self._committer: ThreadPoolExecutor | None = None
        self._sink_open = False  # the open transaction has begun in the sink (deferred while a commit is in flight)

    # ------------------------------------------------------------------ topics

    def ensure_positions_topic(self) -> None:
        self._ensure(POSITIONS_TOPIC, TopicSpec(compact=True, partitions=1))

    def load_schema_starts(self) -> None:
        """Avro: the value schema versions whose first event the log holds (schemas.starts), read from
        :data:`STARTS_TOPIC` (created on first use); each version first written from now on is recorded there, in
        the log transaction of its first event (:meth:`commit`)."""
        book = self.converter.starts
        if book is None:
            return
        self.settle()
        if STARTS_TOPIC not in self._known:
            self._ensure(STARTS_TOPIC, TopicSpec(compact=True, partitions=1))
        book.load(list(read_schema_starts(self.sink).values()))

    def ensure_table_topic(self, table: TableInfo, topic: str) -> None:
        """A table's topic: compacted when the table has a key, delete-policy when it is keyless."""
        if topic in self._known:
            return
        spec = TopicSpec(compact=not table.keyless, partitions=self.config.partitions, keyless=table.keyless)
        self._ensure(topic, spec)
        if not table.keyless:
            self._tables_by_topic[topic] = table
            self._track(topic, TABLE_TOPIC)

    def ensure_outbox_topic(self, topic: str) -> None:
        """An events topic of outbox routing: facts, never compacted, kept forever."""
        if topic in self._known:
            return
        spec = TopicSpec(compact=False, partitions=self.config.partitions, overrides={"retention_ms": "-1"})
        self._ensure(topic, spec)
        self._track(topic, OUTBOX_TOPIC)

    def ensure_schema_changes_topic(self, topic: str) -> None:
        """``<prefix>.schema_changes`` (capture.schema_changes): a history in DDL order, one partition, never
        compacted, kept forever (as Debezium's schema history topic)."""
        if topic not in self._known:
            self._ensure(topic, TopicSpec(compact=False, partitions=1, overrides={"retention_ms": "-1"}))

    def ensure_topic(self, topic: str, *, compact: bool) -> None:
        """A connector topic that has no key state (transaction metadata, logical messages)."""
        if topic not in self._known:
            self._ensure(topic, TopicSpec(compact=compact, partitions=self.config.partitions))

    def _ensure(self, topic: str, spec: TopicSpec) -> None:
        self.settle()
        self.sink.ensure_topic(topic, spec)
        self._known.add(topic)

    def _track(self, topic: str, kind: str) -> None:
        self.settle()
        self.keystate.track(topic, kind, self.sink.topic_incarnation(topic))
        self.keystate.catch_up(self.sink, topic, self.interpret)
        self._caught_up_shape(topic)

    def catch_up_tracked(self, tables: Iterable[TableInfo], topic_of: Any) -> None:
        """At start: bring the key state of every known topic up to the log (only what was appended since)."""
        self.settle()
        for table in tables:
            if not table.keyless:
                self._tables_by_topic.setdefault(topic_of(table), table)
        for topic, kind in self.keystate.tracked().items():
            if self.sink.topic_incarnation(topic) is None:
                continue  # deleted from the log: tracked again (from empty) when it is created
            self.keystate.track(topic, kind, self.sink.topic_incarnation(topic))
            self.keystate.catch_up(self.sink, topic, self.interpret)
            self._caught_up_shape(topic)

    def _caught_up_shape(self, topic: str) -> None:
        """After a catch-up that read whole row images of a table topic: the table's shape at the latest of them
        (capture.shapes; a key state rebuilt, or behind the log after a crash, has none or an older one)."""
        latest = self._shapes_read.pop(topic, None)
        table = self._tables_by_topic.get(topic)
        if latest is None or table is None:
            return
        (commit_lsn, _), names, written = latest
        if written is None:  # JSON: the catalog's types (a column it lacks, no type)
            types = {c.name: c.type_name for c in table.columns}
            written = tuple(types.get(n, "") for n in names)
        shape = Shape.of(names, written, table.key)
        self.keystate.put_shape(topic, shape.to_json(commit_lsn))

    def interpret(self, topic: str, key: bytes | None, value: bytes | None) -> Change:
        """What a stored record says about its key (capture.keystate's catch-up)."""
        if key is None:
            return None
        if value is None:
            return ("delete", None)
        table = self._tables_by_topic.get(topic)
        if table is None:  # an outbox events topic (or a table not captured any more: liveness only)
            if topic.startswith(f"{self.config.outbox_topic_prefix}."):
                version = orjson.loads(value).get("version")
                return ("route", int(version)) if isinstance(version, int) else None
            op = orjson.loads(value).get("op") if value[:1] == b"{" else "u"
            return ("delete", None) if op == "d" else (None if op == "t" else ("put", None))
        op, after = self.converter.read_change(table, value)
        if after is not None and op in ("c", "r", "u") and value[:1] == b"{":
            self._shape_read(topic, value, after)
        elif value[:1] == b"\x00" and op in ("c", "r", "u", "d"):  # Avro: written under its shape's schema
            written = self.converter.written_shape()
            if written is not None:
                self._shape_written(topic, *written)
        if op == "d":
            return ("delete", None)
        if op == "t":
            return None  # the tombstones that follow it remove the keys
        # the TOAST-able values, and those of columns the catalog does not know (renamed or dropped since: a
        # fill looks for a renamed column's value under its earlier names too, capture.shapes)
        values = {c: v for c, v in after.items() if (c in table.toastable_columns or c not in table.column_names)
                  and c not in table.key} if after else {}  # fmt: skip
        return ("put", values if values and ToastCache.size_of(values) >= TOAST_MIN_ROW_BYTES else None)

    def _shape_read(self, topic: str, value: bytes, after: dict[str, Any]) -> None:
        """A whole row image read back (JSON): the table's columns at its position, kept when the latest."""
        found = _SOURCE_POSITION.match(value, max(0, value.rfind(b'"source":')))  # the envelope's: the last
        if found is None:
            return
        position = (int(found[1]), int(found[2]))
        latest = self._shapes_read.get(topic)
        if latest is None or latest[0] <= position:
            self._shapes_read[topic] = (position, tuple(after), None)

    def _shape_written(self, topic: str, position: tuple[int, int], names: tuple[str, ...],
                       types: tuple[str, ...]) -> None:  # fmt: skip
        """An Avro change read back: the columns and types of the schema it was written with (its shape)."""
        latest = self._shapes_read.get(topic)
        if latest is None or latest[0] <= position:
            self._shapes_read[topic] = (position, names, types)

    # ------------------------------------------------------------------ the batch

    def begin(self) -> None:
        """Open a transaction; while a commit is in flight, in memory only (the sink's begins once it returned)."""
        if not self.in_txn:
            self.in_txn = True
            self.started = time.monotonic()
            if self._behind is None:
                self._begin_sink()

    def _begin_sink(self) -> None:
        self.sink.begin()
        self._sink_open = True  # (before the key state's begin: a failure there still aborts the sink's)
        self.keystate.begin()

    def _records_of(self, topic: str) -> TopicRecords:
        """The open batch's records of ``topic`` (a transaction is begun first if none is open)."""
        if not self.in_txn:
            self.begin()
        records = self._records.get(topic)
        if records is None:
            records = self._records[topic] = TopicRecords()
        return records

    def add(self, event: Event) -> None:
        records = self._records_of(event.topic)
        if event.headers is not None and records.headers is None:
            records.lift_chunks()
            records.headers = [None] * len(records.values)
        records.keys.append(event.key)
        records.values.append(event.value)
        if records.headers is not None:
            records.headers.append(event.headers)
        self.bytes += (len(event.key) if event.key else 0) + (len(event.value) if event.value else 0) + RECORD_OVERHEAD
        self.events += 1

    def add_many(self, topic: str, keys: list[bytes | None], values: list[bytes | None], nbytes: int) -> None:
        """Events of one topic without headers, in order (the native core's output); ``nbytes``: their keys' and
        values' bytes."""
        records = self._records_of(topic)
        if records.headers is not None:
            records.headers.extend([None] * len(values))
        records.keys.extend(keys)
        records.values.extend(values)
        self.bytes += nbytes + RECORD_OVERHEAD * len(values)
        self.events += len(values)

    def add_arrays(self, topic: str, keys: pa.Array, values: pa.Array, nbytes: int) -> None:
        """Events of one topic without headers as Arrow binary arrays (snapshot reads encoded in bulk), in order;
        ``nbytes``: their keys' and values' bytes."""
        records = self._records_of(topic)
        records.add_arrays(keys, values)
        self.bytes += nbytes + RECORD_OVERHEAD * len(values)
        self.events += len(values)

    @property
    def full(self) -> bool:
        """The buffer holds ``batch_bytes`` or ``batch_events``: time to append it (or commit it)."""
        return self.bytes >= self.config.batch_bytes or self.events >= self.config.batch_events

    @property
    def txn_full(self) -> bool:
        """The open transaction holds ``batch_bytes`` or ``batch_events``, appended ahead or buffered: time to
        commit it (streaming's bound on a log transaction, whatever :meth:`append_ahead` appended of it)."""
        return (self.appended_bytes + self.bytes >= self.config.batch_bytes
                or self.appended_events + self.events >= self.config.batch_events)  # fmt: skip

    def age_ms(self) -> float:
        """How long the open transaction has been open (0 when none is)."""
        return (time.monotonic() - self.started) * 1000 if self.in_txn else 0.0

    def append_ahead(self) -> None:
        """Append the buffered events inside the open transaction once they hold :data:`APPEND_AHEAD_BYTES`.

        Streaming calls it as a log transaction fills: the sink's appends do not wait (the embedded log's
        producer writes and syncs them in its writer thread, Kafka's sends them), so that work overlaps with
        decoding the next changes instead of stalling the connector at the commit, while the walsender,
        unread, stalls too (docs/capture.md, "The pre-filled table workload"). While a commit runs behind, the
        batch stays in memory (up to ``batch_bytes``) rather than wait for it."""
        if APPEND_AHEAD_BYTES and self.bytes >= APPEND_AHEAD_BYTES and self.settle(wait=False):
            self.send_pending()

    def send_pending(self, *, also: tuple[tuple[str, int], ...] = ()) -> None:
        """Append the buffered events inside the open transaction (not committed: memory stays bounded)."""
        self.append_taken(self.take_pending(), also=also)

    def take_pending(self) -> dict[str, TopicRecords]:
        """The buffered events, handed over (the batch is empty again): for :meth:`append_taken`."""
        records, self._records = self._records, {}
        self.appended_bytes += self.bytes
        self.appended_events += self.events
        self.bytes = self.events = 0
        return records

    def append_taken(self, records: dict[str, TopicRecords], *, also: tuple[tuple[str, int], ...] = ()) -> None:
        """Append events taken with :meth:`take_pending` inside the open transaction (see :class:`BackgroundAppends`
        for the one other thread that may call this)."""
        if records:
            self.settle()
            for tp, end in self.sink.append(records, also=also).items():
                self._written[tp] = max(end, self._written.get(tp, 0))

    def commit(self, position: SourcePosition | None) -> bool:
        """Append the batch and its position and commit, durably; then the key state. False: nothing open."""
        self.settle()
        if not self.in_txn:
            return False
        self._send_all(position)
        late = self.sink.commit(POSITIONS_TOPIC, self.position_key, None if position is None else position.to_json())
        self.in_txn = self._sink_open = False
        self.appended_bytes = self.appended_events = 0
        written, self._written = self._written, {}
        self._committed(written, late)
        self.keystate.commit(written)
        return True

    def commit_behind(self, position: SourcePosition | None) -> bool:
        """:meth:`commit`, with the sink's commit left to the committer thread (a sink that ``commits_behind``; the
        module docstring): returns once it is under way; :attr:`on_settled` is told ``position`` once it is stored
        (by the next :meth:`settle`). False: nothing open."""
        if not self.sink.commits_behind:
            raise ValueError(f"{self.sink.describe()} does not commit behind: commit() it")
        self.settle()
        if not self.in_txn:
            return False
        self._send_all(position)
        self.keystate.hold(self.settle)
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-commit")
        self._behind_position = position
        self._behind_written, self._written = self._written, {}
        self._behind = self._committer.submit(
            self.sink.commit, POSITIONS_TOPIC, self.position_key, None if position is None else position.to_json()
        )
        self.in_txn = self._sink_open = False
        self.appended_bytes = self.appended_events = 0
        return True

    @property
    def committing(self) -> bool:
        """A commit is in flight (:meth:`commit_behind`)."""
        return self._behind is not None

    def settle(self, *, wait: bool = True) -> bool:
        """Wait for the commit in flight, if any (``wait`` False: only if it returned already), and finish it: the
        key state's commit, :attr:`on_settled`; then the open transaction, if any, begins in the sink. Its failure
        is raised here, the key state rolled back: the caller aborts, as after a failed :meth:`commit`. True:
        nothing is in flight now."""
        behind = self._behind
        if behind is None:
            return True
        if not wait and not behind.done():
            return False
        try:
            late = behind.result()
        except BaseException:
            if not behind.done():  # interrupted while waiting: the commit still runs, and abort() waits for it
                raise
            self._behind = None
            self._sink_open = True  # the failed commit's transaction is the sink's to abort (abort())
            self.keystate.abort()
            raise
        self._behind = None
        self._settled(late)
        if self.in_txn and not self._sink_open:
            self._begin_sink()
        return True

    def _settled(self, late: dict[tuple[str, int], int]) -> None:
        """The commit in flight returned: the key state commits what it held, and the position is stored."""
        written, self._behind_written = self._behind_written, {}
        position, self._behind_position = self._behind_position, None
        self._committed(written, late)
        self.keystate.commit_held(written)
        if self.on_settled is not None:
            self.on_settled(position)

    def _send_all(self, position: SourcePosition | None) -> None:
        """The batch's last part appended, with the starts of value schema versions it holds the first events of."""
        book = self.converter.starts
        starts = book.committing() if book is not None else []
        if starts:  # the first events of value schema versions are in this transaction: their starts too
            if STARTS_TOPIC not in self._known:
                self._ensure(STARTS_TOPIC, TopicSpec(compact=True, partitions=1))
            records = self._records_of(STARTS_TOPIC)
            for start in starts:
                records.keys.append(start.key)
                records.values.append(start.to_json())
                if records.headers is not None:
                    records.headers.append(None)
        if not self._sink_open:  # nothing appended yet: the transaction begins in the sink now
            self._begin_sink()
        self.send_pending(also=((POSITIONS_TOPIC, 0),) if position is not None else ())  # one coordinator write

    def _committed(self, written: dict[tuple[str, int], int], late: dict[tuple[str, int], int]) -> None:
        """A commit returned: ``written`` gets the offsets it reported (``late``)."""
        for tp, end in late.items():
            written[tp] = max(end, written.get(tp, 0))
        if self.converter.starts is not None:
            self.converter.starts.committed()
        self.commits += 1

    def abort(self) -> None:
        """Forget the open transaction (the sink aborts it; a failed abort is left to the next start).

        Raises :class:`ProducerFencedError` when the abort finds this instance fenced: another instance
        took over, and opening the sink again would fence that one in turn (the two would take turns).
        """
        behind, self._behind = self._behind, None
        if behind is not None:  # the sink is one thread's at a time: the commit in flight ends first
            try:
                late = behind.result()
            except Exception as e:
                log.warning("capture: the log commit in flight failed as well: %s", e)
                self._sink_open = True  # its transaction is aborted below
            else:
                self._settled(late)  # stored: the key state keeps it
        self._behind_position = None
        self._behind_written = {}
        self._records = {}
        self.bytes = self.events = self.appended_bytes = self.appended_events = 0
        self._written = {}
        if self.converter.starts is not None:
            self.converter.starts.aborted()
        self.keystate.abort()
        self._known.clear()  # topics first tracked in the aborted transaction are tracked again on next sight
        self.in_txn = False
        if self._sink_open:
            self._sink_open = False
            try:
                self.sink.abort()
            except ProducerFencedError:
                raise
            except Exception as e:  # the log may be gone or its disk full: the next open aborts it
                log.warning("capture: abort after failure failed (%s); the next start aborts it", e)

    def close(self) -> None:
        """Stop the committer thread (after the last commit, or an abort)."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None


class BackgroundAppends:
    """A big transaction's appends made by one worker thread while the connector thread prepares the next batch.

    The initial snapshot is one log transaction of every table's reads; appending a batch (encoding record
    batches, writing them, the embedded log's sync of each) took a third of the connector's time while its
    readers waited. With this, the connector hands a full batch over (:meth:`submit`) and goes on reading;
    the worker appends it (the embedded log's sink only encodes it there: its producer's writer thread writes
    and syncs the record batches meanwhile, see eventstore.producer's queued appends). At most one append is
    in flight, so batches keep their order and memory stays at two batches (and the producer's queue);
    nothing is visible before the transaction's commit either way. The sink is used by one
    thread at a time: the connector thread calls :meth:`wait` before it touches the sink itself (creating a
    topic, committing, aborting), and :meth:`close` before the transaction ends. An append's failure is
    raised in the connector thread by the next :meth:`submit` or :meth:`wait`.

    Thread-safety: methods are called by the connector thread only; the worker runs ``append_taken``.
    """

    def __init__(self, writer: LogWriter) -> None:
        self.writer = writer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-appends")
        self._in_flight: Future[None] | None = None

    def submit(self) -> None:
        """Append the writer's buffered events in the worker (after the append before, if any, is done)."""
        self.wait()
        self._in_flight = self._pool.submit(self.writer.append_taken, self.writer.take_pending())

    def wait(self) -> None:
        """Until no append is in flight; its failure is raised here."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """Wait for the last append and stop the worker. While another error propagates, an append's failure
        is logged rather than raised over it (the transaction is aborted either way)."""
        try:
            if sys.exc_info()[1] is None:
                self.wait()
            else:
                try:
                    self.wait()
                except Exception as e:  # the error already propagating is the one to report
                    log.warning("capture: a background append failed as well: %s", e)
        finally:
            self._pool.shutdown(wait=True)
