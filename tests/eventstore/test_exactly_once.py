"""Exactly once, consume → transform → produce, with a consumer group and kill -9.

Three worker processes in one group read ``in`` (6 partitions), write one output record
per input record to ``out``, and commit their input offsets *in the same transaction*
as the output (``send_offsets_to_transaction``). Workers are killed with -9 while they
run, some restarted with the same transactional id (fencing their former instance),
some not (the group moves their partitions; recovery aborts their open transaction).
read_committed on ``out`` must hold every input record exactly once.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from readiness import file_size, wait_for_progress, wait_until

from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.producer import Producer

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
IN_PARTITIONS = 6

WORKER = r"""
import sys, time
from eventstore.consumer import Consumer
from eventstore.log import Log
from eventstore.producer import Producer
path, name, commits = sys.argv[1], sys.argv[2], open(sys.argv[3], "a", buffering=1)
log = Log(path)
producer = Producer(log, transactional_id=f"eos-{name}", linger_ms=1)
producer.init_transactions()
consumer = Consumer(log, group_id="eos", enable_auto_commit=False, isolation_level="read_committed", client_id=name)
consumer.subscribe(["in"])
print("ready", flush=True)
while True:
    records = consumer.poll(timeout_ms=100, max_records=25)
    if not records:
        continue
    producer.begin_transaction()
    for r in records:
        producer.send("out", b"out:" + r.value, key=r.key)
    positions = {tp: consumer.position(tp) for tp in consumer.assignment()}
    producer.send_offsets_to_transaction(positions, "eos")
    producer.commit_transaction()
    commits.write(f"{len(records)}\n")   # for the test: this instance did real work
    time.sleep(0.02)   # slow enough that kills land mid-stream
"""


class Worker:
    """One worker process; ``commits`` holds a line per transaction it committed."""

    def __init__(self, path: Path, name: str, instance: int) -> None:
        self.commits = path.parent / f"commits-{name}-{instance}"
        argv = [sys.executable, "-c", WORKER, str(path), name, str(self.commits)]
        self.proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def working(self) -> bool:
        """Whether it committed a transaction (it owns partitions and has records to move)."""
        return file_size(self.commits) > 0


def diagnose(log: Log) -> str:
    """Where things stand, for the failure message: unstable partitions and open transactions."""
    from eventstore.transactions import TransactionCoordinator

    parts = []
    for topic in log.topics():
        for p in range(log.topic(topic).partitions):
            plog = log.partition(topic, p)
            lso, end = plog.last_stable_offset(), plog.log_end_offset()
            if lso != end:
                parts.append(f"{topic}-{p} LSO {lso} < end {end}")
    txns = [f"{m.transactional_id}:{m.state.value}@{m.epoch}" for m in TransactionCoordinator(log).describe()]
    members = sorted(os.listdir(log.path / "_groups" / "eos" / "members")) if (log.path / "_groups").exists() else []
    return f"unstable: {parts}; transactions: {txns}; members: {members}"


def committed_output(log: Log) -> list[bytes]:
    out: list[bytes] = []
    with Consumer(log, isolation_level="read_committed", enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition("out", p) for p in range(3)])
        consumer.seek_to_beginning()
        while True:
            records = consumer.poll(timeout_ms=0)
            if not records:
                return out
            out.extend(r.value for r in records if r.value is not None)


def test_consume_transform_produce_exactly_once_under_kill_9(tmp_path: Path) -> None:
    rng = random.Random(3)
    path = tmp_path / "log"
    n = 20_000 if SOAK else 6_000  # enough work that the kills land before it is all done
    with Log(path) as log:
        log.create_topic("in", IN_PARTITIONS)
        log.create_topic("out", 3)
        with Producer(log) as producer:
            producer.send_batch("in", [b"%d" % i for i in range(n)], [b"k%d" % (i % 97) for i in range(n)])
    started = itertools.count()
    workers = {name: Worker(path, name, next(started)) for name in ("a", "b", "c")}
    kills = 0
    try:
        with Log(path) as log:

            def done() -> int:
                return len(set(committed_output(log)))

            for _ in range(12 if SOAK else 3):
                # The victim is a worker that has committed since it started (a restarted one must first
                # rejoin the group and get partitions): the kill lands while it moves records.
                working = wait_until(
                    lambda: [w for w in sorted(workers) if workers[w].working()] or done() >= n,
                    "a worker to commit a transaction",
                    every=0.1,
                )
                if working is True:
                    break  # everything is done: nothing left to kill in
                name = rng.choice(working)
                time.sleep(rng.uniform(0.0, 0.2))
                os.kill(workers[name].proc.pid, signal.SIGKILL)
                workers[name].proc.wait()
                kills += 1
                if kills % 2:  # restart under the same transactional id: fences the dead instance
                    workers[name] = Worker(path, name, next(started))
                else:  # gone for good: the group moves its partitions, recovery aborts its transaction
                    del workers[name]
                    if not workers:
                        workers["d"] = Worker(path, "d", next(started))
            # a slow machine only makes this take longer: it fails when the output stops growing
            wait_for_progress(done, n, "the workers to write every input record once", stall=120, every=0.2)
            outputs = committed_output(log)
            diagnosis = diagnose(log)
    finally:
        for worker in workers.values():
            worker.proc.kill()
            worker.proc.wait()
    assert kills >= 2
    expected = sorted(b"out:%d" % i for i in range(n))
    assert len(outputs) == len(set(outputs)), f"{len(outputs) - len(set(outputs))} duplicates in read_committed output"
    assert sorted(outputs) == expected, f"{len(set(expected) - set(outputs))} records missing; {diagnosis}"
