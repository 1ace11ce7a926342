"""The reservations application service: one method per command, and reads of the write model.

Both front ends (the HTTP API in :mod:`examples.reservations.api` and the CLI in
``python -m examples.reservations``) go through this class, so they share its ids,
its idempotency and its errors::

    app = ReservationsApp(dsn)
    app.register_user("alice", user_id="u1")
    result = app.reserve_seat("hamlet-2025-06-01", "A12", customer_id="u1")
    app.change_seat(result.stream_id.removeprefix("reservation-"), "B3")

Reads (``user``, ``reservation``) fold the write model's streams; ``view_rows`` reads the
read views that projections build (``users``, ``seats``; see examples/reservations/views.py),
with read-your-writes through ``commit_lsn`` (:func:`projections.consistency.wait_for`).
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from commands.handler import CommandHandler, CommandResult, HandlerConfig, Loaded
from examples.reservations.domain import (
    RESERVATION,
    USER,
    CancelReservation,
    ChangeSeat,
    RegisterUser,
    Reservation,
    ReserveSeat,
    User,
)


class ReservationsApp:
    """Commands and reads of the reservations domain on one database (thread-safe)."""

    def __init__(self, dsn: str, config: HandlerConfig | None = None) -> None:
        self.dsn = dsn
        self.handler = CommandHandler(dsn, config)

    def view_rows(self, view: str, column: str, value: str) -> list[dict[str, Any]]:
        """Rows of read view ``view`` (``users``, ``seats``) where ``column = value``."""
        query = sql.SQL("SELECT * FROM {} WHERE {} = %s ORDER BY 1, 2").format(
            sql.Identifier(view), sql.Identifier(column)
        )
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            return conn.execute(query, (value,)).fetchall()

    def close(self) -> None:
        self.handler.close()

    def register_user(
        self,
        username: str,
        *,
        display_name: str = "",
        user_id: str | None = None,
        command_id: str | None = None,
        correlation_id: str | None = None,
    ) -> CommandResult:
        command = RegisterUser(user_id or uuid.uuid4().hex, username, display_name)
        return self.handler.handle(USER, command, command_id=command_id, correlation_id=correlation_id)

    def reserve_seat(
        self,
        show_id: str,
        seat: str,
        *,
        customer_id: str,
        reservation_id: str | None = None,
        command_id: str | None = None,
        correlation_id: str | None = None,
    ) -> CommandResult:
        command = ReserveSeat(reservation_id or uuid.uuid4().hex, show_id, seat, customer_id)
        return self.handler.handle(RESERVATION, command, command_id=command_id, correlation_id=correlation_id)

    def change_seat(
        self, reservation_id: str, seat: str, *, command_id: str | None = None, correlation_id: str | None = None
    ) -> CommandResult:
        command = ChangeSeat(reservation_id, seat)
        return self.handler.handle(RESERVATION, command, command_id=command_id, correlation_id=correlation_id)

    def cancel_reservation(
        self, reservation_id: str, *, command_id: str | None = None, correlation_id: str | None = None
    ) -> CommandResult:
        command = CancelReservation(reservation_id)
        return self.handler.handle(RESERVATION, command, command_id=command_id, correlation_id=correlation_id)

    def user(self, user_id: str) -> Loaded[User]:
        return self.handler.load(USER, f"user-{user_id}")

    def reservation(self, reservation_id: str) -> Loaded[Reservation]:
        return self.handler.load(RESERVATION, f"reservation-{reservation_id}")
