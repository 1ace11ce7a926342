"""the reservations example's read views: users, seats, show_occupancy

Revision ID: reservations_0001
Revises:
Create Date: 2026-12-07

The first revision of the example's own branch. Tideline before 0.2 created these tables in its own ``0002``;
where they already exist (a database migrated then) this revision adopts them as they are.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "reservations_0001"
down_revision: str | None = None
branch_labels: tuple[str, ...] | None = ("reservations",)
depends_on: tuple[str, ...] | None = None

TABLES = ("users", "seats", "show_occupancy")


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    if "users" not in existing:
        op.create_table(
            "users",
            sa.Column("user_id", sa.Text, nullable=False),
            sa.Column("username", sa.Text, nullable=False),
            sa.Column("display_name", sa.Text, nullable=False),
            sa.Column("version", sa.Integer, nullable=False, comment="version of the user's stream the row reflects"),
            sa.Column("commit_lsn", sa.BigInteger, nullable=False, comment="source commit LSN of that version"),
            sa.PrimaryKeyConstraint("user_id", name="users_pkey"),
            sa.UniqueConstraint("username", name="users_username_key"),
            comment="read view: registered users (projection users)",
        )
    if "seats" not in existing:
        op.create_table(
            "seats",
            sa.Column("show_id", sa.Text, nullable=False),
            sa.Column("seat", sa.Text, nullable=False),
            sa.Column("reservation_id", sa.Text, nullable=False),
            sa.Column("customer_id", sa.Text, nullable=False),
            sa.Column("version", sa.Integer, nullable=False, comment="version of the reservation's stream"),
            sa.Column("commit_lsn", sa.BigInteger, nullable=False, comment="source commit LSN of that version"),
            sa.PrimaryKeyConstraint("show_id", "seat", name="seats_pkey"),
            comment="read view: the active reservation holding each seat (projection seats)",
        )
    if "show_occupancy" not in existing:
        op.create_table(
            "show_occupancy",
            sa.Column("show_id", sa.Text, nullable=False),
            sa.Column("window_start", sa.DateTime(timezone=True), nullable=False, comment="hour of recorded_at (UTC)"),
            sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
            sa.Column(
                "reserved", sa.Integer, nullable=False, server_default=sa.text("0"), comment="SeatReserved events"
            ),
            sa.Column(
                "cancelled",
                sa.Integer,
                nullable=False,
                server_default=sa.text("0"),
                comment="ReservationCancelled events",
            ),
            sa.PrimaryKeyConstraint("show_id", "window_start", name="show_occupancy_pkey"),
            comment="read view: reservations and cancellations per show and hour (projection show_occupancy)",
        )


def downgrade() -> None:
    for table in reversed(TABLES):
        op.drop_table(table)
