"""``python -m examples.reservations``: issue commands, read state, or serve the HTTP API.

::

    export TIDELINE_DSN=$(tideline pg start --dir /tmp/tideline-pg)
    tideline db upgrade
    python -m examples.reservations register-user alice --user-id u1
    python -m examples.reservations reserve hamlet A12 --customer u1 --reservation-id r1
    python -m examples.reservations change-seat r1 B3
    python -m examples.reservations cancel r1
    python -m examples.reservations show-reservation r1
    python -m examples.reservations serve --port 8000      # the HTTP API (examples/reservations/api.py)

Each command prints one JSON object (the command result); ``--command-id`` makes a
retry of the same command idempotent. A refused command prints ``error: …`` and exits 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

import typer

from commands.codec import to_json
from commands.errors import CommandsError
from commands.handler import CommandResult, Loaded
from examples.reservations.app import ReservationsApp

app = typer.Typer(
    name="python -m examples.reservations",
    help="Theatre seat reservations and user registration on Tideline's write side.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class Options:
    dsn: str = ""


@app.callback()
def _root(
    dsn: Annotated[str, typer.Option("--dsn", envvar="TIDELINE_DSN", help="Database (migrated).")],
) -> None:
    Options.dsn = dsn


CommandId = Annotated[str | None, typer.Option("--command-id", help="Idempotency key (default: a fresh one).")]


def _run(call: Callable[[ReservationsApp], CommandResult | Loaded[Any]]) -> None:
    service = ReservationsApp(Options.dsn)
    try:
        outcome = call(service)
    except CommandsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        service.close()
    if isinstance(outcome, CommandResult):
        typer.echo(json.dumps(outcome.to_json()))
    else:
        typer.echo(json.dumps({"version": outcome.version, "state": to_json(outcome.state)}))


@app.command("register-user")
def register_user(
    username: str,
    display_name: Annotated[str, typer.Option("--display-name")] = "",
    user_id: Annotated[str | None, typer.Option("--user-id", help="Default: a fresh id.")] = None,
    command_id: CommandId = None,
) -> None:
    """RegisterUser: a username is unique across users."""
    _run(lambda s: s.register_user(username, display_name=display_name, user_id=user_id, command_id=command_id))


@app.command()
def reserve(
    show_id: str,
    seat: str,
    customer: Annotated[str, typer.Option("--customer", help="The customer's user id.")],
    reservation_id: Annotated[str | None, typer.Option("--reservation-id", help="Default: a fresh id.")] = None,
    command_id: CommandId = None,
) -> None:
    """ReserveSeat: a seat of a show is held by one reservation at a time."""
    _run(
        lambda s: s.reserve_seat(
            show_id, seat, customer_id=customer, reservation_id=reservation_id, command_id=command_id
        )
    )


@app.command("change-seat")
def change_seat(reservation_id: str, seat: str, command_id: CommandId = None) -> None:
    """ChangeSeat: move an active reservation to a free seat of the same show."""
    _run(lambda s: s.change_seat(reservation_id, seat, command_id=command_id))


@app.command()
def cancel(reservation_id: str, command_id: CommandId = None) -> None:
    """CancelReservation: the seat becomes free."""
    _run(lambda s: s.cancel_reservation(reservation_id, command_id=command_id))


@app.command("show-reservation")
def show_reservation(reservation_id: str) -> None:
    """Print a reservation's state and version."""
    _run(lambda s: s.reservation(reservation_id))


@app.command("show-user")
def show_user(user_id: str) -> None:
    """Print a user's state and version."""
    _run(lambda s: s.user(user_id))


@app.command()
def serve(
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8000,
) -> None:
    """Serve the HTTP API with uvicorn until interrupted."""
    import uvicorn

    from examples.reservations.api import create_app

    uvicorn.run(create_app(Options.dsn), host=host, port=port, log_level="info")


if __name__ == "__main__":
    app()
