"""The read side's tables as SQLAlchemy Core metadata: read views and projection bookkeeping.

Like :mod:`commands.schema`, this is the *current* shape; ``migrations/versions/0002``
creates it with explicit DDL, and a test checks after upgrading that the database equals
this metadata (both metadata objects together). ``migrations`` imports this module,
never the reverse.

Read views (the reservations example's, kept here because every table Tideline runs
on is created by the one migration chain):

- ``users``: one row per registered user (fold of ``events.user``);
- ``seats``: the current holder of each seat, one row per *active* reservation
  (fold of ``events.reservation``);
- ``show_occupancy``: seats reserved and cancelled per show and hour of event time
  (``recorded_at``), hourly tumbling windows;
- ``cdc_mirror``: the latest row per key of any CDC topic (one table, a column
  ``projection`` tells mirrors apart).

Bookkeeping:

- ``projection_state``: per fold projection and stream, the state folded so far and
  the stream version it includes (how ``follow`` continues a fold);
- ``projection_checkpoints``: per projection and source partition, the next offset to
  apply; written in the same transaction as the view rows it accounts for;
- ``projection_runs``: the last run of each projection (mode, start/end, events, the
  source LSN the view has reached — see :mod:`projections.consistency`).

Constraint and index names follow Postgres's defaults (``<table>_pkey``,
``<table>_<column>_key``) on purpose: a rebuild builds a shadow table with
``LIKE … INCLUDING ALL`` and renames the shadow's names to these after the swap.

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
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

users = Table(
    "users",
    metadata,
    Column("user_id", Text, nullable=False),
    Column("username", Text, nullable=False),
    Column("display_name", Text, nullable=False),
    Column("version", Integer, nullable=False, comment="version of the user's stream the row reflects"),
    Column("commit_lsn", BigInteger, nullable=False, comment="source commit LSN of that version"),
    PrimaryKeyConstraint("user_id", name="users_pkey"),
    UniqueConstraint("username", name="users_username_key"),
    comment="read view: registered users (projection users)",
)

seats = Table(
    "seats",
    metadata,
    Column("show_id", Text, nullable=False),
    Column("seat", Text, nullable=False),
    Column("reservation_id", Text, nullable=False),
    Column("customer_id", Text, nullable=False),
    Column("version", Integer, nullable=False, comment="version of the reservation's stream"),
    Column("commit_lsn", BigInteger, nullable=False, comment="source commit LSN of that version"),
    PrimaryKeyConstraint("show_id", "seat", name="seats_pkey"),
    comment="read view: the active reservation holding each seat (projection seats)",
)

show_occupancy = Table(
    "show_occupancy",
    metadata,
    Column("show_id", Text, nullable=False),
    Column("window_start", DateTime(timezone=True), nullable=False, comment="hour of recorded_at (UTC)"),
    Column("window_end", DateTime(timezone=True), nullable=False),
    Column("reserved", Integer, nullable=False, server_default=text("0"), comment="SeatReserved events"),
    Column("cancelled", Integer, nullable=False, server_default=text("0"), comment="ReservationCancelled events"),
    PrimaryKeyConstraint("show_id", "window_start", name="show_occupancy_pkey"),
    comment="read view: reservations and cancellations per show and hour (projection show_occupancy)",
)

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

VIEW_TABLES = (users, seats, show_occupancy, cdc_mirror)
BOOKKEEPING_TABLES = (projection_state, projection_checkpoints, projection_runs)
