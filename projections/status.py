"""What ``tideline project status`` shows: per projection, its checkpoints, lag, health and last run.

**Stalled** (Marten's high-water health check): a projection whose lag stayed above zero,
with no progress, for longer than ``stall_after`` seconds — its oldest unapplied record
(the record at a lagging partition's checkpoint) was appended more than ``stall_after``
ago *and* no batch has been committed since then (the checkpoints' ``updated_at``).
A job that keeps committing batches is behind, not stalled; a view nobody follows while
events arrive is stalled once they wait longer than that.
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from projections.consistency import format_lsn
from projections.sources import LogSource, as_source

DEFAULT_STALL_AFTER_S = 60.0


def projection_status(
    dsn: str, log: Path | LogSource, *, stall_after: float = DEFAULT_STALL_AFTER_S, now: datetime | None = None
) -> list[dict[str, Any]]:
    """One dict per projection with a run or a checkpoint: ``projection, mode, status, events,
    batches, reached_lsn, started_at, finished_at, error, lag, last_progress_at, waiting_since,
    stalled`` and ``partitions`` (``topic, partition, next_offset, log_end, lag, commit_lsn``);
    lag = log end (read_committed: the embedded log's, or Kafka's last stable offset) − next
    offset; ``waiting_since``: when the oldest record not yet applied was appended (None:
    nothing waits); ``log``: the embedded log's directory or a source (Kafka); ``now``: the
    time to judge by (default: now)."""
    now = now or datetime.now(UTC)
    with psycopg.connect(dsn, autocommit=True) as conn:
        runs = {
            r[0]: r
            for r in conn.execute(
                "SELECT projection, mode, status, events, batches, reached_lsn, started_at, finished_at, error "
                "FROM projection_runs"
            )
        }
        checkpoints = conn.execute(
            "SELECT projection, topic, partition, next_offset, commit_lsn, updated_at FROM projection_checkpoints "
            "ORDER BY projection, topic, partition"
        ).fetchall()
    ends: dict[tuple[str, int], int] = {}
    waiting: dict[tuple[str, str, int], datetime] = {}
    with as_source(log) if isinstance(log, Path) else nullcontext(log) as source:
        if source.exists():
            stable = source.stable_offsets(sorted({c[1] for c in checkpoints}))
            ends = {(t, p): o for t, per in stable.items() for p, o in per.items()}
            for name, topic, partition, offset, _, _ in checkpoints:
                end = ends.get((topic, partition))
                if end is not None and end > offset:
                    since = source.appended_at(topic, partition, int(offset))
                    if since is not None:
                        waiting[(name, topic, partition)] = since
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
    progress: dict[str, datetime] = {}
    for name, topic, partition, offset, lsn, updated_at in checkpoints:
        log_end = ends.get((topic, partition))
        progress[name] = max(updated_at, progress.get(name, updated_at))
        out[name]["partitions"].append(
            {
                "topic": topic,
                "partition": int(partition),
                "next_offset": int(offset),
                "log_end": log_end,
                "lag": None if log_end is None else max(0, log_end - int(offset)),
                "commit_lsn": format_lsn(int(lsn)),
            }
        )
    for name, row in out.items():
        _health(row, progress.get(name), [t for (n, _, _), t in waiting.items() if n == name], stall_after, now)
    return list(out.values())


def _health(
    row: dict[str, Any], progress: datetime | None, waiting: list[datetime], stall_after: float, now: datetime
) -> None:
    lags = [p["lag"] for p in row["partitions"] if p["lag"] is not None]
    row["lag"] = sum(lags) if lags else None
    row["last_progress_at"] = progress.isoformat(timespec="milliseconds") if progress else None
    since = min(waiting) if waiting else None
    row["waiting_since"] = since.isoformat(timespec="milliseconds") if since else None
    limit = now - timedelta(seconds=stall_after)
    row["stalled"] = bool(row["lag"]) and since is not None and since < limit and (progress is None or progress < limit)
