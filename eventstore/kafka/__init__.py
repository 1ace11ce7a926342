"""Apache Kafka as the log: the embedded log's admin / producer / reader shape over confluent-kafka.

- :class:`KafkaAdmin` — ``topics``, ``topic``, ``create_topic`` (``TopicConfig`` mapped to
  Kafka's topic configs, plus replication factor and ``min.insync.replicas``), ``describe``.
- :class:`KafkaProducer` — ``acks=all``, idempotent, transactional with a
  ``transactional_id``: ``init_transactions`` / ``begin_transaction`` /
  ``send_batch`` / ``commit_transaction`` / ``abort_transaction``; a fenced producer
  raises :class:`~eventstore.errors.ProducerFencedError`.
- :class:`KafkaReader` — ``read_to_end``: a partition from an offset to its last
  stable offset, ``read_committed``.

Every client uses ``partitioner=murmur2_random`` (see :mod:`eventstore.kafka.config`).
"""

from eventstore.errors import KafkaUnavailableError
from eventstore.kafka.admin import KafkaAdmin, KafkaPartitionInfo
from eventstore.kafka.config import (
    client_config,
    probe_bootstrap,
    topic_config_from_kafka,
    topic_configs,
)
from eventstore.kafka.producer import KafkaProducer
from eventstore.kafka.reader import KafkaReader, PartitionChunk

__all__ = [
    "KafkaAdmin",
    "KafkaPartitionInfo",
    "KafkaProducer",
    "KafkaReader",
    "KafkaUnavailableError",
    "PartitionChunk",
    "client_config",
    "probe_bootstrap",
    "topic_config_from_kafka",
    "topic_configs",
]
