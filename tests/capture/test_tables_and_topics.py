"""Tables an ordinary database has: keyless tables (--keyless-tables), names that are not topic names, overrides."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from capture_util import capture, drop_slots, events, fresh_database, latest_by_key, records, sql

from capture.config import CaptureConfig, KeylessPolicy
from capture.connector import Connector
from capture.topics import TopicCollisionError, table_topic, topic_name_part
from eventstore.log import Log
from eventstore.topic import CleanupPolicy
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TIDELINE = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "tideline")


@pytest.fixture
def db(postgres: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(postgres, request.node.name[:16].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


# ---------------------------------------------------------------------------- keyless tables


def test_keyless_table_is_captured_like_debezium(db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Default policy: the keyed table's changes are all there; the keyless table's inserts with a null key."""
    sql(
        db,
        "CREATE TABLE audit_log (at timestamptz DEFAULT now(), actor text, action text)",
        "CREATE TABLE accounts (id int PRIMARY KEY, owner text)",
        "INSERT INTO audit_log(actor, action) VALUES ('ann', 'login')",
        "INSERT INTO accounts VALUES (1, 'ann')",
    )
    with caplog.at_level(logging.WARNING, logger="capture.connector"):
        stats = capture(tmp_path / "log", db, partitions=3)
    assert stats.keyless_tables == ["public.audit_log"]
    assert any("public.audit_log has no primary key" in r.getMessage() and "REPLICA IDENTITY" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    config = CaptureConfig(dsn=db, slot="t", topic_prefix="cdc", partitions=3)
    with Log(tmp_path / "log") as log:  # one running connector: each insert its own log transaction
        connector = Connector(config, log)
        thread = threading.Thread(target=connector.run)
        thread.start()
        try:
            for i in range(6):
                batches = connector.stats.batches
                sql(db, f"INSERT INTO audit_log(actor, action) VALUES ('bob', 'act {i}')",
                    f"INSERT INTO accounts VALUES ({10 + i}, 'bob')")  # fmt: skip
                _wait(lambda b=batches, n=2 * (i + 1): connector.stats.batches > b and connector.stats.events >= n)
        finally:
            connector.stop()
            thread.join(60)
    sql(db, "UPDATE audit_log SET action = 'changed'", "DELETE FROM audit_log WHERE actor = 'ann'")  # invisible
    sql(db, "UPDATE accounts SET owner = 'cy' WHERE id = 1")
    capture(tmp_path / "log", db, partitions=3)

    with Log(tmp_path / "log") as log:
        meta = log.topic("cdc.public.audit_log")
        assert meta.config.cleanup_policy is CleanupPolicy.DELETE
        assert log.topic("cdc.public.accounts").config.cleanup_policy.compacts
    audit = records(tmp_path / "log", "cdc.public.audit_log")
    assert sorted((k, v["op"], v["after"]["action"]) for k, v, _ in audit) == sorted(
        [(None, "r", "login")] + [(None, "c", f"act {i}") for i in range(6)]
    )  # the delete and the update are not there: the server does not decode them for a keyless table
    partitions = {p for p, _, _ in _partitions(tmp_path / "log", "cdc.public.audit_log")}
    assert len(partitions) == 3, "keyless batches should rotate over the partitions"
    assert latest_by_key(tmp_path / "log", "cdc.public.accounts")[b'{"id":1}']["owner"] == "cy"


def _wait(done: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def _partitions(log_dir: Path, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:
    from eventstore.consumer import Consumer, TopicPartition

    out = []
    with Log(log_dir) as log, Consumer(log, enable_auto_commit=False) as consumer:
        n = log.topic(topic).partitions
        consumer.assign([TopicPartition(topic, p) for p in range(n)])
        consumer.seek_to_beginning()
        while batch := consumer.poll(timeout_ms=0):
            out += [(r.partition, r.key, r.value) for r in batch]
    return out


def test_keyless_tables_in_capture_status(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE audit_log (actor text)", "CREATE TABLE t (id int PRIMARY KEY)")
    capture(tmp_path / "log", db, slot="st")
    out = subprocess.run(
        [TIDELINE, "--data-dir", str(tmp_path / "log"), "capture", "status", "--dsn", db, "--slot", "st",
         "--topic-prefix", "cdc", "--json"], capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    status = json.loads(out.stdout)
    assert status["keyless_tables"] == ["public.audit_log"] and status["skipped_tables"] == []
    [warning] = status["warnings"]
    assert "public.audit_log" in warning and "updates and deletes are invisible" in warning
    skip = subprocess.run(
        [TIDELINE, "--data-dir", str(tmp_path / "log"), "capture", "status", "--dsn", db, "--slot", "st",
         "--topic-prefix", "cdc", "--keyless-tables", "skip"], capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert "warning: table public.audit_log has no primary key and no replica identity: not captured" in skip.stdout


def test_skip_policy_leaves_keyless_tables_out(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE audit_log (actor text)", "CREATE TABLE t (id int PRIMARY KEY)",
        "INSERT INTO audit_log VALUES ('x')", "INSERT INTO t VALUES (1)")  # fmt: skip
    stats = capture(tmp_path / "log", db, keyless_tables=KeylessPolicy.SKIP)
    sql(db, "INSERT INTO audit_log VALUES ('y')", "INSERT INTO t VALUES (2)")
    capture(tmp_path / "log", db, keyless_tables=KeylessPolicy.SKIP)
    assert stats.skipped_tables == ["public.audit_log"] and stats.keyless_tables == []
    with Log(tmp_path / "log") as log:
        assert "cdc.public.audit_log" not in log.topics()
    assert [e["after"]["id"] for e in events(tmp_path / "log", "cdc.public.t")] == [1, 2]


def test_replica_identity_index_keeps_its_key(db: str, tmp_path: Path) -> None:
    sql(
        db,
        "CREATE TABLE codes (code text NOT NULL, label text)",
        "CREATE UNIQUE INDEX codes_code ON codes (code)",
        "ALTER TABLE codes REPLICA IDENTITY USING INDEX codes_code",
    )
    capture(tmp_path / "log", db)
    sql(db, "INSERT INTO codes VALUES ('a', 'A')", "UPDATE codes SET label = 'AA'", "DELETE FROM codes")
    capture(tmp_path / "log", db)
    recs = records(tmp_path / "log", "cdc.public.codes")
    assert [(k, v["op"] if v else None) for k, v, _ in recs] == [
        ({"code": "a"}, "c"), ({"code": "a"}, "u"), ({"code": "a"}, "d"), ({"code": "a"}, None),
    ]  # fmt: skip


# ---------------------------------------------------------------------------- topic names


def test_topic_name_mapping_rule() -> None:
    assert topic_name_part("filter table_6") == "filter_table_6"
    assert table_topic("p", "public", "filter table_6") == "p.public.filter_table_6"
    assert table_topic("p", "Sales Dept", "ünï/x") == "p.Sales_Dept._n__x"  # one _ per character
    assert table_topic("p", "s", "a.b-c_d") == "p.s.a.b-c_d"  # legal characters stay


def test_table_names_outside_topic_characters_are_mapped(db: str, tmp_path: Path) -> None:
    sql(db, 'CREATE TABLE "filter table_6" (id int PRIMARY KEY, v text)', 'CREATE SCHEMA "Sales Dept"',
        'CREATE TABLE "Sales Dept"."ünïcødé" (id int PRIMARY KEY)',
        """INSERT INTO "filter table_6" VALUES (1, 'x')""",
        """INSERT INTO "Sales Dept"."ünïcødé" VALUES (7)""")  # fmt: skip
    capture(tmp_path / "log", db)
    sql(db, """UPDATE "filter table_6" SET v = 'y'""")
    capture(tmp_path / "log", db)
    filt = events(tmp_path / "log", "cdc.public.filter_table_6")
    assert [(e["op"], e["after"]["v"]) for e in filt] == [("r", "x"), ("u", "y")]
    assert filt[0]["source"]["table"] == "filter table_6"  # the event names the real table
    [uni] = events(tmp_path / "log", "cdc.Sales_Dept._n_c_d_")
    assert uni["source"]["schema"] == "Sales Dept" and uni["source"]["table"] == "ünïcødé"


def test_colliding_topic_names_are_refused_then_overridden(db: str, tmp_path: Path) -> None:
    sql(db, 'CREATE TABLE "a b" (id int PRIMARY KEY)', "CREATE TABLE a_b (id int PRIMARY KEY)",
        'INSERT INTO "a b" VALUES (1)', "INSERT INTO a_b VALUES (2)")  # fmt: skip
    with pytest.raises(TopicCollisionError, match=r"public\.a b and public\.a_b|public\.a_b and public\.a b") as e:
        capture(tmp_path / "log", db)
    assert "--table-topic" in str(e.value)
    with Log(tmp_path / "log") as log:  # refused before anything of either table was written
        assert not [t for t in log.topics() if t.startswith("cdc.public.")]
    capture(tmp_path / "log2", db, slot="t2", table_topics={"public.a b": "cdc.public.a_space_b"})
    assert [e["after"]["id"] for e in events(tmp_path / "log2", "cdc.public.a_space_b")] == [1]
    assert [e["after"]["id"] for e in events(tmp_path / "log2", "cdc.public.a_b")] == [2]


def test_colliding_table_created_while_streaming_stops_the_connector(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE a_b (id int PRIMARY KEY)")
    capture(tmp_path / "log", db)
    sql(db, 'CREATE TABLE "a b" (id int PRIMARY KEY)', 'INSERT INTO "a b" VALUES (1)')
    with pytest.raises(TopicCollisionError, match=r"both map to topic 'cdc\.public\.a_b'"):
        capture(tmp_path / "log", db)
    assert events(tmp_path / "log", "cdc.public.a_b") == []  # nothing of "a b" went into a_b's topic
