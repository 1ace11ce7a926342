"""the CDC mirror view (cdc_mirror) and projection bookkeeping

Revision ID: tideline_0002 (0002 before Tideline 0.2)
Revises: tideline_0001
Create Date: 2025-01-02

Before Tideline 0.2 this revision also created the reservations example's tables (users, seats,
show_occupancy); a database migrated then keeps them, and the example's own first revision adopts them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "tideline_0002"
down_revision: str | None = "tideline_0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
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
    ):
        op.drop_table(table)
