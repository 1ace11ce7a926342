"""What a running connector reports: counters, lag, the slot's retained WAL, and its warnings.

One structured log line (``capture status {json}``) every ``status_interval_s``; the
slot's retained WAL is read every :data:`WAL_CHECK_S` and warned about above
``retained_wal_warn_bytes``. The same :class:`Stats` feed ``--json`` summaries and the
Prometheus collector (capture.metrics).

**The core** (:class:`CoreReport`, made by capture.native.core): which per-change core the connector
runs, per table, and the reason for every table on the Python path. It is in the start log
lines, the status line, ``--json`` summaries and the metrics, and the connector writes it to
``<state dir>/<prefix>.<slot>.core.json`` (:func:`write_core_report`) when it starts and when it
changes, where ``tideline capture status`` and the console read it (:func:`read_core_report`).

Thread-safety: ``Stats`` is written by the connector thread; readers (metrics scrapes)
read plain ints and may see a value one update old. A :class:`CoreReport`'s table map is
replaced, never changed in place, so a reader iterates a consistent one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg

from capture.slots import slot_status
from eventstore.topic import now_ms
from schemas.position import format_lsn

log = logging.getLogger("capture.connector")

WAL_CHECK_S = 30.0

NATIVE = "native"
PYTHON = "python"


@dataclass(frozen=True, slots=True)
class TableCore:
    """The core a table's changes take: ``native``, or ``python`` and why (``reason``)."""

    core: str
    reason: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {"core": self.core, "reason": self.reason}


class CoreReport:
    """Which per-change core the connector runs (see the module docstring).

    ``requested``: ``--core`` (auto, python, native). ``reason``: why every table takes the Python path
    (None: the native core runs); ``chosen``: that is what ``--core python`` asked for (not warned about).
    ``tables``: every captured table → its :class:`TableCore` (a table not covered takes the Python path while
    the others take the native core)."""

    def __init__(self, requested: str, reason: str | None = None, *, chosen: bool = False) -> None:
        self.requested = requested
        self.reason = reason
        self.chosen = chosen
        self.tables: dict[str, TableCore] = {}
        self.version = 0  # counts changes: the report file is written again
        # the Kafka sink's producer (capture.native.kafka.ProducerChoice.to_json(): kafka_producer, its reason
        # and what was asked); None with the embedded log
        self.producer: dict[str, Any] | None = None

    def set_table(self, table: str, core: TableCore) -> bool:
        """Record ``table``'s core; whether that changed anything."""
        if self.tables.get(table) == core:
            return False
        self.tables = {**self.tables, table: core}
        self.version += 1
        return True

    def drop_table(self, table: str) -> None:
        if table in self.tables:
            self.tables = {name: core for name, core in self.tables.items() if name != table}
            self.version += 1

    @property
    def core(self) -> str:
        """The connector's core: ``python`` when no table takes the native core."""
        if self.reason is not None:
            return PYTHON
        tables = self.tables
        return NATIVE if not tables or any(t.core == NATIVE for t in tables.values()) else PYTHON

    @property
    def core_reason(self) -> str | None:
        if self.reason is not None or self.core == NATIVE:
            return self.reason
        return "no captured table is covered by the native core (core_tables says why, per table)"

    def python_tables(self) -> dict[str, str]:
        """Tables on the Python path while the native core runs → their reasons."""
        if self.reason is not None:
            return {}
        return {name: t.reason or "" for name, t in self.tables.items() if t.core == PYTHON}

    def to_json(self, *, tables: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"core": self.core, "core_reason": self.core_reason, "core_requested": self.requested,
                               "core_chosen": self.chosen}  # fmt: skip
        if tables:
            out["core_tables"] = {name: t.to_json() for name, t in sorted(self.tables.items())}
        if self.producer is not None:
            out.update(self.producer)
        return out

    def summary(self) -> str:
        """For the start log line: ``native``, ``native (python for a, b)`` or ``python (reason)``."""
        if self.core == PYTHON:
            return f"python ({self.core_reason})"
        python = self.python_tables()
        core = f"native (python for {', '.join(sorted(python))})" if python else "native"
        if self.producer is not None:
            core += f", Kafka producer {self.producer['kafka_producer']}"
        return core


def core_warnings(report: dict[str, Any]) -> list[str]:
    """The warnings of a core report's JSON (:meth:`CoreReport.to_json`): the tables on the Python path that
    ``--core`` did not ask for — one line when every table is, for one reason (the extension not built …)."""
    producer = []
    if report.get("kafka_producer") == PYTHON and report.get("kafka_producer_requested") != PYTHON:
        producer = [f"capture writes to Kafka with the Python producer (a Python call per record): "
                    f"{report.get('kafka_producer_reason')}"]  # fmt: skip
    if report.get("core") is None or report.get("core_chosen"):
        return producer
    tables: dict[str, dict[str, str | None]] = report.get("core_tables") or {}
    python = {name: t["reason"] for name, t in tables.items() if t["core"] == PYTHON}
    reason = report.get("core_reason")
    if report["core"] == PYTHON and all(r == reason for r in python.values()):
        return [f"capture runs the Python core for every table: {reason}", *producer]
    return [f"table {name} takes the Python core: {r}" for name, r in sorted(python.items())] + producer


def write_core_report(path: Path, report: CoreReport) -> None:
    """Write ``report`` (with the time) to ``path`` atomically (``tideline capture status`` reads it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps({**report.to_json(), "reported_ms": now_ms()}, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)


def read_core_report(path: Path) -> dict[str, Any]:
    """What the connector last wrote to ``path``: ``core`` (None: nothing written there), ``core_reason``,
    ``core_requested``, ``core_tables``, ``core_reported_ms`` (when it was written)."""
    try:
        report: dict[str, Any] = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {"core": None, "core_reason": f"not reported: no connector of this slot and topic prefix has "
                f"started with its state in {path.parent}", "core_requested": None, "core_chosen": False,
                "core_tables": {}, "core_reported_ms": None}  # fmt: skip
    report["core_reported_ms"] = report.pop("reported_ms", None)
    return report


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
    schema_changes: int = 0  # schema change events written (--schema-changes, capture.schema_changes)
    retained_wal_bytes: int = -1  # the slot's, at the last check (WAL_CHECK_S); -1: not checked yet
    reconnects: int = 0  # transient failures recovered from
    key_state_caught_up: int = 0  # log records the key state read back at start (0: it was current)
    started: float = field(default_factory=time.monotonic)
    stored_lag_ms: int = 0  # when the last position was stored: that moment − its transaction's commit time
    keyless_tables: list[str] = field(default_factory=list)  # captured with null keys (updates/deletes invisible)
    skipped_tables: list[str] = field(default_factory=list)  # keyless, left out (--keyless-tables skip)
    unpublished_tables: list[str] = field(default_factory=list)  # pgoutput: captured by the filter, not published
    generated_columns_left_out: list[str] = field(default_factory=list)  # stored generated columns no image holds
    # partitions that left a captured root whose rows stayed in its topic (capture.partitions: Avro keys)
    partitions_not_followed: list[str] = field(default_factory=list)
    incremental: dict[str, Any] | None = None  # the incremental snapshot under way (capture.incremental)
    incremental_rereads: int = 0  # chunk reads taken again: a transaction the stream had passed was invisible
    core: CoreReport | None = None  # the per-change core, per table (set at start: capture.native.core.core_report)

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

    def to_json(self, *, core_tables: bool = True) -> dict[str, Any]:
        """Every figure; ``core_tables``: with the core of every table (the periodic status line leaves it out:
        the start log lines name the tables on the Python path)."""
        core = self.core.to_json(tables=core_tables) if self.core is not None else {"core": None}
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
            "schema_changes": self.schema_changes,
            "reconnects": self.reconnects,
            "key_state_caught_up": self.key_state_caught_up,
            "keyless_tables": self.keyless_tables,
            "skipped_tables": self.skipped_tables,
            "unpublished_tables": self.unpublished_tables,
            "generated_columns_left_out": self.generated_columns_left_out,
            "partitions_not_followed": self.partitions_not_followed,
            "incremental_snapshot": self.incremental,
            "incremental_rereads": self.incremental_rereads,
            **core,
        }


class StatusReporter:
    """The periodic status line and the slot's retained-WAL check."""

    def __init__(
        self,
        dsn: str,
        slot: str,
        stats: Stats,
        interval_s: float,
        retained_warn_bytes: int,
        core_path: Path | None = None,
    ) -> None:
        self.dsn = dsn
        self.slot = slot
        self.stats = stats
        self.interval_s = interval_s
        self.retained_warn_bytes = retained_warn_bytes
        self._logged = 0.0
        self._wal_checked = 0.0
        self.core_path = core_path  # where the core report is written when it changes (None: nowhere)
        self._core_written = -1 if stats.core is None else stats.core.version

    def tick(self) -> None:
        """Every ``interval_s``: a structured status line; every ``WAL_CHECK_S``: the slot's retained WAL."""
        now = time.monotonic()
        if now - self._logged < self.interval_s:
            return
        self._logged = now
        log.info("capture status %s", orjson.dumps(self.stats.to_json(core_tables=False)).decode())
        core = self.stats.core
        if core is not None and self.core_path is not None and core.version != self._core_written:
            try:
                write_core_report(self.core_path, core)
                self._core_written = core.version
            except OSError as e:  # a full or read-only state dir: capture goes on, status shows the last one
                log.warning("capture: cannot write the core report %s: %s", self.core_path, e)
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
