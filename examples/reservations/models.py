"""The reservations example's view tables (SQLAlchemy Core): its own, created by its own migrations branch
(``examples/reservations/migrations``, branch ``reservations``), never by Tideline's.

- ``users``: one row per registered user (fold of ``events.user``);
- ``seats``: the current holder of each seat, one row per *active* reservation (fold of
  ``events.reservation``);
- ``show_occupancy``: seats reserved and cancelled per show and hour of event time (``recorded_at``),
  hourly tumbling windows.

``version`` and ``commit_lsn`` columns are the example's choice (the row's stream version and the source
commit LSN it reflects), not something Tideline requires of a view.
"""

from __future__ import annotations

from pathlib import Path

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
    text,
)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"  # the example's migrations location
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


def upgrade(dsn: str) -> None:
    """Migrate ``dsn``: Tideline's branch and the example's (what ``tideline db upgrade --migrations
    examples.reservations.migrations`` does)."""
    import migrations

    migrations.upgrade(dsn, apps=(MIGRATIONS,))
