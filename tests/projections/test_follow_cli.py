"""``tideline project follow`` as a user runs it: Spark's console quiet by default
(``--spark-log-level`` to change it), one structured progress line per interval, on both engines."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from views_util import capture, drop_slots, issue_commands, migrated_database

from examples.reservations.views import VIEWS
from projections.reference import expected_rows, view_rows
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
SPARK_NOISE = ("log4j", "Setting default log level", "To adjust logging level", " WARN ", "NativeCodeLoader")


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = migrated_database(postgres, "cli")
    yield dsn
    drop_slots(dsn)


@pytest.fixture
def log_dir(db: str, tmp_path: Path) -> Path:
    log_dir = tmp_path / "log"
    capture(log_dir, db)
    issue_commands(db, 60, random.Random(13), tag="c")
    capture(log_dir, db)
    return log_dir


def follow_once(log_dir: Path, db: str, *options: str) -> subprocess.CompletedProcess[str]:
    argv = [TIDELINE, "--data-dir", str(log_dir), "project", "follow", "users", "--dsn", db, "--once", *options]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def progress_lines(stderr: str, engine: str) -> list[dict[str, str]]:
    lines = [line for line in stderr.splitlines() if line.startswith(f"follow view=users engine={engine} ")]
    return [dict(pair.split("=", 1) for pair in line.split()[1:]) for line in lines]


def test_spark_engine_is_quiet_by_default_and_says_what_it_did(db: str, log_dir: Path) -> None:
    done = follow_once(log_dir, db, "--engine", "spark", "--master", "local[1]", "--log-interval", "0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    noise = [line for line in done.stderr.splitlines() if any(n in line for n in SPARK_NOISE)]
    assert noise == [], noise
    lines = progress_lines(done.stderr, "spark")
    assert lines, done.stderr[-3000:]
    events = int(lines[-1]["events_total"])
    assert events > 0 and lines[-1]["lag"] == "0" and lines[-1]["last_batch_at"] != "-"
    assert f"followed users (spark): {lines[-1]['batches_total']} batches, {events:,} events" in done.stdout
    assert view_rows(db, VIEWS["users"]) == expected_rows(VIEWS["users"], log_dir)


def test_spark_log_level_shows_spark_again(db: str, log_dir: Path) -> None:
    done = follow_once(log_dir, db, "--engine", "spark", "--master", "local[1]", "--spark-log-level", "info")
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(" INFO SparkContext: " in line for line in done.stderr.splitlines()), done.stderr[-3000:]
    bad = follow_once(log_dir, db, "--engine", "spark", "--spark-log-level", "loud")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("error: --spark-log-level must be")


def test_live_engine_runs_without_spark_and_reports(db: str, log_dir: Path) -> None:
    done = follow_once(log_dir, db, "--log-interval", "0.2", "--max-records-per-batch", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "spark" not in done.stderr.lower(), done.stderr  # no session started, nothing of it printed
    lines = progress_lines(done.stderr, "live")
    assert lines and int(lines[-1]["batches_total"]) > 1 and lines[-1]["lag"] == "0"
    assert view_rows(db, VIEWS["users"]) == expected_rows(VIEWS["users"], log_dir)
    wrong = follow_once(log_dir, db, "--engine", "live", "--trigger-seconds", "1")
    assert wrong.returncode == 1 and "--trigger-seconds is for --engine spark" in wrong.stderr
    unknown = follow_once(log_dir, db, "--engine", "flink")
    assert unknown.returncode == 1 and "unknown follow engine 'flink'" in unknown.stderr
