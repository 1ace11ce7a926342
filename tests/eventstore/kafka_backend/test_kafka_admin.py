"""Topic creation on a real Kafka: the embedded log's TopicConfig mapped to Kafka's topic configs."""

from __future__ import annotations

import pytest
from kafka_util import unique_topic

from eventstore.errors import ConfigError, TopicExistsError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, topic_configs
from eventstore.record_batch import Codec
from eventstore.topic import CleanupPolicy, TopicConfig
from tideline.kafkaharness import LocalKafka

CDC_CONFIG = TopicConfig(
    cleanup_policy=CleanupPolicy.COMPACT,
    delete_retention_ms=3_600_000,
    min_compaction_lag_ms=5_000,
    retention_ms=-1,
    segment_ms=600_000,
    compression=Codec.ZSTD,
)


def test_create_topic_writes_every_setting_under_kafkas_name(kafka: LocalKafka) -> None:
    admin = KafkaAdmin(kafka.bootstrap_servers)
    topic = unique_topic("cdc")
    created = admin.create_topic(topic, 3, CDC_CONFIG)
    assert (created.name, created.partitions, created.config) == (topic, 3, CDC_CONFIG)

    stored = admin.topic_configs(topic)  # what the broker has, by Kafka's names
    assert stored["cleanup.policy"] == "compact"
    assert stored["delete.retention.ms"] == "3600000"
    assert stored["min.compaction.lag.ms"] == "5000"
    assert stored["retention.ms"] == "-1"
    assert stored["segment.ms"] == "600000"
    assert stored["compression.type"] == "zstd"
    for name, value in topic_configs(CDC_CONFIG).items():
        assert stored[name] == value, name

    read_back = admin.topic(topic)
    assert (read_back.partitions, read_back.config) == (3, CDC_CONFIG)
    assert topic in admin.topics()
    assert "__consumer_offsets" not in admin.topics()


def test_overrides_and_the_default_codec_round_trip(kafka: LocalKafka) -> None:
    admin = KafkaAdmin(kafka.bootstrap_servers)
    topic = unique_topic("plain")
    admin.create_topic(topic, overrides={"cleanup.policy": "compact,delete", "retention_ms": "86400000"})
    assert admin.topic_configs(topic)["compression.type"] == "producer"  # our "none": keep what was sent
    config = admin.topic(topic).config
    assert config == TopicConfig(cleanup_policy=CleanupPolicy.COMPACT_DELETE, retention_ms=86_400_000)


def test_replication_factor_and_min_insync_replicas_on_three_brokers(kafka3: LocalKafka) -> None:
    admin = KafkaAdmin(kafka3.bootstrap_servers)
    topic = unique_topic("replicated")
    admin.create_topic(topic, 2, CDC_CONFIG, replication_factor=3, min_insync_replicas=2)
    described = admin.describe_json(topic)
    assert (described["replication_factor"], described["min_insync_replicas"]) == (3, 2)
    for info in described["partition_info"]:
        assert sorted(info["replicas"]) == [1, 2, 3]
        assert info["leader"] in (1, 2, 3)
        assert info["log_start_offset"] == info["log_end_offset"] == info["last_stable_offset"] == 0


def test_bad_topic_requests_are_one_line_errors(kafka: LocalKafka) -> None:
    admin = KafkaAdmin(kafka.bootstrap_servers)
    topic = unique_topic("taken")
    admin.create_topic(topic)
    with pytest.raises(TopicExistsError, match=f"topic '{topic}' already exists"):
        admin.create_topic(topic)
    with pytest.raises(ConfigError, match="replication") as refused:
        admin.create_topic(unique_topic("too-many-replicas"), replication_factor=3)  # one broker only
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"min\.insync\.replicas 3 exceeds replication factor 2"):
        admin.create_topic(unique_topic("unsatisfiable"), replication_factor=2, min_insync_replicas=3)
    with pytest.raises(ConfigError, match="illegal topic name"):
        admin.create_topic("no spaces")
    with pytest.raises(ConfigError, match="unknown topic setting"):
        admin.create_topic(unique_topic("typo"), overrides={"retention.mss": "1"})
    missing = unique_topic("missing")
    with pytest.raises(UnknownTopicError, match=missing):
        admin.topic(missing)
    with pytest.raises(UnknownTopicError):
        admin.describe(missing)
    assert missing not in admin.topics()  # asking about it did not auto-create it


def test_ensure_topic_creates_once_and_refuses_a_contradicting_existing_topic(kafka: LocalKafka) -> None:
    admin = KafkaAdmin(kafka.bootstrap_servers)
    topic = unique_topic("first-sight")
    created = admin.ensure_topic(topic, 2, CDC_CONFIG)
    assert admin.ensure_topic(topic, 2, CDC_CONFIG) == admin.topic(topic)
    assert (created.partitions, admin.topic(topic).config) == (2, CDC_CONFIG)
    with pytest.raises(ConfigError) as contradiction:
        admin.ensure_topic(topic, 3, TopicConfig(), overrides={"min_compaction_lag_ms": "0"})
    assert str(contradiction.value) == (
        f"topic '{topic}' exists on Kafka with other settings: partitions=2 (asked: 3), "
        "cleanup_policy=compact (asked: delete), min_compaction_lag_ms=5000 (asked: 0)"
    )
    assert admin.topic(topic).config == CDC_CONFIG  # nothing was changed
