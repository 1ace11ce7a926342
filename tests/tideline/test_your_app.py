"""docs/your-app.md, the guide to an application of your own: it writes exactly the bank example's files
(examples/bank), and the bank's domain holds its rules against the real event store."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest

from commands.errors import DomainError, DuplicateClaimError, ValidationError
from examples.bank.app import BankApp
from examples.bank.domain import AccountNotOpen, BalanceNotZero, InsufficientFunds
from examples.bank.models import MIGRATIONS
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "your-app.md"
EXAMPLE = ROOT / "examples" / "bank"
HEREDOC = re.compile(r"^cat > (?P<path>bank/\S+) <<'EOF'\n(?P<body>.*?)^EOF$", re.MULTILINE | re.DOTALL)


def guide_files() -> dict[str, str]:
    return {m["path"].removeprefix("bank/"): m["body"] for m in HEREDOC.finditer(GUIDE.read_text())}


def test_the_guide_writes_the_bank_example_file_for_file() -> None:
    written = guide_files()
    example = {
        str(p.relative_to(EXAMPLE)): p.read_text()
        for p in sorted(EXAMPLE.rglob("*.py"))
        if "__pycache__" not in p.parts and p.name != "__main__.py"  # the example's CLI is not in the guide
    }
    assert sorted(written) == sorted(example)
    for name, body in example.items():
        assert written[name] == body, f"docs/your-app.md's bank/{name} differs from examples/bank/{name}"


def test_the_bank_uses_only_tidelines_public_packages() -> None:
    """The example imports Tideline's packages, never the reservations example nor Tideline's internals."""
    public = ("commands.", "projections.views", "projections.consistency", "migrations")
    for path in EXAMPLE.rglob("*.py"):
        for line in path.read_text().splitlines():
            m = re.match(r"(?:from|import) (\w[\w.]*)", line)
            if m is None or m[1].startswith(("__future__", "collections", "dataclasses", "datetime", "decimal",
                                             "enum", "json", "pathlib", "re", "typing", "typer", "psycopg",
                                             "pyspark", "sqlalchemy", "alembic")):  # fmt: skip
                continue
            assert m[1].startswith(public) or m[1] == "commands", f"{path.name}: {line}"


@pytest.fixture
def bank(postgres: LocalPostgres) -> BankApp:
    import uuid

    import migrations

    dsn = postgres.create_database(f"bank_{uuid.uuid4().hex[:8]}")
    migrations.upgrade(dsn, apps=(MIGRATIONS,))
    return BankApp(dsn)


def test_the_banks_rules_hold_on_the_event_store(bank: BankApp) -> None:
    with bank:
        bank.open_account("a1", "@alice", "Alice")
        bank.deposit("a1", Decimal("100.10"))
        assert bank.withdraw("a1", Decimal("0.10")).version == 3
        with pytest.raises(InsufficientFunds, match=re.escape("holds 100.00, cannot withdraw 100.01")):
            bank.withdraw("a1", Decimal("100.01"))
        with pytest.raises(ValidationError, match="at most two decimal places"):
            bank.deposit("a1", Decimal("1.005"))
        with pytest.raises(DomainError) as taken:  # a taken handle is a DomainError like the others
            bank.open_account("a2", "@alice", "Another")
        assert isinstance(taken.value, DuplicateClaimError)
        with pytest.raises(BalanceNotZero):
            bank.close_account("a1")
        bank.withdraw("a1", Decimal("100.00"))
        bank.close_account("a1")
        with pytest.raises(AccountNotOpen):
            bank.deposit("a1", Decimal("1"))
        bank.open_account("a2", "@alice", "Another")  # a closed account's handle is free again
        state = bank.account("a1").state
        assert state.balance == Decimal("0.00") and state.movements == 3
