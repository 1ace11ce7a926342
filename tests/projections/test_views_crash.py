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
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession
from typer.testing import CliRunner
from views_util import capture, drop_slots, issue_commands, migrated_database, soak

from eventstore.log import Log
from examples.reservations.views import VIEWS
from projections import store
from projections.consistency import stable_offsets
from projections.follow import follow
from projections.live import follow_live
from projections.reference import expected_rows, records, view_rows
from projections.views import FoldView, Row, StoredEvent, Stream, View, columns_of, key_columns
from tideline.cli import app
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
KILLS = 8 if soak() else 3
VIEWS_KILLED = ["show_occupancy", "seats"] if soak() else ["show_occupancy"]
LIVE_KILLS = 12 if soak() else 6
ENGINE_ARGS = {  # small batches: many commits for the kills to fall between and inside
    "spark": [
        "--engine",
        "spark",
        "--master",
        "local[1]",
        "--max-records-per-trigger",
        "15",
        "--trigger-seconds",
        "0.1",
    ],
    "live": ["--engine", "live", "--max-records-per-batch", "1"],
}
KILL_DELAY_S = {"spark": 1.0, "live": 0.25}  # after the first committed batch: at most this much later
# The live engine applies a one-record batch in a millisecond or two: give it enough to be killed inside.
COMMANDS = {"spark": 500 if soak() else 250, "live": 1600 if soak() else 800}


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = migrated_database(postgres, "crash")
    yield dsn
    drop_slots(dsn)


def batches(dsn: str, projection: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT batches FROM projection_runs WHERE projection = %s", (projection,)).fetchone()
    return int(row[0]) if row else 0


def checkpoints(dsn: str, projection: str) -> store.Offsets:
    with psycopg.connect(dsn) as c:
        return store.offsets_of(store.read_checkpoints(c, projection))


def log_end_offsets(log_dir: Path, topics: tuple[str, ...]) -> store.Offsets:
    with Log(log_dir) as log:
        return stable_offsets(log, topics)


def start_follow(
    log_dir: Path, dsn: str, view: str, checkpoint_dir: Path, stderr: Path, engine: str = "spark"
) -> subprocess.Popen[bytes]:
    argv = [TIDELINE, "--data-dir", str(log_dir), "project", "follow", view, "--dsn", dsn,
            *ENGINE_ARGS[engine], "--checkpoint-dir", str(checkpoint_dir)]  # fmt: skip
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    with stderr.open("ab") as err:  # a file, not a pipe: Spark's start-up logging would fill a pipe and block
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def assert_view_at_cut(dsn: str, view: View, log_dir: Path, applied: store.Offsets) -> None:
    """The view holds exactly the records below its checkpoints ``applied`` (all of a batch or none).

    Most views have one answer at a cut: the reference of the records below it. A fold view
    whose rows of one key can come from several streams (``seats``: a seat held by one
    reservation after another, the streams spread over partitions) has no single answer at a
    cut that falls at different points of different partitions: a key taken over by a row with
    a larger ``commit_lsn`` (a later holder, read early from a partition that is ahead) is
    empty again once that holder moves on, even if an earlier holder, in a partition that is
    behind, still has it below the cut. So for those, exactly: every stream's applied version
    (``projection_state``) is the reference's at the cut; every row of the view is a row some
    stream holds at the cut; and a key shows the holder with the largest ``commit_lsn`` unless
    a row with a larger one held it at some version below the cut and has moved on since.
    """
    rows = view_rows(dsn, view)
    if not isinstance(view, FoldView) or view.snapshots or "commit_lsn" not in columns_of(view):
        assert rows == expected_rows(view, log_dir, applied), f"after a kill at {applied}"
        return
    versions, current, history = fold_at_cut(view, log_dir, applied)
    with psycopg.connect(dsn) as conn:
        query = "SELECT stream_id, version FROM projection_state WHERE projection = %s"
        stored: dict[str, int] = dict(conn.execute(query, (view.name,)).fetchall())
    assert stored == versions, f"after a kill at {applied}: streams applied other than once"
    columns = columns_of(view)
    keys, lsn = [columns.index(c) for c in key_columns(view.table)], columns.index("commit_lsn")
    assert not set(rows) - set(current), f"after a kill at {applied}: rows no stream holds at the cut"
    shown = {tuple(r[i] for i in keys): r for r in rows}
    winners: dict[tuple[object, ...], Row] = {}
    for r in current:
        k = tuple(r[i] for i in keys)
        if k not in winners or winners[k][lsn] < r[lsn]:
            winners[k] = r
    for k, winner in winners.items():
        if shown.get(k) != winner:
            moved_on = [h for h in history if tuple(h[i] for i in keys) == k and h[lsn] > winner[lsn]]
            assert moved_on, f"after a kill at {applied}: {k} shows {shown.get(k)}, not {winner}"


def fold_at_cut(view: FoldView, log_dir: Path, until: store.Offsets) -> tuple[dict[str, int], set[Row], set[Row]]:
    """Per stream its version below the cut; the rows the streams hold there; every row any of them
    held at any version below it."""
    streams: dict[str, list[StoredEvent]] = defaultdict(list)
    for _, _, (_, value) in records(log_dir, view.topics, until):
        if value is not None:
            e = StoredEvent.from_value(value)
            streams[e.stream_id].append(e)
    versions: dict[str, int] = {}
    current: set[Row] = set()
    history: set[Row] = set()
    for sid, events in streams.items():
        events.sort(key=lambda e: e.version)
        aggregate, state = view.aggregate(events[0].stream_type), None
        rows: list[Row] = []
        for e in events:
            state = view.fold(e.stream_type, [e], state)
            rows = [tuple(r) for r in view.rows(Stream(aggregate, sid, e.version, e.commit_lsn, state))]
            history.update(rows)
        versions[sid] = events[-1].version
        current.update(rows)
    return versions, current, history


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the follow job and the JVM it started (its own process group, by the child's PID)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


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
    kills_mid_run = 0
    log_end = log_end_offsets(log_dir, VIEWS[view].topics)
    for _ in range(KILLS if engine == "spark" else LIVE_KILLS):
        before = checkpoints(db, view)
        process = start_follow(log_dir, db, view, checkpoint_dir, tmp_path / "follow.err", engine)
        try:
            deadline = time.monotonic() + 180
            while process.poll() is None and time.monotonic() < deadline:
                now = checkpoints(db, view)
                if now != before or now == log_end:  # a batch committed (or nothing is left to do)
                    break
                time.sleep(0.05)
            time.sleep(rng.uniform(0, KILL_DELAY_S[engine]))
            finished = process.poll() is not None
        finally:
            if process.poll() is None:
                kill_group(process)
        assert process.returncode in (0, -signal.SIGKILL), (tmp_path / "follow.err").read_text()[-2000:]
        applied = checkpoints(db, view)
        kills_mid_run += not finished and applied != log_end
        assert_view_at_cut(db, VIEWS[view], log_dir, applied)
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
