"""``python -m examples.bank``: the bank's commands and reads.

::

    python -m examples.bank open a1 @alice "Alice Liddell"
    python -m examples.bank deposit a1 120.50 --reference salary
    python -m examples.bank withdraw a1 20
    python -m examples.bank show a1                 # the write model's state
    python -m examples.bank view a1 --after 0/1A2B3C4D   # the accounts view, once it has that position

Each command prints one JSON object (the command result, money as exact strings); a refused command prints
``error: …`` and exits 1. The database comes from ``--dsn`` or ``TIDELINE_DSN``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

import typer

from commands.codec import to_json
from commands.errors import CommandsError
from commands.handler import CommandResult

from .app import BankApp, ReadTimeout

app = typer.Typer(
    name="python -m examples.bank",
    help="Bank accounts on Tideline's write side.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class Options:
    dsn: str = ""


@app.callback()
def _root(dsn: Annotated[str, typer.Option("--dsn", envvar="TIDELINE_DSN", help="Database (migrated).")]) -> None:
    Options.dsn = dsn


def _amount(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation:
        raise typer.BadParameter(f"not an amount: {text!r}") from None


def _run(call: Callable[[BankApp], Any]) -> None:
    with BankApp(Options.dsn) as bank:
        try:
            outcome = call(bank)
        except (CommandsError, ReadTimeout) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    # A command's result, the folded state (already JSON-ready), or a view row (Decimal balance: str)
    typer.echo(json.dumps(outcome.to_json() if isinstance(outcome, CommandResult) else outcome, default=str))


CommandId = Annotated[str | None, typer.Option("--command-id", help="Idempotency key (default: a fresh one).")]


@app.command("open")
def open_account(account_id: str, handle: str, owner: str, command_id: CommandId = None) -> None:
    """OpenAccount: the handle (@name) is unique among open accounts."""
    _run(lambda b: b.open_account(account_id, handle, owner, command_id=command_id))


@app.command()
def deposit(
    account_id: str,
    amount: str,
    reference: Annotated[str, typer.Option("--reference")] = "",
    command_id: CommandId = None,
) -> None:
    """Deposit AMOUNT (e.g. 120.50)."""
    _run(lambda b: b.deposit(account_id, _amount(amount), reference=reference, command_id=command_id))


@app.command()
def withdraw(
    account_id: str,
    amount: str,
    reference: Annotated[str, typer.Option("--reference")] = "",
    command_id: CommandId = None,
) -> None:
    """Withdraw AMOUNT: refused past the balance."""
    _run(lambda b: b.withdraw(account_id, _amount(amount), reference=reference, command_id=command_id))


@app.command("close")
def close_account(account_id: str, command_id: CommandId = None) -> None:
    """CloseAccount: refused while money is left; gives the handle back."""
    _run(lambda b: b.close_account(account_id, command_id=command_id))


@app.command()
def show(account_id: str) -> None:
    """The account's state, folded from its events."""
    _run(lambda b: {"version": (loaded := b.account(account_id)).version, "state": to_json(loaded.state)})


@app.command()
def view(
    account_id: str,
    after: Annotated[str | None, typer.Option("--after", help="Wait until the view has this commit_lsn.")] = None,
    timeout: Annotated[float, typer.Option("--timeout")] = 10.0,
) -> None:
    """The account's row of the accounts view (read-your-writes with --after)."""
    _run(lambda b: b.account_view(account_id, after=after, timeout=timeout) or {})


if __name__ == "__main__":
    app()
