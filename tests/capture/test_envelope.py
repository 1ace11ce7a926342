"""Every op's envelope, field by field, against Debezium's documented PostgreSQL examples (one table of cases).

Debezium's documentation ("Descriptions of Debezium PostgreSQL connector data change
events") shows, for the ``customers`` table (id PRIMARY KEY, first_name, last_name,
email): a create with ``before: null``; an update with ``before: null`` under REPLICA
IDENTITY DEFAULT and the old row under FULL; a delete whose ``before`` holds what the
replica identity carries (the key columns under DEFAULT) followed by a tombstone; a
primary-key change as delete (old key, ``before`` = the old image) + tombstone + create
(new key), with the ``__debezium.newkey`` / ``__debezium.oldkey`` headers; a truncate with
neither ``before`` nor ``after``; a logical-decoding message with ``message.prefix`` /
``message.content`` (base64), key ``{"prefix": …}`` and ``source.schema``/``table`` empty;
a snapshot read ``op: r`` with ``source.snapshot`` set. Where Tideline differs it is
documented (docs/capture.md): a truncate's key is ``{}`` (a compacted topic cannot hold a
null key) and ``source`` carries ``commit_lsn`` and ``event_index`` (our unique position).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from capture_util import capture, drop_slots, fresh_database, records, sql

from capture.messages import Plugin
from tideline.pgharness import LocalPostgres

SOURCE_FIELDS = {
    "version", "connector", "name", "ts_ms", "snapshot", "db", "schema", "table", "txId", "lsn", "commit_lsn",
    "event_index",
}  # fmt: skip
ENVELOPE_FIELDS = {"before", "after", "source", "op", "ts_ms", "transaction"}


@dataclass(frozen=True)
class Case:
    name: str
    statements: tuple[str, ...]  # run after the snapshot, streamed
    topic: str
    # expected records, in order: (key, op or None for a tombstone, before, after, headers to check)
    expected: tuple[tuple[Any, str | None, Any, Any, dict[str, Any]], ...]
    identity_full: bool = False
    snapshot_rows: tuple[str, ...] = ("INSERT INTO customers VALUES (1001, 'Sally', 'Thomas', 's@x.org')",)
    source: dict[str, Any] = field(default_factory=dict)


ROW = {"id": 1001, "first_name": "Sally", "last_name": "Thomas", "email": "s@x.org"}
NEW_ROW = {"id": 1002, "first_name": "Anne", "last_name": "Kretchmar", "email": "a@x.org"}

CASES = [
    Case("create", ("INSERT INTO customers VALUES (1002, 'Anne', 'Kretchmar', 'a@x.org')",), "cdc.public.customers",
         (({"id": 1002}, "c", None, NEW_ROW, {}),), source={"snapshot": "false", "table": "customers"}),
    Case("update (replica identity default)", ("UPDATE customers SET first_name = 'Anne Marie' WHERE id = 1001",),
         "cdc.public.customers", (({"id": 1001}, "u", None, {**ROW, "first_name": "Anne Marie"}, {}),)),
    Case("update (replica identity full)", ("UPDATE customers SET first_name = 'Anne Marie' WHERE id = 1001",),
         "cdc.public.customers", (({"id": 1001}, "u", ROW, {**ROW, "first_name": "Anne Marie"}, {}),),
         identity_full=True),
    Case("delete (replica identity default)", ("DELETE FROM customers WHERE id = 1001",), "cdc.public.customers",
         (({"id": 1001}, "d", {"id": 1001}, None, {}), ({"id": 1001}, None, None, None, {}))),
    Case("delete (replica identity full)", ("DELETE FROM customers WHERE id = 1001",), "cdc.public.customers",
         (({"id": 1001}, "d", ROW, None, {}), ({"id": 1001}, None, None, None, {})), identity_full=True),
    Case("key change", ("UPDATE customers SET id = 1002 WHERE id = 1001",), "cdc.public.customers",
         (({"id": 1001}, "d", {"id": 1001}, None, {"__debezium.newkey": {"id": 1002}}),
          ({"id": 1001}, None, None, None, {"__debezium.newkey": {"id": 1002}}),
          ({"id": 1002}, "c", None, {**ROW, "id": 1002}, {"__debezium.oldkey": {"id": 1001}}))),
    Case("key change (replica identity full)", ("UPDATE customers SET id = 1002 WHERE id = 1001",),
         "cdc.public.customers",
         (({"id": 1001}, "d", ROW, None, {"__debezium.newkey": {"id": 1002}}),
          ({"id": 1001}, None, None, None, {"__debezium.newkey": {"id": 1002}}),
          ({"id": 1002}, "c", None, {**ROW, "id": 1002}, {"__debezium.oldkey": {"id": 1001}})),
         identity_full=True),
    Case("truncate", ("TRUNCATE customers",), "cdc.public.customers",
         (({}, "t", None, None, {}), ({"id": 1001}, None, None, None, {}))),
    Case("message", ("SELECT pg_logical_emit_message(true, 'foo', 'bar')",), "cdc.message",
         (({"prefix": "foo"}, "m", None, None, {}),), source={"schema": "", "table": ""}),
]  # fmt: skip


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "envelope")
    yield dsn
    drop_slots(dsn)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_envelope_matches_debezium(case: Case, db: str, tmp_path: Path, plugin: Plugin) -> None:
    """The same envelopes from either plugin (pgoutput's differences stay inside its decoder)."""
    sql(db, "CREATE TABLE customers (id int PRIMARY KEY, first_name text, last_name text, email text)")
    if case.identity_full:
        sql(db, "ALTER TABLE customers REPLICA IDENTITY FULL")
    sql(db, *case.snapshot_rows)
    capture(tmp_path / "log", db, plugin=plugin)
    snapshot = records(tmp_path / "log", "cdc.public.customers")
    # the snapshot read: op r, before null, after the row, source.snapshot set (the only read is also the last)
    [(key, read, _)] = snapshot
    assert key == {"id": 1001} and set(read) == ENVELOPE_FIELDS
    assert (read["op"], read["before"], read["after"]) == ("r", None, ROW)
    assert read["source"]["snapshot"] == "last" and set(read["source"]) == SOURCE_FIELDS
    assert read["transaction"] is None

    sql(db, *case.statements)
    capture(tmp_path / "log", db, plugin=plugin)
    streamed = records(tmp_path / "log", case.topic)[len(snapshot) if case.topic == "cdc.public.customers" else 0 :]
    assert len(streamed) == len(case.expected), streamed
    for (key, value, headers), (want_key, op, before, after, want_headers) in zip(streamed, case.expected, strict=True):
        assert key == want_key
        for name, decoded in want_headers.items():
            assert orjson.loads(headers[name]) == decoded
        if op is None:
            assert value is None  # a tombstone
            continue
        assert value["op"] == op and value["ts_ms"] > 0
        source = value["source"]
        assert set(source) == SOURCE_FIELDS
        assert source["connector"] == "postgresql" and source["name"] == "cdc" and source["db"] == db.rsplit("/", 1)[1]
        assert source["snapshot"] == "false" and isinstance(source["txId"], int)
        assert source["commit_lsn"] >= source["lsn"] > 0 and source["event_index"] >= 0
        for name, expected in case.source.items():
            assert source[name] == expected, name
        if op == "m":
            assert value["message"]["prefix"] == "foo" and base64.b64decode(value["message"]["content"]) == b"bar"
            continue
        assert set(value) == ENVELOPE_FIELDS
        assert source["schema"] == "public" and source["table"] == "customers"
        assert value["before"] == before and value["after"] == after
        assert value["transaction"]["id"] == f"{source['txId']}:{source['commit_lsn']}"
