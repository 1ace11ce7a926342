"""``tideline db``: the alembic migrations of Tideline's own tables and of the application's beside them.

Tideline's branch (``tideline``) holds its tables (events, commands, claims, snapshots, cdc_mirror, the
projections' bookkeeping); an application's migrations are a branch of their own, found through
``--migrations`` (repeatable), else ``$TIDELINE_MIGRATIONS`` (``os.pathsep``-separated): each a directory or
the dotted name of a package (see :mod:`migrations`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tideline.cli_common import fail, one_line_errors

if TYPE_CHECKING:
    from migrations import BranchState

DSN_ENV = "TIDELINE_DSN"
MIGRATIONS_ENV = "TIDELINE_MIGRATIONS"

app = typer.Typer(help="Create and migrate Tideline's tables and your application's (alembic).", no_args_is_help=True)

DsnOption = Annotated[
    str | None,
    typer.Option("--dsn", envvar=DSN_ENV, help=f"Database URL or libpq string (or ${DSN_ENV}).", show_default=False),
]
MigrationsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--migrations",
        help="Your application's migrations: a directory or a package's dotted name (repeatable; "
        f"default ${MIGRATIONS_ENV}, {os.pathsep}-separated).",
        show_default=False,
    ),
]


def _dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise fail(f"no database: pass --dsn or set {DSN_ENV}")
    return dsn


def _apps(sources: list[str] | None) -> tuple[Path, ...]:
    import migrations

    if not sources:
        sources = [s for s in os.environ.get(MIGRATIONS_ENV, "").split(os.pathsep) if s.strip()]
    try:
        return migrations.locations(sources)
    except migrations.MigrationsError as e:
        raise fail(str(e)) from None


def _migration_errors() -> tuple[type[Exception], ...]:
    import sqlalchemy.exc
    from alembic.util import CommandError

    import migrations

    return (CommandError, sqlalchemy.exc.SQLAlchemyError, migrations.MigrationsError)


def _describe(states: list[BranchState]) -> str:
    return ", ".join(f"{s.branch.label} {s.current or 'empty'}" for s in states)


@app.command()
def upgrade(
    dsn: DsnOption = None,
    revision: Annotated[
        str, typer.Argument(help="Target: 'heads' (every branch), a revision, or BRANCH@head.")
    ] = "heads",
    migrations_: MigrationsOption = None,
) -> None:
    """Migrate the database up to REVISION (default: every branch to its head); a no-op when already there."""
    import migrations

    target = _dsn(dsn)
    apps = _apps(migrations_)
    with one_line_errors():
        try:
            before = migrations.status(target, apps)
            migrations.upgrade(target, revision, apps)
            after = migrations.status(target, apps)
        except _migration_errors() as e:
            raise fail(f"upgrade failed: {_one_line(e)}") from None
    changed = [a for b, a in zip(before, after, strict=True) if b.current != a.current]
    was = {b.branch.label: b.current for b in before}
    for state in after:
        if state in changed:
            typer.echo(
                f"{state.branch.label}: database at revision {state.current} (was {was[state.branch.label] or 'empty'})"
            )
        else:
            typer.echo(f"{state.branch.label}: database at revision {state.current or 'empty'} (unchanged)")


@app.command()
def downgrade(
    revision: Annotated[
        str,
        typer.Argument(
            help="Target revision; 'tideline@base' / 'APP@base' drops one branch's tables, 'base' every branch's."
        ),
    ],
    dsn: DsnOption = None,
    migrations_: MigrationsOption = None,
) -> None:
    """Migrate the database down to REVISION (data in dropped tables is lost)."""
    import migrations

    target = _dsn(dsn)
    apps = _apps(migrations_)
    with one_line_errors():
        try:
            migrations.downgrade(target, revision, apps)
            after = migrations.status(target, apps)
        except _migration_errors() as e:
            raise fail(f"downgrade failed: {_one_line(e)}") from None
    typer.echo(f"database at {_describe(after)}")


@app.command()
def current(dsn: DsnOption = None, migrations_: MigrationsOption = None) -> None:
    """Print, per branch, the database's revision and the branch's latest one."""
    import migrations

    target = _dsn(dsn)
    apps = _apps(migrations_)
    with one_line_errors():
        try:
            states = migrations.status(target, apps)
        except _migration_errors() as e:
            raise fail(f"cannot read the revision: {_one_line(e)}") from None
    for state in states:
        verdict = (
            "up to date" if state.up_to_date else f"behind: run `tideline db upgrade` to reach {state.branch.head}"
        )
        typer.echo(f"{state.branch.label}: {state.current or 'empty'} ({verdict})")


@app.command()
def history(migrations_: MigrationsOption = None) -> None:
    """List the migrations, branch by branch (Tideline's first), oldest first."""
    import migrations

    apps = _apps(migrations_)
    with one_line_errors():
        try:
            rows = migrations.history(apps)
        except _migration_errors() as e:
            raise fail(_one_line(e)) from None
    for branch, revision, message in rows:
        typer.echo(f"{branch}  {revision}  {message}")


@app.command()
def revision(
    message: Annotated[str, typer.Option("-m", "--message", help="What the revision does.")],
    branch: Annotated[str, typer.Option("--branch", help="Your application's branch label (e.g. bank).")],
    location: Annotated[
        Path | None,
        typer.Option(
            "--location", help="Directory to write into (default: the one --migrations / $TIDELINE_MIGRATIONS names)."
        ),
    ] = None,
    depends_on: Annotated[
        str | None, typer.Option("--depends-on", help="A revision it needs first (e.g. tideline_0002).")
    ] = None,
    rev_id: Annotated[str | None, typer.Option("--rev-id", help="Its id (default: alembic's random one).")] = None,
    migrations_: MigrationsOption = None,
) -> None:
    """Write a new, empty revision of your application's branch (its first: a new base labelled BRANCH)."""
    import migrations

    apps = _apps(migrations_)
    if location is None:
        if len(apps) != 1:
            raise fail("name the directory to write into: --location DIR (or exactly one --migrations)")
        location = apps[0]
    with one_line_errors():
        try:
            path = migrations.new_revision(message, branch, location, apps, depends_on=depends_on, rev_id=rev_id)
        except _migration_errors() as e:
            raise fail(_one_line(e)) from None
    typer.echo(f"wrote {path}")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:400]
