"""docker-compose.yml hangs together and runs the commands the tests run (no Docker engine here).

Checked: the file parses; every service has an image or a build whose Dockerfile and
COPY sources exist; ``depends_on`` names services with a valid condition, and a
``service_healthy`` dependency has a health check; named volumes are declared; every
``tideline …`` and ``python -m examples.reservations …`` command line parses with this
code (run with ``--help`` appended: an unknown option or subcommand fails); Spark's
launcher is where the image says it is (the pyspark package's ``bin/spark-class``); the
Postgres image installs the same Debian wal2json package the tests use.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyspark
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def test_services_and_dependencies() -> None:
    assert {"postgres", "capture", "app", "spark-master", "spark-worker"} <= set(SERVICES)
    assert any(name.startswith("follow") for name in SERVICES), "no projection follow job"
    declared_volumes = set(COMPOSE.get("volumes", {}))
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, name
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            assert spec["condition"] in CONDITIONS, (name, dep, spec)
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy: it has no healthcheck"
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
    for name, service in SERVICES.items():
        command = service.get("command")
        if isinstance(command, list):
            out.append((name, [str(c) for c in command]))
    return out


@pytest.mark.parametrize(("service", "command"), _commands(), ids=[c[0] for c in _commands()])
def test_command_parses(service: str, command: list[str]) -> None:
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "TIDELINE_DSN": "postgresql://x@127.0.0.1:1/x", "PATH": path}
    if command[0] == "tideline" or command[:3] == ["python", "-m", "examples.reservations"]:
        argv = [str(BIN / "tideline"), *command[1:]] if command[0] == "tideline" else [sys.executable, *command[1:]]
        result = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert result.returncode == 0, f"{service}: {' '.join(command)}\n{result.stdout[-1500:]}{result.stderr[-1500:]}"
    elif command[0].endswith("/pyspark/bin/spark-class"):
        assert (Path(pyspark.__file__).parent / "bin" / "spark-class").exists()
        assert command[1] in ("org.apache.spark.deploy.master.Master", "org.apache.spark.deploy.worker.Worker")
    elif command[0] == "postgres":
        settings = dict(c.split("=", 1) for c in command[1:] if c != "-c")
        assert settings["wal_level"] == "logical" and "wal2json" in settings["output_plugin_libraries"]
    else:
        raise AssertionError(f"{service}: a command the tests do not know: {command}")
