"""Migrations: upgrade from empty and down again, the schema equals commands.schema + projections.models,
events is append-only."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from commands_util import rows
from typer.testing import CliRunner

import migrations
from commands.db import make_engine
from commands.schema import metadata
from projections.models import metadata as read_side
from tideline.cli import app
from tideline.pgharness import LocalPostgres

WRITE_MODEL = ["claims", "commands", "events", "snapshots"]
READ_SIDE = [
    "cdc_mirror",
    "projection_checkpoints",
    "projection_runs",
    "projection_state",
    "seats",
    "show_occupancy",
    "users",
]


def tables(dsn: str) -> list[str]:
    return [t for (t,) in rows(dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_upgrade_from_empty_then_downgrade_and_again(postgres: LocalPostgres) -> None:
    dsn = postgres.create_database(f"mig_{uuid.uuid4().hex[:8]}")
    assert "empty (behind" in cli("db", "current", "--dsn", dsn)
    assert "database at revision 0002 (was empty)" in cli("db", "upgrade", "--dsn", dsn)
    assert tables(dsn) == sorted(["alembic_version", *WRITE_MODEL, *READ_SIDE])
    assert "(unchanged)" in cli("db", "upgrade", "--dsn", dsn)
    assert "0002 (up to date)" in cli("db", "current", "--dsn", dsn)
    engine = make_engine(dsn)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), [metadata, read_side]) == []
    finally:
        engine.dispose()
    assert "database at revision 0001" in cli("db", "downgrade", "0001", "--dsn", dsn)
    assert tables(dsn) == ["alembic_version", *WRITE_MODEL]
    assert "base (empty)" in cli("db", "downgrade", "base", "--dsn", dsn)
    assert tables(dsn) == ["alembic_version"]
    assert rows(dsn, "SELECT count(*) FROM pg_proc WHERE proname = 'tideline_events_append_only'") == [(0,)]
    migrations.upgrade(dsn)
    assert migrations.current(dsn) == migrations.head() == "0002"


def test_db_cli_errors_are_one_line() -> None:
    result = CliRunner().invoke(app, ["db", "upgrade", "--dsn", "postgresql://nobody@127.0.0.1:1/none"])
    assert result.exit_code == 1
    assert result.output.startswith("error: upgrade failed:") and result.output.count("\n") == 1, result.output


@pytest.mark.parametrize(
    "statement",
    ["UPDATE events SET payload = '{}'", "DELETE FROM events", "TRUNCATE events"],
    ids=["update", "delete", "truncate"],
)
def test_events_are_append_only(dsn: str, statement: str) -> None:
    rows(
        dsn,
        "INSERT INTO events (stream_id, stream_type, version, event_type, payload) "
        """VALUES ('s', 't', 1, 'E', '{"a": 1}') RETURNING id""",
    )
    verb = statement.split()[0]
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.RestrictViolation) as refused:
        conn.execute(statement.encode())
    assert str(refused.value).startswith(f"events is append-only: {verb} refused")
    assert refused.value.diag.message_hint == "events are never changed or removed: append a compensating event instead"
    assert rows(dsn, "SELECT version, payload FROM events") == [(1, {"a": 1})]
