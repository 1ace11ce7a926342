"""Transactions, fencing and read_committed reads on a real Apache Kafka broker."""

from __future__ import annotations

import pytest
from kafka_util import read_raw, unique_topic

from eventstore.errors import ConfigError, ProducerFencedError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.offsets import TopicPartition
from eventstore.topic import CleanupPolicy, TopicConfig
from tideline.kafkaharness import LocalKafka

COMPACT = TopicConfig(cleanup_policy=CleanupPolicy.COMPACT)


def _values(bootstrap: str, topic: str, partition: int = 0) -> list[bytes | None]:
    with KafkaReader(bootstrap) as reader:
        return [r.value for r in reader.read_to_end(TopicPartition(topic, partition))]


def test_aborted_records_are_invisible_to_read_committed(kafka: LocalKafka) -> None:
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("txn")
    KafkaAdmin(bootstrap).create_topic(topic)
    with KafkaProducer(bootstrap, transactional_id=unique_topic("txn-id")) as producer:
        producer.init_transactions()
        for value, commit in ((b"one", True), (b"aborted", False), (b"two", True)):
            producer.begin_transaction()
            producer.send_batch(topic, [value])
            if commit:
                producer.commit_transaction()
            else:
                producer.abort_transaction()
    assert _values(bootstrap, topic) == [b"one", b"two"]
    # The aborted record was written: a read_uncommitted reader sees it, so the check above means something.
    assert [v for _, v in read_raw(bootstrap, topic, 0, isolation="read_uncommitted")] == [b"one", b"aborted", b"two"]


def test_a_transaction_spans_topics_with_keys_headers_and_tombstones(kafka: LocalKafka) -> None:
    bootstrap = kafka.bootstrap_servers
    admin = KafkaAdmin(bootstrap)
    events, positions = unique_topic("events"), unique_topic("positions")
    admin.create_topic(events, 3, COMPACT)
    admin.create_topic(positions, 1, COMPACT)
    keys = [b"k1", b"k2", b"k3", b"k1"]
    values: list[bytes | None] = [b"a", b"b", b"c", None]
    headers = [[("op", b"c")], None, [("op", b"c"), ("trace", None)], [("op", b"d")]]
    with KafkaProducer(bootstrap, transactional_id=unique_topic("span")) as producer:
        producer.init_transactions()
        producer.begin_transaction()
        sent = producer.send_batch(events, values, keys, headers=headers)
        producer.send_batch(positions, [b'{"lsn": 42}'], [b"connector"])
        assert _values(bootstrap, positions) == []  # not committed yet: the reader stops at the open transaction
        producer.commit_transaction()
    assert sum(count for _, count in sent.values()) == 4
    with KafkaReader(bootstrap) as reader:
        records = [r for p in range(3) for r in reader.read_to_end(TopicPartition(events, p))]
    by_key = {}
    for r in records:
        by_key.setdefault(r.key, []).append((r.value, r.headers))
    assert by_key == {
        b"k1": [(b"a", [("op", b"c")]), (None, [("op", b"d")])],
        b"k2": [(b"b", [])],
        b"k3": [(b"c", [("op", b"c"), ("trace", None)])],
    }
    assert _values(bootstrap, positions) == [b'{"lsn": 42}']


def test_a_second_instance_fences_the_first(kafka: LocalKafka) -> None:
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("fence")
    KafkaAdmin(bootstrap).create_topic(topic)
    transactional_id = unique_topic("connector")
    zombie = KafkaProducer(bootstrap, transactional_id=transactional_id, timeout_s=20)
    zombie.init_transactions()
    zombie.begin_transaction()
    zombie.send_batch(topic, [b"from-the-zombie"])

    successor = KafkaProducer(bootstrap, transactional_id=transactional_id, timeout_s=20)
    successor.init_transactions()  # fences the zombie and aborts its open transaction
    with pytest.raises(ProducerFencedError, match="another instance took over"):
        zombie.commit_transaction()
    with pytest.raises(ProducerFencedError):  # and it stays fenced
        zombie.begin_transaction()
    zombie.close()

    successor.begin_transaction()
    successor.send_batch(topic, [b"from-the-successor"])
    successor.commit_transaction()
    successor.close()
    assert _values(bootstrap, topic) == [b"from-the-successor"]


def test_a_fenced_instance_that_sends_gets_producer_fenced_error(kafka: LocalKafka) -> None:
    """Regression: confluent-kafka 2.16 raised the fencing met inside flush as a SystemError."""
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("fence-send")
    KafkaAdmin(bootstrap).create_topic(topic)
    transactional_id = unique_topic("fenced-sender")
    zombie = KafkaProducer(bootstrap, transactional_id=transactional_id, timeout_s=20)
    zombie.init_transactions()
    successor = KafkaProducer(bootstrap, transactional_id=transactional_id, timeout_s=20)
    successor.init_transactions()
    zombie.begin_transaction()
    with pytest.raises(ProducerFencedError, match="another instance took over"):
        zombie.send_batch(topic, [b"from-the-zombie"])
    zombie.close()
    successor.close()
    assert _values(bootstrap, topic) == []


def test_init_transactions_aborts_what_a_killed_predecessor_left_open(kafka: LocalKafka) -> None:
    """A crashed connector's open transaction would hold read_committed readers back until it timed out."""
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("crashed")
    KafkaAdmin(bootstrap).create_topic(topic)
    transactional_id = unique_topic("crashed-id")
    with KafkaProducer(bootstrap, transactional_id=transactional_id) as first:
        first.init_transactions()
        first.begin_transaction()
        first.send_batch(topic, [b"committed"])
        first.commit_transaction()
    predecessor = KafkaProducer(bootstrap, transactional_id=transactional_id)
    predecessor.init_transactions()
    predecessor.begin_transaction()
    predecessor.send_batch(topic, [b"left-open"])  # then it "dies": never committed nor aborted
    (info,) = KafkaAdmin(bootstrap).describe(topic)[1]
    assert info.last_stable_offset < info.high_watermark  # the open transaction holds the stable offset back

    KafkaProducer(bootstrap, transactional_id=transactional_id).init_transactions()
    (info,) = KafkaAdmin(bootstrap).describe(topic)[1]
    assert info.last_stable_offset == info.high_watermark
    assert _values(bootstrap, topic) == [b"committed"]


def test_keyless_batches_go_round_robin_and_bad_targets_are_refused(kafka: LocalKafka) -> None:
    bootstrap = kafka.bootstrap_servers
    topic = unique_topic("keyless")
    KafkaAdmin(bootstrap).create_topic(topic, 2)
    with KafkaProducer(bootstrap) as producer:
        first = producer.send_batch(topic, [b"a", b"b"])
        second = producer.send_batch(topic, [b"c"])
        assert len(first) == len(second) == 1 and set(first) | set(second) == {0, 1}
        with pytest.raises(ConfigError, match="has no partition 5"):
            producer.send_batch(topic, [b"x"], partition=5)
        missing = unique_topic("missing")
        with pytest.raises(UnknownTopicError, match=missing):
            producer.send_batch(missing, [b"x"])
    (only,) = set(first)
    assert _values(bootstrap, topic, only) == [b"a", b"b"]
