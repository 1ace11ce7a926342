"""The idempotent producer: retried batches are stored once; newer epochs fence older ones.

* A producer whose acknowledgements get lost (the append happens, then the caller sees a
  retriable error) retries the same batch; every record is stored exactly once, in order.
* The partition's producer state (sequence window, epochs) survives a clean reopen, a
  kill -9, and the loss of its snapshot file (rebuilt from batch headers).
* A transactional producer restarted with the same transactional id (new epoch) fences
  the old instance, at the coordinator and at the partitions, also across processes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from readiness import wait_until

from eventstore.errors import OutOfOrderSequenceError, ProducerFencedError, RetriableError
from eventstore.log import Log
from eventstore.partition_log import AppendResult
from eventstore.producer import Producer
from eventstore.producer_state import PRODUCER_STATE_FILE
from eventstore.record_batch import EncodedBatch, build_records, encode_batch
from eventstore.topic import TopicConfig

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
ROOT = Path(__file__).resolve().parents[2]


class LossyAckLog(Log):
    """A real log whose acknowledgements sometimes get lost (fault injection, not a fake).

    With probability ``p_after`` the batch is appended and then a RetriableError is raised
    (the caller cannot know it was stored); with ``p_before`` the error comes first.
    """

    def __init__(self, path: Path, *, seed: int, p_after: float, p_before: float) -> None:
        super().__init__(path)
        self.rng = random.Random(seed)
        self.p_after = p_after
        self.p_before = p_before
        self.lost_acks = 0
        self.duplicates = 0

    def append(self, topic: str, partition: int, batch: EncodedBatch | bytearray) -> AppendResult:
        roll = self.rng.random()
        if roll < self.p_before:
            raise RetriableError("injected: request failed before reaching the log")
        result = super().append(topic, partition, batch)
        if result.duplicate:
            self.duplicates += 1
        if roll < self.p_before + self.p_after:
            self.lost_acks += 1
            raise RetriableError("injected: acknowledgement lost after the append")
        return result


def all_values(log: Log, topic: str, partition: int) -> list[bytes]:
    out: list[bytes] = []
    offset = 0
    while True:
        fetched = log.read(topic, partition, offset)
        if not fetched:
            return out
        for f in fetched:
            out.extend(v for v in f.records.column(3).to_pylist() if v is not None)
            offset = f.header.next_offset


def test_lost_acknowledgements_never_store_a_batch_twice(tmp_path: Path) -> None:
    log = LossyAckLog(tmp_path / "log", seed=7, p_after=0.3, p_before=0.1)
    log.create_topic("t", 3)
    n = 20_000 if SOAK else 3_000
    with Producer(log, linger_ms=1, batch_size=2_000, retries=50, retry_backoff_ms=0) as producer:
        futures = [producer.send("t", b"v%06d" % i, key=b"k%d" % (i % 37)) for i in range(n)]
        for i in range(0, n, 500):  # and the vectorized path
            producer.send_batch("t", [b"b%06d" % j for j in range(i, i + 500)], [b"k%d" % (j % 37) for j in range(500)])
        producer.flush()
        offsets = [f.result() for f in futures]
    assert log.lost_acks > 50 and log.duplicates == log.lost_acks  # every lost ack was retried and deduplicated
    seen: list[bytes] = []
    for p in range(3):
        values = all_values(log, "t", p)
        assert len(values) == len(set(values)), f"partition {p} stored a batch twice"
        singles = [v for v in values if v.startswith(b"v")]
        assert singles == sorted(singles), f"partition {p} out of send order"
        seen.extend(values)
    assert sorted(seen) == sorted([b"v%06d" % i for i in range(n)] + [b"b%06d" % i for i in range(n // 500 * 500)])
    # the metadata of each acknowledged record points at that record
    for meta in offsets[:: max(1, n // 200)]:
        fetched = log.read("t", meta.partition, meta.offset)
        f = fetched[0]
        deltas = f.records.column(0).to_pylist()
        assert f.records.column(3)[deltas.index(meta.offset - f.header.base_offset)].as_py().startswith(b"v")
    log.close()


def _batch(pid: int, epoch: int, seq: int, n: int, *, tag: bytes = b"x") -> EncodedBatch:
    records = build_records([b"k"] * n, [tag + b"%d" % i for i in range(n)])
    return encode_batch(
        records, first_timestamp=1, max_timestamp=1, producer_id=pid, producer_epoch=epoch, base_sequence=seq
    )


def test_sequence_rules(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        log.create_topic("t", 1)
        first = log.append("t", 0, _batch(5, 0, 0, 3))
        assert (first.base_offset, first.duplicate) == (0, False)
        assert log.append("t", 0, _batch(5, 0, 3, 2)).base_offset == 3
        again = log.append("t", 0, _batch(5, 0, 0, 3))  # an older batch still in the window
        assert (again.base_offset, again.last_offset, again.duplicate) == (0, 2, True)
        with pytest.raises(OutOfOrderSequenceError, match="expected 5"):
            log.append("t", 0, _batch(5, 0, 7, 1))  # a gap
        with pytest.raises(OutOfOrderSequenceError, match="must start at sequence 0"):
            log.append("t", 0, _batch(5, 1, 4, 1))  # a new epoch starts at 0
        assert log.append("t", 0, _batch(5, 1, 0, 1)).base_offset == 5
        with pytest.raises(ProducerFencedError, match="epoch 0 is fenced by epoch 1"):
            log.append("t", 0, _batch(5, 0, 5, 1))
        assert log.append("t", 0, _batch(9, 0, 0, 1)).base_offset == 6  # other producers are independent
        assert log.append("t", 0, _batch(-1, -1, -1, 1)).base_offset == 7  # non-idempotent: no checks
        assert log.partition("t", 0).log_end_offset() == 8


@pytest.mark.parametrize("how", ["clean_close", "lost_snapshot", "roll_then_lost_snapshot"])
def test_producer_state_survives_reopen(tmp_path: Path, how: str) -> None:
    path = tmp_path / "log"
    with Log(path) as log:
        log.create_topic("t", 1, TopicConfig(segment_bytes=4096))
        seq = 0
        for i in range(40 if how == "roll_then_lost_snapshot" else 3):
            log.append("t", 0, _batch(3, 0, seq, 4, tag=b"%d-" % i))
            seq += 4
        last = _batch(3, 0, seq - 4, 4, tag=b"%d-" % (i))
    if how != "clean_close":
        (path / "t-0" / PRODUCER_STATE_FILE).unlink()
    with Log(path) as log:
        result = log.append("t", 0, last)
        assert result.duplicate, "the retry of the last batch was stored again after reopen"
        end = log.partition("t", 0).log_end_offset()
        assert log.append("t", 0, _batch(3, 0, seq, 1)).base_offset == end
        with pytest.raises(OutOfOrderSequenceError):
            log.append("t", 0, _batch(3, 0, seq + 5, 1))


KILLED_WRITER = r"""
import sys, os
from eventstore.log import Log
from eventstore.record_batch import build_records, encode_batch
log = Log(sys.argv[1])
pid = int(sys.argv[4])  # each writer instance is a new producer
seq = 0
i = 0
while True:
    records = build_records([b"k"] * 5, [b"%d-%d" % (i, j) for j in range(5)])
    batch = encode_batch(
        records, first_timestamp=1, max_timestamp=1, producer_id=pid, producer_epoch=0, base_sequence=seq
    )
    log.append("t", 0, batch)
    with open(sys.argv[2], "wb") as f:   # the last acknowledged batch, for the parent to retry
        f.write(bytes(batch))
    os.replace(sys.argv[2], sys.argv[3])
    seq += 5
    i += 1
"""


def test_producer_state_survives_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with Log(path) as log:
        log.create_topic("t", 1, TopicConfig(segment_bytes=64 << 10))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for round_ in range(6 if SOAK else 3):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                KILLED_WRITER,
                str(path),
                str(tmp_path / "acked.tmp"),
                str(tmp_path / "acked"),
                str(11 + round_),
            ],
            env=env,
        )
        try:  # the moment: once it acknowledged a batch (then it appends batch after batch)
            wait_until((tmp_path / "acked").exists, f"writer {round_}'s first acknowledged batch", alive=proc)
            time.sleep(0.3 * random.random())
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"round {round_}: the writer exited by itself ({proc.returncode})"
        last = bytearray((tmp_path / "acked").read_bytes())
        with Log(path) as log:
            end = log.partition("t", 0).log_end_offset()
            retried = log.append("t", 0, last)
            # the acknowledged batch is either the last stored one or (if the writer got one
            # more batch in before the kill) the one before it: both are in the window
            assert retried.duplicate, f"round {round_}: retry after kill -9 stored the batch twice"
            assert log.partition("t", 0).log_end_offset() == end
        (tmp_path / "acked").unlink()


ZOMBIE = r"""
import sys, time
from eventstore.log import Log
from eventstore.producer import Producer
from eventstore.errors import ProducerFencedError
log = Log(sys.argv[1])
p = Producer(log, transactional_id="orders-app", linger_ms=0)
p.init_transactions()
p.begin_transaction()
p.send("out", b"zombie-first", key=b"k0").result()
print("ready", flush=True)  # its open transaction holds a record: the fresh instance must abort it
n = 0
try:
    while True:
        p.send("out", b"zombie-%d" % n, key=b"k%d" % (n % 4)).result()
        n += 1
        time.sleep(0.002)
except ProducerFencedError as e:
    print("fenced", n, e, flush=True)
"""


def test_new_epoch_fences_the_old_instance_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with Log(path) as log:
        log.create_topic("out", 4)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    zombie = subprocess.Popen([sys.executable, "-c", ZOMBIE, str(path)], env=env, stdout=subprocess.PIPE, text=True)
    assert zombie.stdout is not None
    assert zombie.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # let it write into its open transaction
    with Log(path) as log:
        fresh = Producer(log, transactional_id="orders-app")
        fresh.init_transactions()  # bumps the epoch, aborts the zombie's open transaction
        out, _ = zombie.communicate(timeout=30)
        assert out.startswith("fenced"), out
        fresh.begin_transaction()
        fresh.send("out", b"fresh", key=b"k0").result()
        fresh.commit_transaction()
        fresh.close()
        for p in range(4):
            plog = log.partition("out", p)
            assert plog.last_stable_offset() == plog.log_end_offset()
        aborted = [a for p in range(4) for a in log.partition("out", p).aborted_transactions(0, 1 << 62)]
        assert aborted, "the zombie's open transaction was not aborted"


def test_coordinator_fences_commit_of_old_instance(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        log.create_topic("out", 2)
        old = Producer(log, transactional_id="app")
        old.init_transactions()
        old.begin_transaction()
        old.send("out", b"a", key=b"a").result()
        new = Producer(log, transactional_id="app")
        new.init_transactions()
        assert new.epoch == old.epoch + 2  # one bump to abort the open transaction, one for the new instance
        with pytest.raises(ProducerFencedError):
            old.commit_transaction()
        with pytest.raises(ProducerFencedError):
            old.begin_transaction()
        new.close()
