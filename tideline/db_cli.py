"""``tideline db``: the alembic migrations of Tideline's own tables (events, commands, claims, snapshots)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from tideline.cli_common import fail, one_line_errors

DSN_ENV = "TIDELINE_DSN"

app = typer.Typer(help="Create and migrate Tideline's tables (alembic).", no_args_is_help=True)

DsnOption = Annotated[
    str | None,
    typer.Option("--dsn", envvar=DSN_ENV, help=f"Database URL or libpq string (or ${DSN_ENV}).", show_default=False),
]


def _dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise fail(f"no database: pass --dsn or set {DSN_ENV}")
    return dsn


def _migration_errors() -> tuple[type[Exception], ...]:
    import sqlalchemy.exc
    from alembic.util import CommandError

    return (CommandError, sqlalchemy.exc.SQLAlchemyError)


@app.command()
def upgrade(
    dsn: DsnOption = None,
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Migrate the database up to REVISION (default: the latest); a no-op when already there."""
    import migrations

    target = _dsn(dsn)
    with one_line_errors():
        try:
            before = migrations.current(target)
            migrations.upgrade(target, revision)
            after = migrations.current(target)
        except _migration_errors() as e:
            raise fail(f"upgrade failed: {_one_line(e)}") from None
    typer.echo(f"database at revision {after}" + (f" (was {before or 'empty'})" if before != after else " (unchanged)"))


@app.command()
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision; 'base' drops every migrated table.")],
    dsn: DsnOption = None,
) -> None:
    """Migrate the database down to REVISION (data in dropped tables is lost)."""
    import migrations

    target = _dsn(dsn)
    with one_line_errors():
        try:
            migrations.downgrade(target, revision)
            after = migrations.current(target)
        except _migration_errors() as e:
            raise fail(f"downgrade failed: {_one_line(e)}") from None
    typer.echo(f"database at revision {after or 'base (empty)'}")


@app.command()
def current(dsn: DsnOption = None) -> None:
    """Print the database's revision and the latest one."""
    import migrations

    target = _dsn(dsn)
    with one_line_errors():
        try:
            revision = migrations.current(target)
        except _migration_errors() as e:
            raise fail(f"cannot read the revision: {_one_line(e)}") from None
    head = migrations.head()
    state = "up to date" if revision == head else f"behind: run `tideline db upgrade` to reach {head}"
    typer.echo(f"{revision or 'empty'} ({state})")


@app.command()
def history() -> None:
    """List the migrations, oldest first."""
    import migrations

    for revision, message in migrations.history():
        typer.echo(f"{revision}  {message}")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:400]
