"""The write model's tables as SQLAlchemy Core metadata.

This is the *current* shape of the tables; the migrations in ``migrations/versions``
create and change them (``tideline db upgrade``), and a test checks after upgrading
that the database matches this metadata exactly. ``migrations`` imports this module,
never the reverse (``commands`` sits below ``migrations`` and ``tideline``).

``events`` is append-only: a trigger installed by the first migration refuses UPDATE,
DELETE and TRUNCATE. Its global ``id`` orders rows by insertion, *not* by commit:
consumers order by WAL commit position (capture), never by ``id``.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

# Named so that the handler can tell a version conflict from any other violation.
EVENTS_STREAM_VERSION_KEY = "events_stream_id_version_key"
COMMANDS_PKEY = "commands_pkey"
CLAIMS_PKEY = "claims_pkey"
APPEND_ONLY_FUNCTION = "tideline_events_append_only"

events = Table(
    "events",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True, comment="global insertion order"),
    Column("stream_id", Text, nullable=False),
    Column("stream_type", Text, nullable=False, comment="aggregate type; topic events.<stream_type>"),
    Column("version", Integer, nullable=False, comment="1, 2, … per stream, dense"),
    Column("event_type", Text, nullable=False),
    Column("schema_version", Integer, nullable=False, server_default=text("1")),
    Column("payload", JSONB, nullable=False),
    Column(
        "metadata",
        JSONB,
        nullable=False,
        server_default=text("'{}'::jsonb"),
        comment="command_id, command_type, correlation_id, causation_id",
    ),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("stream_id", "version", name=EVENTS_STREAM_VERSION_KEY),
    CheckConstraint("version >= 1", name="events_version_check"),
    CheckConstraint("schema_version >= 1", name="events_schema_version_check"),
    comment="append-only event streams of the write side",
)

commands = Table(
    "commands",
    metadata,
    Column("command_id", Text, nullable=False),
    Column("stream_id", Text, nullable=False),
    Column("command_type", Text, nullable=False),
    Column("result", JSONB, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("command_id", name=COMMANDS_PKEY),
    comment="accepted commands by id: a repeated command id returns the stored result",
)

claims = Table(
    "claims",
    metadata,
    Column("claim_type", Text, nullable=False),
    Column("value", Text, nullable=False),
    Column("stream_id", Text, nullable=False),
    Column("command_id", Text, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("claim_type", "value", name=CLAIMS_PKEY),
    comment="cross-aggregate uniqueness: (claim_type, value) is held by one stream",
)

snapshots = Table(
    "snapshots",
    metadata,
    Column("stream_id", Text, primary_key=True),
    Column("stream_type", Text, nullable=False),
    Column("version", Integer, nullable=False, comment="the stream version the state includes"),
    Column("schema_version", Integer, nullable=False, comment="AggregateType.state_version"),
    Column("state", JSONB, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    comment="latest snapshot per stream; a cache: deleting rows loses nothing",
)
