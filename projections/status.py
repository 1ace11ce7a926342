"""What ``tideline project status`` shows: per projection, its checkpoints, lag and last run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from eventstore.isolation import IsolationLevel, end_offset
from eventstore.log import Log
from projections.consistency import format_lsn


def projection_status(dsn: str, log_dir: Path) -> list[dict[str, Any]]:
    """One dict per projection with a run or a checkpoint: ``projection, mode, status, events,
    batches, reached_lsn, started_at, finished_at, error`` and ``partitions`` (``topic,
    partition, next_offset, log_end, lag, commit_lsn``); lag = log end (read_committed) − next offset."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        runs = {
            r[0]: r
            for r in conn.execute(
                "SELECT projection, mode, status, events, batches, reached_lsn, started_at, finished_at, error "
                "FROM projection_runs"
            )
        }
        checkpoints = conn.execute(
            "SELECT projection, topic, partition, next_offset, commit_lsn FROM projection_checkpoints "
            "ORDER BY projection, topic, partition"
        ).fetchall()
    ends: dict[tuple[str, int], int] = {}
    if log_dir.exists():
        with Log(log_dir, create=False) as log:
            topics = set(log.topics())
            for _, topic, partition, _, _ in checkpoints:
                if topic in topics and partition < log.topic(topic).partitions:
                    ends[(topic, partition)] = end_offset(
                        log.partition(topic, partition), IsolationLevel.READ_COMMITTED
                    )
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(set(runs) | {c[0] for c in checkpoints}):
        run = runs.get(name)
        out[name] = {
            "projection": name,
            "mode": run[1] if run else "",
            "status": run[2] if run else "",
            "events": int(run[3]) if run else 0,
            "batches": int(run[4]) if run else 0,
            "reached_lsn": format_lsn(int(run[5])) if run else format_lsn(0),
            "started_at": run[6].isoformat(timespec="seconds") if run else None,
            "finished_at": run[7].isoformat(timespec="seconds") if run and run[7] else None,
            "error": run[8] if run else None,
            "partitions": [],
        }
    for name, topic, partition, offset, lsn in checkpoints:
        end = ends.get((topic, partition))
        out[name]["partitions"].append(
            {
                "topic": topic,
                "partition": int(partition),
                "next_offset": int(offset),
                "log_end": end,
                "lag": None if end is None else max(0, end - int(offset)),
                "commit_lsn": format_lsn(int(lsn)),
            }
        )
    return list(out.values())
