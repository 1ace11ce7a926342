"""``tideline log`` on Apache Kafka: what the commands do when ``--kafka`` / ``TIDELINE_KAFKA_BOOTSTRAP`` is set.

Same output as on the embedded log (the row shapes of :mod:`tideline.log_cli`), through
:mod:`eventstore.kafka` and Kafka's own consumer groups:

- ``create`` — :meth:`KafkaAdmin.create_topic` (plus replication factor and ``min.insync.replicas``);
- ``topics`` / ``describe`` — the cluster's topics; partitions with leader, replicas, ISR, offsets
  (:func:`describe_topics`: all of them, for the operations console);
- ``produce`` — stdin lines in chunks through :class:`KafkaProducer` (``acks=all``, idempotent);
- ``tail`` — a librdkafka consumer, ``read_committed`` by default; ``--group`` joins a Kafka
  consumer group and commits what it printed;
- ``groups`` — Kafka's consumer groups with members, committed offsets and lag per partition.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any, BinaryIO

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient

from eventstore.errors import ConfigError, TidelineError
from eventstore.kafka import KafkaAdmin, KafkaProducer, client_config
from eventstore.kafka.config import translate, watermarks
from eventstore.topic import TopicConfig
from tideline.log_cli import ProduceSummary, TailRows, send_lines

POLL_SECONDS = 0.5
TAIL_BATCH = 10_000
GROUP_ASSIGNMENT_WAIT_S = 30.0  # without --follow: how long tail --group waits to be given partitions
TIMEOUT_S = 10.0


def create_topic(bootstrap: str, topic: str, partitions: int, overrides: dict[str, str], *,
                 replication_factor: int | None, min_insync_replicas: int | None) -> str:  # fmt: skip
    meta = KafkaAdmin(bootstrap).create_topic(topic, partitions, TopicConfig(), overrides=overrides,
                                              replication_factor=replication_factor,
                                              min_insync_replicas=min_insync_replicas)  # fmt: skip
    return (
        f"created topic {meta.name} with {meta.partitions} partition{'s' if meta.partitions != 1 else ''} "
        f"({meta.config.cleanup_policy.value}) on Kafka at {bootstrap}"
    )


def topics(bootstrap: str) -> list[dict[str, Any]]:
    admin = KafkaAdmin(bootstrap)
    out = []
    for name in admin.topics():
        meta = admin.topic(name)
        out.append({"topic": name, "partitions": meta.partitions, "cleanup_policy": meta.config.cleanup_policy.value})
    return out


def describe_topics(bootstrap: str) -> list[dict[str, Any]]:
    """``log describe --json`` of every topic of the cluster (partitions with leader, replicas, ISR, offsets)."""
    admin = KafkaAdmin(bootstrap)
    return [admin.describe_json(name) for name in admin.topics()]


def produce_lines(bootstrap: str, topic: str, stream: BinaryIO, *, partition: int | None = None) -> ProduceSummary:
    """``KEY<TAB>VALUE`` lines of ``stream`` to ``topic``, one ``send_batch`` per chunk (as on the embedded log)."""
    compacted = KafkaAdmin(bootstrap).topic(topic).config.cleanup_policy.compacts
    with KafkaProducer(bootstrap) as producer:
        return send_lines(producer, topic, stream, compacted=compacted, partition=partition)


# ---------------------------------------------------------------------------- tail


def tail_polls(
    bootstrap: str,
    topic: str,
    *,
    from_beginning: bool,
    follow: bool,
    partition: int | None,
    offset: int | None,
    group: str | None,
    isolation: str,
) -> Generator[list[TailRows], None, None]:
    """Rows of each consume call; without ``follow`` it ends at the end offsets seen at the start."""
    count = KafkaAdmin(bootstrap).topic(topic).partitions  # UnknownTopicError before anything else
    starts_at_end = follow and not from_beginning
    consumer = Consumer(client_config(
        bootstrap,
        group_id=group or "tideline-tail",  # librdkafka needs one; without --group it is never joined
        enable_auto_commit=False,  # tail commits exactly what it printed
        enable_auto_offset_store=False,
        auto_offset_reset="latest" if starts_at_end else "earliest",
        isolation_level=isolation,
        enable_partition_eof=True,
        fetch_wait_max_ms=500 if follow else 20,  # without --follow nothing is awaited at the end
    ))  # fmt: skip
    try:
        stop_at = None if follow else _high_watermarks(consumer, bootstrap, topic, range(count))
        if group is not None:
            consumer.subscribe([topic])
        else:
            numbers = [partition] if partition is not None else list(range(count))
            if partition is not None and not 0 <= partition < count:
                raise ConfigError(f"topic {topic!r} has no partition {partition} (it has {count})")
            start = offset if offset is not None else (OFFSET_END if starts_at_end else OFFSET_BEGINNING)
            consumer.assign([KafkaTopicPartition(topic, p, start) for p in numbers])
        yield from _consume(consumer, topic, stop_at, committing=group is not None, bootstrap=bootstrap)
    finally:
        consumer.close()


def _high_watermarks(consumer: Consumer, bootstrap: str, topic: str, partitions: range) -> dict[int, int]:
    try:
        return {p: watermarks(consumer, KafkaTopicPartition(topic, p), timeout_s=TIMEOUT_S)[1]
                for p in partitions}  # fmt: skip
    except KafkaException as e:
        translate(e, what=f"reading the end offsets of {topic!r}", bootstrap=bootstrap, topic=topic)


def _consume(consumer: Consumer, topic: str, stop_at: dict[int, int] | None, *, committing: bool,
             bootstrap: str) -> Generator[list[TailRows], None, None]:  # fmt: skip
    done: set[int] = set()
    waited_since = time.monotonic()
    while True:
        try:
            messages = consumer.consume(TAIL_BATCH, POLL_SECONDS)
        except KafkaException as e:
            translate(e, what=f"reading {topic!r}", bootstrap=bootstrap, topic=topic)
        rows, next_offsets = _rows(messages, stop_at, done, bootstrap)
        if rows:
            yield rows
        if committing and next_offsets:
            consumer.commit(offsets=[KafkaTopicPartition(topic, p, o) for p, o in next_offsets.items()],
                            asynchronous=False)  # fmt: skip
        if stop_at is None:
            continue
        assigned = {tp.partition for tp in consumer.assignment()}
        done |= {p for p in assigned if stop_at[p] == 0}
        if assigned and assigned <= done:
            return
        if not assigned and time.monotonic() - waited_since > GROUP_ASSIGNMENT_WAIT_S:
            raise TidelineError(f"no partition of {topic!r} was assigned within {GROUP_ASSIGNMENT_WAIT_S:.0f}s")


def _rows(messages: list[Message], stop_at: dict[int, int] | None, done: set[int],
          bootstrap: str) -> tuple[list[TailRows], dict[int, int]]:  # fmt: skip
    by_partition: dict[int, TailRows] = {}
    next_offsets: dict[int, int] = {}
    for msg in messages:
        p = msg.partition() or 0
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                done.add(p)
                continue
            translate(err, what=f"reading {msg.topic()!r}", bootstrap=bootstrap, topic=msg.topic())
        offset = msg.offset() or 0
        if stop_at is not None and (p in done or offset >= stop_at[p]):
            done.add(p)
            continue
        rows = by_partition.setdefault(p, TailRows(p, [], [], [], [], []))
        rows.offsets.append(offset)
        rows.timestamps.append(msg.timestamp()[1])
        rows.keys.append(msg.key())
        rows.values.append(msg.value())
        assert rows.headers is not None
        rows.headers.append(_headers(msg.headers()))
        next_offsets[p] = offset + 1
        if stop_at is not None and offset + 1 >= stop_at[p]:
            done.add(p)
    return [by_partition[p] for p in sorted(by_partition)], next_offsets


def _headers(raw: Any) -> list[tuple[str, bytes | None]]:
    pairs = raw.items() if isinstance(raw, dict) else (raw or [])
    return [(key, value.encode() if isinstance(value, str) else value) for key, value in pairs]


# ---------------------------------------------------------------------------- groups


def describe_groups(bootstrap: str) -> list[dict[str, Any]]:
    """Kafka's consumer groups in :func:`tideline.log_cli.describe_groups`' shape (members, offsets, lag)."""
    from confluent_kafka import ConsumerGroupTopicPartitions

    admin = AdminClient(client_config(bootstrap))
    try:
        listed = admin.list_consumer_groups(request_timeout=TIMEOUT_S).result(timeout=TIMEOUT_S + 5)
        group_ids = sorted(g.group_id for g in listed.valid)
        if not group_ids:
            return []
        descriptions = {
            g: f.result(timeout=TIMEOUT_S + 5)
            for g, f in admin.describe_consumer_groups(group_ids, request_timeout=TIMEOUT_S).items()
        }
        committed = {}
        for group_id in group_ids:  # librdkafka answers one group per request
            (future,) = admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group_id)], request_timeout=TIMEOUT_S
            ).values()
            committed[group_id] = future.result(timeout=TIMEOUT_S + 5).topic_partitions or []
    except KafkaException as e:
        translate(e, what="describing consumer groups", bootstrap=bootstrap)
    kafka_admin = KafkaAdmin(bootstrap)
    ends: dict[str, dict[int, tuple[int, int]]] = {}
    out = []
    for group_id in group_ids:
        description = descriptions[group_id]
        owners = {
            (tp.topic, tp.partition): m.member_id
            for m in description.members
            for tp in (m.assignment.topic_partitions if m.assignment else [])
        }
        offsets = {(tp.topic, tp.partition): tp.offset for tp in committed[group_id] if tp.offset >= 0}
        rows = []
        for topic, p in sorted(set(offsets) | set(owners)):
            if topic not in ends:
                ends[topic] = _partition_ends(kafka_admin, topic)
            log_end, stable = ends[topic].get(p, (None, None))
            done = offsets.get((topic, p))
            rows.append({
                "topic": topic, "partition": p, "committed_offset": done, "log_end_offset": log_end,
                "last_stable_offset": stable,
                "lag": None if done is None or log_end is None else max(0, log_end - done),
                "member_id": owners.get((topic, p)), "pending_transaction": False,
            })  # fmt: skip
        out.append({
            "group": group_id,
            "state": str(description.state.name).lower() if description.state is not None else None,
            "members": [
                {"member_id": m.member_id, "client_id": m.client_id, "pid": None, "host": m.host,
                 "topics": sorted({tp.topic for tp in (m.assignment.topic_partitions if m.assignment else [])}),
                 "assignment": [{"topic": tp.topic, "partition": tp.partition}
                                for tp in (m.assignment.topic_partitions if m.assignment else [])],
                 "joined_ms": None, "heartbeat_ms": None}
                for m in description.members
            ],
            "partitions": rows,
        })  # fmt: skip
    return out


def _partition_ends(admin: KafkaAdmin, topic: str) -> dict[int, tuple[int, int]]:
    try:
        _, infos = admin.describe(topic)
    except TidelineError:  # the topic is gone: the group's commit outlived it
        return {}
    return {i.partition: (i.high_watermark, i.last_stable_offset) for i in infos}
