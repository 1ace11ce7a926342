"""Keys land on Kafka's murmur2 partitions on a real broker, as in the embedded log (shared/testdata vectors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message, Producer
from kafka_util import TIMEOUT_S, unique_topic

from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader, client_config
from eventstore.offsets import TopicPartition
from eventstore.partitioner import partition_for_key
from tideline.kafkaharness import LocalKafka

VECTORS_PATH = Path(__file__).parents[4] / "shared" / "testdata" / "kafka_murmur2.json"
PARTITIONS = 12


@pytest.fixture(scope="module")
def vectors() -> list[dict[str, Any]]:
    if not VECTORS_PATH.is_file():
        pytest.fail(f"Kafka murmur2 reference vectors not found at {VECTORS_PATH}", pytrace=False)
    loaded: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text())["vectors"]
    assert loaded
    return loaded


def _produce_and_report(config: dict[str, Any], topic: str, keys: list[bytes]) -> dict[bytes, int]:
    """Let librdkafka pick each key's partition; return key → partition from the delivery reports."""
    producer = Producer(config)
    placed: dict[bytes, int] = {}
    errors: list[KafkaError] = []

    def delivered(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            placed[msg.key()] = msg.partition()  # type: ignore[index]

    for key in keys:
        producer.produce(topic, b"v", key, on_delivery=delivered)
    assert producer.flush(TIMEOUT_S) == 0
    assert not errors, errors
    return placed


def _placement_read_back(bootstrap: str, topic: str) -> dict[bytes, int]:
    placed: dict[bytes, int] = {}
    with KafkaReader(bootstrap) as reader:
        for partition in range(PARTITIONS):
            for record in reader.read_to_end(TopicPartition(topic, partition)):
                assert record.key is not None
                placed[record.key] = partition
    return placed


def test_librdkafka_with_our_client_config_places_keys_like_kafka_and_the_embedded_log(
    kafka: LocalKafka, vectors: list[dict[str, Any]]
) -> None:
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("murmur2")
    KafkaAdmin(bootstrap).create_topic(topic, PARTITIONS)
    keys = [v["key"].encode() for v in vectors]
    expected = {v["key"].encode(): v["partition_of_12"] for v in vectors}
    assert {k: partition_for_key(k, PARTITIONS) for k in keys} == expected  # the embedded log's partitioner

    reported = _produce_and_report(client_config(bootstrap), topic, keys)
    assert reported == expected
    assert _placement_read_back(bootstrap, topic) == expected


def test_librdkafkas_default_partitioner_would_misplace_keys(kafka: LocalKafka, vectors: list[dict[str, Any]]) -> None:
    """Why ``partitioner=murmur2_random`` is set: the CRC32 default disagrees on these very vectors."""
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("crc32")
    KafkaAdmin(bootstrap).create_topic(topic, PARTITIONS)
    keys = [v["key"].encode() for v in vectors]
    expected = {v["key"].encode(): v["partition_of_12"] for v in vectors}
    reported = _produce_and_report({"bootstrap.servers": bootstrap}, topic, keys)
    assert reported != expected


def test_send_batch_places_keys_on_the_vector_partitions(kafka: LocalKafka, vectors: list[dict[str, Any]]) -> None:
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("murmur2-batch")
    KafkaAdmin(bootstrap).create_topic(topic, PARTITIONS)
    keys = [v["key"].encode() for v in vectors]
    expected = {v["key"].encode(): v["partition_of_12"] for v in vectors}
    with KafkaProducer(bootstrap) as producer:
        sent = producer.send_batch(topic, [b"v"] * len(keys), keys)
    assert sum(count for _, count in sent.values()) == len(keys)
    assert set(sent) == set(expected.values())
    assert _placement_read_back(bootstrap, topic) == expected
