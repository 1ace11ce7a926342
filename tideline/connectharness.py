"""Kafka Connect standalone running Debezium's PostgreSQL connector, for comparisons with Tideline.

The side-by-side comparison (tests/capture/test_debezium_envelope.py, ``python -m bench
debezium``) runs Debezium's connector next to Tideline's capture: both read a copy of one
replication slot (``copy_slot``: ``pg_copy_logical_replication_slot``), so both decode the
same WAL, and both write into the same Kafka cluster. The worker runs from the jar cache
(``make jars``: ``.cache/jars/debezium/``, or ``$TIDELINE_JAR_CACHE/debezium/``, see
jvm/debezium/pom.xml) with ``java -cp``; nothing is downloaded at run time. Usage::

    with LocalConnect(Path("connect"), kafka.bootstrap_servers) as connect:
        connect.add_connector("dbz", debezium_postgres_config(dsn, slot="dbz", publication="p",
                                                              topic_prefix="dbz"))
        connect.wait_running("dbz")
        connect.wait_for_log("Snapshot completed")   # or read its topics
        connect.cpu_seconds()                        # utime+stime of the worker's process tree

Directory layout (the harness owns everything under ``D``)::

    D/
      worker.properties   the worker's settings (``_worker_settings``), written at start
      log4j2.properties   INFO to connect.log
      connect.log         the worker's and the connector's log
      stdout.log          JVM stdout and stderr (crashes)
      offsets.dat         the standalone worker's source offsets (private: a new
                          directory starts the connector from scratch)

The worker: ``org.apache.kafka.connect.cli.ConnectStandalone D/worker.properties``, no
connector on the command line (connectors are added over the REST API), the REST API on
a free port of 127.0.0.1, JSON converters with ``schemas.enable=false`` for keys and
values (the envelope Tideline writes), topic creation by the worker (the harness's
brokers do not auto-create topics). JVM flags as Kafka's own start scripts
(``kafka-run-class.sh``: G1, 20 ms pause target) with a heap of ``heap``; ``worker_settings``
add to (or override) worker.properties.

Crash policy: the worker is this harness's iff its PID (kept in memory, not on disk)
is alive and runs ConnectStandalone with ``D/worker.properties``; ``stop()`` sends
SIGTERM, then SIGKILL after ``stop_timeout``, to that PID only, never by name. A worker
left behind by a crashed test process is not found again: use a fresh directory.

Thread safety: none; one owner. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg.conninfo import conninfo_to_dict

from eventstore.errors import TidelineError
from tideline.kafkaharness import _free_ports, _java, _pid_alive, _reap, cached_jar_dir, log4j2_properties

log = logging.getLogger(__name__)

DEBEZIUM_JARS_SUBDIR = "debezium"
COMPLETE_MARKER = "COMPLETE"  # written by jvm/fetch-jars.sh last: "<debezium version>/<connect version>"
MAIN_CLASS = "org.apache.kafka.connect.cli.ConnectStandalone"
CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
DEFAULT_HEAP = "1g"
POLL_SECONDS = 0.2
JARS_HINT = "run `make jars` (Maven fetches Kafka Connect and Debezium into the jar cache once)"

# Kafka's kafka-run-class.sh defaults (KAFKA_JVM_PERFORMANCE_OPTS), so Debezium runs as it is usually run.
JVM_FLAGS = ("-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
             "-XX:+ExplicitGCInvokesConcurrent", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")  # fmt: skip

# The settings that make Debezium's envelope comparable with Tideline's JSON (docs/capture.md,
# "Differences from Debezium", says why each was chosen). Anything here can be overridden per call.
COMPARABLE_SETTINGS: Mapping[str, str] = {
    "plugin.name": "pgoutput",
    "publication.autocreate.mode": "disabled",  # Tideline's publication, as Tideline made it
    "snapshot.mode": "initial",
    "decimal.handling.mode": "string",  # exact digits, and NaN/±Infinity (precise: base64 bytes; double: rounded)
    "time.precision.mode": "isostring",  # ISO 8601 strings like Tideline's (default adaptive: epoch integers)
    "binary.handling.mode": "base64",  # Tideline's bytea (default bytes: base64 too through the JSON converter)
    "interval.handling.mode": "string",  # ISO 8601 (default numeric: approximate microseconds)
    "hstore.handling.mode": "json",
    "tombstones.on.delete": "true",
    "provide.transaction.metadata": "false",
    "skipped.operations": "none",  # default "t": truncates skipped; Tideline writes them
    "include.unknown.datatypes": "true",
    "slot.drop.on.stop": "false",
    "topic.creation.default.replication.factor": "1",
    "topic.creation.default.partitions": "1",
    # Left at Kafka's default cleanup.policy=delete: Debezium keys a truncate with null, which a compacted
    # topic rejects ("failed to send record", and the task dies); Tideline keys it {} (docs/capture.md).
}


class ConnectHarnessError(TidelineError):
    """Kafka Connect or the Debezium connector cannot be set up, started, or failed; the message says why."""


def debezium_jar_dir(jar_dir: Path | None = None) -> Path:
    """The Connect + Debezium jars: ``jar_dir``, else ``$TIDELINE_JAR_CACHE/debezium``, else the repo's cache."""
    jar_dir, complete = cached_jar_dir(DEBEZIUM_JARS_SUBDIR, jar_dir)
    if not complete:
        raise ConnectHarnessError(f"Debezium's jars not found in {jar_dir}: {JARS_HINT}")
    return jar_dir


def debezium_version(jar_dir: Path | None = None) -> str:
    """Debezium's version in the jar cache (``3.7.0.Final``)."""
    return (debezium_jar_dir(jar_dir) / COMPLETE_MARKER).read_text().strip().split("/")[0]


def copy_slot(dsn: str, source: str, target: str) -> str:
    """A logical slot ``target`` reading the same WAL as ``source`` from the same position; returns
    the LSN it starts at. ``source`` may be in use; its position is the one it last confirmed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (source, target))
        row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                           (target,)).fetchone()  # fmt: skip
    assert row is not None
    return str(row[0])


def debezium_postgres_config(
    dsn: str, *, slot: str, publication: str, topic_prefix: str, overrides: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Debezium's PostgreSQL connector on ``dsn``'s database reading ``slot`` through ``publication``,
    with ``COMPARABLE_SETTINGS``, then ``overrides`` (connector settings: ``{"snapshot.mode": "never"}``)."""
    info = conninfo_to_dict(dsn)
    config = {
        "connector.class": CONNECTOR_CLASS,
        "tasks.max": "1",
        "database.hostname": str(info.get("host") or "127.0.0.1"),
        "database.port": str(info.get("port") or 5432),
        "database.user": str(info.get("user") or "postgres"),
        "database.password": str(info.get("password") or ""),
        "database.dbname": str(info["dbname"]),
        "topic.prefix": topic_prefix,
        "slot.name": slot,
        "publication.name": publication,
        **COMPARABLE_SETTINGS,
    }
    config.update(overrides or {})
    return config


@dataclass
class LocalConnect:
    """A Kafka Connect standalone worker in ``directory`` writing to ``bootstrap_servers``."""

    directory: Path
    bootstrap_servers: str
    heap: str = DEFAULT_HEAP
    jar_dir: Path | None = None
    worker_settings: Mapping[str, str] = field(default_factory=dict)  # worker.properties beyond the harness's own
    start_timeout: float = 120.0  # seconds until the REST API answers
    stop_timeout: float = 30.0  # seconds after SIGTERM before SIGKILL
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _port: int = field(default=0, init=False, repr=False)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> str:
        """Start the worker and wait until its REST API answers; returns its URL. Idempotent."""
        if self.running:
            return self.url
        jars, java = debezium_jar_dir(self.jar_dir), _java()
        root = self.directory.resolve()
        root.mkdir(parents=True, exist_ok=True)
        (self._port,) = _free_ports(1)
        settings = _worker_settings(self.bootstrap_servers, root / "offsets.dat", self._port)
        settings.update(self.worker_settings)
        _write(root / "worker.properties", "".join(f"{k}={v}\n" for k, v in settings.items()))
        log4j = log4j2_properties("tideline.connectharness", root / "connect.log", {"org.reflections": "ERROR"})
        _write(root / "log4j2.properties", log4j)
        argv = [java, f"-Xmx{self.heap}", *JVM_FLAGS, f"-Dlog4j2.configurationFile={root / 'log4j2.properties'}",
                "-cp", f"{jars}/*", MAIN_CLASS, str(root / "worker.properties")]  # fmt: skip
        with open(root / "stdout.log", "ab") as out:
            self._proc = subprocess.Popen(argv, cwd=root, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                          start_new_session=True)  # fmt: skip
        log.info("started Kafka Connect (PID %d), REST on %s", self._proc.pid, self.url)
        try:
            self._wait(lambda: self._get("/") is not None, self.start_timeout, "the REST API to answer")
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self) -> None:
        """SIGTERM to the worker's PID, SIGKILL after ``stop_timeout``; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            log.warning("Kafka Connect (PID %d) alive %.0fs after SIGTERM: SIGKILL", proc.pid, self.stop_timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _reap(proc.pid)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and _pid_alive(self._proc.pid)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "connect.log"

    # -- connectors ----------------------------------------------------------

    def add_connector(self, name: str, config: Mapping[str, str]) -> None:
        """Create (or reconfigure) connector ``name``: ``PUT /connectors/<name>/config``."""
        self._request("PUT", f"/connectors/{name}/config", dict(config))

    def delete_connector(self, name: str) -> None:
        self._request("DELETE", f"/connectors/{name}")

    def status(self, name: str) -> dict[str, Any] | None:
        """``GET /connectors/<name>/status``, None while the worker does not know it yet."""
        return self._get(f"/connectors/{name}/status")

    def wait_running(self, name: str, timeout: float = 120.0) -> None:
        """Wait until the connector and its task are RUNNING; a FAILED one raises with its trace's first lines."""

        def running() -> bool:
            status = self.status(name)
            if status is None:
                return False
            states = [status["connector"]["state"], *(t["state"] for t in status.get("tasks", []))]
            for part in [status["connector"], *status.get("tasks", [])]:
                if part["state"] == "FAILED":
                    trace = str(part.get("trace", "")).splitlines()
                    raise ConnectHarnessError(f"connector {name} failed: {' | '.join(trace[:3])}")
            return len(states) > 1 and all(s == "RUNNING" for s in states)

        self._wait(running, timeout, f"connector {name} to run")

    def wait_for_log(self, pattern: str, timeout: float = 120.0, *, after: int = 0) -> int:
        """Wait until ``connect.log`` (from byte ``after`` on) matches the regex ``pattern``; returns
        the offset after the match. Raises if the worker exits first."""
        regex = re.compile(pattern)
        found = 0

        def matched() -> bool:
            nonlocal found
            text = _read_from(self.log_path, after)
            m = regex.search(text)
            if m is not None:
                found = after + len(text[: m.end()].encode())
            return m is not None

        self._wait(matched, timeout, f"{pattern!r} in {self.log_path}")
        return found

    def cpu_seconds(self) -> float:
        """utime + stime of the worker's process tree so far (seconds); 0 when it is not running."""
        return process_tree_cpu_seconds(self._proc.pid) if self._proc is not None else 0.0

    # -- internals -----------------------------------------------------------

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if not self.running:
                raise ConnectHarnessError(f"Kafka Connect exited while waiting for {what}: {self._failure()}")
            if time.monotonic() >= deadline:
                raise ConnectHarnessError(f"waited {timeout:.0f}s for {what}: see {self.log_path}")
            time.sleep(POLL_SECONDS)

    def _failure(self) -> str:
        text = _read_from(self.log_path, 0)[-20_000:] + _read_from(self.directory / "stdout.log", 0)[-5_000:]
        lines = [ln.strip() for ln in text.splitlines() if "ERROR" in ln or "Exception" in ln]
        return " | ".join(lines[-3:]) or f"no error logged (see {self.directory})"

    def _get(self, path: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", path)
        except (ConnectHarnessError, OSError):
            return None

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            raise ConnectHarnessError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        parsed = json.loads(payload) if payload else {}
        return parsed if isinstance(parsed, dict) else {"value": parsed}


def _worker_settings(bootstrap: str, offsets: Path, port: int) -> dict[str, str]:
    """worker.properties: see the module docstring."""
    return {
        "bootstrap.servers": bootstrap,
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable": "false",
        "value.converter.schemas.enable": "false",
        "offset.storage.file.filename": str(offsets),
        "offset.flush.interval.ms": "1000",
        "listeners": f"http://127.0.0.1:{port}",
        "rest.advertised.host.name": "127.0.0.1",
        "topic.creation.enable": "true",
        "plugin.discovery": "only_scan",  # the connector is on the classpath; no plugin.path to scan
    }


def process_tree_cpu_seconds(pid: int) -> float:
    """utime + stime (seconds) of ``pid`` and every live descendant, plus what its waited-for
    children used (cutime + cstime), from ``/proc/<pid>/stat``; 0 for a process gone."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))  # fields[1] = ppid
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        if current not in stats:
            continue
        fields = stats[current]
        # after ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
        total += sum(int(x) for x in fields[11:15])
        todo += children.get(current, [])
    return total / ticks




def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
