"""Transactions across topics and partitions, as read_committed and read_uncommitted see them.

* A transaction over 3 topics × 4 partitions is visible all at once on commit, never on
  abort, and not while open (the last stable offset holds read_committed readers back).
* A producer process and a consumer reading concurrently: read_committed never returns a
  record of a transaction that was not (yet) committed; read_uncommitted does.
* A producer killed -9 inside a transaction: its data stays invisible, and recovery
  (the coordinator's, or the next instance's ``init_transactions``) aborts it. A crash
  after the commit decision but before all markers: recovery completes the commit.
* Compaction never lets aborted data replace a committed value, nor cleans past an
  open transaction.
* A commit or abort whose markers cannot be written (a full disk) after its decision was
  stored completes when the producer retries it, also when the abort bumped the epoch; a
  fenced instance stays fenced; closing with an abort that fails still closes.
* Queued appends (``send_batch_queued``) keep their order among synchronous ones; one that fails
  fails the transaction with the log's own error, and nothing queued after it is written; commit,
  abort and close wait for the queue. An append that lands after its fenced transaction was aborted
  is refused, also where that transaction had written nothing yet.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import pytest

from eventstore.cleaner import compact_partition
from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import InvalidRecordError, InvalidTxnStateError, LogStorageError, ProducerFencedError
from eventstore.log import Log
from eventstore.partition_log import AppendResult
from eventstore.producer import Producer
from eventstore.record_batch import EncodedBatch
from eventstore.transactions import TransactionCoordinator, TxnState

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
TOPICS = ("orders", "payments", "audit")


def make_topics(log: Log, partitions: int) -> list[TopicPartition]:
    for t in TOPICS:
        log.create_topic(t, partitions)
    return [TopicPartition(t, p) for t in TOPICS for p in range(partitions)]


def values_seen(log: Log, tps: list[TopicPartition], isolation: str) -> list[bytes]:
    """Everything a fresh consumer at ``isolation`` reads from the beginning, right now."""
    out: list[bytes] = []
    with Consumer(log, isolation_level=isolation, enable_auto_commit=False) as consumer:
        consumer.assign(tps)
        consumer.seek_to_beginning()
        while True:
            records = consumer.poll(timeout_ms=0)
            if not records:
                return out
            out.extend(r.value for r in records if r.value is not None)


def test_transaction_over_three_topics(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 4)
        producer = Producer(log, transactional_id="app", linger_ms=1)
        producer.init_transactions()

        def txn(tag: str, n: int) -> list[bytes]:
            sent = [f"{tag}-{t}-{i}".encode() for t in TOPICS for i in range(n)]
            for v in sent:
                producer.send(v.split(b"-")[1].decode(), v, key=v)
            return sent

        producer.begin_transaction()
        committed = txn("c1", 40)
        producer.commit_transaction()
        producer.begin_transaction()
        aborted = txn("a1", 40)
        producer.flush()  # on disk, then aborted
        producer.abort_transaction()
        producer.begin_transaction()
        open_ = txn("o1", 40)
        producer.flush()  # on disk, still open

        assert all(log.partition(tp.topic, tp.partition).aborted_transactions(0, 1 << 62) for tp in tps)
        unstable = [
            tp
            for tp in tps
            if log.partition(tp.topic, tp.partition).last_stable_offset()
            < log.partition(tp.topic, tp.partition).log_end_offset()
        ]
        assert len(unstable) == len(tps), "every partition holds open data: the LSO must stop before it"
        assert sorted(values_seen(log, tps, "read_committed")) == sorted(committed)
        assert sorted(values_seen(log, tps, "read_uncommitted")) == sorted(committed + aborted + open_)

        producer.commit_transaction()
        assert sorted(values_seen(log, tps, "read_committed")) == sorted(committed + open_)
        for tp in tps:
            plog = log.partition(tp.topic, tp.partition)
            assert plog.last_stable_offset() == plog.log_end_offset()
        producer.close()
    with Log(tmp_path / "log") as log:  # and the same after reopening
        assert sorted(values_seen(log, tps, "read_committed")) == sorted(committed + open_)


TXN_PRODUCER = r"""
import os, random, sys, time
from eventstore.log import Log
from eventstore.producer import Producer
path, decisions, count, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
topics = ("orders", "payments", "audit")
log = Log(path)
p = Producer(log, transactional_id="writer", linger_ms=1)
p.init_transactions()
with open(decisions, "a") as out:
    for k in range(count):
        p.begin_transaction()
        for i in range(rng.randint(1, 30)):
            t = rng.choice(topics)
            p.send(t, b"%d:%d" % (k, i), key=b"key-%d" % rng.randint(0, 50))
        p.flush()                      # durable and readable by read_uncommitted, still open
        time.sleep(rng.random() * 0.01)
        decision = "commit" if rng.random() < 0.7 else "abort"
        out.write(f"{k} {decision}\n"); out.flush(); os.fsync(out.fileno())   # decided before the markers
        if decision == "commit":
            p.commit_transaction()
        else:
            p.abort_transaction()
p.close()
print("done", flush=True)
"""


def test_concurrent_processes_read_committed_never_sees_open_or_aborted(tmp_path: Path) -> None:
    path = tmp_path / "log"
    decisions_path = tmp_path / "decisions"
    decisions_path.touch()
    count = 1500 if SOAK else 200
    with Log(path) as log:
        tps = make_topics(log, 3)
    writer = subprocess.Popen(
        [sys.executable, "-c", TXN_PRODUCER, str(path), str(decisions_path), str(count), "11"],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    decisions: dict[int, str] = {}

    def decision(k: int) -> str | None:
        if k not in decisions:
            for line in decisions_path.read_text().splitlines():
                n, d = line.split()
                decisions[int(n)] = d
        return decisions.get(k)

    committed_seen: list[bytes] = []
    uncommitted_seen: list[bytes] = []
    with Log(path) as log:
        rc = Consumer(log, isolation_level="read_committed", enable_auto_commit=False)
        ru = Consumer(log, isolation_level="read_uncommitted", enable_auto_commit=False)
        for c in (rc, ru):
            c.assign(tps)
            c.seek_to_beginning()
        idle = 0
        while idle < 3:
            done = writer.poll() is not None
            got = 0
            for record in rc.poll(timeout_ms=20):
                assert record.value is not None
                k = int(record.value.split(b":")[0])
                assert decision(k) == "commit", f"read_committed returned {record.value!r} of a {decision(k)} txn"
                committed_seen.append(record.value)
                got += 1
            for record in ru.poll(timeout_ms=0):
                assert record.value is not None
                uncommitted_seen.append(record.value)
                got += 1
            idle = idle + 1 if done and got == 0 else 0
        rc.close()
        ru.close()
    assert writer.wait() == 0
    assert len(decisions) == count
    assert len(committed_seen) == len(set(committed_seen))
    committed_txns = {k for k, d in decisions.items() if d == "commit"}
    aborted_seen = [v for v in uncommitted_seen if decisions[int(v.split(b":")[0])] == "abort"]
    assert aborted_seen, "read_uncommitted should have returned records of aborted transactions"
    expected = sorted(v for v in uncommitted_seen if int(v.split(b":")[0]) in committed_txns)
    assert sorted(committed_seen) == expected  # every committed record, once, and nothing else


CRASHER = r"""
import sys, time
from eventstore.log import Log
from eventstore.producer import Producer
log = Log(sys.argv[1])
p = Producer(log, transactional_id="crasher", linger_ms=1)
p.init_transactions()
p.begin_transaction()
p.send("orders", b"committed-before", key=b"a")
p.commit_transaction()
p.begin_transaction()
for t in ("orders", "payments", "audit"):
    for i in range(20):
        p.send(t, b"doomed-%d" % i, key=b"k%d" % i)
p.flush()
print("sent", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("recovery", ["coordinator", "next_instance"])
def test_kill_9_mid_transaction_leaves_it_aborted(tmp_path: Path, recovery: str) -> None:
    path = tmp_path / "log"
    with Log(path) as log:
        tps = make_topics(log, 2)
    proc = subprocess.Popen([sys.executable, "-c", CRASHER, str(path)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "sent"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with Log(path) as log:
        assert values_seen(log, tps, "read_committed") == [b"committed-before"]
        assert len(values_seen(log, tps, "read_uncommitted")) == 61
        coordinator = TransactionCoordinator(log)
        assert coordinator.read_state("crasher").state is TxnState.ONGOING  # type: ignore[union-attr]
        if recovery == "coordinator":
            ended = coordinator.recover()  # the owner's flock died with it: no need to wait for the timeout
            assert [m.transactional_id for m in ended] == ["crasher"]
            assert ended[0].state is TxnState.COMPLETE_ABORT
            assert coordinator.read_state("crasher").state is TxnState.COMPLETE_ABORT  # type: ignore[union-attr]
        else:
            Producer(log, transactional_id="crasher").init_transactions()
            state = coordinator.read_state("crasher")
            assert state is not None and (state.state, state.epoch) == (TxnState.EMPTY, 2)  # aborted at epoch 1
        for tp in tps:
            plog = log.partition(tp.topic, tp.partition)
            assert plog.last_stable_offset() == plog.log_end_offset()
        assert values_seen(log, tps, "read_committed") == [b"committed-before"]
        assert len(values_seen(log, tps, "read_uncommitted")) == 61  # aborted data stays until cleaned
        assert coordinator.recover() == []  # idempotent


class CrashOnSecondMarker(Log):
    """A real log that 'crashes' (raises) when the second commit marker is appended."""

    markers = 0

    def append(self, topic: str, partition: int, batch: EncodedBatch | bytearray) -> AppendResult:
        if batch[21] & 0x20:  # attributes: control batch
            self.markers += 1
            if self.markers == 2:
                raise KeyboardInterrupt("simulated crash between markers")
        return super().append(topic, partition, batch)


def test_crash_between_decision_and_markers_completes_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with Log(path) as log:
        tps = make_topics(log, 2)
    log = CrashOnSecondMarker(path)
    producer = Producer(log, transactional_id="half", linger_ms=1)
    producer.init_transactions()
    producer.begin_transaction()
    sent = [b"v%d" % i for i in range(30)]
    for i, v in enumerate(sent):
        producer.send(TOPICS[i % 3], v, key=v)
    with pytest.raises(KeyboardInterrupt):
        producer.commit_transaction()
    log.close()
    with Log(path) as fresh:
        coordinator = TransactionCoordinator(fresh)
        assert coordinator.read_state("half").state is TxnState.PREPARE_COMMIT  # type: ignore[union-attr]
        assert values_seen(fresh, tps, "read_committed") != sorted(sent)  # only part of it is committed yet
        ended = coordinator.recover()
        assert [m.state for m in ended] == [TxnState.COMPLETE_COMMIT]
        assert sorted(values_seen(fresh, tps, "read_committed")) == sorted(sent)


class FullDisk(Log):
    """A real log whose appends fail with ENOSPC while ``data_full`` (data batches) or ``markers_full``
    (control batches) is set, the way a full file system fails them (the batch is not stored)."""

    data_full = False
    markers_full = False

    def append(self, topic: str, partition: int, batch: EncodedBatch | bytearray) -> AppendResult:
        control = bool(batch[21] & 0x20)
        if self.markers_full if control else self.data_full:
            raise LogStorageError(self.path / f"{topic}-{partition}", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return super().append(topic, partition, batch)


@contextmanager
def full_disk(tmp_path: Path, partitions: int) -> Iterator[tuple[FullDisk, list[TopicPartition]]]:
    """A log with the test topics, reopened as a :class:`FullDisk`; ``(log, topic partitions)``."""
    path = tmp_path / "log"
    with Log(path) as log:
        tps = make_topics(log, partitions)
    with FullDisk(path) as full:
        yield full, tps


def open_with_one_record(log: Log, tid: str, value: bytes) -> Producer:
    """A transactional producer whose open transaction holds one stored record."""
    producer = Producer(log, transactional_id=tid, linger_ms=1)
    producer.init_transactions()
    producer.begin_transaction()
    producer.send("orders", value, key=b"k").result()
    return producer


def goes_on(producer: Producer, log: Log, tps: list[TopicPartition], value: bytes, before: list[bytes]) -> None:
    """The producer commits one more record, read_committed then sees ``before`` and it; closes it."""
    producer.begin_transaction()
    producer.send("orders", value, key=b"k")
    producer.commit_transaction()
    assert sorted(values_seen(log, tps, "read_committed")) == sorted([*before, value])
    producer.close()


def test_a_commit_whose_markers_failed_completes_when_retried(tmp_path: Path) -> None:
    with full_disk(tmp_path, 2) as (log, tps):
        producer = Producer(log, transactional_id="retry", linger_ms=1)
        producer.init_transactions()
        producer.begin_transaction()
        sent = [b"c%d" % i for i in range(12)]
        for i, v in enumerate(sent):
            producer.send(TOPICS[i % 3], v, key=v)
        log.markers_full = True
        with pytest.raises(LogStorageError, match="No space left"):
            producer.commit_transaction()
        assert TransactionCoordinator(log).read_state("retry").state is TxnState.PREPARE_COMMIT  # type: ignore[union-attr]
        assert values_seen(log, tps, "read_committed") == []
        log.markers_full = False
        producer.commit_transaction()  # the retry writes the markers of the stored decision
        assert sorted(values_seen(log, tps, "read_committed")) == sorted(sent)
        goes_on(producer, log, tps, b"next", sent)


def test_an_abort_that_bumped_the_epoch_then_failed_is_retried_under_the_old_epoch(tmp_path: Path) -> None:
    """The capture connector's disk-full path: a send fails (the transaction must abort, with a new
    epoch), the abort's decision is stored but its markers are not; the retry, still under the old
    epoch, must not be taken for a fenced zombie."""
    with full_disk(tmp_path, 2) as (log, tps):
        producer = open_with_one_record(log, "full", b"stored")
        epoch = producer.epoch
        log.data_full = log.markers_full = True
        with pytest.raises(LogStorageError):
            producer.send("payments", b"refused", key=b"b").result()
        with pytest.raises(LogStorageError):
            producer.abort_transaction()
        state = TransactionCoordinator(log).read_state("full")
        assert state is not None and (state.state, state.epoch, state.last_epoch) == (
            TxnState.PREPARE_ABORT,
            epoch + 1,
            epoch,
        )
        log.data_full = log.markers_full = False
        producer.abort_transaction()  # under the old epoch: a retry, not a zombie
        assert producer.epoch == epoch + 1
        assert values_seen(log, tps, "read_committed") == []
        goes_on(producer, log, tps, b"after", [])


def test_a_fenced_instance_stays_fenced_even_when_it_aborts_after_a_failed_send(tmp_path: Path) -> None:
    with full_disk(tmp_path, 1) as (log, tps):
        old = open_with_one_record(log, "z", b"old")
        log.data_full = True
        with pytest.raises(LogStorageError):
            old.send("orders", b"refused", key=b"k").result()
        log.data_full = False
        new = Producer(log, transactional_id="z", linger_ms=1)
        new.init_transactions()  # aborts old's transaction with a bumped epoch: old is a zombie now
        with pytest.raises(ProducerFencedError):
            old.abort_transaction()
        assert old.epoch < new.epoch
        goes_on(new, log, tps, b"new", [])


def test_an_append_that_lands_after_its_fenced_transaction_was_aborted_is_refused(tmp_path: Path) -> None:
    """The old instance registered a partition but its append had not landed when a new instance aborted its
    transaction (a queued append still in flight). The abort's marker fences the old epoch in that partition
    although nothing was open there, so the late append is refused, and the new instance's commit does not
    commit it (both instances share one producer id)."""
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 1)
        old = Producer(log, transactional_id="late", linger_ms=1)
        old.init_transactions()
        old.begin_transaction()
        old.send_batch("orders", [b"kept"], [b"k"], partition=0)
        old.commit_transaction()
        old.begin_transaction()
        old.add_partitions_to_transaction([("orders", 0)])  # registered; its append is still on its way
        new = Producer(log, transactional_id="late", linger_ms=1)
        new.init_transactions()  # aborts old's transaction, whose partition holds nothing of it yet
        with pytest.raises(ProducerFencedError):
            old.send_batch("orders", [b"in flight"], [b"k"], partition=0)
        # The fencing marker aborts nothing: the same producer id's committed record stays visible.
        goes_on(new, log, tps, b"the new instance's", [b"kept"])
        assert values_seen(log, tps, "read_uncommitted") == [b"kept", b"the new instance's"]
    with Log(tmp_path / "log") as log:  # reopened: the partition's state rebuilt from its files says the same
        assert values_seen(log, tps, "read_committed") == [b"kept", b"the new instance's"]


def test_closing_with_an_abort_that_fails_still_closes_and_the_next_instance_aborts(tmp_path: Path) -> None:
    with full_disk(tmp_path, 1) as (log, tps):
        producer = open_with_one_record(log, "c", b"left open")
        log.markers_full = True
        with pytest.raises(LogStorageError):
            producer.close()
        assert not TransactionCoordinator(log).owner_alive("c", producer.epoch)  # closed all the same, and ...
        log.markers_full = False
        successor = Producer(log, transactional_id="c", linger_ms=1)
        successor.init_transactions()  # ... the next instance completes the decided abort
        assert values_seen(log, tps, "read_committed") == []
        goes_on(successor, log, tps, b"kept", [])


def test_transaction_timeout_aborts_and_fences_a_live_producer(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 1)
        producer = Producer(log, transactional_id="slow", transaction_timeout_ms=50)
        producer.init_transactions()
        producer.begin_transaction()
        producer.send("orders", b"late", key=b"k").result()
        assert TransactionCoordinator(log).recover() == []  # alive and within its timeout
        time.sleep(0.1)
        assert [m.transactional_id for m in TransactionCoordinator(log).recover()] == ["slow"]
        with pytest.raises(ProducerFencedError):
            producer.commit_transaction()
        assert values_seen(log, tps, "read_committed") == []


def test_compaction_respects_transactions(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        log.create_topic("state", 1, overrides={"cleanup_policy": "compact"})
        plog = log.partition("state", 0)
        producer = Producer(log, transactional_id="c", linger_ms=1)
        producer.init_transactions()
        producer.begin_transaction()
        producer.send("state", b"committed", key=b"K")
        producer.commit_transaction()
        producer.begin_transaction()
        producer.send("state", b"aborted", key=b"K")
        producer.flush()
        producer.abort_transaction()
        plog.roll()
        producer.begin_transaction()
        producer.send("state", b"open", key=b"K")
        producer.flush()
        plog.roll()  # the open transaction sits in a closed segment now
        stats = compact_partition(plog)
        assert stats.segments_cleaned == 1, "only the segment below the last stable offset is cleanable"
        tp = [TopicPartition("state", 0)]
        assert values_seen(log, tp, "read_committed") == [b"committed"]
        assert values_seen(log, tp, "read_uncommitted") == [b"committed", b"open"]  # the aborted batch is gone
        producer.commit_transaction()
        plog.roll()
        compact_partition(plog)
        assert values_seen(log, tp, "read_committed") == [b"open"]
        producer.close()


def test_many_random_transactions_model(tmp_path: Path) -> None:
    """A reference model: random commits/aborts/interleavings by two producers."""
    rng = random.Random(5)
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 2)
        producers = [Producer(log, transactional_id=f"p{i}", linger_ms=1) for i in range(2)]
        for p in producers:
            p.init_transactions()
        expected: list[bytes] = []
        pending: dict[int, list[bytes]] = {0: [], 1: []}
        for p in producers:
            p.begin_transaction()
        for step in range(400 if SOAK else 120):
            i = rng.randrange(2)
            p = producers[i]
            action = rng.random()
            if action < 0.7:
                v = b"%d-%d" % (i, step)
                p.send(rng.choice(TOPICS), v, key=v, partition=rng.randrange(2))
                pending[i].append(v)
            else:
                if action < 0.9:
                    p.commit_transaction()
                    expected.extend(pending[i])
                else:
                    p.abort_transaction()
                pending[i] = []
                p.begin_transaction()
            if step % 20 == 0:  # committed data behind another open transaction is held back (LSO)
                seen = values_seen(log, tps, "read_committed")
                assert len(seen) == len(set(seen)) and set(seen) <= set(expected)
        for p in producers:
            p.commit_transaction()
            p.close()
        expected.extend(pending[0] + pending[1])
        assert sorted(values_seen(log, tps, "read_committed")) == sorted(expected)


def test_compaction_drops_markers_and_a_rebuild_still_knows_they_ended(tmp_path: Path) -> None:
    from eventstore.producer_state import PRODUCER_STATE_FILE

    path = tmp_path / "log"
    with Log(path) as log:
        log.create_topic("state", 1, overrides={"cleanup_policy": "compact"})
        plog = log.partition("state", 0)
        producers = [Producer(log, transactional_id=f"m{i}", linger_ms=1) for i in range(2)]
        for p in producers:
            p.init_transactions()
        for i in range(50):  # two producers: the marker kept as a group's last batch closes only one
            p = producers[i % 2]
            p.begin_transaction()
            p.send("state", b"v%d" % i, key=b"k%d" % (i % 5))
            p.commit_transaction()
        for p in producers:
            p.close()
        plog.roll()
        markers_before = sum(f.header.is_control for f in plog.read(0, max_bytes=1 << 30))
        compact_partition(plog)
        markers_after = sum(f.header.is_control for f in plog.read(0, max_bytes=1 << 30))
        assert markers_before >= 50 and markers_after <= 1  # (the group's last batch may be one)
    (path / "state-0" / PRODUCER_STATE_FILE).unlink()  # force a rebuild from the batch headers
    with Log(path) as log:
        plog = log.partition("state", 0)
        with Producer(log) as plain:  # another producer's append: a write-side open rebuilds the state
            plain.send("state", b"plain", key=b"k9").result()
        assert plog.last_stable_offset() == plog.log_end_offset(), "a rebuilt state thinks old transactions are open"
        producer = Producer(log, transactional_id="m0", linger_ms=1)
        producer.init_transactions()
        producer.begin_transaction()
        producer.send("state", b"after", key=b"k0")
        producer.commit_transaction()
        producer.close()
        assert sorted(values_seen(log, [TopicPartition("state", 0)], "read_committed")) == sorted(
            [b"v45", b"v46", b"v47", b"v48", b"v49", b"plain", b"after"]
        )


# ---------------------------------------------------------------------------- queued appends


def offsets_and_values(log: Log, topic: str, partition: int, isolation: str) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    with Consumer(log, isolation_level=isolation, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(topic, partition)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=0):
            out.extend((r.offset, r.value) for r in records if r.value is not None)
    return out


def test_queued_appends_keep_their_order_among_synchronous_ones(tmp_path: Path) -> None:
    """send_batch_queued returns before its batches are written; a synchronous append to the same partition
    waits for them, so the partition holds every call's records in the order of the calls; commit waits for
    the queue; each future says where its call's records went; the next transaction's sequences follow."""
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 2)
        producer = Producer(log, transactional_id="q", linger_ms=0, batch_size=4096)  # ~3 batches per call
        producer.init_transactions()
        producer.begin_transaction()
        calls: list[tuple[Future[tuple[int, int]], list[bytes]]] = []
        expected: list[bytes] = []
        for n in range(6):
            values = [b"q%d-%03d-" % (n, i) + b"x" * 90 for i in range(100)]
            calls.append((producer.send_batch_queued("orders", values, [b"k%d" % i for i in range(100)],
                                                     partition=0), values))  # fmt: skip
            expected += values
            if n % 2:
                producer.send_batch("orders", [b"sync-%d" % n], [b"s"], partition=0)
                expected.append(b"sync-%d" % n)
        assert offsets_and_values(log, "orders", 0, "read_committed") == []
        producer.commit_transaction()
        stored = offsets_and_values(log, "orders", 0, "read_committed")
        assert [v for _, v in stored] == expected
        where = dict((v, o) for o, v in stored)
        for future, values in calls:
            assert future.done() and future.result() == (where[values[0]], len(values))
        goes_on(producer, log, tps, b"next", expected)


def test_a_failed_queued_append_fails_its_transaction_and_nothing_queued_after_it_is_written(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 1)
        log.create_topic("small", 1, overrides={"max_batch_bytes": "4096"})
        producer = Producer(log, transactional_id="qf", linger_ms=0)
        producer.init_transactions()
        producer.begin_transaction()
        assert producer.send_batch_queued("small", [b"first"], [b"k"], partition=0).result()[1] == 1
        too_big = producer.send_batch_queued("small", [b"x" * 20_000], [b"k"], partition=0)
        try:  # queued behind the refused batch, or refused at once if the writer got there first
            after: Future[tuple[int, int]] | None = producer.send_batch_queued("small", [b"after"], [b"k"], partition=0)
        except InvalidRecordError:
            after = None
        with pytest.raises(InvalidRecordError, match="max_batch_bytes"):
            too_big.result()
        if after is not None:
            with pytest.raises(InvalidRecordError):
                after.result()
        with pytest.raises(InvalidRecordError):  # the failure as the log raised it, not a generic state error
            producer.send_batch_queued("small", [b"later"], [b"k"], partition=0)
        with pytest.raises(InvalidRecordError):  # likewise for the other calls of an open transaction
            producer.add_partitions_to_transaction([("orders", 0)])
        with pytest.raises(InvalidRecordError, match="max_batch_bytes"):
            producer.commit_transaction()
        epoch = producer.epoch
        producer.abort_transaction()
        assert producer.epoch == epoch + 1  # sequences were given out to unwritten batches: a new epoch
        assert [v for _, v in offsets_and_values(log, "small", 0, "read_uncommitted")] == [b"first"]
        assert offsets_and_values(log, "small", 0, "read_committed") == []
        producer.begin_transaction()
        producer.send_batch_queued("small", [b"next"], [b"k"], partition=0)
        producer.commit_transaction()
        assert [v for _, v in offsets_and_values(log, "small", 0, "read_committed")] == [b"next"]
        goes_on(producer, log, tps, b"goes on", [])


def test_abort_and_close_wait_for_queued_appends(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 1)
        producer = Producer(log, transactional_id="qa", linger_ms=0, batch_size=4096)
        producer.init_transactions()
        with pytest.raises(InvalidTxnStateError):  # outside a transaction
            producer.send_batch_queued("orders", [b"v"], [b"k"], partition=0)
        producer.begin_transaction()
        futures = [producer.send_batch_queued("orders", [b"v%d" % i] * 60, [b"k"] * 60, partition=0) for i in range(8)]
        producer.abort_transaction()
        assert all(f.done() and f.exception() is None for f in futures)  # written, then aborted
        assert values_seen(log, tps, "read_committed") == []
        producer.begin_transaction()
        assert producer.send_batch_queued("orders", [], [], partition=0).result() == (-1, 0)
        left = producer.send_batch_queued("orders", [b"left open"] * 60, [b"k"] * 60, partition=0)
        producer.close()  # inside a transaction: aborted once its queued appends are done; the writer stops
        assert left.done() and producer._writer is not None and not producer._writer.is_alive()
        assert values_seen(log, tps, "read_committed") == []
        with pytest.raises(InvalidTxnStateError, match="transactional"):
            Producer(log).send_batch_queued("orders", [b"v"], [b"k"], partition=0)


def test_a_queued_append_refused_by_a_full_disk_raises_that_error(tmp_path: Path) -> None:
    """The log's storage error (retried by the producer, then its outcome unknown) reaches the caller as the
    log raised it — the capture connector tells a full disk (retried) from other storage errors by it."""
    with full_disk(tmp_path, 1) as (log, tps):
        producer = Producer(log, transactional_id="qd", linger_ms=0, retries=1, retry_backoff_ms=1)
        producer.init_transactions()
        producer.begin_transaction()
        log.data_full = True
        refused = producer.send_batch_queued("orders", [b"refused"], [b"k"], partition=0)
        with pytest.raises(LogStorageError, match="No space left"):
            refused.result()
        log.data_full = False
        for call in (lambda: producer.send_batch_queued("orders", [b"v"], [b"k"], partition=0),
                     lambda: producer.add_partitions_to_transaction([("payments", 0)]),
                     lambda: producer.send_batch("orders", [b"v"], [b"k"], partition=0)):  # fmt: skip
            with pytest.raises(LogStorageError, match="No space left"):
                call()
        producer.abort_transaction()
        goes_on(producer, log, tps, b"after", [])


class SlowLog(Log):
    """A real log whose data appends each take ``delay`` seconds longer (a slow disk), so queued batches are still
    queued when the caller goes on."""

    delay = 0.0

    def append(self, topic: str, partition: int, batch: EncodedBatch | bytearray) -> AppendResult:
        if not batch[21] & 0x20:
            time.sleep(self.delay)
        return super().append(topic, partition, batch)


def test_commit_right_after_queued_appends_waits_for_them(tmp_path: Path) -> None:
    """The last call of the transaction is queued, then commit: everything queued is written before the commit
    marker (read_committed sees every record, in order), and every future is resolved by then."""
    path = tmp_path / "log"
    with Log(path) as log:
        tps = make_topics(log, 1)
    with SlowLog(path) as log:
        log.delay = 0.05
        producer = Producer(log, transactional_id="qc", linger_ms=0, batch_size=4096)
        producer.init_transactions()
        producer.begin_transaction()
        futures, expected = [], []
        for n in range(4):
            values = [b"c%d-%03d-" % (n, i) + b"x" * 90 for i in range(100)]  # ~3 batches per call
            futures.append(producer.send_batch_queued("orders", values, [b"k"] * 100, partition=0))
            expected += values
        assert not futures[-1].done()  # still queued behind the slow appends: commit must wait for it
        producer.commit_transaction()
        assert all(f.done() and f.exception() is None for f in futures)
        assert [v for _, v in offsets_and_values(log, "orders", 0, "read_committed")] == expected
        goes_on(producer, log, tps, b"after", expected)


def test_a_queued_sends_callback_may_call_the_producer(tmp_path: Path) -> None:
    """Futures are resolved with no producer lock held: a done-callback that sends (in the writer thread) does not
    hang the producer, and the transaction commits with every record."""
    with Log(tmp_path / "log") as log:
        tps = make_topics(log, 2)
        producer = Producer(log, transactional_id="qcb", linger_ms=0)
        producer.init_transactions()
        producer.begin_transaction()
        sent: list[Future[tuple[int, int]]] = []
        called = threading.Event()

        def callback(_: Future[tuple[int, int]]) -> None:
            try:  # more than the queue's room: from the writer thread, a queued send never waits for room
                sent.extend(producer.send_batch_queued("orders", [b"cb"], [b"k"], partition=1) for _ in range(6))
                producer.send_batch("orders", [b"cb sync"], [b"k"], partition=1)
            finally:
                called.set()

        producer.send_batch_queued("orders", [b"queued"], [b"k"], partition=0).add_done_callback(callback)
        assert called.wait(timeout=10)  # (a callback that hung would hang the producer's writer thread)
        producer.commit_transaction()
        assert len(sent) == 6 and all(f.result(timeout=10)[1] == 1 for f in sent)
        stored = [b"cb"] * 6 + [b"cb sync", b"queued"]
        assert sorted(values_seen(log, tps, "read_committed")) == stored
        goes_on(producer, log, tps, b"after", stored)


class Interrupted(BaseException):
    """What a signal handler raises in the caller's thread (as KeyboardInterrupt does on Ctrl-C)."""


def test_a_queued_send_interrupted_while_waiting_for_room_fails_the_transaction(tmp_path: Path) -> None:
    """The queue is full behind a slow disk; the next call is interrupted while it waits for room: its batches
    were given sequence numbers but never queued, so the transaction must abort (with a new epoch); the calls of
    the transaction raise the interruption; each send queued before it resolves (written, or skipped with the
    interruption once it is known); nothing hangs, and the producer goes on after the abort."""
    path = tmp_path / "log"
    with Log(path) as log:
        tps = make_topics(log, 1)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted("interrupted while waiting for room")

    with SlowLog(path) as log:
        log.delay = 0.2
        producer = Producer(log, transactional_id="qi", linger_ms=0, batch_size=4096)
        producer.init_transactions()
        producer.begin_transaction()
        queued = [producer.send_batch_queued("orders", [b"q%d" % i] * 60, [b"k"] * 60, partition=0)
                  for i in range(3)]  # fmt: skip
        previous = signal.signal(signal.SIGALRM, interrupt)
        caller = threading.get_ident()
        full = threading.Event()

        def interrupt_when_full() -> None:  # the caller is then waiting for room (each append takes 0.2 s)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not full.is_set():
                with producer._lock:
                    if sum(len(b) for _, b in producer._queue) >= 4:
                        full.set()
                time.sleep(0.01)
            time.sleep(0.05)
            signal.pthread_kill(caller, signal.SIGALRM)

        interrupter = threading.Thread(target=interrupt_when_full, daemon=True)
        try:
            interrupter.start()
            with pytest.raises(Interrupted):
                for i in range(40):  # one waits for room well before 40 (4 batches queued at most)
                    producer.send_batch_queued("orders", [b"w%d" % i] * 60, [b"k"] * 60, partition=0)
        finally:
            interrupter.join()
            signal.signal(signal.SIGALRM, previous)
        assert full.is_set()
        with pytest.raises(Interrupted):
            producer.commit_transaction()
        for f in queued:
            error = f.exception(timeout=30)
            assert error is None or isinstance(error, Interrupted)
        epoch = producer.epoch
        log.delay = 0.0
        producer.abort_transaction()
        assert producer.epoch == epoch + 1
        assert values_seen(log, tps, "read_committed") == []
        goes_on(producer, log, tps, b"after", [])


def test_batches_are_split_under_a_topics_max_batch_bytes(tmp_path: Path) -> None:
    """A producer whose batch size is above a topic's ``max_batch_bytes`` writes smaller batches there instead of
    having them refused (queued and synchronous sends alike); one record above the limit is still refused."""
    with Log(tmp_path / "log") as log:
        log.create_topic("small", 1, overrides={"max_batch_bytes": "8192"})
        producer = Producer(log, transactional_id="split", linger_ms=60_000, batch_size=2 << 20)
        producer.init_transactions()
        producer.begin_transaction()
        values = [b"v%04d-" % i + b"x" * 100 for i in range(400)]  # 43 kB in all: several batches of 8 KiB at most
        assert producer.send_batch_queued("small", values, [b"k"] * 400, partition=0).result(timeout=30)[1] == 400
        assert producer.send_batch("small", values, [b"k"] * 400, partition=0) == {0: (400, 400)}
        sent = [producer.send("small", v, key=b"k", partition=0) for v in values]  # lingering: batched by size
        producer.commit_transaction()
        assert [f.result().offset for f in sent] == list(range(800, 1200))
        assert [v for _, v in offsets_and_values(log, "small", 0, "read_committed")] == values * 3
        # skewed sizes: 300 small records then 10 of 3,000 bytes (an average would put 30 of the big ones in one
        # batch); records sent one by one, a big one after 4,000 pending bytes (the pending batch goes first)
        skewed = [b"s%03d" % i for i in range(300)] + [b"B" * 3000] * 10
        producer.begin_transaction()
        producer.send_batch_queued("small", skewed, [b"k"] * 310, partition=0).result(timeout=30)
        producer.send_batch("small", skewed, [b"k"] * 310, partition=0)
        one_by_one = [b"p" * 976] * 4 + [b"B" * 5000, b"after"]
        sent = [producer.send("small", v, key=b"k", partition=0) for v in one_by_one]
        producer.commit_transaction()
        assert all(f.result().offset >= 0 for f in sent)
        assert [v for _, v in offsets_and_values(log, "small", 0, "read_committed")] == (
            values * 3 + skewed * 2 + one_by_one
        )
        producer.begin_transaction()
        with pytest.raises(InvalidRecordError, match="max_batch_bytes"):
            producer.send_batch("small", [b"x" * 20_000], [b"k"], partition=0)
        producer.abort_transaction()
        producer.close()
