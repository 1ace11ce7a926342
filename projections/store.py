"""The Postgres side of projections: checkpoints, runs, shadow tables, and applying changes.

Everything a view's output and its source offsets need to be written *together* goes
through one psycopg connection in one transaction, whose boundaries the caller owns
(``with conn.transaction():``). Functions here never commit.

Offsets: ``{topic: {partition: next offset}}`` (:data:`Offsets`), the same shape as the
tideline source's streaming offsets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

Offsets = dict[str, dict[int, int]]
Conn = psycopg.Connection[Any]

SHADOW_SUFFIX = "__shadow"
REACHED_CHANNEL = "tideline_reached"  # NOTIFY channel: a projection's reached LSN rose (payload: its name)
STAGING_SUFFIX = "__staging"


# -- checkpoints and runs -------------------------------------------------------------------


def read_checkpoints(conn: Conn, projection: str, *, lock: bool = False) -> dict[tuple[str, int], tuple[int, int]]:
    """``(topic, partition) → (next_offset, commit_lsn)``; ``lock``: hold the rows (and the
    projection's run row) until the transaction ends, so two writers of one view serialize."""
    if lock:
        conn.execute("SELECT 1 FROM projection_runs WHERE projection = %s FOR UPDATE", (projection,))
    query = "SELECT topic, partition, next_offset, commit_lsn FROM projection_checkpoints WHERE projection = %s"
    if lock:
        query += " FOR UPDATE"
    return {(t, int(p)): (int(o), int(lsn)) for t, p, o, lsn in conn.execute(query, (projection,))}


def offsets_of(checkpoints: Mapping[tuple[str, int], tuple[int, int]]) -> Offsets:
    out: Offsets = {}
    for (topic, partition), (offset, _) in checkpoints.items():
        out.setdefault(topic, {})[partition] = offset
    return out


def write_checkpoints(
    conn: Conn, projection: str, ends: Offsets, lsns: Mapping[tuple[str, int], int], *, replace: bool = False
) -> None:
    """Store ``ends`` as the next offsets (never moving one back unless ``replace``: a rebuild)."""
    if replace:
        conn.execute("DELETE FROM projection_checkpoints WHERE projection = %s", (projection,))
    rows = [(projection, t, p, o, lsns.get((t, p), 0)) for t, per in ends.items() for p, o in per.items()]
    if not rows:
        return
    with conn.cursor() as cur:
        cur.executemany(
            """
            INSERT INTO projection_checkpoints AS c (projection, topic, partition, next_offset, commit_lsn)
            VALUES (%s, %s, %s, %s, %s)
            ON CONFLICT (projection, topic, partition) DO UPDATE
               SET next_offset = GREATEST(c.next_offset, EXCLUDED.next_offset),
                   commit_lsn = GREATEST(c.commit_lsn, EXCLUDED.commit_lsn), updated_at = now()
            """,
            rows,
        )


def start_run(conn: Conn, projection: str, mode: str) -> None:
    """Record that a run started (the reached LSN of earlier runs is kept)."""
    conn.execute(
        """
        INSERT INTO projection_runs AS r (projection, mode, status) VALUES (%s, %s, 'running')
        ON CONFLICT (projection) DO UPDATE
           SET mode = EXCLUDED.mode, status = 'running', started_at = now(), finished_at = NULL,
               events = 0, batches = 0, error = NULL, updated_at = now()
        """,
        (projection, mode),
    )


def add_progress(conn: Conn, projection: str, events: int, batches: int = 1) -> None:
    conn.execute(
        "UPDATE projection_runs SET events = events + %s, batches = batches + %s, updated_at = now() "
        "WHERE projection = %s",
        (events, batches, projection),
    )


def finish_run(conn: Conn, projection: str, status: str, error: str | None = None) -> None:
    conn.execute(
        "UPDATE projection_runs SET status = %s, error = %s, finished_at = now(), updated_at = now() "
        "WHERE projection = %s",
        (status, error, projection),
    )


def advance_reached(conn: Conn, projection: str, lsn: int) -> None:
    """Raise the projection's reached LSN to ``lsn`` (never lowers it); when it rose, notify
    :data:`REACHED_CHANNEL` (payload: the projection) — delivered when the transaction commits,
    so a waiter (:func:`projections.consistency.wait_for`) wakes as the view changes."""
    conn.execute(
        "WITH raised AS (UPDATE projection_runs SET reached_lsn = %s, updated_at = now() "
        "WHERE projection = %s AND reached_lsn < %s RETURNING projection) "
        "SELECT pg_notify(%s, projection) FROM raised",
        (lsn, projection, lsn, REACHED_CHANNEL),
    )


def reached_lsn(conn: Conn, projection: str) -> int:
    row = conn.execute("SELECT reached_lsn FROM projection_runs WHERE projection = %s", (projection,)).fetchone()
    return int(row[0]) if row else 0


# -- shadow tables ----------------------------------------------------------------------------


def create_shadow(conn: Conn, table: str) -> str:
    """An empty copy of ``table`` (columns, defaults, constraints, indexes, comments) to build into."""
    shadow = table + SHADOW_SUFFIX
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(shadow)))
    conn.execute(
        sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(sql.Identifier(shadow), sql.Identifier(table))
    )
    row = conn.execute("SELECT obj_description(CAST(%s AS regclass), 'pg_class')", (table,)).fetchone()
    if row and row[0] is not None:  # LIKE copies column comments, not the table's
        conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(sql.Identifier(shadow), sql.Literal(row[0])))
    return shadow


def drop_table(conn: Conn, name: str) -> None:
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def swap_in(conn: Conn, table: str, shadow: str) -> None:
    """Replace ``table`` by ``shadow`` (in the caller's transaction): drop the old table, rename
    the shadow, then give its constraints and indexes the canonical names (``<table>_pkey`` …)."""
    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(table)))
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(sql.Identifier(shadow), sql.Identifier(table)))
    constraints = conn.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = CAST(%s AS regclass) AND conname LIKE %s",
        (table, shadow + "%"),
    ).fetchall()
    for (name,) in constraints:  # renaming a constraint renames its index
        canonical = table + name[len(shadow) :]
        conn.execute(
            sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                sql.Identifier(table), sql.Identifier(name), sql.Identifier(canonical)
            )
        )
    indexes = conn.execute(
        "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexname LIKE %s", (table, shadow + "%")
    ).fetchall()
    for (name,) in indexes:
        canonical = table + name[len(shadow) :]
        conn.execute(sql.SQL("ALTER INDEX {} RENAME TO {}").format(sql.Identifier(name), sql.Identifier(canonical)))


# -- bulk load ------------------------------------------------------------------------------


def copy_rows(conn: Conn, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> int:
    """COPY Python rows into ``table`` (dicts and lists become jsonb); the number written."""
    n = 0
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table), sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    )
    with conn.cursor() as cur, cur.copy(statement) as copy:
        for row in rows:
            copy.write_row([Jsonb(v) if isinstance(v, dict | list) else v for v in row])
            n += 1
    return n
