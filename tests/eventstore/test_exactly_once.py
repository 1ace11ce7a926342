"""Exactly once, consume → transform → produce, with a consumer group and kill -9.

Three worker processes in one group read ``in`` (6 partitions), write one output record
per input record to ``out``, and commit their input offsets *in the same transaction*
as the output (``send_offsets_to_transaction``). Workers are killed with -9 while they
run, some restarted with the same transactional id (fencing their former instance),
some not (the group moves their partitions; recovery aborts their open transaction).
read_committed on ``out`` must hold every input record exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

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
path, name = sys.argv[1], sys.argv[2]
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
    time.sleep(0.02)   # slow enough that kills land mid-stream
"""


def start(path: Path, name: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(path), name], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


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
    workers = {name: start(path, name) for name in ("a", "b", "c")}
    kills = 0
    deadline = time.monotonic() + (600 if SOAK else 120)
    try:
        with Log(path) as log:
            while time.monotonic() < deadline:
                time.sleep(0.1 + rng.random() * 0.2)
                done = len(set(committed_output(log)))
                if done >= n:
                    break
                if kills < (12 if SOAK else 3):
                    name = rng.choice(sorted(workers))
                    os.kill(workers[name].pid, signal.SIGKILL)
                    workers[name].wait()
                    kills += 1
                    if kills % 2:  # restart under the same transactional id: fences the dead instance
                        workers[name] = start(path, name)
                    else:  # gone for good: the group moves its partitions, recovery aborts its transaction
                        del workers[name]
                        if not workers:
                            workers["d"] = start(path, "d")
            outputs = committed_output(log)
            diagnosis = diagnose(log)
    finally:
        for proc in workers.values():
            proc.kill()
            proc.wait()
    assert kills >= 2
    expected = sorted(b"out:%d" % i for i in range(n))
    assert len(outputs) == len(set(outputs)), f"{len(outputs) - len(set(outputs))} duplicates in read_committed output"
    assert sorted(outputs) == expected, f"{len(set(expected) - set(outputs))} records missing; {diagnosis}"
