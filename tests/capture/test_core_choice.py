"""The per-change core is never chosen silently: which one runs, per table, and why a table takes the Python path,
in the start log lines, ``capture run --json``, ``capture status --json``, the metrics and the console.

Without the extension: ``tideline`` runs in a process whose ``import tideline_native`` fails as it does where the
extension was never built (a meta-path finder raising the same ``ModuleNotFoundError``), so the real fallback of
capture.native.core runs — ``auto`` captures on the Python path and says so once, ``native`` refuses in one line.
With the extension: a table with columns the core does not convert (an array, an enum, an interval) is
reported per table, with the columns, at start and when a table appears later.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from capture_util import drop_slots, fresh_database, sql
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from capture.config import CaptureConfig, CoreChoice, SnapshotMode
from capture.connector import Connector
from capture.metrics import CaptureCollector
from capture.native import extension
from capture.report import capture_status
from capture.tables import TableFilter
from eventstore.log import Log
from tideline.cli import app as cli_app
from tideline.console.app import create_app
from tideline.console.panels import ConsoleSettings
from tideline.console.state import ConsoleState
from tideline.pgharness import LocalPostgres

PREFIX = "cdc"
NOT_BUILT = "the extension tideline_native is not built (No module named 'tideline_native')"
TAGGED_REASON = (
    "column tags: text[] not covered by the native core; column mood: mood not covered by the native core; "
    "column span: interval not covered by the native core"
)
# `tideline` in a process where the extension cannot be imported, exactly as where it was never built.
WITHOUT_NATIVE = """
import sys

class NotBuilt:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tideline_native":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotBuilt())
sys.argv[0] = "tideline"
from tideline.cli import main
main()
"""


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    """``plain`` (every column converted natively) and ``tagged`` (an array, an enum and an interval)."""
    dsn = fresh_database(postgres, "core")
    sql(dsn, "CREATE TYPE mood AS ENUM ('calm', 'busy')",
        "CREATE TABLE plain (id int PRIMARY KEY, name text, amount numeric(12,2))",
        "CREATE TABLE tagged (id int PRIMARY KEY, tags text[], mood mood, span interval, note text)",
        "INSERT INTO plain VALUES (1, 'one', 1.5)",
        "INSERT INTO tagged VALUES (1, ARRAY['a'], 'calm', '1 day', 'n')")  # fmt: skip
    yield dsn
    drop_slots(dsn)


def insert_rows(dsn: str, first: int, n: int) -> None:
    sql(dsn, f"INSERT INTO plain SELECT g, 'p' || g, g / 4.0 FROM generate_series({first}, {first + n - 1}) g",
        f"INSERT INTO tagged SELECT g, ARRAY['t', g::text], 'busy', g * interval '1 hour', 'n' "
        f"FROM generate_series({first}, {first + n - 1}) g")  # fmt: skip


def without_native(*args: str) -> list[str]:
    return [sys.executable, "-c", WITHOUT_NATIVE, *args]


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def metric_samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Exposition text → sample name → the label sets of its samples (the core's info samples are all 1)."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append({**sample.labels, "value": str(sample.value)})
    return out


def status_json(log_dir: Path, dsn: str, slot: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli_app, ["--data-dir", str(log_dir), "capture", "status", "--dsn", dsn, "--slot",
                                          slot, "--topic-prefix", PREFIX, "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def core_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "core" in line and " capture status " not in line]


def test_without_the_extension_auto_captures_on_the_python_core_and_says_so(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    stderr_path = tmp_path / "capture.stderr"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            without_native("--data-dir", str(log_dir), "capture", "run", "--dsn", db, "--slot", "nonative",
                           "--topic-prefix", PREFIX, "--core", "auto", "--metrics-port", "0", "--json"),
            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ},
        )  # fmt: skip
    try:
        found: list[re.Match[str]] = []

        def started() -> bool:
            assert proc.poll() is None, stderr_path.read_text()
            text = stderr_path.read_text()
            match = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", text)
            if match and "capture: streaming slot" in text:
                found.append(match)
                return True
            return False

        wait_for("the connector to stream", started)
        url = f"http://127.0.0.1:{found[0].group(1)}/metrics"
        insert_rows(db, 10, 50)

        def scraped() -> dict[str, list[dict[str, str]]]:
            with urllib.request.urlopen(url, timeout=5) as response:
                return metric_samples(response.read().decode())

        wait_for("the rows", lambda: float(scraped()["tideline_capture_events_total"][0]["value"]) >= 100)
        samples = scraped()
        (info,) = samples["tideline_capture_core_info"]
        assert (info["core"], info["requested"], info["reason"]) == ("python", "auto", NOT_BUILT)
        per_table = {s["table"]: (s["core"], s["reason"]) for s in samples["tideline_capture_table_core_info"]}
        assert per_table == {"public.plain": ("python", NOT_BUILT), "public.tagged": ("python", NOT_BUILT)}
        assert samples["tideline_capture_python_core_tables"][0]["value"] == "2.0"

        status = status_json(log_dir, db, "nonative")  # this process has the extension: it reads the report
        assert (status["core"], status["core_reason"], status["core_requested"]) == ("python", NOT_BUILT, "auto")
        assert status["core_tables"] == {"public.plain": {"core": "python", "reason": NOT_BUILT},
                                         "public.tagged": {"core": "python", "reason": NOT_BUILT}}  # fmt: skip
        core_warnings = [w for w in status["warnings"] if "core" in w]
        assert core_warnings == [f"capture runs the Python core for every table: {NOT_BUILT}"]

        state = ConsoleState(ConsoleSettings(data_dir=log_dir, dsn=db, slot="nonative", topic_prefix=PREFIX))
        state.refresh()
        api = TestClient(create_app(state))
        panel = api.get("/api/capture").json()
        assert {k: panel[k] for k in ("core", "core_reason", "core_tables")} == {
            k: status[k] for k in ("core", "core_reason", "core_tables")
        }
        assert {"panel": "capture", "message": core_warnings[0]} in api.get("/api/warnings").json()["warnings"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    text = stderr_path.read_text()
    assert proc.returncode == 0, text
    summary = json.loads(out)
    assert summary["core"] == "python" and summary["core_reason"] == NOT_BUILT
    assert summary["core_tables"]["public.tagged"] == {"core": "python", "reason": NOT_BUILT}
    warnings = [line for line in core_lines(text) if " WARNING " in line]
    assert len(warnings) == 1, text
    assert f"capture: core python for every table: {NOT_BUILT}; every change takes the Python path" in warnings[0]
    (streaming,) = [line for line in text.splitlines() if "capture: streaming slot" in line]
    assert streaming.endswith(f", core python ({NOT_BUILT})")


@pytest.mark.parametrize("how", ["--core", "env"])
def test_core_native_without_the_extension_refuses_in_one_line(db: str, tmp_path: Path, how: str) -> None:
    log_dir = tmp_path / "log"
    args = ["--data-dir", str(log_dir), "capture", "run", "--dsn", db, "--slot", "refused", "--topic-prefix", PREFIX]
    env = {**os.environ}
    if how == "env":
        env["TIDELINE_CAPTURE_CORE"] = "native"
    else:
        args += ["--core", "native"]
    done = subprocess.run(without_native(*args), capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --core native: the extension tideline_native is not built; run `make native`")
    assert line.endswith(f"[{NOT_BUILT}]")
    assert not log_dir.exists(), "nothing is made before the refusal"


def test_tables_the_native_core_does_not_cover_are_reported_per_table(
    db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not extension.available():
        pytest.skip("tideline_native is not built (make native)")
    caplog.set_level(logging.INFO, logger="capture.connector")
    log_dir = tmp_path / "log"
    config = CaptureConfig(dsn=db, slot="pertable", topic_prefix=PREFIX, core=CoreChoice.AUTO,
                           table_filter=TableFilter(include=["public.*"]), status_interval_s=0.1)  # fmt: skip
    with Log(log_dir) as log:
        connector = Connector(config, log)
        runner = threading.Thread(target=connector.run)
        runner.start()
        try:
            wait_for("streaming", lambda: "capture: streaming slot" in caplog.text)
            lines = [r.getMessage() for r in caplog.records if "core" in r.getMessage()]
            assert "capture: core native for 1 of 2 tables; python for public.tagged" in lines
            assert f"capture: table public.tagged takes the Python core: {TAGGED_REASON}" in lines
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "core" in
                      r.getMessage()]  # fmt: skip
            assert warned == [f"capture: table public.tagged takes the Python core: {TAGGED_REASON}"]
            assert any(line.endswith(", core native (python for public.tagged)") for line in lines)

            stats = connector.stats.to_json()
            assert (stats["core"], stats["core_reason"], stats["core_requested"]) == ("native", None, "auto")
            assert stats["core_tables"] == {"public.plain": {"core": "native", "reason": None},
                                            "public.tagged": {"core": "python", "reason": TAGGED_REASON}}  # fmt: skip

            registry = CollectorRegistry()
            registry.register(CaptureCollector(connector))
            samples = metric_samples(generate_latest(registry).decode())
            (info,) = samples["tideline_capture_core_info"]
            assert (info["core"], info["reason"], info["slot"]) == ("native", "", "pertable")
            per_table = {s["table"]: (s["core"], s["reason"]) for s in samples["tideline_capture_table_core_info"]}
            assert per_table == {"public.plain": ("native", ""), "public.tagged": ("python", TAGGED_REASON)}
            assert samples["tideline_capture_python_core_tables"][0]["value"] == "1.0"

            # a table that appears while streaming: reported when its first change registers it with the core
            sql(db, "CREATE TABLE late (id int PRIMARY KEY, nums int[])", "INSERT INTO late VALUES (1, '{1}')",
                "INSERT INTO late VALUES (2, '{2}')")  # fmt: skip
            late = "column nums: integer[] not covered by the native core"
            wait_for("the late table's report", lambda: "public.late" in connector.stats.to_json()["core_tables"])
            assert connector.stats.to_json()["core_tables"]["public.late"] == {"core": "python", "reason": late}
            assert f"capture: table public.late takes the Python core: {late}" in caplog.text

            def reported() -> dict[str, Any]:
                return capture_status(db, slot="pertable", topic_prefix=PREFIX, log=log, sink=None)

            wait_for("the report file", lambda: "public.late" in reported()["core_tables"])  # the status tick writes
            status = reported()
            assert status["core"] == "native" and status["core_reason"] is None
            assert status["core_tables"]["public.tagged"] == {"core": "python", "reason": TAGGED_REASON}
            assert status["core_tables"]["public.plain"] == {"core": "native", "reason": None}
            assert [w for w in status["warnings"] if "core" in w] == [
                f"table public.late takes the Python core: {late}",
                f"table public.tagged takes the Python core: {TAGGED_REASON}",
            ]
            assert status["core_reported_ms"] > 0
        finally:
            connector.stop()
            runner.join(timeout=60)
        assert not runner.is_alive()


def test_core_native_warns_per_table_and_core_python_is_said_once(
    db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not extension.available():
        pytest.skip("tideline_native is not built (make native)")
    caplog.set_level(logging.INFO, logger="capture.connector")
    with Log(tmp_path / "log") as log:
        strict = CaptureConfig(dsn=db, slot="strict", topic_prefix=PREFIX, core=CoreChoice.NATIVE,
                               snapshot=SnapshotMode.INITIAL, exit_when_caught_up=True)  # fmt: skip
        stats = Connector(strict, log).run()
        assert stats.to_json()["core_tables"]["public.tagged"] == {"core": "python", "reason": TAGGED_REASON}
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == [f"capture: table public.tagged takes the Python core: {TAGGED_REASON}"]
        caplog.clear()
        stats = Connector(CaptureConfig(dsn=db, slot="chosen", topic_prefix=PREFIX, core=CoreChoice.PYTHON,
                                        exit_when_caught_up=True), log).run()  # fmt: skip
        chosen = "--core python (or TIDELINE_CAPTURE_CORE=python) asks for the Python path"
        assert (stats.to_json()["core"], stats.to_json()["core_reason"]) == ("python", chosen)
        said = [m for m in core_lines("\n".join(r.getMessage() for r in caplog.records)) if "streaming slot" not in m]
        assert said == [f"capture: core python for every table: {chosen}"]
        assert not [r for r in caplog.records if r.levelno == logging.WARNING], "what --core asked for is no warning"
        status = capture_status(db, slot="chosen", topic_prefix=PREFIX, log=log, sink=None)
        assert status["core"] == "python" and status["core_chosen"] is True
        assert not [w for w in status["warnings"] if "core" in w]
        never = capture_status(db, slot="never_ran", topic_prefix=PREFIX, log=log, sink=None)
        assert never["core"] is None and never["core_reason"].startswith("not reported: no connector")
