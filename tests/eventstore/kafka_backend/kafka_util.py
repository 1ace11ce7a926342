"""Helpers of the Kafka backend's tests: unique topic names, raw librdkafka readers for cross-checks."""

from __future__ import annotations

import itertools
import os
import time

from confluent_kafka import Consumer, KafkaError
from confluent_kafka import TopicPartition as KafkaTopicPartition

TIMEOUT_S = 60.0
_counter = itertools.count()


def unique_topic(stem: str) -> str:
    """A topic name no other test of the session uses (the session's brokers are shared)."""
    return f"{stem}-{os.getpid()}-{next(_counter)}"


def read_raw(bootstrap: str, topic: str, partition: int, *, isolation: str) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) of every record of one partition up to its end, with librdkafka alone (not our reader)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "raw-check", "enable.auto.commit": False,
                         "isolation.level": isolation, "enable.partition.eof": True})  # fmt: skip
    try:
        consumer.assign([KafkaTopicPartition(topic, partition, 0)])
        records: list[tuple[bytes | None, bytes | None]] = []
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return records
                raise AssertionError(f"reading {topic}-{partition}: {err}")
            records.append((msg.key(), msg.value()))
        raise AssertionError(f"no end of {topic}-{partition} within {TIMEOUT_S:.0f}s")
    finally:
        consumer.close()
