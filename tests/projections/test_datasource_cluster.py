"""The tideline source and a view rebuild on a Spark standalone cluster (master + one worker
started from the pyspark wheel on 127.0.0.1), driven from their own processes with
``master("spark://…")`` / ``--master spark://…``."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest
from projections_util import consumer_rows
from views_util import capture, drop_slots, issue_commands, migrated_database

from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from examples.reservations.views import VIEWS
from projections.reference import expected_rows, view_rows
from tideline.pgharness import LocalPostgres

REPO_ROOT = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(pyspark.__file__).parent
DRIVER = Path(__file__).with_name("cluster_driver.py")
TIDELINE = str(Path(sys.executable).with_name("tideline"))


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once while choosing, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this test started (the daemon and its executors), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as response:
            state = json.load(response)
    except (OSError, ValueError):  # not listening yet, or still starting (its /json/ answered with HTML)
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


@pytest.fixture(scope="module")
def standalone_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``spark://127.0.0.1:P`` with one registered worker (1 core, 1 GiB); both stopped by PID afterwards."""
    work = tmp_path_factory.mktemp("spark-standalone")
    port, ui_port, worker_ui = _free_ports(3)
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(work)}
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    url = f"spark://127.0.0.1:{port}"
    started: list[subprocess.Popen[bytes]] = []
    try:
        with open(work / "master.log", "wb") as master_log, open(work / "worker.log", "wb") as worker_log:
            master_cmd = [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"]
            master_cmd += ["--port", str(port), "--webui-port", str(ui_port)]
            started.append(
                subprocess.Popen(
                    master_cmd, env=env, stdout=master_log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            worker_cmd = [spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1"]
            worker_cmd += [
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                str(worker_ui),
                "--work-dir",
                str(work / "work"),
            ]
            started.append(
                subprocess.Popen(
                    worker_cmd, env=env, stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = time.monotonic() + 90
        while _alive_workers(ui_port) < 1:
            if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                logs = (work / "master.log").read_text()[-2000:] + (work / "worker.log").read_text()[-2000:]
                pytest.fail(f"the standalone master and worker did not come up:\n{logs}")
            time.sleep(0.5)
        yield url
    finally:
        for proc in reversed(started):
            _stop(proc)


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
