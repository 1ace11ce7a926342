"""Attempt-aware task output: what a Spark task writes to Postgres becomes visible only if
Spark keeps that attempt.

Spark re-runs a failed task (``spark.task.maxFailures``) and, with speculation, runs a
second copy of a slow one on another host; the side effects of every attempt reach
Postgres, also those of an attempt that fails after committing or loses the race. So no
task writes where a reader, a swap or a merge looks:

**Staging table** ``<name>__staging`` (one per output of a rebuild: the view's rows, the
fold's states). ``CREATE UNLOGGED TABLE … (LIKE <table> INCLUDING DEFAULTS)`` — the
target's columns and NOT NULLs, no keys, no indexes — plus one column:

    task_attempt  bigint  not null   TaskContext.taskAttemptId() of the attempt that wrote the row

``taskAttemptId`` is unique for every attempt of every task of a SparkContext (retries,
speculative copies and re-run stages included), unlike ``attemptNumber``, which starts
again at 0 in a re-run stage. Only the driver creates and drops these tables; a task only
COPYs into one (and may commit as often as it likes).

**A task's result names its attempt**: ``(partition, task_attempt, count)``
(:class:`TaskOutput`). Spark hands the driver the result of exactly one attempt per
partition — the attempt it keeps — however many ran. The driver deletes every other
attempt's rows (:func:`keep_winners`) and only then merges the staging table into the view,
in the rebuild's one transaction, and drops it.

Crash policy: the rebuild drops its staging tables when it ends, successfully or not (an
abandoned attempt still running then finds no table and fails alone; one in the middle of
a COPY makes the DROP wait for its transaction). A driver killed mid-rebuild leaves them
until the next rebuild of the view, which drops and recreates them (names are per view).
Nothing but the rebuild that created them reads them.

Fault injection (tests): the local property :data:`FAULT_PROPERTY`, set on the driver with
``sparkContext.setLocalProperty``, makes the *first* attempt of chosen partitions misbehave
right after it committed its output — the window in which a retry or a speculative copy
duplicates output: ``fail:0,2`` raises, ``straggle:30:1`` sleeps 30 s (speculation then
launches a copy elsewhere). Unset, it costs one property lookup per task.

Thread-safety: functions only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from psycopg import sql

from projections.store import STAGING_SUFFIX, Conn

ATTEMPT_COLUMN = "task_attempt"
FAULT_PROPERTY = "tideline.test.taskFault"


class InjectedTaskFault(RuntimeError):
    """Raised by a task attempt told to fail by :data:`FAULT_PROPERTY` (tests only)."""


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """What one task attempt wrote: its partition, its attempt id, and a count (rows or events)."""

    partition: int
    task_attempt: int
    count: int


def staging_name(name: str) -> str:
    return f"{name}{STAGING_SUFFIX}"


def create(conn: Conn, table: str, name: str) -> str:
    """A fresh staging table ``<name>__staging`` for rows of ``table`` (driver side)."""
    staging = staging_name(name)
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


def keep_winners(conn: Conn, staging: str, attempts: Sequence[int]) -> int:
    """Delete the rows of every attempt but ``attempts`` from ``staging``; the rows deleted."""
    cur = conn.execute(
        sql.SQL("DELETE FROM {} WHERE NOT ({} = ANY(%s))").format(
            sql.Identifier(staging), sql.Identifier(ATTEMPT_COLUMN)
        ),
        (list(attempts),),
    )
    return cur.rowcount


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
    else:
        raise ValueError(f"{FAULT_PROPERTY} must be fail:PARTITIONS or straggle:SECONDS:PARTITIONS, not {spec!r}")


def _partitions(text: str) -> set[int]:
    return {int(p) for p in text.split(",") if p.strip()}
