"""The plain-SQL part of the reservations demo (``make demo``): the ``shop.orders`` table, its workload and its checks.

The table (numeric, jsonb, arrays, timestamps, large text), rows for it, a workload of
inserts, updates, key changes and deletes in many transactions, and the two views the
demo compares: every row as the connector writes it (``_table_state``: uncast text →
converters → JSON form) and the latest ``after`` per key in the captured topic
(``_log_state``, which also counts events stored twice).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg

from capture.pgtypes import SESSION_OPTIONS, dumps
from capture.tables import TableCatalog, TableFilter, result_rows, select_columns_sql
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log

TABLE = "shop.orders"
TOPIC = "demo.shop.orders"
SLOT = "tideline_demo"
INSERT = "INSERT INTO shop.orders (id, customer, total, items, tags, note) VALUES (%s, %s, %s, %s, %s, %s)"


@dataclass(slots=True)
class SqlWorkload:
    """What the workload has done so far; ``next_id`` is the next unused primary key."""

    next_id: int
    statements: int = 0
    transactions: int = 0


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


def _workload(dsn: str, rng: random.Random, transactions: int, result: SqlWorkload, on_txn: Any) -> None:
    next_id = result.next_id
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
            result.next_id = next_id
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
