"""The schema registry on Kafka (``KafkaSchemaStore``): Confluent's ``_schemas`` layout, fencing between writers.

Each test uses a topic and transactional id of its own (the session's brokers are shared).
"""

from __future__ import annotations

import json

import pytest
from kafka_util import read_raw, unique_topic

from eventstore.kafka import KafkaAdmin
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.topic import CleanupPolicy
from schemas.errors import SchemaStoreConflictError
from schemas.registry import SchemaRegistry, schema_key
from tideline.kafkaharness import LocalKafka


def schema(n: int) -> str:
    return json.dumps({"type": "record", "name": f"R{n}", "fields": [{"name": "x", "type": "long"}]})


def stores(kafka: LocalKafka, count: int) -> tuple[str, list[KafkaSchemaStore]]:
    topic, writer_id = unique_topic("schemas"), unique_topic("registry-writer")
    return topic, [KafkaSchemaStore(kafka.bootstrap_servers, topic=topic, transactional_id=writer_id)
                   for _ in range(count)]  # fmt: skip


def test_writers_that_fence_each_other_never_share_an_id_and_agree(kafka: LocalKafka) -> None:
    topic, (store_a, store_b) = stores(kafka, 2)
    a, b = SchemaRegistry(store_a), SchemaRegistry(store_b)
    assert a.subjects() == []  # no topic yet: an empty registry, nothing created by a reader
    assert topic not in KafkaAdmin(kafka.bootstrap_servers).topics()

    ids = {}
    for n in range(6):  # alternating writers: each write fences the other, whose next write is redone
        writer = (a, b)[n % 2]
        ids[f"s{n}-value"] = writer.register(f"s{n}-value", schema(n)).id
    assert sorted(ids.values()) == list(range(1, 7))
    assert a.register("s0-value", schema(0)).id == ids["s0-value"]  # idempotent across writers
    for registry in (a, b):
        assert {s: registry.latest(s).id for s in registry.subjects()} == ids

    reopened = SchemaRegistry(KafkaSchemaStore(kafka.bootstrap_servers, topic=topic))  # replays the topic
    assert {s: reopened.latest(s).id for s in reopened.subjects()} == ids
    meta = KafkaAdmin(kafka.bootstrap_servers).topic(topic)
    assert (meta.partitions, meta.config.cleanup_policy) == (1, CleanupPolicy.COMPACT)

    records = read_raw(kafka.bootstrap_servers, topic, 0, isolation="read_committed")
    assert len(records) == 6  # the writes the fencing aborted are not there
    key, value = records[0]
    assert key == b'{"keytype":"SCHEMA","subject":"s0-value","version":1,"magic":1}'  # Confluent's bytes
    assert value is not None and json.loads(value) == {"subject": "s0-value", "version": 1, "id": 1,
                                                       "schema": schema(0), "deleted": False}  # fmt: skip
    for store in (store_a, store_b):
        store.close()


def test_a_fenced_writer_writes_nothing(kafka: LocalKafka) -> None:
    topic, (zombie, successor) = stores(kafka, 2)
    with zombie.locked():  # the zombie has read and picked its id …
        SchemaRegistry(successor).register("taken-value", schema(1))  # … when another writer takes over
        with pytest.raises(SchemaStoreConflictError, match="another schema registry writer took over"):
            zombie.append(schema_key("lost-value", 1), b'{"deleted":false,"id":1,"schema":"\\"long\\"",'
                                                      b'"subject":"lost-value","version":1}')  # fmt: skip
    records = read_raw(kafka.bootstrap_servers, topic, 0, isolation="read_committed")
    assert [json.loads(k or b"")["subject"] for k, _ in records] == ["taken-value"]
    assert SchemaRegistry(zombie).register("later-value", schema(2)).id == 2  # a new producer: fences back
    zombie.close()
    successor.close()
