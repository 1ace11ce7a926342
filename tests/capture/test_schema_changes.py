"""Schema change events in band (``--schema-changes``, capture.schema_changes), against the real Postgres.

Each DDL on a captured table becomes one event on ``cdc.schema_changes`` at the DDL's own WAL position:
merged with the table's row events by ``(source.commit_lsn, source.event_index)``, it comes after every
row written before the DDL and before the first row of the new shape, also inside one transaction. Its
value is Debezium's schema change value (the statement, the table's columns and key after it). Both
plugins (the ``plugin`` fixture). A kill -9 inside a transaction of many DDLs, then a restart: every DDL
once. A role that may not create event triggers gets one line saying what to do; once a superuser
installed them, that role captures schema changes too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, sql, stored_position
from readiness import wait_until

from capture.errors import PermanentCaptureError
from capture.messages import Plugin
from capture.schema_changes import TRIGGERS, install_sql
from capture.tables import TableFilter
from eventstore.errors import ConfigError
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "cdc.schema_changes"


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "ddl")
    yield dsn
    drop_slots(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:  # event triggers are per database, but leave none behind
        for name in TRIGGERS:
            c.execute(f"DROP EVENT TRIGGER IF EXISTS {name}".encode())


def merged(log_dir: Path, *topics: str) -> list[tuple[str, dict[str, Any]]]:
    """(topic, event) of the topics' change events in commit order (snapshot reads left out)."""
    out = [(t, e) for t in topics for e in events(log_dir, t) if e.get("op") != "r"]
    out.sort(key=lambda te: (te[1]["source"]["commit_lsn"], te[1]["source"]["event_index"]))
    return out


def describe(topic: str, event: dict[str, Any]) -> str:
    if topic == TOPIC:
        [change] = event["tableChanges"]
        columns = [c["name"] for c in change["table"]["columns"]] if change["table"] else None
        return f"{change['type']} {change['id']} {columns}"
    row = event["after"] or event["before"]
    return f"{event['op']} {topic.rsplit('.', 1)[1]} {sorted(row)}"


def test_each_ddl_is_an_event_at_its_position(db: str, tmp_path: Path, plugin: Plugin) -> None:
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, n int NOT NULL)", "CREATE TABLE skipped (id int PRIMARY KEY)",
        "INSERT INTO t VALUES (1, 1)")  # fmt: skip
    only = TableFilter(include=["public.t", "public.u"])
    capture(log_dir, db, plugin=plugin, table_filter=only, schema_changes=True)  # installs the triggers
    sql(
        db,
        "INSERT INTO t VALUES (2, 2)",
        "ALTER TABLE t ADD COLUMN note text DEFAULT 'x'",
        "INSERT INTO t VALUES (3, 3, 'three')",
        "BEGIN; UPDATE t SET n = 10 WHERE id = 1; ALTER TABLE t DROP COLUMN n; INSERT INTO t VALUES (4, 'four'); "
        "COMMIT",
        "ALTER TABLE t RENAME COLUMN note TO remark",
        "ALTER TABLE skipped ADD COLUMN v int",  # not a captured table: no event
        "CREATE TABLE u (k text PRIMARY KEY, v int)",
        "INSERT INTO u VALUES ('a', 1)",
    )
    capture(log_dir, db, plugin=plugin, table_filter=only, schema_changes=True)
    sql(db, "DROP TABLE u", "UPDATE t SET remark = 'one' WHERE id = 1")  # a table's rows are read while it exists
    capture(log_dir, db, plugin=plugin, table_filter=only, schema_changes=True)
    seen = [describe(t, e) for t, e in merged(log_dir, TOPIC, "cdc.public.t", "cdc.public.u")]
    # pgoutput: the managed publication takes u in only at the next start, which reads its rows (op=r) with an
    # incremental snapshot (docs/capture.md, Publications); wal2json streams its INSERT
    created = ["c u ['k', 'v']"] if plugin is Plugin.WAL2JSON else []
    assert seen == [
        "c t ['id', 'n']",
        "ALTER \"public\".\"t\" ['id', 'n', 'note']",
        "c t ['id', 'n', 'note']",
        "u t ['id', 'n', 'note']",  # committed with the DROP, before it
        "ALTER \"public\".\"t\" ['id', 'note']",
        "c t ['id', 'note']",
        "ALTER \"public\".\"t\" ['id', 'remark']",
        "CREATE \"public\".\"u\" ['k', 'v']",
        *created,
        "DROP \"public\".\"u\" None",
        "u t ['id', 'remark']",
    ], seen
    assert [e["after"] for e in events(log_dir, "cdc.public.u")] == [{"k": "a", "v": 1}]
    changes = events(log_dir, TOPIC)
    added = changes[0]
    assert added["ddl"] == "ALTER TABLE t ADD COLUMN note text DEFAULT 'x'"
    assert added["databaseName"] == psycopg.conninfo.conninfo_to_dict(db)["dbname"]
    assert added["schemaName"] == "public" and added["source"]["table"] == "t"
    table = added["tableChanges"][0]["table"]
    assert table["primaryKeyColumnNames"] == ["id"]
    assert table["columns"] == [
        {"name": "id", "typeName": "integer", "position": 1, "optional": False, "defaultValueExpression": None},
        {"name": "n", "typeName": "integer", "position": 2, "optional": False, "defaultValueExpression": None},
        {"name": "note", "typeName": "text", "position": 3, "optional": True, "defaultValueExpression": "'x'::text"},
    ]
    created = changes[3]
    assert created["tableChanges"][0]["table"]["primaryKeyColumnNames"] == ["k"]
    assert created["ddl"] == "CREATE TABLE u (k text PRIMARY KEY, v int)"


def test_without_the_option_ddl_messages_write_nothing(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """The triggers stay installed (another connector may use them); a connector without --schema-changes
    writes no schema change event and no logical message event for them."""
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)")
    capture(log_dir, db, plugin=plugin, schema_changes=True)
    sql(db, "ALTER TABLE t ADD COLUMN v int", "INSERT INTO t VALUES (1, 1)")
    capture(log_dir, db, plugin=plugin)
    assert events(log_dir, TOPIC) == [] and events(log_dir, "cdc.message") == []
    assert [e["after"] for e in events(log_dir, "cdc.public.t")] == [{"id": 1, "v": 1}]


CHILD = """
import sys
from pathlib import Path
from capture.connector import CaptureConfig, Connector
from capture.messages import Plugin
from eventstore.log import Log
dsn, log_dir, plugin, caught_up = sys.argv[1:5]
config = CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", plugin=Plugin(plugin), schema_changes=True,
                       batch_bytes=16384, exit_when_caught_up=caught_up == "1")
with Log(Path(log_dir)) as log:
    Connector(config, log).run()
print("done")
"""


def child(dsn: str, log_dir: Path, plugin: Plugin, *, caught_up: bool, err: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", CHILD, dsn, str(log_dir), plugin.value, "1" if caught_up else "0"]
    with err.open("wb") as stderr:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=stderr)


def test_a_restart_mid_transaction_writes_each_ddl_once(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """kill -9 once a position inside a transaction of 300 DDLs (each followed by a row) is stored, restart."""
    ddls = 300
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, n int, pad text)")
    first = child(db, log_dir, plugin, caught_up=True, err=tmp_path / "first.err")
    assert first.wait(timeout=300) == 0, (tmp_path / "first.err").read_text()[-2000:]
    steps = "; ".join(f"ALTER TABLE t ALTER COLUMN n SET DEFAULT {i}; INSERT INTO t (id, pad) VALUES ({i}, "
                      f"repeat('x', 300))" for i in range(1, ddls + 1))  # fmt: skip
    sql(db, f"BEGIN; {steps}; COMMIT")
    err = tmp_path / "killed.err"
    killed = child(db, log_dir, plugin, caught_up=False, err=err)
    try:
        wait_until(lambda: (p := stored_position(log_dir, db)) is not None and p.commit_lsn and not p.complete
                   and p.event_index >= ddls // 2, "a stored position inside the transaction of DDLs", every=0.01,
                   alive=killed, details=lambda: err.read_text()[-2000:])  # fmt: skip
    finally:
        if killed.poll() is None:
            killed.send_signal(signal.SIGKILL)  # by PID
        killed.wait()
    position = stored_position(log_dir, db)
    assert position is not None and not position.complete and position.event_index < 2 * ddls - 1, position
    last = child(db, log_dir, plugin, caught_up=True, err=tmp_path / "last.err")
    assert last.wait(timeout=300) == 0, (tmp_path / "last.err").read_text()[-2000:]
    changes = [e for _, e in merged(log_dir, TOPIC, "cdc.public.t")]
    defaults = [
        next(c["defaultValueExpression"] for c in e["tableChanges"][0]["table"]["columns"] if c["name"] == "n")
        for e in changes
        if "tableChanges" in e
    ]
    assert defaults == [str(i) for i in range(1, ddls + 1)]  # each DDL once, in order
    assert [e["source"]["event_index"] for e in changes] == list(range(2 * ddls))
    assert [e["after"]["n"] for e in changes if "after" in e] == list(range(1, ddls + 1))


def test_a_role_that_may_not_create_event_triggers_gets_one_line(db: str, tmp_path: Path) -> None:
    role = f"reader_{psycopg.conninfo.conninfo_to_dict(db)['dbname']}"  # roles are the cluster's: one per test
    with psycopg.connect(db, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN REPLICATION".encode())
        c.execute(f"GRANT CREATE ON SCHEMA public TO {role}".encode())
        c.execute("CREATE TABLE t (id int PRIMARY KEY)")
        c.execute(f"GRANT SELECT ON t TO {role}".encode())
    reader = psycopg.conninfo.make_conninfo(db, user=role)
    with pytest.raises((ConfigError, PermanentCaptureError), match=rf"role {role} may not create them") as e:
        capture(tmp_path / "refused", reader, schema_changes=True)
    assert "tideline capture schema-changes-sql" in str(e.value)
    with psycopg.connect(db, autocommit=True) as c:  # a DBA installs them (the SQL the command prints)
        for statement in install_sql():
            c.execute(statement.encode())
    log_dir = tmp_path / "log"
    capture(log_dir, reader, schema_changes=True)
    sql(db, "ALTER TABLE t ADD COLUMN v int")  # by another role: the trigger's function emits it all the same
    capture(log_dir, reader, schema_changes=True)
    [change] = events(log_dir, TOPIC)
    assert change["ddl"] == "ALTER TABLE t ADD COLUMN v int"


def test_the_printed_sql_installs_the_triggers(db: str) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "tideline"), "capture", "schema-changes-sql"],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    with psycopg.connect(db, autocommit=True) as c:
        c.execute(done.stdout.encode())
        names = sorted(r[0] for r in c.execute("SELECT evtname FROM pg_event_trigger"))
    assert names == sorted(TRIGGERS)
