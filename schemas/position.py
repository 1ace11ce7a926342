"""The capture connector's stored position: the one definition of the record, for writers and readers.

The connector (capture/) appends this record to the compacted topic
:data:`POSITIONS_TOPIC` in the same atomic log transaction as the events it covers
(Kafka Connect's offsets topic, made transactional); projections/ read it for
read-your-writes. Both import it from here, the lowest layer, so that nobody parses the
record by hand.

Record (compacted topic ``__tideline_capture_offsets``, partition 0):

* key: JSON ``{"connector": <topic prefix>, "slot": <slot name>}`` (:func:`connector_key`)
* value: JSON ``{"commit_lsn", "event_index", "complete", "confirm_lsn", "snapshot_done",
  "commit_lsn_text"}``; ``commit_lsn_text`` is for people reading the topic (``X/Y``) and
  ignored on read. The Avro form of the same record is ``schemas/avsc/connector_position.avsc``.

Meaning: the log holds every event of every source transaction committed before
``commit_lsn``, and of the transaction committed at ``commit_lsn`` the events up to
``event_index`` (all of them when ``complete``). ``confirm_lsn`` is the end of the last
wholly stored transaction: what the replication slot may be confirmed up to, and the
LSN a reader may consider reached. ``snapshot_done`` is false while a snapshot is under
way (the record written before the slot is created says so).

An event is identified by ``(commit_lsn, event_index)`` (DESIGN.md §2): LSN alone is
not unique.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

POSITIONS_TOPIC = "__tideline_capture_offsets"


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
class SourcePosition:
    """How far the log is, in source terms: up to ``event_index`` of the transaction committed at ``commit_lsn``."""

    commit_lsn: int
    event_index: int
    complete: bool  # the whole transaction is stored
    confirm_lsn: int  # the last commit end whose transaction is wholly stored (what the slot may confirm)
    snapshot_done: bool = True  # false while a snapshot is under way

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "commit_lsn": self.commit_lsn,
                "event_index": self.event_index,
                "complete": self.complete,
                "confirm_lsn": self.confirm_lsn,
                "snapshot_done": self.snapshot_done,
                "commit_lsn_text": format_lsn(self.commit_lsn),
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> SourcePosition:
        """Parse a stored record; a record that is not one raises ValueError naming what is wrong."""
        try:
            d = orjson.loads(raw)
            return cls(
                int(d["commit_lsn"]),
                int(d["event_index"]),
                bool(d["complete"]),
                int(d["confirm_lsn"]),
                bool(d.get("snapshot_done", True)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a connector position record ({e}): {raw[:200]!r}") from None

    def covers(self, commit_lsn: int, index: int) -> bool:
        """Whether the event ``(commit_lsn, index)`` is already stored."""
        if commit_lsn != self.commit_lsn:
            return commit_lsn < self.commit_lsn
        return self.complete or index <= self.event_index
