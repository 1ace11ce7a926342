"""Where a connector stands, seen from outside it: what ``tideline capture status`` and the console show.

One function, :func:`capture_status`, computes every figure of that report (the slot as
the server sees it, the connector's stored position, the lag in bytes, the publications,
the tables needing attention, the warnings); the command line prints it and the
operations console (:mod:`tideline.console`) serves it, so the two cannot disagree.

The core (capture.status.CoreReport): what the connector wrote to its state directory when it last
started or its tables' cores changed: the core it runs, per table, with the reason for every table
on the Python path (``core``: None when no connector has written one there).

Lag: the server's current WAL position − the stored position's ``confirm_lsn`` (the end
of the last wholly stored source transaction), in bytes; absent when there is no slot or
no stored position. Nothing here writes anything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from capture.config import RETAINED_WAL_WARN_BYTES, CaptureConfig, CoreChoice, KeylessPolicy, PublicationMode
from capture.connector import Connector
from capture.publications import Publications
from capture.slots import slot_status
from capture.status import core_warnings, read_core_report, retained_wal_warning
from capture.tables import KEYLESS_WARNING, TableCatalog, TableFilter
from schemas.position import parse_lsn

if TYPE_CHECKING:
    from capture.sinks import Sink
    from eventstore.log import Log
    from schemas.position import SourcePosition


def capture_status(
    dsn: str,
    *,
    slot: str,
    topic_prefix: str,
    log: Log | None,
    sink: Sink | None,
    table_filter: TableFilter | None = None,
    keyless: KeylessPolicy = KeylessPolicy.KEYLESS,
    publication: str | None = None,
    retained_wal_warn_bytes: int | None = None,
    state_dir: Path | None = None,
) -> dict[str, Any]:
    """The connector ``(topic_prefix, slot)`` of database ``dsn``, its position read from ``log``
    (the embedded log) or ``sink`` (Kafka): ``slot`` (None: missing), ``stored_position``
    (None: none stored), ``incremental_snapshot`` (its progress; None: none running),
    ``keyless_tables``, ``skipped_tables``, ``publications`` (pgoutput),
    ``warnings`` and, when both a slot and a position exist, ``lag_bytes``. The slot's retained
    WAL is warned about above ``retained_wal_warn_bytes`` (None: the connector's threshold). ``core``,
    ``core_reason``, ``core_tables`` …: the connector's core report in ``state_dir`` (None: the sink's default,
    as for the connector)."""
    threshold = RETAINED_WAL_WARN_BYTES if retained_wal_warn_bytes is None else retained_wal_warn_bytes
    info = slot_status(dsn, slot)
    publications: list[dict[str, Any]] = []
    if publication is not None or (info is not None and info["plugin"] == "pgoutput"):
        described = Publications(dsn, publication or slot, PublicationMode.FILTERED).describe()
        publications = [p for p in described if p["exists"] or not p["name"].endswith("_keyless")]
    catalog = TableCatalog(dsn, table_filter or TableFilter(), keyless)
    catalog.load()
    config = CaptureConfig(dsn=dsn, slot=slot, topic_prefix=topic_prefix, state_dir=state_dir,
                           core=CoreChoice.PYTHON)  # it only reads: whatever TIDELINE_CAPTURE_CORE says  # fmt: skip
    connector = Connector(config, log, sink=sink)
    position = connector.read_position()
    core = read_core_report(connector.core_report_path())
    warnings = [f"table {name} {KEYLESS_WARNING}" for name in catalog.keyless]
    warnings += [f"table {name} has no primary key and no replica identity: not captured" for name in catalog.skipped]
    if info is not None:
        retained = retained_wal_warning(slot, int(info["retained_wal_bytes"]), threshold)
        if retained is not None:
            warnings.append(retained)
        if info["wal_status"] == "lost":
            warnings.append(f"slot {slot} lost WAL it needed: restart capture with --snapshot when_needed")
    warnings += core_warnings(core)
    out: dict[str, Any] = {
        "slot": info,
        "stored_position": None if position is None else orjson.loads(position.to_json()),
        "keyless_tables": catalog.keyless,
        "skipped_tables": catalog.skipped,
        "publications": publications,
        "warnings": warnings,
        "incremental_snapshot": None if position is None else incremental_status(position),
        **core,
    }
    if info is not None and position is not None:
        out["lag_bytes"] = max(0, parse_lsn(info["current_wal_lsn"]) - position.confirm_lsn)
    return out


def incremental_status(position: SourcePosition) -> dict[str, Any] | None:
    """The stored incremental snapshot's progress: rows, percent, and its rate since it started (pauses included)."""
    p = position.incremental
    if p is None:
        return None
    elapsed = max(0.001, time.time() - p.started_ms / 1000)
    return {
        "id": p.id,
        "table": p.tables[0] if p.tables else None,
        "tables_left": len(p.tables),
        "tables_done": p.tables_done,
        "rows": p.rows,
        "percent": p.percent,
        "rows_per_s": round(p.rows / elapsed, 1),
        "paused": p.paused,
        "last_key": p.last_key,
        "filters": p.filters,
    }
