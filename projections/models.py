"""Tideline's read-side tables as SQLAlchemy Core metadata: the CDC mirror view and projection bookkeeping.

Like :mod:`commands.schema`, this is the *current* shape; the ``tideline`` migrations branch
(``migrations/versions/tideline_0002``) creates it with explicit DDL, and a test checks after upgrading that the
database equals this metadata (both metadata objects together). ``migrations`` imports this module, never the
reverse. An application's own view tables live in the application (its metadata, its migrations branch: see
docs/your-app.md); the reservations example's are in ``examples/reservations/models.py``.

View:

- ``cdc_mirror``: the latest row per key of any CDC topic (one table, a column
  ``projection`` tells mirrors apart).

Bookkeeping:

- ``projection_state``: per fold projection and stream, the state folded so far and
  the stream version it includes (how ``follow`` continues a fold);
- ``projection_checkpoints``: per projection and source partition, the next offset to
  apply; written in the same transaction as the view rows it accounts for;
- ``projection_runs``: the last run of each projection (mode, start/end, events, the
  source LSN the view has reached — see :mod:`projections.consistency`).

Constraint names follow Postgres's defaults (``<table>_pkey``); a rebuild keeps whatever names a view's
table has.

LSNs are stored as ``bigint`` (the 64-bit WAL position; ``0/16B3D40`` is
``0x016B3D40``).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

cdc_mirror = Table(
    "cdc_mirror",
    metadata,
    Column("projection", Text, nullable=False),
    Column("key", JSONB, nullable=False, comment="the change event's key"),
    Column("row", JSONB, nullable=False, comment="the latest after image"),
    Column("commit_lsn", BigInteger, nullable=False),
    Column("event_index", Integer, nullable=False),
    PrimaryKeyConstraint("projection", "key", name="cdc_mirror_pkey"),
    comment="read views: latest row per key of CDC topics (one mirror per projection)",
)

projection_state = Table(
    "projection_state",
    metadata,
    Column("projection", Text, nullable=False),
    Column("stream_id", Text, nullable=False),
    Column("version", Integer, nullable=False, comment="the stream version the state includes"),
    Column("commit_lsn", BigInteger, nullable=False, comment="source commit LSN of that version"),
    Column("state", JSONB, nullable=False),
    PrimaryKeyConstraint("projection", "stream_id", name="projection_state_pkey"),
    comment="fold projections: the state of each stream so far",
)

projection_checkpoints = Table(
    "projection_checkpoints",
    metadata,
    Column("projection", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("next_offset", BigInteger, nullable=False, comment="the first offset not yet applied"),
    Column("commit_lsn", BigInteger, nullable=False, server_default=text("0"), comment="max source commit LSN applied"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("projection", "topic", "partition", name="projection_checkpoints_pkey"),
    comment="source offsets applied, written with the view rows they produced",
)

projection_runs = Table(
    "projection_runs",
    metadata,
    Column("projection", Text, nullable=False),
    Column("mode", Text, nullable=False, comment="rebuild | follow"),
    Column("status", Text, nullable=False, comment="running | done | failed"),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True)),
    Column("events", BigInteger, nullable=False, server_default=text("0"), comment="records applied by the run"),
    Column("batches", BigInteger, nullable=False, server_default=text("0")),
    Column("reached_lsn", BigInteger, nullable=False, server_default=text("0"), comment="read-your-writes position"),
    Column("error", Text),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("projection", name="projection_runs_pkey"),
    comment="the last run of each projection and the source position its view has reached",
)

VIEW_TABLES = (cdc_mirror,)
BOOKKEEPING_TABLES = (projection_state, projection_checkpoints, projection_runs)
