"""The ``ua_account`` aggregate: an account is opened with an owner and a unique handle, then takes
deposits and withdrawals (never below zero)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from commands.aggregate import AggregateType
from commands.errors import DomainError
from commands.events import Event, EventRegistry

registry = EventRegistry()


@registry.register
@dataclass(frozen=True, slots=True)
class AccountOpened(Event):
    event_type: ClassVar[str] = "AccountOpened"
    account_id: str
    owner: str
    handle: str


@registry.register
@dataclass(frozen=True, slots=True)
class Deposited(Event):
    event_type: ClassVar[str] = "Deposited"
    account_id: str
    amount: int


@registry.register
@dataclass(frozen=True, slots=True)
class Withdrawn(Event):
    event_type: ClassVar[str] = "Withdrawn"
    account_id: str
    amount: int


@dataclass(frozen=True, slots=True)
class Account:
    opened: bool = False
    account_id: str = ""
    owner: str = ""
    handle: str = ""
    balance: int = 0


@dataclass(frozen=True, slots=True)
class OpenAccount:
    account_id: str
    owner: str
    handle: str


def apply_account(state: Account, event: Event) -> Account:
    if isinstance(event, AccountOpened):
        return Account(True, event.account_id, event.owner, event.handle, 0)
    if isinstance(event, Deposited):
        return replace(state, balance=state.balance + event.amount)
    if isinstance(event, Withdrawn):
        return replace(state, balance=state.balance - event.amount)
    return state


def decide_account(state: Account, command: OpenAccount) -> Sequence[Event]:
    if state.opened:
        raise DomainError(f"account {command.account_id!r} is open already")
    return [AccountOpened(command.account_id, command.owner, command.handle)]


ACCOUNT: AggregateType[Account, OpenAccount] = AggregateType(
    name="ua_account",
    state_type=Account,
    initial=Account(),
    apply=apply_account,
    decide=decide_account,
    stream_id=lambda c: f"ua_account-{c.account_id}",
    events=registry,
)
