"""The live follow engine (no Spark): the same views as rebuild and the reference, read-your-writes
through capture running in a thread, a fold that raises, the progress line, stalled views."""

from __future__ import annotations

import json
import random
import re
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
    capture,
    capture_config,
    change_accounts,
    drop_slots,
    issue_commands,
    migrated_database,
)

from capture.connector import Connector
from commands.handler import CommandHandler, HandlerConfig
from eventstore.log import Log
from eventstore.producer import Producer
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
