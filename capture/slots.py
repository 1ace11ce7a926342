"""The replication slot as the server sees it: its state, dropping it, and the server's WAL position.

Plain SQL connections (not the replication connection): capture.replication creates
and streams slots, this module only looks at them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from schemas.position import parse_lsn


@dataclass(frozen=True, slots=True)
class SlotState:
    plugin: str
    confirmed_flush_lsn: str | None
    restart_lsn: str | None
    wal_status: str | None  # reserved | extended | unreserved | lost

    @property
    def lost(self) -> bool:
        """The server invalidated the slot (``max_slot_wal_keep_size``): the WAL it needed is gone."""
        return self.wal_status == "lost"

    @property
    def confirmed_flush(self) -> int | None:
        """``confirmed_flush_lsn`` as a number (None: the server reports none)."""
        return None if self.confirmed_flush_lsn is None else parse_lsn(self.confirmed_flush_lsn)


def slot_state(dsn: str, slot: str) -> SlotState | None:
    """The slot of this database named ``slot`` (None: there is none)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT plugin, confirmed_flush_lsn::text, restart_lsn::text, wal_status FROM pg_replication_slots "
            "WHERE slot_name = %s AND database = current_database()",
            (slot,),
        ).fetchone()
    return None if row is None else SlotState(row[0], row[1], row[2], row[3])


def drop_slot(dsn: str, slot: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


FAILOVER_SLOTS_SINCE = 170000  # server_version_num: CREATE_REPLICATION_SLOT … (FAILOVER), sync_replication_slots

# The server's WAL end: where it writes (a primary), or where its replay is (a standby, where capture may decode
# too: PostgreSQL 16+), as one expression for both.
WAL_END = "(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)"


def current_wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(f"SELECT {WAL_END}::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


def slot_status(dsn: str, slot: str) -> dict[str, Any] | None:
    """The slot as the server sees it, with retained WAL in bytes (``capture status``, metrics)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        failover = "failover" if c.info.server_version >= FAILOVER_SLOTS_SINCE else "NULL::bool"
        row = c.execute(
            "SELECT plugin, active, confirmed_flush_lsn::text, restart_lsn::text, wal_status, "
            f"{WAL_END}::text, pg_wal_lsn_diff({WAL_END}, restart_lsn)::bigint, "
            f"pg_wal_lsn_diff({WAL_END}, confirmed_flush_lsn)::bigint, {failover} "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    if row is None:
        return None
    return {
        "slot": slot,
        "plugin": row[0],
        "active": row[1],
        "confirmed_flush_lsn": row[2],
        "restart_lsn": row[3],
        "wal_status": row[4],
        "current_wal_lsn": row[5],
        "retained_wal_bytes": int(row[6] or 0),
        "unconfirmed_bytes": int(row[7] or 0),
        "failover": row[8],  # synchronized to standbys (PostgreSQL 17+); None: the server has no failover slots
    }
