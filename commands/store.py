"""The SQL of the write side: load a stream, append a decision, keep snapshots.

Every statement here runs on a psycopg connection in autocommit mode (the driver
connection of a SQLAlchemy pool: going through SQLAlchemy's execution layer cost about
0.1 ms per statement, a third of a command), and the round trips are counted because
they are the cost of a command:

- :func:`load_stream` — one statement: the latest usable snapshot, the events after it
  and the command record if the command id was seen before (one MVCC snapshot, so the
  three agree).
- :func:`append` — one statement (a data-modifying CTE) inserts the command record and
  the events: the command row with ``ON CONFLICT (command_id) DO NOTHING`` and the
  events only if it was inserted, so a repeated command id appends nothing, also when
  two arrive at once (the second waits for the first to commit, then does nothing). A
  version conflict is the unique violation of ``(stream_id, version)``: the whole
  statement is rolled back. Without claims the statement is its own transaction; with
  claims, ``BEGIN`` … claims … ``COMMIT`` wraps it.
- :func:`wal_insert_lsn` — one statement *after* the commit, so the position it returns
  is past the commit record (a position read inside the transaction would precede the
  commit, and a reader caught up to it might not yet have the events).

Claims are inserted in sorted order (two commands claiming the same values queue up
instead of deadlocking); a deadlock or serialization failure is treated like a version
conflict: the handler retries from a fresh load.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg.errors
from psycopg import Connection
from psycopg.types.json import set_json_loads

from commands.aggregate import Claim
from commands.errors import DuplicateClaimError
from commands.events import EncodedEvent
from commands.schema import EVENTS_STREAM_VERSION_KEY

KIND_SNAPSHOT, KIND_EVENT, KIND_COMMAND = 0, 1, 2

LOAD_SQL = """
SELECT 0 AS kind, s.version, s.schema_version, NULL AS event_type, s.state AS data
  FROM snapshots s
 WHERE s.stream_id = %(stream_id)s AND s.schema_version = %(state_version)s AND %(use_snapshot)s
UNION ALL
SELECT 1, e.version, e.schema_version, e.event_type, e.payload
  FROM events e
 WHERE e.stream_id = %(stream_id)s
   AND e.version > CASE WHEN %(use_snapshot)s THEN COALESCE(
           (SELECT version FROM snapshots WHERE stream_id = %(stream_id)s AND schema_version = %(state_version)s), 0)
       ELSE 0 END
UNION ALL
SELECT 2, NULL, NULL, c.stream_id, c.result
  FROM commands c
 WHERE c.command_id = %(command_id)s
ORDER BY 1, 2
"""

APPEND_SQL = """
WITH new_command AS (
    INSERT INTO commands (command_id, stream_id, command_type, result)
    VALUES (%(command_id)s, %(stream_id)s, %(command_type)s, CAST(%(result)s AS jsonb))
    ON CONFLICT (command_id) DO NOTHING
    RETURNING command_id
), new_events AS (
    INSERT INTO events (stream_id, stream_type, version, event_type, schema_version, payload, metadata)
    SELECT %(stream_id)s, %(stream_type)s, e.version, e.event_type, e.schema_version, e.payload,
           CAST(%(metadata)s AS jsonb)
      FROM new_command,
           jsonb_to_recordset(CAST(%(events)s AS jsonb))
               AS e(version integer, event_type text, schema_version integer, payload jsonb)
     ORDER BY e.version
    RETURNING id
)
SELECT (SELECT count(*) FROM new_command) AS recorded, (SELECT count(*) FROM new_events) AS appended
"""

ACQUIRE_SQL = """
INSERT INTO claims (claim_type, value, stream_id, command_id)
SELECT c.claim_type, c.value, %(stream_id)s, %(command_id)s
  FROM unnest(CAST(%(claim_types)s AS text[]), CAST(%(claim_values)s AS text[]))
       WITH ORDINALITY AS c(claim_type, value, n)
 ORDER BY c.n
ON CONFLICT (claim_type, value) DO NOTHING
RETURNING claim_type, value
"""

HOLDER_SQL = "SELECT stream_id FROM claims WHERE claim_type = %(claim_type)s AND value = %(value)s"

RELEASE_SQL = """
DELETE FROM claims
 WHERE stream_id = %(stream_id)s
   AND (claim_type, value) IN (SELECT * FROM unnest(CAST(%(claim_types)s AS text[]), CAST(%(claim_values)s AS text[])))
"""

RECORDED_SQL = "SELECT stream_id, result FROM commands WHERE command_id = %(command_id)s"

LSN_SQL = "SELECT CAST(pg_current_wal_insert_lsn() AS text)"

SNAPSHOT_SQL = """
INSERT INTO snapshots (stream_id, stream_type, version, schema_version, state)
VALUES (%(stream_id)s, %(stream_type)s, %(version)s, %(schema_version)s, CAST(%(state)s AS jsonb))
ON CONFLICT (stream_id) DO UPDATE
   SET stream_type = EXCLUDED.stream_type, version = EXCLUDED.version,
       schema_version = EXCLUDED.schema_version, state = EXCLUDED.state, recorded_at = now()
 WHERE snapshots.version < EXCLUDED.version OR snapshots.schema_version <> EXCLUDED.schema_version
"""

_RETRYABLE = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


class VersionConflict(Exception):
    """Another writer appended to the stream first (or a deadlock/serialization failure): retry."""


class ClaimReleased(Exception):
    """A claim we could not insert had no holder by the time we looked: retry."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One row of ``events`` as loaded for a fold (payload not yet upcast)."""

    version: int
    event_type: str
    schema_version: int
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    schema_version: int
    state: Any  # JSON form of the aggregate state


@dataclass(frozen=True, slots=True)
class RecordedCommand:
    stream_id: str
    result: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LoadedStream:
    """What :func:`load_stream` found: fold ``snapshot`` (or the initial state) with ``events``."""

    snapshot: Snapshot | None
    events: list[StoredEvent]
    recorded: RecordedCommand | None  # the command id's stored record, if seen before

    @property
    def version(self) -> int:
        if self.events:
            return self.events[-1].version
        return self.snapshot.version if self.snapshot is not None else 0


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def prepare(conn: Connection[Any]) -> None:
    """Make ``conn`` parse jsonb with orjson (once per connection)."""
    set_json_loads(orjson.loads, conn)


def load_stream(
    conn: Connection[Any], stream_id: str, *, state_version: int, use_snapshot: bool, command_id: str = ""
) -> LoadedStream:
    """The stream's latest snapshot at ``state_version`` (if ``use_snapshot``), the events after it,
    and the record of ``command_id`` if there is one."""
    params = {
        "stream_id": stream_id,
        "state_version": state_version,
        "use_snapshot": use_snapshot,
        "command_id": command_id,
    }
    snapshot: Snapshot | None = None
    recorded: RecordedCommand | None = None
    events: list[StoredEvent] = []
    for kind, version, schema_version, event_type, data in conn.execute(LOAD_SQL, params).fetchall():
        if kind == KIND_EVENT:
            events.append(StoredEvent(version, event_type, schema_version, data))
        elif kind == KIND_SNAPSHOT:
            snapshot = Snapshot(version, schema_version, data)
        else:
            recorded = RecordedCommand(event_type, data)
    return LoadedStream(snapshot, events, recorded)


def recorded_command(conn: Connection[Any], command_id: str) -> RecordedCommand | None:
    row = conn.execute(RECORDED_SQL, {"command_id": command_id}).fetchone()
    return None if row is None else RecordedCommand(row[0], row[1])


@contextmanager
def transaction(conn: Connection[Any]) -> Iterator[None]:
    """An explicit server-side transaction on an autocommit connection (rolled back on any error)."""
    conn.execute("BEGIN")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@dataclass(frozen=True, slots=True)
class Append:
    """One command's decision, ready to store."""

    command_id: str
    command_type: str
    stream_id: str
    stream_type: str
    expected_version: int  # the version the decision was made on
    events: Sequence[EncodedEvent]
    metadata: dict[str, Any]
    result: dict[str, Any]  # stored in commands.result, returned for a repeated command id
    acquire: Sequence[Claim] = ()
    release: Sequence[Claim] = ()


def append(conn: Connection[Any], decision: Append) -> bool:
    """Store ``decision`` atomically; False if its command id was already recorded (nothing written).

    Raises VersionConflict (retry), ClaimReleased (retry) or DuplicateClaimError.
    """
    try:
        if not decision.acquire and not decision.release:
            return _append_events(conn, decision)
        with transaction(conn):
            if not _append_events(conn, decision):
                return False
            _acquire(conn, decision)
            _release(conn, decision)
            return True
    except psycopg.Error as e:
        if _is_version_conflict(e):
            raise VersionConflict(str(e)) from e
        raise


def _is_version_conflict(error: BaseException | None) -> bool:
    if isinstance(error, psycopg.errors.UniqueViolation):
        return error.diag.constraint_name == EVENTS_STREAM_VERSION_KEY
    return isinstance(error, _RETRYABLE)


def _append_events(conn: Connection[Any], d: Append) -> bool:
    rows = [
        {"version": d.expected_version + i, "event_type": e.event_type,
         "schema_version": e.schema_version, "payload": e.payload}
        for i, e in enumerate(d.events, start=1)
    ]  # fmt: skip
    params = {
        "command_id": d.command_id,
        "stream_id": d.stream_id,
        "command_type": d.command_type,
        "result": dumps(d.result),
        "stream_type": d.stream_type,
        "metadata": dumps(d.metadata),
        "events": dumps(rows),
    }
    row = conn.execute(APPEND_SQL, params).fetchone()
    assert row is not None
    return bool(row[0])


def _acquire(conn: Connection[Any], d: Append) -> None:
    if not d.acquire:
        return
    params = {
        "stream_id": d.stream_id,
        "command_id": d.command_id,
        "claim_types": [c.claim_type for c in d.acquire],
        "claim_values": [c.value for c in d.acquire],
    }
    inserted = {Claim(t, v) for t, v in conn.execute(ACQUIRE_SQL, params).fetchall()}
    for claim in d.acquire:
        if claim in inserted:
            continue
        row = conn.execute(HOLDER_SQL, {"claim_type": claim.claim_type, "value": claim.value}).fetchone()
        holder = None if row is None else row[0]
        if holder is None:
            raise ClaimReleased(f"{claim.claim_type} {claim.value!r} was released while we claimed it")
        if holder != d.stream_id:
            raise DuplicateClaimError(claim.claim_type, claim.value, holder)


def _release(conn: Connection[Any], d: Append) -> None:
    if not d.release:
        return
    conn.execute(
        RELEASE_SQL,
        {
            "stream_id": d.stream_id,
            "claim_types": [c.claim_type for c in d.release],
            "claim_values": [c.value for c in d.release],
        },
    )


def wal_insert_lsn(conn: Connection[Any]) -> str:
    """The server's current WAL insert position, e.g. ``0/16B3748``."""
    row = conn.execute(LSN_SQL).fetchone()
    assert row is not None and isinstance(row[0], str)
    return row[0]


def save_snapshot(
    conn: Connection[Any], *, stream_id: str, stream_type: str, version: int, schema_version: int, state: Any
) -> None:
    """Keep ``state`` (JSON form) as the stream's snapshot unless a newer one is stored."""
    conn.execute(
        SNAPSHOT_SQL,
        {
            "stream_id": stream_id,
            "stream_type": stream_type,
            "version": version,
            "schema_version": schema_version,
            "state": dumps(state),
        },
    )
