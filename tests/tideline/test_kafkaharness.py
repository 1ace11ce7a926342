"""The local Kafka harness against real Apache Kafka brokers (KRaft, from the jar cache; no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from readiness import patience
from typer.testing import CliRunner

from tideline.kafka_cli import app
from tideline.kafkaharness import JAR_CACHE_ENV, KafkaHarnessError, LocalKafka, NodeShutdown

TIMEOUT = 60.0


def _alive(pid: int) -> bool:
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return proc_stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_for(what: str, done: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def _create_topic(bootstrap: str, name: str, partitions: int = 1, **config: str) -> None:
    admin = _admin(bootstrap)  # referenced until the future is done: a collected client cancels it
    futures = admin.create_topics([NewTopic(name, partitions, config=config)], request_timeout=30)
    futures[name].result(timeout=TIMEOUT)


def _broker_config(bootstrap: str, node_id: int) -> dict[str, str | None]:
    admin = _admin(bootstrap)
    resource = ConfigResource(ConfigResource.Type.BROKER, str(node_id))
    (future,) = admin.describe_configs([resource], request_timeout=30).values()
    return {name: entry.value for name, entry in future.result(timeout=TIMEOUT).items()}


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> list[int]:
    """Produce with acks=all; return each record's offset (raises on a delivery error)."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    offsets: list[int] = []
    errors: list[KafkaError] = []

    def delivered(err: KafkaError | None, msg: object) -> None:
        if err is not None:
            errors.append(err)
        else:
            offsets.append(msg.offset())  # type: ignore[attr-defined]

    for value in values:
        producer.produce(topic, value, on_delivery=delivered)
    assert producer.flush(TIMEOUT) == 0, "records still queued after the timeout"
    assert not errors, errors
    return offsets


def _read_all(bootstrap: str, topic: str) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "harness-test", "enable.auto.commit": False,
                         "isolation.level": "read_committed"})  # fmt: skip
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=TIMEOUT)
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[bytes] = []
        deadline = time.monotonic() + TIMEOUT
        while len(values) < high and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                values.append(msg.value() or b"")
        return values
    finally:
        consumer.close()


def test_single_node_cluster_serves_and_refuses_auto_created_topics(kafka: LocalKafka) -> None:
    bootstrap = kafka.bootstrap_servers
    admin = _admin(bootstrap)
    cluster = admin.describe_cluster(request_timeout=30).result(timeout=TIMEOUT)
    assert [node.id for node in cluster.nodes] == [1]
    assert _broker_config(bootstrap, 1)["auto.create.topics.enable"] == "false"
    _create_topic(bootstrap, "harness-one")
    assert _produce(bootstrap, "harness-one", [b"a", b"b"]) == [0, 1]
    assert _read_all(bootstrap, "harness-one") == [b"a", b"b"]


def test_three_nodes_replicate_three_ways_with_two_in_sync(kafka3: LocalKafka) -> None:
    bootstrap = kafka3.bootstrap_servers
    assert len(bootstrap.split(",")) == 3
    _create_topic(bootstrap, "harness-rf3", partitions=2)
    metadata = _admin(bootstrap).list_topics("harness-rf3", timeout=TIMEOUT)
    for partition in metadata.topics["harness-rf3"].partitions.values():
        assert sorted(partition.replicas) == [1, 2, 3]
    config = _broker_config(bootstrap, 2)
    assert (config["default.replication.factor"], config["min.insync.replicas"]) == ("3", "2")


def test_one_of_three_nodes_killed_and_restarted_loses_nothing(kafka3: LocalKafka) -> None:
    bootstrap = kafka3.bootstrap_servers
    _create_topic(bootstrap, "harness-failover")
    _produce(bootstrap, "harness-failover", [b"before"])
    stopped = kafka3.stop_node(3, kill=True)
    try:
        assert stopped.shutdown is NodeShutdown.KILLED and stopped.pid is not None
        assert not _alive(stopped.pid)
        assert [n.running for n in kafka3.status().nodes] == [True, True, False]
        survivors = ",".join(s for s in bootstrap.split(",") if s != kafka3.status().nodes[2].bootstrap_server)
        _produce(survivors, "harness-failover", [b"while-down"])  # acks=all: two in-sync replicas suffice
    finally:
        kafka3.start_node(3)
    assert kafka3.status().bootstrap_servers == bootstrap  # same ports: the other nodes know them

    def back_in_sync() -> bool:
        topic = _admin(bootstrap).list_topics("harness-failover", timeout=TIMEOUT).topics["harness-failover"]
        return sorted(topic.partitions[0].isrs) == [1, 2, 3]

    _wait_for("node 3 back in the in-sync replicas", back_in_sync)
    assert _read_all(bootstrap, "harness-failover") == [b"before", b"while-down"]


@pytest.fixture
def own_dir(tmp_path: Path) -> Iterator[Path]:
    """A cluster directory of the test's own, whatever ran in it stopped afterwards."""
    directory = tmp_path / "kafka"
    try:
        yield directory
    finally:
        LocalKafka(directory).stop()


def test_cli_start_is_idempotent_recovers_a_killed_node_and_stop_ends_every_process(own_dir: Path) -> None:
    runner = CliRunner()
    started = runner.invoke(app, ["start", "--dir", str(own_dir)])
    assert started.exit_code == 0, started.output
    bootstrap = started.output.strip()
    assert bootstrap.startswith("127.0.0.1:") and "," not in bootstrap
    again = runner.invoke(app, ["start", "--dir", str(own_dir)])
    assert (again.exit_code, again.output.strip()) == (0, bootstrap)

    info = json.loads(runner.invoke(app, ["status", "--dir", str(own_dir), "--json"]).output)
    (node,) = info["nodes"]
    assert info["running"] and info["bootstrap_servers"] == bootstrap and node["running"]
    _create_topic(bootstrap, "survives-kill")
    _produce(bootstrap, "survives-kill", [b"kept"])

    os.kill(node["pid"], signal.SIGKILL)  # kill -9 from outside the harness
    _wait_for("the killed JVM to exit", lambda: not _alive(node["pid"]) or _reap(node["pid"]))
    restarted = runner.invoke(app, ["start", "--dir", str(own_dir)])
    assert restarted.exit_code == 0, restarted.output
    assert _read_all(restarted.output.strip(), "survives-kill") == [b"kept"]

    pid = LocalKafka(own_dir).status().nodes[0].pid
    assert pid is not None
    stopped = runner.invoke(app, ["stop", "--dir", str(own_dir)])
    assert stopped.exit_code == 0 and f"PID {pid}" in stopped.output, stopped.output
    assert not _alive(pid)
    assert "no Kafka running" in runner.invoke(app, ["stop", "--dir", str(own_dir)]).output
    wrong = runner.invoke(app, ["start", "--dir", str(own_dir), "--brokers", "3"])
    assert wrong.exit_code == 1 and "formatted with 1 broker(s), not 3" in wrong.output


def _reap(pid: int) -> bool:
    """The test process started the JVM (through the CLI runner): collect its exit status."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def test_a_recycled_pid_in_the_state_file_is_never_signalled(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        directory = tmp_path / "kafka"
        directory.mkdir()
        state = {"version": 1, "cluster_id": "x", "brokers": 1,
                 "nodes": {"1": {"broker_port": 1, "controller_port": 2, "pid": stranger.pid}}}  # fmt: skip
        (directory / "harness.json").write_text(json.dumps(state))
        kafka = LocalKafka(directory)
        assert not kafka.status().running
        (result,) = kafka.stop()
        assert result.shutdown is NodeShutdown.NOT_RUNNING
        assert stranger.poll() is None, "the harness signalled a process that is not its broker"
    finally:
        stranger.kill()
        stranger.wait()


def test_missing_jar_cache_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JAR_CACHE_ENV, str(tmp_path / "no-jars"))
    with pytest.raises(KafkaHarnessError, match="run `make jars`"):
        LocalKafka(tmp_path / "kafka").start()
    result = CliRunner().invoke(app, ["start", "--dir", str(tmp_path / "kafka")])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("error: Apache Kafka's jars not found")


def _processes_under(directory: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(directory).encode() in (entry / "cmdline").read_bytes() and _alive(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize(
    ("setting", "value", "reason"),
    [
        ("log.retention.hours", "not-a-number", "log.retention.hours"),  # refused when formatting
        ("authorizer.class.name", "no.such.Authorizer", "ClassNotFoundException: no.such.Authorizer"),  # at start
    ],
)
def test_a_node_that_cannot_start_is_a_one_line_error_and_leaves_nothing_running(
    tmp_path: Path, setting: str, value: str, reason: str
) -> None:
    kafka = LocalKafka(tmp_path / "kafka", overrides={setting: value})
    with pytest.raises(KafkaHarnessError) as failure:
        kafka.start()
    message = str(failure.value)
    assert "\n" not in message, message
    assert "Kafka node 1" in message and reason in message, message
    assert _processes_under(tmp_path) == []
    assert not kafka.status().running
