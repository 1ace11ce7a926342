"""``tideline console`` in a real browser: Debian's chromium (``make system``) driven by Playwright, against a
running ``capture run`` and ``project follow`` on the test's Postgres. The page shows the topic count and the
capture lag that ``log topics`` and ``capture status --json`` print, follows new changes as they arrive, and
the test keeps a screenshot (``<tmp_path>/console.png``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from console_util import ORDERS_TOPIC, PREFIX, TABLES, Watched, watched_database
from playwright.sync_api import Page, expect, sync_playwright
from typer.testing import CliRunner

from tideline.cli import app as cli_app
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
CHROMIUM = "/usr/bin/chromium"  # Debian's package (make system); Playwright's own browser builds are never fetched
MIRROR = f"mirror:{ORDERS_TOPIC}"
START_TIMEOUT_S = 120.0
PAGE_TIMEOUT_MS = 20_000


class Started:
    """A ``tideline`` process of this test, its stderr in a file; stopped by its PID (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, args: list[str], directory: Path) -> None:
        self.name = name
        self.stderr_path = directory / f"{name}.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen([TIDELINE, *args], stdout=subprocess.DEVNULL, stderr=stderr,
                                            env={**os.environ})  # fmt: skip

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first match of ``pattern`` in the process's stderr, waiting for it to appear."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(pattern, self.stderr_path.read_text(errors="replace"))
            if found:
                return found
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.process.returncode}: {self.stderr_text()}")
            time.sleep(0.1)
        raise AssertionError(f"{self.name} never printed {pattern!r}: {self.stderr_text()}")

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def watched(postgres: LocalPostgres) -> Iterator[Watched]:
    made = watched_database(postgres, orders=40)
    yield made
    made.drop_slot()


def cli_json(log_dir: Path, *args: str) -> Any:
    result = CliRunner().invoke(cli_app, ["--data-dir", str(log_dir), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def end_offset(log_dir: Path, topic: str) -> int:
    (partition,) = cli_json(log_dir, "log", "describe", topic)["partition_info"]
    return int(partition["log_end_offset"])


def applied(log_dir: Path, dsn: str, offset: int) -> bool:
    """The mirror view's checkpoint has passed ``offset`` and nothing readable waits (``project status``):
    the log's end offset of the orders topic holds still until the next change."""
    rows = cli_json(log_dir, "project", "status", "--dsn", dsn)
    return any(p["next_offset"] >= offset and p["lag"] == 0 for r in rows for p in r["partitions"])


def expect_value(page: Page, selector: str, value: object) -> None:
    expect(page.locator(selector)).to_have_attribute("data-value", str(value), timeout=PAGE_TIMEOUT_MS)


def expect_settled(page: Page, selector: str, read: Any, attempts: int = 5) -> Any:
    """The page's ``data-value`` at ``selector`` equals what ``read()`` returns, read again while the two
    disagree (the figure may move between the command's read and the page's next refresh)."""
    for attempt in range(attempts):
        value = read()
        try:
            expect(page.locator(selector)).to_have_attribute("data-value", str(value), timeout=5_000)
            return value
        except AssertionError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def test_the_page_shows_the_commands_figures_live(watched: Watched, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    names = ["--slot", watched.slot, "--topic-prefix", PREFIX, "--tables", ",".join(TABLES)]
    processes: list[Started] = []
    try:
        capture = Started("capture", ["--data-dir", str(log_dir), "capture", "run", "--dsn", watched.dsn, *names,
                                      "--metrics-port", "0"], tmp_path)  # fmt: skip
        processes.append(capture)
        metrics = capture.wait_for(r"capture: metrics on (http://\S+/metrics)").group(1)
        processes.append(Started("follow", ["--data-dir", str(log_dir), "project", "follow", MIRROR, "--dsn",
                                            watched.dsn, "--log-interval", "0"], tmp_path))  # fmt: skip
        console = Started("console", ["--data-dir", str(log_dir), "console", "--port", "0", "--dsn", watched.dsn,
                                      *names, "--interval", "0.5", "--capture-metrics", metrics], tmp_path)  # fmt: skip
        processes.append(console)
        url = console.wait_for(r"console listening=(http://\S+/)").group(1)
        capture.wait_for(r"capture: streaming slot")  # the snapshot is stored

        with sync_playwright() as playwright:
            # Chromium's sandbox cannot start as root (CI runs as root): --no-sandbox there, the sandbox elsewhere.
            browser = playwright.chromium.launch(executable_path=CHROMIUM, chromium_sandbox=os.geteuid() != 0)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url)
                topics = expect_settled(page, "#topic-count", lambda: len(cli_json(log_dir, "log", "topics")))
                assert topics >= 3  # orders, notes, capture's positions
                status_args = ("capture", "status", "--dsn", watched.dsn, *names)
                lag = expect_settled(page, "#capture-lag-bytes", lambda: cli_json(log_dir, *status_args)["lag_bytes"])
                assert lag >= 0
                expect(page.locator("#warnings li", has_text="table public.notes has no primary key")).to_be_visible()

                # New changes arrive: capture stores them, follow applies them, the page shows both.
                before = end_offset(log_dir, ORDERS_TOPIC)
                watched.insert_orders(1000, 25)
                deadline = time.monotonic() + START_TIMEOUT_S
                while not applied(log_dir, watched.dsn, before + 25):  # stored, committed and followed
                    assert time.monotonic() < deadline, capture.stderr_text()
                    time.sleep(0.1)
                after = end_offset(log_dir, ORDERS_TOPIC)
                assert after >= before + 25
                expect_value(page, f'tr[data-topic="{ORDERS_TOPIC}"] td.end', after)
                expect_value(page, f'tr[data-projection="{MIRROR}"] td.lag', 0)
                expect(page.locator(f'tr[data-projection="{MIRROR}"] td.health-ok')).to_have_text("ok")
                expect_settled(page, "#capture-lag-bytes", lambda: cli_json(log_dir, *status_args)["lag_bytes"])
                expect(page.locator("#chart-throughput polyline")).not_to_have_count(0)
                expect(page.locator("#chart-latency polyline")).not_to_have_count(0)
                expect(page.locator("#health-dot")).to_have_class("dot ok")
                shot = tmp_path / "console.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
            finally:
                browser.close()
    finally:
        for started in reversed(processes):
            started.stop()
