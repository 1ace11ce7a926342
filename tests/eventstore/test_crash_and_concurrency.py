"""Processes that die and processes that share: kill -9 of producers, many writers at once.

* kill -9 of a producing process at random moments, many times: every reopen succeeds,
  every acknowledged record is there at its offset, offsets stay dense (nothing after a
  gap), and a torn tail never turns into an error.
* 4 processes appending to one topic while the test reads and another process compacts
  in a loop: every acknowledged record is read exactly once, in per-partition offset order.

Sizes grow with ``TIDELINE_SOAK=1`` (make soak).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from readiness import file_size, wait_for_growth

from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log

SOAK = os.environ.get("TIDELINE_SOAK") == "1"

PRODUCER = r"""
import sys
from eventstore.log import Log
from eventstore.producer import Producer
path, topic, tag, count, ack_path = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
big = len(sys.argv) > 6
log = Log(path)
with open(ack_path, "a", buffering=1) as acks, Producer(log, linger_ms=2, batch_size=1 << 20) as producer:
    i = 0
    while count < 0 or i < count:
        n = 3000 if big and i % 2 else 1 + i % 7
        keys = [f"{tag}-{i}-{j}".encode() for j in range(n)]
        futures = [producer.send(topic, k * (20 if big else 1), key=k) for k in keys]
        producer.flush()
        acks.write("".join(f"{f.result().partition} {f.result().offset} {k.decode()}\n" for f, k in zip(futures, keys)))
        i += 1
log.close()
"""

COMPACTOR = r"""
import sys, time
from eventstore.log import Log
from eventstore.cleaner import compact_partition
log = Log(sys.argv[1])
deadline = time.time() + float(sys.argv[3])
passes = 0
while time.time() < deadline:
    for p in range(log.topic(sys.argv[2]).partitions):
        compact_partition(log.partition(sys.argv[2], p))
    passes += 1
print(passes)
"""


def _read_acks(path: Path) -> dict[tuple[int, int], str]:
    acks: dict[tuple[int, int], str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) == 3:  # the last line may be cut by the kill
                acks[(int(parts[0]), int(parts[1]))] = parts[2]
    return acks


def _read_everything(log: Log, topic: str) -> dict[int, list[tuple[int, bytes | None, bytes | None]]]:
    partitions = log.topic(topic).partitions
    consumer = Consumer(log)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    consumer.seek_to_beginning()
    out: dict[int, list[tuple[int, bytes | None, bytes | None]]] = {p: [] for p in range(partitions)}
    while polled := consumer.poll():
        for r in polled:
            out[r.partition].append((r.offset, r.key, r.value))
    return out


def test_kill_minus_9_of_producers_loses_nothing_acknowledged(tmp_path: Path) -> None:
    rng = random.Random(7)
    iterations = 200 if SOAK else 12
    with Log(tmp_path / "log") as log:
        log.create_topic("k", 2, overrides={"segment_bytes": str(256 * 1024)})
    acks_path = tmp_path / "acks"
    for i in range(iterations):
        acked = file_size(acks_path)
        proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, str(tmp_path / "log"), "k", f"r{i}", "-1", str(acks_path), "big"]
        )
        try:
            # The moment is chosen once this producer acknowledged its first batch (its start-up takes
            # ~0.3 s on a quiet machine, seconds under load): then it is writing, batch after batch.
            wait_for_growth(acks_path, acked, f"producer {i}'s first acknowledgement", alive=proc)
            time.sleep(rng.uniform(0.0, 0.9))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"producer {i} exited by itself ({proc.returncode})"
        with Log(tmp_path / "log") as log:
            stored = _read_everything(log, "k")
            for p, records in stored.items():
                offsets = [o for o, _, _ in records]
                assert offsets == list(range(len(offsets))), f"partition {p}: offsets not dense after kill {i}"
            by_offset = {(p, o): k for p, recs in stored.items() for o, k, _ in recs}
            acks = _read_acks(acks_path)
            for (p, o), key in acks.items():
                assert by_offset.get((p, o)) == key.encode(), f"acknowledged {key} at {p}/{o} lost after kill {i}"
            assert any(key.startswith(f"r{i}-") for key in acks.values()), f"producer {i} acknowledged nothing"


def test_four_writers_a_reader_and_a_compactor_share_one_topic(tmp_path: Path) -> None:
    per_writer = 4000 if SOAK else 400  # rounds of 1..7 records
    log_dir = tmp_path / "log"
    with Log(log_dir) as log:
        log.create_topic("s", 2, overrides={"segment_bytes": str(64 * 1024), "cleanup_policy": "compact"})
    acks = [tmp_path / f"acks{w}" for w in range(4)]
    writers = [
        subprocess.Popen([sys.executable, "-c", PRODUCER, str(log_dir), "s", f"w{w}", str(per_writer), str(acks[w])])
        for w in range(4)
    ]
    compactor = subprocess.Popen(
        [sys.executable, "-c", COMPACTOR, str(log_dir), "s", "25" if SOAK else "8"], stdout=subprocess.PIPE, text=True
    )
    seen: dict[int, list[tuple[int, bytes | None]]] = {0: [], 1: []}
    with Log(log_dir) as log:
        consumer = Consumer(log)
        consumer.assign([TopicPartition("s", 0), TopicPartition("s", 1)])
        consumer.seek_to_beginning()
        while True:
            done = all(w.poll() is not None for w in writers)
            polled = consumer.poll(timeout_ms=20)
            for r in polled:
                seen[r.partition].append((r.offset, r.key))
            if done and not polled:
                break
        passes = int(compactor.communicate(timeout=120)[0].strip() or 0)
    assert all(w.returncode == 0 for w in writers)
    assert compactor.returncode == 0 and passes > 0
    expected = {}
    for path in acks:
        expected.update(_read_acks(path))
    assert len(expected) == sum(len(range(1, 8)) * 0 + 1 + i % 7 for i in range(per_writer)) * 4
    got: dict[tuple[int, int], str] = {}
    for p, records in seen.items():
        offsets = [o for o, _ in records]
        assert offsets == sorted(set(offsets)), f"partition {p}: not read exactly once in offset order"
        for o, k in records:
            got[(p, o)] = (k or b"").decode()
    assert got == expected  # keys are unique, so compaction may rewrite but never drop them
