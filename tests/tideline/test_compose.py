"""docker-compose.yml (and its Kafka override) hang together and run the commands the tests run (no Docker engine here).

Checked: the files parse; every service has an image or a build whose Dockerfile and
COPY sources exist; ``depends_on`` names services with a valid condition, and a
``service_healthy`` dependency has a health check; named volumes are declared; every
``tideline …`` and ``python -m examples.reservations …`` command line parses with this
code (run with ``--help`` appended: an unknown option or subcommand fails); Spark's
launcher is where the image says it is (the pyspark package's ``bin/spark-class``); the
Postgres image installs the same Debian wal2json package the tests use.

``docker-compose.kafka.yml`` is checked merged onto ``docker-compose.yml`` (as ``docker
compose -f … -f …`` merges: mappings key by key, ``command`` replaced): a KRaft Kafka of
the jar cache's version; capture, the registry and the follow jobs on ``--kafka
kafka:9092``, waiting for Kafka to be healthy; the ``mirror`` one-off on the log volume.
A command refused only because its piece of issue 15 has not landed yet ("does not
support Kafka yet") is skipped, naming it; any other failure (an unknown option) fails.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyspark
import pytest
import yaml
from typer.testing import CliRunner

from tideline.cli import app

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
KAFKA_OVERRIDE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.kafka.yml").read_text())
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
KAFKA_BOOTSTRAP = "kafka:9092"
PENDING = "does not support Kafka yet"  # tideline.cli's refusal of a command without Kafka support


def _merge(base: Any, override: Any) -> Any:
    """Compose's merge of two files, as far as these use it: mappings key by key, lists of
    volumes/ports joined, anything else (``command``, ``image``) replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base[key], value) if key in base and key != "command" else value
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return base + [item for item in override if item not in base]
    return override


ON_KAFKA: dict[str, Any] = _merge(COMPOSE, KAFKA_OVERRIDE)
COMPOSITIONS = {"embedded": COMPOSE, "kafka": ON_KAFKA}


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_services_and_dependencies(composition: str) -> None:
    compose = COMPOSITIONS[composition]
    services: dict[str, dict[str, Any]] = compose["services"]
    assert {"postgres", "capture", "app", "spark-master", "spark-worker"} <= set(services)
    assert any(name.startswith("follow") for name in services), "no projection follow job"
    declared_volumes = set(compose.get("volumes", {}))
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in CONDITIONS, (name, dep, spec)
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy: it has no healthcheck"
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source.startswith((".", "/")) or source in declared_volumes, f"{name}: undeclared volume {source}"
        check = service.get("healthcheck")
        if check is not None:
            assert check["test"][0] in ("CMD", "CMD-SHELL"), (name, check)


def test_the_log_volume_is_shared_by_writers_and_readers() -> None:
    for name in ("capture", "spark-worker", *[n for n in SERVICES if n.startswith("follow")]):
        mounts = [m.split(":") for m in SERVICES[name].get("volumes", [])]
        assert ["log", "/data"] in mounts, f"{name} does not mount the log volume"
        assert SERVICES[name]["environment"]["TIDELINE_DATA_DIR"] == "/data/log"


@pytest.mark.parametrize("dockerfile", sorted({s["build"]["dockerfile"] for s in SERVICES.values() if "build" in s}))
def test_dockerfiles_exist_and_copy_what_exists(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"{dockerfile}: COPY {source}: no such path"
    if "postgres" in dockerfile:
        assert "postgresql-15-wal2json" in text and "FROM postgres:15" in text


def _commands() -> list[tuple[str, list[str]]]:
    out = []
    for composition, compose in COMPOSITIONS.items():
        for name, service in compose["services"].items():
            command = service.get("command")
            if isinstance(command, list) and (composition == "embedded" or name in KAFKA_OVERRIDE["services"]):
                out.append((name if composition == "embedded" else f"{name}-on-kafka", [str(c) for c in command]))
    return out


def _kafka_version() -> str:
    found = re.search(r"<kafka.version>([^<]+)</kafka.version>", (ROOT / "jvm/kafka-server/pom.xml").read_text())
    assert found, "jvm/kafka-server/pom.xml names no kafka.version"
    return found[1]


def test_kafka_is_one_kraft_node_of_the_jar_caches_version() -> None:
    kafka = ON_KAFKA["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{_kafka_version()}"
    env = {key: str(value) for key, value in kafka["environment"].items()}
    assert not any("ZOOKEEPER" in key for key in env)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    cluster_id = env["CLUSTER_ID"]
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16 and not cluster_id.startswith("-")
    assert f"PLAINTEXT://{KAFKA_BOOTSTRAP}" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"  # Tideline creates topics with their settings
    for key in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"):  # fmt: skip
        assert env[key] == "1", f"{key}: one node can hold one replica"
    assert f"kafka-data:{env['KAFKA_LOG_DIRS']}" in kafka["volumes"]
    assert "kafka-data" in ON_KAFKA["volumes"]


def test_capture_registry_and_follow_jobs_use_kafka() -> None:
    services = ON_KAFKA["services"]
    on_kafka = ["capture", "registry", *[n for n in services if n.startswith("follow")]]
    assert set(on_kafka) <= set(KAFKA_OVERRIDE["services"]), "a service left on the embedded log"
    for name in on_kafka:
        command = services[name]["command"]
        assert command[:3] == ["tideline", "--kafka", KAFKA_BOOTSTRAP], name
        assert services[name]["depends_on"]["kafka"] == {"condition": "service_healthy"}, name
    assert services["capture"]["command"][3:] == SERVICES["capture"]["command"][1:]  # the same capture, on Kafka
    for name in on_kafka:
        if name.startswith("follow"):
            assert services[name]["command"][3:6] == SERVICES[name]["command"][1:4], name
    registry = services["registry"]
    assert registry["command"][3:7] == ["schemas", "serve", "--port", "8081"] and "8081:8081" in registry["ports"]
    mirror = services["mirror"]
    assert mirror["command"] == ["tideline", "log", "mirror", "--to-kafka", KAFKA_BOOTSTRAP]
    assert mirror["profiles"] == ["mirror"]  # a one-off (docker compose run), never started by `up`
    assert "log:/data" in mirror["volumes"] and mirror["environment"]["TIDELINE_DATA_DIR"] == "/data/log"


@pytest.mark.parametrize(("service", "command"), _commands(), ids=[c[0] for c in _commands()])
def test_command_parses(service: str, command: list[str]) -> None:
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "TIDELINE_DSN": "postgresql://x@127.0.0.1:1/x", "PATH": path}
    if command[0] == "tideline":  # in this process: the console script is tideline.cli:main over this app
        parsed = CliRunner().invoke(app, [*command[1:], "--help"], env={"TIDELINE_DSN": env["TIDELINE_DSN"]})
        if parsed.exit_code != 0 and PENDING in parsed.output:
            pytest.skip(f"{service} needs what issue 15 has not landed yet: {parsed.output.strip()}")
        assert parsed.exit_code == 0, f"{service}: {' '.join(command)}\n{parsed.output[-3000:]}"
    elif command[:3] == ["python", "-m", "examples.reservations"]:
        argv = [sys.executable, *command[1:], "--help"]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert result.returncode == 0, f"{service}: {' '.join(command)}\n{result.stdout[-1500:]}{result.stderr[-1500:]}"
    elif command[0].endswith("/pyspark/bin/spark-class"):
        assert (Path(pyspark.__file__).parent / "bin" / "spark-class").exists()
        assert command[1] in ("org.apache.spark.deploy.master.Master", "org.apache.spark.deploy.worker.Worker")
    elif command[0] == "postgres":
        settings = dict(c.split("=", 1) for c in command[1:] if c != "-c")
        assert settings["wal_level"] == "logical" and "wal2json" in settings["output_plugin_libraries"]
    else:
        raise AssertionError(f"{service}: a command the tests do not know: {command}")
