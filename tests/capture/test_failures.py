"""Failures that must end (capture.errors): each permanent class stops at once with one line saying what to do;
a transient one (the walsender killed mid-stream) is survived with nothing lost or duplicated.

Server-side classes that need another server configuration (wal_level, max_replication_slots,
output_plugin_libraries) run against a private cluster of their own, reconfigured with
ALTER SYSTEM between cases; the others use the session's cluster.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, sql
from readiness import wait_until

from capture.connector import CaptureConfig, Connector
from capture.errors import PermanentCaptureError, is_sink_transient, permanent_reason
from capture.replication import ReplicationConnection
from eventstore.log import Log
from schemas.position import parse_lsn
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TIDELINE = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "tideline")


@pytest.fixture
def db(postgres: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(postgres, request.node.name[:16].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


def run_cli(data_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TIDELINE, "--data-dir", str(data_dir), "capture", "run", "--slot", "f", "--topic-prefix", "cdc",
         "--exit-when-caught-up", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------------------- on the session cluster


def test_unreachable_server_is_reported_not_retried_forever(tmp_path: Path) -> None:
    result = run_cli(tmp_path / "log", "--dsn", "postgresql://nobody@127.0.0.1:1/x", timeout=60)
    assert_one_line_error(result, "cannot connect to the source database", "--retry-on-start")


def test_retry_on_start_gives_up_after_max_retry_time(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_cli(tmp_path / "log", "--dsn", "postgresql://nobody@127.0.0.1:1/x", "--retry-on-start",
                     "--max-retry-time", "3", timeout=90)  # fmt: skip
    assert_one_line_error(result, "unreachable", "--max-retry-time 3")
    assert "reconnecting in" in result.stderr  # it did retry before giving up
    assert time.monotonic() - started < 80


def test_missing_role_and_database(postgres: LocalPostgres, tmp_path: Path) -> None:
    port = postgres.dsn.rsplit(":", 1)[1].split("/")[0]
    no_role = run_cli(tmp_path / "a", "--dsn", f"postgresql://nobody@127.0.0.1:{port}/postgres")
    assert_one_line_error(no_role, "role does not exist", 'role "nobody" does not exist')
    no_db = run_cli(tmp_path / "b", "--dsn", f"postgresql://postgres@127.0.0.1:{port}/no_such_db")
    assert_one_line_error(no_db, "database does not exist", "fix the database name")


def test_role_without_replication_permission(postgres: LocalPostgres, db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)")
    sql(postgres.dsn, "DO $$ BEGIN CREATE ROLE plain LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    sql(db, "GRANT SELECT ON ALL TABLES IN SCHEMA public TO plain")
    dsn = db.replace("postgres@", "plain@", 1)
    result = run_cli(tmp_path / "log", "--dsn", dsn)
    assert_one_line_error(result, "permission denied", "REPLICATION")


def test_slot_active_in_another_process(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)")
    capture(tmp_path / "first", db, slot="f")  # creates slot f and stores a position
    holder = ReplicationConnection(db)
    try:
        holder.start("f", 0, {"format-version": "2"})
        result = run_cli(tmp_path / "first", "--dsn", db, "--slot-busy-wait", "5")
        assert_one_line_error(result, "in use by another process", "--slot")
    finally:
        holder.close()


def test_refused_table_under_fail_policy(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE loose (a int)")
    result = run_cli(tmp_path / "log", "--dsn", db, "--keyless-tables", "fail")
    assert_one_line_error(result, "public.loose has no primary key", "--keyless-tables keyless")


def test_walsender_killed_mid_stream_is_survived(db: str, tmp_path: Path) -> None:
    """Transient: the server ends the replication connection; the connector reconnects and loses nothing."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    config = CaptureConfig(dsn=db, slot="f", topic_prefix="cdc", max_retry_time_s=120)
    with Log(tmp_path / "log") as log:
        connector = Connector(config, log)
        thread = threading.Thread(target=connector.run)
        thread.start()
        try:
            _wait(lambda: connector.stats.batches >= 2)  # "snapshot under way", then the (empty) snapshot
            for round_ in range(4):
                sql(db, *[f"INSERT INTO t VALUES ({round_ * 100 + i}, {i})" for i in range(50)])
                _wait(lambda r=round_: connector.stats.events >= (r + 1) * 50)
                killed = _terminate_walsender(db, "f")
                assert killed, "no walsender to terminate"
                _wait(lambda n=round_: connector.stats.reconnects >= n + 1)
            # Wait for the update's position, not an event count: events a reconnect streams again are
            # counted again, so a count can pass 201 before the update arrived.
            with psycopg.connect(db) as c:
                row = c.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            assert row is not None
            before_update = parse_lsn(row[0])  # the update commits after this
            sql(db, "UPDATE t SET v = -1 WHERE id = 0")

            def update_stored() -> bool:
                position = connector.read_position()
                return position is not None and position.commit_lsn >= before_update

            _wait(update_stored)
        finally:
            connector.stop()
            thread.join(60)
    ids = [e["after"]["id"] for e in events(tmp_path / "log", "cdc.public.t")]
    assert sorted(ids) == sorted([r * 100 + i for r in range(4) for i in range(50)] + [0])  # none lost, none twice


def _terminate_walsender(dsn: str, slot: str) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with psycopg.connect(dsn, autocommit=True) as c:
            row = c.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s AND active",
                (slot,),
            ).fetchone()
        if row is not None and row[0]:
            return True
        time.sleep(0.1)
    return False


def _wait(done: Callable[[], object], timeout: float = 60.0) -> None:
    wait_until(done, "a condition of this test", timeout=timeout)


# ---------------------------------------------------------------------------- a cluster of its own


@pytest.fixture(scope="module")
def odd_cluster() -> Iterator[LocalPostgres]:
    """A private cluster this module reconfigures (ALTER SYSTEM + restart) for server-side failure classes."""
    directory = Path(tempfile.mkdtemp(prefix="tideline-pg-odd-"))
    cluster = LocalPostgres(directory / "cluster", fast=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _reconfigure(cluster: LocalPostgres, **settings: str) -> None:
    with psycopg.connect(cluster.dsn, autocommit=True) as c:
        c.execute("ALTER SYSTEM RESET ALL")
        for name, value in settings.items():
            c.execute(f"ALTER SYSTEM SET {name} = '{value}'".encode())
    cluster.stop()
    cluster.start()


def test_wal_level_not_logical(odd_cluster: LocalPostgres, tmp_path: Path) -> None:
    _reconfigure(odd_cluster, wal_level="replica")
    dsn = odd_cluster.create_database("walr")
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    result = run_cli(tmp_path / "log", "--dsn", dsn)
    assert_one_line_error(result, "wal_level is not logical", "wal_level = logical")


def test_all_replication_slots_in_use(odd_cluster: LocalPostgres, tmp_path: Path) -> None:
    _reconfigure(odd_cluster, max_replication_slots="1")
    dsn = odd_cluster.create_database("slots")
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY)", "SELECT pg_create_logical_replication_slot('other', 'wal2json')")
    try:
        result = run_cli(tmp_path / "log", "--dsn", dsn)
        assert_one_line_error(result, "replication slots are all in use", "max_replication_slots")
    finally:
        sql(dsn, "SELECT pg_drop_replication_slot('other')")


def test_output_plugin_not_allowed(odd_cluster: LocalPostgres, tmp_path: Path) -> None:
    check = subprocess.run(
        [str(odd_cluster.binaries / "postgres"), "--describe-config"], capture_output=True, text=True, check=True
    )
    if "output_plugin_libraries" not in check.stdout:
        pytest.skip("this PostgreSQL has no output_plugin_libraries setting (added in 15.19): nothing to refuse")
    _reconfigure(odd_cluster, output_plugin_libraries="pgoutput")
    dsn = odd_cluster.create_database("plugins")
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    result = run_cli(tmp_path / "log", "--dsn", dsn)
    assert_one_line_error(result, "does not allow this output plugin", "output_plugin_libraries")


def test_plugin_not_installed_is_classified(db: str) -> None:
    """The real server's error for a plugin library that does not exist is classified as permanent (the CLI only
    accepts plugins Tideline decodes, so the error is provoked directly)."""
    with psycopg.connect(db, autocommit=True) as c, pytest.raises(psycopg.Error) as e:
        c.execute("SELECT pg_create_logical_replication_slot('x', 'no_such_plugin')")
    reason = permanent_reason(e.value)
    assert reason is not None, str(e.value)
    if "may not be used as an output plugin" in str(e.value):  # 15.19+: refused before the library is looked for
        assert "output_plugin_libraries" in reason
    else:
        assert "not installed" in reason and "apt-get install" in reason, reason
    assert permanent_reason(psycopg.OperationalError("server closed the connection unexpectedly")) is None


def test_in_process_errors_are_permanent_capture_errors(tmp_path: Path) -> None:
    config = CaptureConfig(dsn="postgresql://nobody@127.0.0.1:1/x", slot="f", exit_when_caught_up=True)
    with Log(tmp_path / "log") as log, pytest.raises(PermanentCaptureError, match="cannot connect"):
        Connector(config, log).run()


def test_a_key_state_still_locked_by_a_fenced_instance_is_retried(tmp_path: Path) -> None:
    """A new instance that fenced the old one may find the key state's SQLite file still locked by it (it
    stops at its next write): SQLite's real error for that is retried (with the sink opened again), not
    fatal; an SQLite error of another kind is not."""
    path = tmp_path / "ks.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE k (key BLOB)")
    holder.execute("BEGIN IMMEDIATE")  # the old instance's write transaction
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        with pytest.raises(sqlite3.OperationalError) as locked:
            other.execute("INSERT INTO k VALUES (x'00')")
        assert is_sink_transient(locked.value), locked.value
        with pytest.raises(sqlite3.OperationalError) as missing:
            other.execute("SELECT * FROM no_such_table")
        assert not is_sink_transient(missing.value)
    finally:
        other.close()
        holder.close()
