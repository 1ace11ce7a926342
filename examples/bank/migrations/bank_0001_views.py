"""the bank's views: accounts, account_activity

Revision ID: bank_0001
Revises:
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "bank_0001"
down_revision: str | None = None
branch_labels: tuple[str, ...] | None = ("bank",)
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("account_id", sa.Text, nullable=False),
        sa.Column("handle", sa.Text, nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("balance", sa.Numeric(14, 2), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("commit_lsn", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("account_id", name="pk_accounts"),
        sa.UniqueConstraint("handle", name="uq_accounts_handle"),
        comment="open accounts (projection accounts)",
    )
    op.create_index("ix_accounts_owner", "accounts", ["owner"])
    op.create_table(
        "account_activity",
        sa.Column("account_id", sa.Text, nullable=False),
        sa.Column("day", sa.Date, nullable=False),
        sa.Column("deposits", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("withdrawals", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("account_id", "day", name="pk_account_activity"),
        comment="deposits and withdrawals per account and day (projection activity)",
    )


def downgrade() -> None:
    op.drop_table("account_activity")
    op.drop_table("accounts")
