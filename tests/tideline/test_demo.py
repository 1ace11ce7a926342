"""The reservations demo (``python -m examples.reservations.demo``, ``make demo``) runs end to end (Postgres,
capture, commands, Spark), passes its checks, and cleans up.

The demo runs as its own process (it starts and stops a SparkSession; the projection
tests share one in this process). Sizes are small to keep CI fast; ``make demo`` uses
the defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from tideline.cli import app

DEMO = [sys.executable, "-m", "examples.reservations.demo"]


def test_demo_runs_and_passes_its_checks(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    result = subprocess.run(
        [*DEMO, "--dir", str(target), "--orders", "500", "--transactions", "40", "--users", "30",
         "--reservations", "150", "--master", "local[2]"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, (out[-4000:], result.stderr[-4000:])
    assert "✗" not in out
    assert out.count("✓") >= 11
    for check in (
        "capture: latest value per key = SELECT * FROM shop.orders",
        "outbox: every stored event once in events.*",
        "view seats = reference fold of the log",
        "view show_occupancy = reference fold of the log",
        "view snapshots = reference fold of the log",
        "view seats = seat claims of the write model",
        "view orders (mirror) = SELECT * FROM shop.orders",
    ):
        assert f"✓ {check}" in out, check
    assert "stale version" in out and "seat taken" in out  # refused commands are part of the show
    assert "all checks passed" in out

    # Everything it started is stopped: Postgres (its pid file gone or the process dead) …
    harness = json.loads((target / "postgres" / "harness.json").read_text())
    assert not Path(f"/proc/{harness['pid']}").exists()
    # … and the log stays, readable by the CLI.
    topics = json.loads(CliRunner().invoke(app, ["--data-dir", str(target / "log"), "log", "topics", "--json"]).stdout)
    names = {t["topic"] for t in topics}
    assert {"demo.shop.orders", "events.user", "events.reservation"} <= names
    assert not any(n.startswith("demo.public.") for n in names)  # the read views are not captured back


def test_demo_refuses_a_used_directory(tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "something").write_text("keep me")
    result = subprocess.run([*DEMO, "--dir", str(used)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"error: {used} is not empty: the demo needs a fresh directory"]
    assert (used / "something").read_text() == "keep me"
