"""What a running connector reports: counters, lag, the slot's retained WAL, and its warnings.

One structured log line (``capture status {json}``) every ``status_interval_s``; the
slot's retained WAL is read every :data:`WAL_CHECK_S` and warned about above
``retained_wal_warn_bytes``. The same :class:`Stats` feed ``--json`` summaries and the
Prometheus collector (capture.metrics).

Thread-safety: ``Stats`` is written by the connector thread; readers (metrics scrapes)
read plain ints and may see a value one update old.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg

from capture.slots import slot_status
from eventstore.topic import now_ms
from schemas.position import format_lsn

log = logging.getLogger("capture.connector")

WAL_CHECK_S = 30.0


@dataclass(slots=True)
class Stats:
    events: int = 0
    transactions: int = 0
    batches: int = 0
    snapshot_rows: int = 0
    last_commit_ts_ms: int = 0
    last_stored_lsn: int = 0
    server_wal_end: int = 0
    outbox_violations: int = 0  # updates/deletes/truncates of outbox rows seen (and not routed)
    retained_wal_bytes: int = -1  # the slot's, at the last check (WAL_CHECK_S); -1: not checked yet
    reconnects: int = 0  # transient failures recovered from
    key_state_caught_up: int = 0  # log records the key state read back at start (0: it was current)
    started: float = field(default_factory=time.monotonic)
    stored_lag_ms: int = 0  # when the last position was stored: that moment − its transaction's commit time
    keyless_tables: list[str] = field(default_factory=list)  # captured with null keys (updates/deletes invisible)
    skipped_tables: list[str] = field(default_factory=list)  # keyless, left out (--keyless-tables skip)
    unpublished_tables: list[str] = field(default_factory=list)  # pgoutput: captured by the filter, not published
    incremental: dict[str, Any] | None = None  # the incremental snapshot under way (capture.incremental)
    incremental_rereads: int = 0  # chunk reads taken again: a transaction the stream had passed was invisible

    def batch_stored(self, commit_lsn: int | None) -> None:
        """A log transaction committed; ``commit_lsn``: its position's (None: it carried none)."""
        self.batches += 1
        if commit_lsn is not None:
            self.last_stored_lsn = commit_lsn
            if self.last_commit_ts_ms:
                self.stored_lag_ms = max(0, now_ms() - self.last_commit_ts_ms)

    def lag_ms(self) -> int:
        """Debezium's MilliSecondsBehindSource: how long after its commit the last stored change was stored."""
        return self.stored_lag_ms

    def lag_bytes(self) -> int:
        return max(0, self.server_wal_end - self.last_stored_lsn)

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "transactions": self.transactions,
            "batches": self.batches,
            "snapshot_rows": self.snapshot_rows,
            "events_per_s": round(self.events / max(1e-9, time.monotonic() - self.started), 1),
            "last_stored_lsn": format_lsn(self.last_stored_lsn),
            "lag_ms": self.lag_ms(),
            "lag_bytes": self.lag_bytes(),
            "outbox_violations": self.outbox_violations,
            "reconnects": self.reconnects,
            "key_state_caught_up": self.key_state_caught_up,
            "keyless_tables": self.keyless_tables,
            "skipped_tables": self.skipped_tables,
            "unpublished_tables": self.unpublished_tables,
            "incremental_snapshot": self.incremental,
            "incremental_rereads": self.incremental_rereads,
        }


class StatusReporter:
    """The periodic status line and the slot's retained-WAL check."""

    def __init__(self, dsn: str, slot: str, stats: Stats, interval_s: float, retained_warn_bytes: int) -> None:
        self.dsn = dsn
        self.slot = slot
        self.stats = stats
        self.interval_s = interval_s
        self.retained_warn_bytes = retained_warn_bytes
        self._logged = 0.0
        self._wal_checked = 0.0

    def tick(self) -> None:
        """Every ``interval_s``: a structured status line; every ``WAL_CHECK_S``: the slot's retained WAL."""
        now = time.monotonic()
        if now - self._logged < self.interval_s:
            return
        self._logged = now
        log.info("capture status %s", orjson.dumps(self.stats.to_json()).decode())
        if now - self._wal_checked < WAL_CHECK_S:
            return
        try:
            info = slot_status(self.dsn, self.slot)
        except psycopg.Error as e:
            self._wal_checked = now
            log.warning("capture: cannot read slot status: %s", e)
            return
        if info is None:
            return  # no slot yet (a snapshot is starting): look again at the next status line
        self._wal_checked = now
        self.stats.retained_wal_bytes = int(info["retained_wal_bytes"] or 0)
        warning = retained_wal_warning(self.slot, self.stats.retained_wal_bytes, self.retained_warn_bytes)
        if warning is not None:
            log.warning("capture: %s", warning)


def retained_wal_warning(slot: str, retained_bytes: int, threshold_bytes: int) -> str | None:
    """The warning for a slot holding back more WAL than ``threshold_bytes`` (None: within it); the
    running connector logs it, ``capture status`` and the console list it."""
    if retained_bytes <= threshold_bytes:
        return None
    return (
        f"slot {slot} retains {retained_bytes} bytes of WAL (threshold {threshold_bytes}): is the connector "
        "keeping up, or are captured tables idle while others are busy (use --heartbeat-query)?"
    )
