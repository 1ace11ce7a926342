"""The double fault of the Kafka sink (issue 31): a commit whose markers Kafka skipped, then an abort by the
same producer.

Kafka's transaction coordinator (4.4, ``TransactionMarkerChannelManager``) skips the commit markers of a
partition that has no leader at the moment it writes them, and completes the transaction anyway: the
producer's commit returned, its position record (on another partition) is committed, but its records in
that partition stay open, and the partition's last stable offset (LSO) stops at them. The same
producer's next marker there ends them: COMMIT keeps them, ABORT drops them with its own records. That is
how a one-broker cluster stopped around a commit leaves a "hanging" batch (docs/capture.md, "Kafka
transactions and the double fault"); here it is provoked deterministically on three brokers: the table
partition's only replica is stopped (controlled shutdown) after the batch's records were acknowledged and
before its commit, so the coordinator (another broker) finds the partition leaderless.

One stop of that broker serves three cases at once:

- **the hazard, on this broker**: a bare transactional producer's batch left so, then an aborted
  transaction of that producer in the same partition: ``read_committed`` readers never see the committed
  batch (the test asserts the loss: it is Kafka's behaviour the sink must guard against);
- **the sink**: its batch left so on partition A, then the same producer's next transaction writes A and
  is aborted: every committed batch is read back once (the sink wrote the skipped COMMIT marker before
  that producer sent to A again), the aborted one not at all;
- **a partition that gets no further write** (B) while the connector dies: its next run takes the
  batches the last one left in its state directory and writes B's marker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from readiness import wait_until

from capture.sinks import TopicRecords, TopicSpec
from capture.sinks.kafka import KafkaLogSink
from eventstore.kafka import KafkaAdmin
from eventstore.kafka.config import client_config
from eventstore.kafka.txn_markers import TxnMarkers
from tideline.kafkaharness import LocalKafka

TXN_PARTITIONS = 5  # transaction.state.log.num.partitions of the harness


def java_hash(text: str) -> int:
    """Java's ``String.hashCode``: Kafka places a transactional id in partition abs(hash) % partitions."""
    h = 0
    for ch in text:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def coordinator(admin: AdminClient, transactional_id: str) -> int:
    """The broker that coordinates ``transactional_id``: the leader of its ``__transaction_state`` partition."""
    meta = admin.list_topics("__transaction_state", timeout=30).topics["__transaction_state"]
    h = java_hash(transactional_id)
    return int(meta.partitions[(0 if h == -(1 << 31) else abs(h)) % TXN_PARTITIONS].leader)


def leader(admin: AdminClient, topic: str) -> int:
    return int(admin.list_topics(topic, timeout=30).topics[topic].partitions[0].leader)


def read(bootstrap: str, topic: str, *, committed: bool = True) -> list[str]:
    """Every key a consumer gets from ``topic``'s partition 0 until it reports the end: ``read_committed``
    (the default: up to the last stable offset), else ``read_uncommitted`` (up to the high watermark)."""
    isolation = "read_committed" if committed else "read_uncommitted"
    consumer = Consumer(client_config(bootstrap, group_id=f"check-{topic}", enable_auto_commit=False,
                                      isolation_level=isolation, enable_partition_eof=True))
    keys: list[str] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            error = msg.error()
            if error is None:
                keys.append((msg.key() or b"").decode())
            elif error.code() == KafkaError._PARTITION_EOF:
                return keys
            else:
                raise AssertionError(f"{topic}: {error}")
        raise AssertionError(f"{topic}: no end of partition reported in 60 s (read so far: {keys})")
    finally:
        consumer.close()


@pytest.fixture
def names(kafka3: LocalKafka) -> Iterator[dict[str, str | int]]:
    """Transactional ids and a broker that coordinates none of them (the one whose stop leaves the table
    partitions leaderless while their coordinators keep running), topics on it alone."""
    admin = AdminClient(client_config(kafka3.bootstrap_servers))
    warm = Producer({**client_config(kafka3.bootstrap_servers), "transactional.id": "double-fault-warm-up"})
    warm.init_transactions(60)  # creates __transaction_state in a fresh cluster
    brokers = set(admin.list_topics(timeout=30).brokers)
    for attempt in range(1000):
        sink_id, bare_id = f"capture.df{attempt}", f"bare.df{attempt}"
        busy = {coordinator(admin, t) for t in (sink_id, f"{sink_id}#1", bare_id)}
        if brokers - busy:
            break
    stopped = min(brokers - busy)
    stamp = int(time.time() * 1000)
    topics = {"a": f"df{stamp}.a", "b": f"df{stamp}.b", "bare": f"df{stamp}.bare", "positions": f"df{stamp}.positions"}
    created = admin.create_topics(
        [NewTopic(t, num_partitions=1, replica_assignment=[[stopped]], config={"cleanup.policy": "compact"})
         for key, t in topics.items() if key != "positions"]
        + [NewTopic(topics["positions"], num_partitions=1, replication_factor=3, config={"cleanup.policy": "compact"})]
    )  # fmt: skip
    for future in created.values():
        future.result(60)
    yield {"sink_id": sink_id, "bare_id": bare_id, "stopped": stopped, **topics}


def test_an_abort_after_a_skipped_commit_marker_drops_only_its_own_records(
    kafka3: LocalKafka, names: dict[str, str | int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    boot = kafka3.bootstrap_servers
    a, b, bare, positions = str(names["a"]), str(names["b"]), str(names["bare"]), str(names["positions"])
    stopped = int(names["stopped"])
    admin, markers = AdminClient(client_config(boot)), TxnMarkers(boot)
    sink = KafkaLogSink(boot, state_dir=tmp_path / "state")
    sink.check_every_s = 1e9  # no periodic check: what holds must be the producer's own write path
    producer = Producer({**client_config(boot), "transactional.id": str(names["bare_id"]), "acks": "all"})
    caplog.set_level(logging.INFO, logger="capture.sink")

    # a fresh client per ask: one that knew a partition before its leader restarted keeps sending the old
    # leader epoch, and the broker answers FENCED_LEADER_EPOCH until that client's metadata is refreshed
    def hw(topic: str) -> int:
        return KafkaAdmin(boot).end_offsets([(topic, 0)], read_committed=False)[(topic, 0)]

    def lso(topic: str) -> int:
        return KafkaAdmin(boot).end_offsets([(topic, 0)], read_committed=True)[(topic, 0)]

    def sink_txn(batch: dict[str, list[str]], n: int) -> None:
        sink.begin()
        sink.append({t: TopicRecords([k.encode() for k in ks], [b"v"] * len(ks)) for t, ks in batch.items()})
        sink.commit(positions, b"me", json.dumps({"n": n}).encode())

    restarted = True
    try:
        sink.open(str(names["sink_id"]))
        for topic in (a, b, positions):
            sink.ensure_topic(topic, TopicSpec(compact=True, partitions=1))
        producer.init_transactions(60)
        sink_txn({a: ["w0"], b: ["w0"]}, 0)  # one batch per producer: both have written A and B
        sink_txn({a: ["w1"], b: ["w1"]}, 1)
        turn = sink._turn
        producer.begin_transaction()
        producer.produce(bare, key=b"t1", value=b"v", partition=0)
        assert producer.flush(60) == 0
        wait_until(lambda: lso(a) == hw(a) and lso(b) == hw(b), "the earlier batches' markers")
        first_a, first_b = hw(a), hw(b)  # where the batch goes: only this sink writes A and B
        sink.begin()
        sink.append({a: TopicRecords([b"t1-a", b"t1-b"], [b"v", b"v"]), b: TopicRecords([b"t1-a"], [b"v"])})
        wait_until(lambda: hw(a) == first_a + 2 and hw(b) == first_b + 1, "the batch's records acknowledged")

        # the table partitions' only replica stops (controlled shutdown): no leader, as seen by the coordinators
        restarted = False
        kafka3.stop_node(stopped)
        ports = {n.node_id: n.broker_port for n in kafka3.status().nodes}
        for broker in sorted(set(ports) - {stopped}):  # each answers from its own metadata (sparse connections)
            own = AdminClient(client_config(f"127.0.0.1:{ports[broker]}"))
            wait_until(lambda own=own: all(leader(own, t) == -1 for t in (a, b, bare)),
                       f"broker {broker} to see the partitions without a leader")  # fmt: skip
        producer.commit_transaction(60)
        sink.commit(positions, b"me", json.dumps({"n": 2}).encode())  # returns: Kafka committed
        kafka3.start_node(stopped)
        restarted = True
        wait_until(lambda: all(leader(admin, t) == stopped for t in (a, b, bare)), "the partitions' leader back")

        # what Kafka left: the commits returned and the position is readable, the records are held open
        assert sink.read_last(positions, 0, b"me") == b'{"n": 2}'
        assert (lso(a), hw(a)) == (first_a, first_a + 2)
        assert (lso(b), hw(b)) == (first_b, first_b + 1)
        assert lso(bare) == hw(bare) - 1
        opened = markers.producers([(a, 0), (b, 0)])
        assert [p.txn_start_offset for p in opened[(a, 0)] if p.txn_start_offset >= 0] == [first_a]
        assert [p.txn_start_offset for p in opened[(b, 0)] if p.txn_start_offset >= 0] == [first_b]

        # the hazard: the same producer's next transaction there aborts, and its marker drops the committed batch
        producer.begin_transaction()
        producer.produce(bare, key=b"t2", value=b"v", partition=0)
        assert producer.flush(60) == 0
        producer.abort_transaction(60)
        wait_until(lambda: lso(bare) == hw(bare), "the abort's marker in the bare producer's partition")
        assert read(boot, bare) == []  # "t1" was committed, and is lost

        # the sink: the other producer's batch (positions only), then the same producer writes A and aborts
        assert sink._turn != turn
        sink_txn({}, 3)
        assert sink._turn == turn
        sink.begin()
        sink.append({a: TopicRecords([b"t2-a"], [b"v"])})  # finds the batch's marker missing, writes it, sends
        wait_until(lambda: "t2-a" in read(boot, a, committed=False), "the record of the transaction to abort in A")
        sink.abort()
        wait_until(lambda: lso(a) == hw(a), "the abort's marker in A")
        assert read(boot, a) == ["w0", "w1", "t1-a", "t1-b"]  # committed batches once, the aborted one not
        assert f"Kafka topic {a} partition 0: the batch at offset {first_a}" in caplog.text

        # B got no further write; this run ends (a kill -9 would leave the same: the batches file is written
        # at every commit). The next run of the connector takes the batches it left and writes B's marker.
        assert lso(b) == first_b
        sink.close()
        sink = KafkaLogSink(boot, state_dir=tmp_path / "state")
        sink.open(str(names["sink_id"]))
        assert "batch(es) of the last run without known commit markers" in caplog.text
        wait_until(lambda: lso(b) == hw(b), "the next run to write B's marker")
        assert f"Kafka topic {b} partition 0: the batch at offset {first_b}" in caplog.text
        assert read(boot, b) == ["w0", "w1", "t1-a"]
        sink.begin()
        sink.append({b: TopicRecords([b"t3-b"], [b"v"])})
        wait_until(lambda: "t3-b" in read(boot, b, committed=False), "the record of the transaction to abort in B")
        sink.abort()  # the next run's abort there: B's committed batch stays
        wait_until(lambda: lso(b) == hw(b), "the abort's marker in B")
        assert read(boot, b) == ["w0", "w1", "t1-a"]
    finally:
        if not restarted:
            kafka3.start_node(stopped)
        producer.flush(5)
        sink.close()
