"""The bank's view tables (SQLAlchemy Core), created by its own migrations branch (``migrations/``, ``bank``).

Names follow the application's own convention (``pk_``, ``uq_``, ``ix_``), which a rebuild keeps.

- ``accounts``: one row per open account (fold of ``events.account``): handle, owner, balance, and the stream
  version and source commit LSN the row reflects (the app's read-your-writes reads ``commit_lsn``);
- ``account_activity``: deposits and withdrawals per account and day of ``recorded_at`` (UTC).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import (
    BigInteger,
    Column,
    Date,
    Index,
    Integer,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"  # the bank's migrations location
metadata = MetaData()

accounts = Table(
    "accounts",
    metadata,
    Column("account_id", Text, nullable=False),
    Column("handle", Text, nullable=False),
    Column("owner", Text, nullable=False),
    Column("balance", Numeric(14, 2), nullable=False),
    Column("version", Integer, nullable=False),
    Column("commit_lsn", BigInteger, nullable=False),
    PrimaryKeyConstraint("account_id", name="pk_accounts"),
    UniqueConstraint("handle", name="uq_accounts_handle"),
    Index("ix_accounts_owner", "owner"),
    comment="open accounts (projection accounts)",
)

account_activity = Table(
    "account_activity",
    metadata,
    Column("account_id", Text, nullable=False),
    Column("day", Date, nullable=False),
    Column("deposits", Integer, nullable=False, server_default=text("0")),
    Column("withdrawals", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("account_id", "day", name="pk_account_activity"),
    comment="deposits and withdrawals per account and day (projection activity)",
)
