"""Copying the embedded log's topics into Kafka, partition for partition, for the projections-from-Kafka
tests: what capture writes into the embedded log, made readable on a real Kafka (a `tideline log
mirror --to-kafka` is a separate piece of work; this is the tests' own small copy)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path

from eventstore.consumer import Consumer, TopicPartition
from eventstore.isolation import IsolationLevel
from eventstore.kafka import KafkaAdmin, KafkaProducer
from eventstore.log import Log

TRANSACTION_RECORDS = 400  # records per Kafka transaction (one partition's, in offset order)


class KafkaMirror:
    """Copies committed records (keys, values, headers) of embedded-log topics to the same
    partition of a Kafka topic of the same name and partition count, in Kafka transactions;
    each :meth:`copy` continues where the last one stopped. Topics it creates must not exist."""

    def __init__(self, log_dir: Path, bootstrap_servers: str) -> None:
        self.log_dir = log_dir
        self.bootstrap_servers = bootstrap_servers
        self.admin = KafkaAdmin(bootstrap_servers)
        self.copied: dict[tuple[str, int], int] = {}  # next embedded offset to copy
        self.producer = KafkaProducer(bootstrap_servers, transactional_id=f"test-mirror-{uuid.uuid4().hex[:8]}")
        self.producer.init_transactions()

    def copy(self, topics: Iterable[str]) -> int:
        """Copy what is new in ``topics`` (those the log has); the number of records copied."""
        copied = 0
        with Log(self.log_dir, create=False) as log:
            existing = set(log.topics())
            for topic in (t for t in topics if t in existing):
                meta = log.topic(topic)
                if (topic, 0) not in self.copied:
                    self.admin.create_topic(topic, meta.partitions, meta.config)
                for p in range(meta.partitions):
                    copied += self._copy_partition(log, topic, p)
        return copied

    def _copy_partition(self, log: Log, topic: str, partition: int) -> int:
        start = self.copied.get((topic, partition), 0)
        copied = 0
        with Consumer(log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED) as consumer:
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, start)
            while polled := consumer.poll(timeout_ms=0, max_records=TRANSACTION_RECORDS):
                records = list(polled)
                self.producer.begin_transaction()
                self.producer.send_batch(
                    topic,
                    [r.value for r in records],
                    [r.key for r in records],
                    partition=partition,
                    headers=[list(r.headers) or None for r in records],
                )
                self.producer.commit_transaction()
                copied += len(records)
            self.copied[(topic, partition)] = consumer.position(tp)
        return copied

    def close(self) -> None:
        self.producer.close()
