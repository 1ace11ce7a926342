"""Replication factor 3, min.insync.replicas 2: a transactional writer loses nothing when a broker dies."""

from __future__ import annotations

from kafka_util import unique_topic

from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.offsets import TopicPartition
from eventstore.topic import CleanupPolicy, TopicConfig
from tideline.kafkaharness import LocalKafka, NodeShutdown

PARTITIONS = 3


def _batch(tag: str, n: int = 50) -> tuple[list[bytes | None], list[bytes | None]]:
    return [f"{tag}-{i}".encode() for i in range(n)], [f"key-{tag}-{i}".encode() for i in range(n)]


def test_transactions_commit_through_a_killed_partition_leader(kafka3: LocalKafka) -> None:
    bootstrap = kafka3.bootstrap_servers
    topic = unique_topic("replicated-txn")
    admin = KafkaAdmin(bootstrap, timeout_s=30)
    admin.create_topic(topic, PARTITIONS, TopicConfig(cleanup_policy=CleanupPolicy.COMPACT),
                       replication_factor=3, min_insync_replicas=2)  # fmt: skip
    leader = admin.describe(topic)[1][0].leader
    producer = KafkaProducer(bootstrap, transactional_id=unique_topic("replicated-id"), timeout_s=90)
    written: list[bytes | None] = []
    try:
        producer.init_transactions()
        producer.begin_transaction()
        values, keys = _batch("before")
        producer.send_batch(topic, values, keys)
        producer.commit_transaction()
        written += values

        stopped = kafka3.stop_node(leader, kill=True)  # kill -9 the leader of partition 0
        assert stopped.shutdown is NodeShutdown.KILLED
        for tag in ("during-1", "during-2"):  # acks=all is met by the two replicas left
            producer.begin_transaction()
            values, keys = _batch(tag)
            producer.send_batch(topic, values, keys)
            producer.commit_transaction()
            written += values
    finally:
        producer.close()
        kafka3.start_node(leader)

    with KafkaReader(bootstrap, timeout_s=60) as reader:
        read = [r.value for p in range(PARTITIONS) for r in reader.read_to_end(TopicPartition(topic, p))]
    assert sorted(v or b"" for v in read) == sorted(v or b"" for v in written)
    assert admin.describe(topic)[1][0].leader in (1, 2, 3)
