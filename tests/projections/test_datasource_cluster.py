"""The tideline source and a view rebuild on a Spark standalone cluster (a master and two workers
started from the pyspark wheel on 127.0.0.1 and 127.0.0.2), driven from their own processes with
``master("spark://…")`` / ``--master spark://…``; and a user's views package that lives outside the
repository, which the executors get only because Tideline ships it (projections.shipping)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from projections_util import consumer_rows
from spark_cluster import standalone_cluster
from userapp_util import AppLog, user_database
from views_util import capture, drop_slots, issue_commands, migrated_database

from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from examples.reservations.views import VIEWS
from projections.reference import expected_rows, view_rows
from projections.views import load_catalog
from tideline.pgharness import LocalPostgres

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("cluster_driver.py")
TIDELINE = str(Path(sys.executable).with_name("tideline"))


@pytest.fixture(scope="module")
def standalone_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``spark://127.0.0.1:P`` with two registered workers (127.0.0.1 and 127.0.0.2, 1 core, 1 GiB
    each); all stopped by PID afterwards."""
    with standalone_cluster(tmp_path_factory.mktemp("spark-standalone"), ["127.0.0.1", "127.0.0.2"]) as cluster:
        yield cluster.url


def test_read_on_a_standalone_cluster(standalone_master: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with Log(log_dir, fsync=FsyncPolicy(FsyncMode.NONE)) as log:
        log.create_topic("c", partitions=2, overrides={"segment_bytes": "2048"})
        with Producer(log) as producer:
            for i in range(5):
                producer.send_batch(
                    "c",
                    [f"v{i}-{j}".encode() if j % 9 else None for j in range(30)],
                    [f"k{j}".encode() for j in range(30)],
                )
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, str(DRIVER), standalone_master, str(log_dir), "c", str(REPO_ROOT)],
        env=env,
        capture_output=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert result["master"] == standalone_master
    expected = [
        [r[0], r[1], r[2], r[3], None if r[4] is None else r[4].hex(), None if r[5] is None else r[5].hex(), r[7]]
        for r in consumer_rows(log_dir, ["c"])
    ]
    assert result["rows"] == expected and len(expected) == 150
    # the Python workers that read the log ran in the standalone worker's application directory
    assert result["worker_dirs"] and all("/work/app-" in d for d in result["worker_dirs"])


def test_rebuild_on_a_standalone_cluster(standalone_master: str, postgres: LocalPostgres, tmp_path: Path) -> None:
    """``tideline project rebuild seats --master spark://…``: the fold view's rebuild (Arrow
    batches to Python workers, folds and COPY on the cluster's executor) on the standalone
    cluster, from events captured from a real database, equals the reference fold."""
    dsn = migrated_database(postgres, "cluster")
    log_dir = tmp_path / "log"
    assert issue_commands(dsn, 80, random.Random(17), "cl") > 0
    capture(log_dir, dsn)
    drop_slots(dsn)
    argv = [TIDELINE, "--data-dir", str(log_dir), "project", "rebuild", "seats", "--dsn", dsn]
    argv += ["--master", standalone_master, "--json"]
    done = subprocess.run(
        argv, env={**os.environ, "PYSPARK_PYTHON": sys.executable}, capture_output=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    summary = json.loads(done.stdout.decode().strip().splitlines()[-1])
    view = VIEWS["seats"]
    expected = expected_rows(view, log_dir)
    assert summary["projection"] == "seats" and summary["events"] > 0 and summary["rows"] == len(expected) > 0
    assert view_rows(dsn, view) == expected


def test_a_views_package_outside_the_repository_rebuilds_on_the_cluster(
    standalone_master: str, postgres: LocalPostgres, tmp_path: Path
) -> None:
    """The tests' userapp, copied under a fresh package name into a directory outside the repository
    that only the driver has on its ``sys.path`` (no ``PYTHONPATH`` anywhere): its fold view (the
    executors import the package to fold) rebuilds on both workers of the cluster and equals the
    reference; the zip shipped to the executors holds the package and no bytecode. (Its count view is
    not rebuilt here: a count is Spark SQL on the executors, no user code, and each rebuild is a Spark
    application of its own, about 35 s on this cluster.)"""
    outside = tmp_path / "app"
    assert not outside.resolve().is_relative_to(REPO_ROOT)
    package = f"ua_outside_{uuid.uuid4().hex[:8]}"
    shutil.copytree(
        Path(__file__).with_name("userapp"), outside / package, ignore=shutil.ignore_patterns("__pycache__")
    )
    dsn = user_database(postgres, "outside")
    log = AppLog(tmp_path / "log")
    log.write(events=400)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_SUBMIT_ARGS")}
    env["PYSPARK_PYTHON"] = sys.executable
    for view in ("ua_accounts",):
        argv = ["tideline", "--data-dir", str(log.path), "project", "rebuild", view, "--dsn", dsn,
                "--views", f"{package}.views", "--master", standalone_master, "--json"]  # fmt: skip
        driver = f"import sys; sys.path.insert(0, {str(outside)!r}); sys.argv = {argv!r}; "
        driver += "from tideline.cli import main; main()"
        done = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr.decode()[-4000:]
        summary = json.loads(done.stdout.decode().strip().splitlines()[-1])
        assert summary["engine"] == "spark" and summary["engine_reason"] == f"--master {standalone_master} given"
        sys.path.insert(0, str(outside))
        try:
            catalog = load_catalog(f"{package}.views")
        finally:
            sys.path.remove(str(outside))
        expected = expected_rows(catalog[view], log.path)
        assert summary["events"] == 400 and summary["rows"] == len(expected) > 0
        assert view_rows(dsn, catalog[view]) == expected
