"""Where each registered value schema version started: the capture position of its first event.

A captured table's value subject (``<topic>-value``) gets a new version when the table's shape
changes (capture.shapes, capture.avro): the first change of the new shape registers it, and that
change is where the version starts. The connector records it on the compacted topic
:data:`STARTS_TOPIC`, **in the same log transaction as that first event** (capture.writer), so
the record exists exactly when the event does: a crash before the commit loses both, and the
change, read again after the restart, records it again. ``tideline schemas list`` and ``show``
print it beside each version.

Record (topic :data:`STARTS_TOPIC`, 1 partition, compacted, kept forever):

* key: JSON ``{"subject": <str>, "version": <int>}`` (sorted keys, no spaces: equal keys are
  equal bytes, so compaction keeps one per version);
* value: JSON ``{"schema_id", "topic", "commit_lsn", "commit_lsn_text", "lsn", "lsn_text",
  "event_index", "snapshot"}``: the first event's source position (``commit_lsn`` and
  ``event_index`` as its ``source`` block has them; ``lsn``: the change's own, 0 for a snapshot
  read) and whether it was a snapshot read (``snapshot``: the version started with the table's
  snapshot, at the snapshot's position).

A version that has no record was registered by something else than a change written by the
connector (``tideline schemas check``, another tool), or before this record existed.

Thread-safety: functions and frozen values only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from schemas.position import format_lsn

STARTS_TOPIC = "__tideline_schema_starts"


@dataclass(frozen=True, slots=True)
class SchemaStart:
    """The first event written under a value schema version."""

    subject: str
    version: int
    schema_id: int
    topic: str
    commit_lsn: int
    event_index: int
    lsn: int
    snapshot: bool

    @property
    def key(self) -> bytes:
        return start_key(self.subject, self.version)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "schema_id": self.schema_id,
                "topic": self.topic,
                "commit_lsn": self.commit_lsn,
                "commit_lsn_text": format_lsn(self.commit_lsn),
                "lsn": self.lsn,
                "lsn_text": format_lsn(self.lsn),
                "event_index": self.event_index,
                "snapshot": self.snapshot,
            }
        )

    @classmethod
    def from_record(cls, key: bytes, value: bytes) -> SchemaStart:
        """A stored record; ValueError names what is wrong with it."""
        try:
            k: Any = orjson.loads(key)
            v: Any = orjson.loads(value)
            return cls(str(k["subject"]), int(k["version"]), int(v["schema_id"]), str(v["topic"]),
                       int(v["commit_lsn"]), int(v["event_index"]), int(v["lsn"]), bool(v["snapshot"]))  # fmt: skip
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a record of {STARTS_TOPIC} is not a schema start ({e}): key {key[:200]!r}") from None


def start_key(subject: str, version: int) -> bytes:
    return orjson.dumps({"subject": subject, "version": version}, option=orjson.OPT_SORT_KEYS)


def latest_starts(records: list[tuple[bytes | None, bytes | None]]) -> dict[tuple[str, int], SchemaStart]:
    """The starts the records of :data:`STARTS_TOPIC` hold, in offset order (the last value per key wins;
    a record that is not a start raises ValueError)."""
    out: dict[tuple[str, int], SchemaStart] = {}
    for key, value in records:
        if key is None or value is None:
            continue
        start = SchemaStart.from_record(key, value)
        out[(start.subject, start.version)] = start
    return out
