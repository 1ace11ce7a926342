"""Streaming appends a log transaction as it fills (capture.writer.LogWriter.append_ahead), not only at its commit.

The embedded log's producer writes and syncs those appends in its writer thread while the connector decodes the
next changes; what was appended stays invisible until the commit, and the transaction stays bounded by
``batch_bytes`` / ``batch_events`` whatever was appended of it. Checked against a real Postgres with both plugins:
the log holds every change once, in order, in as many log transactions as the bound asks for, each written as
several record batches; and a connector killed with events appended ahead in its open transaction leaves none of
them visible, its restart storing each change once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, sql

from capture import writer
from capture.messages import Plugin
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "cdc.public.acc"
AHEAD = 4 << 10  # append every 4 KiB of events
BATCH = 64 << 10  # commit every 64 KiB
TRANSACTIONS, ROWS = 400, 10  # 4,000 INSERTs then 4,000 UPDATEs in 10-row transactions (~3.5 KB of events each)


@pytest.fixture
def db(postgres: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(postgres, request.node.name[:20].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


def workload(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for t in range(TRANSACTIONS):
            c.execute("INSERT INTO acc SELECT g, g, md5(g::text) FROM generate_series(%s::int, %s) g",
                      (t * ROWS, t * ROWS + ROWS - 1))  # fmt: skip
        for t in range(TRANSACTIONS):
            lo = t * ROWS
            c.execute("UPDATE acc SET balance = balance + 1 WHERE id BETWEEN %s AND %s", (lo, lo + ROWS - 1))


def expected() -> list[tuple[str, int, int]]:
    n = TRANSACTIONS * ROWS
    return [("c", i, i) for i in range(n)] + [("u", i, i + 1) for i in range(n)]


def stored(log_dir: Path) -> list[tuple[str, int, int]]:
    return [(e["op"], e["after"]["id"], e["after"]["balance"]) for e in events(log_dir, TOPIC)]


def record_batches(log_dir: Path) -> int:
    """The data batches of the table topic (read_committed: the committed transactions' only)."""
    n = 0
    with Log(log_dir) as log, Consumer(log, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(TOPIC, 0)])
        consumer.seek_to_beginning()
        while batch := consumer.poll(timeout_ms=0):
            n += len(batch.batches)
    return n


def test_transactions_appended_ahead_stay_bounded_and_hold_each_change_once(
    db: str, tmp_path: Path, plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    sql(db, "CREATE TABLE acc (id int PRIMARY KEY, balance bigint, note text)")
    log_dir = tmp_path / "log"
    capture(log_dir, db, plugin=plugin)  # the slot (and the empty table's snapshot)
    workload(db)
    monkeypatch.setattr(writer, "APPEND_AHEAD_BYTES", AHEAD)
    # no commit for age: only the bound (or the end) commits, so the count of log transactions shows the bound;
    # uncompressed, so that the stored bytes are the bytes the bound counts
    stats = capture(log_dir, db, plugin=plugin, batch_bytes=BATCH, linger_ms=60_000, max_linger_ms=60_000,
                    compression="none")  # fmt: skip
    assert stored(log_dir) == expected()
    with Log(log_dir) as log:
        size = sum(f.stat().st_size for f in (log.path / f"{TOPIC}-0").glob("*.log"))
    # bounded by batch_bytes although each transaction was appended in pieces (each resets the buffer's count):
    # one transaction holds at most the bound and one source transaction more
    assert stats.batches >= size // (BATCH + (8 << 10)) >= 20, (stats.batches, size)
    # the pieces: several record batches per log transaction
    assert record_batches(log_dir) >= 3 * stats.batches, (record_batches(log_dir), stats.batches)


KILLED_CHILD = r"""
import os, sys
from pathlib import Path
from capture import writer
from capture.connector import CaptureConfig, Connector, SnapshotMode
from capture.messages import Plugin
from eventstore.log import Log

log_dir, dsn, plugin, ahead, batch = sys.argv[1], sys.argv[2], Plugin(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
writer.APPEND_AHEAD_BYTES = ahead
commit = writer.LogWriter.commit
appended_ahead = [0]

def dying_commit(self, position):
    # the third log transaction that holds events appended ahead dies before its commit, as a kill -9 would
    if self.appended_bytes and position is not None:
        appended_ahead[0] += 1
        if appended_ahead[0] == 3:
            os._exit(17)
    return commit(self, position)

writer.LogWriter.commit = dying_commit
config = CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", plugin=plugin, snapshot=SnapshotMode.NEVER,
                       exit_when_caught_up=True, batch_bytes=batch)
with Log(Path(log_dir)) as log:
    Connector(config, log).run()
"""


def test_kill_with_events_appended_ahead_shows_none_of_them(db: str, tmp_path: Path, plugin: Plugin) -> None:
    sql(db, "CREATE TABLE acc (id int PRIMARY KEY, balance bigint, note text)")
    log_dir = tmp_path / "log"
    capture(log_dir, db, plugin=plugin)
    workload(db)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", KILLED_CHILD, str(log_dir), db, plugin.value, str(AHEAD), str(BATCH)]
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 17, killed.stderr[-2000:]
    partial = stored(log_dir)
    assert 0 < len(partial) < len(expected())  # two log transactions committed, the third's appends not visible
    assert partial == expected()[: len(partial)]
    capture(log_dir, db, plugin=plugin, batch_bytes=BATCH)
    assert stored(log_dir) == expected()
