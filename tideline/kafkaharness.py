"""A private local Apache Kafka cluster (KRaft) for tests, the demo and ``tideline kafka``.

The cluster runs Apache Kafka's own broker from the jar cache (``make jars``:
``.cache/jars/kafka/``, or ``$TIDELINE_JAR_CACHE/kafka/``) with ``java -cp``; no
ZooKeeper, nothing downloaded at run time. Usage::

    with LocalKafka(Path("kafka"), brokers=3) as kafka:
        kafka.bootstrap_servers      # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        kafka.stop_node(2, kill=True)  # kill -9 one broker (failure tests)
        kafka.start_node(2)            # back, and registered again

Topology: every node is a *combined* KRaft node (``process.roles=broker,controller``),
node ids 1 … N, with a static controller quorum of all N nodes
(``controller.quorum.voters``). One JVM per node keeps a 3-broker cluster at three
processes (a separate controller would be a fourth); losing one node of three
leaves both a controller majority and two in-sync replicas. N is 1 or 3.

Settings (``_broker_settings``) are tuned for tests on a small machine: a 512 MiB
heap per JVM, two network and two I/O threads, 5 partitions for the internal
offsets and transaction topics, no initial rebalance delay, a 1 s cleaner backoff
and a 16 MiB compaction buffer, ``auto.create.topics.enable=false`` (Tideline
creates its topics with their configuration). With 3 nodes, topics default to
replication factor 3 and ``min.insync.replicas=2``, and so do the internal topics.
Like any Kafka, a broker does not fsync each write: durability comes from
``acks=all`` and the in-sync replicas.

Directory layout (the harness owns everything under ``D``)::

    D/
      harness.json          {"version": 1, "cluster_id", "brokers", "nodes": {"1":
                            {"broker_port", "controller_port", "pid"}, …}}: written
                            at format time and after every start/stop
      harness.lock          flock taken by start() and stop(), across processes
      node-N/
        server.properties   rewritten at every start of the node (edits are lost)
        log4j2.properties   the node's logging: INFO to server.log
        data/               log.dirs, formatted by kafka.tools.StorageTool
        server.log          broker log
        stdout.log          JVM stdout and stderr (crashes, GC errors)

Crash policy: a PID is node N's iff it is alive (not a zombie) and its command line
runs ``kafka.Kafka`` with ``D/node-N/server.properties``, so a recycled PID is never
signalled. ``harness.json`` is rewritten atomically (temp file + rename). A node
killed with ``kill -9`` is simply started again: Kafka recovers its log on start.
A formatted directory keeps its cluster id and node count: starting it with
another ``brokers`` is refused. Ports are chosen free on 127.0.0.1 at the first
start and kept; a node restarted alone must get its old ports back (the other
nodes know them), a whole cluster restarted picks new ones if the old are taken.

``stop()`` sends SIGTERM (controlled shutdown) to every node at once, then SIGKILL
to those still alive after ``stop_timeout``; it signals PIDs only, never names.

Thread safety: a ``LocalKafka`` holds no state but its configuration; start() and
stop() on one directory are serialized by ``harness.lock`` (an flock), even across
processes. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import base64
import contextlib
import enum
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from eventstore.errors import TidelineError

log = logging.getLogger(__name__)

JAR_CACHE_ENV = "TIDELINE_JAR_CACHE"
DEFAULT_JAR_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "jars"
KAFKA_JARS_SUBDIR = "kafka"
COMPLETE_MARKER = "COMPLETE"  # written by jvm/fetch-jars.sh last: its line is the Kafka version
STATE_FILE = "harness.json"
LOCK_FILE = "harness.lock"
STATE_VERSION = 1
MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL_CLASS = "kafka.tools.StorageTool"
SUPPORTED_BROKER_COUNTS = (1, 3)
DEFAULT_HEAP = "512m"
POLL_SECONDS = 0.1
KILL_GRACE_SECONDS = 10.0
JARS_HINT = "run `make jars` (Maven fetches Apache Kafka into the jar cache once)"


class KafkaHarnessError(TidelineError):
    """The local Kafka cluster cannot be set up, started or stopped; the message says why."""


class NodeShutdown(enum.Enum):
    """How a node's JVM ended."""

    NOT_RUNNING = "not running"
    CONTROLLED = "controlled"  # SIGTERM: controlled shutdown, leadership moved away first
    KILLED = "killed"  # SIGKILL: asked for (kill -9) or SIGTERM did not end it in time


@dataclass(frozen=True)
class NodeStop:
    """What stopping one node did."""

    node_id: int
    pid: int | None  # the JVM signalled, None if none was running
    shutdown: NodeShutdown


@dataclass(frozen=True)
class NodeStatus:
    """One node as ``status()`` saw it."""

    node_id: int
    running: bool
    pid: int | None
    broker_port: int
    controller_port: int

    @property
    def bootstrap_server(self) -> str:
        return f"127.0.0.1:{self.broker_port}"


@dataclass(frozen=True)
class KafkaClusterStatus:
    """A snapshot of the cluster directory."""

    directory: Path
    formatted: bool  # storage formatted (harness.json written)
    cluster_id: str | None
    nodes: tuple[NodeStatus, ...]

    @property
    def running(self) -> bool:
        return any(n.running for n in self.nodes)

    @property
    def bootstrap_servers(self) -> str | None:
        """The running nodes' broker listeners, comma-separated; None if none runs."""
        up = [n.bootstrap_server for n in self.nodes if n.running]
        return ",".join(up) if up else None

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "formatted": self.formatted,
            "cluster_id": self.cluster_id,
            "running": self.running,
            "bootstrap_servers": self.bootstrap_servers,
            "nodes": [
                {"node_id": n.node_id, "running": n.running, "pid": n.pid,
                 "broker_port": n.broker_port, "controller_port": n.controller_port}
                for n in self.nodes
            ],
        }  # fmt: skip


@dataclass(frozen=True)
class _Node:
    node_id: int
    broker_port: int
    controller_port: int


@dataclass(frozen=True)
class LocalKafka:
    """A private Kafka cluster of ``brokers`` KRaft nodes living in ``directory``.

    ``brokers`` (1 or 3) is fixed when the directory is first formatted; None takes
    the directory's count (so ``stop`` and ``status`` need not repeat it).

    ``overrides``: extra broker settings (``server.properties`` keys), applied last.
    ``jar_dir``: the Kafka jars (default: the jar cache, see the module docstring).
    """

    directory: Path
    brokers: int | None = None  # None: as formatted (1 for a new directory)
    heap: str = DEFAULT_HEAP
    overrides: Mapping[str, str] = field(default_factory=dict)
    jar_dir: Path | None = None
    start_timeout: float = 120.0  # seconds until every node is registered with the cluster
    stop_timeout: float = 30.0  # seconds of controlled shutdown before SIGKILL
    _root: Path = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.brokers is not None and self.brokers not in SUPPORTED_BROKER_COUNTS:
            raise KafkaHarnessError(f"brokers must be 1 or 3, got {self.brokers}")
        object.__setattr__(self, "_root", Path(os.path.abspath(self.directory)))

    # -- public API ----------------------------------------------------------

    def start(self) -> str:
        """Format (first time), start every node not running, wait until all are registered.

        Returns the bootstrap servers. Idempotent: running nodes are left alone.
        """
        jars = kafka_jar_dir(self.jar_dir)
        java = _java()
        self._root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            state = self._state() or self._format(java, jars)
            nodes = _nodes_of(state)
            pids = {n.node_id: self._pid_of(n.node_id) for n in nodes}
            if all(pid is None for pid in pids.values()):
                nodes = self._ports_for_full_start(nodes)
            log_offsets: dict[int, int] = {}
            for node in nodes:
                if pids[node.node_id] is None:
                    pids[node.node_id], log_offsets[node.node_id] = self._launch(java, jars, node, nodes)
            self._write_state(state, nodes, pids)
            self._wait_ready_or_stop(state, nodes, log_offsets, pids)
            return _bootstrap(nodes)

    def stop(self) -> list[NodeStop]:
        """Stop every node by PID (SIGTERM to all at once, SIGKILL after ``stop_timeout``); idempotent."""
        if not (self._root / STATE_FILE).exists():
            return []
        with self._locked():
            state = self._state()
            nodes = _nodes_of(state)
            pids = {n.node_id: self._pid_of(n.node_id) for n in nodes}
            results = self._terminate(pids, kill=False)
            self._write_state(state, nodes, {n.node_id: None for n in nodes})
            return results

    def stop_node(self, node_id: int, *, kill: bool = False) -> NodeStop:
        """Stop one node: SIGTERM (controlled shutdown), or SIGKILL at once when ``kill`` (kill -9)."""
        with self._locked():
            state = self._state()
            nodes = _nodes_of(state)
            self._node(nodes, node_id)
            pids = {n.node_id: self._pid_of(n.node_id) for n in nodes}
            (result,) = self._terminate({node_id: pids[node_id]}, kill=kill)
            pids[node_id] = None
            self._write_state(state, nodes, pids)
            return result

    def start_node(self, node_id: int) -> None:
        """Start one stopped node on its old ports and wait until it is registered again."""
        jars, java = kafka_jar_dir(self.jar_dir), _java()
        with self._locked():
            state = self._state()
            nodes = _nodes_of(state)
            node = self._node(nodes, node_id)
            pids = {n.node_id: self._pid_of(n.node_id) for n in nodes}
            if pids[node_id] is None:
                for port in (node.broker_port, node.controller_port):
                    if not _port_is_free(port):
                        raise KafkaHarnessError(
                            f"port {port} of Kafka node {node_id} is taken by another process: "
                            "the node cannot rejoin on other ports (restart the whole cluster)"
                        )
                pids[node_id], log_offset = self._launch(java, jars, node, nodes)
                self._write_state(state, nodes, pids)
                self._wait_ready_or_stop(state, nodes, {node_id: log_offset}, pids)

    def status(self) -> KafkaClusterStatus:
        state = self._state()
        nodes = _nodes_of(state) if state else []
        return KafkaClusterStatus(
            directory=self._root,
            formatted=bool(state),
            cluster_id=state.get("cluster_id") if state else None,
            nodes=tuple(
                NodeStatus(n.node_id, (pid := self._pid_of(n.node_id)) is not None, pid, n.broker_port,
                           n.controller_port)
                for n in nodes
            ),
        )  # fmt: skip

    @property
    def bootstrap_servers(self) -> str:
        """Broker listeners of the running nodes; raises if none runs."""
        servers = self.status().bootstrap_servers
        if servers is None:
            raise KafkaHarnessError(
                f"no Kafka running in {self._root}: start it (`tideline kafka start --dir {self._root}`)"
            )
        return servers

    def node_dir(self, node_id: int) -> Path:
        return self._root / f"node-{node_id}"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- format --------------------------------------------------------------

    def _format(self, java: str, jars: Path) -> dict[str, Any]:
        """Choose ports and a cluster id, format every node's storage, write harness.json."""
        count = self.brokers or 1
        ports = _free_ports(2 * count)
        nodes = [_Node(i + 1, ports[2 * i], ports[2 * i + 1]) for i in range(count)]
        # Kafka's own Uuid.randomUuid never starts an id with "-": the storage tool's argument parser would
        # read such an id as an option ("argument --cluster-id/-t: expected one argument"; seen 1 in ~64 starts)
        cluster_id = "-"
        while cluster_id.startswith("-"):
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        formats: dict[int, subprocess.Popen[str]] = {}
        for node in nodes:  # one JVM per node, all at once: each takes a second or two to start
            data = self.node_dir(node.node_id) / "data"
            if data.exists():  # a torn earlier format (harness.json is written last)
                shutil.rmtree(data)
            self._write_node_config(node, nodes)
            argv = [java, "-Xmx256m", "-XX:+UseSerialGC", "-cp", f"{jars}/*",
                    f"-Dlog4j2.configurationFile={self._log4j_path(node.node_id)}", STORAGE_TOOL_CLASS,
                    "format", "-t", cluster_id, "-c", str(self._config_path(node.node_id))]
            formats[node.node_id] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True)  # fmt: skip
        try:
            for node_id, proc in formats.items():
                output, _ = proc.communicate(timeout=120)
                if proc.returncode != 0:
                    raise KafkaHarnessError(
                        f"formatting Kafka node {node_id} in {self.node_dir(node_id) / 'data'} failed "
                        f"(exit {proc.returncode}): {_java_error(output)}"
                    )
        finally:
            for proc in formats.values():  # after a failure or timeout: leave no formatter running
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        state: dict[str, Any] = {"version": STATE_VERSION, "cluster_id": cluster_id, "brokers": count}
        self._write_state(state, nodes, {n.node_id: None for n in nodes})
        return state

    # -- launch and wait -----------------------------------------------------

    def _launch(self, java: str, jars: Path, node: _Node, nodes: list[_Node]) -> tuple[int, int]:
        """Start the node's JVM; return its PID and where its run begins in server.log."""
        self._write_node_config(node, nodes)
        ndir = self.node_dir(node.node_id)
        server_log = ndir / "server.log"
        log_offset = server_log.stat().st_size if server_log.exists() else 0
        argv = [
            java, f"-Xms{min(self.heap, '256m', key=_heap_bytes)}", f"-Xmx{self.heap}",
            "-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self._log4j_path(node.node_id)}",
            "-cp", f"{jars}/*", MAIN_CLASS, str(self._config_path(node.node_id)),
        ]  # fmt: skip
        with open(ndir / "stdout.log", "ab") as out:
            # A session of its own: the JVM outlives `tideline kafka start` and ignores its Ctrl-C.
            proc = subprocess.Popen(argv, cwd=ndir, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)  # fmt: skip
        log.info("started Kafka node %d (PID %d) on 127.0.0.1:%d", node.node_id, proc.pid, node.broker_port)
        return proc.pid, log_offset

    def _wait_ready_or_stop(
        self, state: dict[str, Any], nodes: list[_Node], log_offsets: Mapping[int, int], pids: dict[int, int | None]
    ) -> None:
        """``_wait_ready``; if that fails, stop the nodes this call launched (nothing is left behind)."""
        try:
            self._wait_ready(nodes, log_offsets, pids)
        except BaseException:
            self._terminate({node_id: pids[node_id] for node_id in log_offsets}, kill=False)
            self._write_state(state, nodes, {**pids, **{node_id: None for node_id in log_offsets}})
            raise

    def _wait_ready(self, nodes: list[_Node], log_offsets: Mapping[int, int], pids: Mapping[int, int | None]) -> None:
        """Wait until each launched node logged its start and every node is an unfenced broker.

        Both are needed: the cluster keeps listing a broker killed with SIGKILL until its
        session times out, and a node logs "started" before the controller unfences it.
        """
        deadline = time.monotonic() + self.start_timeout
        bootstrap = _bootstrap(nodes)
        wanted = set(log_offsets)
        started: set[int] = set()
        while True:
            for node_id in wanted:
                pid = pids[node_id]
                if pid is None or not _pid_alive(pid):
                    _reap(pid)
                    raise KafkaHarnessError(
                        f"Kafka node {node_id} exited while starting: "
                        f"{self._failure_summary(node_id, log_offsets.get(node_id, 0))} "
                        f"(full log: {self.node_dir(node_id) / 'server.log'})"
                    )
            started |= {i for i in wanted - started if _STARTED in _read_from(self._server_log(i), log_offsets[i])}
            if started == wanted and {n.node_id for n in nodes} <= _registered_brokers(bootstrap, nodes):
                return
            if time.monotonic() >= deadline:
                raise KafkaHarnessError(
                    f"Kafka nodes {sorted(wanted)} in {self._root} not registered after {self.start_timeout:.0f}s: "
                    f"see {self._root}/node-*/server.log, then start again or stop"
                )
            time.sleep(POLL_SECONDS)

    def _failure_summary(self, node_id: int, log_offset: int) -> str:
        """What this run of the node logged as its failure: the exceptions, without timestamps."""
        ndir = self.node_dir(node_id)
        text = _read_from(ndir / "server.log", log_offset) + "\n" + _read_from(ndir / "stdout.log", 0)[-20_000:]
        return _java_error(_LOG_PREFIX.sub("", text))

    # -- stop ----------------------------------------------------------------

    def _terminate(self, pids: Mapping[int, int | None], *, kill: bool) -> list[NodeStop]:
        live = {node_id: pid for node_id, pid in pids.items() if pid is not None}
        first = signal.SIGKILL if kill else signal.SIGTERM
        for pid in live.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, first)
        how = {node_id: NodeShutdown.KILLED if kill else NodeShutdown.CONTROLLED for node_id in live}
        if not kill and not _wait_until(lambda: not any(map(_pid_alive, live.values())), self.stop_timeout):
            for node_id, pid in live.items():
                if _pid_alive(pid):
                    log.warning("Kafka node %d (PID %d) alive %.0fs after SIGTERM: SIGKILL", node_id, pid,
                                self.stop_timeout)  # fmt: skip
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    how[node_id] = NodeShutdown.KILLED
        if not _wait_until(lambda: not any(map(_pid_alive, live.values())), KILL_GRACE_SECONDS):
            alive = [pid for pid in live.values() if _pid_alive(pid)]
            raise KafkaHarnessError(f"Kafka PIDs {alive} survived SIGKILL: check `ps -p {alive[0]}`")
        for pid in live.values():
            _reap(pid)
        return [NodeStop(node_id, pids[node_id], how.get(node_id, NodeShutdown.NOT_RUNNING)) for node_id in pids]

    # -- files ---------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _server_log(self, node_id: int) -> Path:
        return self.node_dir(node_id) / "server.log"

    def _config_path(self, node_id: int) -> Path:
        return self.node_dir(node_id) / "server.properties"

    def _log4j_path(self, node_id: int) -> Path:
        return self.node_dir(node_id) / "log4j2.properties"

    def _write_node_config(self, node: _Node, nodes: list[_Node]) -> None:
        ndir = self.node_dir(node.node_id)
        ndir.mkdir(parents=True, exist_ok=True)
        settings = {**_broker_settings(node, nodes, ndir / "data"), **self.overrides}
        text = "# Generated by tideline.kafkaharness at every start: edits are overwritten.\n"
        text += "".join(f"{key}={value}\n" for key, value in settings.items())
        _write_atomically(self._config_path(node.node_id), text)
        log4j = log4j2_properties("tideline.kafkaharness", ndir / "server.log", {"state.change.logger": "WARN"})
        _write_atomically(self._log4j_path(node.node_id), log4j)

    def node_pid(self, node_id: int) -> int | None:
        """The PID of node ``node_id``'s running JVM, or None (tests pause a broker with SIGSTOP)."""
        return self._pid_of(node_id)

    def _pid_of(self, node_id: int) -> int | None:
        """The live JVM of node ``node_id`` (from harness.json, checked against /proc), or None."""
        entry = self._state().get("nodes", {}).get(str(node_id), {})
        pid = entry.get("pid")
        if isinstance(pid, int) and _runs_config(pid, self._config_path(node_id)):
            return pid
        return None

    def _node(self, nodes: list[_Node], node_id: int) -> _Node:
        for node in nodes:
            if node.node_id == node_id:
                return node
        raise KafkaHarnessError(f"no Kafka node {node_id} in {self._root} (nodes: {[n.node_id for n in nodes]})")

    def _ports_for_full_start(self, nodes: list[_Node]) -> list[_Node]:
        ports = [p for n in nodes for p in (n.broker_port, n.controller_port)]
        if all(map(_port_is_free, ports)):
            return nodes
        log.info("ports of %s were taken while it was stopped: choosing new ones", self._root)
        fresh = _free_ports(len(ports))
        return [_Node(n.node_id, fresh[2 * i], fresh[2 * i + 1]) for i, n in enumerate(nodes)]

    def _state(self) -> dict[str, Any]:
        try:
            state = json.loads((self._root / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            return {}
        if self.brokers is not None and state.get("brokers") != self.brokers:
            raise KafkaHarnessError(
                f"the Kafka cluster in {self._root} was formatted with {state.get('brokers')} broker(s), "
                f"not {self.brokers}: use --brokers {state.get('brokers')} or another directory"
            )
        return state

    def _write_state(self, state: dict[str, Any], nodes: list[_Node], pids: Mapping[int, int | None]) -> None:
        state["nodes"] = {str(n.node_id): _node_json(n, pids.get(n.node_id)) for n in nodes}
        _write_atomically(self._root / STATE_FILE, json.dumps(state, indent=2) + "\n")


def _broker_settings(node: _Node, nodes: list[_Node], data_dir: Path) -> dict[str, str]:
    """server.properties of one combined node: see the module docstring for the choices."""
    n = len(nodes)
    replicas = str(min(n, 3))
    min_isr = str(min(n, 2))
    return {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": ",".join(f"{x.node_id}@127.0.0.1:{x.controller_port}" for x in nodes),
        "listeners": f"PLAINTEXT://127.0.0.1:{node.broker_port},CONTROLLER://127.0.0.1:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.broker_port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        "default.replication.factor": replicas,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": replicas,
        "offsets.topic.num.partitions": "5",
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": "5",
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": min_isr,
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "unclean.leader.election.enable": "false",
        "num.network.threads": "2",
        "num.io.threads": "2",
        "background.threads": "2",
        "num.replica.fetchers": "1",
        "num.recovery.threads.per.data.dir": "1",
        "log.cleaner.threads": "1",
        "log.cleaner.backoff.ms": "1000",
        "log.cleaner.dedupe.buffer.size": str(16 << 20),
    }


_STARTED = "Kafka Server started"  # logged by KafkaRaftServer once broker and controller run
_LOG_PREFIX = re.compile(r"^\[[^\]]*\] ", re.MULTILINE)  # log4j2.properties' "[%d] " before each line

def log4j2_properties(generator: str, log_file: Path, quieter: dict[str, str]) -> str:
    """A JVM's log4j2.properties: INFO to ``log_file`` as "[%d] level message (logger)", ``quieter``
    loggers (name → level) above that; ``generator`` names the module that writes it."""
    lines = [
        f"# Generated by {generator} at every start.",
        "status = warn",
        "appender.file.type = File",
        "appender.file.name = file",
        f"appender.file.fileName = {log_file}",
        "appender.file.layout.type = PatternLayout",
        "appender.file.layout.pattern = [%d] %p %m (%c)%n",
        "rootLogger.level = INFO",
        "rootLogger.appenderRef.file.ref = file",
    ]
    for i, (name, level) in enumerate(quieter.items()):
        lines += [f"logger.q{i}.name = {name}", f"logger.q{i}.level = {level}"]
    return "\n".join(lines) + "\n"


def cached_jar_dir(subdir: str, jar_dir: Path | None = None) -> tuple[Path, bool]:
    """``jar_dir``, else ``$TIDELINE_JAR_CACHE/<subdir>``, else the repo's cache; and whether it is
    complete (``jvm/fetch-jars.sh`` writes its COMPLETE marker last)."""
    if jar_dir is None:
        env = os.environ.get(JAR_CACHE_ENV)
        jar_dir = (Path(env) if env else DEFAULT_JAR_CACHE) / subdir
    return jar_dir, (jar_dir / COMPLETE_MARKER).is_file()


def kafka_jar_dir(jar_dir: Path | None = None) -> Path:
    """The directory of Kafka's jars: ``jar_dir``, else ``$TIDELINE_JAR_CACHE/kafka``, else the repo's cache."""
    jar_dir, complete = cached_jar_dir(KAFKA_JARS_SUBDIR, jar_dir)
    if not complete:
        raise KafkaHarnessError(f"Apache Kafka's jars not found in {jar_dir}: {JARS_HINT}")
    return jar_dir


def kafka_version(jar_dir: Path | None = None) -> str:
    """The Kafka version in the jar cache (the line ``jvm/fetch-jars.sh`` wrote)."""
    return (kafka_jar_dir(jar_dir) / COMPLETE_MARKER).read_text().strip()


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if java is None or not os.access(java, os.X_OK):
        raise KafkaHarnessError("no `java` found (Kafka needs Java 17): run `make system` or set JAVA_HOME")
    return java


def _registered_brokers(bootstrap: str, nodes: list[_Node]) -> set[int]:
    """Node ids of the brokers the cluster's metadata lists (unfenced); empty while none answers."""
    from confluent_kafka.admin import AdminClient

    from eventstore.kafka.config import LIBRDKAFKA_LOGGER

    if not any(not _port_is_free(n.broker_port) for n in nodes):
        return set()  # nothing listens yet: spare librdkafka's connection-refused noise
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": LIBRDKAFKA_LOGGER,  # librdkafka's log lines go to logging, not stderr
        "socket.connection.setup.timeout.ms": 2000,
    }
    admin = AdminClient(config)
    try:
        cluster = admin.describe_cluster(request_timeout=5).result()
    except Exception:  # not ready: the broker answers only once it has joined the quorum
        return set()
    return {node.id for node in cluster.nodes}


def _nodes_of(state: Mapping[str, Any]) -> list[_Node]:
    entries = state.get("nodes", {})
    return [
        _Node(int(node_id), int(entry["broker_port"]), int(entry["controller_port"]))
        for node_id, entry in sorted(entries.items(), key=lambda item: int(item[0]))
    ]


def _node_json(node: _Node, pid: int | None) -> dict[str, Any]:
    return {"broker_port": node.broker_port, "controller_port": node.controller_port, "pid": pid}


def _bootstrap(nodes: list[_Node]) -> str:
    return ",".join(f"127.0.0.1:{n.broker_port}" for n in nodes)


def _heap_bytes(size: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = size.strip().lower()
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


# -- processes (Linux /proc) -----------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (an unreaped dead process)."""
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return proc_stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _runs_config(pid: int, config: Path) -> bool:
    """True if ``pid`` is a live ``kafka.Kafka`` JVM started with ``config``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return MAIN_CLASS.encode() in argv and str(config).encode() in argv and _pid_alive(pid)


def _reap(pid: int | None) -> None:
    """Collect the exit status of a JVM we started, so that it does not linger as a zombie."""
    if pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _wait_until(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (all bound at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # Kafka binds with SO_REUSEADDR too
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _java_error(output: str) -> str:
    """The message of a JVM's failure on one line: exception lines, not the stack frames under them."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    messages = [line for line in lines if not line.startswith(("at ", "..."))
                and ("Exception" in line or "Error" in line or line.startswith("ERROR "))]  # fmt: skip
    return _one_line("\n".join(dict.fromkeys(messages)) if messages else output)


def _one_line(text: str, max_lines: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-max_lines:]) or "no output"
