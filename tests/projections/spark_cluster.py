"""A Spark standalone cluster for tests, started from the pyspark wheel: a master and one
worker per loopback address (1 core, 1 GiB each), every daemon in a process group of its
own, all stopped by PID afterwards; and the processes of it a test may kill (an
executor: a descendant of a worker *this* cluster started, never looked up by name)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyspark
import pytest

SPARK_HOME = Path(pyspark.__file__).parent
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once while choosing, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this test started (the daemon and its executors), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as response:
            state = json.load(response)
    except (OSError, ValueError):  # not listening yet, or still starting (its /json/ answered with HTML)
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


@dataclass
class Cluster:
    url: str  # spark://127.0.0.1:PORT
    ui_port: int  # the master's web UI (/json/)
    master: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]]
    killed: list[tuple[int, str]] = field(default_factory=list)  # (pid, start time) of what a test killed or orphaned


@contextmanager
def standalone_cluster(work: Path, hosts: list[str], *, start_timeout: float = 120) -> Iterator[Cluster]:
    """A master on 127.0.0.1 and one worker on each of ``hosts`` (loopback addresses); logs
    ``master.log`` and ``worker-N.log`` and each worker's application directories under
    ``worker-N/work`` in ``work``."""
    port, ui_port, *worker_uis = free_ports(2 + len(hosts))
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    url = f"spark://127.0.0.1:{port}"
    base = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOG_DIR": str(work)}
    started: list[subprocess.Popen[bytes]] = []

    def launch(name: str, host: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(work / f"{name}.log", "wb") as log:
            started.append(
                subprocess.Popen(
                    [spark_class, *argv, "--host", host],
                    env={**base, "SPARK_LOCAL_IP": host},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return started[-1]

    cluster: Cluster | None = None
    try:
        master = launch(
            "master",
            "127.0.0.1",
            ["org.apache.spark.deploy.master.Master", "--port", str(port), "--webui-port", str(ui_port)],
        )
        workers = []
        for i, (host, ui) in enumerate(zip(hosts, worker_uis, strict=True)):
            argv = ["org.apache.spark.deploy.worker.Worker", url, "--cores", "1", "--memory", "1g"]
            argv += ["--webui-port", str(ui), "--work-dir", str(work / f"worker-{i}" / "work")]
            workers.append(launch(f"worker-{i}", host, argv))
        deadline = time.monotonic() + start_timeout
        while alive_workers(ui_port) < len(hosts):
            if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                logs = "".join(p.read_text()[-1500:] for p in sorted(work.glob("*.log")))
                pytest.fail(f"the standalone master and {len(hosts)} worker(s) did not come up:\n{logs}")
            time.sleep(0.5)
        cluster = Cluster(url, ui_port, master, workers)
        yield cluster
    finally:
        for proc in reversed(started):
            stop(proc)
        for pid, start in cluster.killed if cluster is not None else ():
            if _start_time(pid) == start:  # still the process the test orphaned (a Python worker of a killed executor)
                os.kill(pid, signal.SIGKILL)


# -- the processes of a worker ------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's children, /proc/PID/task/*/children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread or the process ended meanwhile
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    out: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo += children(child)
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time since boot): tells a PID's process from a later one with its number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def executors(worker: subprocess.Popen[bytes]) -> list[int]:
    """The executor JVMs (``CoarseGrainedExecutorBackend``) the worker ``worker`` launched: its
    own child processes (found through /proc, below the PID this test started)."""
    return [pid for pid in children(worker.pid) if EXECUTOR_CLASS in cmdline(pid)]


def kill_executor(cluster: Cluster, worker: int = 0) -> int:
    """SIGKILL the one executor running on worker ``worker`` of ``cluster``; its PID. The
    executor's own children (its Python workers) are left to die as they do when an executor
    is lost; any still alive when the cluster stops is killed then."""
    (pid,) = executors(cluster.workers[worker])
    below = [(p, _start_time(p)) for p in descendants(pid)]
    os.kill(pid, signal.SIGKILL)
    cluster.killed += [(p, s) for p, s in below if s is not None]
    return pid
