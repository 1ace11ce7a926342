"""tideline.connectharness without a JVM: the connector's settings, the jar cache check, CPU of a process tree.

The harness itself (Kafka Connect + Debezium against Postgres and Kafka) runs in
tests/capture/test_debezium_envelope.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tideline.connectharness import (
    COMPARABLE_SETTINGS,
    ConnectHarnessError,
    debezium_jar_dir,
    debezium_postgres_config,
    process_tree_cpu_seconds,
)


def test_connector_settings_come_from_the_dsn_and_the_comparable_settings() -> None:
    config = debezium_postgres_config("postgresql://postgres@127.0.0.1:5544/my%20db", slot="s", publication="p",
                                      topic_prefix="dbz", overrides={"snapshot.mode": "no_data"})  # fmt: skip
    host = (config["database.hostname"], config["database.port"], config["database.user"])
    assert host == ("127.0.0.1", "5544", "postgres")
    assert config["database.dbname"] == "my db" and config["database.password"] == ""
    assert (config["slot.name"], config["publication.name"], config["topic.prefix"]) == ("s", "p", "dbz")
    assert config["snapshot.mode"] == "no_data"  # the override wins
    assert {k: config[k] for k in COMPARABLE_SETTINGS if k != "snapshot.mode"} == {
        k: v for k, v in COMPARABLE_SETTINGS.items() if k != "snapshot.mode"
    }
    assert config["plugin.name"] == "pgoutput" and config["skipped.operations"] == "none"


def test_missing_jars_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConnectHarnessError, match="make jars"):
        debezium_jar_dir(tmp_path / "nothing")


def test_cpu_of_an_exited_process_tree_includes_threads_and_children() -> None:
    """Read when the child has exited but is not reaped: the kernel's final utime+stime, with cutime+cstime."""
    burn = "import time\nt = time.thread_time()\nwhile time.thread_time() - t < {s}: pass\n"
    code = (
        "import subprocess, sys, threading\n"
        f"threads = [threading.Thread(target=exec, args=({burn.format(s=0.3)!r},)) for _ in range(2)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        f"subprocess.run([sys.executable, '-c', {burn.format(s=0.3)!r}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    cpu = process_tree_cpu_seconds(proc.pid)
    _, _, usage = os.wait4(proc.pid, 0)
    assert cpu >= 0.85  # two threads and a child, 0.3 s each
    assert abs(cpu - (usage.ru_utime + usage.ru_stime)) < 0.05  # the same counters as wait4's rusage
    assert process_tree_cpu_seconds(proc.pid) == 0.0  # reaped: gone
