"""``follow`` without Spark: the ``live`` engine, a view applied within milliseconds of capture.

The same views (:mod:`projections.views`), the same tables, the same checkpoint records
(:mod:`projections.store`) and the same transaction protocol as the Spark engine
(:mod:`projections.follow`); only the reading differs: a :class:`~eventstore.consumer.Consumer`
(read_committed) over the view's partitions, woken by the log's change notifications
(:class:`~eventstore.notify.ChangeWaiter`: inotify on the partitions' directories, on
capture's position topic and on ``_topics/``) instead of a micro-batch timer.

One cycle, whenever the log may have changed:

1. take a read-your-writes **sample** (capture's stored position, *then* the last stable
   offsets of the view's partitions: :class:`~projections.consistency.ReachedTracker`);
2. read what is readable from the consumer's positions (at most ``max_records_per_batch``);
3. in **one** Postgres transaction: lock the projection's run and checkpoint rows; if they
   are not what this job last stored (a rebuild, or another job, moved them) roll back and
   restart from Postgres's offsets; else apply the records (:mod:`projections.apply`),
   store the positions reached as the next offsets, count the batch, and raise the
   reached LSN to the samples the new checkpoints cover (the notification that wakes
   :func:`~projections.consistency.wait_for` is sent on commit).

With nothing new to read, samples the stored checkpoints already cover are promoted
(capture stored a position past transactions that touched other topics). A kill at any
point leaves all of a batch or none of it: the positions a restart reads are the
checkpoints committed with the view rows. A fold that raises on an event
(:class:`~projections.progress.FoldFailed`) rolls its batch back and stops the job.

Reads the embedded log only (as the Spark engine's source). Avro-framed keys and values
(capture's ``--value-format avro``) are read as the JSON capture writes otherwise.

Thread-safety: one thread runs a :class:`LiveFollower`; ``stats`` may be read by others,
:meth:`LiveFollower.wakeup` called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

import psycopg

from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import ConfigError, TidelineError
from eventstore.log import Log
from eventstore.notify import ChangeWaiter
from eventstore.schema_store import FramedDecoder
from eventstore.topic import TOPICS_DIR
from projections import store
from projections.apply import LogRecord, apply_records
from projections.consistency import ReachedTracker, Sample
from projections.progress import BatchReport, FollowStats
from projections.views import View, ViewCatalog
from schemas.position import POSITIONS_TOPIC

DEFAULT_MAX_RECORDS_PER_BATCH = 5_000
WAIT_SLICE_S = 0.25  # a waiting job re-checks ``stop`` (and the log, to be safe) at least this often

logger = logging.getLogger(__name__)


class _CheckpointsMoved(TidelineError):
    """The stored checkpoints are not what this job last stored: restart from them."""


class _Decoder:
    """Capture's Avro framing → its JSON (a fresh registry view once, when a schema id is missing:
    capture registers schemas as it meets new table shapes)."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self._decoder: FramedDecoder | None = None

    def __call__(self, data: bytes | None, what: str, tp: TopicPartition, offset: int) -> bytes | None:
        if data is None or data[:1] != b"\x00":
            return data  # JSON (or raw): as stored
        for fresh in (False, True):
            if self._decoder is None or fresh:
                self._decoder = FramedDecoder(self.log, lambda note: None)
            decoded, schema_id = self._decoder.decode(data)
            if schema_id is not None:
                return decoded
        raise ConfigError(
            f"{tp.topic}[{tp.partition}] offset {offset}: the {what} is framed Avro but does not decode with the "
            f"registry of {self.log.path} (topic __schemas)"
        )


class LiveFollower:
    """One follow job on the ``live`` engine (see the module docstring).

    >>> job = LiveFollower(VIEWS, "users", log_dir=Path("log"), dsn=dsn)   # doctest: +SKIP
    >>> job.run(once=True).events
    """

    def __init__(
        self,
        catalog: ViewCatalog,
        name: str,
        *,
        log_dir: Path,
        dsn: str,
        max_records_per_batch: int | None = None,
        on_batch: BatchReport = lambda _: None,
    ) -> None:
        self.view: View = catalog[name]
        self.log_dir = log_dir
        self.dsn = dsn
        self.max_records = max_records_per_batch or DEFAULT_MAX_RECORDS_PER_BATCH
        if self.max_records < 1:
            raise ConfigError(f"max records per batch must be ≥ 1, not {self.max_records}")
        self.on_batch = on_batch
        self.stats = FollowStats(self.view.name)
        self.tracker = ReachedTracker(log_dir, self.view.topics)
        self.expected: store.Offsets = {}  # the checkpoints as this job last read or stored them
        self._waiter: ChangeWaiter | None = None

    # ------------------------------------------------------------------ the job

    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> FollowStats:
        """Follow until ``stop`` is set (or, ``once``, until everything readable now is applied)."""
        stop = stop or threading.Event()
        status, error = "done", None
        with Log(self.log_dir) as log:  # the log may be new (nothing captured yet)
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                store.start_run(conn, self.view.name, "follow")
            try:
                with (
                    psycopg.connect(self.dsn, autocommit=True) as conn,
                    ChangeWaiter() as waiter,
                    Consumer(log, enable_auto_commit=False, auto_offset_reset="none") as consumer,
                ):
                    self._waiter = waiter
                    self._follow(log, conn, consumer, waiter, once, stop)
            except BaseException as e:
                status, error = "failed", f"{type(e).__name__}: {e}"[:2000]
                raise
            finally:
                self._waiter = None
                self.tracker.close()
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    store.finish_run(conn, self.view.name, status, error)
        return self.stats

    def wakeup(self) -> None:
        """End the current wait at once (call after setting ``stop``); any thread."""
        waiter = self._waiter
        if waiter is not None:
            with suppress(ValueError):  # closed meanwhile
                waiter.wakeup()

    def _follow(
        self, log: Log, conn: store.Conn, consumer: Consumer, waiter: ChangeWaiter, once: bool, stop: threading.Event
    ) -> None:
        decode = _Decoder(log)
        self._restart(log, conn, consumer)
        target = consumer.end_offsets(consumer.assignment()) if once else None
        while not stop.is_set():
            self._assign_new_topics(log, conn, consumer)
            with suppress(OSError):  # a directory vanished: watched again next cycle
                waiter.set_watched(self._watched(log, consumer))  # watch first, then read
            sample = self.tracker.sample()
            starts = self._positions(consumer)
            records = self._read(consumer, decode)
            ends = self._positions(consumer)
            try:
                if records or ends != starts:
                    self._commit(conn, records, ends)
                else:
                    self._promote_idle(conn, sample)
            except _CheckpointsMoved as moved:
                logger.info("projection=%s restart: %s", self.view.name, moved)
                self.stats.restarts += 1
                self._restart(log, conn, consumer)
                continue
            if target is not None and all(consumer.position(tp) >= o for tp, o in target.items()):
                return
            if len(records) < self.max_records:
                waiter.wait(WAIT_SLICE_S)

    # ------------------------------------------------------------------ positions

    def _restart(self, log: Log, conn: store.Conn, consumer: Consumer) -> None:
        """Positions from Postgres's checkpoints (the truth); the earliest offset where there is none."""
        self.expected = store.offsets_of(store.read_checkpoints(conn, self.view.name))
        self.stats.applied = self.expected
        existing = set(log.topics())
        wanted = [
            TopicPartition(t, p) for t in self.view.topics if t in existing for p in range(log.topic(t).partitions)
        ]
        consumer.assign(wanted)
        self._seek(consumer, wanted)

    def _seek(self, consumer: Consumer, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            stored = self.expected.get(tp.topic, {}).get(tp.partition)
            if stored is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, stored)

    def _assign_new_topics(self, log: Log, conn: store.Conn, consumer: Consumer) -> None:
        """A view topic that appeared since (an aggregate's first event) is read from its start."""
        assigned = {tp.topic for tp in consumer.assignment()}
        missing = [t for t in self.view.topics if t not in assigned]
        if not missing:
            return
        existing = set(log.topics())
        new = [TopicPartition(t, p) for t in missing if t in existing for p in range(log.topic(t).partitions)]
        if new:
            consumer.assign([*consumer.assignment(), *new])  # keeps the positions of the others
            self._seek(consumer, new)

    def _watched(self, log: Log, consumer: Consumer) -> list[Path]:
        dirs = [log.partition(tp.topic, tp.partition).directory for tp in consumer.assignment()]
        if POSITIONS_TOPIC in log.topics():  # capture stored a position: the reached LSN may move
            dirs.append(log.partition(POSITIONS_TOPIC, 0).directory)
        topics_dir = log.path / TOPICS_DIR
        if topics_dir.is_dir():  # a view topic may appear
            dirs.append(topics_dir)
        return dirs

    @staticmethod
    def _positions(consumer: Consumer) -> store.Offsets:
        out: store.Offsets = {}
        for tp in consumer.assignment():
            out.setdefault(tp.topic, {})[tp.partition] = consumer.position(tp)
        return out

    def _read(self, consumer: Consumer, decode: _Decoder) -> list[LogRecord]:
        """What is readable now, at most ``max_records``, in offset order per partition."""
        records: list[LogRecord] = []
        while len(records) < self.max_records:
            polled = consumer.poll(timeout_ms=0, max_records=self.max_records - len(records))
            if not polled:
                break
            for r in polled:
                tp = TopicPartition(r.topic, r.partition)
                key = decode(r.key, "key", tp, r.offset)
                value = decode(r.value, "value", tp, r.offset)
                records.append(LogRecord(r.topic, r.partition, r.offset, key, value))
        return records

    # ------------------------------------------------------------------ one batch

    def _commit(self, conn: store.Conn, records: list[LogRecord], ends: store.Offsets) -> None:
        began = time.monotonic()
        with conn.pipeline(), conn.transaction():  # writes go in one round trip; reads sync as they must
            stored = store.offsets_of(store.read_checkpoints(conn, self.view.name, lock=True))
            if stored != self.expected:
                raise _CheckpointsMoved(f"checkpoints {stored} are not the {self.expected} this job stored")
            lsns = apply_records(conn, self.view, records) if records else {}
            store.write_checkpoints(conn, self.view.name, ends, lsns)
            store.add_progress(conn, self.view.name, len(records), 1)
            merged = {t: dict(per) for t, per in stored.items()}
            for t, per in ends.items():
                for p, o in per.items():
                    merged.setdefault(t, {})[p] = max(o, merged.get(t, {}).get(p, 0))
            reached = self.tracker.promote(merged)
            if reached:
                store.advance_reached(conn, self.view.name, reached)
        self.expected = merged
        self.stats.committed(len(records), time.monotonic() - began, merged, reached)
        self.on_batch(self.stats)

    def _promote_idle(self, conn: store.Conn, sample: Sample) -> None:
        """Nothing new in the view's partitions: the stored checkpoints may cover newer samples."""
        if not self.tracker.pending or sample.lsn <= self.stats.reached_lsn:
            return
        applied = store.offsets_of(store.read_checkpoints(conn, self.view.name))
        reached = self.tracker.promote(applied)
        if reached:
            store.advance_reached(conn, self.view.name, reached)
            self.stats.reached_lsn = max(self.stats.reached_lsn, reached)


def follow_live(
    catalog: ViewCatalog,
    name: str,
    *,
    log_dir: Path,
    dsn: str,
    once: bool = False,
    stop: threading.Event | None = None,
    max_records_per_batch: int | None = None,
) -> FollowStats:
    """Follow view ``name`` on the live engine (see :class:`LiveFollower`); ``once``: apply what
    is readable now, then return."""
    job = LiveFollower(catalog, name, log_dir=log_dir, dsn=dsn, max_records_per_batch=max_records_per_batch)
    return job.run(once=once, stop=stop)
