"""write model: events (append-only), commands, claims, snapshots

Revision ID: tideline_0001 (0001 before Tideline 0.2: migrations.upgrade renames it in the version table)
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "tideline_0001"
down_revision: str | None = None
branch_labels: tuple[str, ...] | None = ("tideline",)  # an app's migrations are a branch of their own
depends_on: str | None = None

APPEND_ONLY_SQL = """
CREATE FUNCTION tideline_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events is append-only: % refused', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'events are never changed or removed: append a compensating event instead';
END
$$;
CREATE TRIGGER events_append_only_row BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION tideline_events_append_only();
CREATE TRIGGER events_append_only_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION tideline_events_append_only();
"""


def _recorded_at() -> sa.Column[Any]:
    return sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now())


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True, comment="global insertion order"),
        sa.Column("stream_id", sa.Text, nullable=False),
        sa.Column("stream_type", sa.Text, nullable=False, comment="aggregate type; topic events.<stream_type>"),
        sa.Column("version", sa.Integer, nullable=False, comment="1, 2, … per stream, dense"),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column(
            "metadata",
            JSONB,
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
            comment="command_id, command_type, correlation_id, causation_id",
        ),
        _recorded_at(),
        sa.UniqueConstraint("stream_id", "version", name="events_stream_id_version_key"),
        sa.CheckConstraint("version >= 1", name="events_version_check"),
        sa.CheckConstraint("schema_version >= 1", name="events_schema_version_check"),
        comment="append-only event streams of the write side",
    )
    op.execute(APPEND_ONLY_SQL)
    op.create_table(
        "commands",
        sa.Column("command_id", sa.Text, nullable=False),
        sa.Column("stream_id", sa.Text, nullable=False),
        sa.Column("command_type", sa.Text, nullable=False),
        sa.Column("result", JSONB, nullable=False),
        _recorded_at(),
        sa.PrimaryKeyConstraint("command_id", name="commands_pkey"),
        comment="accepted commands by id: a repeated command id returns the stored result",
    )
    op.create_table(
        "claims",
        sa.Column("claim_type", sa.Text, nullable=False),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("stream_id", sa.Text, nullable=False),
        sa.Column("command_id", sa.Text, nullable=False),
        _recorded_at(),
        sa.PrimaryKeyConstraint("claim_type", "value", name="claims_pkey"),
        comment="cross-aggregate uniqueness: (claim_type, value) is held by one stream",
    )
    op.create_table(
        "snapshots",
        sa.Column("stream_id", sa.Text, primary_key=True),
        sa.Column("stream_type", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False, comment="the stream version the state includes"),
        sa.Column("schema_version", sa.Integer, nullable=False, comment="AggregateType.state_version"),
        sa.Column("state", JSONB, nullable=False),
        _recorded_at(),
        comment="latest snapshot per stream; a cache: deleting rows loses nothing",
    )


def downgrade() -> None:
    op.drop_table("snapshots")
    op.drop_table("claims")
    op.drop_table("commands")
    op.execute("DROP TABLE events")  # drops its triggers; TRUNCATE/DELETE would be refused
    op.execute("DROP FUNCTION tideline_events_append_only()")
