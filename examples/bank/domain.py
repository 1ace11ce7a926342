"""The bank domain: accounts with a unique handle, and money in and out of them.

One aggregate type, ``account`` (stream ``account-<account_id>``):

- ``OpenAccount`` → ``AccountOpened``; the handle (``@alice``) is unique among open accounts: the event claims
  ``("handle", <handle>)``, and ``AccountClosed`` gives it back;
- ``Deposit`` → ``MoneyDeposited``; ``Withdraw`` → ``MoneyWithdrawn``, refused past the balance
  (``InsufficientFunds``); ``CloseAccount`` → ``AccountClosed``, refused while money is left.

Money is ``Decimal`` with two places, never ``float``: the command codec stores it as an exact string.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import ClassVar

from commands.aggregate import AggregateType, Claim, ClaimChanges
from commands.errors import DomainError, ValidationError
from commands.events import Event, EventRegistry

registry = EventRegistry()

ACCOUNT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
HANDLE = re.compile(r"@[a-z0-9_]{3,30}")
CENT = Decimal("0.01")
MAX_AMOUNT = Decimal("1000000000.00")


class AccountExists(DomainError):
    """OpenAccount for an account id that is already open (or was closed: ids are never reused)."""


class AccountNotOpen(DomainError):
    """Deposit, Withdraw or CloseAccount on an account that is unknown or closed."""


class InsufficientFunds(DomainError):
    """Withdraw of more than the balance."""


class BalanceNotZero(DomainError):
    """CloseAccount while money is left."""


def money(amount: Decimal, what: str = "amount") -> Decimal:
    """``amount`` checked: positive, at most two decimal places, below ``MAX_AMOUNT``."""
    if not isinstance(amount, Decimal) or not amount.is_finite():
        raise ValidationError(f"invalid {what} {amount!r}: a finite Decimal")
    if amount <= 0 or amount > MAX_AMOUNT:
        raise ValidationError(f"invalid {what} {amount}: must be > 0 and <= {MAX_AMOUNT}")
    if amount != amount.quantize(CENT):
        raise ValidationError(f"invalid {what} {amount}: at most two decimal places")
    return amount.quantize(CENT)


# -- commands -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenAccount:
    account_id: str
    handle: str
    owner: str


@dataclass(frozen=True, slots=True)
class Deposit:
    account_id: str
    amount: Decimal
    reference: str = ""


@dataclass(frozen=True, slots=True)
class Withdraw:
    account_id: str
    amount: Decimal
    reference: str = ""


@dataclass(frozen=True, slots=True)
class CloseAccount:
    account_id: str


AccountCommand = OpenAccount | Deposit | Withdraw | CloseAccount


# -- events ---------------------------------------------------------------------------------------------------


@registry.register
@dataclass(frozen=True, slots=True)
class AccountOpened(Event):
    event_type: ClassVar[str] = "AccountOpened"
    account_id: str
    handle: str
    owner: str


@registry.register
@dataclass(frozen=True, slots=True)
class MoneyDeposited(Event):
    event_type: ClassVar[str] = "MoneyDeposited"
    account_id: str
    amount: Decimal
    balance: Decimal  # after the deposit
    reference: str


@registry.register
@dataclass(frozen=True, slots=True)
class MoneyWithdrawn(Event):
    event_type: ClassVar[str] = "MoneyWithdrawn"
    account_id: str
    amount: Decimal
    balance: Decimal  # after the withdrawal
    reference: str


@registry.register
@dataclass(frozen=True, slots=True)
class AccountClosed(Event):
    event_type: ClassVar[str] = "AccountClosed"
    account_id: str
    handle: str


# -- state ----------------------------------------------------------------------------------------------------


class Status(enum.Enum):
    NONE = "none"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Account:
    status: Status = Status.NONE
    account_id: str = ""
    handle: str = ""
    owner: str = ""
    balance: Decimal = Decimal("0.00")
    movements: int = 0  # deposits and withdrawals so far


def apply_account(state: Account, event: Event) -> Account:
    if isinstance(event, AccountOpened):
        return Account(Status.OPEN, event.account_id, event.handle, event.owner)
    if isinstance(event, MoneyDeposited | MoneyWithdrawn):
        return replace(state, balance=event.balance, movements=state.movements + 1)
    if isinstance(event, AccountClosed):
        return replace(state, status=Status.CLOSED)
    return state


def decide_account(state: Account, command: AccountCommand) -> Sequence[Event]:
    if not ACCOUNT_ID.fullmatch(command.account_id):
        raise ValidationError(f"invalid account id {command.account_id!r}: must match {ACCOUNT_ID.pattern}")
    if isinstance(command, OpenAccount):
        if not HANDLE.fullmatch(command.handle):
            raise ValidationError(f"invalid handle {command.handle!r}: must match {HANDLE.pattern}")
        if not command.owner.strip():
            raise ValidationError("an account needs an owner")
        if state.status is not Status.NONE:
            raise AccountExists(f"account {command.account_id!r} exists ({state.status.value})")
        return [AccountOpened(command.account_id, command.handle, command.owner.strip())]
    if state.status is not Status.OPEN:
        raise AccountNotOpen(f"account {command.account_id!r} is not open ({state.status.value})")
    if isinstance(command, Deposit):
        amount = money(command.amount)
        return [MoneyDeposited(command.account_id, amount, state.balance + amount, command.reference)]
    if isinstance(command, Withdraw):
        amount = money(command.amount)
        if amount > state.balance:
            raise InsufficientFunds(f"account {command.account_id!r} holds {state.balance}, cannot withdraw {amount}")
        return [MoneyWithdrawn(command.account_id, amount, state.balance - amount, command.reference)]
    if state.balance != 0:
        raise BalanceNotZero(f"account {command.account_id!r} still holds {state.balance}: withdraw it first")
    return [AccountClosed(command.account_id, state.handle)]


def account_claims(event: Event) -> ClaimChanges:
    if isinstance(event, AccountOpened):
        return ClaimChanges(acquire=(Claim("handle", event.handle),))
    if isinstance(event, AccountClosed):
        return ClaimChanges(release=(Claim("handle", event.handle),))
    return ClaimChanges()


ACCOUNT: AggregateType[Account, AccountCommand] = AggregateType(
    name="account",
    state_type=Account,
    initial=Account(),
    apply=apply_account,
    decide=decide_account,
    stream_id=lambda c: f"account-{c.account_id}",
    events=registry,
    claims=account_claims,
)
