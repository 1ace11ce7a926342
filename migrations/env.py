"""Alembic environment: online migrations on the DSN given by :func:`migrations.alembic_config`."""

from __future__ import annotations

from alembic import context

from commands.db import make_engine
from commands.schema import metadata as write_model
from projections.models import metadata as read_side

target_metadata = [write_model, read_side]


def run_migrations_online() -> None:
    dsn = context.config.attributes.get("dsn")
    if not dsn:
        raise RuntimeError("no DSN: build the config with migrations.alembic_config(dsn)")
    engine = make_engine(dsn)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata, transaction_per_migration=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported: run them against a database")
run_migrations_online()
