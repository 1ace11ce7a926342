"""pgoutput's streamed transactions (protocol 2): nothing of an aborted one is stored, a committed one
is stored once, and memory stays bounded whatever its size.

The test database sets ``logical_decoding_work_mem = 64kB`` (the smallest; its walsenders
read it), so every transaction over 64 kB reaches the connector before it commits, in
Stream Start/Stop blocks that the decoder spills to disk (capture/decoders/pgoutput/streams.py)
and decodes at Stream Commit. ``pg_stat_replication_slots.stream_txns`` proves the server
did stream. Size: one transaction of 1 GB of row data (1,000,000 rows of 1,000 bytes) under a cap of 60 MB
of memory growth; ``TIDELINE_SOAK=1``: 3 GB.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, sql
from workload import soak

from capture.messages import Plugin
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "streamed")
    sql(dsn, f"ALTER DATABASE {dsn.rsplit('/', 1)[1]} SET logical_decoding_work_mem = '64kB'")
    yield dsn
    drop_slots(dsn)


def streamed_transactions(dsn: str, slot: str) -> int:
    """How many transactions the server has streamed before their commit on ``slot``."""
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return int(row[0]) if row else 0


def test_a_streamed_transaction_that_aborts_stores_nothing(db: str, tmp_path: Path) -> None:
    """Aborted whole, or one of its subtransactions rolled back: only what committed reaches the log."""
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, pad text)")
    capture(log_dir, db, plugin=Plugin.PGOUTPUT)
    with psycopg.connect(db) as c:  # streamed (≫ 64 kB), then rolled back
        c.execute("INSERT INTO t SELECT g, repeat('a', 200) FROM generate_series(1, 5000) g")
        c.rollback()
        c.execute("INSERT INTO t SELECT g, repeat('b', 200) FROM generate_series(10001, 12000) g")
        with pytest.raises(psycopg.errors.UniqueViolation), c.transaction():  # a savepoint, rolled back
            c.execute("INSERT INTO t SELECT g, repeat('c', 200) FROM generate_series(20001, 23000) g")
            c.execute("SELECT pg_logical_emit_message(true, 'rolled back', 'in the savepoint')")
            c.execute("INSERT INTO t VALUES (10001, 'duplicate')")
        c.execute("UPDATE t SET pad = 'd' WHERE id <= 10100")
        c.execute("SELECT pg_logical_emit_message(true, 'kept', 'committed')")
        c.commit()
    stats = capture(log_dir, db, plugin=Plugin.PGOUTPUT)
    assert streamed_transactions(db, "t") >= 2  # both did stream before they ended
    assert stats.reconnects == 0  # nothing the stream could not tell
    changes = events(log_dir, "cdc.public.t")
    assert [(e["op"], e["after"]["id"]) for e in changes] == [("c", i) for i in range(10001, 12001)] + [
        ("u", i) for i in range(10001, 10101)
    ]
    assert [e["source"]["event_index"] for e in changes] == list(range(2100))
    assert stats.transactions == 1 and len({e["source"]["txId"] for e in changes}) == 1
    assert [m["message"]["prefix"] for m in events(log_dir, "cdc.message")] == ["kept"]


def test_a_message_the_stream_cannot_attribute_is_settled_by_the_server(
    db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pgoutput 15 tags a transactional message with the top-level xid: emitted in a savepoint before its
    first change, then rolled back, it looks like its parent's. The connector reconnects without streaming
    (the server filters the transaction itself): the message is not stored, and nothing twice."""
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, pad text)")
    capture(log_dir, db, plugin=Plugin.PGOUTPUT)
    with psycopg.connect(db) as c:
        c.execute("INSERT INTO t SELECT g, repeat('b', 200) FROM generate_series(1, 2000) g")
        with pytest.raises(psycopg.errors.UniqueViolation), c.transaction():
            c.execute("SELECT pg_logical_emit_message(true, 'whose', 'the savepoint''s')")
            c.execute("INSERT INTO t SELECT g, repeat('c', 200) FROM generate_series(3001, 6000) g")
            c.execute("INSERT INTO t VALUES (1, 'duplicate')")
        c.commit()
    with caplog.at_level(logging.WARNING, logger="capture.connector"):
        stats = capture(log_dir, db, plugin=Plugin.PGOUTPUT)
    assert any("reconnecting without streaming" in r.getMessage() for r in caplog.records), caplog.text
    assert stats.reconnects == 1
    assert [e["after"]["id"] for e in events(log_dir, "cdc.public.t")] == list(range(1, 2001))
    assert events(log_dir, "cdc.message") == []


MEMORY_CHILD = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from capture.connector import CaptureConfig, Connector
from capture.messages import Plugin
from eventstore.log import Log
with Log(sys.argv[1]) as log:
    Connector(CaptureConfig(dsn=sys.argv[2], slot="t", topic_prefix="cdc", exit_when_caught_up=True,
                            batch_bytes=1 << 20, plugin=Plugin.PGOUTPUT), log).run()
# VmHWM: this process's own peak (ru_maxrss also carries the parent's peak over fork/exec)
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def test_a_big_streamed_transaction_is_stored_once_in_bounded_memory(db: str, tmp_path: Path) -> None:
    """A 1 GB transaction (soak: 3 GB) reaches the log once, in order, while the connector's peak memory grows by
    less than MEMORY_CAP_KB over an idle run's: the transaction waits on disk, its events are committed to the log
    in 1 MiB batches as it is decoded."""
    rows, pad = (3_000_000, 1000) if soak() else (1_000_000, 1000)
    sql(db, "CREATE TABLE big (id int PRIMARY KEY, payload text)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", MEMORY_CHILD, str(tmp_path / "log"), db]
    baseline_kb = int(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split()[-1])
    sql(db, f"INSERT INTO big SELECT g, repeat('p', {pad}) FROM generate_series(1, {rows}) g")  # one transaction
    second = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    peak_kb = int(second.stdout.split()[-1])
    print(f"{rows:,} rows ({rows * pad / 1e9:.1f} GB of row data) in one streamed transaction: peak RSS {peak_kb} kB, "
          f"{peak_kb - baseline_kb} kB over idle")  # fmt: skip
    assert streamed_transactions(db, "t") >= 1
    assert "streamed transaction" in second.stderr  # decoded from its spill file at Stream Commit
    assert stored_ids(tmp_path / "log", "cdc.public.big", pad) == rows  # once each, in order, whole
    assert peak_kb - baseline_kb < MEMORY_CAP_KB, f"peak RSS grew by {peak_kb - baseline_kb} kB"
    capture(tmp_path / "log", db, plugin=Plugin.PGOUTPUT)  # a restart stores nothing twice
    assert stored_ids(tmp_path / "log", "cdc.public.big", pad) == rows


MEMORY_CAP_KB = 60_000


def stored_ids(log_dir: Path, topic: str, pad: int) -> int:
    """How many creates ``topic`` holds, checking as it reads (one batch at a time: a GB of events is never held)
    that their ids run 1, 2, 3, … and each carries its whole payload."""
    expected = 1
    with Log(log_dir) as log, Consumer(log, isolation_level="read_committed", enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(topic, p) for p in range(log.topic(topic).partitions)])
        consumer.seek_to_beginning()
        while batch := consumer.poll(timeout_ms=0):
            for r in batch:
                assert r.value is not None and r.key == b'{"id":%d}' % expected, (r.key, expected)
                event = orjson.loads(r.value)
                assert event["op"] == "c" and event["after"] == {"id": expected, "payload": "p" * pad}, expected
                expected += 1
    return expected - 1
