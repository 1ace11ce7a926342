"""Exactly once: ``tideline project follow`` killed (SIGKILL) at random points, again and again,
on both engines (``--engine spark``: micro-batches; ``--engine live``: no Spark, one record
per batch so that kills land between and inside many transactions).

After every kill the view must equal the reference fold of exactly the records below its
stored checkpoints (a batch is all in or all out), and after a final run, the reference of
the whole log. ``show_occupancy`` is the sharpest witness: its upserts are additive, so a
batch applied twice would double counts. The CLI's rebuild and status are exercised too.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from crash_util import TIDELINE, kill_repeatedly
from pyspark.sql import SparkSession
from typer.testing import CliRunner
from views_util import capture, drop_slots, issue_commands, migrated_database, soak

from examples.reservations.views import VIEWS
from projections.follow import follow
from projections.live import follow_live
from projections.reference import expected_rows, view_rows
from tideline.cli import app
from tideline.pgharness import LocalPostgres

KILLS = 8 if soak() else 2
VIEWS_KILLED = ["show_occupancy", "seats"] if soak() else ["show_occupancy"]
LIVE_KILLS = 12 if soak() else 6
# The live engine applies a one-record batch in a millisecond or two: give it enough to be killed inside.
COMMANDS = {"spark": 500 if soak() else 250, "live": 1600 if soak() else 800}


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = migrated_database(postgres, "crash")
    yield dsn
    drop_slots(dsn)


@pytest.mark.parametrize(
    ("engine", "view"),
    [("spark", v) for v in VIEWS_KILLED] + [("live", "show_occupancy"), ("live", "seats")],
)
def test_follow_killed_at_random_points_is_exactly_once(
    request: pytest.FixtureRequest, db: str, tmp_path: Path, engine: str, view: str
) -> None:
    log_dir, checkpoint_dir = tmp_path / "log", tmp_path / "checkpoints"
    rng = random.Random(11)
    capture(log_dir, db)
    issue_commands(db, COMMANDS[engine], rng, tag="k")
    capture(log_dir, db)
    expected = expected_rows(VIEWS[view], log_dir)
    kills_mid_run = kill_repeatedly(
        log_dir,
        ["--data-dir", str(log_dir)],
        db,
        VIEWS[view],
        engine,
        kills=KILLS if engine == "spark" else LIVE_KILLS,
        rng=rng,
        checkpoint_dir=checkpoint_dir,
        stderr=tmp_path / "follow.err",
    )
    assert kills_mid_run > 0
    if engine == "live":
        follow_live(VIEWS, view, log_dir=log_dir, dsn=db, once=True)
    else:
        spark: SparkSession = request.getfixturevalue("spark")  # started only for the Spark engine
        follow(spark, VIEWS, view, log_dir=log_dir, dsn=db, checkpoint_dir=checkpoint_dir, once=True)
    assert view_rows(db, VIEWS[view]) == expected


def test_cli_rebuild_and_status(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    capture(log_dir, db)
    issue_commands(db, 80, random.Random(3), tag="cli")
    capture(log_dir, db)
    argv = [TIDELINE, "--data-dir", str(log_dir), "project", "rebuild", "users", "--dsn", db, "--master", "local[1]",
            "--json"]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env={**os.environ, "PYSPARK_PYTHON": sys.executable}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["projection"] == "users" and summary["rows"] == len(expected_rows(VIEWS["users"], log_dir)) > 0
    assert view_rows(db, VIEWS["users"]) == expected_rows(VIEWS["users"], log_dir)
    status = CliRunner().invoke(app, ["--data-dir", str(log_dir), "project", "status", "--dsn", db, "--json"])
    assert status.exit_code == 0, status.output
    (users,) = [p for p in json.loads(status.output) if p["projection"] == "users"]
    assert users["mode"] == "rebuild" and users["status"] == "done" and users["events"] == summary["events"]
    assert [p["lag"] for p in users["partitions"]] == [0, 0]
    unknown = CliRunner().invoke(app, ["--data-dir", str(log_dir), "project", "rebuild", "nope", "--dsn", db])
    assert unknown.exit_code == 1 and "unknown projection 'nope'" in unknown.output
