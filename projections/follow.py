"""``follow``: keep a view up to date with Structured Streaming micro-batches, exactly once.

The query reads the view's topics (read_committed: ``spark.readStream.format("tideline")``
on the embedded log, Spark's own ``format("kafka")`` on Kafka; :mod:`projections.sources`)
from the offsets in ``projection_checkpoints`` — the Postgres checkpoint is the truth; the
Spark checkpoint under ``<checkpoint dir>/<projection>`` is kept only while it agrees
with it (otherwise it is deleted and the query starts from Postgres's offsets).

Each micro-batch (``foreachBatch``), in **one** Postgres transaction:

1. lock the projection's run and checkpoint rows; drop the batch's records at offsets
   below the stored next offsets (a batch Spark re-runs after a crash changes nothing);
2. compute and apply the batch's changes — fold views: load the touched streams' states,
   fold the new events (versions ≤ the stored one skipped), delete the streams' previous
   rows, insert the new ones; count views: additive upserts; mirrors: the batch's latest
   record per key, upserted or (tombstone, ``d``, ``t``) deleted;
3. store the batch's end offsets (read from Spark's offset log, written before the batch
   ran) and the reached LSN they imply (:mod:`projections.consistency`).

A crash anywhere leaves either all of a batch or none of it in Postgres: the views are
exactly once. The batch frame is persisted while it is used more than once.

A view that was rebuilt while a follow job ran has checkpoints *behind* the job's next
batch start; the batch raises :class:`CheckpointMoved` and the job restarts from Postgres.

A fold that raises on an event (:class:`~projections.progress.FoldFailed`) rolls the
batch's transaction back and stops the job with an error naming the view, topic,
partition, offset and the fold's error.

This is the ``spark`` engine of ``tideline project follow``: a micro-batch costs hundreds
of milliseconds here, so it suits heavy views and catching up; :mod:`projections.live` is
the millisecond engine for the same views (docs/projections-views.md, "follow engines").
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import TimestampType

from eventstore.errors import TidelineError
from projections import engine, store
from projections.apply import LocatedEvent, add_counts, apply_fold
from projections.consistency import ReachedTracker
from projections.progress import BatchReport, FoldFailed, FollowStats
from projections.sources import LogSource, open_source
from projections.views import CountView, FoldView, MirrorView, View, ViewCatalog, columns_of

IDLE_TICK_S = 0.5

logger = logging.getLogger(__name__)


class CheckpointMoved(TidelineError):
    """The view's checkpoints moved behind the running query (a rebuild): restart from Postgres."""


__all__ = ["CheckpointMoved", "FollowStats", "Follower", "follow"]


def checkpoint_path(checkpoint_dir: Path, projection: str) -> Path:
    return checkpoint_dir / re.sub(r"[^A-Za-z0-9_.-]", "_", projection)


def spark_committed_offsets(location: Path) -> store.Offsets | None:
    """The end offsets of the last batch Spark committed in its checkpoint (None: none)."""
    commits = [int(p.name) for p in (location / "commits").glob("[0-9]*")] if (location / "commits").is_dir() else []
    if not commits:
        return None
    return batch_end_offsets(location, max(commits))


def batch_end_offsets(location: Path, batch_id: int) -> store.Offsets | None:
    """Spark's offset log entry of ``batch_id``: ``v1``, metadata, then the source's offset JSON."""
    path = location / "offsets" / str(batch_id)
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    raw = json.loads(lines[2])
    return {t: {int(p): int(o) for p, o in per.items()} for t, per in raw.items()}


class Follower:
    """One follow job: the streaming query of one view and its bookkeeping (driver side)."""

    def __init__(
        self,
        spark: SparkSession,
        catalog: ViewCatalog,
        name: str,
        *,
        dsn: str,
        checkpoint_dir: Path,
        log_dir: Path | None = None,
        source: LogSource | None = None,
        trigger_seconds: float = 1.0,
        max_records_per_trigger: int | None = None,
        on_batch: BatchReport = lambda _: None,
    ) -> None:
        """Reads ``source``, or the embedded log at ``log_dir`` (created if missing, kept open by
        this job until :meth:`run` returns)."""
        if (log_dir is None) == (source is None):
            raise ValueError("give exactly one of log_dir (the embedded log) and source")
        from projections.shipping import ship_views

        self.spark = spark
        self.view: View = catalog[name]
        ship_views(spark, catalog.module)  # the executors import the catalog's module
        self._owned = source is None
        self.source: LogSource = source or open_source(log_dir=log_dir, create=True)
        self.dsn = dsn
        self.location = checkpoint_path(checkpoint_dir, self.view.name)
        self.trigger_seconds = trigger_seconds
        self.max_records_per_trigger = max_records_per_trigger
        self.on_batch = on_batch
        self.stats = FollowStats(self.view.name)
        self.tracker = ReachedTracker(self.source, self.view.topics)
        self.lock = threading.Lock()  # the tracker and stats: foreachBatch runs on a Spark thread
        self.starting: store.Offsets = {}
        self.failure: FoldFailed | None = None  # set by a batch whose fold raised: the job's error

    # ------------------------------------------------------------------ the job

    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> FollowStats:
        """Follow until ``stop`` is set (or, ``once``, until everything readable now is applied)."""
        stop = stop or threading.Event()
        missing = sorted(set(self.view.topics) - set(self.source.partition_counts(self.view.topics)))
        if missing:  # read from their start once they appear (an aggregate with no events yet)
            logger.info("projection=%s missing_topics=%s (read once they appear)", self.view.name, ",".join(missing))
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            store.start_run(conn, self.view.name, "follow")
        status, error = "done", None
        try:
            while True:
                try:
                    self._run_query(once, stop)
                    break
                except StreamingQueryException as e:
                    if self.failure is not None:
                        raise self.failure from None  # view, topic, partition, offset: not Spark's wrapping
                    if "CheckpointMoved" not in str(e):
                        raise
                    self.stats.restarts += 1
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

    def _run_query(self, once: bool, stop: threading.Event) -> None:
        self.starting = self._starting_offsets()
        frame = self.source.stream_frame(self.spark, self.view.topics, self.starting, self.max_records_per_trigger)
        writer = (
            frame.writeStream.queryName(f"follow-{self.view.name}")
            .foreachBatch(self._batch)
            .option("checkpointLocation", str(self.location))
        )
        writer = (
            writer.trigger(availableNow=True)
            if once
            else writer.trigger(processingTime=f"{self.trigger_seconds} seconds")
        )
        query = writer.start()
        try:
            while query.isActive:
                if stop.is_set():
                    query.stop()
                    break
                if query.awaitTermination(1):
                    break
                self._idle_tick()
            query.awaitTermination()  # raises the query's error, if any
        finally:
            if query.isActive:
                query.stop()
        self._idle_tick()

    def _starting_offsets(self) -> store.Offsets:
        """Postgres's checkpoints (earliest for partitions without one); a Spark checkpoint that
        disagrees with them is removed."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            stored = store.offsets_of(store.read_checkpoints(conn, self.view.name))
        self.stats.applied = stored
        counts = self.source.partition_counts(self.view.topics)  # a topic that appears later: from its earliest
        starting = {t: {p: stored.get(t, {}).get(p, -2) for p in range(n)} for t, n in counts.items()}
        if self.location.exists() and spark_committed_offsets(self.location) != {
            t: {p: o for p, o in per.items() if o >= 0} for t, per in starting.items()
        }:
            shutil.rmtree(self.location)
        return starting

    def _idle_tick(self) -> None:
        """Between batches: promote samples the stored checkpoints cover (raises reached when idle).

        ``self.lock`` is never held across a database call: a batch holds the projection's
        checkpoint rows locked in its transaction while it takes ``self.lock``, so waiting on
        those rows under ``self.lock`` would deadlock (it did, when a sample was covered
        while a batch was being applied). ``advance_reached`` only ever raises the value.
        """
        with self.lock:
            self.tracker.sample()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            applied = store.offsets_of(store.read_checkpoints(conn, self.view.name))
            with self.lock:
                reached = self.tracker.promote(applied)
            if reached:
                store.advance_reached(conn, self.view.name, reached)
                with self.lock:
                    self.stats.reached_lsn = max(self.stats.reached_lsn, reached)

    # ------------------------------------------------------------------ one micro-batch

    def _batch(self, df: DataFrame, batch_id: int) -> None:
        began = time.monotonic()
        end = batch_end_offsets(self.location, batch_id)
        if end is None:
            raise TidelineError(f"no offsets of batch {batch_id} in {self.location}/offsets")
        start = batch_end_offsets(self.location, batch_id - 1) if batch_id > 0 else None
        start = start or {t: {p: o for p, o in per.items() if o >= 0} for t, per in self.starting.items()}
        with psycopg.connect(self.dsn) as conn, conn.transaction():
            applied = store.offsets_of(store.read_checkpoints(conn, self.view.name, lock=True))
            for t, per in start.items():
                for p, o in per.items():
                    if applied.get(t, {}).get(p, 0) < o:
                        raise CheckpointMoved(
                            f"CheckpointMoved: {self.view.name} {t}[{p}] stored {applied.get(t, {}).get(p, 0)} < {o}"
                        )
            fresh = engine.skip_applied(df, applied).persist()
            try:
                per_partition = fresh.groupBy("topic", "partition").agg(F.count(F.lit(1)).alias("n")).collect()
                events = sum(int(r["n"]) for r in per_partition)
                lsns = self._apply(conn, fresh) if events else {}
            except FoldFailed as e:  # the transaction rolls back: nothing of this batch is committed
                self.failure = e
                raise
            finally:
                fresh.unpersist()
            store.write_checkpoints(conn, self.view.name, end, lsns)
            store.add_progress(conn, self.view.name, events, 1)
            merged = {t: dict(per) for t, per in applied.items()}
            for t, per in end.items():
                for p, o in per.items():
                    merged.setdefault(t, {})[p] = max(o, merged.get(t, {}).get(p, 0))
            with self.lock:
                self.tracker.sample()
                reached = self.tracker.promote(merged)
            if reached:
                store.advance_reached(conn, self.view.name, reached)
        with self.lock:
            self.stats.committed(events, time.monotonic() - began, merged, reached)
        self.on_batch(self.stats)

    def _apply(self, conn: store.Conn, fresh: DataFrame) -> dict[tuple[str, int], int]:
        if isinstance(self.view, FoldView):
            return apply_fold_frame(conn, self.view, fresh)
        if isinstance(self.view, CountView):
            return apply_counts(conn, self.view, fresh)
        return apply_mirror(conn, self.view, fresh)


# -- applying a batch ---------------------------------------------------------------------------


def _events(view: FoldView, fresh: DataFrame) -> list[LocatedEvent]:
    columns = ("topic", "partition", "offset", *engine.EVENT_COLUMNS)
    parsed = engine.python_rows(engine.parse_events(fresh).select(*columns))
    out = []
    for r in parsed.collect():
        try:
            event = engine.stored_event(tuple(r)[3:])
        except Exception as e:  # a value from_json could not parse (nulls): not an outbox event
            raise FoldFailed(view.name, r[0], int(r[1]), int(r[2]), e) from e
        out.append(LocatedEvent(r[0], int(r[1]), int(r[2]), event))
    return out


def apply_fold_frame(conn: store.Conn, view: FoldView, fresh: DataFrame) -> dict[tuple[str, int], int]:
    """Fold the batch's events (collected to the driver) into the stored states (:func:`apply.apply_fold`)."""
    return apply_fold(conn, view, _events(view, fresh))


def apply_counts(conn: store.Conn, view: CountView, fresh: DataFrame) -> dict[tuple[str, int], int]:
    """Add the batch's counts per key to the stored ones."""
    parsed = engine.parse_events(fresh).persist()
    try:
        lsns = {
            (r[0], int(r[1])): int(r[2] or 0)
            for r in parsed.groupBy("topic", "partition").agg(F.max("commit_lsn")).collect()
        }
        frame = view.frame(parsed.select(*engine.EVENT_COLUMNS))
        timestamps = [f.name for f in frame.schema.fields if isinstance(f.dataType, TimestampType)]
        counted = engine.python_rows(frame)
        rows = [
            tuple(engine.from_micros(r[c]) if c in timestamps else r[c] for c in columns_of(view))
            for r in counted.collect()
        ]
    finally:
        parsed.unpersist()
    add_counts(conn, view, rows)
    return lsns


def apply_mirror(conn: store.Conn, view: MirrorView, fresh: DataFrame) -> dict[tuple[str, int], int]:
    """The batch's latest record per key: upsert its row, or delete the key."""
    cdc = engine.parse_cdc(fresh).persist()
    try:
        lsns = {
            (r[0], int(r[1])): int(r[2] or 0)
            for r in cdc.groupBy("topic", "partition").agg(F.max("commit_lsn")).collect()
        }
        latest = engine.latest_per_key(cdc).collect()
    finally:
        cdc.unpersist()
    gone = [(view.name, r["key"]) for r in latest if r["gone"]]
    live = [
        (view.name, r["key"], r["after"], int(r["commit_lsn"]), int(r["event_index"])) for r in latest if not r["gone"]
    ]
    with conn.cursor() as cur:
        if gone:
            cur.executemany("DELETE FROM cdc_mirror WHERE projection = %s AND key = CAST(%s AS jsonb)", gone)
        if live:
            cur.executemany(
                """
                INSERT INTO cdc_mirror (projection, key, row, commit_lsn, event_index)
                VALUES (%s, CAST(%s AS jsonb), CAST(%s AS jsonb), %s, %s)
                ON CONFLICT (projection, key) DO UPDATE
                   SET row = EXCLUDED.row, commit_lsn = EXCLUDED.commit_lsn, event_index = EXCLUDED.event_index
                """,
                live,
            )
    return lsns


def follow(
    spark: SparkSession,
    catalog: ViewCatalog,
    name: str,
    *,
    dsn: str,
    checkpoint_dir: Path,
    log_dir: Path | None = None,
    source: LogSource | None = None,
    once: bool = False,
    stop: threading.Event | None = None,
    **options: Any,
) -> FollowStats:
    """Follow view ``name`` of the embedded log at ``log_dir`` or of ``source`` (see :class:`Follower`);
    ``once``: apply what is readable now, then return."""
    job = Follower(
        spark, catalog, name, log_dir=log_dir, source=source, dsn=dsn, checkpoint_dir=checkpoint_dir, **options
    )
    return job.run(once=once, stop=stop)
