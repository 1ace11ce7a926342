"""``rebuild``: replay a view's topics from the beginning with Spark, then swap the result in.

1. Sample the capture position and fix the offsets to read to (a consistent cut of the
   log's transactions; :mod:`projections.consistency`).
2. Spark batch read (``format("tideline")``, read_committed) up to those offsets; values
   parsed with ``from_json``.
3. Compute the view and COPY it from the partitions into a *shadow* table (a copy of the
   view's table made with ``LIKE … INCLUDING ALL``), or, for views whose table is shared
   (``snapshots``, ``cdc_mirror``), into an unlogged staging table. Fold views: events
   repartitioned by stream id, sorted by version within partitions, folded per stream on
   the executors with the aggregate's ``apply`` (their states go to a staging table too).
4. One Postgres transaction: swap the shadow in (drop the old table, rename the shadow,
   rename its constraints and indexes to the canonical names) — or merge the staging
   table into the shared one — replace the projection's states, set the projection's
   checkpoints to the offsets read, record the run and the reached LSN.

Readers see the old view until that commit and the whole new one after it; a crash before
it leaves the view and its checkpoints as they were (the next rebuild drops the leftovers).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from sqlalchemy import Table

from eventstore.log import Log
from projections import engine, store
from projections.consistency import captured_lsn, consistent_offsets
from projections.models import projection_state
from projections.views import CountView, FoldView, MirrorView, View, ViewCatalog, columns_of, owned_table

Stage = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RebuildResult:
    projection: str
    events: int  # records read from the topics
    rows: int  # rows in the view (or written to the shared table) after the swap
    offsets: store.Offsets
    reached_lsn: int
    seconds: float


def source(spark: SparkSession, log_dir: Path, ends: store.Offsets) -> DataFrame:
    """The records of the topics in ``ends``, from the beginning up to those offsets."""
    import json

    return (
        spark.read.format("tideline")
        .option("path", str(log_dir))
        .option("subscribe", ",".join(ends))
        .option("decodeAvro", "true")  # capture's --value-format avro: read as its JSON
        .option("startingOffsets", "earliest")
        .option("endingOffsets", json.dumps({t: {str(p): o for p, o in per.items()} for t, per in ends.items()}))
        .load()
    )


def rebuild(
    spark: SparkSession,
    catalog: ViewCatalog,
    name: str,
    *,
    log_dir: Path,
    dsn: str,
    stage: Stage = lambda _: None,
) -> RebuildResult:
    """Rebuild view ``name`` of ``catalog`` from the log at ``log_dir`` into the database at ``dsn``."""
    view = catalog[name]
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.start_run(conn, view.name, "rebuild")
    try:
        stage("fixing the offsets to read")
        with Log(log_dir, create=False) as log:
            lsn = captured_lsn(log)
            ends = consistent_offsets(log, view.topics)
        result = _rebuild(spark, catalog, view, log_dir, dsn, ends, lsn, stage)
    except BaseException as e:
        with psycopg.connect(dsn, autocommit=True) as conn:
            store.finish_run(conn, view.name, "failed", f"{type(e).__name__}: {e}"[:2000])
        raise
    return RebuildResult(view.name, result[0], result[1], ends, lsn, time.monotonic() - started)


def _rebuild(
    spark: SparkSession,
    catalog: ViewCatalog,
    view: View,
    log_dir: Path,
    dsn: str,
    ends: store.Offsets,
    lsn: int,
    stage: Stage,
) -> tuple[int, int]:
    table = view.table.name
    with psycopg.connect(dsn, autocommit=True) as conn:
        target = store.create_shadow(conn, table) if owned_table(view) else store.create_staging(conn, table, view.name)
        states = store.create_staging(conn, projection_state.name, f"{view.name}__state")
    stage(f"reading {', '.join(ends) or 'nothing'} and writing {target}")
    events = 0
    if ends:
        raw = source(spark, log_dir, ends)
        if isinstance(view, FoldView):
            events = fold_frame(spark, catalog, view, raw, dsn, target, states)
        elif isinstance(view, CountView):
            parsed = engine.parse_events(raw).persist()
            events = parsed.count()
            engine.write_frame(view.frame(parsed.select(*engine.EVENT_COLUMNS)), dsn, target)
            parsed.unpersist()
        else:
            events = _mirror(view, raw, dsn, target)
    stage("swapping the view in")
    with psycopg.connect(dsn) as conn, conn.transaction():
        store.read_checkpoints(conn, view.name, lock=True)
        if owned_table(view):
            store.swap_in(conn, table, target)
        else:
            _merge_shared(conn, view, view.table, target)
        conn.execute("DELETE FROM projection_state WHERE projection = %s", (view.name,))
        cols = ", ".join(engine.STATE_COLUMNS)
        conn.execute(f'INSERT INTO projection_state ({cols}) SELECT {cols} FROM "{states}"')
        store.drop_table(conn, states)
        store.write_checkpoints(conn, view.name, ends, {}, replace=True)
        store.add_progress(conn, view.name, events, 1)
        store.advance_reached(conn, view.name, lsn)
        store.finish_run(conn, view.name, "done")
        rows = _count(conn, view)
    return events, rows


def fold_frame(
    spark: SparkSession, catalog: ViewCatalog, view: FoldView, raw: DataFrame, dsn: str, target: str, states: str
) -> int:
    """Fold the outbox records of ``raw`` (the source's columns) into ``target`` and ``states``;
    the number of events folded. The records go to Python as Arrow batches (``mapInArrow``),
    repartitioned by key (= stream id) and sorted by key and offset (a stream's events
    in order, together); values are parsed and folded there (:func:`engine.fold_batches`)."""
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or "2")
    records = raw.where(~F.col("is_tombstone")).select("key", "value", "offset")
    ordered = records.repartition(partitions, "key").sortWithinPartitions("key", "offset").select("key", "value")
    job = functools.partial(engine.fold_batches, catalog.module, view.name, dsn, target, states)
    total = ordered.mapInArrow(job, "events long").agg(F.sum("events")).first()
    return int(total[0] or 0) if total is not None else 0


def _mirror(view: MirrorView, raw: DataFrame, dsn: str, target: str) -> int:
    """The last record of every key, parsed (only those: parsing every change event cost more
    than the rest of the read), keys whose last record says "gone" dropped."""
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
    engine.write_frame(rows, dsn, target)
    latest.unpersist()
    return events


def _merge_shared(conn: store.Conn, view: View, table: Table, staging: str) -> None:
    cols = ", ".join(f'"{c}"' for c in columns_of(view))
    if isinstance(view, MirrorView):
        conn.execute("DELETE FROM cdc_mirror WHERE projection = %s", (view.name,))
        conn.execute(f'INSERT INTO cdc_mirror ({cols}) SELECT {cols} FROM "{staging}"')
    else:  # snapshots: newer versions (or another state_version) replace stored ones; never removed
        conn.execute(
            f"""
            INSERT INTO snapshots ({cols}) SELECT {cols} FROM "{staging}"
            ON CONFLICT (stream_id) DO UPDATE
               SET stream_type = EXCLUDED.stream_type, version = EXCLUDED.version,
                   schema_version = EXCLUDED.schema_version, state = EXCLUDED.state, recorded_at = now()
             WHERE snapshots.version < EXCLUDED.version OR snapshots.schema_version <> EXCLUDED.schema_version
            """
        )
    store.drop_table(conn, staging)


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
