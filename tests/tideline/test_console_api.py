"""The console's JSON endpoints against a real capture into the embedded log (and into Kafka): each panel is
exactly what its command prints (``log describe``, ``capture status``, ``log groups``, ``project status``,
``schemas list``), warnings gather theirs, and the series are rates of what was appended."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from console_util import ORDERS_TOPIC, PREFIX, TABLES, Watched, watched_database
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from capture.sinks.kafka import KafkaLogSink
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from schemas.registry import SchemaRegistry
from tideline.cli import app as cli_app
from tideline.console.app import create_app
from tideline.console.panels import ConsoleSettings
from tideline.console.state import ConsoleState
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
MIRROR = f"mirror:{ORDERS_TOPIC}"
ORDER_ID = {"name": "id", "type": "int"}
ORDER_NOTE = {"name": "note", "type": ["null", "string"], "default": None}
ORDER_SCHEMA = {"type": "record", "name": "Order", "fields": [ORDER_ID]}
ORDER_SCHEMA_2 = {"type": "record", "name": "Order", "fields": [ORDER_ID, ORDER_NOTE]}


@dataclass
class Setup:
    watched: Watched
    log_dir: Path

    def settings(self, **kw: Any) -> ConsoleSettings:
        return ConsoleSettings(data_dir=self.log_dir, dsn=self.watched.dsn, slot=self.watched.slot,
                               topic_prefix=PREFIX, tables=TABLES, **kw)  # fmt: skip

    def cli(self, *args: str, kafka: str | None = None) -> Any:
        """``tideline --data-dir LOG [--kafka K] ARGS… --json`` in-process, parsed."""
        where = ["--data-dir", str(self.log_dir), *(["--kafka", kafka] if kafka else [])]
        result = CliRunner().invoke(cli_app, [*where, *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)


def follow_once(setup: Setup) -> None:
    """``project follow mirror:<orders topic> --once``: a projection with checkpoints (its own process:
    the command installs signal handlers)."""
    done = subprocess.run(
        [TIDELINE, "--data-dir", str(setup.log_dir), "project", "follow", MIRROR, "--dsn", setup.watched.dsn, "--once",
         "--log-interval", "0"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def setup(postgres: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A captured database, a projection followed once, a consumer group that read part of the orders,
    and two versions of a subject in the registry."""
    watched = watched_database(postgres)
    log_dir = tmp_path_factory.mktemp("console-api") / "log"
    with Log(log_dir) as log:
        watched.capture_once(log=log)
        with Consumer(log, group_id="billing", client_id="console-test", enable_auto_commit=False) as consumer:
            consumer.assign([TopicPartition(ORDERS_TOPIC, 0)])
            consumer.seek_to_beginning()
            consumer.commit({TopicPartition(ORDERS_TOPIC, 0): 20})
        registry = SchemaRegistry(LogSchemaStore(log))
        registry.register(f"{ORDERS_TOPIC}-value", ORDER_SCHEMA)
        registry.register(f"{ORDERS_TOPIC}-value", ORDER_SCHEMA_2)
    made = Setup(watched, log_dir)
    follow_once(made)
    try:
        yield made
    finally:
        watched.drop_slot()


def _api(state: ConsoleState, path: str) -> dict[str, Any]:
    response = TestClient(create_app(state)).get(path)
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, dict) and body.pop("refreshed_ms") > 0
    return body


def settled(page: Callable[[], Any], command: Callable[[], Any]) -> tuple[Any, Any]:
    """The page's figures and the command's, read until the command gives the same answer before and after
    the page's refresh (a checkpoint or autovacuum may move the server's WAL between two reads)."""
    for _ in range(5):
        before = command()
        shown = page()
        if command() == before:
            return shown, before
    raise AssertionError("the database never kept still for two reads")


def test_each_panel_is_what_its_command_prints(setup: Setup) -> None:
    state = ConsoleState(setup.settings())

    def refreshed(path: str) -> Callable[[], dict[str, Any]]:
        return lambda: (state.refresh(), _api(state, path))[1]

    topics, listed = settled(refreshed("/api/topics"), lambda: setup.cli("log", "topics"))
    assert topics["count"] == len(listed) and topics["count"] >= 4  # orders, notes, positions, offsets, schemas
    assert topics["topics"] == [setup.cli("log", "describe", t["topic"]) for t in listed]

    capture, status = settled(refreshed("/api/capture"), lambda: setup.cli(
        "capture", "status", *setup.watched.tideline_args()))  # fmt: skip
    assert capture == status and capture["lag_bytes"] >= 0 and capture["slot"]["slot"] == setup.watched.slot
    assert capture["keyless_tables"] == ["public.notes"]

    groups, described = settled(refreshed("/api/groups"), lambda: setup.cli("log", "groups"))
    assert groups == {"groups": described}
    (billing,) = [g for g in described if g["group"] == "billing"]
    assert billing["partitions"][0]["committed_offset"] == 20 and billing["partitions"][0]["lag"] > 0

    projections, project = settled(refreshed("/api/projections"), lambda: setup.cli(
        "project", "status", "--dsn", setup.watched.dsn))  # fmt: skip
    assert projections == {"projections": project}
    assert [p["projection"] for p in project] == [MIRROR] and project[0]["lag"] is not None

    schemas = _api(state, "/api/schemas")
    assert schemas == {"subjects": setup.cli("schemas", "list")}
    assert schemas["subjects"][0]["versions"] == [1, 2]

    config = _api_plain(state, "/api/config")
    assert config["backend"] == "embedded" and config["slot"] == setup.watched.slot
    missing = TestClient(create_app(state)).get("/api/nope")
    assert missing.status_code == 404 and "no panel 'nope'" in missing.json()["detail"]
    page = TestClient(create_app(state)).get("/")
    assert page.status_code == 200 and 'id="topic-count"' in page.text
    assert TestClient(create_app(state)).get("/static/console.js").status_code == 200


def _api_plain(state: ConsoleState, path: str) -> dict[str, Any]:
    response = TestClient(create_app(state)).get(path)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_warnings_name_keyless_tables_retained_wal_and_stalled_views(setup: Setup) -> None:
    setup.watched.insert_orders(1000, 30)
    with Log(setup.log_dir) as log:
        setup.watched.capture_once(log=log)  # the projection now lags, and nobody follows it
    state = ConsoleState(setup.settings(retained_wal_warn_bytes=0, stall_after_s=0))
    state.refresh()
    messages = [w["message"] for w in _api(state, "/api/warnings")["warnings"]]
    assert any(m.startswith("table public.notes has no primary key") for m in messages), messages
    assert any(m.startswith(f"slot {setup.watched.slot} retains ") and "(threshold 0)" in m for m in messages)
    (row,) = setup.cli("project", "status", "--dsn", setup.watched.dsn, "--stall-after", "0")
    assert row["stalled"] and row["lag"] >= 30  # the orders, and the transaction's commit marker
    assert any(m.startswith(f"projection {MIRROR} is stalled: lag {row['lag']}") for m in messages), messages
    status = setup.cli("capture", "status", *setup.watched.tideline_args(), "--retained-wal-warn", "0")
    # the same warnings; the WAL a slot retains grows between the two reads (other databases of the cluster write)
    def retained(ms: list[str]) -> list[str]:
        return [re.sub(r" retains \d+ bytes ", " retains N bytes ", m) for m in ms]

    assert retained([m for m in messages if not m.startswith("projection")]) == retained(status["warnings"])
    follow_once(setup)  # caught up again: no longer stalled
    state.refresh()
    assert not any("stalled" in w["message"] for w in _api(state, "/api/warnings")["warnings"])


def test_series_are_rates_of_what_was_appended_and_missing_parts_are_said(setup: Setup) -> None:
    state = ConsoleState(ConsoleSettings(data_dir=setup.log_dir, topic_prefix=PREFIX))  # no database given
    state.refresh()
    setup.watched.insert_orders(2000, 40)
    with Log(setup.log_dir) as log:
        setup.watched.capture_once(log=log)
    state.refresh()
    series = _api(state, "/api/series")
    assert series["throughput_source"] == f"records appended to {PREFIX}.* topics"
    assert series["latency_source"] is None
    first, second = series["points"]
    assert first["events_per_s"] is None and second["events_per_s"] > 0
    assert first["latency_ms"] is None and second["capture_lag_bytes"] is None
    capture = _api(state, "/api/capture")
    assert capture == {"error": "no database: give --dsn or set TIDELINE_DSN", "unavailable": True}
    assert _api(state, "/api/warnings")["warnings"] == []  # a panel with nothing to watch is not a warning

    broken = ConsoleState(ConsoleSettings(data_dir=setup.log_dir / "nowhere", topic_prefix=PREFIX,
                                          capture_metrics="http://127.0.0.1:1/metrics"))  # fmt: skip
    broken.refresh()
    assert "nowhere" in _api(broken, "/api/topics")["error"]
    panels = {w["panel"]: w["message"] for w in _api(broken, "/api/warnings")["warnings"]}
    assert "nowhere" in panels["topics"] and panels["series"].startswith("capture metrics: ")
    assert _api(broken, "/api/series")["points"][0]["events_per_s"] is None


def test_console_command_refuses_what_it_cannot_watch(setup: Setup, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli_app, ["--data-dir", str(tmp_path / "none"), "console", "--port", "0"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: no log at {tmp_path / 'none'}: give --data-dir (or TIDELINE_DATA_DIR) of an existing log, or --kafka"
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = CliRunner().invoke(cli_app, ["--data-dir", str(setup.log_dir), "console", "--port", str(port)])
    assert busy.exit_code == 1
    assert busy.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_panels_on_kafka_are_what_the_commands_print(postgres: LocalPostgres, kafka: LocalKafka,
                                                     tmp_path: Path) -> None:  # fmt: skip
    watched = watched_database(postgres, orders=30)
    bootstrap = kafka.bootstrap_servers
    assert bootstrap is not None
    sink = KafkaLogSink(bootstrap, state_dir=tmp_path / "_capture")
    try:
        watched.capture_once(sink=sink)
    finally:
        sink.close()
    setup = Setup(watched, tmp_path)
    state = ConsoleState(setup.settings(kafka=bootstrap))

    def refreshed(path: str) -> Callable[[], dict[str, Any]]:
        return lambda: (state.refresh(), _api(state, path))[1]

    try:
        topics, listed = settled(refreshed("/api/topics"), lambda: setup.cli("log", "topics", kafka=bootstrap))
        assert topics["count"] == len(listed) and ORDERS_TOPIC in {t["topic"] for t in listed}
        assert topics["topics"] == [setup.cli("log", "describe", t["topic"], kafka=bootstrap) for t in listed]
        capture, status = settled(refreshed("/api/capture"), lambda: setup.cli(
            "capture", "status", *watched.tideline_args(), kafka=bootstrap))  # fmt: skip
        assert capture == status and capture["stored_position"] is not None and "lag_bytes" in capture
        groups, described = settled(refreshed("/api/groups"), lambda: setup.cli("log", "groups", kafka=bootstrap))
        assert groups == {"groups": described}
        assert _api(state, "/api/schemas") == {"subjects": setup.cli("schemas", "list", kafka=bootstrap)}
        assert _api(state, "/api/projections") == {"projections": setup.cli(
            "project", "status", "--dsn", watched.dsn, kafka=bootstrap)}  # fmt: skip
        assert _api_plain(state, "/api/config")["backend"] == "kafka"
    finally:
        watched.drop_slot()
