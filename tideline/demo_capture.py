"""The capture part of ``tideline demo``: a private Postgres, a workload, captured and verified.

Starts a throwaway PostgreSQL 15 with wal2json in ``<demo dir>/postgres`` (stopped by
PID at the end, whatever happens), fills a table, captures it (initial snapshot), runs
a workload of inserts, updates, key changes and deletes in many transactions, captures
again (streaming from the stored position), and checks that the latest value of every
key in the log equals ``SELECT *`` of the table, value for value (numeric, jsonb,
arrays and timestamps included), and that no event was stored twice.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg

from capture.connector import CaptureConfig, Connector, Stats, slot_status
from capture.pgtypes import SESSION_OPTIONS, dumps
from capture.tables import TableCatalog, TableFilter, result_rows, select_columns_sql
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

TABLE = "shop.orders"
TOPIC = "demo.shop.orders"
SLOT = "tideline_demo"
INSERT = "INSERT INTO shop.orders (id, customer, total, items, tags, note) VALUES (%s, %s, %s, %s, %s, %s)"


@dataclass(slots=True)
class CaptureResult:
    rows_initial: int = 0
    statements: int = 0
    transactions: int = 0
    snapshot: Stats | None = None
    stream: Stats | None = None
    snapshot_seconds: float = 0.0
    stream_seconds: float = 0.0
    events_in_topic: int = 0
    table_rows: int = 0
    retained_wal_bytes: int = 0
    mismatches: int = 0
    duplicates: int = 0
    dsn: str = ""


SCHEMA = """
CREATE SCHEMA shop;
CREATE TABLE shop.orders (
    id int PRIMARY KEY,
    customer text NOT NULL,
    total numeric(14,4) NOT NULL,
    items jsonb,
    tags text[],
    placed timestamptz NOT NULL DEFAULT now(),
    note text
);
"""


def _row(i: int, rng: random.Random) -> tuple[Any, ...]:
    items = orjson.dumps([{"sku": f"sku-{rng.randrange(500)}", "qty": rng.randint(1, 9)}]).decode()
    tags = "{" + ",".join(rng.sample(["new", "gift", "rush", "a b", "c,d"], rng.randint(0, 3))) + "}"
    total = f"{rng.randrange(10**9)}.{rng.randrange(10**4):04d}"
    return (i, f"customer-{rng.randrange(2000)}", total, items, tags, "x" * rng.choice([0, 10, 3000]))


def _workload(dsn: str, rng: random.Random, transactions: int, result: CaptureResult, on_txn: Any) -> None:
    next_id = result.rows_initial + 1
    with psycopg.connect(dsn) as c:
        for _ in range(transactions):
            with c.transaction():
                for _ in range(rng.randint(1, 40)):
                    roll = rng.random()
                    if roll < 0.5:
                        c.execute(INSERT, _row(next_id, rng))
                        next_id += 1
                    elif roll < 0.8:
                        c.execute(
                            "UPDATE shop.orders SET total = total + 0.0001, tags = array_append(tags, 'upd') "
                            "WHERE id = %s",
                            (rng.randrange(1, next_id),),
                        )
                    elif roll < 0.9:
                        c.execute("DELETE FROM shop.orders WHERE id = %s", (rng.randrange(1, next_id),))
                    else:  # a primary-key change
                        c.execute("UPDATE shop.orders SET id = %s WHERE id = %s", (next_id, rng.randrange(1, next_id)))
                        next_id += 1
                    result.statements += 1
            result.transactions += 1
            on_txn()


def _table_state(dsn: str) -> dict[bytes, Any]:
    """Every row as the connector would write it: uncast text → converters → JSON form."""
    catalog = TableCatalog(dsn, TableFilter(include=[TABLE]))
    (info,) = catalog.load()
    out: dict[bytes, Any] = {}
    with psycopg.connect(dsn, options=SESSION_OPTIONS) as c:
        res = c.execute(select_columns_sql(info)).pgresult
        assert res is not None
        for columns in result_rows(res, info):
            row = {col.name: col.value for col in columns}
            out[dumps({"id": row["id"]})] = orjson.loads(dumps(row))
    return out


def _log_state(log: Log) -> tuple[dict[bytes, Any], int, int]:
    """Latest ``after`` per key, the number of change events, and how many were stored twice."""
    state: dict[bytes, Any] = {}
    events = duplicates = 0
    seen: set[tuple[int, int, bytes]] = set()
    with Consumer(log, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(TOPIC, p) for p in range(log.topic(TOPIC).partitions)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=0):
            for r in records:
                assert r.key is not None
                if r.value is None:
                    state.pop(r.key, None)
                    continue
                value = orjson.loads(r.value)
                events += 1
                src = value["source"]
                ident = (src["commit_lsn"], src["event_index"], r.key + value["op"].encode())
                duplicates += ident in seen and value["op"] != "r"
                seen.add(ident)
                if value["op"] in ("d", "t"):
                    state.pop(r.key, None)
                else:
                    state[r.key] = value["after"]
    return state, events, duplicates


def run_capture_demo(directory: Path, log: Log, *, rows: int, transactions: int, progress: Any) -> CaptureResult:
    """The whole capture phase; Postgres is stopped before this returns or raises."""
    rng = random.Random(7)
    result = CaptureResult(rows_initial=rows)
    start_task = progress.add_task("postgres: start + load", total=rows)
    snap_task = progress.add_task("capture: snapshot", total=rows)
    work_task = progress.add_task("postgres: workload", total=transactions)
    stream_task = progress.add_task("capture: stream + verify", total=1)
    pg = LocalPostgres(directory / "postgres", fast=True)
    try:
        pg.start()
        dsn = result.dsn = pg.create_database("shop")
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(SCHEMA.encode())
            with c.cursor().copy("COPY shop.orders (id, customer, total, items, tags, note) FROM STDIN") as copy:
                for i in range(1, rows + 1):
                    copy.write_row(_row(i, rng))
                    if i % 1000 == 0:
                        progress.update(start_task, completed=i)
        progress.update(start_task, completed=rows)
        config = CaptureConfig(dsn=dsn, slot=SLOT, topic_prefix="demo", exit_when_caught_up=True)
        started = time.monotonic()
        result.snapshot = Connector(config, log).run()
        result.snapshot_seconds = time.monotonic() - started
        progress.update(snap_task, completed=result.snapshot.snapshot_rows)
        _workload(dsn, rng, transactions, result, lambda: progress.advance(work_task))
        started = time.monotonic()
        result.stream = Connector(config, log).run()
        result.stream_seconds = time.monotonic() - started
        state, result.events_in_topic, result.duplicates = _log_state(log)
        table = _table_state(dsn)
        result.table_rows = len(table)
        result.mismatches = sum(1 for k in set(state) | set(table) if state.get(k) != table.get(k))
        info = slot_status(dsn, SLOT)
        result.retained_wal_bytes = info["retained_wal_bytes"] if info else -1
        progress.update(stream_task, completed=1)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
    finally:
        pg.stop()
    return result
