"""Rebuilds under Spark's own fault tolerance (issue 17, part 1): a task attempt that
committed its output and then failed is retried, and a straggler gets a speculative copy on
another host; either way two attempts write. Every write path (fold views, snapshots, the
count view's DataFrame, mirrors) must still leave exactly the reference fold, and no
staging or shadow table behind.

The fault is injected right after an attempt committed (projections.attempts.FAULT_PROPERTY):
the window in which the rebuild before attempt-aware staging duplicated rows (the swap then
failed on a primary key, or a table without one kept duplicates)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession
from readiness import patience
from spark_cluster import standalone_cluster
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
from projections import attempts
from projections.rebuild import RebuildResult, rebuild
from projections.reference import expected_rows, view_rows
from tideline.pgharness import LocalPostgres
from tideline.reliability import record_fault_result

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("rebuild_driver.py")
# Every write path once: a fold view, a DataFrame view, aggregate snapshots, a mirror (seats, a second
# fold view, adds nothing but time)
SHIPPED = ["users", "show_occupancy", "snapshots", f"mirror:{ACCOUNTS_TOPIC}"]
FAULT_CLASS = "spark rebuild attempts"  # RELIABILITY.md row (records lost: reference rows missing; duplicates: extra)


@pytest.fixture(scope="module")
def workload(postgres: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A database and the log captured from it: commands of every kind, and CDC changes."""
    dsn = migrated_database(postgres, "attempts")
    log_dir = tmp_path_factory.mktemp("attempts") / "log"
    capture(log_dir, dsn)
    assert issue_commands(dsn, 150, random.Random(41), "at") > 0
    change_accounts(dsn, 120, random.Random(43))
    with psycopg.connect(dsn, autocommit=True) as c:  # enough keys that every write task of the mirror has rows
        c.execute("INSERT INTO accounts SELECT g, 'o' || g, g FROM generate_series(200, 239) g")
    capture(log_dir, dsn)
    yield dsn, log_dir
    drop_slots(dsn)


# Speculation, make test size: a fold view and a mirror (the two staging layouts); the soak: every write path
SPECULATED = SHIPPED if soak() else ["users", f"mirror:{ACCOUNTS_TOPIC}"]


def run_driver(
    master: str, log_dir: Path, dsn: str, fault: str, views: list[str] = SHIPPED
) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, str(DRIVER), master, str(log_dir), dsn, fault, *views],
        env=env,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    lines = [json.loads(line) for line in done.stdout.decode().splitlines() if line.startswith("{")]
    return {r["view"]: r for r in lines}


def assert_views_equal_reference(dsn: str, log_dir: Path, views: list[str] = SHIPPED) -> None:
    for name in views:
        expected = expected_rows(VIEWS[name], log_dir)
        assert expected, name
        assert view_rows(dsn, VIEWS[name]) == expected, name
    with psycopg.connect(dsn) as conn:  # one state per stream of each fold view
        for name in {"users", "snapshots"} & set(views):
            row = conn.execute(
                "SELECT count(*), count(DISTINCT stream_id) FROM projection_state WHERE projection = %s", (name,)
            ).fetchone()
            assert row is not None and row[0] == row[1] > 0, name


def test_rebuild_survives_first_attempts_failing_after_they_committed(workload: tuple[str, Path]) -> None:
    """``local[2,4]`` (4 attempts per task): the first attempt of partitions 0 and 1 of every
    write job commits its rows, then raises; Spark retries it."""
    dsn, log_dir = workload
    results = run_driver("local[2,4]", log_dir, dsn, "fail:0,1")
    assert set(results) == set(SHIPPED)
    for name, r in results.items():
        assert r["failed"] >= 1, f"{name}: no task attempt failed: the fault was not injected ({r})"
        assert r["discarded"] > 0, f"{name}: the failed attempts' committed rows were not staged ({r})"
    assert_views_equal_reference(dsn, log_dir)
    assert leftovers(dsn) == []
    failed = sum(r["failed"] for r in results.values())
    discarded = sum(r["discarded"] for r in results.values())
    record_fault_result(FAULT_CLASS, "first task attempts fail after committing their rows (local[2,4])",
                        injected=failed, survived=failed, records_lost=0, duplicates=0,
                        detail=f"{len(results)} views, {discarded} rows discarded")  # fmt: skip


@pytest.fixture(scope="module")
def two_host_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone master with two workers on two loopback addresses (127.0.0.1, 127.0.0.2),
    1 core and 1 GiB each: Spark never runs a speculative copy on the host of the original
    attempt, so speculation needs two hosts. All three stopped by PID afterwards."""
    with standalone_cluster(tmp_path_factory.mktemp("spark-two-hosts"), ["127.0.0.1", "127.0.0.2"]) as cluster:
        yield cluster.url


def test_rebuild_survives_speculative_copies(two_host_cluster: str, workload: tuple[str, Path]) -> None:
    """Speculation on, two hosts: the first attempt of partition 0 of every write job commits
    its rows and then stalls; Spark launches a copy on the other host, keeps the copy, and
    kills the straggler."""
    dsn, log_dir = workload
    results = run_driver(two_host_cluster, log_dir, dsn, "straggle:60:0", SPECULATED)
    assert set(results) == set(SPECULATED)
    for name, r in results.items():
        assert r["discarded"] > 0, f"{name}: no speculative copy's twin was discarded ({r})"
    assert_views_equal_reference(dsn, log_dir, SPECULATED)
    assert leftovers(dsn) == []
    record_fault_result(FAULT_CLASS, "first task attempts straggle after committing: speculative copies (2 hosts)",
                        injected=len(results), survived=len(results), records_lost=0, duplicates=0,
                        detail=f"{sum(r['discarded'] for r in results.values())} rows discarded")  # fmt: skip


# -- zombies: attempts Spark gave up on that still run -------------------------------------------
#
# An executor declared lost (missed heartbeats) keeps running its tasks, and a killed task's
# Python worker runs until the kill reaches it: such an attempt may commit its staged rows at
# any moment, also while the driver swaps. Spark offers no way to time that, so the zombie
# here is a plain connection writing what such an attempt writes (rows tagged with an attempt
# id Spark did not keep), timed by Postgres's own locks against the real rebuild.


class Zombie(threading.Thread):
    """Writes copies of a few staged rows, tagged with an attempt id Spark never kept, into
    ``staging`` in a transaction that also locks ``target`` (the table the swap writes); commits
    once the swap waits for that lock — i.e. in the middle of the swap transaction."""

    def __init__(self, dsn: str, staging: str, target: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.staging, self.target = dsn, staging, target
        self.holding = threading.Event()
        self.saw_swap_waiting = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as conn:
                conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(self.target)))
                staging = sql.Identifier(self.staging)
                conn.execute(
                    sql.SQL("CREATE TEMP TABLE zombie ON COMMIT DROP AS SELECT * FROM {} LIMIT 5").format(staging)
                )
                conn.execute("UPDATE zombie SET task_attempt = task_attempt + 1000000000000")
                conn.execute(sql.SQL("INSERT INTO {} SELECT * FROM zombie").format(staging))
                self.holding.set()
                deadline = time.monotonic() + 300  # a safety net only: the test asserts the wait was seen
                while time.monotonic() < deadline:
                    row = conn.execute(
                        "SELECT count(*) FROM pg_locks WHERE relation = CAST(%s AS regclass) AND NOT granted",
                        (self.target,),
                    ).fetchone()
                    if row and row[0] > 0:
                        self.saw_swap_waiting = True
                        break
                    time.sleep(0.01)
            # committed on leaving the block: the swap's next statement sees the zombie's rows
        except BaseException as e:
            self.error = e
            self.holding.set()


def rebuild_with_zombie(spark: SparkSession, dsn: str, log_dir: Path, name: str) -> Zombie:
    """Rebuild ``name`` with a :class:`Zombie` writing into its rows' staging table during the
    swap; the zombie, finished."""
    staging: list[str] = []
    zombies: list[Zombie] = []

    def stage(message: str) -> None:
        if message.startswith("reading "):
            staging.append(message.rsplit(" ", 1)[-1])  # "… and writing <rows staging table>"
        elif message == "swapping the view in":
            zombies.append(Zombie(dsn, staging[-1], VIEWS[name].table.name))
            zombies[-1].start()
            zombies[-1].holding.wait()

    rebuild(spark, VIEWS, name, log_dir=log_dir, dsn=dsn, stage=stage)
    (zombie,) = zombies
    zombie.join()
    return zombie


def test_rows_a_zombie_attempt_commits_during_the_swap_stay_out_of_the_view(
    spark: SparkSession, workload: tuple[str, Path]
) -> None:
    """Regression (a delete-then-copy swap): the staged rows of the attempts Spark did not keep
    were deleted, then the view built from what was left — a zombie's commit between the two
    statements reached the view (duplicates: a primary key violated, or silently doubled rows)."""
    dsn, log_dir = workload
    for name in SHIPPED:
        view = VIEWS[name]
        zombie = rebuild_with_zombie(spark, dsn, log_dir, name)
        assert zombie.error is None, f"{name}: {zombie.error!r}"
        assert zombie.saw_swap_waiting, f"{name}: the swap never waited for {view.table.name}"
        assert view_rows(dsn, view) == expected_rows(view, log_dir), name
    assert_views_equal_reference(dsn, log_dir)
    assert leftovers(dsn) == []
    record_fault_result(FAULT_CLASS, "a zombie attempt commits staged rows in the middle of the swap",
                        injected=len(SHIPPED), survived=len(SHIPPED), records_lost=0, duplicates=0)  # fmt: skip


def test_two_rebuilds_of_one_view_at_once_keep_apart(spark: SparkSession, workload: tuple[str, Path]) -> None:
    """A second ``rebuild users`` starts while the first is about to swap (two operators, a
    cron job): both rebuilds hold the whole view. Regression: staging tables named per view
    only — the second dropped and recreated the first's, the first swapped in the second's
    (still empty) table and then dropped it under the second, which failed. The same naming
    let a zombie of an earlier Spark application (attempt ids start again at 0 in each) write
    into a later rebuild's staging table under an id that rebuild keeps."""
    dsn, log_dir = workload
    view = VIEWS["users"]
    expected = expected_rows(view, log_dir)
    second: list[RebuildResult | BaseException] = []

    def run_second() -> None:
        try:
            second.append(rebuild(spark, VIEWS, "users", log_dir=log_dir, dsn=dsn))
        except BaseException as e:
            second.append(e)

    def staging_tables() -> set[int]:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(r"SELECT oid FROM pg_class WHERE relname LIKE 'users\_\_%staging'").fetchall()
        return {int(r[0]) for r in rows}

    thread = threading.Thread(target=run_second, daemon=True)

    def stage(message: str) -> None:
        if message != "swapping the view in":
            return
        before = staging_tables()
        thread.start()
        deadline = time.monotonic() + 300  # a safety net only
        while len(staging_tables() - before) < 2 and not second and time.monotonic() < deadline:
            time.sleep(0.01)  # until the second rebuild created its two staging tables

    first = rebuild(spark, VIEWS, "users", log_dir=log_dir, dsn=dsn, stage=stage)
    thread.join(600)
    assert first.rows == len(expected), "the first rebuild swapped in an incomplete view"
    (result,) = second
    assert isinstance(result, RebuildResult), f"the second rebuild failed: {result!r}"
    assert result.rows == len(expected)
    assert view_rows(dsn, view) == expected
    assert leftovers(dsn) == []
    record_fault_result(FAULT_CLASS, "a second rebuild of the view starts while the first swaps",
                        injected=1, survived=1, records_lost=0, duplicates=0)  # fmt: skip


KILLED_DRIVER = """
import sys, time
from projections import attempts
with attempts.staging_run(sys.argv[1], "users") as run:
    print(run.create("users"), flush=True)
    time.sleep(600)
"""


def tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {r[0] for r in conn.execute("SELECT relname FROM pg_class WHERE relkind = 'r'")}


def test_a_killed_drivers_staging_is_dropped_by_the_next_rebuild_a_running_ones_is_not(
    workload: tuple[str, Path],
) -> None:
    """Crash policy of projections.attempts: a driver killed mid-rebuild (kill -9: no
    ``finally``) leaves its staging table; the next rebuild drops it — its run's lock went
    with the killed driver's connection — but not the table of a rebuild still running."""
    dsn, _ = workload
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, dsn], env=env, stdout=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        abandoned = driver.stdout.readline().decode().strip()
    finally:
        driver.kill()
        driver.wait()
    assert abandoned in tables(dsn)
    token = int(abandoned.split("__")[-2], 16)
    deadline = time.monotonic() + patience(60)  # until the server noticed the lost connection (a safety net only)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s",
                (attempts.STAGING_LOCK_CLASS, token),
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            time.sleep(0.05)
    with attempts.staging_run(dsn, "seats") as running:
        live = running.create("seats")
        with attempts.staging_run(dsn, "users"):
            left = tables(dsn)
            assert abandoned not in left
            assert live in left
    assert live not in tables(dsn)
