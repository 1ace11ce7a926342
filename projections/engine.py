"""Spark plumbing shared by rebuild and follow: the session, parsing the log's records, the
per-stream fold that runs on executors, and bulk writes into Postgres.

Parsing: Spark's own ``from_json`` with a fixed schema
(:data:`projections.views.OUTBOX_VALUE_SCHEMA`, :data:`~projections.views.CDC_VALUE_SCHEMA`)
for count views, mirrors and follow; event payloads and CDC images stay JSON text so that
numbers keep every digit. A fold rebuild parses outbox values in Python instead
(:func:`fold_batches`, orjson), where the fold runs anyway.

**Writes: psycopg COPY from the partitions, not JDBC.** Measured (docs/projections-views.md,
"Writes"; 300k ``cdc_mirror``-shaped rows, local[2]): COPY 70k–140k rows/s, JDBC with
``/usr/share/java/postgresql.jar`` on ``spark.jars`` and ``spark.driver.extraClassPath``
166k–171k rows/s — JDBC is ≈ 1.2× faster for rows Spark computes. COPY is kept as the one
write path because the fold views' rows (the bulk of a rebuild) are produced in Python on
the executors and written from there, where JDBC would need them converted back into a JVM
DataFrame; and executors then need no JDBC jar.

**Writes are attempt-aware**: executors COPY into staging tables, every row tagged with the
task attempt that wrote it, and report ``(partition, task_attempt, count)``; only the rows
of the attempts Spark hands to the driver are kept (:mod:`projections.attempts`).

Every function Spark ships to executors is a module-level function of this module (or a
:func:`functools.partial` of one) and finds the view by ``(catalog module, view name)``,
so workers import exactly the declarations the driver used.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import TimestampType

from commands.aggregate import AggregateType
from commands.codec import to_json
from eventstore.errors import ConfigError
from projections import attempts, store
from projections.datasource import register
from projections.planning import OffsetRange
from projections.views import (
    CDC_VALUE_SCHEMA,
    OUTBOX_VALUE_SCHEMA,
    FoldView,
    Row,
    StoredEvent,
    Stream,
    ViewCatalog,
    load_catalog,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

STATE_COLUMNS = ("projection", "stream_id", "version", "commit_lsn", "state")
FOLD_OUTPUT = "partition int, task_attempt long, events long"  # one row per fold task: the attempt and its events
FLUSH_STATES = 10_000  # a fold task commits its staged rows every this many streams
# An offset-order fold task holds one state per stream of its log partition; past this many (Spark setting
# MAX_OPEN_STREAMS_CONF) it stops, and the rebuild folds sorted by stream instead (Spark's sort spills to
# disk, a dict of states does not).
MAX_OPEN_STREAMS = 2_000_000
MAX_OPEN_STREAMS_CONF = "spark.tideline.fold.maxOpenStreams"
EVENT_COLUMNS = (
    "stream_id",
    "stream_type",
    "version",
    "event_type",
    "schema_version",
    "payload",
    "recorded_at",
    "commit_lsn",
    "event_index",
)


def make_session(
    master: str = "local[*]", app_name: str = "tideline-projections", *, kafka: bool = False
) -> SparkSession:
    """A SparkSession for projection jobs: UTC, no UI, the tideline source registered; executors
    run this interpreter (``spark.executorEnv.PYSPARK_PYTHON``), which imports Tideline as it is
    installed (a source tree that is not installed: :func:`executor_pythonpath`), also on a cluster.
    The views module is shipped by the jobs themselves (:mod:`projections.shipping`).
    ``kafka``: Spark's own Kafka source on ``spark.jars`` too (:mod:`projections.spark_kafka`;
    a ConfigError saying to run ``make jars`` when they are missing)."""
    from projections.spark_kafka import spark_jars_setting

    jars = spark_jars_setting() if kafka else None
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", str(max(2, os.cpu_count() or 2)))
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
    )
    pythonpath = executor_pythonpath()
    if pythonpath is not None:
        builder = builder.config("spark.executorEnv.PYTHONPATH", pythonpath)
    if master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1")
    if jars is not None:
        builder = builder.config("spark.jars", jars)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    return session


def executor_pythonpath() -> str | None:
    """What executors need on ``PYTHONPATH`` to import Tideline: nothing when this interpreter has it
    installed (a wheel, or an editable install: ``pip install -e .``), since executors run this
    interpreter; the source tree this module lives in when Tideline runs from a checkout that is not
    installed (it must then be at the same path on every node)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("tideline")
    except importlib.metadata.PackageNotFoundError:
        return str(REPO_ROOT)
    return None


# -- parsing --------------------------------------------------------------------------------


def parse_events(raw: DataFrame) -> DataFrame:
    """Outbox records → ``topic, partition, offset`` + :data:`EVENT_COLUMNS` (tombstones dropped)."""
    value = F.from_json(F.col("value").cast("string"), OUTBOX_VALUE_SCHEMA).alias("e")
    return (
        raw.where(~F.col("is_tombstone"))
        .select("topic", "partition", "offset", value)
        .select(
            "topic",
            "partition",
            "offset",
            *[F.col(f"e.{c}").alias(c) for c in EVENT_COLUMNS[:7]],
            F.col("e.source.commit_lsn").alias("commit_lsn"),
            F.col("e.source.event_index").alias("event_index"),
        )
    )


def parse_cdc(raw: DataFrame) -> DataFrame:
    """Change events → ``topic, partition, offset, key (JSON text), gone, after, commit_lsn,
    event_index``; ``gone``: a tombstone, a delete or a truncate (the key has no row)."""
    value = F.from_json(F.col("value").cast("string"), CDC_VALUE_SCHEMA).alias("c")
    parsed = raw.select("topic", "partition", "offset", "key", "is_tombstone", value)
    return parsed.select(
        "topic",
        "partition",
        "offset",
        F.col("key").cast("string").alias("key"),
        (F.col("is_tombstone") | F.col("c.op").isin("d", "t") | F.col("c.after").isNull()).alias("gone"),
        F.col("c.after").alias("after"),
        F.coalesce(F.col("c.source.commit_lsn"), F.lit(0)).alias("commit_lsn"),
        F.coalesce(F.col("c.source.event_index"), F.lit(0)).alias("event_index"),
    )


def latest_per_key(cdc: DataFrame) -> DataFrame:
    """The last record of every key (a key lives in one partition: the highest offset is the latest)."""
    last = F.max_by(F.struct("gone", "after", "commit_lsn", "event_index"), F.col("offset")).alias("last")
    return cdc.groupBy("key").agg(last).select("key", "last.*")


def skip_applied(df: DataFrame, applied: store.Offsets) -> DataFrame:
    """``df`` without the records at offsets below the stored next offsets (a re-run batch)."""
    condition: Column | None = None
    for topic, per in applied.items():
        for partition, offset in per.items():
            c = (F.col("topic") == topic) & (F.col("partition") == partition) & (F.col("offset") < offset)
            condition = c if condition is None else condition | c
    return df if condition is None else df.where(~condition)


def python_rows(df: DataFrame) -> DataFrame:
    """Timestamps as microseconds since the epoch (Python workers would make naive local datetimes)."""
    cols = [
        F.unix_micros(F.col(f.name)).alias(f.name) if isinstance(f.dataType, TimestampType) else F.col(f.name)
        for f in df.schema.fields
    ]
    return df.select(*cols)


def from_micros(value: int | None) -> datetime | None:
    return None if value is None else EPOCH + timedelta(microseconds=value)


def stored_event(row: Sequence[Any]) -> StoredEvent:
    """A :class:`StoredEvent` from :data:`EVENT_COLUMNS` values (recorded_at in µs)."""
    sid, stype, version, etype, sversion, payload, recorded, lsn, index = row
    when = from_micros(recorded)
    assert when is not None
    return StoredEvent(
        sid, stype, int(version), etype, int(sversion), orjson.loads(payload), when, int(lsn), int(index)
    )


# -- the fold on executors --------------------------------------------------------------------


def stream_of(view: FoldView, events: list[StoredEvent], state: Any = None, version: int = 0) -> Stream:
    """The stream after ``events`` with version > ``version``, starting from ``state``."""
    first = events[0]
    fresh = [e for e in events if e.version > version]
    aggregate = view.aggregate(first.stream_type)
    new_state = view.fold(first.stream_type, fresh, state)
    last = fresh[-1] if fresh else None
    return Stream(
        aggregate,
        first.stream_id,
        last.version if last else version,
        last.commit_lsn if last else 0,
        new_state,
    )


def fold_batches(
    catalog_module: str,
    view_name: str,
    dsn: str,
    rows_table: str,
    state_table: str,
    batches: Iterable[Any],
    *,
    offset_order: bool = False,
    max_open_streams: int = 0,
) -> Iterator[Any]:
    """Executor side of a fold rebuild (``mapInArrow``): records ``key, value`` sorted by key
    (a stream's records are contiguous, batches may split them) → each stream folded, its
    view rows COPYed into the staging table ``rows_table`` and its state into ``state_table``,
    tagged with this task's attempt (:mod:`projections.attempts`); yields one batch
    ``partition, task_attempt, events`` (:data:`FOLD_OUTPUT`): the driver keeps the rows of
    the attempts whose batch reaches it.

    ``offset_order``: the records are one whole log partition in offset order instead (every
    stream of the partition, interleaved). Each event is applied to its stream's state as it
    comes, as a follow job applies them (an event whose version is not above the stream's is
    skipped), and the streams are written at the end: no sort, and memory for the states of
    the partition's streams, not for its events; past ``max_open_streams`` of them it raises
    :class:`TooManyStreams`.

    Values are parsed here with orjson, not by Spark: ``from_json`` of the whole outbox
    value cost more than everything else of the read, and the stream id is the record key.
    """
    import pyarrow as pa

    partition, attempt = attempts.current()
    view = view_in(load_catalog(catalog_module), view_name)
    with psycopg.connect(dsn) as conn:

        def flush(rows: list[Row], states: list[Row]) -> None:
            flush_staged(conn, view, rows_table, state_table, rows, states, attempt)

        columns = ((b.column(0), b.column(1)) for b in batches)
        if offset_order:
            events = fold_in_offset_order(view, columns, flush, max_open_streams)
        else:
            events = fold_sorted(view, columns, flush)
    attempts.inject_fault()
    yield pa.RecordBatch.from_pydict(
        {"partition": [partition], "task_attempt": [attempt], "events": [events]},
        schema=pa.schema([("partition", pa.int32()), ("task_attempt", pa.int64()), ("events", pa.int64())]),
    )


def fold_log_partitions(
    catalog_module: str,
    view_name: str,
    dsn: str,
    rows_table: str,
    state_table: str,
    log_path: str,
    max_open_streams: int,
    ranges: Sequence[OffsetRange],
    batches: Iterable[Any],
) -> Iterator[Any]:
    """Executor side of a fold rebuild from the embedded log (``mapInArrow`` over ``spark.range``:
    the ids of this task's rows index ``ranges``, one per task, a whole log partition): the task reads
    its range itself, read_committed (:func:`projections.range_reader.read_range`, as the
    ``tideline`` source's task would), and folds it in offset order — no hop through the JVM
    and back. Staging and the ``(partition, task_attempt, events)`` it yields as
    :func:`fold_batches` with ``offset_order``."""
    import pyarrow as pa

    from eventstore.isolation import IsolationLevel
    from projections.options import DEFAULT_BATCH_ROWS
    from projections.range_reader import ReadSettings, read_range

    partition, attempt = attempts.current()
    view = view_in(load_catalog(catalog_module), view_name)
    settings = ReadSettings(log_path, IsolationLevel.READ_COMMITTED, None, None, True, DEFAULT_BATCH_ROWS,
                            decode_avro=True)  # fmt: skip
    events = 0
    with psycopg.connect(dsn) as conn:

        def flush(rows: list[Row], states: list[Row]) -> None:
            flush_staged(conn, view, rows_table, state_table, rows, states, attempt)

        for batch in batches:
            for i in batch.column(0).to_pylist():
                reads = read_range(ranges[i], settings)
                columns = ((b.column("key"), b.column("value")) for b in reads)
                events += fold_in_offset_order(view, columns, flush, max_open_streams)
    attempts.inject_fault()
    yield pa.RecordBatch.from_pydict(
        {"partition": [partition], "task_attempt": [attempt], "events": [events]},
        schema=pa.schema([("partition", pa.int32()), ("task_attempt", pa.int64()), ("events", pa.int64())]),
    )


Flush = Callable[[list[Row], list[Row]], None]  # stage (and commit) view rows and states, then clear both lists


def _records(columns: Iterable[tuple[Any, Any]]) -> Iterator[tuple[bytes, StoredEvent]]:
    """``(keys, values)`` Arrow arrays → ``(key, event)`` per outbox record (tombstones skipped)."""
    for keys, values in columns:
        for key, value in zip(keys.to_pylist(), values.to_pylist(), strict=True):
            if value is None:
                continue
            event = StoredEvent.from_value(value)
            if key != event.stream_id.encode():  # streams are grouped by key: a mis-keyed record would mix two
                raise ConfigError(f"outbox record of stream {event.stream_id!r} has key {key!r}, not its stream id")
            yield key, event


def _emit(view: FoldView, stream: Stream, view_rows: list[Row], states: list[Row]) -> None:
    """A folded stream's rows of the view, and its state row (what follow resumes from)."""
    view_rows.extend(view.rows(stream))
    states.append((view.name, stream.stream_id, stream.version, stream.commit_lsn, to_json(stream.state)))


def fold_sorted(view: FoldView, batches: Iterable[tuple[Any, Any]], flush: Flush) -> int:
    """Records sorted by key: a stream's events contiguous, folded when the next stream begins."""
    events = 0
    view_rows: list[Row] = []
    states: list[Row] = []
    current: list[StoredEvent] = []
    current_key: bytes | None = None

    def fold_current() -> int:
        current.sort(key=lambda e: e.version)  # offset order already, unless a topic was repartitioned
        _emit(view, stream_of(view, current), view_rows, states)
        return len(current)

    for key, event in _records(batches):
        if key != current_key and current:
            events += fold_current()
            current = []
            if len(states) >= FLUSH_STATES:
                flush(view_rows, states)
        current_key = key
        current.append(event)
    if current:
        events += fold_current()
    flush(view_rows, states)
    return events


@dataclass(slots=True)
class _OpenStream:
    aggregate: AggregateType[Any, Any]
    stream_id: str
    version: int
    commit_lsn: int
    state: Any


def fold_in_offset_order(
    view: FoldView, batches: Iterable[tuple[Any, Any]], flush: Flush, max_open_streams: int
) -> int:
    """A whole log partition in offset order: each event applied to its stream's state as it comes."""
    events = 0
    open_streams: dict[bytes, _OpenStream] = {}
    for key, event in _records(batches):
        events += 1
        stream = open_streams.get(key)
        if stream is None:
            if len(open_streams) >= max_open_streams:
                raise TooManyStreams(view.name, max_open_streams)
            aggregate = view.aggregate(event.stream_type)
            stream = open_streams[key] = _OpenStream(aggregate, event.stream_id, 0, 0, aggregate.initial)
        if event.version <= stream.version:  # as follow: a version applied already is not applied again
            continue
        decoded = stream.aggregate.events.decode(event.event_type, event.schema_version, event.payload)
        stream.state = stream.aggregate.apply(stream.state, decoded)
        stream.version, stream.commit_lsn = event.version, event.commit_lsn
    view_rows: list[Row] = []
    states: list[Row] = []
    for s in open_streams.values():
        _emit(view, Stream(s.aggregate, s.stream_id, s.version, s.commit_lsn, s.state), view_rows, states)
        if len(states) >= FLUSH_STATES:
            flush(view_rows, states)
    flush(view_rows, states)
    return events


class TooManyStreams(Exception):
    """An offset-order fold task met more streams than it may hold states for."""

    MARK = "offset-order fold: more streams in one log partition than"

    def __init__(self, view: str, limit: int) -> None:
        super().__init__(f"view {view}: {self.MARK} {limit:,}")


def flush_staged(
    conn: store.Conn,
    view: FoldView,
    rows_table: str,
    state_table: str,
    rows: list[Row],
    states: list[Row],
    attempt: int,
) -> None:
    from projections.views import columns_of

    store.copy_rows(conn, rows_table, (*columns_of(view), attempts.ATTEMPT_COLUMN), attempts.tagged(rows, attempt))
    store.copy_rows(conn, state_table, (*STATE_COLUMNS, attempts.ATTEMPT_COLUMN), attempts.tagged(states, attempt))
    conn.commit()
    rows.clear()
    states.clear()


def copy_partition(
    dsn: str, table: str, columns: Sequence[str], timestamps: Sequence[bool], rows: Iterable[Any]
) -> Iterator[tuple[int, int, int]]:
    """Executor side of a frame write: COPY this partition's rows into the staging table
    ``table``, tagged with this task's attempt; yields ``(partition, task_attempt, rows)``."""
    partition, attempt = attempts.current()

    def convert(row: Any) -> list[Any]:
        return [*(from_micros(v) if ts else v for v, ts in zip(row, timestamps, strict=True)), attempt]

    with psycopg.connect(dsn) as conn:
        n = store.copy_rows(conn, table, (*columns, attempts.ATTEMPT_COLUMN), (convert(r) for r in rows))
        conn.commit()
    attempts.inject_fault()
    yield partition, attempt, n


def write_frame(df: DataFrame, dsn: str, table: str) -> list[attempts.TaskOutput]:
    """COPY a DataFrame (columns named as ``table``'s) from its partitions into the staging
    table ``table``; what each partition's kept attempt wrote."""
    timestamps = [isinstance(f.dataType, TimestampType) for f in df.schema.fields]
    job = functools.partial(copy_partition, dsn, table, list(df.columns), timestamps)
    return [attempts.TaskOutput(*out) for out in python_rows(df).rdd.mapPartitions(job).collect()]


def view_in(catalog: ViewCatalog, name: str) -> FoldView:
    view = catalog[name]
    if not isinstance(view, FoldView):
        raise TypeError(f"view {name} is not a fold view")
    return view
