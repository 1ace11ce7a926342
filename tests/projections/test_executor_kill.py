"""A Spark executor killed (SIGKILL, by PID) in the middle of a view rebuild and of a follow
micro-batch (issue 19, fault class "spark"): Spark relaunches an executor and re-runs the
lost tasks, and the view must still be exactly the reference fold — nothing lost, nothing
twice — with no staging table left behind.

The cluster is a standalone master and one worker (1 core) started from the pyspark wheel;
the executor is the ``CoarseGrainedExecutorBackend`` JVM the worker launched for the
driver's application, found below the worker's PID (:mod:`spark_cluster`), never by name.
The drivers run in their own processes (executor_kill_driver.py).

- Rebuild: the kill lands while the first attempt of a write task has *committed* its
  staged rows and is still running (it holds there: ``hold`` of
  :data:`projections.attempts.FAULT_PROPERTY`): the lost attempt's rows stay in the
  staging table, the re-run attempt writes them again, and only one of the two may reach
  the view.
- Follow: the kill lands while a read task of a micro-batch holds its records (the batch's
  Postgres transaction is open, the checkpoints locked): the batch's jobs re-run the lost
  tasks on the new executor and the batch commits once, whole.

``make soak`` (TIDELINE_SOAK=1): more events, every shipped view rebuilt, each with a
kill, and several kills across the follow batches of three views. Each test records a
RELIABILITY.md row (fault class "spark").
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from crash_util import checkpoints, log_end_offsets
from readiness import patience
from spark_cluster import Cluster, kill_executor, standalone_cluster
from views_util import (
    ACCOUNTS_TOPIC,
    capture,
    change_accounts,
    drop_slots,
    issue_commands,
    leftovers,
    migrated_database,
    soak,
)

from examples.reservations.views import VIEWS
from projections.reference import expected_rows, view_rows
from tideline.pgharness import LocalPostgres
from tideline.reliability import record_fault_result

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("executor_kill_driver.py")
FAULT_CLASS = "spark"  # RELIABILITY.md row
ALL_VIEWS = ["users", "seats", "show_occupancy", "snapshots", f"mirror:{ACCOUNTS_TOPIC}"]
# make test: one fold view (rows and states staged); the soak adds the count view (a shuffle: the lost
# executor's map output re-run in a new stage attempt), snapshots and the mirror
REBUILT = ALL_VIEWS if soak() else ["users"]
FOLLOWED = ["show_occupancy", "users", f"mirror:{ACCOUNTS_TOPIC}"] if soak() else ["show_occupancy"]
FOLLOW_KILLS = 3 if soak() else 1  # per followed view
COMMANDS = 500 if soak() else 150
CHANGES = 300 if soak() else 120
WAIT_S = 300  # safety nets only: every wait ends on the event it waits for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-kill"), ["127.0.0.1"]) as started:
        yield started


@pytest.fixture(scope="module")
def workload(postgres: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A database and the log captured from it: commands of every kind, and CDC changes."""
    dsn = migrated_database(postgres, "kill")
    log_dir = tmp_path_factory.mktemp("kill") / "log"
    capture(log_dir, dsn)
    assert issue_commands(dsn, COMMANDS, random.Random(61), "k") > 0
    change_accounts(dsn, CHANGES, random.Random(67))
    with psycopg.connect(dsn, autocommit=True) as c:  # keys for both write tasks of the mirror
        c.execute("INSERT INTO accounts SELECT g, 'o' || g, g FROM generate_series(200, 239) g")
    capture(log_dir, dsn)
    yield dsn, log_dir
    drop_slots(dsn)


def start_driver(cluster: Cluster, log_dir: Path, dsn: str, out: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO_ROOT)}
    argv = [sys.executable, str(DRIVER), cluster.url, str(log_dir), dsn, *args]
    with (out / "stdout").open("wb") as stdout, (out / "stderr").open("wb") as stderr:
        return subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr)


def wait_for(what: str, ready: Any, driver: subprocess.Popen[bytes], out: Path) -> None:
    """Until ``ready()``; fails if the driver exits first."""
    deadline = time.monotonic() + patience(WAIT_S)
    while not ready():
        if driver.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: the driver exited ({driver.returncode}) or never got there:\n{tail(out)}")
        time.sleep(0.05)


def finish(driver: subprocess.Popen[bytes], out: Path) -> dict[str, dict[str, Any]]:
    try:
        driver.wait(timeout=patience(WAIT_S))
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 0, tail(out)
    lines = [json.loads(line) for line in (out / "stdout").read_text().splitlines() if line.startswith("{")]
    return {r["view"]: r for r in lines}


def tail(out: Path) -> str:
    return (out / "stderr").read_text(errors="replace")[-4000:]


def staged_rows(dsn: str, view: str) -> int:
    """Rows in the staging tables of a rebuild of ``view`` (``<view>__…__staging``)."""
    pattern = view.replace("\\", "\\\\").replace("_", r"\_").replace("%", r"\%") + r"\_\_%\_\_staging"
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = [r[0] for r in conn.execute("SELECT relname FROM pg_class WHERE relname LIKE %s", (pattern,))]
        total = 0
        for name in names:
            try:
                row = conn.execute(f'SELECT count(*) FROM "{name}"').fetchone()
            except psycopg.errors.UndefinedTable:  # dropped meanwhile
                continue
            total += int(row[0]) if row else 0
    return total


def lost_and_doubled(dsn: str, name: str, log_dir: Path) -> tuple[int, int]:
    """Reference rows missing from the view, and rows of the view beyond the reference's."""

    def counted(rows: list[Any]) -> Counter[str]:
        return Counter(json.dumps(r, sort_keys=True, default=str) for r in rows)  # rows may hold dicts (jsonb)

    expected, actual = counted(expected_rows(VIEWS[name], log_dir)), counted(view_rows(dsn, VIEWS[name]))
    return sum((expected - actual).values()), sum((actual - expected).values())


def test_rebuild_survives_its_executor_killed(cluster: Cluster, workload: tuple[str, Path], tmp_path: Path) -> None:
    """Each view's rebuild: once the holding first attempt of its write job committed staged
    rows, the executor is SIGKILLed; Spark relaunches one and re-runs the task, and the view
    equals the reference with the killed attempt's rows discarded."""
    dsn, log_dir = workload
    flags = tmp_path / "flags"
    flags.mkdir()
    driver = start_driver(cluster, log_dir, dsn, tmp_path, "rebuild", str(flags), *REBUILT)
    killed: list[int] = []
    try:
        for n, name in enumerate(REBUILT):
            held = flags / f"token-{n}.held"
            wait_for(f"{name}'s write task holding", held.exists, driver, tmp_path)
            assert staged_rows(dsn, name) > 0, f"{name}: the holding attempt committed no staged rows"
            killed.append(kill_executor(cluster))
            held.unlink()  # the killed attempt's Python worker, if still alive, goes on
    finally:
        results = finish(driver, tmp_path)
    assert len(set(killed)) == len(REBUILT), f"one executor per rebuild killed: {killed}"
    assert set(results) == set(REBUILT)
    for name, r in results.items():
        assert r["failed"] >= 1, f"{name}: no task attempt was lost with the executor ({r})"
        assert r["discarded"] > 0, f"{name}: the killed attempt's committed rows were not staged ({r})"
    lost = doubled = 0
    for name in REBUILT:
        missing, extra = lost_and_doubled(dsn, name, log_dir)
        lost, doubled = lost + missing, doubled + extra
        assert (missing, extra) == (0, 0), f"{name}: {missing} reference rows missing, {extra} extra"
        assert view_rows(dsn, VIEWS[name]) == expected_rows(VIEWS[name], log_dir), name
    with psycopg.connect(dsn) as conn:  # one state per stream of each fold view
        for name in set(REBUILT) & {"users", "seats", "snapshots"}:
            row = conn.execute(
                "SELECT count(*), count(DISTINCT stream_id) FROM projection_state WHERE projection = %s", (name,)
            ).fetchone()
            assert row is not None and row[0] == row[1] > 0, name
    assert leftovers(dsn) == []
    record_fault_result(FAULT_CLASS, "executor SIGKILLed mid-rebuild, after a write task committed its staged rows",
                        injected=len(killed), survived=len(killed), records_lost=lost, duplicates=doubled,
                        detail=f"{len(REBUILT)} views, {sum(r['discarded'] for r in results.values())} staged rows "
                               f"of killed attempts discarded")  # fmt: skip


def test_follow_survives_its_executor_killed_mid_batch(
    cluster: Cluster, workload: tuple[str, Path], postgres: LocalPostgres, tmp_path: Path
) -> None:
    """Each view followed from scratch in micro-batches: after a batch committed, a read task
    of a later batch holds its records and the executor is SIGKILLed under it; the batch's
    jobs re-run the lost task on a new executor. Caught up, the view equals the reference."""
    _, log_dir = workload
    dsn = migrated_database(postgres, "killfollow")  # the views from nothing: every event applied by follow
    flags = tmp_path / "flags"
    flags.mkdir()
    ends = {name: log_end_offsets(log_dir, VIEWS[name].topics) for name in FOLLOWED}
    smallest = min(sum(sum(per.values()) for per in ends[name].values()) for name in FOLLOWED)
    max_records = max(1, smallest // (FOLLOW_KILLS + 1))  # a batch for every kill after the first, in every view
    driver = start_driver(cluster, log_dir, dsn, tmp_path, "follow", str(flags), str(tmp_path / "ckpt"),
                          str(max_records), str(FOLLOW_KILLS), *FOLLOWED)  # fmt: skip
    killed: list[int] = []
    try:
        for _ in range(len(FOLLOWED) * FOLLOW_KILLS):
            wait_for("a read task stalled", lambda: any(flags.glob("stalled-*")), driver, tmp_path)
            killed.append(kill_executor(cluster))
            for stalled in flags.glob("stalled-*"):
                stalled.unlink()  # the killed attempt's Python worker, if still alive, goes on
    finally:
        results = finish(driver, tmp_path)
    assert set(results) == set(FOLLOWED)
    last = results[FOLLOWED[-1]]
    assert last["executors_lost"] == len(killed), f"{len(killed)} executors killed, Spark lost {last}"
    assert last["failed"] >= len(killed), f"the kills did not land in running tasks ({last})"
    lost = doubled = 0
    for name in FOLLOWED:
        assert results[name]["batches"] >= FOLLOW_KILLS + 1, results[name]
        assert checkpoints(dsn, name) == ends[name], name
        missing, extra = lost_and_doubled(dsn, name, log_dir)
        lost, doubled = lost + missing, doubled + extra
        assert (missing, extra) == (0, 0), f"{name}: {missing} reference rows missing, {extra} extra"
        assert view_rows(dsn, VIEWS[name]) == expected_rows(VIEWS[name], log_dir), name
    assert leftovers(dsn) == []
    record_fault_result(FAULT_CLASS, "executor SIGKILLed mid-batch of a follow job (a read task holding its records)",
                        injected=len(killed), survived=len(killed), records_lost=lost, duplicates=doubled,
                        detail=f"{len(FOLLOWED)} views, {last['failed']} task attempts lost")  # fmt: skip
