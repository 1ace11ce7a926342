"""Migrations: Tideline's branch holds only Tideline's tables; an application's migrations are a branch of their
own beside it (the reservations example's, and one written here like a user would); ``db current`` is right for
every branch; a database migrated before the ids were namespaced is adopted; events is append-only."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from commands_util import rows
from sqlalchemy import MetaData
from typer.testing import CliRunner

import migrations
from commands.db import make_engine
from commands.schema import metadata
from examples.reservations import models as example
from projections.models import metadata as read_side
from tideline.cli import app
from tideline.pgharness import LocalPostgres

WRITE_MODEL = ["claims", "commands", "events", "snapshots"]
READ_SIDE = ["cdc_mirror", "projection_checkpoints", "projection_runs", "projection_state"]
EXAMPLE = ["seats", "show_occupancy", "users"]
EXAMPLE_MIGRATIONS = "examples.reservations.migrations"


def tables(dsn: str) -> list[str]:
    return [t for (t,) in rows(dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]


def cli(*args: str, env: dict[str, str] | None = None) -> str:
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.output


def cli_error(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    return result.output


def schema_diff(dsn: str, *metadatas: MetaData) -> list[object]:
    engine = make_engine(dsn)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), list(metadatas)))
    finally:
        engine.dispose()


def fresh(postgres: LocalPostgres) -> str:
    return postgres.create_database(f"mig_{uuid.uuid4().hex[:8]}")


def test_upgrade_from_empty_creates_only_tidelines_tables_then_downgrade_and_again(postgres: LocalPostgres) -> None:
    dsn = fresh(postgres)
    assert "tideline: empty (behind" in cli("db", "current", "--dsn", dsn)
    assert "tideline: database at revision tideline_0002 (was empty)" in cli("db", "upgrade", "--dsn", dsn)
    assert tables(dsn) == sorted(["alembic_version", *WRITE_MODEL, *READ_SIDE])  # no example table
    assert "(unchanged)" in cli("db", "upgrade", "--dsn", dsn)
    assert cli("db", "current", "--dsn", dsn) == "tideline: tideline_0002 (up to date)\n"
    assert schema_diff(dsn, metadata, read_side) == []
    assert "tideline tideline_0001" in cli("db", "downgrade", "tideline_0001", "--dsn", dsn)
    assert tables(dsn) == ["alembic_version", *WRITE_MODEL]
    assert "tideline empty" in cli("db", "downgrade", "base", "--dsn", dsn)
    assert tables(dsn) == ["alembic_version"]
    assert rows(dsn, "SELECT count(*) FROM pg_proc WHERE proname = 'tideline_events_append_only'") == [(0,)]
    migrations.upgrade(dsn)
    assert migrations.current(dsn) == migrations.head() == "tideline_0002"


def test_the_example_owns_its_tables_in_its_own_branch(postgres: LocalPostgres) -> None:
    dsn = fresh(postgres)
    cli("db", "upgrade", "--dsn", dsn)
    out = cli("db", "upgrade", "--dsn", dsn, "--migrations", EXAMPLE_MIGRATIONS)
    assert "reservations: database at revision reservations_0001 (was empty)" in out, out
    assert "tideline: database at revision tideline_0002 (unchanged)" in out, out
    assert tables(dsn) == sorted(["alembic_version", *WRITE_MODEL, *READ_SIDE, *EXAMPLE])
    assert schema_diff(dsn, metadata, read_side, example.metadata) == []
    assert cli("db", "current", "--dsn", dsn, "--migrations", EXAMPLE_MIGRATIONS) == (
        "tideline: tideline_0002 (up to date)\nreservations: reservations_0001 (up to date)\n"
    )
    # Without the location the database names a revision nothing loaded has: said, not guessed.
    assert "reservations_0001, which none of the loaded migrations has" in cli_error("db", "current", "--dsn", dsn)
    # One branch down alone.
    cli("db", "downgrade", "reservations@base", "--dsn", dsn, "--migrations", EXAMPLE_MIGRATIONS)
    assert tables(dsn) == sorted(["alembic_version", *WRITE_MODEL, *READ_SIDE])
    assert migrations.current(dsn, "tideline") == "tideline_0002"


def write_revision(directory: Path, name: str, body: str) -> None:
    (directory / name).write_text(textwrap.dedent(body))


def test_a_user_apps_migrations_apply_beside_tidelines(postgres: LocalPostgres, tmp_path: Path) -> None:
    """A user's own chain: its first revision written by `tideline db revision`, filled in like a user would;
    `db current` is right for both branches at every step; TIDELINE_MIGRATIONS names the location too."""
    dsn = fresh(postgres)
    location = tmp_path / "bank_migrations"
    out = cli("db", "revision", "-m", "accounts view", "--branch", "bank", "--location", str(location),
              "--rev-id", "0001")  # fmt: skip
    first = Path(out.removeprefix("wrote ").strip())
    assert first.parent == location.resolve()
    text = first.read_text()
    assert "branch_labels: tuple[str, ...] | None = ('bank',)" in text and "down_revision: str | None = None" in text
    text = text.replace(
        "raise NotImplementedError('write the upgrade')",
        "op.create_table('accounts', sa.Column('id', sa.Text, nullable=False), "
        "sa.PrimaryKeyConstraint('id', name='pk_accounts'))",
    ).replace("raise NotImplementedError('write the downgrade')", "op.drop_table('accounts')")
    first.write_text(text)
    env = {"TIDELINE_MIGRATIONS": str(location)}
    cli("db", "upgrade", "--dsn", dsn)  # Tideline's branch alone first
    assert cli("db", "current", "--dsn", dsn, env=env) == (
        "tideline: tideline_0002 (up to date)\nbank: empty (behind: run `tideline db upgrade` to reach 0001)\n"
    )
    out = cli("db", "upgrade", "--dsn", dsn, env=env)
    assert "bank: database at revision 0001 (was empty)" in out and "tideline_0002 (unchanged)" in out
    assert "accounts" in tables(dsn)
    assert cli("db", "current", "--dsn", dsn, env=env) == (
        "tideline: tideline_0002 (up to date)\nbank: 0001 (up to date)\n"
    )  # an app id "0001" is not taken for Tideline's (its ids are namespaced)

    # The app's next revision needs Tideline's tables first (depends_on): alembic then keeps only the app's
    # revision in alembic_version, and Tideline's branch still reads as up to date.
    out = cli("db", "revision", "-m", "owner index", "--branch", "bank", "--depends-on", "tideline_0002",
              "--rev-id", "0002", env=env)  # fmt: skip
    second = Path(out.removeprefix("wrote ").strip())
    text = second.read_text()
    assert "down_revision: str | None = '0001'" in text and "('tideline_0002',)" in text
    second.write_text(
        text.replace(
            "raise NotImplementedError('write the upgrade')",
            "op.add_column('accounts', sa.Column('owner', sa.Text)); "
            "op.create_index('ix_accounts_owner', 'accounts', ['owner'])",
        ).replace("raise NotImplementedError('write the downgrade')", "op.drop_column('accounts', 'owner')")
    )
    assert "bank: 0001 (behind: run `tideline db upgrade` to reach 0002)" in cli("db", "current", "--dsn", dsn, env=env)
    cli("db", "upgrade", "--dsn", dsn, env=env)
    assert rows(dsn, "SELECT version_num FROM alembic_version") == [("0002",)]
    assert cli("db", "current", "--dsn", dsn, env=env) == (
        "tideline: tideline_0002 (up to date)\nbank: 0002 (up to date)\n"
    )
    history = cli("db", "history", env=env).splitlines()
    assert [line.split()[:2] for line in history] == [
        ["tideline", "tideline_0001"], ["tideline", "tideline_0002"], ["bank", "0001"], ["bank", "0002"],
    ]  # fmt: skip


def test_an_app_revision_continuing_tidelines_chain_is_refused(postgres: LocalPostgres, tmp_path: Path) -> None:
    dsn = fresh(postgres)
    write_revision(
        tmp_path,
        "bad.py",
        """
        revision = "bad_0001"
        down_revision = "tideline_0002"
        branch_labels = None
        depends_on = None
        def upgrade(): pass
        def downgrade(): pass
        """,
    )
    error = cli_error("db", "upgrade", "--dsn", dsn, "--migrations", str(tmp_path))
    assert "revision bad_0001" in error and "continues Tideline's chain (down_revision tideline_0002)" in error
    assert tables(dsn) == []  # refused before anything ran
    assert "no such directory or importable package" in cli_error(
        "db", "upgrade", "--dsn", dsn, "--migrations", str(tmp_path / "missing")
    )


def test_a_database_migrated_before_ids_were_namespaced_is_adopted(postgres: LocalPostgres) -> None:
    """Tideline before 0.2: revisions 0001/0002, and 0002 also created the example's tables. Upgrading renames
    the ids and the example's first revision adopts its tables with their rows."""
    dsn = fresh(postgres)
    example.upgrade(dsn)
    rows(dsn, "INSERT INTO users VALUES ('u1', 'ann', 'Ann', 1, 42) RETURNING user_id")
    rows(dsn, "DELETE FROM alembic_version RETURNING version_num")
    rows(dsn, "INSERT INTO alembic_version VALUES ('0002') RETURNING version_num")  # the legacy state
    assert migrations.current(dsn) == "tideline_0002"  # read as the namespaced id, without writing
    out = cli("db", "upgrade", "--dsn", dsn, "--migrations", EXAMPLE_MIGRATIONS)
    assert "reservations: database at revision reservations_0001 (was empty)" in out, out
    assert sorted(rows(dsn, "SELECT version_num FROM alembic_version")) == [("reservations_0001",), ("tideline_0002",)]
    assert rows(dsn, "SELECT user_id, username FROM users") == [("u1", "ann")]
    assert schema_diff(dsn, metadata, read_side, example.metadata) == []


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
