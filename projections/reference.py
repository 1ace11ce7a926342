"""Every view computed in plain Python from the log (read_committed), embedded or Kafka.

The reference the tests and the demo hold Spark's results against: no Spark, no SQL, the
same declarations (the aggregates' ``apply``, ``FoldView.rows``, ``CountView.contributions``,
a dict for "latest row per key"). :func:`view_rows` reads what a view holds in Postgres in
the same form. The log is the embedded log's directory or a
:class:`~projections.sources.LogSource` (Kafka: records read with ``KafkaReader``).

Rows are tuples in :func:`projections.views.columns_of` order; jsonb values as parsed JSON.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql

from projections.sources import LogSource, as_source
from projections.store import Offsets
from projections.views import CountView, FoldView, MirrorView, Row, StoredEvent, Stream, View, columns_of

Record = tuple[bytes | None, bytes | None]  # key, value
Log = Path | LogSource  # the embedded log's directory, or a source


def records(log: Log, topics: tuple[str, ...], until: Offsets | None = None) -> Iterator[tuple[str, int, Record]]:
    """``(topic, partition, (key, value))`` of every committed record, partition by partition
    (with ``until``: only those at offsets below it; partitions it leaves out: none); keys and
    values framed as Avro by capture come back as the JSON capture writes otherwise."""
    source = as_source(log)
    try:
        for topic, partitions in source.partition_counts(topics).items():
            for p in range(partitions):
                limit = None if until is None else until.get(topic, {}).get(p, 0)
                if limit == 0:
                    continue
                for r in source.records(topic, p, limit):
                    yield topic, p, (r.key, r.value)
    finally:
        if source is not log:
            source.close()


def expected_rows(view: View, log: Log, until: Offsets | None = None) -> list[Row]:
    """What ``view`` must hold after applying everything committed in the log (or, with
    ``until``, the records below those offsets: what a view with these checkpoints holds)."""
    if isinstance(view, FoldView):
        return _fold(view, log, until)
    if isinstance(view, CountView):
        return _counts(view, log, until)
    return _mirror(view, log, until)


def _fold(view: FoldView, log: Log, until: Offsets | None) -> list[Row]:
    streams: dict[str, list[StoredEvent]] = defaultdict(list)
    for _, _, (_, value) in records(log, view.topics, until):
        if value is not None:
            e = StoredEvent.from_value(value)
            streams[e.stream_id].append(e)
    out: list[Row] = []
    for events in streams.values():
        events.sort(key=lambda e: e.version)
        first, last = events[0], events[-1]
        state = view.fold(first.stream_type, events)
        out.extend(
            view.rows(Stream(view.aggregate(first.stream_type), first.stream_id, last.version, last.commit_lsn, state))
        )
    return normalized(out)


def _counts(view: CountView, log: Log, until: Offsets | None) -> list[Row]:
    totals: dict[Row, list[int]] = {}
    for _, _, (_, value) in records(log, view.topics, until):
        if value is None:
            continue
        for key, counts in view.contributions(StoredEvent.from_value(value)):
            current = totals.setdefault(key, [0] * len(counts))
            for i, n in enumerate(counts):
                current[i] += n
    return normalized([(*key, *view.extra(key), *counts) for key, counts in totals.items()])


def _mirror(view: MirrorView, log: Log, until: Offsets | None) -> list[Row]:
    latest: dict[bytes, Row | None] = {}
    for _, _, (key, value) in records(log, view.topics, until):
        if key is None:
            continue
        change = orjson.loads(value) if value is not None else None
        if change is None or change.get("op") in ("d", "t") or change.get("after") is None:
            latest[key] = None
        else:
            source = change.get("source") or {}
            row = (view.name, orjson.loads(key), change["after"], int(source.get("commit_lsn", 0)),
                   int(source.get("event_index", 0)))  # fmt: skip
            latest[key] = row
    return normalized([r for r in latest.values() if r is not None])


def view_rows(dsn: str, view: View) -> list[Row]:
    """What ``view`` holds in the database at ``dsn``, as :func:`expected_rows` gives it."""
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in columns_of(view))
    query = sql.SQL("SELECT {} FROM {}").format(columns, sql.Identifier(view.table.name))
    params: tuple[Any, ...] = ()
    if isinstance(view, MirrorView):
        query += sql.SQL(" WHERE projection = %s")
        params = (view.name,)
    elif isinstance(view, FoldView) and view.snapshots:
        query += sql.SQL(" WHERE stream_type = ANY(%s)")
        params = ([a.name for a in view.aggregates],)
    with psycopg.connect(dsn) as conn:
        return normalized([tuple(r) for r in conn.execute(query, params)])


def normalized(rows: list[Row]) -> list[Row]:
    """Rows in a canonical order (JSON values compared by their sorted-key encoding)."""
    return sorted(
        rows, key=lambda r: orjson.dumps(r, option=orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME, default=str)
    )
