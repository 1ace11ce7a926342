"""Alembic migrations: the only way Tideline's tables are created or changed.

The revisions in ``versions/`` spell their DDL out (a migration must keep meaning what it
meant when it ran); ``env.py`` points alembic's ``target_metadata`` at the current
table definitions in :mod:`commands.schema` and :mod:`projections.models`, so ``alembic check`` and the tests can
tell when they disagree. ``migrations`` imports ``commands`` and ``projections``, never the
reverse.

Revisions:

- ``0001`` write model: ``events`` (append-only trigger), ``commands``, ``claims``, ``snapshots``.
- ``0002`` read side: views ``users``, ``seats``, ``show_occupancy``, ``cdc_mirror`` and the
  projections' ``projection_state``, ``projection_checkpoints``, ``projection_runs``.

From Python::

    from migrations import upgrade, current
    upgrade(dsn)               # to head; idempotent
    current(dsn)               # "0002"
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from commands.db import make_engine

SCRIPT_LOCATION = Path(__file__).resolve().parent
HEAD = "head"


def alembic_config(dsn: str) -> Config:
    """An alembic Config for ``dsn`` without an ini file (env.py reads ``attributes['dsn']``)."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.attributes["dsn"] = dsn
    return config


def upgrade(dsn: str, revision: str = HEAD) -> None:
    """Migrate the database at ``dsn`` up to ``revision`` (default: the latest)."""
    command.upgrade(alembic_config(dsn), revision)


def downgrade(dsn: str, revision: str) -> None:
    """Migrate down to ``revision`` (``base`` drops every table the migrations created)."""
    command.downgrade(alembic_config(dsn), revision)


def current(dsn: str) -> str | None:
    """The revision the database is at; None before the first upgrade."""
    engine = make_engine(dsn)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The latest revision in ``versions/``."""
    heads = ScriptDirectory.from_config(alembic_config("")).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"migrations have {len(heads)} heads ({', '.join(heads)}): merge them")
    return heads[0]


def history() -> list[tuple[str, str]]:
    """(revision, message) from first to latest."""
    script = ScriptDirectory.from_config(alembic_config(""))
    return [(r.revision, r.doc or "") for r in reversed(list(script.walk_revisions()))]
