"""The codec's value types (Decimal, datetime, date, UUID) through the real stored paths, and
``except DomainError`` around a taken claim: the command handler against Postgres (events and
snapshots as jsonb, loaded back with orjson) and capture's outbox routing into the log (the
values a fold view decodes)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest
from commands_util import rows

from capture.config import CaptureConfig
from capture.connector import Connector
from commands.aggregate import AggregateType, Claim, ClaimChanges
from commands.errors import DomainError, DuplicateClaimError, ValidationError
from commands.events import Event, EventRegistry
from commands.handler import CommandHandler, HandlerConfig
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from examples.reservations.domain import USER, RegisterUser, User

# -- a small bank: money as Decimal, instants, value dates, ids as UUID -------------------------

REGISTRY = EventRegistry()
PLUS_2 = dt.timezone(dt.timedelta(hours=2))
MINUS_5_30 = dt.timezone(-dt.timedelta(hours=5, minutes=30))


@dataclass(frozen=True, slots=True)
class Money:
    amount: Decimal
    currency: str = "EUR"


@REGISTRY.register
@dataclass(frozen=True, slots=True)
class AccountOpened(Event):
    event_type: ClassVar[str] = "AccountOpened"
    account_id: uuid.UUID
    handle: str
    opened_at: dt.datetime
    opening: Money


@REGISTRY.register
@dataclass(frozen=True, slots=True)
class Deposited(Event):
    event_type: ClassVar[str] = "Deposited"
    account_id: uuid.UUID
    amount: Decimal
    value_date: dt.date
    booked_at: dt.datetime
    parts: tuple[Decimal, ...] = ()
    tags: frozenset[Decimal] = frozenset()
    due: dict[str, dt.date] = field(default_factory=dict)
    reference: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class Account:
    account_id: uuid.UUID | None = None
    handle: str = ""
    opened_at: dt.datetime | None = None
    balance: Decimal = Decimal("0.00")
    history: tuple[Money, ...] = ()
    by_value_date: dict[dt.date, Decimal] = field(default_factory=dict)
    last_booked_at: dt.datetime | None = None
    references: frozenset[uuid.UUID] = frozenset()


@dataclass(frozen=True, slots=True)
class Open:
    account_id: uuid.UUID
    handle: str
    opened_at: dt.datetime
    opening: Money


@dataclass(frozen=True, slots=True)
class Deposit:
    account_id: uuid.UUID
    event: Deposited


def apply(state: Account, event: Event) -> Account:
    if isinstance(event, AccountOpened):
        return Account(event.account_id, event.handle, event.opened_at, event.opening.amount, (event.opening,))
    assert isinstance(event, Deposited)
    by_date = dict(state.by_value_date)
    by_date[event.value_date] = by_date.get(event.value_date, Decimal("0.00")) + event.amount
    refs = state.references | ({event.reference} if event.reference else set())
    return dataclasses.replace(
        state,
        balance=state.balance + event.amount,
        history=(*state.history, Money(event.amount)),
        by_value_date=by_date,
        last_booked_at=event.booked_at,
        references=frozenset(refs),
    )


def decide(state: Account, command: Open | Deposit) -> Sequence[Event]:
    if isinstance(command, Open):
        if state.account_id is not None:
            raise ValidationError(f"account {command.account_id} is already open")
        return [AccountOpened(command.account_id, command.handle, command.opened_at, command.opening)]
    if state.account_id is None:
        raise ValidationError(f"account {command.account_id} is not open")
    return [command.event]


def claims(event: Event) -> ClaimChanges:
    return (
        ClaimChanges(acquire=(Claim("handle", event.handle),)) if isinstance(event, AccountOpened) else ClaimChanges()
    )


ACCOUNT: AggregateType[Account, Open | Deposit] = AggregateType(
    name="account",
    state_type=Account,
    initial=Account(),
    apply=apply,
    decide=decide,
    stream_id=lambda c: f"account-{c.account_id}",
    events=REGISTRY,
    claims=claims,
)

ID = uuid.UUID("0189b7a2-3c4d-7e5f-8a9b-0c1d2e3f4a5b")
REF = uuid.UUID("f47ac10b-58cc-4372-a567-0e02b2c3d479")
OPENED = AccountOpened(ID, "alice", dt.datetime(2024, 5, 1, 12, 30, 0, 250_000, tzinfo=PLUS_2), Money(Decimal("10.50")))
EVENTS: list[Event] = [
    OPENED,
    Deposited(
        ID,
        Decimal("0.10"),
        dt.date(2024, 5, 2),
        dt.datetime(2024, 5, 2, 9, 0, tzinfo=MINUS_5_30),
        parts=(Decimal("0.05"), Decimal("0.050")),
        tags=frozenset({Decimal("1E+2"), Decimal("-0.00"), Decimal("2.5")}),
        due={"first": dt.date(2024, 6, 1)},
        reference=REF,
    ),
    Deposited(
        ID,
        Decimal("1234567890123456.1234567890"),  # 26 digits: sums stay exact in the default context (28)
        dt.date(2024, 5, 2),
        dt.datetime(2024, 5, 3, 23, 59, 59, 999_999),  # naive: stays naive
    ),
    Deposited(ID, Decimal("-0.0000001"), dt.date(2024, 2, 29), dt.datetime(2024, 5, 4, tzinfo=dt.UTC)),
]
COMMANDS: list[Open | Deposit] = [
    Open(ID, OPENED.handle, OPENED.opened_at, OPENED.opening),
    *(Deposit(ID, e) for e in EVENTS[1:] if isinstance(e, Deposited)),
]
EXPECTED = ACCOUNT.fold(EVENTS)


def exactly(value: Any) -> Any:
    """``value`` with what == does not compare made visible: a Decimal's scale and sign, a
    datetime's UTC offset, every value's exact type."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: exactly(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return (type(value).__name__, fields)
    if isinstance(value, Decimal):
        return ("Decimal", value.as_tuple())
    if isinstance(value, dt.datetime):
        return (type(value).__name__, value.isoformat())
    if isinstance(value, dict):
        return ("dict", sorted((repr(exactly(k)), exactly(v)) for k, v in value.items()))
    if isinstance(value, frozenset | tuple | list):
        items = [exactly(v) for v in value]
        return (type(value).__name__, sorted(items, key=repr) if isinstance(value, frozenset) else items)
    return (type(value).__name__, value)


def test_the_exactly_helper_sees_scale_and_offset() -> None:
    assert Decimal("10.5") == Decimal("10.50") and exactly(Decimal("10.5")) != exactly(Decimal("10.50"))
    noon_utc = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)
    assert noon_utc == noon_utc.astimezone(PLUS_2) and exactly(noon_utc) != exactly(noon_utc.astimezone(PLUS_2))


def test_value_types_round_trip_through_the_event_store_and_snapshots(dsn: str) -> None:
    with CommandHandler(dsn, HandlerConfig(snapshot_every=3)) as handler:
        for command in COMMANDS:
            handler.handle(ACCOUNT, command)
    stream = f"account-{ID}"
    stored = rows(
        dsn, "SELECT event_type, schema_version, payload FROM events WHERE stream_id = %s ORDER BY version", stream
    )
    # The jsonb column holds the codec's strings (psycopg parses jsonb with the json module here).
    assert stored[0][2] == {
        "account_id": str(ID),
        "handle": "alice",
        "opened_at": "2024-05-01T12:30:00.250000+02:00",
        "opening": {"amount": "10.50", "currency": "EUR"},
    }
    assert stored[1][2]["amount"] == "0.10" and stored[1][2]["booked_at"] == "2024-05-02T09:00:00-05:30"
    assert stored[1][2]["tags"] == ["-0.00", "1E+2", "2.5"] and stored[1][2]["due"] == {"first": "2024-06-01"}
    assert stored[2][2]["booked_at"] == "2024-05-03T23:59:59.999999"
    decoded = [REGISTRY.decode(t, v, p) for t, v, p in stored]
    assert exactly(decoded) == exactly(EVENTS)

    [(version, state)] = rows(dsn, "SELECT version, state FROM snapshots WHERE stream_id = %s", stream)
    assert version == 3 and state["balance"] == "1234567890123466.7234567890"
    assert state["history"][:2] == [{"amount": "10.50", "currency": "EUR"}, {"amount": "0.10", "currency": "EUR"}]
    assert state["references"] == [str(REF)] and state["last_booked_at"] == "2024-05-03T23:59:59.999999"
    assert state["by_value_date"] == {"2024-05-02": "1234567890123456.2234567890"}

    # Folded again by handlers that cache nothing: from the snapshot (the handler's own orjson path) and the
    # version-4 event after it, and from the events alone.
    for use_snapshots in (True, False):
        with CommandHandler(dsn, HandlerConfig(cache_size=0, use_snapshots=use_snapshots)) as fresh:
            loaded = fresh.load(ACCOUNT, stream)
        assert loaded.version == 4
        assert exactly(loaded.state) == exactly(EXPECTED), f"use_snapshots={use_snapshots}"
    assert str(EXPECTED.balance) == "1234567890123466.7234566890"


@pytest.fixture
def slot_dropped(dsn: str) -> Iterator[str]:
    yield dsn
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()"
        )


def test_value_types_round_trip_through_capture_into_the_log(slot_dropped: str, tmp_path: Path) -> None:
    """The outbox route a fold view reads: jsonb → wal2json → capture → the log → StoredEvent → the registry."""
    from projections.views import StoredEvent  # imports pyspark: only this test needs it

    dsn = slot_dropped
    with CommandHandler(dsn, HandlerConfig(snapshot_every=None)) as handler:
        for command in COMMANDS:
            handler.handle(ACCOUNT, command)
    log_dir = tmp_path / "log"
    config = CaptureConfig(
        dsn=dsn, slot="codec", topic_prefix="cdc", outbox_table="public.events", exit_when_caught_up=True
    )
    with Log(log_dir) as log:
        Connector(config, log).run()
    with Log(log_dir) as log, Consumer(log, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition("events.account", 0)])
        consumer.seek_to_beginning()
        values: list[bytes] = []
        while batch := consumer.poll(timeout_ms=0):
            values.extend(r.value for r in batch if r.value is not None)
    events = [StoredEvent.from_value(v) for v in values]
    assert [(e.stream_id, e.version) for e in events] == [(f"account-{ID}", v) for v in range(1, 5)]
    decoded = [ACCOUNT.events.decode(e.event_type, e.schema_version, e.payload) for e in events]
    assert exactly(decoded) == exactly(EVENTS)
    assert exactly(ACCOUNT.fold(decoded)) == exactly(EXPECTED)


# -- a taken claim is a DomainError --------------------------------------------------------------


def test_except_domain_error_catches_a_taken_username(handler: CommandHandler, dsn: str) -> None:
    handler.handle(USER, RegisterUser("u1", "alice"))
    try:
        handler.handle(USER, RegisterUser("u2", "alice"))
    except DomainError as e:  # what an application writes for "refused: tell the user, do not retry"
        refused: DomainError = e
    else:
        pytest.fail("a taken username was accepted")
    assert isinstance(refused, DuplicateClaimError)
    assert (refused.claim_type, refused.value, refused.holder) == ("username", "alice", "user-u1")
    assert str(refused) == "username 'alice' is already claimed by 'user-u1'"
    assert rows(dsn, "SELECT stream_id FROM events") == [("user-u1",)]  # nothing of u2 was written
    assert handler.load(USER, "user-u2").version == 0
    assert isinstance(handler.load(USER, "user-u1").state, User)


def test_except_domain_error_catches_a_taken_handle_of_a_user_aggregate(handler: CommandHandler, dsn: str) -> None:
    """The same with an aggregate of the test's own (claims derived from its events, Decimal money)."""
    handler.handle(ACCOUNT, COMMANDS[0])
    other = uuid.UUID(int=1)
    with pytest.raises(DomainError, match="handle 'alice' is already claimed by") as info:
        handler.handle(ACCOUNT, Open(other, "alice", dt.datetime(2024, 1, 1, tzinfo=dt.UTC), Money(Decimal("1.00"))))
    assert type(info.value) is DuplicateClaimError and info.value.holder == f"account-{ID}"
    assert rows(dsn, "SELECT count(*) FROM events WHERE stream_id = %s", f"account-{other}") == [(0,)]
