"""Which topics a log mirror copies, and where each goes on Kafka (:mod:`eventstore.kafka.mirror`).

By default every topic of the embedded log but internal ones (``__…``, as MirrorMaker 2
skips ``__.*``), except Tideline's own topics a move needs (:data:`INTERNAL_MAPPINGS`):

* ``__tideline_capture_offsets`` (the connector positions): same name on Kafka, where
  capture into Kafka reads its position, so it resumes without a new snapshot. Shared by
  every connector of a cluster: other connectors' keys may be there already, not the
  source's. Copied after the topics whose events its positions cover.
* ``__schemas`` (the schema registry) → ``_schemas``, Kafka's registry topic, each record
  rewritten in Confluent's field order (:func:`~eventstore.kafka.schema_store.confluent_record`),
  so the schema ids of framed values stay valid.
* ``__tideline_schema_starts`` (where each value schema version started, schemas.starts):
  same name on Kafka, where ``tideline schemas versions`` reads it. Shared like the positions.

Never: ``__consumer_offsets`` (embedded group offsets) and the mirror's own progress topic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from eventstore.kafka.mirror_progress import MIRROR_OFFSETS_TOPIC
from eventstore.kafka.schema_store import SCHEMAS_TOPIC as KAFKA_SCHEMAS_TOPIC
from eventstore.kafka.schema_store import confluent_record
from eventstore.log import Log
from eventstore.offsets import OFFSETS_TOPIC, TopicPartition
from eventstore.schema_store import SCHEMAS_TOPIC
from eventstore.topic import TopicConfig
from schemas.position import POSITIONS_TOPIC
from schemas.starts import STARTS_TOPIC

KAFKA_MIN_SEGMENT_BYTES = 1 << 20  # Kafka 4 refuses a smaller segment.bytes
RecordConverter = Callable[[bytes, bytes | None], tuple[bytes, bytes | None]]


@dataclass(frozen=True, slots=True)
class TopicMapping:
    """How one source topic goes to Kafka when it is not simply copied under its own name."""

    target: str | None = None  # the Kafka topic (None: the source's name)
    convert: RecordConverter | None = None  # rewrites each keyed record's (key, value)
    shared: bool = False  # other writers' keys may be on Kafka already (the source's must not)
    copied_after_others: bool = False  # its records say how far the others are (see eventstore.kafka.mirror)


# Internal topics that carry what a move to Kafka needs: the connector's position (capture
# resumes without a new snapshot) and the schema registry (schema ids in framed values stay valid).
INTERNAL_MAPPINGS: dict[str, TopicMapping] = {
    POSITIONS_TOPIC: TopicMapping(shared=True, copied_after_others=True),
    SCHEMAS_TOPIC: TopicMapping(target=KAFKA_SCHEMAS_TOPIC, convert=confluent_record),
    STARTS_TOPIC: TopicMapping(shared=True),
}
NOT_MIRRORABLE = {
    OFFSETS_TOPIC: "it holds the embedded log's consumer group offsets, which mean nothing on Kafka "
    "(Kafka keeps its own groups in its internal topic of that name)",
    MIRROR_OFFSETS_TOPIC: "it is the mirror's own progress topic",
}


def default_topics(log: Log) -> list[str]:
    """What a mirror copies unless told: every topic but internal ones (``__…``, as MirrorMaker 2
    skips ``__.*`` by default), except those of :data:`INTERNAL_MAPPINGS`."""
    return [t for t in log.topics() if not t.startswith("__") or t in INTERNAL_MAPPINGS]


def kafka_topic_config(source: TopicConfig) -> TopicConfig:
    """The settings a Kafka topic mirroring a source topic with ``source`` is created with."""
    return dataclasses.replace(source, segment_bytes=max(source.segment_bytes, KAFKA_MIN_SEGMENT_BYTES))


@dataclass(frozen=True, slots=True)
class MirrorTopic:
    """One topic to mirror: its source shape, where it goes, and whether Kafka has that topic already."""

    name: str
    partitions: int
    config: TopicConfig  # the Kafka topic's settings when the mirror creates it
    exists_on_kafka: bool
    target: str  # the Kafka topic
    mapping: TopicMapping

    def partition_list(self) -> list[TopicPartition]:
        return [TopicPartition(self.name, p) for p in range(self.partitions)]
