"""The SQL of the write side: load a stream, append a decision, keep snapshots.

Every statement here runs on a psycopg connection in autocommit mode (the driver
connection of a SQLAlchemy pool: going through SQLAlchemy's execution layer cost about
0.1 ms per statement, a third of a command), and the round trips are counted because
they are the cost of a command:

- :func:`load_stream` — one statement: the latest usable snapshot, the events after it
  and the command record if the command id was seen before (one MVCC snapshot, so the
  three agree); or, for a state the handler has cached, only the events after its
  version and the command record.
- :func:`append` — one round trip without claims: a simple-protocol query string
  ``BEGIN; EXECUTE tideline_append(…); COMMIT; SELECT pg_current_wal_insert_lsn()``.
  ``tideline_append`` (prepared once per connection by :func:`prepare`) is a
  data-modifying CTE that inserts the command record and the events: the command row
  with ``ON CONFLICT (command_id) DO NOTHING`` and the events only if it was inserted,
  so a repeated command id appends nothing, also when two arrive at once (the second
  waits for the first to commit, then does nothing). A version conflict is the unique
  violation of ``(stream_id, version)``: the server stops the string there and the
  client sends ``ROLLBACK``. The ``COMMIT`` ends the transaction, so the position read
  after it (in the same string) is past the commit record (a position read inside the
  transaction would precede the commit, and a reader caught up to it might not yet have
  the events). With claims: ``BEGIN``, the append, the claims, then ``COMMIT; SELECT
  pg_current_wal_insert_lsn()``.
- :func:`wal_insert_lsn` — the position alone (a repeated command's reply).

The loads and the append are prepared statements (SQL ``PREPARE``, once per connection;
a connection that lost them, e.g. to ``DISCARD ALL``, prepares them again). The append's
parameters are quoted client-side by libpq (``PQescapeLiteral``), as a multi-statement
string must be; the statements run on libpq directly (see "the wire" below).

Claims are inserted in sorted order (two commands claiming the same values queue up
instead of deadlocking); a deadlock or serialization failure is treated like a version
conflict: the handler retries from a fresh load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import psycopg.errors
from psycopg import Connection, generators
from psycopg.pq import Escaping, ExecStatus, TransactionStatus
from psycopg.pq.abc import PGconn, PGresult
from psycopg.types.json import set_json_loads

from commands.aggregate import Claim
from commands.errors import DuplicateClaimError
from commands.events import EncodedEvent
from commands.schema import EVENTS_STREAM_VERSION_KEY

KIND_SNAPSHOT, KIND_EVENT, KIND_COMMAND = 0, 1, 2

T = TypeVar("T")

# Prepared once per connection by :func:`prepare` (SQL ``PREPARE``), run by name.
LOAD_NAME, LOAD_AFTER_NAME, APPEND_NAME = "tideline_load", "tideline_load_after", "tideline_append"

# $1 stream_id, $2 state_version, $3 use_snapshot, $4 command_id
PREPARE_LOAD_SQL = f"""
PREPARE {LOAD_NAME} (text, integer, boolean, text) AS
SELECT 0 AS kind, s.version, s.schema_version, NULL AS event_type, s.state AS data
  FROM snapshots s
 WHERE s.stream_id = $1 AND s.schema_version = $2 AND $3
UNION ALL
SELECT 1, e.version, e.schema_version, e.event_type, e.payload
  FROM events e
 WHERE e.stream_id = $1
   AND e.version > CASE WHEN $3 THEN COALESCE(
           (SELECT version FROM snapshots WHERE stream_id = $1 AND schema_version = $2), 0)
       ELSE 0 END
UNION ALL
SELECT 2, NULL, NULL, c.stream_id, c.result
  FROM commands c
 WHERE c.command_id = $4
ORDER BY 1, 2
"""

# $1 stream_id, $2 after_version, $3 command_id
PREPARE_LOAD_AFTER_SQL = f"""
PREPARE {LOAD_AFTER_NAME} (text, integer, text) AS
SELECT 1 AS kind, e.version, e.schema_version, e.event_type, e.payload AS data
  FROM events e
 WHERE e.stream_id = $1 AND e.version > $2
UNION ALL
SELECT 2, NULL, NULL, c.stream_id, c.result
  FROM commands c
 WHERE c.command_id = $3
ORDER BY 1, 2
"""

# $1 command_id, $2 stream_id, $3 command_type, $4 result, $5 stream_type, $6 metadata,
# $7 events: [{version, event_type, schema_version, payload}, …]
PREPARE_APPEND_SQL = f"""
PREPARE {APPEND_NAME} (text, text, text, jsonb, text, jsonb, jsonb) AS
WITH new_command AS (
    INSERT INTO commands (command_id, stream_id, command_type, result)
    VALUES ($1, $2, $3, $4)
    ON CONFLICT (command_id) DO NOTHING
    RETURNING command_id
), new_events AS (
    INSERT INTO events (stream_id, stream_type, version, event_type, schema_version, payload, metadata)
    SELECT $2, $5, e.version, e.event_type, e.schema_version, e.payload, $6
      FROM new_command,
           jsonb_to_recordset($7) AS e(version integer, event_type text, schema_version integer, payload jsonb)
     ORDER BY e.version
    RETURNING id
)
SELECT (SELECT count(*) FROM new_command) AS recorded, (SELECT count(*) FROM new_events) AS appended
"""

PREPARED = (PREPARE_LOAD_SQL, PREPARE_LOAD_AFTER_SQL, PREPARE_APPEND_SQL)

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
    after_version: int = 0  # the events follow this version (a state the caller holds; 0: the start)

    @property
    def version(self) -> int:
        if self.events:
            return self.events[-1].version
        return self.snapshot.version if self.snapshot is not None else self.after_version


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def prepare(conn: Connection[Any]) -> None:
    """Make ``conn`` parse jsonb with orjson and prepare the hot statements (once per connection)."""
    set_json_loads(orjson.loads, conn)
    for sql in PREPARED:
        with contextlib.suppress(psycopg.errors.DuplicatePreparedStatement):  # prepared before on this session
            conn.execute(sql)


def _prepared(conn: Connection[Any], run: Callable[[], T]) -> T:
    """``run()``, preparing the statements again if the session lost them (``DISCARD ALL``)."""
    try:
        return run()
    except psycopg.errors.InvalidSqlStatementName:
        prepare(conn)
        return run()


# -- the wire: the two statements of every command, on libpq directly ------------------------
#
# psycopg's cursor layer (adapting parameters, preparing, result sets) cost as much client
# CPU as everything else in a command, and commands are CPU-bound with a few writers per
# core. The hot statements therefore go through the connection's libpq object: parameters
# sent as text, results read as text (jsonb parsed with orjson), through psycopg's own
# generators and ``Connection.wait`` (the socket wait releases the GIL; Ctrl-C cancels the query). Errors are psycopg's
# exceptions (``error_from_result``): the same classes and diagnostics as anywhere else.


def _run(conn: Connection[Any], send: Callable[[PGconn], None]) -> list[PGresult]:
    pgconn = conn.pgconn
    send(pgconn)
    results: list[PGresult] = conn.wait(generators.execute(pgconn))
    for result in results:
        if result.status == ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    return results


def _text(value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    return str(value).encode()


def load_stream(
    conn: Connection[Any],
    stream_id: str,
    *,
    state_version: int,
    use_snapshot: bool,
    command_id: str | None = None,
    after_version: int | None = None,
) -> LoadedStream:
    """The stream's latest snapshot at ``state_version`` (if ``use_snapshot``), the events after it,
    and the record of ``command_id`` if there is one (None: nothing to look up).

    ``after_version``: the caller holds the state at that version (a cached one); only the
    events after it are read, no snapshot.
    """
    params: tuple[object, ...]
    if after_version is None:
        name, params = LOAD_NAME, (stream_id, state_version, use_snapshot, command_id)
    else:
        name, params = LOAD_AFTER_NAME, (stream_id, after_version, command_id)
    values = [_text(v) for v in params]

    def run() -> list[PGresult]:
        return _run(conn, lambda pgconn: pgconn.send_query_prepared(name.encode(), values))

    (result,) = _prepared(conn, run)
    snapshot: Snapshot | None = None
    recorded: RecordedCommand | None = None
    events: list[StoredEvent] = []
    get = result.get_value
    for i in range(result.ntuples):
        kind = int(get(i, 0) or b"")
        data = orjson.loads(get(i, 4) or b"null")
        if kind == KIND_EVENT:
            events.append(StoredEvent(int(get(i, 1) or b""), (get(i, 3) or b"").decode(), int(get(i, 2) or b""), data))
        elif kind == KIND_SNAPSHOT:
            snapshot = Snapshot(int(get(i, 1) or b""), int(get(i, 2) or b""), data)
        else:
            recorded = RecordedCommand((get(i, 3) or b"").decode(), data)
    return LoadedStream(snapshot, events, recorded, after_version or 0)


def recorded_command(conn: Connection[Any], command_id: str) -> RecordedCommand | None:
    row = conn.execute(RECORDED_SQL, {"command_id": command_id}).fetchone()
    return None if row is None else RecordedCommand(row[0], row[1])


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


def append(conn: Connection[Any], decision: Append) -> str | None:
    """Store ``decision`` atomically and commit; the WAL position right after the commit, or
    None if its command id was already recorded (nothing written).

    Raises VersionConflict (retry), ClaimReleased (retry) or DuplicateClaimError.
    """
    try:
        return _prepared(conn, lambda: _append(conn, decision))
    except psycopg.Error as e:
        if _is_version_conflict(e):
            raise VersionConflict(str(e)) from e
        raise


def _append(conn: Connection[Any], decision: Append) -> str | None:
    quote = Escaping(conn.pgconn).escape_literal
    args = b", ".join(quote(v.encode()) for v in _append_params(decision))
    execute = b"EXECUTE " + APPEND_NAME.encode() + b" (" + args + b")"
    lsn = LSN_SQL.encode()
    try:
        if not decision.acquire and not decision.release:
            results = _run(conn, lambda c: c.send_query(b"BEGIN; " + execute + b"; COMMIT; " + lsn))
            recorded = results[1].get_value(0, 0) != b"0"
        else:
            results = _run(conn, lambda c: c.send_query(b"BEGIN; " + execute))
            recorded = results[1].get_value(0, 0) != b"0"
            if recorded:
                _acquire(conn, decision)
                _release(conn, decision)
                results = _run(conn, lambda c: c.send_query(b"COMMIT; " + lsn))
            else:
                _run(conn, lambda c: c.send_query(b"ROLLBACK"))
    except BaseException:
        if not conn.closed and conn.pgconn.transaction_status != TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
        raise
    if not recorded:
        return None  # the command id was recorded before: nothing appended
    value = results[-1].get_value(0, 0)
    assert value is not None
    return value.decode()


def _is_version_conflict(error: BaseException | None) -> bool:
    if isinstance(error, psycopg.errors.UniqueViolation):
        return error.diag.constraint_name == EVENTS_STREAM_VERSION_KEY
    return isinstance(error, _RETRYABLE)


def _append_params(d: Append) -> tuple[str, ...]:
    rows = [
        {"version": d.expected_version + i, "event_type": e.event_type,
         "schema_version": e.schema_version, "payload": e.payload}
        for i, e in enumerate(d.events, start=1)
    ]  # fmt: skip
    return (d.command_id, d.stream_id, d.command_type, dumps(d.result), d.stream_type, dumps(d.metadata), dumps(rows))


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
