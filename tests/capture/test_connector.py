"""The connector against the real local Postgres: ops, envelope, keys, TOAST (with both plugins), restarts."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, latest_by_key, records, sql

from capture.connector import CaptureConfig, Connector, KeylessPolicy, SlotLostError, SnapshotMode
from capture.errors import PermanentCaptureError
from capture.events import UNAVAILABLE
from capture.messages import Plugin
from capture.tables import TableFilter, TableInfo, TableRefusedError
from capture.writer import LogWriter
from eventstore.errors import ConfigError
from eventstore.log import Log
from eventstore.record_batch import Codec, unpack_header
from schemas.position import parse_lsn
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(postgres: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(postgres, request.node.name[:20].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


def test_transaction_metadata_is_off_by_default(db: str, tmp_path: Path) -> None:
    """As Debezium's provide.transaction.metadata: no BEGIN/END records unless asked for."""
    sql(db, "CREATE TABLE quiet (id int PRIMARY KEY)")
    capture(tmp_path / "log", db)
    sql(db, "INSERT INTO quiet VALUES (1)", "INSERT INTO quiet VALUES (2)")
    stats = capture(tmp_path / "log", db)
    assert stats.transactions == 2
    assert [e["transaction"]["total_order"] for e in events(tmp_path / "log", "cdc.public.quiet")] == [1, 1]
    with Log(tmp_path / "log") as log:
        assert "cdc.transaction" not in log.topics()


@pytest.mark.parametrize(("plugin", "protocol"), [(Plugin.WAL2JSON, 2), (Plugin.PGOUTPUT, 1), (Plugin.PGOUTPUT, 2),
                                                  (Plugin.PGOUTPUT, 3)], ids=["wal2json", "pgoutput-v1", "pgoutput-v2",
                                                                              "pgoutput-v3"])  # fmt: skip
def test_snapshot_then_every_op(db: str, tmp_path: Path, plugin: Plugin, protocol: int) -> None:
    """Each plugin, pgoutput with each protocol version of PostgreSQL 15 (2 is the default), gives the same
    events."""
    sql(
        db,
        "CREATE TABLE accounts (id int PRIMARY KEY, owner text, balance numeric(20,4), tags text[])",
        "INSERT INTO accounts VALUES (1, 'ann', 10.5, '{a,b}'), (2, 'bob', 0, NULL)",
    )
    capture(tmp_path / "log", db, plugin=plugin, pgoutput_proto_version=protocol)  # snapshot
    snap = events(tmp_path / "log", "cdc.public.accounts")
    assert [e["op"] for e in snap] == ["r", "r"]
    assert snap[0]["after"] == {"id": 1, "owner": "ann", "balance": "10.5000", "tags": ["a", "b"]}
    assert [e["source"]["snapshot"] for e in snap] == ["first", "last"]  # as Debezium marks them
    assert snap[0]["source"]["snapshot"] == "first"

    sql(
        db,
        "INSERT INTO accounts VALUES (3, 'cy', 12345678901234.5678, '{\"x y\",NULL}')",
        "UPDATE accounts SET balance = balance + 1 WHERE id = 1",
        "DELETE FROM accounts WHERE id = 2",
        "UPDATE accounts SET id = 30 WHERE id = 3",  # a key change
        "SELECT pg_logical_emit_message(true, 'audit', 'hello')",
    )
    capture(tmp_path / "log", db, transaction_metadata=True, plugin=plugin,
            pgoutput_proto_version=protocol)  # stream (restart from the stored position)
    recs = records(tmp_path / "log", "cdc.public.accounts")
    streamed = recs[2:]
    ops = [(k, v["op"] if v else None) for k, v, _ in streamed]
    assert ops == [
        ({"id": 3}, "c"),
        ({"id": 1}, "u"),
        ({"id": 2}, "d"),
        ({"id": 2}, None),  # tombstone after a delete
        ({"id": 3}, "d"),
        ({"id": 3}, None),
        ({"id": 30}, "c"),
    ]
    create = streamed[0][1]
    assert create["after"]["balance"] == "12345678901234.5678"  # every digit
    assert create["after"]["tags"] == ["x y", None]
    assert streamed[4][1]["source"]["event_index"] == streamed[6][1]["source"]["event_index"]
    # Debezium's key-change headers: the d event and its tombstone name the new key, the c event the old one
    assert orjson.loads(streamed[4][2]["__debezium.newkey"]) == {"id": 30}
    assert orjson.loads(streamed[5][2]["__debezium.newkey"]) == {"id": 30}
    assert orjson.loads(streamed[6][2]["__debezium.oldkey"]) == {"id": 3}
    assert "__debezium.newkey" not in streamed[0][2]
    src = create["source"]
    assert src["snapshot"] == "false" and src["table"] == "accounts" and src["schema"] == "public"
    assert src["commit_lsn"] >= src["lsn"] and isinstance(src["txId"], int) and src["event_index"] == 0
    assert create["transaction"]["id"].startswith(f"{src['txId']}:")
    messages = events(tmp_path / "log", "cdc.message")
    assert messages[0]["op"] == "m" and messages[0]["message"]["prefix"] == "audit"
    assert base64.b64decode(messages[0]["message"]["content"]) == b"hello"
    txns = events(tmp_path / "log", "cdc.transaction")
    assert [t["status"] for t in txns] == ["BEGIN", "END"] * 5
    ends = [t for t in txns if t["status"] == "END"]
    # a key change is two events (d and c), counted as Debezium counts them; the last one only emitted a message
    assert [t["event_count"] for t in ends] == [1, 1, 1, 2, 0]
    key_change = [streamed[4][1]["transaction"], streamed[6][1]["transaction"]]
    assert [(t["total_order"], t["data_collection_order"]) for t in key_change] == [(1, 1), (2, 2)]
    assert ends[0]["data_collections"] == [{"data_collection": "public.accounts", "event_count": 1}]
    state = latest_by_key(tmp_path / "log", "cdc.public.accounts")
    assert set(state) == {b'{"id":1}', b'{"id":30}'}


def test_restart_stores_nothing_twice(db: str, tmp_path: Path, plugin: Plugin) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    capture(tmp_path / "log", db, plugin=plugin)
    for round_ in range(3):
        sql(db, *[f"INSERT INTO t VALUES ({round_ * 100 + i}, {i})" for i in range(20)])
        capture(tmp_path / "log", db, plugin=plugin)
    ids = [e["after"]["id"] for e in events(tmp_path / "log", "cdc.public.t")]
    assert sorted(ids) == sorted(r * 100 + i for r in range(3) for i in range(20))
    assert len(ids) == len(set(ids))


def test_truncate_tombstones_every_live_key(db: str, tmp_path: Path, plugin: Plugin) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)", "INSERT INTO t SELECT g, 'x' FROM generate_series(1, 5) g")
    capture(tmp_path / "log", db, plugin=plugin)
    sql(db, "DELETE FROM t WHERE id = 1", "TRUNCATE t", "INSERT INTO t VALUES (9, 'after')")
    capture(tmp_path / "log", db, plugin=plugin)
    recs = records(tmp_path / "log", "cdc.public.t")
    truncate = [v for _, v, _ in recs if v and v["op"] == "t"]
    assert len(truncate) == 1 and truncate[0]["source"]["table"] == "t"
    assert latest_by_key(tmp_path / "log", "cdc.public.t") == {b'{"id":9}': {"id": 9, "v": "after"}}


@pytest.mark.parametrize("times", [1, 9])
def test_truncate_between_consistent_point_and_read_retakes_the_snapshot(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, times: int
) -> None:
    """TRUNCATE is not MVCC-safe: one that commits after the slot's consistent point but before the
    snapshot reads the table makes the snapshot see it empty, while the stream replays what came after
    the point (here an update of a row the snapshot never emitted) — a key the table no longer has would
    stay in the log. The snapshot notices and is taken again with a new slot; after five attempts in a
    row it stops with one clear error instead."""
    sql(db, "CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY, v int)",
        "INSERT INTO a VALUES (1)", "INSERT INTO b SELECT g, 0 FROM generate_series(1, 3) g")  # fmt: skip
    real = LogWriter.ensure_table_topic
    hit = {"n": 0}

    def ensure_table_topic(self: LogWriter, table: TableInfo, topic: str) -> int:
        if table.name == "b" and hit["n"] < times:  # after the consistent point, before b is read
            hit["n"] += 1
            sql(db, "UPDATE b SET v = v + 1 WHERE id = 1", "TRUNCATE b", "INSERT INTO b VALUES (7, 7)")
        return real(self, table, topic)

    monkeypatch.setattr(LogWriter, "ensure_table_topic", ensure_table_topic)
    if times > 1:
        with pytest.raises(PermanentCaptureError, match=r"table public\.b was truncated.*5 snapshots in a row"):
            capture(tmp_path / "log", db)
        return
    capture(tmp_path / "log", db)
    assert latest_by_key(tmp_path / "log", "cdc.public.b") == {b'{"id":7}': {"id": 7, "v": 7}}
    assert "taking the snapshot again with a new slot (attempt 2 of 5)" in caplog.text
    assert [e["op"] for e in events(tmp_path / "log", "cdc.public.b")] == ["r"]  # nothing of the first attempt
    assert [e["after"]["id"] for e in events(tmp_path / "log", "cdc.public.a")] == [1]
    sql(db, "UPDATE b SET v = 8 WHERE id = 7")
    capture(tmp_path / "log", db)
    assert latest_by_key(tmp_path / "log", "cdc.public.b") == {b'{"id":7}': {"id": 7, "v": 8}}


def test_unchanged_toast_survives_100_updates(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """wal2json omits the unchanged TOASTed column, pgoutput marks it 'u': filled the same way."""
    big = "x" * (1 << 20)
    sql(db, "CREATE TABLE docs (id int PRIMARY KEY, body text, n int)")
    sql(db, "ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")  # TOASTed, uncompressed
    capture(tmp_path / "log", db, plugin=plugin)
    with psycopg.connect(db, autocommit=True) as c:
        c.execute("INSERT INTO docs VALUES (1, %s, 0)", (big,))
        for i in range(100):
            c.execute("UPDATE docs SET n = %s WHERE id = 1", (i + 1,))
    capture(tmp_path / "log", db, plugin=plugin)
    evs = events(tmp_path / "log", "cdc.public.docs")
    assert len(evs) == 101
    assert all(e["after"]["body"] == big for e in evs), "an unchanged TOAST value was lost"
    # after a restart the cache is empty: the value comes from the log
    with psycopg.connect(db, autocommit=True) as c:
        c.execute("UPDATE docs SET n = -1 WHERE id = 1")
    capture(tmp_path / "log", db, plugin=plugin)
    assert events(tmp_path / "log", "cdc.public.docs")[-1]["after"]["body"] == big


def test_toast_unavailable_marker_when_nothing_is_known(db: str, tmp_path: Path, plugin: Plugin) -> None:
    big = "y" * (1 << 20)
    sql(db, "CREATE TABLE docs (id int PRIMARY KEY, body text, n int)")
    sql(db, "ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")
    with psycopg.connect(db, autocommit=True) as c:
        c.execute("INSERT INTO docs VALUES (1, %s, 0)", (big,))
    capture(tmp_path / "log", db, snapshot=SnapshotMode.NEVER, plugin=plugin)  # creates the slot after the insert
    sql(db, "UPDATE docs SET n = 1 WHERE id = 1")
    capture(tmp_path / "log", db, snapshot=SnapshotMode.NEVER, plugin=plugin)
    assert events(tmp_path / "log", "cdc.public.docs")[-1]["after"]["body"] == UNAVAILABLE


def test_replica_identity_full_fills_toast_and_keys_tables_without_pk(
    db: str, tmp_path: Path, plugin: Plugin
) -> None:
    sql(
        db,
        "CREATE TABLE nopk (a int, b text)",
        "ALTER TABLE nopk REPLICA IDENTITY FULL",
        "CREATE TABLE keyed (a int NOT NULL, b text)",
        "ALTER TABLE keyed REPLICA IDENTITY FULL",
    )
    tf = TableFilter(key_columns={"public.keyed": ["a"]})
    capture(tmp_path / "log", db, table_filter=tf, plugin=plugin)
    sql(db, "INSERT INTO nopk VALUES (1, 'p')", "UPDATE nopk SET b = 'q'", "INSERT INTO keyed VALUES (7, 'k')")
    sql(db, "UPDATE keyed SET b = 'l'", "DELETE FROM keyed")
    capture(tmp_path / "log", db, table_filter=tf, plugin=plugin)
    nopk = records(tmp_path / "log", "cdc.public.nopk")
    assert [k for k, _, _ in nopk] == [{"a": 1, "b": "p"}] * 3 + [{"a": 1, "b": "q"}]  # full-row keys
    keyed = records(tmp_path / "log", "cdc.public.keyed")
    assert [(k, v["op"] if v else None) for k, v, _ in keyed] == [
        ({"a": 7}, "c"),
        ({"a": 7}, "u"),
        ({"a": 7}, "d"),
        ({"a": 7}, None),
    ]
    assert keyed[1][1]["before"] == {"a": 7, "b": "k"}


def test_table_without_key_is_refused_under_fail(db: str, tmp_path: Path) -> None:
    """--keyless-tables fail: the behaviour before keyless capture existed (the default is keyless)."""
    sql(db, "CREATE TABLE loose (a int, b text)")
    with pytest.raises(TableRefusedError, match=r"public\.loose has no primary key"):
        capture(tmp_path / "log", db, keyless_tables=KeylessPolicy.FAIL)
    capture(tmp_path / "log", db, table_filter=TableFilter(exclude=["public.loose"]), slot="t2")


def test_exclude_and_mask_columns(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE users (id int PRIMARY KEY, email text, password text, name text)")
    sql(db, "INSERT INTO users VALUES (1, 'a@b.c', 'hunter2', 'Ann')")
    tf = TableFilter(exclude_columns=["public.users.password"], mask_columns=["public.users.email"], mask_salt="s")
    capture(tmp_path / "log", db, table_filter=tf)
    after = events(tmp_path / "log", "cdc.public.users")[0]["after"]
    assert "password" not in after and after["name"] == "Ann"
    assert after["email"] != "a@b.c" and len(after["email"]) == 64


def test_slot_lost_is_reported_and_when_needed_recovers(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
    capture(tmp_path / "log", db)
    drop_slots(db)
    sql(db, "INSERT INTO t VALUES (2)")
    with pytest.raises(SlotLostError, match="when_needed"):
        capture(tmp_path / "log", db)
    capture(tmp_path / "log", db, snapshot=SnapshotMode.WHEN_NEEDED)
    assert set(latest_by_key(tmp_path / "log", "cdc.public.t")) == {b'{"id":1}', b'{"id":2}'}


def test_existing_foreign_slot_needs_a_decision(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)", "SELECT pg_create_logical_replication_slot('t', 'wal2json')")
    with pytest.raises(ConfigError, match="stored no position"):
        capture(tmp_path / "log", db)
    sql(db, "INSERT INTO t VALUES (5)")
    capture(tmp_path / "log", db, snapshot=SnapshotMode.NEVER)
    assert [e["after"]["id"] for e in events(tmp_path / "log", "cdc.public.t")] == [5]


MEMORY_CHILD = r"""
import sys
from capture.connector import CaptureConfig, Connector
from eventstore.log import Log
with Log(sys.argv[1]) as log:
    Connector(CaptureConfig(dsn=sys.argv[2], slot="t", topic_prefix="cdc", exit_when_caught_up=True,
                            batch_bytes=1 << 20), log).run()
# VmHWM: this process's own peak (ru_maxrss also carries the parent's peak over fork/exec)
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def test_200k_row_transaction_in_bounded_memory(db: str, tmp_path: Path) -> None:
    rows = 200_000
    sql(db, "CREATE TABLE big (id int PRIMARY KEY, payload text)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", MEMORY_CHILD, str(tmp_path / "log"), db]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    baseline_kb = int(first.stdout.split()[-1])
    sql(db, f"INSERT INTO big SELECT g, repeat('p', 200) FROM generate_series(1, {rows}) g")  # one transaction
    second = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    peak_kb = int(second.stdout.split()[-1])
    assert len(events(tmp_path / "log", "cdc.public.big")) == rows
    # ~60 MB of events went through; the process grew by far less (batches of 1 MiB are committed mid-transaction)
    assert peak_kb - baseline_kb < 60_000, f"peak RSS grew by {peak_kb - baseline_kb} kB"


def test_numeric_is_exact(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE n (id int PRIMARY KEY, v numeric, w numeric(38,10))")
    capture(tmp_path / "log", db)
    value = "123456789012345678901234567.1234567890"
    sql(db, f"INSERT INTO n VALUES (1, {value}, 1234567890123456789012345678.0123456789)")
    capture(tmp_path / "log", db)
    after = events(tmp_path / "log", "cdc.public.n")[0]["after"]
    assert Decimal(after["v"]) == Decimal(value) and after["w"] == "1234567890123456789012345678.0123456789"


def test_truncate_whose_tombstones_fill_whole_batches_is_committed(db: str, tmp_path: Path) -> None:
    """Regression: when a TRUNCATE's tombstones filled the batch exactly (appended inside the open transaction,
    nothing left buffered), the connector never committed that transaction and never caught up (seen with 1M
    keys and 20,000-event batches; here 10 keys and 5-event batches)."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 10)")
    capture(tmp_path / "log", db)
    sql(db, "TRUNCATE t")
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(capture(tmp_path / "log", db, batch_events=5)), daemon=True)
    runner.start()
    runner.join(120)
    assert done, "the connector did not catch up after a TRUNCATE whose tombstones filled whole batches"
    assert latest_by_key(tmp_path / "log", "cdc.public.t") == {}
    assert len([v for _, v, _ in records(tmp_path / "log", "cdc.public.t") if v is None]) == 10


HEARTBEAT = "SELECT pg_logical_emit_message(false, 'tideline-heartbeat', now()::text)"


def test_message_heartbeat_advances_slot_and_position_of_an_idle_source(
    db: str, postgres: LocalPostgres, tmp_path: Path
) -> None:
    """Debezium's heartbeat action without a table: with the captured database idle while another
    database of the cluster writes WAL, a non-transactional logical message every interval moves
    the stored position's confirm_lsn (what read-your-writes waits on) and the slot past that WAL.
    Before the fix a message never raised the stored confirm position, so a wait for a command's
    ``commit_lsn`` could hang when other WAL followed its commit."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)")
    capture(tmp_path / "log", db)  # the slot exists
    other = fresh_database(postgres, "hb_other")
    sql(other, "CREATE TABLE busy (id int PRIMARY KEY)", "INSERT INTO busy SELECT generate_series(1, 1000)")
    with psycopg.connect(db, autocommit=True) as c:
        row = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        target = parse_lsn(row[0])

        def slot_lsn() -> int:
            got = c.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 't'")
            (text,) = got.fetchone() or ("0/0",)
            return parse_lsn(text)

        assert slot_lsn() < target
        config = CaptureConfig(
            dsn=db, slot="t", topic_prefix="cdc", heartbeat_query=HEARTBEAT, heartbeat_interval_s=0.2
        )
        with Log(tmp_path / "log") as log:
            connector = Connector(config, log)
            runner = threading.Thread(target=connector.run, daemon=True)
            runner.start()
            try:
                deadline = time.monotonic() + 60
                position = connector.read_position()
                # the idle keepalives move the position too (capture.streaming): wait for a beat as well
                while (position is None or position.confirm_lsn < target or not connector.stats.events) and (
                    time.monotonic() < deadline
                ):
                    time.sleep(0.1)
                    position = connector.read_position()
            finally:
                connector.stop()
                runner.join(60)
    assert not runner.is_alive()
    assert slot_lsn_after(db) >= target, "the heartbeat did not move the slot"
    assert position is not None and position.confirm_lsn >= target, position
    beats = events(tmp_path / "log", "cdc.message")
    assert beats and {b["message"]["prefix"] for b in beats} == {"tideline-heartbeat"}
    assert events(tmp_path / "log", "cdc.public.t") == []


def slot_lsn_after(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 't'").fetchone()
        return parse_lsn(row[0]) if row else 0


def test_compressed_capture_reads_back_the_same_events(db: str, tmp_path: Path) -> None:
    """--compression (CaptureConfig.compression): the log holds the same events, snapshot and stream, in far
    fewer bytes; a codec the log cannot store is refused before anything starts."""
    sql(db, "CREATE TABLE docs (id int PRIMARY KEY, body text, n int)",
        "INSERT INTO docs SELECT g, 'row ' || g, g FROM generate_series(1, 2000) g")  # fmt: skip
    for codec in (None, "lz4"):
        capture(tmp_path / f"log-{codec}", db, slot=f"s_{codec}".lower(), compression=codec)
    sql(db, "UPDATE docs SET n = n + 1 WHERE id <= 500", "DELETE FROM docs WHERE id > 1900")
    for codec in (None, "lz4"):
        capture(tmp_path / f"log-{codec}", db, slot=f"s_{codec}".lower(), compression=codec)
    plain, packed = (records(tmp_path / f"log-{c}", "cdc.public.docs") for c in (None, "lz4"))

    def data(recs: list[tuple[Any, Any, dict[str, bytes]]]) -> list[tuple[Any, Any]]:
        return [(k, v and {**v, "ts_ms": 0, "source": {**v["source"], "ts_ms": 0, "lsn": 0, "commit_lsn": 0}})
                for k, v, _ in recs]  # fmt: skip

    assert len(plain) == 2000 + 500 + 2 * 100 and data(packed) == data(plain)

    def stored(log_dir: Path) -> int:
        return sum(f.stat().st_size for f in log_dir.glob("cdc.public.docs-*/*.log"))

    assert stored(tmp_path / "log-lz4") < stored(tmp_path / "log-None") / 3
    # The default is lz4 (CaptureConfig.compression, capture run's --compression); "none" stores plain batches.
    for name, codec in (("default", Codec.LZ4), ("none", Codec.NONE)):
        kw = {} if name == "default" else {"compression": name}
        capture(tmp_path / f"log-{name}", db, slot=f"c_{name}", **kw)
        segments = sorted((tmp_path / f"log-{name}").glob("cdc.public.docs-*/*.log"))
        assert segments and {unpack_header(f.read_bytes()).codec for f in segments} == {codec}, name
    with pytest.raises(ConfigError, match="unknown compression codec 'snappy'"):
        capture(tmp_path / "log-snappy", db, slot="s_snappy", compression="snappy")
