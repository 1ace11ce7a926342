"""HTTP API of the reservations example (FastAPI).

Run it (after ``tideline db upgrade --dsn "$DSN"``)::

    python -m examples.reservations --dsn "$DSN" serve --port 8000

Endpoints (JSON bodies; ``Idempotency-Key`` header = the command id, so a client's
retry of the same request is applied once; ``X-Correlation-Id`` is stored in the
events' metadata):

=======  ===================================  =========================================
POST     /users                               {"username", "display_name"?, "user_id"?}
GET      /users/{user_id}
POST     /reservations                        {"show_id", "seat", "customer_id", "reservation_id"?}
GET      /reservations/{reservation_id}
POST     /reservations/{reservation_id}/seat  {"seat"}  (ChangeSeat)
POST     /reservations/{reservation_id}/cancel
=======  ===================================  =========================================

``?consistent=true`` on a command waits (up to ``consistency_timeout`` seconds) until the
read view it changes — ``users`` for registrations, ``seats`` for reservations — has
reached the command's ``commit_lsn`` (:func:`projections.consistency.wait_for`; a
``tideline project follow`` job must be running), and answers ``504`` if it has not.
Read views: ``GET /views/users/{user_id}``, ``GET /views/seats/{show_id}``.

A command answers ``201`` with the command result (``stream_id``, ``version``,
``events``, ``commit_lsn``, ``replayed``) and the aggregate's state after it. Errors
answer ``{"error": <class>, "detail": <message>}``: ``422`` for an invalid command,
``409`` when the state refuses it (taken seat or username, cancelled reservation …),
``503`` with ``Retry-After`` when the stream kept changing under it (ConcurrencyError).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from commands.codec import to_json
from commands.errors import CommandIdReusedError, CommandsError, ConcurrencyError, ValidationError
from commands.handler import CommandResult, HandlerConfig, Loaded
from examples.reservations.app import ReservationsApp
from examples.reservations.domain import RESERVATION, USER
from projections.consistency import wait_for


class RegisterUserBody(BaseModel):
    username: str
    display_name: str = ""
    user_id: str | None = None


class ReserveSeatBody(BaseModel):
    show_id: str
    seat: str
    customer_id: str
    reservation_id: str | None = None


class ChangeSeatBody(BaseModel):
    seat: str


IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
CorrelationId = Annotated[str | None, Header(alias="X-Correlation-Id")]
Consistent = Annotated[bool, Query(alias="consistent", description="Wait until the read view has the events.")]


def status_of(error: CommandsError) -> int:
    if isinstance(error, ValidationError | CommandIdReusedError):
        return 422
    if isinstance(error, ConcurrencyError):
        return 503
    return 409


def create_app(dsn: str, config: HandlerConfig | None = None, *, consistency_timeout: float = 10.0) -> FastAPI:
    """The API on the database at ``dsn`` (migrated with ``tideline db upgrade``); read views
    and ``?consistent=true`` use the same database."""
    service = ReservationsApp(dsn, config or HandlerConfig(pin_connections=False))

    def consistent(result: CommandResult, projection: str, wanted: bool) -> None:
        if wanted and not wait_for(dsn, projection, result.commit_lsn, consistency_timeout):
            raise HTTPException(504, f"view {projection} has not reached {result.commit_lsn} yet")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.close()

    api = FastAPI(title="Tideline reservations example", lifespan=lifespan)

    @api.exception_handler(CommandsError)
    async def refused(_: Request, error: CommandsError) -> JSONResponse:
        headers = {"Retry-After": "1"} if isinstance(error, ConcurrencyError) else None
        body = {"error": type(error).__name__, "detail": str(error)}
        return JSONResponse(body, status_code=status_of(error), headers=headers)

    def answer(result: CommandResult, loaded: Loaded[Any]) -> dict[str, Any]:
        return {"result": result.to_json(), "state": to_json(loaded.state), "version": loaded.version}

    def found(loaded: Loaded[Any], what: str) -> JSONResponse | dict[str, Any]:
        if loaded.version == 0:
            return JSONResponse({"error": "NotFound", "detail": f"no {what}"}, status_code=404)
        return {"state": to_json(loaded.state), "version": loaded.version}

    @api.post("/users", status_code=201)
    def register_user(
        body: RegisterUserBody,
        key: IdempotencyKey = None,
        correlation: CorrelationId = None,
        consistent_read: Consistent = False,
    ) -> dict[str, Any]:
        r = service.register_user(
            body.username,
            display_name=body.display_name,
            user_id=body.user_id,
            command_id=key,
            correlation_id=correlation,
        )
        consistent(r, "users", consistent_read)
        return answer(r, service.handler.load(USER, r.stream_id))

    @api.get("/users/{user_id}", response_model=None)
    def get_user(user_id: str) -> JSONResponse | dict[str, Any]:
        return found(service.user(user_id), f"user {user_id!r}")

    @api.post("/reservations", status_code=201)
    def reserve_seat(
        body: ReserveSeatBody,
        key: IdempotencyKey = None,
        correlation: CorrelationId = None,
        consistent_read: Consistent = False,
    ) -> dict[str, Any]:
        r = service.reserve_seat(
            body.show_id,
            body.seat,
            customer_id=body.customer_id,
            reservation_id=body.reservation_id,
            command_id=key,
            correlation_id=correlation,
        )
        consistent(r, "seats", consistent_read)
        return answer(r, service.handler.load(RESERVATION, r.stream_id))

    @api.get("/reservations/{reservation_id}", response_model=None)
    def get_reservation(reservation_id: str) -> JSONResponse | dict[str, Any]:
        return found(service.reservation(reservation_id), f"reservation {reservation_id!r}")

    @api.post("/reservations/{reservation_id}/seat", status_code=201)
    def change_seat(
        reservation_id: str,
        body: ChangeSeatBody,
        key: IdempotencyKey = None,
        correlation: CorrelationId = None,
        consistent_read: Consistent = False,
    ) -> dict[str, Any]:
        r = service.change_seat(reservation_id, body.seat, command_id=key, correlation_id=correlation)
        consistent(r, "seats", consistent_read)
        return answer(r, service.reservation(reservation_id))

    @api.post("/reservations/{reservation_id}/cancel", status_code=201)
    def cancel_reservation(
        reservation_id: str,
        key: IdempotencyKey = None,
        correlation: CorrelationId = None,
        consistent_read: Consistent = False,
    ) -> dict[str, Any]:
        r = service.cancel_reservation(reservation_id, command_id=key, correlation_id=correlation)
        consistent(r, "seats", consistent_read)
        return answer(r, service.reservation(reservation_id))

    @api.get("/views/users/{user_id}", response_model=None)
    def view_user(user_id: str) -> JSONResponse | dict[str, Any]:
        rows = service.view_rows("users", "user_id", user_id)
        if not rows:
            return JSONResponse({"error": "NotFound", "detail": f"no user {user_id!r} in the view"}, status_code=404)
        return rows[0]

    @api.get("/views/seats/{show_id}")
    def view_seats(show_id: str) -> dict[str, Any]:
        return {"show_id": show_id, "seats": service.view_rows("seats", "show_id", show_id)}

    return api
