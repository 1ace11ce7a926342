"""``rebuild`` without Spark: the ``live`` rebuild engine, for views whose topics are small.

Spark's start-up (a JVM, then Python workers: 10–17 s here) dwarfs the rebuild of a view of a
few thousand records. This engine computes the same rows in this process and hands them to
the very same swap as the Spark rebuild (:func:`projections.rebuild.run_rebuild` and
:func:`projections.rebuild.swap`): the same cut of the log, the same staging tables (one
"attempt", id 0, kept), the same shadow table swapped in (or merge into a shared table), the
same states upsert, checkpoints replaced by the offsets read, the same ``projection_runs``
record and reached LSN. A follow job, on either engine, continues from it exactly as from a
Spark rebuild.

- **fold views**: each log partition is read in offset order and folded one event at a time,
  one state per stream, by the Spark fold task's own function
  (:func:`projections.engine.fold_in_offset_order`); from the embedded log with the
  ``tideline`` source's reader (:func:`projections.range_reader.read_range`, Arrow batches,
  read_committed, Avro decoded), from Kafka with :meth:`LogSource.records`. A stream found in two
  partitions (a topic whose partition count grew) makes the swap roll back, and the view is folded
  again by stream, its events in version order — as the Spark rebuild does.
- **count views**: ``contributions(event)`` summed per key (:func:`projections.apply.count_rows`),
  the Python twin of ``frame`` that the live follow engine applies.
- **mirrors**: the last record of every key; keys whose last record says "gone" left out; the
  change's ``after`` image extracted by Postgres (numbers keep every digit).

Memory: the states of one partition's streams (fold views), the counts per key, or the last
record per key (mirrors) — and, only in the rare split-stream case, every event of the view.

``tideline project rebuild VIEW --engine auto`` (the default) picks this engine when the view's
topics hold at most :data:`DEFAULT_LIVE_MAX_RECORDS` records (:func:`choose_engine`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from eventstore.errors import ConfigError, TidelineError
from projections import attempts, engine, store
from projections.apply import LogRecord, count_rows
from projections.models import projection_state
from projections.progress import FoldFailed
from projections.rebuild import RebuildResult, SplitStreams, Stage, Staged, run_rebuild, swap
from projections.sources import LogSource
from projections.views import CountView, FoldView, MirrorView, Row, View, ViewCatalog, columns_of

# At most this many records in a view's topics (their offsets: an upper bound) and `--engine auto` rebuilds it
# without Spark. Measured here (docs/projections-views.md, "Two engines"; 2 CPUs, load 2-4, a fold view, the whole
# command's wall time): 3,000 records live 1.4-1.6 s against 17.6-21.0 s on Spark (local[*]); 100,000: 3.6 s
# against 18.0 s; 300,000: 7.0 s against 26.8 s; 1,000,000: 20.4 s (333 MB resident) against 40.4 s. The live
# engine is one process, though: Spark's fold grows with cores and executors, and a mirror's live rebuild holds
# the last record of every key in memory. 500,000 keeps the live engine where it wins by seconds, not minutes.
DEFAULT_LIVE_MAX_RECORDS = 500_000
ATTEMPT = 0  # the one "task attempt" of a live rebuild: the staged rows the swap keeps
BATCH = 10_000  # records per batch handed to the fold (Kafka) / staged per INSERT round (mirrors)

logger = logging.getLogger(__name__)


class RebuildEngine(enum.Enum):
    """``value``: the CLI name (``tideline project rebuild --engine``)."""

    AUTO = "auto"
    LIVE = "live"
    SPARK = "spark"

    @classmethod
    def parse(cls, text: str) -> RebuildEngine:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ConfigError(f"unknown rebuild engine {text!r} (known: {', '.join(e.value for e in cls)})") from None


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine a rebuild runs on and why (printed and logged: no engine is chosen silently)."""

    engine: RebuildEngine  # LIVE or SPARK, never AUTO
    records: int | None  # the records counted in the view's topics (None: not counted)
    reason: str


def choose_engine(
    requested: RebuildEngine,
    source: LogSource,
    view: View,
    max_records: int = DEFAULT_LIVE_MAX_RECORDS,
    *,
    master: str | None = None,
) -> EngineChoice:
    """The engine for a rebuild of ``view``: ``requested`` unless it is ``auto``; then Spark when a
    ``master`` was given, else the live engine when the view's topics hold at most ``max_records``
    records (:meth:`LogSource.record_count`: offsets, no scan), Spark otherwise."""
    if requested is RebuildEngine.LIVE:
        return EngineChoice(RebuildEngine.LIVE, None, "--engine live")
    if requested is RebuildEngine.SPARK:
        return EngineChoice(RebuildEngine.SPARK, None, "--engine spark")
    if master is not None:
        return EngineChoice(RebuildEngine.SPARK, None, f"--master {master} given")
    records = source.record_count(view.topics)
    topics = ", ".join(view.topics)
    if records <= max_records:
        reason = f"{records:,} records in {topics} ≤ {max_records:,} (--live-max-records)"
        return EngineChoice(RebuildEngine.LIVE, records, reason)
    reason = f"{records:,} records in {topics} > {max_records:,} (--live-max-records)"
    return EngineChoice(RebuildEngine.SPARK, records, reason)


class LiveRebuildFailed(TidelineError):
    """A live rebuild's fold raised (nothing was swapped in)."""


def rebuild_live(
    catalog: ViewCatalog,
    name: str,
    *,
    dsn: str,
    log_dir: Path | None = None,
    source: LogSource | None = None,
    stage: Stage = lambda _: None,
) -> RebuildResult:
    """Rebuild view ``name`` of ``catalog`` from the embedded log at ``log_dir`` (or ``source``) into
    the database at ``dsn`` without Spark (see the module docstring); the same result, records and
    swap as :func:`projections.rebuild.rebuild`."""

    def compute(view: View, log: LogSource, ends: store.Offsets, lsn: int) -> tuple[int, int, int]:
        return _rebuild(view, log, dsn, ends, lsn, stage)

    return run_rebuild(catalog[name], dsn=dsn, log_dir=log_dir, source=source, stage=stage, compute=compute)


def _rebuild(view: View, log: LogSource, dsn: str, ends: store.Offsets, lsn: int, stage: Stage) -> tuple[int, int, int]:
    with attempts.staging_run(dsn, view.name) as run:  # its tables dropped however this ends
        rows_staging = run.create(view.table.name)
        states_staging = run.create(projection_state.name, "state")
        stage(f"reading {', '.join(ends) or 'nothing'} and writing {rows_staging} (live engine)")
        with psycopg.connect(dsn) as conn:
            events = _compute(conn, view, log, ends, rows_staging, states_staging)
        staged = Staged(rows_staging, states_staging, events, [ATTEMPT])
        stage("swapping the view in")
        try:
            discarded, rows = swap(dsn, view, staged, ends, lsn)
        except SplitStreams:  # a topic whose partition count grew: fold again by stream (nothing was swapped)
            assert isinstance(view, FoldView)
            stage("a stream spans two log partitions: folding again by stream")
            with psycopg.connect(dsn) as conn:
                for table in (rows_staging, states_staging):
                    conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(table)))
                events = _fold_by_stream(conn, view, log, ends, rows_staging, states_staging)
            staged = Staged(rows_staging, states_staging, events, [ATTEMPT])
            stage("swapping the view in")
            discarded, rows = swap(dsn, view, staged, ends, lsn)
    return staged.events, rows, discarded


def _compute(
    conn: store.Conn, view: View, log: LogSource, ends: store.Offsets, rows_staging: str, states_staging: str
) -> int:
    """Stage ``view``'s rows (and a fold's states) computed from the records below ``ends``; the
    events read (counted as the Spark rebuild counts them)."""
    if isinstance(view, FoldView):
        return _fold_per_partition(conn, view, log, ends, rows_staging, states_staging)
    if isinstance(view, CountView):
        records = _non_tombstones(_records(log, ends))
        counted = _Counted(records)
        rows, _ = count_rows(view, counted)
        _stage_rows(conn, rows_staging, columns_of(view), rows)
        return counted.n
    return _mirror(conn, view, log, ends, rows_staging)


def _flush(conn: store.Conn, view: FoldView, rows_staging: str, states_staging: str) -> engine.Flush:
    def flush(rows: list[Row], states: list[Row]) -> None:
        engine.flush_staged(conn, view, rows_staging, states_staging, rows, states, ATTEMPT)

    return flush


def _fold_per_partition(
    conn: store.Conn, view: FoldView, log: LogSource, ends: store.Offsets, rows_staging: str, states_staging: str
) -> int:
    """Each log partition folded in offset order, as one Spark fold task folds it."""
    flush = _flush(conn, view, rows_staging, states_staging)
    events = 0
    for batches in _partition_batches(log, ends):
        try:
            events += engine.fold_in_offset_order(view, batches, flush, engine.MAX_OPEN_STREAMS)
        except TidelineError:
            raise
        except Exception as e:
            raise LiveRebuildFailed(f"view {view.name}: the fold raised: {type(e).__name__}: {e}") from e
    return events


def _fold_by_stream(
    conn: store.Conn, view: FoldView, log: LogSource, ends: store.Offsets, rows_staging: str, states_staging: str
) -> int:
    """Every record held, sorted by stream (stable: partition, then offset order kept), each stream's
    events folded in version order (:func:`projections.engine.fold_sorted`, the Spark rebuild's
    fold by key)."""
    records = sorted(
        ((r.key, r.value) for r in _records(log, ends) if r.value is not None), key=lambda kv: kv[0] or b""
    )
    columns = [(_Column([k for k, _ in chunk]), _Column([v for _, v in chunk])) for chunk in _chunks(records, BATCH)]
    try:
        return engine.fold_sorted(view, columns, _flush(conn, view, rows_staging, states_staging))
    except TidelineError:
        raise
    except Exception as e:
        raise LiveRebuildFailed(f"view {view.name}: the fold raised: {type(e).__name__}: {e}") from e


def _partition_batches(log: LogSource, ends: store.Offsets) -> Iterator[Iterable[tuple[Any, Any]]]:
    """Per log partition below ``ends``: its records as ``(keys, values)`` column pairs, offset order."""
    direct = log.task_ranges(ends)
    if direct is not None:  # the embedded log: the Spark source's own reader, Arrow batches
        from eventstore.isolation import IsolationLevel
        from projections.options import DEFAULT_BATCH_ROWS
        from projections.range_reader import ReadSettings, read_range

        path, ranges = direct
        settings = ReadSettings(path, IsolationLevel.READ_COMMITTED, None, None, True, DEFAULT_BATCH_ROWS,
                                decode_avro=True)  # fmt: skip
        for rng in ranges:
            yield ((b.column("key"), b.column("value")) for b in read_range(rng, settings))
        return
    for topic, per in sorted(ends.items()):
        for partition, end in sorted(per.items()):
            records = log.records(topic, partition, end)
            yield (
                (_Column([r.key for r in chunk]), _Column([r.value for r in chunk]))
                for chunk in _chunks(records, BATCH)
            )


def _records(log: LogSource, ends: store.Offsets) -> Iterator[LogRecord]:
    for topic, per in sorted(ends.items()):
        for partition, end in sorted(per.items()):
            if end > 0:
                yield from log.records(topic, partition, end)


def _non_tombstones(records: Iterable[LogRecord]) -> Iterator[LogRecord]:
    return (r for r in records if r.value is not None)


class _Counted:
    """An iterable of records that counts what it yielded (``n``)."""

    def __init__(self, records: Iterable[LogRecord]) -> None:
        self.records = records
        self.n = 0

    def __iter__(self) -> Iterator[LogRecord]:
        for r in self.records:
            self.n += 1
            yield r


class _Column:
    """A list standing in for an Arrow array where the fold asks only for ``to_pylist()``."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def to_pylist(self) -> list[Any]:
        return self.values


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _stage_rows(conn: store.Conn, staging: str, columns: Iterable[str], rows: Iterable[Row]) -> None:
    store.copy_rows(conn, staging, (*columns, attempts.ATTEMPT_COLUMN), attempts.tagged(rows, ATTEMPT))
    conn.commit()


def _mirror(conn: store.Conn, view: MirrorView, log: LogSource, ends: store.Offsets, staging: str) -> int:
    """The last record of every key (a key lives in one partition), keys whose last record says
    "gone" left out; the records read (all of them, as the Spark rebuild counts a mirror's)."""
    import orjson

    latest: dict[bytes, LogRecord] = {}
    events = 0
    for r in _records(log, ends):
        events += 1
        if r.key is not None:  # keyless: nothing to mirror (as the follow engines)
            latest[r.key] = r
    live: list[tuple[str, str, str, int, int, int]] = []
    for key, r in latest.items():
        try:
            change = orjson.loads(r.value) if r.value is not None else None
            gone = change is None or change.get("op") in ("d", "t") or change.get("after") is None
            position = (change or {}).get("source") or {}
            lsn, index = int(position.get("commit_lsn") or 0), int(position.get("event_index") or 0)
        except Exception as e:  # not a change event: named, as a fold that cannot take an event
            raise FoldFailed(view.name, r.topic, r.partition, r.offset, e) from e
        if not gone and r.value is not None:
            live.append((view.name, key.decode(), r.value.decode(), lsn, index, ATTEMPT))
    insert = sql.SQL(
        "INSERT INTO {} (projection, key, row, commit_lsn, event_index, {}) "
        "VALUES (%s, CAST(%s AS jsonb), CAST(%s AS jsonb) -> 'after', %s, %s, %s)"
    ).format(sql.Identifier(staging), sql.Identifier(attempts.ATTEMPT_COLUMN))
    with conn.cursor() as cur:
        for chunk in _chunks(live, BATCH):
            cur.executemany(insert, chunk)
    conn.commit()
    return events
