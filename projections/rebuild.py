"""``rebuild``: replay a view's topics from the beginning with Spark, then swap the result in.

1. Sample the capture position and fix the offsets to read to (a consistent cut of the
   log's transactions; :mod:`projections.consistency`).
2. Spark batch read (read_committed) up to those offsets: ``format("tideline")`` on the
   embedded log, Spark's own ``format("kafka")`` on Kafka (:mod:`projections.sources`;
   the same columns either way, so the views cannot tell).
3. Compute the view on the executors and COPY its rows — and a fold's states — into
   unlogged **staging tables** of this run, tagged with the task attempt that wrote them
   (:mod:`projections.attempts`). Fold views: one task per log partition
   (a stream lives in one partition), its records folded in offset order with the
   aggregate's ``apply``, one state per stream — no shuffle, no sort (a partition with more
   streams than a task holds is folded again sorted by stream). From the embedded log each
   such task reads its partition itself (:func:`engine.fold_log_partitions`), as the
   ``tideline`` source's task would, without the hop into the JVM and back; from Kafka the
   records come through Spark's Kafka source (``wholePartitions``).
   Count views and mirrors: Spark computes the rows; each partition COPYs its own.
4. One Postgres transaction: build a shadow of the view's table (``LIKE … INCLUDING
   ALL``) from the staged rows of the task attempts Spark kept — never those of another
   attempt (a retried, speculative or zombie task wrote twice), whenever it committed —
   and swap it in (drop the old table, rename the shadow, give its constraints and indexes
   the names the old table's had: :func:`projections.store.swap_in`) — or merge those rows
   into the shared table (``snapshots``, ``cdc_mirror``) — replace the projection's states
   from the kept attempts' states, set the projection's checkpoints to the offsets read,
   record the run and the reached LSN.
   States are upserted (unchanged ones not rewritten) and those of streams no longer folded
   deleted. A stream whose events lie in two log partitions (a topic whose partition count
   grew) shows there as two kept states: the swap rolls back and the fold runs again by key.
5. Drop the staging tables (also when the rebuild failed; a killed driver's are dropped
   by the next rebuild).

Readers see the old view until that commit and the whole new one after it; a crash before
it leaves the view and its checkpoints as they were.

This is the ``spark`` rebuild engine; :mod:`projections.live_rebuild` computes step 3 in the
calling process instead (small views: no Spark to start) and shares everything else
(:func:`run_rebuild`, :func:`swap`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from projections import attempts, engine, store
from projections.consistency import take_sample
from projections.models import projection_state
from projections.planning import OffsetRange
from projections.sources import LogSource, source_for
from projections.views import CountView, FoldView, MirrorView, View, ViewCatalog, columns_of, owned_table

log = logging.getLogger("projections.rebuild")

Stage = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RebuildResult:
    projection: str
    events: int  # records read from the topics
    rows: int  # rows in the view (or written to the shared table) after the swap
    offsets: store.Offsets
    reached_lsn: int
    seconds: float
    discarded: int = 0  # staged rows of task attempts Spark did not keep (a retried or speculative task)


def rebuild(
    spark: SparkSession,
    catalog: ViewCatalog,
    name: str,
    *,
    dsn: str,
    log_dir: Path | None = None,
    source: LogSource | None = None,
    stage: Stage = lambda _: None,
) -> RebuildResult:
    """Rebuild view ``name`` of ``catalog`` from the embedded log at ``log_dir`` (or ``source``,
    e.g. Kafka) into the database at ``dsn``. The catalog's module (its top-level package) is
    shipped to Spark's executors first (:func:`projections.shipping.ship_views`)."""
    from projections.shipping import ship_views

    ship_views(spark, catalog.module)

    def compute(view: View, log: LogSource, ends: store.Offsets, lsn: int) -> tuple[int, int, int]:
        return _rebuild(spark, catalog, view, log, dsn, ends, lsn, stage)

    return run_rebuild(catalog[name], dsn=dsn, log_dir=log_dir, source=source, stage=stage, compute=compute)


Compute = Callable[[View, LogSource, store.Offsets, int], tuple[int, int, int]]


def run_rebuild(
    view: View,
    *,
    dsn: str,
    log_dir: Path | None,
    source: LogSource | None,
    stage: Stage,
    compute: Compute,
) -> RebuildResult:
    """What every rebuild engine does around its ``compute(view, log, ends, lsn) -> (events, rows,
    discarded)`` (which stages the view and swaps it in: :func:`swap`): the run recorded as started,
    the offsets to read to fixed (module docstring, step 1), the run recorded as failed if it raises."""
    started = time.monotonic()
    with source_for(log_dir, source) as log:
        with psycopg.connect(dsn, autocommit=True) as conn:
            store.start_run(conn, view.name, "rebuild")
        try:
            stage("fixing the offsets to read")
            # capture's position first, then the cut: the position counts only if the cut holds every record
            # appended before it was read (commit markers land partition by partition, so the last stable
            # offsets may still lag the log end of a transaction the position already covers)
            sample = take_sample(log, view.topics)
            ends = log.consistent_offsets(view.topics)
            lsn = sample.lsn if sample.covered_by(ends) else 0
            result = compute(view, log, ends, lsn)
        except BaseException as e:
            with psycopg.connect(dsn, autocommit=True) as conn:
                store.finish_run(conn, view.name, "failed", f"{type(e).__name__}: {e}"[:2000])
            raise
    events, rows, discarded = result
    return RebuildResult(view.name, events, rows, ends, lsn, time.monotonic() - started, discarded)


@dataclass(frozen=True, slots=True)
class Staged:
    """A rebuild's output before the swap: the staging tables and the attempts Spark kept."""

    rows: str  # staging table of the view's rows
    states: str  # staging table of a fold's states (empty for other views)
    events: int
    kept: list[int]  # task_attempt of the attempt kept for each partition


def _rebuild(
    spark: SparkSession,
    catalog: ViewCatalog,
    view: View,
    log: LogSource,
    dsn: str,
    ends: store.Offsets,
    lsn: int,
    stage: Stage,
) -> tuple[int, int, int]:
    with attempts.staging_run(dsn, view.name) as run:  # its tables dropped however this ends
        rows_staging = run.create(view.table.name)
        states_staging = run.create(projection_state.name, "state")
        stage(f"reading {', '.join(ends) or 'nothing'} and writing {rows_staging}")
        staged = _compute(spark, catalog, view, log, dsn, ends, rows_staging, states_staging)
        stage("swapping the view in")
        try:
            discarded, rows = swap(dsn, view, staged, ends, lsn)
        except SplitStreams:  # a topic whose partition count grew: fold again by key (nothing was swapped)
            assert isinstance(view, FoldView)
            stage("a stream spans two log partitions: folding again by key")
            _truncate(dsn, rows_staging, states_staging)
            raw = log.batch_frame(spark, ends)
            folded = fold_frame(spark, catalog, view, raw, dsn, rows_staging, states_staging)
            staged = Staged(rows_staging, states_staging, folded.events, folded.kept)
            stage("swapping the view in")
            discarded, rows = swap(dsn, view, staged, ends, lsn)
    return staged.events, rows, discarded


class SplitStreams(Exception):
    """The kept attempts of a per-log-partition fold hold two states of one stream: its events lie in
    two log partitions (the topic's partition count grew after the stream began)."""

    def __init__(self, view: str) -> None:
        super().__init__(f"view {view}: a stream's events lie in two log partitions")


def swap(dsn: str, view: View, staged: Staged, ends: store.Offsets, lsn: int) -> tuple[int, int]:
    """The swap transaction (module docstring, step 4); ``(discarded staged rows, rows in the view)``.
    Raises :class:`SplitStreams` (nothing swapped) when a fold's kept states hold a stream twice."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        store.read_checkpoints(conn, view.name, lock=True)
        discarded = _commit(conn, view, staged)
        store.write_checkpoints(conn, view.name, ends, {}, replace=True)
        store.add_progress(conn, view.name, staged.events, 1)
        store.advance_reached(conn, view.name, lsn)
        store.finish_run(conn, view.name, "done")
        rows = _count(conn, view)
    return discarded, rows


def _compute(
    spark: SparkSession,
    catalog: ViewCatalog,
    view: View,
    log: LogSource,
    dsn: str,
    ends: store.Offsets,
    rows_staging: str,
    states_staging: str,
) -> Staged:
    """Run the view's Spark job into the staging tables."""
    if not ends:
        return Staged(rows_staging, states_staging, 0, [])
    if isinstance(view, FoldView):
        direct = log.task_ranges(ends)
        if direct is not None:
            folded = fold_log(spark, catalog, view, direct, dsn, rows_staging, states_staging)
            if folded is None:  # too many streams in a partition to hold their states
                folded = fold_frame(spark, catalog, view, log.batch_frame(spark, ends), dsn, rows_staging,
                                    states_staging)  # fmt: skip
        else:
            raw = log.batch_frame(spark, ends, whole_partitions=True)
            folded = fold_frame(spark, catalog, view, raw, dsn, rows_staging, states_staging, per_log_partition=True)
        return Staged(rows_staging, states_staging, folded.events, folded.kept)
    if isinstance(view, CountView):
        parsed = engine.parse_events(log.batch_frame(spark, ends)).persist()
        events = parsed.count()
        outputs = engine.write_frame(view.frame(parsed.select(*engine.EVENT_COLUMNS)), dsn, rows_staging)
        parsed.unpersist()
        return Staged(rows_staging, states_staging, events, attempts.winners(outputs))
    events, outputs = _mirror(view, log.batch_frame(spark, ends), dsn, rows_staging)
    return Staged(rows_staging, states_staging, events, attempts.winners(outputs))


def _commit(conn: store.Conn, view: View, staged: Staged) -> int:
    """In the swap transaction: build a shadow from the staged rows of the attempts Spark
    kept and swap it in (or merge them into a shared table), and replace the projection's
    states from the kept attempts' staged states; the staged rows of other attempts (never
    read: :func:`attempts.kept_rows`)."""
    discarded = attempts.discarded(conn, staged.rows, staged.kept)
    discarded += attempts.discarded(conn, staged.states, staged.kept)
    kept = (staged.kept,)
    if isinstance(view, FoldView):  # first: a stream folded twice shows here (SplitStreams), before any row moved
        _replace_states(conn, view, staged)
    columns = columns_of(view)
    if owned_table(view):
        shadow = store.create_shadow(conn, view.table.name)
        conn.execute(_insert(shadow, columns, attempts.kept_rows(staged.rows, columns)), kept)
        store.swap_in(conn, view.table.name, shadow)
    else:
        _merge_shared(conn, view, attempts.kept_rows(staged.rows, columns), kept)
    return discarded


def _replace_states(conn: store.Conn, view: FoldView, staged: Staged) -> None:
    """Make the projection's stored states those of the kept attempts: new streams inserted, changed
    ones updated, streams no longer folded removed; states that did not change are not rewritten (a
    rebuild of an unchanged log writes next to nothing, and leaves no dead rows behind). A projection
    without stored states (its first rebuild) takes a plain INSERT, cheaper than the upsert. Raises
    :class:`SplitStreams` when the kept attempts hold two states of one stream."""
    kept = (staged.kept,)
    states = attempts.kept_rows(staged.states, engine.STATE_COLUMNS)
    insert = _insert(projection_state.name, engine.STATE_COLUMNS, states)
    table = sql.Identifier(projection_state.name)
    stored = conn.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE projection = %s)").format(table), (view.name,)
    ).fetchone()
    if not (stored and stored[0]):
        try:  # the caller's swap transaction rolls back on SplitStreams: nothing moved
            conn.execute(insert, kept)
        except psycopg.errors.UniqueViolation as e:
            raise SplitStreams(view.name) from e
        return
    changed = ("version", "commit_lsn", "state")
    upsert = sql.SQL(
        " ON CONFLICT (projection, stream_id) DO UPDATE SET ({0}) = ROW({1}) WHERE ({2}) IS DISTINCT FROM ({1})"
    ).format(
        sql.SQL(", ").join(sql.Identifier(c) for c in changed),
        sql.SQL(", ").join(sql.SQL("EXCLUDED.{}").format(sql.Identifier(c)) for c in changed),
        sql.SQL(", ").join(sql.SQL("{}.{}").format(table, sql.Identifier(c)) for c in changed),
    )
    try:
        conn.execute(insert + upsert, kept)
    except psycopg.errors.CardinalityViolation as e:  # "cannot affect row a second time": one stream, two states
        raise SplitStreams(view.name) from e
    conn.execute(
        sql.SQL(
            "DELETE FROM {} AS p WHERE p.projection = %s AND NOT EXISTS "
            "(SELECT 1 FROM {} s WHERE s.{} = ANY(%s) AND s.stream_id = p.stream_id)"
        ).format(table, sql.Identifier(staged.states), sql.Identifier(attempts.ATTEMPT_COLUMN)),
        (view.name, staged.kept),
    )


def _insert(table: str, columns: Sequence[str], select: sql.Composable) -> sql.Composed:
    return (
        sql.SQL("INSERT INTO {} ({}) ").format(
            sql.Identifier(table), sql.SQL(", ").join(sql.Identifier(c) for c in columns)
        )
        + select
    )


@dataclass(frozen=True, slots=True)
class Folded:
    events: int
    kept: list[int]  # task_attempt of the attempt Spark kept for each partition


def fold_frame(
    spark: SparkSession,
    catalog: ViewCatalog,
    view: FoldView,
    raw: DataFrame,
    dsn: str,
    rows_staging: str,
    states_staging: str,
    *,
    per_log_partition: bool = False,
) -> Folded:
    """Fold the outbox records of ``raw`` (the source's columns) into the staging tables
    ``rows_staging`` and ``states_staging`` (:mod:`projections.attempts`); the events folded
    and the attempts whose rows count. The records go to Python as Arrow batches
    (``mapInArrow``); values are parsed and folded there (:func:`engine.fold_batches`).

    ``per_log_partition``: ``raw`` holds one Spark partition per log partition in offset order
    (the source's ``wholePartitions``); a stream lives in one log partition, so each task folds
    its records as they come, holding one state per stream (``engine.fold_batches`` with
    ``offset_order``): no shuffle, no sort. A log partition with more streams than a task holds
    (Spark setting ``spark.tideline.fold.maxOpenStreams``, default 2,000,000) is folded again
    the general way. Otherwise (e.g. Parquet files) the records are repartitioned by key
    (= stream id) and sorted by key and offset within partitions (a stream's events in order,
    together)."""
    records = raw.where(~F.col("is_tombstone"))
    job = functools.partial(engine.fold_batches, catalog.module, view.name, dsn, rows_staging, states_staging)
    if per_log_partition:
        fold = functools.partial(job, offset_order=True, max_open_streams=_max_open_streams(spark))
        folded = _unless_too_many_streams(
            lambda: [attempts.TaskOutput(*r) for r in records.select("key", "value").mapInArrow(
                fold, engine.FOLD_OUTPUT).collect()], dsn, rows_staging, states_staging)  # fmt: skip
        if folded is not None:
            return folded
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or "2")
    keyed = records.select("key", "value", "offset").repartition(partitions, "key")
    ordered = keyed.sortWithinPartitions("key", "offset").select("key", "value")
    outputs = [attempts.TaskOutput(*r) for r in ordered.mapInArrow(job, engine.FOLD_OUTPUT).collect()]
    return Folded(sum(o.count for o in outputs), attempts.winners(outputs))


def fold_log(
    spark: SparkSession,
    catalog: ViewCatalog,
    view: FoldView,
    direct: tuple[str, list[OffsetRange]],
    dsn: str,
    rows_staging: str,
    states_staging: str,
) -> Folded | None:
    """Fold the log partitions of ``direct`` (a log Spark tasks read themselves, and one range per
    partition) into the staging tables: one task per log partition reads its records and folds them
    in offset order (``engine.fold_log_partitions``); None (staging emptied) when a partition holds
    more streams than a task keeps states for."""
    path, ranges = direct
    if not ranges:
        return Folded(0, [])
    job = functools.partial(engine.fold_log_partitions, catalog.module, view.name, dsn, rows_staging,
                            states_staging, path, _max_open_streams(spark), ranges)  # fmt: skip
    tasks = spark.range(len(ranges), numPartitions=len(ranges))  # task i folds ranges[i]
    return _unless_too_many_streams(
        lambda: [attempts.TaskOutput(*r) for r in tasks.mapInArrow(job, engine.FOLD_OUTPUT).collect()], dsn,
        rows_staging, states_staging)  # fmt: skip


def _max_open_streams(spark: SparkSession) -> int:
    return int(spark.conf.get(engine.MAX_OPEN_STREAMS_CONF, None) or engine.MAX_OPEN_STREAMS)


def _unless_too_many_streams(run: Callable[[], list[attempts.TaskOutput]], dsn: str, *staging: str) -> Folded | None:
    """``run``'s outputs as :class:`Folded`; None when a task stopped at too many streams (its
    error arrives wrapped by Spark, found by its message), the staging tables emptied."""
    try:
        outputs = run()
    except Exception as e:
        if engine.TooManyStreams.MARK not in str(e):
            raise
        said = next(line for line in str(e).splitlines() if engine.TooManyStreams.MARK in line)
        log.warning("%s; folding sorted by stream instead", said.strip()[-300:])
        _truncate(dsn, *staging)
        return None
    return Folded(sum(o.count for o in outputs), attempts.winners(outputs))


def _truncate(dsn: str, *tables: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables:
            conn.execute(f'TRUNCATE "{table}"')


def _mirror(view: MirrorView, raw: DataFrame, dsn: str, target: str) -> tuple[int, list[attempts.TaskOutput]]:
    """The last record of every key, parsed (only those: parsing every change event cost more
    than the rest of the read), keys whose last record says "gone" dropped; the events read
    and what each partition's kept attempt wrote into the staging table ``target``."""
    last = F.max_by(F.struct("topic", "partition", "offset", "key", "value", "is_tombstone"), F.col("offset"))
    latest = raw.groupBy("key").agg(F.count(F.lit(1)).alias("events"), last.alias("last")).persist()
    total = latest.agg(F.sum("events")).first()
    events = int(total[0] or 0) if total is not None else 0
    parsed = engine.parse_cdc(latest.select("last.*")).where(~F.col("gone"))
    rows = parsed.select(
        F.lit(view.name).alias("projection"),
        "key",
        F.col("after").alias("row"),
        "commit_lsn",
        F.col("event_index").cast("int").alias("event_index"),
    )
    outputs = engine.write_frame(rows, dsn, target)
    latest.unpersist()
    return events, outputs


def _merge_shared(conn: store.Conn, view: View, kept_rows: sql.Composed, kept: tuple[list[int]]) -> None:
    """Merge the kept staged rows (``kept_rows``, its parameter ``kept``) into a shared table."""
    columns = columns_of(view)
    if isinstance(view, MirrorView):
        conn.execute("DELETE FROM cdc_mirror WHERE projection = %s", (view.name,))
        conn.execute(_insert("cdc_mirror", columns, kept_rows), kept)
    else:  # snapshots: newer versions (or another state_version) replace stored ones; never removed
        upsert = sql.SQL(
            """
            ON CONFLICT (stream_id) DO UPDATE
               SET stream_type = EXCLUDED.stream_type, version = EXCLUDED.version,
                   schema_version = EXCLUDED.schema_version, state = EXCLUDED.state, recorded_at = now()
             WHERE snapshots.version < EXCLUDED.version OR snapshots.schema_version <> EXCLUDED.schema_version
            """
        )
        conn.execute(_insert("snapshots", columns, kept_rows) + upsert, kept)


def _count(conn: store.Conn, view: View) -> int:
    if isinstance(view, MirrorView):
        row = conn.execute("SELECT count(*) FROM cdc_mirror WHERE projection = %s", (view.name,)).fetchone()
    elif isinstance(view, FoldView) and view.snapshots:
        row = conn.execute(
            "SELECT count(*) FROM snapshots WHERE stream_type = ANY(%s)", ([a.name for a in view.aggregates],)
        ).fetchone()
    else:
        row = conn.execute(f'SELECT count(*) FROM "{view.table.name}"').fetchone()
    return int(row[0]) if row else 0
