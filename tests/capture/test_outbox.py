"""Outbox routing with real commands and real capture: the commands' ``events`` table → ``events.<type>``.

Commands of the reservations example (commands/, examples/reservations) append rows to
the migrated ``events`` table; the connector, with ``outbox_table="public.events"``,
routes each row to ``events.<stream_type>``: key = stream id, value = the event, header
``event_type``. Checked: every stored event exactly once, per stream in version order,
per partition in commit order — also when the connector is killed (SIGKILL) again and
again while commands run; the table's own topic is never written; an UPDATE of an event
row (possible only with the append-only trigger disabled) is flagged, not routed. The routing
and the kill test run with both plugins.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from capture_util import capture, drop_slots, fresh_database, sql, stored_position
from readiness import wait_until
from workload import soak

import migrations
from capture.connector import SnapshotMode
from capture.messages import Plugin
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.topic import CleanupPolicy
from examples.reservations.demo_commands import run_commands
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = {"outbox_table": "public.events", "partitions": 2}


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "outbox")
    migrations.upgrade(dsn)
    yield dsn
    drop_slots(dsn)


def routed(log_dir: Path) -> dict[str, list[tuple[int, str, dict[str, Any], dict[str, bytes | None]]]]:
    """topic → [(partition, key, value, headers)] of every ``events.*`` topic, partition by partition."""
    out: dict[str, list[tuple[int, str, dict[str, Any], dict[str, bytes | None]]]] = {}
    with Log(log_dir) as log:
        for topic in sorted(t for t in log.topics() if t.startswith("events.")):
            meta = log.topic(topic)
            assert meta.config.cleanup_policy is CleanupPolicy.DELETE and meta.config.retention_ms == -1, meta
            rows = out.setdefault(topic, [])
            for p in range(meta.partitions):
                with Consumer(log, enable_auto_commit=False) as consumer:
                    consumer.assign([TopicPartition(topic, p)])
                    consumer.seek_to_beginning()
                    while batch := consumer.poll(timeout_ms=0):
                        for r in batch:
                            assert r.key is not None and r.value is not None
                            rows.append((p, r.key.decode(), orjson.loads(r.value), dict(r.headers)))
    return out


def stored_events(dsn: str) -> list[tuple[int, str, str, int, str]]:
    with psycopg.connect(dsn) as c:
        return [
            (int(i), str(s), str(t), int(v), str(e))
            for i, s, t, v, e in c.execute(
                "SELECT id, stream_id, stream_type, version, event_type FROM events ORDER BY id"
            ).fetchall()
        ]


def assert_routed_exactly_once(log_dir: Path, dsn: str) -> int:
    stored = stored_events(dsn)
    topics = routed(log_dir)
    seen: list[tuple[int, str, str, int, str]] = []
    for topic, rows in topics.items():
        last_position: dict[int, tuple[int, int]] = {}
        for partition, key, value, headers in rows:
            assert topic == f"events.{value['stream_type']}"
            assert key == value["stream_id"]
            assert headers["event_type"] == value["event_type"].encode()
            position = (value["source"]["commit_lsn"], value["source"]["event_index"])
            assert position > last_position.get(partition, (-1, -1)), f"{topic}[{partition}]: not in commit order"
            last_position[partition] = position
            seen.append((value["id"], key, value["stream_type"], value["version"], value["event_type"]))
    assert sorted(seen) == stored, "routed events differ from the events table (lost or duplicated)"
    by_stream: dict[str, list[int]] = {}
    for _, stream, _, version, _ in sorted(seen):
        by_stream.setdefault(stream, []).append(version)
    assert all(v == list(range(1, len(v) + 1)) for v in by_stream.values()), "a stream's versions out of order"
    return len(seen)


def issue_commands(dsn: str, n: int, seed: int, stop: threading.Event | None = None) -> int:
    """The demo's reservations workload (some commands refused: they write nothing); the number accepted."""
    done = run_commands(dsn, users=min(max(1, n // 4), 200), reservations=n, seed=seed, stop=stop)
    return sum(done.accepted.values())


def test_commands_are_routed_to_event_topics(db: str, tmp_path: Path, plugin: Plugin) -> None:
    log_dir = tmp_path / "log"
    before = issue_commands(db, 30, seed=1)  # already in the table: routed by the snapshot, in id order
    capture(log_dir, db, plugin=plugin, **OUTBOX)
    after = issue_commands(db, 60, seed=2)
    capture(log_dir, db, plugin=plugin, **OUTBOX)
    n = assert_routed_exactly_once(log_dir, db)
    assert n == len(stored_events(db)) and before > 0 and after > 0
    assert set(routed(log_dir)) == {"events.user", "events.reservation"}
    with Log(log_dir) as log:
        assert "cdc.public.events" not in log.topics()  # the outbox table itself is not a topic


def test_a_new_snapshot_does_not_route_events_again(db: str, tmp_path: Path) -> None:
    """--snapshot always / when_needed read the events table again: its rows are routed once only."""
    log_dir = tmp_path / "log"
    issue_commands(db, 20, seed=6)
    capture(log_dir, db, **OUTBOX)
    issue_commands(db, 20, seed=7)
    capture(log_dir, db, snapshot=SnapshotMode.ALWAYS, **OUTBOX)  # a fresh snapshot of everything
    issue_commands(db, 20, seed=8)
    capture(log_dir, db, **OUTBOX)
    assert assert_routed_exactly_once(log_dir, db) == len(stored_events(db))


def test_an_update_of_an_event_row_is_flagged_not_routed(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    issue_commands(db, 10, seed=3)
    capture(log_dir, db, **OUTBOX)
    with pytest.raises(psycopg.Error, match="append-only"):
        sql(db, "UPDATE events SET event_type = 'Forged'")
    sql(
        db,
        "ALTER TABLE events DISABLE TRIGGER USER",  # only an owner can: the trigger is the guard
        "UPDATE events SET event_type = 'Forged' WHERE id = (SELECT min(id) FROM events)",
        "ALTER TABLE events ENABLE TRIGGER USER",
    )
    stats = capture(log_dir, db, **OUTBOX)
    assert stats.outbox_violations == 1
    assert all(v["event_type"] != "Forged" for rows in routed(log_dir).values() for _, _, v, _ in rows)


CHILD = r"""
import sys
from capture.connector import CaptureConfig, Connector
from capture.messages import Plugin
from eventstore.log import Log
log_dir, dsn, plugin = sys.argv[1:4]
config = CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", outbox_table="public.events", partitions=2,
                       plugin=Plugin(plugin))
with Log(log_dir) as log:
    Connector(config, log).run()
"""


def test_exactly_once_across_connector_kills(db: str, tmp_path: Path, plugin: Plugin) -> None:
    log_dir = tmp_path / "log"
    kills = 40 if soak() else 6
    capture(log_dir, db, plugin=plugin, **OUTBOX)  # the slot and the (empty) snapshot
    stop = threading.Event()
    counts: list[int] = []
    writer = threading.Thread(target=lambda: counts.append(issue_commands(db, 100_000, seed=4, stop=stop)))
    writer.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(5)
    try:
        for i in range(kills):
            argv = [sys.executable, "-c", CHILD, str(log_dir), db, plugin.value]
            before = stored_position(log_dir, db)
            err = tmp_path / f"child-{i}.stderr"
            with err.open("wb") as stderr:
                child = subprocess.Popen(argv, env=env, stderr=stderr)
            try:  # the moment: once this run stored a position (it routes the commands the writer issues)
                wait_until(
                    lambda b=before: stored_position(log_dir, db) != b,
                    f"run {i}'s first stored position",
                    every=0.1,
                    alive=child,
                    details=lambda e=err: e.read_text(errors="replace")[-2000:],
                )
                time.sleep(rng.uniform(0.0, 1.2))
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=30)
            assert child.returncode == -signal.SIGKILL, err.read_text(errors="replace")[-2000:]
    finally:
        stop.set()
        writer.join()
    assert counts and counts[0] > 0
    capture(log_dir, db, plugin=plugin, **OUTBOX)  # the rest, uninterrupted
    n = assert_routed_exactly_once(log_dir, db)
    assert n == len(stored_events(db)) > 0
