"""read views (users, seats, show_occupancy, cdc_mirror) and projection bookkeeping

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
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
    op.create_table(
        "show_occupancy",
        sa.Column("show_id", sa.Text, nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False, comment="hour of recorded_at (UTC)"),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reserved", sa.Integer, nullable=False, server_default=sa.text("0"), comment="SeatReserved events"),
        sa.Column(
            "cancelled", sa.Integer, nullable=False, server_default=sa.text("0"), comment="ReservationCancelled events"
        ),
        sa.PrimaryKeyConstraint("show_id", "window_start", name="show_occupancy_pkey"),
        comment="read view: reservations and cancellations per show and hour (projection show_occupancy)",
    )
    op.create_table(
        "cdc_mirror",
        sa.Column("projection", sa.Text, nullable=False),
        sa.Column("key", JSONB, nullable=False, comment="the change event's key"),
        sa.Column("row", JSONB, nullable=False, comment="the latest after image"),
        sa.Column("commit_lsn", sa.BigInteger, nullable=False),
        sa.Column("event_index", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("projection", "key", name="cdc_mirror_pkey"),
        comment="read views: latest row per key of CDC topics (one mirror per projection)",
    )
    op.create_table(
        "projection_state",
        sa.Column("projection", sa.Text, nullable=False),
        sa.Column("stream_id", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False, comment="the stream version the state includes"),
        sa.Column("commit_lsn", sa.BigInteger, nullable=False, comment="source commit LSN of that version"),
        sa.Column("state", JSONB, nullable=False),
        sa.PrimaryKeyConstraint("projection", "stream_id", name="projection_state_pkey"),
        comment="fold projections: the state of each stream so far",
    )
    op.create_table(
        "projection_checkpoints",
        sa.Column("projection", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("next_offset", sa.BigInteger, nullable=False, comment="the first offset not yet applied"),
        sa.Column(
            "commit_lsn",
            sa.BigInteger,
            nullable=False,
            server_default=sa.text("0"),
            comment="max source commit LSN applied",
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("projection", "topic", "partition", name="projection_checkpoints_pkey"),
        comment="source offsets applied, written with the view rows they produced",
    )
    op.create_table(
        "projection_runs",
        sa.Column("projection", sa.Text, nullable=False),
        sa.Column("mode", sa.Text, nullable=False, comment="rebuild | follow"),
        sa.Column("status", sa.Text, nullable=False, comment="running | done | failed"),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column(
            "events", sa.BigInteger, nullable=False, server_default=sa.text("0"), comment="records applied by the run"
        ),
        sa.Column("batches", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column(
            "reached_lsn",
            sa.BigInteger,
            nullable=False,
            server_default=sa.text("0"),
            comment="read-your-writes position",
        ),
        sa.Column("error", sa.Text),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("projection", name="projection_runs_pkey"),
        comment="the last run of each projection and the source position its view has reached",
    )


def downgrade() -> None:
    for table in (
        "projection_runs",
        "projection_checkpoints",
        "projection_state",
        "cdc_mirror",
        "show_occupancy",
        "seats",
        "users",
    ):
        op.drop_table(table)
