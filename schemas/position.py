"""The capture connector's stored position: the one definition of the record, for writers and readers.

The connector (capture/) appends this record to the compacted topic
:data:`POSITIONS_TOPIC` in the same atomic log transaction as the events it covers
(Kafka Connect's offsets topic, made transactional); projections/ read it for
read-your-writes. Both import it from here, the lowest layer, so that nobody parses the
record by hand.

Record (compacted topic ``__tideline_capture_offsets``, partition 0):

* key: JSON ``{"connector": <topic prefix>, "slot": <slot name>}`` (:func:`connector_key`)
* value: JSON ``{"version", "commit_lsn", "event_index", "complete", "confirm_lsn",
  "snapshot_done", "commit_lsn_text", "incremental", "run"}``; ``commit_lsn_text`` is for people
  reading the topic (``X/Y``) and ignored on read; ``incremental`` (absent when none runs)
  is the progress of an incremental snapshot, :class:`IncrementalProgress`; ``run`` (absent
  when unknown) names the connection of the connector that stored the record, whose start
  recorded the source's tables (capture.table_history). The Avro form of the same record
  is ``schemas/avsc/connector_position.avsc``.

Versions: ``version`` is :data:`POSITION_VERSION` (2). Version 1 records (written before
incremental snapshots existed) have no ``version`` and no ``incremental`` field and read as
positions with no incremental snapshot under way; a version above 2 (a newer Tideline) is
refused with an error naming both versions, never half-read.

Meaning: the log holds every event of every source transaction committed before
``commit_lsn``, and of the transaction committed at ``commit_lsn`` the events up to
``event_index`` (all of them when ``complete``). ``confirm_lsn`` is the end of the last
wholly stored transaction: what the replication slot may be confirmed up to, and the
LSN a reader may consider reached. ``snapshot_done`` is false while a snapshot is under
way (the record written before the slot is created says so).

An event is identified by ``(commit_lsn, event_index)`` (docs/capture.md, "Events"): LSN
alone is not unique.

Incremental snapshot progress (capture.incremental) rides in the same record, so it
commits atomically with the events it accounts for: ``{"id", "tables", "last_key",
"filters", "chunk_size", "paused", "rows", "table_rows", "table_estimate", "tables_done",
"started_ms"}``. ``tables`` are the tables still to read, the one being read first;
``last_key`` the key (each column's text form) of the last row of the last completed chunk
of that table (null: from its start); ``filters`` the ``WHERE`` conditions per table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

POSITIONS_TOPIC = "__tideline_capture_offsets"
POSITION_VERSION = 2  # 1: no "version" field, no incremental snapshots


def format_lsn(lsn: int) -> str:
    """0x16B374D848 → ``"16/B374D848"`` (Postgres's text form of a WAL position)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """``"16/B374D848"`` → 0x16B374D848; a malformed text raises ValueError naming it."""
    high, slash, low = text.partition("/")
    if not slash or not high or not low:
        raise ValueError(f"not an LSN: {text!r}")
    try:
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        raise ValueError(f"not an LSN: {text!r}") from None


def connector_key(topic_prefix: str, slot: str) -> bytes:
    """The position record's key for one connector (its topic prefix and slot)."""
    return orjson.dumps({"connector": topic_prefix, "slot": slot})


@dataclass(frozen=True, slots=True)
class IncrementalProgress:
    """Where an incremental snapshot stands (capture.incremental): stored with the position it belongs to."""

    id: str  # the snapshot's id (the signal's id)
    tables: tuple[str, ...]  # "schema.table" still to read, the one being read first
    last_key: tuple[str | None, ...] | None = None  # text of the key of the last row read from tables[0]
    filters: dict[str, str] = field(default_factory=dict)  # "schema.table" → SQL condition (additional-conditions)
    chunk_size: int = 1024
    paused: bool = False
    rows: int = 0  # rows emitted so far, every table
    table_rows: int = 0  # rows emitted from tables[0]
    table_estimate: int = 0  # rows tables[0] held when its reading began (pg_class.reltuples, or a count)
    tables_done: int = 0
    started_ms: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tables": list(self.tables),
            "last_key": None if self.last_key is None else list(self.last_key),
            "filters": self.filters,
            "chunk_size": self.chunk_size,
            "paused": self.paused,
            "rows": self.rows,
            "table_rows": self.table_rows,
            "table_estimate": self.table_estimate,
            "tables_done": self.tables_done,
            "started_ms": self.started_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IncrementalProgress:
        """Parse the stored form; raises KeyError/TypeError/ValueError on a malformed one."""
        last_key = d.get("last_key")
        filters = d.get("filters") or {}
        if not isinstance(filters, dict):
            raise TypeError(f"incremental filters must be an object, not {filters!r}")
        return cls(
            str(d["id"]),
            tuple(str(t) for t in d["tables"]),
            None if last_key is None else tuple(None if v is None else str(v) for v in last_key),
            {str(k): str(v) for k, v in filters.items()},
            int(d.get("chunk_size", 1024)),
            bool(d.get("paused", False)),
            int(d.get("rows", 0)),
            int(d.get("table_rows", 0)),
            int(d.get("table_estimate", 0)),
            int(d.get("tables_done", 0)),
            int(d.get("started_ms", 0)),
        )

    @property
    def percent(self) -> float:
        """Rough share done: finished tables, plus the current table's rows against its estimate."""
        total = self.tables_done + len(self.tables)
        if total == 0:
            return 100.0
        current = min(0.99, self.table_rows / self.table_estimate) if self.table_estimate > 0 else 0.0
        return round(100.0 * (self.tables_done + (current if self.tables else 0.0)) / total, 1)


@dataclass(frozen=True, slots=True)
class SourcePosition:
    """How far the log is, in source terms: up to ``event_index`` of the transaction committed at ``commit_lsn``."""

    commit_lsn: int
    event_index: int
    complete: bool  # the whole transaction is stored
    confirm_lsn: int  # the last commit end whose transaction is wholly stored (what the slot may confirm)
    snapshot_done: bool = True  # false while a snapshot is under way
    incremental: IncrementalProgress | None = None  # an incremental snapshot under way (capture.incremental)
    run: str | None = None  # the connector's connection that stored it (capture.table_history); None: unknown

    def to_json(self) -> bytes:
        record: dict[str, Any] = {
            "version": POSITION_VERSION,
            "commit_lsn": self.commit_lsn,
            "event_index": self.event_index,
            "complete": self.complete,
            "confirm_lsn": self.confirm_lsn,
            "snapshot_done": self.snapshot_done,
            "commit_lsn_text": format_lsn(self.commit_lsn),
        }
        if self.incremental is not None:
            record["incremental"] = self.incremental.to_dict()
        if self.run is not None:
            record["run"] = self.run
        return orjson.dumps(record)

    @classmethod
    def from_json(cls, raw: bytes) -> SourcePosition:
        """Parse a stored record; a record that is not one raises ValueError naming what is wrong."""
        try:
            d = orjson.loads(raw)
            version = int(d.get("version", 1))
            incremental = d.get("incremental")
            run = d.get("run")
            position = cls(
                int(d["commit_lsn"]),
                int(d["event_index"]),
                bool(d["complete"]),
                int(d["confirm_lsn"]),
                bool(d.get("snapshot_done", True)),
                None if incremental is None else IncrementalProgress.from_dict(incremental),
                None if run is None else str(run),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a connector position record ({e}): {raw[:200]!r}") from None
        if version > POSITION_VERSION:
            raise ValueError(
                f"connector position record version {version} is newer than this Tideline reads "
                f"({POSITION_VERSION}): upgrade Tideline to read it"
            )
        return position

    def covers(self, commit_lsn: int, index: int) -> bool:
        """Whether the event ``(commit_lsn, index)`` is already stored."""
        if commit_lsn != self.commit_lsn:
            return commit_lsn < self.commit_lsn
        return self.complete or index <= self.event_index
