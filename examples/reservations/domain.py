"""The reservations domain: users with unique usernames, and theatre seat reservations.

Two aggregate types, both plain functions over frozen dataclasses:

``user`` (stream ``user-<user_id>``)
    RegisterUser → UserRegistered. A username is unique across users: the event claims
    ``("username", <username>)``.

``reservation`` (stream ``reservation-<reservation_id>``)
    ReserveSeat → SeatReserved; ChangeSeat → SeatChanged; CancelReservation →
    ReservationCancelled. A seat of a show is held by one active reservation at a time:
    SeatReserved claims ``("seat", "<show_id>/<seat>")``, SeatChanged claims the new
    seat and releases the old one, ReservationCancelled releases it.

Why a reservation per stream rather than one stream per show: a show's seats are
independent, so one stream per show would make every booking of a popular show
contend on one version number; the claims table gives the one rule that spans
reservations (a seat, one holder) without serialising unrelated bookings.

Schema history: UserRegistered v1 stored ``{"user_id", "name"}``; v2 splits the login
``username`` from the ``display_name`` (upcaster below: both take the old name).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from commands.aggregate import AggregateType, Claim, ClaimChanges
from commands.errors import DomainError, ValidationError
from commands.events import Event, EventRegistry

registry = EventRegistry()

USERNAME = re.compile(r"[a-z0-9_]{3,32}")
SEAT = re.compile(r"[A-Z][1-9][0-9]{0,2}")  # row letter + seat number: A1 … Z999
IDENTIFIER = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


# -- errors -------------------------------------------------------------------------


class UserAlreadyRegistered(DomainError):
    """The user id is taken (a username is checked by its claim: DuplicateClaimError)."""


class ReservationExists(DomainError):
    """ReserveSeat for a reservation id that already has a seat."""


class ReservationNotActive(DomainError):
    """ChangeSeat or CancelReservation on a reservation that is unknown or cancelled."""


def _check(pattern: re.Pattern[str], value: str, what: str) -> None:
    if not pattern.fullmatch(value):
        raise ValidationError(f"invalid {what} {value!r}: must match {pattern.pattern}")


# -- users ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterUser:
    user_id: str
    username: str
    display_name: str = ""


@registry.register
@dataclass(frozen=True, slots=True)
class UserRegistered(Event):
    event_type: ClassVar[str] = "UserRegistered"
    schema_version: ClassVar[int] = 2
    user_id: str
    username: str
    display_name: str


@registry.upcaster("UserRegistered", 1)
def _user_registered_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    name = payload.pop("name")
    return {**payload, "username": name, "display_name": name}


@dataclass(frozen=True, slots=True)
class User:
    registered: bool = False
    user_id: str = ""
    username: str = ""
    display_name: str = ""


def apply_user(state: User, event: Event) -> User:
    if isinstance(event, UserRegistered):
        return User(True, event.user_id, event.username, event.display_name)
    return state


def decide_user(state: User, command: RegisterUser) -> Sequence[Event]:
    _check(IDENTIFIER, command.user_id, "user id")
    _check(USERNAME, command.username, "username")
    if state.registered:
        raise UserAlreadyRegistered(f"user {command.user_id!r} is already registered as {state.username!r}")
    return [UserRegistered(command.user_id, command.username, command.display_name or command.username)]


def user_claims(event: Event) -> ClaimChanges:
    if isinstance(event, UserRegistered):
        return ClaimChanges(acquire=(Claim("username", event.username),))
    return ClaimChanges()


USER: AggregateType[User, RegisterUser] = AggregateType(
    name="user",
    state_type=User,
    initial=User(),
    apply=apply_user,
    decide=decide_user,
    stream_id=lambda c: f"user-{c.user_id}",
    events=registry,
    claims=user_claims,
)


# -- reservations -------------------------------------------------------------------------


class Status(enum.Enum):
    NONE = "none"
    ACTIVE = "active"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class ReserveSeat:
    reservation_id: str
    show_id: str
    seat: str
    customer_id: str


@dataclass(frozen=True, slots=True)
class ChangeSeat:
    reservation_id: str
    seat: str


@dataclass(frozen=True, slots=True)
class CancelReservation:
    reservation_id: str


ReservationCommand = ReserveSeat | ChangeSeat | CancelReservation


@registry.register
@dataclass(frozen=True, slots=True)
class SeatReserved(Event):
    event_type: ClassVar[str] = "SeatReserved"
    reservation_id: str
    show_id: str
    seat: str
    customer_id: str


@registry.register
@dataclass(frozen=True, slots=True)
class SeatChanged(Event):
    event_type: ClassVar[str] = "SeatChanged"
    reservation_id: str
    show_id: str
    from_seat: str
    to_seat: str


@registry.register
@dataclass(frozen=True, slots=True)
class ReservationCancelled(Event):
    event_type: ClassVar[str] = "ReservationCancelled"
    reservation_id: str
    show_id: str
    seat: str


@dataclass(frozen=True, slots=True)
class Reservation:
    status: Status = Status.NONE
    reservation_id: str = ""
    show_id: str = ""
    seat: str = ""
    customer_id: str = ""
    seat_changes: int = 0


def apply_reservation(state: Reservation, event: Event) -> Reservation:
    if isinstance(event, SeatReserved):
        return Reservation(Status.ACTIVE, event.reservation_id, event.show_id, event.seat, event.customer_id)
    if isinstance(event, SeatChanged):
        return replace(state, seat=event.to_seat, seat_changes=state.seat_changes + 1)
    if isinstance(event, ReservationCancelled):
        return replace(state, status=Status.CANCELLED)
    return state


def decide_reservation(state: Reservation, command: ReservationCommand) -> Sequence[Event]:
    _check(IDENTIFIER, command.reservation_id, "reservation id")
    if isinstance(command, ReserveSeat):
        _check(IDENTIFIER, command.show_id, "show id")
        _check(SEAT, command.seat, "seat")
        _check(IDENTIFIER, command.customer_id, "customer id")
        if state.status is not Status.NONE:
            raise ReservationExists(f"reservation {command.reservation_id!r} already exists ({state.status.value})")
        return [SeatReserved(command.reservation_id, command.show_id, command.seat, command.customer_id)]
    if state.status is not Status.ACTIVE:
        raise ReservationNotActive(f"reservation {command.reservation_id!r} is {state.status.value}, not active")
    if isinstance(command, ChangeSeat):
        _check(SEAT, command.seat, "seat")
        if command.seat == state.seat:
            raise ValidationError(f"reservation {command.reservation_id!r} already holds seat {command.seat}")
        return [SeatChanged(state.reservation_id, state.show_id, state.seat, command.seat)]
    return [ReservationCancelled(state.reservation_id, state.show_id, state.seat)]


def seat_claim(show_id: str, seat: str) -> Claim:
    return Claim("seat", f"{show_id}/{seat}")


def reservation_claims(event: Event) -> ClaimChanges:
    if isinstance(event, SeatReserved):
        return ClaimChanges(acquire=(seat_claim(event.show_id, event.seat),))
    if isinstance(event, SeatChanged):
        return ClaimChanges(
            acquire=(seat_claim(event.show_id, event.to_seat),), release=(seat_claim(event.show_id, event.from_seat),)
        )
    if isinstance(event, ReservationCancelled):
        return ClaimChanges(release=(seat_claim(event.show_id, event.seat),))
    return ClaimChanges()


RESERVATION: AggregateType[Reservation, ReservationCommand] = AggregateType(
    name="reservation",
    state_type=Reservation,
    initial=Reservation(),
    apply=apply_reservation,
    decide=decide_reservation,
    stream_id=lambda c: f"reservation-{c.reservation_id}",
    events=registry,
    claims=reservation_claims,
)
