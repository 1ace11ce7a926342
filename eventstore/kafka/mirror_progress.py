"""The log mirror's stored progress on Kafka: the one definition of the record, for the mirror and its readers.

:class:`~eventstore.kafka.mirror.LogMirror` writes it in the same Kafka transaction as the
records it copied, so it says exactly which source records are on Kafka.

Record (compacted topic :data:`MIRROR_OFFSETS_TOPIC`, partition 0):

* key: JSON ``{"mirror": <name>, "topic": <topic>, "partition": <n>}`` (:func:`mirror_progress_key`)
* value: JSON ``{"next_source_offset": S, "next_target_offset": T}`` (:class:`MirrorProgress`)

Meaning: every committed record of the embedded log's partition before offset ``S`` is on
Kafka, once; none after it is. ``T`` is the Kafka offset after the last record copied (the
mirror being the Kafka topic's only writer): the pair is MirrorMaker 2's offset sync, the
last point where the two offset spaces are known to meet (records map one to one, in
order; offsets do not: compaction gaps and control batches on one side, commit markers on
the other).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from eventstore.kafka.admin import KafkaAdmin
from eventstore.kafka.reader import KafkaReader
from eventstore.offsets import TopicPartition
from eventstore.topic import CleanupPolicy, TopicConfig

MIRROR_OFFSETS_TOPIC = "__tideline_mirror_offsets"


def mirror_offsets_topic_config() -> TopicConfig:
    # Compacted: the latest progress per partition is all that counts. Short segments, so
    # the cleaner keeps what a restart reads small.
    return TopicConfig(cleanup_policy=CleanupPolicy.COMPACT, segment_bytes=16 << 20, segment_ms=3_600_000)


def mirror_progress_key(name: str, tp: TopicPartition) -> bytes:
    """The progress record's key for partition ``tp`` of mirror ``name``."""
    return orjson.dumps({"mirror": name, "topic": tp.topic, "partition": tp.partition})


@dataclass(frozen=True, slots=True)
class MirrorProgress:
    """How far one source partition is copied."""

    next_source_offset: int  # every committed source record before this offset is on Kafka, exactly once
    next_target_offset: int  # the Kafka offset after the last record copied (the mirror being its only writer)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"next_source_offset": self.next_source_offset, "next_target_offset": self.next_target_offset}
        )

    @classmethod
    def from_json(cls, raw: bytes) -> MirrorProgress:
        data = orjson.loads(raw)
        return cls(int(data["next_source_offset"]), int(data["next_target_offset"]))


def read_mirror_progress(bootstrap: str, name: str, *, timeout_s: float = 30.0) -> dict[TopicPartition, MirrorProgress]:
    """The committed progress of mirror ``name`` (empty if the progress topic does not exist).

    Reads ``read_committed`` to the last stable offset: a transaction a killed mirror left
    open is not counted (nor waited for; ``LogMirror.start`` ends it first). Memory: the
    progress of this mirror's partitions.
    """
    if MIRROR_OFFSETS_TOPIC not in KafkaAdmin(bootstrap, timeout_s=timeout_s).topics():
        return {}
    out: dict[TopicPartition, MirrorProgress] = {}
    with KafkaReader(bootstrap, timeout_s=timeout_s) as reader:
        for chunk in reader.read_chunks_to_end(TopicPartition(MIRROR_OFFSETS_TOPIC, 0)):
            for key, value in zip(chunk.keys, chunk.values, strict=True):
                owner = orjson.loads(key) if key else None
                if not isinstance(owner, dict) or owner.get("mirror") != name:
                    continue
                tp = TopicPartition(str(owner["topic"]), int(owner["partition"]))
                if value is None:
                    out.pop(tp, None)
                else:
                    out[tp] = MirrorProgress.from_json(value)
    return out
