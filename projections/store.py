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
    the shadow, then give its constraints and indexes the names the old table's had.

    ``LIKE … INCLUDING ALL`` names the shadow's indexes (and the constraints they back) after the
    shadow (``<table>__shadow_pkey``), so a user's naming convention (``pk_accounts``,
    ``uq_accounts_handle``, ``ix_accounts_owner``) would be lost: the live table's names are read
    from the catalog before it is dropped, and each of the shadow's constraints and indexes takes
    the name of the old one with the same definition (``pg_get_constraintdef``; an index's
    ``pg_get_indexdef`` without its name). Where no old one matches (the table's declaration
    changed meanwhile), a name derived from the shadow's takes the table's name instead
    (``<table>__shadow_pkey`` → ``<table>_pkey``)."""
    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(table)))
    old_constraints, old_indexes = _named_parts(conn, table)
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(sql.Identifier(shadow), sql.Identifier(table)))
    new_constraints, new_indexes = _named_parts(conn, table)
    for current, wanted in _renames(new_constraints, old_constraints, table, shadow):
        # renaming a constraint renames its index
        conn.execute(
            sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                sql.Identifier(table), sql.Identifier(current), sql.Identifier(wanted)
            )
        )
    for current, wanted in _renames(new_indexes, old_indexes, table, shadow):
        conn.execute(sql.SQL("ALTER INDEX {} RENAME TO {}").format(sql.Identifier(current), sql.Identifier(wanted)))


Named = list[tuple[str, str]]  # (definition, name), sorted


def _named_parts(conn: Conn, table: str) -> tuple[Named, Named]:
    """``table``'s constraints (NOT NULLs are not constraints here) and its indexes that back no
    constraint, each as ``(definition, name)``: a definition names neither the object nor the
    table's other objects, so a table's and its ``LIKE`` copy's agree."""
    constraints = conn.execute(
        "SELECT CAST(contype AS text) || ' ' || pg_get_constraintdef(oid), conname FROM pg_constraint "
        "WHERE conrelid = CAST(%s AS regclass)",
        (table,),
    ).fetchall()
    indexes = conn.execute(
        "SELECT replace(pg_get_indexdef(i.indexrelid), ' INDEX ' || quote_ident(c.relname) || ' ON ', ' INDEX ON '), "
        "c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indrelid = CAST(%s AS regclass) "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid AND k.conrelid = i.indrelid)",
        (table,),
    ).fetchall()
    return sorted((str(d), str(n)) for d, n in constraints), sorted((str(d), str(n)) for d, n in indexes)


def _renames(new: Named, old: Named, table: str, shadow: str) -> list[tuple[str, str]]:
    """``(current name, wanted name)`` for each of ``new`` whose name is not yet the one wanted:
    the old name of the same definition (the n-th of equal definitions takes the n-th old name);
    without one, a shadow-derived name with the table's name instead."""
    olds: dict[str, list[str]] = {}
    for definition, name in old:
        olds.setdefault(definition, []).append(name)
    out: list[tuple[str, str]] = []
    for definition, name in new:
        same = olds.get(definition)
        if same:
            wanted = same.pop(0)
        elif name.startswith(shadow):
            wanted = table + name[len(shadow) :]
        else:
            continue
        if wanted != name:
            out.append((name, wanted))
    return out


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
