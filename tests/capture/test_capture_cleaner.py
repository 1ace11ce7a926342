"""``tideline capture run --log-cleaner``: the log cleaner runs beside the connector (issue 19).

An update-only workload over a fixed key set into a table topic with small segments: while
capture runs, the cleaner compacts the topic in the background (fewer records readable
from offset 0 than changes captured), and a reader from offset 0 sees exactly the table's
latest value per key. With ``--kafka`` the option is refused (the brokers clean).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from capture_util import drop_slots, fresh_database, latest_by_key, records, sql
from readiness import patience

from eventstore.log import Log
from eventstore.topic import TopicConfig
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
KEYS = 50


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "cleaner")
    yield dsn
    drop_slots(dsn)


def test_capture_run_with_the_log_cleaner_compacts_while_capturing(db: str, tmp_path: Path) -> None:
    data = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int, pad text)",
        f"INSERT INTO t SELECT g, 0, repeat('p', 200) FROM generate_series(1, {KEYS}) g")  # fmt: skip
    with Log(data) as log:  # the table's topic, made by the operator with small segments (capture keeps it)
        log.create_topic("cdc.public.t", 1, TopicConfig(), overrides={
            "cleanup_policy": "compact", "segment_bytes": "65536", "min_cleanable_dirty_ratio": "0.1",
            "min_compaction_lag_ms": "0", "delete_retention_ms": "0"})  # fmt: skip
    err = tmp_path / "capture.err"
    argv = [TIDELINE, "--data-dir", str(data), "capture", "run", "--dsn", db, "--slot", "clean", "--topic-prefix",
            "cdc", "--log-cleaner"]  # fmt: skip
    with err.open("wb") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)
    changes = KEYS
    try:
        with psycopg.connect(db, autocommit=True) as c:
            deadline = time.monotonic() + patience(120)
            while "log cleaner running" not in err.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
                time.sleep(0.05)
            deadline = time.monotonic() + patience(180)
            while True:  # updates until a reader from offset 0 gets fewer records than were captured
                for _ in range(10):
                    c.execute("UPDATE t SET v = v + 1 WHERE id = %s", (changes % KEYS + 1,))
                    changes += 1
                while not caught_up(data, db):
                    assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
                    time.sleep(0.05)
                if len(records(data, "cdc.public.t")) < changes:
                    break
                assert time.monotonic() < deadline, f"no compaction pass in time: {err.read_text()[-2000:]}"
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID: the connector commits, the cleaner stops
        code = proc.wait(timeout=120)
    assert code == 0, err.read_text()[-2000:]
    with psycopg.connect(db) as c:
        rows = c.execute("SELECT id, v FROM t").fetchall()
    table = {f'{{"id":{i}}}'.encode(): {"id": i, "v": v, "pad": "p" * 200} for i, v in rows}
    assert latest_by_key(data, "cdc.public.t") == table
    assert len(records(data, "cdc.public.t")) < changes  # compacted in the background


def caught_up(data: Path, dsn: str) -> bool:
    """The log holds every key's current value."""
    with psycopg.connect(dsn) as c:
        table = {f'{{"id":{i}}}'.encode(): v for i, v in c.execute("SELECT id, v FROM t")}
    return {k: v["v"] for k, v in latest_by_key(data, "cdc.public.t").items()} == table


def test_log_cleaner_option_is_refused_with_kafka(tmp_path: Path) -> None:
    done = subprocess.run([TIDELINE, "--kafka", "127.0.0.1:9", "capture", "run", "--dsn", "postgresql://x/y",
                           "--log-cleaner"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "brokers' log cleaner" in done.stderr, done.stderr
