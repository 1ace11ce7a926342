"""The live follow engine (no Spark): the same views as rebuild and the reference, read-your-writes
through capture running in a thread, a fold that raises, the progress line, stalled views."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from pyspark.sql import SparkSession
from typer.testing import CliRunner
from views_util import (
    ACCOUNTS_TOPIC,
    HEARTBEAT,
    capture,
    capture_config,
    change_accounts,
    drop_slots,
    issue_commands,
    migrated_database,
    poisoned_log,
)

from capture.connector import Connector
from commands.handler import CommandHandler, HandlerConfig
from eventstore.log import Log
from examples.reservations.api import create_app
from examples.reservations.domain import USER, RegisterUser
from examples.reservations.views import VIEWS
from projections import store
from projections.consistency import CapturePositions, captured_lsn, format_lsn, wait_for
from projections.live import LiveFollower, follow_live
from projections.progress import FoldFailed, ProgressReporter
from projections.rebuild import rebuild
from projections.reference import expected_rows, view_rows
from projections.status import projection_status
from tideline.cli import app
from tideline.pgharness import LocalPostgres

SHIPPED = ["users", "seats", "show_occupancy", "snapshots", f"mirror:{ACCOUNTS_TOPIC}"]


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = migrated_database(postgres, "live")
    yield dsn
    drop_slots(dsn)


def checkpoints(dsn: str, projection: str) -> store.Offsets:
    with psycopg.connect(dsn) as c:
        return store.offsets_of(store.read_checkpoints(c, projection))


def wait_until(condition: Callable[[], bool], errors: list[BaseException], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert not errors, errors
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.05)


def test_live_follow_equals_rebuild_equals_reference(spark: SparkSession, db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    rng = random.Random(17)
    capture(log_dir, db)
    for round_ in range(2):
        assert issue_commands(db, 150, rng, tag=f"l{round_}-") > 0
        change_accounts(db, 120, rng)
        capture(log_dir, db)
        for name in SHIPPED:  # small batches: each round spans many transactions, continuing from the last
            stats = follow_live(VIEWS, name, log_dir=log_dir, dsn=db, once=True, max_records_per_batch=7)
            assert stats.events > 0 and stats.batches > 1, name
            assert view_rows(db, VIEWS[name]) == expected_rows(VIEWS[name], log_dir), f"live {name}, round {round_}"
    followed = {name: view_rows(db, VIEWS[name]) for name in SHIPPED}
    assert all(followed.values()), {n: len(r) for n, r in followed.items()}
    for name in SHIPPED:
        rebuild(spark, VIEWS, name, log_dir=log_dir, dsn=db)
        assert view_rows(db, VIEWS[name]) == followed[name] == expected_rows(VIEWS[name], log_dir), f"rebuild {name}"
    # After a rebuild, the live engine continues from the rebuild's checkpoints: new events only.
    issue_commands(db, 40, rng, tag="late-")
    change_accounts(db, 30, rng)
    capture(log_dir, db)
    for name in SHIPPED:
        stats = follow_live(VIEWS, name, log_dir=log_dir, dsn=db, once=True)
        assert view_rows(db, VIEWS[name]) == expected_rows(VIEWS[name], log_dir), f"live after rebuild {name}"


def test_read_your_writes_live(db: str, tmp_path: Path) -> None:
    """Capture and the live engine running: a command's commit_lsn is reached (woken by the
    view's NOTIFY), ``POST /users?consistent=true`` answers with the user in the view."""
    log_dir = tmp_path / "log"
    capture(log_dir, db)  # the slot and the offsets topic exist before the commands
    errors: list[BaseException] = []
    stop = threading.Event()
    with Log(log_dir) as log:
        connector = Connector(capture_config(db, **HEARTBEAT), log)
        capturing = threading.Thread(target=connector.run, daemon=True)
        capturing.start()
        job = LiveFollower(VIEWS, "users", log_dir=log_dir, dsn=db)

        def run() -> None:
            try:
                job.run(stop=stop)
            except BaseException as e:  # reported by the test thread
                errors.append(e)

        following = threading.Thread(target=run, daemon=True)
        following.start()
        try:
            with CommandHandler(db, HandlerConfig(snapshot_every=None)) as handler:
                for i in range(20):
                    result = handler.handle(USER, RegisterUser(f"u-live{i}", f"live_user{i}"))
                    assert wait_for(db, "users", result.commit_lsn, timeout=60), errors
                    assert f"u-live{i}" in {r[0] for r in view_rows(db, VIEWS["users"])}
            client = TestClient(create_app(db, consistency_timeout=60))
            answer = client.post("/users?consistent=true", json={"username": "api_live", "user_id": "u-api-live"})
            assert answer.status_code == 201, answer.text
            seen = client.get("/views/users/u-api-live")
            assert seen.status_code == 200 and seen.json()["username"] == "api_live"
            with Log(log_dir, create=False) as reader:
                positions = CapturePositions(reader)
                before = positions.lsn()  # the incremental reader agrees with a full read (capture runs on)
                assert 0 < before <= captured_lsn(reader) <= positions.lsn()
                positions.close()
        finally:
            stop.set()
            job.wakeup()
            following.join(timeout=60)
            connector.stop()
            capturing.join(timeout=60)
    assert not following.is_alive() and not capturing.is_alive() and not errors, errors
    assert view_rows(db, VIEWS["users"]) == expected_rows(VIEWS["users"], log_dir)
    with psycopg.connect(db) as c:
        row = c.execute("SELECT mode, status FROM projection_runs WHERE projection = 'users'").fetchone()
    assert row == ("follow", "done")


def test_a_fold_that_raises_stops_the_job_and_commits_nothing_of_its_batch(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    poisoned_log(log_dir, good=2)
    with pytest.raises(FoldFailed) as failed:
        follow_live(VIEWS, "users", log_dir=log_dir, dsn=db, once=True)
    assert (failed.value.topic, failed.value.partition, failed.value.offset) == ("events.user", 0, 2)
    assert view_rows(db, VIEWS["users"]) == [] and checkpoints(db, "users") == {}  # the good events are not in
    # The command line: exit 1, one line naming the view, topic, partition, offset and the error.
    result = CliRunner().invoke(
        app, ["--data-dir", str(log_dir), "project", "follow", "users", "--dsn", db, "--once", "--log-interval", "0"]
    )
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: view users: the fold raised on events.user[0] offset 2: ") and "username" in line
    assert view_rows(db, VIEWS["users"]) == [] and checkpoints(db, "users") == {}
    with psycopg.connect(db) as c:
        status, error = c.execute("SELECT status, error FROM projection_runs WHERE projection = 'users'").fetchone()
    assert status == "failed" and "events.user[0] offset 2" in error
    # Batches before the failing one stay committed: with one record per batch, the two good ones.
    with pytest.raises(FoldFailed):
        follow_live(VIEWS, "users", log_dir=log_dir, dsn=db, once=True, max_records_per_batch=1)
    assert checkpoints(db, "users") == {"events.user": {0: 2}} and len(view_rows(db, VIEWS["users"])) == 2


def parse_line(line: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in line.split()[1:])


def test_progress_line_says_batches_events_lag_and_reached(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    capture(log_dir, db)
    issue_commands(db, 60, random.Random(5), tag="p")
    capture(log_dir, db)
    lines: list[str] = []
    job = LiveFollower(VIEWS, "users", log_dir=log_dir, dsn=db, max_records_per_batch=4)
    with ProgressReporter(job, "live", 0.05, lines.append):
        stats = job.run(once=True)
    assert stats.batches > 1
    fields = [parse_line(line) for line in lines]
    assert all(line.startswith("follow view=users engine=live ") for line in lines)
    last = fields[-1]  # the final line: everything applied, nothing behind
    assert int(last["batches_total"]) == stats.batches and int(last["events_total"]) == stats.events
    assert sum(int(f["events"]) for f in fields) == stats.events  # per-interval counts add up
    assert last["lag"] == "0" and last["reached_lsn"] == format_lsn(stats.reached_lsn) != "0/0"
    assert float(last["last_batch_ms"]) >= 0
    at = datetime.fromisoformat(last["last_batch_at"].replace("Z", "+00:00"))
    assert abs((datetime.now(UTC) - at).total_seconds()) < 600
    # Lag shows what is waiting: a line of a job that has applied nothing yet.
    idle = LiveFollower(VIEWS, "seats", log_dir=log_dir, dsn=db)
    first = parse_line(progress_line_of(idle))
    assert int(first["lag"]) > 0 and first["last_batch_at"] == "-" and first["reached_lsn"] == "0/0"


def progress_line_of(job: LiveFollower) -> str:
    lines: list[str] = []
    ProgressReporter(job, "live", 1.0, lines.append).line()
    return lines[0]


def test_status_flags_a_view_stalled_when_lag_stays_without_progress(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    capture(log_dir, db)
    issue_commands(db, 40, random.Random(9), tag="s")
    capture(log_dir, db)
    follow_live(VIEWS, "users", log_dir=log_dir, dsn=db, once=True)
    now = datetime.now(UTC)
    (users,) = [r for r in projection_status(db, log_dir, stall_after=60, now=now) if r["projection"] == "users"]
    assert users["lag"] == 0 and not users["stalled"]
    later = now + timedelta(hours=1)  # caught up: no lag, so never stalled however long it stays idle
    (users,) = [r for r in projection_status(db, log_dir, stall_after=60, now=later) if r["projection"] == "users"]
    assert not users["stalled"]
    with CommandHandler(db, HandlerConfig(snapshot_every=None)) as handler:
        handler.handle(USER, RegisterUser("late", "late_user"))
    capture(log_dir, db)  # the event waits: nobody follows users now
    rows = {r["projection"]: r for r in projection_status(db, log_dir, stall_after=60, now=datetime.now(UTC))}
    assert rows["users"]["lag"] > 0 and rows["users"]["waiting_since"] and not rows["users"]["stalled"]  # just now
    later = datetime.now(UTC) + timedelta(seconds=61)
    assert {r["projection"]: r["stalled"] for r in projection_status(db, log_dir, stall_after=60, now=later)} == {
        "users": True
    }
    # The command line, with the threshold passed: the event has waited longer than 0 s by now.
    wait_until(lambda: status_json(log_dir, db, "0.001")["users"]["stalled"], [])
    assert not status_json(log_dir, db, "3600")["users"]["stalled"]
    follow_live(VIEWS, "users", log_dir=log_dir, dsn=db, once=True)  # progress: no lag, not stalled
    assert not status_json(log_dir, db, "0.001")["users"]["stalled"]


def status_json(log_dir: Path, db: str, stall_after: str) -> dict[str, dict[str, object]]:
    argv = ["--data-dir", str(log_dir), "project", "status", "--dsn", db, "--json", "--stall-after", stall_after]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    return {r["projection"]: r for r in json.loads(result.output)}
