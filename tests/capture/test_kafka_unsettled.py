"""The Kafka sink's bookkeeping of commit markers (:class:`capture.sinks.kafka.Unsettled`).

Pure bookkeeping first (commits, last stable offsets and open transactions as numbers), then the sink
against a real broker: after a commit across a paused broker the sink waits for every batch's markers,
and a partition held by another producer's open transaction is reported with its offset while the sink
goes on writing there. The double fault itself (a batch whose markers Kafka skipped, then an abort by
the same producer) is tests/capture/test_kafka_double_fault.py.
"""

from __future__ import annotations

import json
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
from capture.sinks.kafka import ANY, SLOW_COMMIT_S, KafkaLogSink, Unsettled
from tideline.kafkaharness import LocalKafka

T0 = ("t", 0)
T1 = ("t", 1)


def test_batches_passed_by_the_stable_offset_are_settled() -> None:
    u = Unsettled()
    u.committed(0, {T0: (0, 10), T1: (0, 4)}, now=0.0)
    u.committed(1, {T0: (10, 5)}, now=0.1)
    assert sorted(u.partitions()) == [T0, T1]
    assert u.owed(0, [T0, T1]) == [T0, T1] and u.owed(1, [T0, T1]) == [T0]
    assert u.settle({T0: 10, T1: 4}, now=0.2) == []
    assert u.partitions() == [T0]  # producer 1's batch at 10..15 not yet
    assert u.owed(0, [T0, T1]) == [] and u.owed(1, [T0]) == [T0]
    assert u.settle({T0: 15}, now=0.3) == []
    assert u.partitions() == [] and u.owed(1, [T0]) == []


def test_a_batch_whose_partition_stays_at_its_first_offset_lingers_after_the_grace() -> None:
    u = Unsettled()
    u.committed(0, {T0: (317, 11)}, now=0.0)
    u.committed(1, {T0: (328, 20), T1: (0, 3)}, now=0.5)
    assert u.lingering(now=0.1, grace_s=2.0) == []  # not asked yet: nothing is known
    u.settle({T0: 317, T1: 3}, now=1.0)
    assert u.lingering(now=1.9, grace_s=2.0) == []  # markers can be late: not yet
    assert u.lingering(now=2.1, grace_s=2.0) == [T0]
    assert not u.held_early(T0)  # held at our own batch: the LSO tells, the grace decides
    assert u.youngest(0, [T0, T1]) == 0.0 and u.youngest(1, [T0, T1]) == 0.5


def test_the_leaders_open_transactions_decide_which_markers_are_lost() -> None:
    u = Unsettled()
    u.committed(0, {T0: (317, 11)}, now=100.0)  # its markers were skipped
    u.committed(1, {T0: (328, 20)}, now=101.0)  # markers written: the LSO cannot show it (held at 317)
    u.committed(0, {T0: (348, 2)}, now=104.9)  # just committed: its markers are on the way
    u.settle({T0: 317}, now=105.0)
    # the leader: producer 0's transaction open at 317 (the lost one) and at 348 (the young one)
    assert u.lost(T0, [317, 348], now=105.0, grace_s=2.0) == [317]
    u.marked(T0, still_open=[348])  # 317 written by the caller; 348 still waits for its own markers
    assert u.owed(1, [T0]) == [] and u.owed(0, [T0]) == [T0]
    assert u.settle({T0: 350}, now=105.1) == [] and u.partitions() == []


def test_a_partition_held_before_our_batches_is_foreign_and_reported_only_after_its_limit() -> None:
    u = Unsettled(foreign_after_s=10)
    u.committed(0, {T0: (50, 5)}, now=0.0)
    assert u.settle({T0: 40}, now=1.0) == []  # another producer's transaction at 40
    assert u.held_early(T0)  # our batch's own marker cannot show in the LSO: the leader must tell
    assert u.lost(T0, [40], now=1.0, grace_s=2.0) == []  # the only open transaction is not ours
    u.marked(T0, still_open=[])
    assert u.owed(0, [T0]) == []  # our batch has its marker: producer 0 may write there
    assert u.partitions() == [T0]  # still asked about: the foreign hold is watched
    assert u.settle({T0: 40}, now=10.5) == []  # 9.5 s since first seen held there
    (held,) = u.settle({T0: 40}, now=11.5)
    assert (held.topic, held.partition, held.offset) == ("t", 0, 40)
    assert u.settle({T0: 40}, now=20.0) == []  # reported once
    assert u.settle({T0: 55}, now=21.0) == [] and u.partitions() == []


def test_bookkeeping_stays_bounded_and_merged_batches_are_owed_by_every_producer() -> None:
    u = Unsettled()
    u.committed(1, {T0: (0, 1)}, now=0.0)
    for i in range(1, 3 * Unsettled.MAX_BATCHES):
        u.committed(i % 2, {T0: (i, 1)}, now=float(i))
    assert len(u._batches[T0]) == Unsettled.MAX_BATCHES
    assert u._batches[T0][-1].producer == ANY
    u.settle({T0: 0}, now=1e6)
    assert u.owed(0, [T0]) == [T0] and u.owed(1, [T0]) == [T0]
    assert u.lost(T0, [0, 25_000], now=1e6, grace_s=2.0) == [0, 25_000]  # inside the merged batch too
    assert u.settle({T0: 3 * Unsettled.MAX_BATCHES}, now=1e6 + 1) == [] and u.partitions() == []


def test_the_batches_a_run_leaves_are_owed_in_the_next_as_committed_long_ago() -> None:
    u = Unsettled()
    u.committed(0, {T0: (317, 11), ("positions", 0): (70, 1)}, now=500.0)
    u.committed(1, {T1: (4, 2)}, now=500.1)
    saved = json.loads(json.dumps(u.to_json()))  # what the sink writes after each commit
    later = Unsettled()
    assert later.restore(saved) == 3
    assert later.owed(0, [T0, T1, ("positions", 0)]) == [T0, ("positions", 0)] and later.owed(1, [T1]) == [T1]
    later.settle({T0: 317, T1: 6, ("positions", 0): 70}, now=3.0)  # a new process: its clock starts low
    assert later.lingering(now=3.0, grace_s=2.0) == [T0, ("positions", 0)]  # no grace left to wait for


def test_the_batches_file_is_written_in_place_while_small_and_always_reads_as_the_last_save(tmp_path: Path) -> None:
    """The file a killed run leaves (KafkaLogSink._save): in place (one pwrite inside the first page, padded with
    spaces) while its text is small, renamed over when it grows past that or shrinks far below the file."""
    sink = KafkaLogSink("127.0.0.1:9", state_dir=tmp_path)  # no broker needed: the file alone
    sink._batches_file = path = tmp_path / "me.batches.json"

    def save(batches: int) -> list[list[str | int]]:
        sink.unsettled = Unsettled()
        for i in range(batches):
            sink.unsettled.committed(i % 2, {("topic-with-a-long-name", i): (1000 + i, 3)}, now=1.0)
        sink._save()
        saved = json.loads(path.read_text())
        assert saved == {"version": 1, "batches": sink.unsettled.to_json()}
        return list(saved["batches"])

    try:
        assert len(save(40)) == 40
        inode, size = path.stat().st_ino, path.stat().st_size
        assert len(save(35)) == 35  # shorter: in place, padded
        assert (path.stat().st_ino, path.stat().st_size) == (inode, size)
        assert len(save(100)) == 100  # past one page: written beside and renamed over
        assert path.stat().st_ino != inode and path.stat().st_size > 4096
        assert save(1) == [["topic-with-a-long-name", 0, 1000, 1003, 0]]  # far shorter: rewritten small
        assert path.stat().st_size < 100
        assert save(0) == []
    finally:
        sink.close()


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
        # paused until the commit has been under way well past SLOW_COMMIT_S: the readiness signal is the commit
        # itself beginning (a timer from the pause misfired on a loaded machine: the commit began after it resumed)
        committing = threading.Event()
        commit = sink._commit

        def marked(*args: bytes | str | None) -> dict[tuple[str, int], int]:
            committing.set()
            return commit(*args)  # type: ignore[arg-type]

        def resume_when_slow() -> None:
            committing.wait(120)
            time.sleep(SLOW_COMMIT_S + 1.0)
            os.kill(pid, signal.SIGCONT)

        sink._commit = marked  # type: ignore[method-assign]
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Thread(target=resume_when_slow)
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
        assert "had no commit marker" not in caplog.text
        turns = []
        for _ in range(3):
            turns.append(sink._turn)
            one_transaction(sink, "slow", 1)
        assert turns == [0, 1, 0]
    finally:
        sink.close()


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
        assert "had no commit marker" not in caplog.text  # not ours to end: no marker written for it
        assert ("held", 0) in sink.unsettled.partitions()  # watched
        other.commit_transaction(30)
        sink.check_every_s = 0.0
        deadline = time.monotonic() + 30
        while ("held", 0) in sink.unsettled._foreign and time.monotonic() < deadline:
            one_transaction(sink, "held", 1)  # its commit asks the stable offsets again
            time.sleep(0.1)
        assert ("held", 0) not in sink.unsettled._foreign  # their transaction ended: the partition is free
    finally:
        other.flush(5)
        sink.close()

