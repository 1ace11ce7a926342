"""The console's page shows capture's core (Debian's chromium driven by Playwright, as test_console_browser):
for a connector that ran without the extension (``import tideline_native`` failing as where it was never built),
``python`` and why; for one with it, ``native`` and each table on the Python path with its columns."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from console_util import PREFIX, Watched, watched_database
from playwright.sync_api import expect, sync_playwright

from capture.native import extension
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")
CHROMIUM = "/usr/bin/chromium"  # Debian's package (make system); Playwright's own browser builds are never fetched
PAGE_TIMEOUT_MS = 20_000
NOT_BUILT = "the extension tideline_native is not built (No module named 'tideline_native')"
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

pytestmark = pytest.mark.skipif(not extension.available(), reason="tideline_native is not built (make native)")


@pytest.fixture
def watched(postgres: LocalPostgres) -> Iterator[Watched]:
    made = watched_database(postgres, orders=5)
    with psycopg.connect(made.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE tagged (id int PRIMARY KEY, tags text[])")
        c.execute("INSERT INTO tagged VALUES (1, ARRAY['a'])")
    yield made
    with psycopg.connect(made.dsn, autocommit=True) as c:
        c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = "
                  "current_database()")  # fmt: skip


def capture_once(log_dir: Path, dsn: str, slot: str, *, native: bool) -> None:
    command = [TIDELINE] if native else [sys.executable, "-c", WITHOUT_NATIVE]
    args = ["--data-dir", str(log_dir), "capture", "run", "--dsn", dsn, "--slot", slot, "--topic-prefix", PREFIX,
            "--tables", "public.orders,public.tagged", "--exit-when-caught-up"]  # fmt: skip
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]


class Console:
    """``tideline console`` of one slot, its stderr in a file; stopped by its PID."""

    def __init__(self, log_dir: Path, dsn: str, slot: str, directory: Path) -> None:
        self.stderr_path = directory / f"console-{slot}.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                [TIDELINE, "--data-dir", str(log_dir), "console", "--port", "0", "--dsn", dsn, "--slot", slot,
                 "--topic-prefix", PREFIX, "--interval", "0.5"], stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip

    def url(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"console listening=(http://\S+/)", self.stderr_path.read_text(errors="replace"))
            if found:
                return found.group(1)
            assert self.process.poll() is None, self.stderr_path.read_text()
            time.sleep(0.1)
        raise AssertionError(f"the console never listened: {self.stderr_path.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def test_the_page_shows_the_core_and_why_python(watched: Watched, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    capture_once(log_dir, watched.dsn, "nonative", native=False)
    capture_once(log_dir, watched.dsn, "withnative", native=True)
    consoles = [Console(log_dir, watched.dsn, slot, tmp_path) for slot in ("nonative", "withnative")]
    try:
        without, with_native = (c.url() for c in consoles)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, chromium_sandbox=os.geteuid() != 0)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(without)
                core = page.locator("#capture-core")
                expect(core).to_have_attribute("data-value", "python", timeout=PAGE_TIMEOUT_MS)
                expect(core).to_have_text(f"python (--core auto): {NOT_BUILT}")
                expect(page.locator("#warnings li", has_text="capture runs the Python core for every table")
                       ).to_have_count(1)  # fmt: skip

                page.goto(with_native)
                expect(page.locator("#capture-core")).to_have_attribute("data-value", "native", timeout=PAGE_TIMEOUT_MS)
                tagged = page.locator('#capture-details dd[data-table="public.tagged"]')
                expect(tagged).to_have_text("python: column tags: text[] not covered by the native core")
                expect(page.locator("#capture-details dd[data-table]")).to_have_count(1)  # orders: native
                expect(page.locator("#warnings li", has_text="table public.tagged takes the Python core")
                       ).to_have_count(1)  # fmt: skip
                page.screenshot(path=str(tmp_path / "console-core.png"), full_page=True)
            finally:
                browser.close()
    finally:
        for console in consoles:
            console.stop()
