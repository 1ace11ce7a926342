"""The Kafka sink's guard against hanging transactions (:class:`capture.sinks.kafka.Unsettled`).

Pure bookkeeping first (commits and last stable offsets as numbers), then the sink against a real
broker: after a commit across a paused broker the sink waits for every batch's markers, and a
partition held by another producer's open transaction is reported with its offset.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from capture.sinks import TopicRecords, TopicSpec
from capture.sinks.kafka import CHECK_EVERY_S, SLOW_COMMIT_S, KafkaLogSink, Unsettled
from tideline.kafkaharness import LocalKafka

T0 = ("t", 0)
T1 = ("t", 1)


def test_batches_passed_by_the_stable_offset_are_settled() -> None:
    u = Unsettled(hanging_after_s=5)
    u.committed(0, {T0: (0, 10), T1: (0, 4)}, now=0.0)
    u.committed(1, {T0: (10, 5)}, now=0.1)
    assert sorted(u.partitions()) == [T0, T1]
    assert u.settle({T0: 10, T1: 4}, now=0.2) == []
    assert u.partitions() == [T0]  # producer 1's batch at 10..15 not yet
    assert u.settle({T0: 15}, now=0.3) == []
    assert u.partitions() == []
    assert u.pinned is None


def test_a_batch_whose_offset_holds_the_partition_past_the_limit_is_hanging_and_pins_its_producer() -> None:
    u = Unsettled(hanging_after_s=5)
    u.committed(0, {T0: (317, 11)}, now=0.0)
    u.committed(1, {T0: (328, 20), T1: (0, 3)}, now=0.5)
    assert u.settle({T0: 317, T1: 3}, now=4.9) == []  # markers can be late: not yet
    assert u.pinned is None
    assert u.next_turn(0, 2) == 1
    (held,) = u.settle({T0: 317}, now=5.1)
    assert (held.topic, held.partition, held.offset, held.producer) == ("t", 0, 317, 0)
    assert held.for_s == pytest.approx(5.1)
    assert u.pinned == 0
    assert u.next_turn(0, 2) == 0 and u.next_turn(1, 2) == 0  # producer 0 alone: its next write heals
    assert u.settle({T0: 317}, now=9.0) == []  # reported once
    u.committed(0, {T0: (348, 2)}, now=9.1)
    assert u.settle({T0: 317}, now=9.15) == [] and u.pinned == 0  # its markers not yet written
    assert u.settle({T0: 348}, now=9.2) == []  # healed: what was unsettled at the pin is settled
    assert u.pinned is None and u.next_turn(0, 2) == 1
    assert u.partitions() == [T0]  # the healing batch itself, 348..350
    assert u.settle({T0: 350}, now=9.3) == [] and u.partitions() == []


def test_a_pin_lasts_until_every_batch_unsettled_at_that_moment_is_settled() -> None:
    u = Unsettled()
    u.committed(1, {T0: (0, 5)}, now=0.0)
    u.committed(0, {T0: (5, 5), T1: (0, 2)}, now=2.0)  # the slow one: the sink pins its producer
    u.pin(0)
    u.committed(0, {T1: (2, 2)}, now=2.1)
    assert u.settle({T0: 10, T1: 0}, now=2.2) == []
    assert u.pinned == 0  # T1's batch of the pin's moment (0..2) not yet
    assert u.settle({T0: 10, T1: 2}, now=2.3) == []
    assert u.pinned is None  # every batch of the pin's moment settled; the later one (2..4) need not be
    assert u.partitions() == [T1]


def test_a_partition_held_before_our_batches_is_reported_only_after_the_foreign_limit() -> None:
    u = Unsettled(hanging_after_s=1, foreign_after_s=10)
    u.committed(0, {T0: (50, 5)}, now=0.0)
    assert u.settle({T0: 40}, now=5.0) == []  # another producer's transaction at 40
    assert u.settle({T0: 40}, now=14.0) == []  # 9 s since first seen held there
    (held,) = u.settle({T0: 40}, now=15.5)
    assert (held.offset, held.producer) == (40, None)
    assert u.pinned is None  # not ours to heal
    assert u.settle({T0: 45}, now=16.0) == []  # moved on: the clock starts again
    assert u.settle({T0: 45}, now=25.0) == []
    assert u.settle({T0: 55}, now=26.0) == [] and u.partitions() == []


def test_bookkeeping_stays_bounded_while_a_partition_hangs() -> None:
    u = Unsettled(hanging_after_s=1)
    u.committed(1, {T0: (0, 1)}, now=0.0)
    for i in range(1, 3 * Unsettled.MAX_BATCHES):
        u.committed(i % 2, {T0: (i, 1)}, now=float(i))
    (held,) = u.settle({T0: 0}, now=1e6)
    assert held.producer == 1  # the oldest batch keeps its producer
    assert len(u._batches[T0]) == Unsettled.MAX_BATCHES
    assert u.settle({T0: 3 * Unsettled.MAX_BATCHES}, now=1e6 + 1) == [] and u.partitions() == []


# -- against a real broker --------------------------------------------------------------------


def one_transaction(sink: KafkaLogSink, topic: str, n: int) -> None:
    sink.begin()
    keys = [f"k{i}".encode() for i in range(n)]
    sink.append({topic: TopicRecords(keys, [b"v"] * n)})
    sink.commit("positions", b"me", b"{}")


def test_after_a_commit_across_a_paused_broker_the_sink_waits_for_every_batch_then_alternates(
    kafka: LocalKafka, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real outage: the broker's JVM stopped (SIGSTOP, by its PID) while a commit is under way."""
    sink = KafkaLogSink(kafka.bootstrap_servers, state_dir=tmp_path / "state")
    pid = kafka.node_pid(1)
    assert pid is not None
    try:
        sink.open("capture.unsettled-slow")
        sink.ensure_topic("positions", TopicSpec(compact=True, partitions=1))
        sink.ensure_topic("slow", TopicSpec(compact=True, partitions=2))
        one_transaction(sink, "slow", 4)
        assert sink._turn == 1  # alternating
        sink.begin()
        sink.append({"slow": TopicRecords([b"a", b"b"], [b"v", b"v"])})
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(SLOW_COMMIT_S + 0.5, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            with caplog.at_level(logging.INFO, logger="capture.sink"):
                sink.commit("positions", b"me", b"{}")
        finally:
            resume.join()
            os.kill(pid, signal.SIGCONT)
        took = re.search(r"a Kafka commit took (\d+\.\d) s", caplog.text)  # about 1.5 s; more on a loaded machine
        assert took is not None and float(took[1]) >= SLOW_COMMIT_S, caplog.text
        assert "waiting up to" in caplog.text
        assert sink.unsettled.partitions() == []  # returned once every batch's markers were seen
        assert sink.unsettled.pinned is None and "hanging" not in caplog.text
        turns = []
        for _ in range(3):
            turns.append(sink._turn)
            one_transaction(sink, "slow", 1)
        assert turns == [0, 1, 0]
    finally:
        sink.close()


def test_a_batch_still_open_after_an_outage_pins_its_producer() -> None:
    """The decision after an outage's wait: what has not settled hangs at once (hanging_after_s=0)."""
    u = Unsettled()
    u.committed(1, {T0: (317, 11), ("positions", 0): (70, 1)}, now=101.0)  # just before the broker stopped
    u.committed(0, {T0: (329, 200), ("positions", 0): (72, 1)}, now=105.0)  # the slow one, across it
    assert u.settle({T0: 317, ("positions", 0): 70}, now=105.2) == []  # 4.2 s: not yet by the clock
    found = u.settle({T0: 317, ("positions", 0): 70}, now=108.0, hanging_after_s=0.0)
    assert {(h.topic, h.offset, h.producer) for h in found} == {("t", 317, 1), ("positions", 70, 1)}
    assert u.pinned == 1 and u.next_turn(0, 2) == 1  # the backlog goes to producer 1: it heals both


def test_a_partition_held_by_another_producers_transaction_is_reported_and_then_settles(
    kafka: LocalKafka, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = KafkaLogSink(kafka.bootstrap_servers, state_dir=tmp_path / "state")
    other = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": "someone-else"})
    try:
        sink.open("capture.unsettled-held")
        sink.ensure_topic("positions", TopicSpec(compact=True, partitions=1))
        sink.ensure_topic("held", TopicSpec(compact=True, partitions=1))
        sink.unsettled.foreign_after_s = 1.0
        other.init_transactions(30)
        other.begin_transaction()
        other.produce("held", key=b"theirs", value=b"x", partition=0)
        assert other.flush(30) == 0
        with caplog.at_level(logging.WARNING, logger="capture.sink"):
            deadline = time.monotonic() + 30
            while "not one of this connector's commits" not in caplog.text and time.monotonic() < deadline:
                one_transaction(sink, "held", 2)
                time.sleep(0.3)
        assert "Kafka topic held partition 0 has been held at offset 0" in caplog.text
        assert sink.unsettled.pinned is None  # not ours to heal: the producers keep alternating
        assert ("held", 0) in sink.unsettled.partitions()
        other.commit_transaction(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(CHECK_EVERY_S + 0.05)
            one_transaction(sink, "held", 1)  # its commit asks the stable offsets again
            left = sink.unsettled._batches.get(("held", 0), ())
            if len(left) <= 1:
                break
        assert len(left) <= 1  # every batch behind their transaction settled; the one just made may wait
    finally:
        other.flush(5)
        sink.close()

