"""The bank's application service: one method per command, the write model's state, and the ``accounts`` view
read with read-your-writes::

    bank = BankApp(dsn)
    opened = bank.open_account("a1", "@alice", "Alice")
    deposited = bank.deposit("a1", Decimal("120.50"))
    bank.account_view("a1", after=deposited.commit_lsn)   # waits until the view has that deposit

``after`` is a command's ``commit_lsn``: the read waits (``projections.consistency.wait_for``) until the follow
job of ``accounts`` has applied it, then reads; ``ReadTimeout`` if it has not within ``timeout`` seconds.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
from psycopg.rows import dict_row

from commands.handler import CommandHandler, CommandResult, HandlerConfig, Loaded
from projections.consistency import wait_for

from .domain import ACCOUNT, Account, CloseAccount, Deposit, OpenAccount, Withdraw

VIEW = "accounts"


class ReadTimeout(Exception):
    """The view did not reach the position asked for in time (the follow job is behind or stopped)."""


class BankApp:
    """Commands and reads of the bank on one database (thread-safe)."""

    def __init__(self, dsn: str, config: HandlerConfig | None = None) -> None:
        self.dsn = dsn
        self.handler = CommandHandler(dsn, config)

    def close(self) -> None:
        self.handler.close()

    def __enter__(self) -> BankApp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_account(self, account_id: str, handle: str, owner: str, *, command_id: str | None = None) -> CommandResult:
        return self.handler.handle(ACCOUNT, OpenAccount(account_id, handle, owner), command_id=command_id)

    def deposit(
        self, account_id: str, amount: Decimal, *, reference: str = "", command_id: str | None = None
    ) -> CommandResult:
        return self.handler.handle(ACCOUNT, Deposit(account_id, amount, reference), command_id=command_id)

    def withdraw(
        self, account_id: str, amount: Decimal, *, reference: str = "", command_id: str | None = None
    ) -> CommandResult:
        return self.handler.handle(ACCOUNT, Withdraw(account_id, amount, reference), command_id=command_id)

    def close_account(self, account_id: str, *, command_id: str | None = None) -> CommandResult:
        return self.handler.handle(ACCOUNT, CloseAccount(account_id), command_id=command_id)

    def account(self, account_id: str) -> Loaded[Account]:
        """The account's state from its events (the write model: always current)."""
        return self.handler.load(ACCOUNT, f"account-{account_id}")

    def account_view(
        self, account_id: str, *, after: str | int | None = None, timeout: float = 10.0
    ) -> dict[str, Any] | None:
        """The account's row of the ``accounts`` view (None: not open), once the view has applied ``after``."""
        if after is not None and not wait_for(self.dsn, VIEW, after, timeout=timeout):
            raise ReadTimeout(f"the {VIEW} view did not reach {after} within {timeout:g} s: is its follow job running?")
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            row: dict[str, Any] | None = conn.execute(
                "SELECT account_id, handle, owner, balance, version FROM accounts WHERE account_id = %s",
                (account_id,),
            ).fetchone()
            return row
