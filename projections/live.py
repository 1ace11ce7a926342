"""``follow`` without Spark: the ``live`` engine, a view applied within milliseconds of capture.

The same views (:mod:`projections.views`), the same tables, the same checkpoint records
(:mod:`projections.store`) and the same transaction protocol as the Spark engine
(:mod:`projections.follow`); only the reading differs: a
:class:`~projections.sources.LiveReader` of the view's partitions (read_committed) that
waits for the log to change instead of a micro-batch timer — on the embedded log a
:class:`~eventstore.consumer.Consumer` woken by the log's change notifications (inotify on
the partitions' directories, on capture's position topic and on ``_topics/``); on Kafka a
librdkafka consumer assigned to the partitions and seeked to the checkpoints, which a
record of the view or a new capture position wakes (:mod:`projections.kafka_source`).

One cycle, whenever the log may have changed:

1. take a read-your-writes **sample** (capture's stored position, *then* the log end
   offsets of the view's partitions: :class:`~projections.consistency.ReachedTracker`);
2. read what is readable from the reader's positions (at most ``max_records_per_batch``);
3. in **one** Postgres transaction: lock the projection's run and checkpoint rows; if they
   are not what this job last stored (a rebuild, or another job, moved them) roll back and
   restart from Postgres's offsets; else apply the records (:mod:`projections.apply`),
   store the positions reached as the next offsets, count the batch, and raise the
   reached LSN to the samples the new checkpoints cover (the notification that wakes
   :func:`~projections.consistency.wait_for` is sent on commit).

With nothing new to read, samples the stored checkpoints already cover are promoted
(capture stored a position past transactions that touched other topics). A kill at any
point leaves all of a batch or none of it: the positions a restart reads are the
checkpoints committed with the view rows (Kafka's consumer groups are not used: nothing
is committed to Kafka). A fold that raises on an event
(:class:`~projections.progress.FoldFailed`) rolls its batch back and stops the job.

Avro-framed keys and values (capture's ``--value-format avro``) are read as the JSON
capture writes otherwise (on the embedded log, through its schema registry).

Thread-safety: one thread runs a :class:`LiveFollower`; ``stats`` may be read by others,
:meth:`LiveFollower.wakeup` called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import psycopg

from eventstore.errors import ConfigError, TidelineError
from projections import store
from projections.apply import LogRecord, apply_records
from projections.consistency import ReachedTracker, Sample
from projections.progress import BatchReport, FollowStats
from projections.sources import LiveReader, LogSource, open_source
from projections.views import View, ViewCatalog

DEFAULT_MAX_RECORDS_PER_BATCH = 5_000
WAIT_SLICE_S = 0.25  # a waiting job re-checks ``stop`` (and the log, to be safe) at least this often

logger = logging.getLogger(__name__)


class _CheckpointsMoved(TidelineError):
    """The stored checkpoints are not what this job last stored: restart from them."""


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
        dsn: str,
        log_dir: Path | None = None,
        source: LogSource | None = None,
        max_records_per_batch: int | None = None,
        on_batch: BatchReport = lambda _: None,
    ) -> None:
        """Reads ``source``, or the embedded log at ``log_dir`` (created if missing, kept open by
        this job until :meth:`run` returns)."""
        if (log_dir is None) == (source is None):
            raise ValueError("give exactly one of log_dir (the embedded log) and source")
        self.view: View = catalog[name]
        self._owned = source is None
        self.source: LogSource = source or open_source(log_dir=log_dir, create=True)
        self.dsn = dsn
        self.max_records = max_records_per_batch or DEFAULT_MAX_RECORDS_PER_BATCH
        if self.max_records < 1:
            raise ConfigError(f"max records per batch must be ≥ 1, not {self.max_records}")
        self.on_batch = on_batch
        self.stats = FollowStats(self.view.name)
        self.tracker = ReachedTracker(self.source, self.view.topics)
        self.expected: store.Offsets = {}  # the checkpoints as this job last read or stored them
        self._reader: LiveReader | None = None

    # ------------------------------------------------------------------ the job

    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> FollowStats:
        """Follow until ``stop`` is set (or, ``once``, until everything readable now is applied)."""
        stop = stop or threading.Event()
        status, error = "done", None
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            store.start_run(conn, self.view.name, "follow")
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                reader = self._reader = self.source.live_reader(self.view.topics)
                try:
                    self._follow(conn, reader, once, stop)
                finally:
                    self._reader = None
                    reader.close()
        except BaseException as e:
            status, error = "failed", f"{type(e).__name__}: {e}"[:2000]
            raise
        finally:
            self.tracker.close()
            if self._owned:
                self.source.close()
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                store.finish_run(conn, self.view.name, status, error)
        return self.stats

    def wakeup(self) -> None:
        """End the current wait at once (call after setting ``stop``); any thread."""
        reader = self._reader
        if reader is not None:
            reader.wakeup()

    def _follow(self, conn: store.Conn, reader: LiveReader, once: bool, stop: threading.Event) -> None:
        self._restart(conn, reader)
        target = reader.end_offsets() if once else None
        while not stop.is_set():
            reader.refresh()  # new topics assigned, watches set: before reading
            sample = self.tracker.sample()
            starts = reader.positions()
            records = reader.read(self.max_records)
            ends = reader.positions()
            try:
                if records or ends != starts:
                    self._commit(conn, records, ends)
                else:
                    self._promote_idle(conn, sample)
            except _CheckpointsMoved as moved:
                logger.info("projection=%s restart: %s", self.view.name, moved)
                self.stats.restarts += 1
                self._restart(conn, reader)
                continue
            if target is not None and _reached(ends, target):
                return
            if len(records) < self.max_records:
                reader.wait(WAIT_SLICE_S)

    # ------------------------------------------------------------------ positions

    def _restart(self, conn: store.Conn, reader: LiveReader) -> None:
        """Positions from Postgres's checkpoints (the truth); the earliest offset where there is none."""
        self.expected = store.offsets_of(store.read_checkpoints(conn, self.view.name))
        self.stats.applied = self.expected
        reader.assign(self.expected)

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


def _reached(positions: store.Offsets, target: store.Offsets) -> bool:
    return all(positions.get(t, {}).get(p, 0) >= o for t, per in target.items() for p, o in per.items())


def follow_live(
    catalog: ViewCatalog,
    name: str,
    *,
    dsn: str,
    log_dir: Path | None = None,
    source: LogSource | None = None,
    once: bool = False,
    stop: threading.Event | None = None,
    max_records_per_batch: int | None = None,
) -> FollowStats:
    """Follow view ``name`` of the embedded log at ``log_dir`` or of ``source`` on the live engine
    (see :class:`LiveFollower`); ``once``: apply what is readable now, then return."""
    job = LiveFollower(
        catalog, name, log_dir=log_dir, source=source, dsn=dsn, max_records_per_batch=max_records_per_batch
    )
    return job.run(once=once, stop=stop)
