"""The connector as a service: CLI, signals, status, reconnects after a dropped connection or a restart."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from capture_util import drop_slots, events, fresh_database, sql
from readiness import patience, wait_for_text, wait_until

from capture.connector import CaptureConfig, Connector
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TIDELINE = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "tideline")


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "svc")
    yield dsn
    drop_slots(dsn)


def cli(*args: str, data_dir: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TIDELINE, "--data-dir", str(data_dir), *args], capture_output=True, text=True, check=check, timeout=120
    )


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, every: float = 0.1) -> None:
    wait_until(predicate, "a condition of this test", timeout=timeout, every=every)


def test_cli_run_status_and_errors(db: str, tmp_path: Path) -> None:
    data = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)", "INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    out = cli("capture", "run", "--dsn", db, "--slot", "cli", "--topic-prefix", "cdc", "--exit-when-caught-up",
              "--json", data_dir=data)  # fmt: skip
    summary = json.loads(out.stdout)
    assert summary["snapshot_rows"] == 2
    status = json.loads(cli("capture", "status", "--dsn", db, "--slot", "cli", "--topic-prefix", "cdc", "--json",
                            data_dir=data).stdout)  # fmt: skip
    assert status["slot"]["plugin"] == "wal2json" and status["stored_position"]["snapshot_done"] is True
    assert status["slot"]["retained_wal_bytes"] >= 0
    bad = cli("capture", "run", "--dsn", db, "--snapshot", "sometimes", data_dir=data, check=False)
    assert bad.returncode == 1 and bad.stderr.startswith("error: --snapshot must be one of")
    assert len(bad.stderr.strip().splitlines()) == 1
    refused = cli("capture", "run", "--dsn", db, "--plugin", "decoderbufs", data_dir=data, check=False)
    assert refused.returncode == 1 and "wal2json" in refused.stderr
    down = cli("capture", "status", "--dsn", "postgresql://nobody@127.0.0.1:1/x", data_dir=data, check=False)
    assert down.returncode == 1 and down.stderr.startswith("error: database: connection failed")
    assert len(down.stderr.strip().splitlines()) == 1  # no traceback
    from_env = subprocess.run([TIDELINE, "--data-dir", str(data), "capture", "status", "--slot", "cli",
                               "--topic-prefix", "cdc", "--json"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "TIDELINE_DSN": db})  # fmt: skip
    assert json.loads(from_env.stdout)["slot"]["plugin"] == "wal2json"  # --dsn from $TIDELINE_DSN


def test_sigterm_finishes_the_batch_and_exits_0(db: str, tmp_path: Path) -> None:
    """SIGTERM at a random moment while transactions stream in: exit 0, and what it stored is a prefix of
    the changes (no duplicates); a restart stores the rest."""
    data = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)")
    err_path = tmp_path / "capture.stderr"
    argv = [TIDELINE, "--data-dir", str(data), "capture", "run", "--dsn", db, "--slot", "sig", "--topic-prefix", "cdc"]
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err_file, text=True)

    def insert() -> None:  # ten transactions of 50 rows, a little apart: work in flight for the signal to meet
        for i in range(10):
            sql(db, f"INSERT INTO t SELECT generate_series({i * 50 + 1}, {i * 50 + 50})")
            time.sleep(0.05)

    writer = threading.Thread(target=insert)
    try:
        wait_for_text(err_path, "streaming slot", alive=proc)
        writer.start()
        # the moment: once it stored changes of the writer's transactions (it works), at a random point after
        wait_until(lambda: count(data) > 0, "the first change stored", alive=proc, details=lambda: err_path.read_text())
        time.sleep(random.Random(5).uniform(0.0, 0.3))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=patience(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if writer.is_alive():
            writer.join()
    assert proc.returncode == 0, err_path.read_text()
    assert "captured" in out
    ids = [e["after"]["id"] for e in events(data, "cdc.public.t")]
    assert ids == list(range(1, len(ids) + 1)), "what a stopped connector stored is not a prefix of the changes"
    cli("capture", "run", "--dsn", db, "--slot", "sig", "--topic-prefix", "cdc", "--exit-when-caught-up", data_dir=data)
    assert [e["after"]["id"] for e in events(data, "cdc.public.t")] == list(range(1, 501))


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` of the running connector: metric name → value (labels dropped: one series each)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tideline_capture_"):
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels.split("{")[0]] = float(value)
    return out


def scrape_ok(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


def test_metrics_endpoint_while_running(db: str, tmp_path: Path) -> None:
    data = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 100)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [TIDELINE, "--data-dir", str(data), "capture", "run", "--dsn", db, "--slot", "met", "--topic-prefix", "cdc",
         "--metrics-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: scrape_ok(port))
        wait_for(lambda: scrape(port)["tideline_capture_snapshot_rows_total"] == 100)
        wait_for(lambda: scrape(port)["tideline_capture_last_stored_lsn"] > 0)  # the snapshot is stored
        sql(db, "INSERT INTO t SELECT generate_series(101, 400)")
        wait_for(lambda: scrape(port)["tideline_capture_events_total"] >= 300)
        wait_for(lambda: scrape(port)["tideline_capture_transactions_total"] >= 1)
        metrics = scrape(port)
        assert metrics["tideline_capture_batches_total"] >= 1
        assert metrics["tideline_capture_last_stored_lsn"] > 0
        assert metrics["tideline_capture_lag_bytes"] >= 0 and metrics["tideline_capture_lag_ms"] >= 0
        wait_for(lambda: scrape(port)["tideline_capture_slot_retained_wal_bytes"] >= 0, timeout=10)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"metrics on http://127.0.0.1:{port}/metrics" in err


def run_in_thread(connector: Connector) -> threading.Thread:
    thread = threading.Thread(target=connector.run, daemon=True)
    thread.start()
    return thread


def count(data: Path) -> int:
    return len(events(data, "cdc.public.t"))


def test_reconnects_after_the_walsender_is_terminated(db: str, tmp_path: Path) -> None:
    data = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 10)")
    log = Log(data)
    connector = Connector(CaptureConfig(dsn=db, slot="drop", topic_prefix="cdc"), log)
    thread = run_in_thread(connector)
    try:
        wait_for(lambda: count(data) == 10)
        for round_ in range(3):
            with psycopg.connect(db, autocommit=True) as c:
                c.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'drop'")
            sql(db, f"INSERT INTO t SELECT generate_series({100 * (round_ + 1)}, {100 * (round_ + 1) + 9})")
            wait_for(lambda r=round_: count(data) == 10 * (r + 2))
    finally:
        connector.stop()
        thread.join(30)
        log.close()
    ids = [e["after"]["id"] for e in events(data, "cdc.public.t")]
    assert len(ids) == len(set(ids)) == 40


def test_reconnects_after_a_postgres_restart(tmp_path: Path) -> None:
    data = tmp_path / "log"
    with LocalPostgres(tmp_path / "pg", fast=True) as pg:
        sql(pg.dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1)")
        log = Log(data)
        connector = Connector(CaptureConfig(dsn=pg.dsn, slot="restart", topic_prefix="cdc"), log)
        thread = run_in_thread(connector)
        try:
            wait_for(lambda: count(data) == 1)
            pg.stop()
            time.sleep(1.0)  # the connector sees the connection drop and backs off
            pg.start()
            sql(pg.dsn, "INSERT INTO t VALUES (2), (3)")
            wait_for(lambda: count(data) == 3, timeout=60)
        finally:
            connector.stop()
            thread.join(60)
            log.close()
            drop_slots(pg.dsn)
    assert sorted(e["after"]["id"] for e in events(data, "cdc.public.t")) == [1, 2, 3]


SNAPSHOT_CHILD = r"""
import sys
from capture.connector import CaptureConfig, Connector
from eventstore.log import Log
with Log(sys.argv[1]) as log:
    Connector(CaptureConfig(dsn=sys.argv[2], slot="snap", topic_prefix="cdc", batch_bytes=256 << 10), log).run()
"""


def test_snapshot_killed_midway_restarts_without_visible_duplicates(db: str, tmp_path: Path) -> None:
    data = tmp_path / "log"
    rows = 500_000  # the native snapshot reads about a million rows a second: enough for the kill to land midway
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)", f"INSERT INTO t SELECT g, repeat('v', 100) FROM generate_series(1, {rows}) g")  # fmt: skip # noqa: E501
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SNAPSHOT_CHILD, str(data), db], env=env, stderr=subprocess.DEVNULL)
    try:
        # wait until the snapshot has appended data (uncommitted) to the table topic, then kill it
        seg = data / "cdc.public.t-0" / "00000000000000000000.log"
        wait_for(lambda: seg.exists() and seg.stat().st_size > 2 << 20, timeout=60, every=0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert events(data, "cdc.public.t") == []  # read_committed: nothing of the half snapshot
        config = CaptureConfig(dsn=db, slot="snap", topic_prefix="cdc", exit_when_caught_up=True)
        with Log(data) as log:
            stats = Connector(config, log).run()
        assert stats.snapshot_rows == rows
        ids = [e["after"]["id"] for e in events(data, "cdc.public.t")]
        assert len(ids) == rows and len(set(ids)) == rows
    finally:
        if proc.poll() is None:
            proc.kill()
