"""Attempt-aware task output: what a Spark task writes to Postgres becomes visible only if
Spark keeps that attempt.

Spark re-runs a failed task (``spark.task.maxFailures``) and, with speculation, runs a
second copy of a slow one on another host; the side effects of every attempt reach
Postgres, also those of an attempt that fails after committing, loses the race, or keeps
running after Spark gave up on it (a *zombie*: its executor was declared lost, or the kill
has not reached its Python worker yet) and commits at any later moment. So no task writes
where a reader, a swap or a merge looks:

**Staging table** ``<name>__<run>__staging`` (one per output of a rebuild: the view's rows,
and a fold's states under ``<name>__state__<run>__staging``; ``<name>`` is the view's name
cut to :data:`NAME_BYTES` bytes, ``<run>`` the run's token, 8 hex digits, random, never
reused while a table of it exists). ``CREATE UNLOGGED TABLE … (LIKE <table> INCLUDING
DEFAULTS)`` — the target's columns and NOT NULLs, no keys, no indexes — plus one column:

    task_attempt  bigint  not null   TaskContext.taskAttemptId() of the attempt that wrote the row

``taskAttemptId`` is unique for every attempt of every task of a SparkContext (retries,
speculative copies and re-run stages included), unlike ``attemptNumber``, which starts
again at 0 in a re-run stage. It starts again at 0 in the next SparkContext: hence one
table per *run*, so that a zombie of an earlier run (which knows only its own run's table)
can never write into a later run's — nor a second rebuild of the same view into the
first's. Only the driver creates and drops these tables; a task only COPYs into the one
it was given (and may commit as often as it likes).

**A task's result names its attempt**: ``(partition, task_attempt, count)``
(:class:`TaskOutput`). Spark hands the driver the result of exactly one attempt per
partition — the attempt it keeps — however many ran (:func:`winners`). Every read of a
staging table selects the rows of those attempts only (:func:`kept_rows`), in the
rebuild's one swap transaction: invariant, for every staged row r that reaches a view,
``r.task_attempt ∈ winners``. It holds whenever the other attempts commit — before the
swap, or during it (a delete-then-copy would let a commit between the two statements
through) — as no statement reads a staging table without that filter.

**Ownership**: a run holds the session advisory lock ``(STAGING_LOCK_CLASS, run)`` on a
connection of its own from before it creates its tables until after it dropped them
(:func:`staging_run`).

Crash policy: the run drops its staging tables when it ends, successfully or not (an
abandoned attempt still running then finds no table and fails alone; one in the middle of
a COPY makes the DROP wait for its transaction). A driver killed mid-rebuild loses its
connection and with it the lock; its tables stay until the next rebuild (of any view)
starts: it drops every staging table whose run's lock it can take (:func:`drop_abandoned`)
— a table whose lock is held belongs to a rebuild still running and is left alone. Nothing
but the run that created them reads them.

Fault injection (tests): the local property :data:`FAULT_PROPERTY`, set on the driver with
``sparkContext.setLocalProperty``, makes the *first* attempt of chosen partitions misbehave
right after it committed its output — the window in which a retry or a speculative copy
duplicates output: ``fail:0,2`` raises, ``straggle:30:1`` sleeps 30 s (speculation then
launches a copy elsewhere), ``hold:/tmp/x/token:0`` takes the file ``/tmp/x/token`` if it is
still there (renames it to ``token.held``: one attempt ever gets it, also across re-runs of
the stage, whose attempts start again at attempt number 0) and waits until ``token.held``
is removed — the test, on the same machine, kills the executor under it meanwhile. Unset,
it costs one property lookup per task.

Thread-safety: functions are; a :class:`StagingRun` belongs to one thread (the driver's).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from projections.store import STAGING_SUFFIX, Conn

ATTEMPT_COLUMN = "task_attempt"
FAULT_PROPERTY = "tideline.test.taskFault"
STAGING_LOCK_CLASS = 0x74646C73  # advisory lock namespace ("tdls"): key 2 is the run token
NAME_BYTES = 36  # of the view's name in a staging table's name (63-byte identifiers, "__state__<run>__staging")
RUN_PATTERN = re.compile(r"__([0-9a-f]{8})" + re.escape(STAGING_SUFFIX) + "$")

logger = logging.getLogger(__name__)


class InjectedTaskFault(RuntimeError):
    """Raised by a task attempt told to fail by :data:`FAULT_PROPERTY` (tests only)."""


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """What one task attempt wrote: its partition, its attempt id, and a count (rows or events)."""

    partition: int
    task_attempt: int
    count: int


@dataclass(slots=True)
class StagingRun:
    """The staging tables of one rebuild run, owned through ``owner`` (an autocommit
    connection holding the run's advisory lock) until :func:`staging_run` ends."""

    name: str  # the view
    token: int  # the run: 0 ≤ token < 2**31 (an int4 advisory lock key)
    owner: Conn
    tables: list[str] = field(default_factory=list)

    def table_name(self, part: str = "") -> str:
        base = self.name.encode()[:NAME_BYTES].decode(errors="ignore")
        return f"{base}{'__' + part if part else ''}__{self.token:08x}{STAGING_SUFFIX}"

    def create(self, like: str, part: str = "") -> str:
        """A fresh staging table for rows of ``like``; its name."""
        staging = create(self.owner, like, self.table_name(part))
        self.tables.append(staging)
        return staging


@contextmanager
def staging_run(dsn: str, name: str) -> Iterator[StagingRun]:
    """A run's staging tables (driver side): abandoned ones of earlier runs dropped first,
    this run's lock taken, and its tables dropped when the block ends, however it ends."""
    with psycopg.connect(dsn, autocommit=True) as owner:
        drop_abandoned(owner)
        token = secrets.randbelow(2**31)
        owner.execute("SELECT pg_advisory_lock(%s, %s)", (STAGING_LOCK_CLASS, token))
        run = StagingRun(name, token, owner)
        try:
            yield run
        finally:
            try:
                for table in run.tables:
                    owner.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
            except psycopg.Error as e:  # the lock goes with the connection: the next rebuild drops them
                logger.warning("staging tables %s not dropped (%s); the next rebuild drops them", run.tables, e)


def drop_abandoned(conn: Conn) -> list[str]:
    """Drop the staging tables of runs that no longer hold their lock (a killed driver's);
    the tables dropped. ``conn``: autocommit."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r' AND c.relnamespace = "
        "CAST(current_schema() AS regnamespace) AND c.relname LIKE %s",
        ("%" + STAGING_SUFFIX.replace("_", r"\_"),),
    ).fetchall()
    by_run: dict[int, list[str]] = {}
    for (relname,) in rows:
        match = RUN_PATTERN.search(relname)
        if match:
            by_run.setdefault(int(match.group(1), 16), []).append(relname)
    dropped: list[str] = []
    for token, tables in sorted(by_run.items()):
        got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (STAGING_LOCK_CLASS, token)).fetchone()
        if not (got and got[0]):
            continue  # a running rebuild's
        try:
            for table in tables:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
                dropped.append(table)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (STAGING_LOCK_CLASS, token))
    if dropped:
        logger.info("dropped staging tables of abandoned rebuilds: %s", ", ".join(dropped))
    return dropped


def create(conn: Conn, table: str, staging: str) -> str:
    """A fresh staging table ``staging`` for rows of ``table`` (driver side); its name."""
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(staging)))
    conn.execute(
        sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {} INCLUDING DEFAULTS, {} bigint NOT NULL)").format(
            sql.Identifier(staging), sql.Identifier(table), sql.Identifier(ATTEMPT_COLUMN)
        )
    )
    return staging


def current() -> tuple[int, int]:
    """``(partition, task_attempt)`` of the Spark task this executor code runs in."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise RuntimeError("attempt-aware output is written from a Spark task only")
    return context.partitionId(), context.taskAttemptId()


def tagged(rows: Iterable[Sequence[object]], task_attempt: int) -> Iterable[list[object]]:
    """Rows with the attempt id appended (the staging table's last column)."""
    return ([*row, task_attempt] for row in rows)


def winners(outputs: Iterable[TaskOutput]) -> list[int]:
    """The attempt ids Spark kept: one per partition (two for one partition is a bug: raise)."""
    seen: dict[int, int] = {}
    for out in outputs:
        if out.partition in seen:
            raise RuntimeError(
                f"Spark returned two attempts ({seen[out.partition]}, {out.task_attempt}) for partition {out.partition}"
            )
        seen[out.partition] = out.task_attempt
    return sorted(seen.values())


def kept_rows(staging: str, columns: Sequence[str]) -> sql.Composed:
    """``SELECT columns FROM staging`` of the kept attempts' rows only; one parameter: the
    attempt ids Spark kept (:func:`winners`). The only way a staging table is read."""
    return sql.SQL("SELECT {} FROM {} WHERE {} = ANY(%s)").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(staging), sql.Identifier(ATTEMPT_COLUMN)
    )


def discarded(conn: Conn, staging: str, kept: Sequence[int]) -> int:
    """The rows in ``staging`` of attempts Spark did not keep (reported, never read)."""
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE {} <> ALL(%s)").format(
            sql.Identifier(staging), sql.Identifier(ATTEMPT_COLUMN)
        ),
        (list(kept),),
    ).fetchone()
    return int(row[0]) if row else 0


def inject_fault() -> None:
    """Executor side, right after a task committed its output: misbehave if told to (tests)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    spec = context.getLocalProperty(FAULT_PROPERTY) if context is not None else None
    if context is None or not spec or context.attemptNumber() != 0:
        return
    kind, _, rest = spec.partition(":")
    if kind == "fail":
        if context.partitionId() in _partitions(rest):
            raise InjectedTaskFault(f"injected fault in partition {context.partitionId()}, first attempt")
    elif kind == "straggle":
        seconds, _, partitions = rest.partition(":")
        if context.partitionId() in _partitions(partitions):
            time.sleep(float(seconds))
    elif kind == "hold":
        token, _, partitions = rest.rpartition(":")
        if context.partitionId() in _partitions(partitions):
            _hold(Path(token))
    else:
        raise ValueError(
            f"{FAULT_PROPERTY} must be fail:PARTITIONS, straggle:SECONDS:PARTITIONS or hold:PATH:PARTITIONS, "
            f"not {spec!r}"
        )


def _hold(token: Path) -> None:
    held = token.with_name(token.name + ".held")
    try:
        token.rename(held)
    except FileNotFoundError:  # taken by an earlier attempt
        return
    deadline = time.monotonic() + 600  # a safety net only: the test removes the file
    while held.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _partitions(text: str) -> set[int]:
    return {int(p) for p in text.split(",") if p.strip()}
