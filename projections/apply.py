"""Applying a batch of log records to a view, in plain Python, inside the caller's transaction.

What ``follow`` does with one batch, whichever engine read it: fold views (both engines:
the Spark follower collects a batch's events to the driver and folds them here), count
views and mirrors (the live engine; the Spark engine computes those two with DataFrames
in :mod:`projections.follow` — the equivalence tests hold both to the reference).

- **fold views**: load the touched streams' states (``projection_state``, locked), fold
  the new events one by one (versions ≤ the stored one skipped), delete the streams'
  previous rows, insert the new ones; a key held by another stream is taken over only
  by a row with a larger ``commit_lsn``; snapshots are upserted. An event the fold
  cannot take (a value that is not an outbox event, an unknown type, an ``apply`` that
  raises) raises :class:`~projections.progress.FoldFailed` naming it.
- **count views**: ``contributions(event)`` summed per key, added to the stored counts.
- **mirrors**: the batch's latest record per key: upsert its ``after`` image, or delete
  the key (tombstone, ``d``, ``t``, no ``after``). The image goes to Postgres as the
  change's JSON text and is extracted there (``->'after'``), so numbers keep every digit.

Every ``apply_*`` returns the largest source ``commit_lsn`` applied per ``(topic,
partition)``. Functions here never commit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import orjson
from psycopg import sql
from psycopg.types.json import Jsonb

from commands.codec import from_json, to_json
from projections import store
from projections.progress import FoldFailed
from projections.views import CountView, FoldView, MirrorView, Row, StoredEvent, Stream, View, columns_of, key_columns

Lsns = dict[tuple[str, int], int]


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One record of a view's topics, where it was read (keys and values as capture's JSON)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # None: a tombstone


@dataclass(frozen=True, slots=True)
class LocatedEvent:
    """An outbox event and the record it came from (named when its fold fails)."""

    topic: str
    partition: int
    offset: int
    event: StoredEvent


def apply_records(conn: store.Conn, view: View, records: Sequence[LogRecord]) -> Lsns:
    """Apply ``records`` (offset order within each partition) to ``view``'s tables."""
    return _APPLY[type(view)](conn, view, records)


# -- fold views ---------------------------------------------------------------------------------


def located_events(view: FoldView, records: Iterable[LogRecord]) -> list[LocatedEvent]:
    """Outbox records (tombstones skipped) parsed; a value that is not an event fails its fold."""
    out: list[LocatedEvent] = []
    for r in records:
        if r.value is None:
            continue
        try:
            out.append(LocatedEvent(r.topic, r.partition, r.offset, StoredEvent.from_value(r.value)))
        except Exception as e:
            raise FoldFailed(view.name, r.topic, r.partition, r.offset, e) from e
    return out


def _apply_fold_records(conn: store.Conn, view: View, records: Sequence[LogRecord]) -> Lsns:
    assert isinstance(view, FoldView)
    return apply_fold(conn, view, located_events(view, records))


def apply_fold(conn: store.Conn, view: FoldView, located: Sequence[LocatedEvent]) -> Lsns:
    """Fold the batch's events into the touched streams' stored states; replace their rows."""
    streams: dict[str, list[LocatedEvent]] = defaultdict(list)
    for e in located:
        streams[e.event.stream_id].append(e)
    stored = {
        sid: (int(v), int(lsn), state)
        for sid, v, lsn, state in conn.execute(
            "SELECT stream_id, version, commit_lsn, state FROM projection_state WHERE projection = %s "
            "AND stream_id = ANY(%s) FOR UPDATE",
            (view.name, list(streams)),
        )
    }
    old_rows: list[Row] = []
    new_rows: list[Row] = []
    states: list[Row] = []
    for sid, events in streams.items():
        events.sort(key=lambda e: e.event.version)
        version, lsn, raw = stored.get(sid, (0, 0, None))
        if events[-1].event.version <= version:
            continue  # all applied already
        before = None if raw is None else _state(view, events[0], raw)
        if before is not None:
            old_rows.extend(view.rows(Stream(view.aggregate(events[0].event.stream_type), sid, version, lsn, before)))
        after = fold_stream(view, events, before, version)
        new_rows.extend(view.rows(after))
        states.append((view.name, sid, after.version, after.commit_lsn, Jsonb(to_json(after.state))))
    if view.snapshots:
        _upsert_snapshots(conn, new_rows)
    else:
        _replace_rows(conn, view, old_rows, new_rows)
    with conn.cursor() as cur:
        cur.executemany(
            """
            INSERT INTO projection_state (projection, stream_id, version, commit_lsn, state) VALUES (%s, %s, %s, %s, %s)
            ON CONFLICT (projection, stream_id) DO UPDATE
               SET version = EXCLUDED.version, commit_lsn = EXCLUDED.commit_lsn, state = EXCLUDED.state
            """,
            states,
        )
    return max_lsns((e.topic, e.partition, e.event.commit_lsn) for e in located)


def _state(view: FoldView, first: LocatedEvent, raw: object) -> object:
    """A stored state (JSON form) back into the aggregate's state class."""
    try:
        return from_json(view.aggregate(first.event.stream_type).state_type, raw)
    except Exception as e:
        raise FoldFailed(view.name, first.topic, first.partition, first.offset, e) from e


def fold_stream(view: FoldView, events: Sequence[LocatedEvent], state: object, version: int) -> Stream:
    """The stream after ``events`` (version order) with version > ``version``, from ``state``:
    folded one event at a time, so that an event the fold cannot take is named."""
    first = events[0].event
    last: StoredEvent | None = None
    for located in events:
        e = located.event
        if e.version <= version:
            continue
        try:
            state = view.fold(e.stream_type, [e], state)  # decode (upcasters) + apply
        except Exception as exc:
            raise FoldFailed(view.name, located.topic, located.partition, located.offset, exc) from exc
        last = e
    return Stream(
        view.aggregate(first.stream_type),
        first.stream_id,
        last.version if last else version,
        last.commit_lsn if last else 0,
        state,
    )


def _replace_rows(conn: store.Conn, view: FoldView, old_rows: list[Row], new_rows: list[Row]) -> None:
    """Delete the streams' previous rows (matched on every column), then insert the new ones; a key
    held by another stream is taken over only by a row with a larger commit_lsn."""
    table = view.table.name
    columns = columns_of(view)
    keys = key_columns(view.table)
    if old_rows:
        match = sql.SQL(" AND ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in columns)
        with conn.cursor() as cur:
            cur.executemany(sql.SQL("DELETE FROM {} WHERE {}").format(sql.Identifier(table), match), old_rows)
    if not new_rows:
        return
    insert = sql.SQL("INSERT INTO {} AS t ({}) VALUES ({}) ").format(
        sql.Identifier(table),
        sql.SQL(", ").join(sql.Identifier(c) for c in columns),
        sql.SQL(", ").join(sql.Placeholder() for _ in columns),
    )
    if "commit_lsn" in columns:
        insert += sql.SQL("ON CONFLICT ({}) DO UPDATE SET {} WHERE t.commit_lsn < EXCLUDED.commit_lsn").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in keys),
            sql.SQL(", ").join(
                sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in columns if c not in keys
            ),
        )
    lsn_at = columns.index("commit_lsn") if "commit_lsn" in columns else None
    ordered = sorted(new_rows, key=lambda r: r[lsn_at]) if lsn_at is not None else new_rows
    with conn.cursor() as cur:
        cur.executemany(insert, ordered)


def _upsert_snapshots(conn: store.Conn, rows: list[Row]) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            """
            INSERT INTO snapshots (stream_id, stream_type, version, schema_version, state) VALUES (%s, %s, %s, %s, %s)
            ON CONFLICT (stream_id) DO UPDATE
               SET stream_type = EXCLUDED.stream_type, version = EXCLUDED.version,
                   schema_version = EXCLUDED.schema_version, state = EXCLUDED.state, recorded_at = now()
             WHERE snapshots.version < EXCLUDED.version OR snapshots.schema_version <> EXCLUDED.schema_version
            """,
            [(*r[:4], Jsonb(r[4])) for r in rows],
        )


def max_lsns(items: Iterable[tuple[str, int, int]]) -> Lsns:
    out: Lsns = {}
    for topic, partition, lsn in items:
        out[(topic, partition)] = max(lsn, out.get((topic, partition), 0))
    return out


# -- count views --------------------------------------------------------------------------------


def add_counts(conn: store.Conn, view: CountView, rows: Sequence[Row]) -> None:
    """Add rows ``(key columns…, extra columns…, count columns…)`` to the stored counts."""
    columns = columns_of(view)
    statement = sql.SQL("INSERT INTO {} AS t ({}) VALUES ({}) ON CONFLICT ({}) DO UPDATE SET {}").format(
        sql.Identifier(view.table.name),
        sql.SQL(", ").join(sql.Identifier(c) for c in columns),
        sql.SQL(", ").join(sql.Placeholder() for _ in columns),
        sql.SQL(", ").join(sql.Identifier(c) for c in view.key_columns),
        sql.SQL(", ").join(sql.SQL("{0} = t.{0} + EXCLUDED.{0}").format(sql.Identifier(c)) for c in view.count_columns),
    )
    with conn.cursor() as cur:
        cur.executemany(statement, rows)


def _apply_count_records(conn: store.Conn, view: View, records: Sequence[LogRecord]) -> Lsns:
    """``contributions(event)`` per event, summed per key (the Python twin of ``frame``)."""
    assert isinstance(view, CountView)
    rows, lsns = count_rows(view, records)
    add_counts(conn, view, rows)
    return lsns


def count_rows(view: CountView, records: Iterable[LogRecord]) -> tuple[list[Row], Lsns]:
    """The rows ``(key columns…, extra columns…, count columns…)`` that ``records`` add to ``view``
    (``contributions(event)`` summed per key; tombstones skipped), and the largest commit LSN per
    partition. An event ``contributions`` cannot take raises :class:`FoldFailed` naming it."""
    totals: dict[Row, list[int]] = {}
    lsns: list[tuple[str, int, int]] = []
    for r in records:
        if r.value is None:
            continue
        try:
            event = StoredEvent.from_value(r.value)
            contributions = view.contributions(event)
        except Exception as e:
            raise FoldFailed(view.name, r.topic, r.partition, r.offset, e) from e
        lsns.append((r.topic, r.partition, event.commit_lsn))
        for key, counts in contributions:
            current = totals.setdefault(tuple(key), [0] * len(counts))
            for i, n in enumerate(counts):
                current[i] += n
    return [(*key, *view.extra(key), *counts) for key, counts in totals.items()], max_lsns(lsns)


# -- mirrors ------------------------------------------------------------------------------------


def _apply_mirror_records(conn: store.Conn, view: View, records: Sequence[LogRecord]) -> Lsns:
    """The batch's latest record per key (a key lives in one partition: offset order is its order)."""
    assert isinstance(view, MirrorView)
    latest: dict[bytes, tuple[bytes | None, int, int]] = {}  # key → (change JSON or None: gone, lsn, index)
    lsns: list[tuple[str, int, int]] = []
    for r in records:
        try:
            change = orjson.loads(r.value) if r.value is not None else None
            source = (change or {}).get("source") or {}
            lsn, index = int(source.get("commit_lsn") or 0), int(source.get("event_index") or 0)
        except Exception as e:  # not a change event: name it, as a fold that cannot take an event
            raise FoldFailed(view.name, r.topic, r.partition, r.offset, e) from e
        lsns.append((r.topic, r.partition, lsn))
        if r.key is None:
            continue  # keyless: nothing to mirror (as the reference and Spark's groupBy on key)
        gone = change is None or change.get("op") in ("d", "t") or change.get("after") is None
        latest[r.key] = (None if gone else r.value, lsn, index)
    gone_keys = [(view.name, k.decode()) for k, (value, _, _) in latest.items() if value is None]
    live = [(view.name, k.decode(), v.decode(), lsn, i) for k, (v, lsn, i) in latest.items() if v is not None]
    with conn.cursor() as cur:
        if gone_keys:
            cur.executemany("DELETE FROM cdc_mirror WHERE projection = %s AND key = CAST(%s AS jsonb)", gone_keys)
        if live:
            cur.executemany(
                """
                INSERT INTO cdc_mirror (projection, key, row, commit_lsn, event_index)
                VALUES (%s, CAST(%s AS jsonb), CAST(%s AS jsonb) -> 'after', %s, %s)
                ON CONFLICT (projection, key) DO UPDATE
                   SET row = EXCLUDED.row, commit_lsn = EXCLUDED.commit_lsn, event_index = EXCLUDED.event_index
                """,
                live,
            )
    return max_lsns(lsns)


_APPLY: dict[type, Callable[[store.Conn, View, Sequence[LogRecord]], Lsns]] = {
    FoldView: _apply_fold_records,
    CountView: _apply_count_records,
    MirrorView: _apply_mirror_records,
}
