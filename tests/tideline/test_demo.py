"""``tideline demo`` runs end to end on a real log, passes its checks, and leaves its data behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

from typer.testing import CliRunner

from tideline.cli import app
from tideline.demo import ORDERS_TOPIC, PROFILES_TOPIC
from tideline.demo_capture import TOPIC as CAPTURE_TOPIC


def test_demo_runs_and_passes_its_checks(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    runner = CliRunner()
    started = time.monotonic()
    result = runner.invoke(app, ["demo", "--records", "20000", "--partitions", "3", "--dir", str(target)])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert time.monotonic() - started < 60
    out = result.stdout
    assert "✗" not in out
    assert out.count("✓") >= 11
    assert "capture: latest value per key = SELECT * FROM shop.orders" in out
    assert "all checks passed" in out
    assert "21,000" in out  # 20,000 through the producer API + 1,000 through the CLI produce path
    assert str(target.resolve()) in out.replace("\n", "")

    # The data stays, and the log commands read it.
    data = ["--data-dir", str(target)]
    topics = json.loads(runner.invoke(app, [*data, "log", "topics", "--json"]).stdout)
    assert {ORDERS_TOPIC, PROFILES_TOPIC, CAPTURE_TOPIC} <= {t["topic"] for t in topics}
    info = json.loads(runner.invoke(app, [*data, "log", "describe", ORDERS_TOPIC, "--json"]).stdout)
    assert info["partitions"] == 3
    assert sum(p["log_end_offset"] for p in info["partition_info"]) == 21_000


def test_demo_default_directory_is_under_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "tideline-data"
    result = CliRunner().invoke(app, ["--data-dir", str(data_dir), "demo", "--records", "2000", "--capture-rows", "0"])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    (demo_dir,) = data_dir.glob("demo-*")
    assert (demo_dir / "tideline-log.json").exists()
    # The data dir itself stays a usable (empty) log, not a bare folder that `log create` would refuse.
    created = CliRunner().invoke(app, ["--data-dir", str(data_dir), "log", "create", "mine"])
    assert created.exit_code == 0, created.stderr


def test_demo_refuses_a_used_directory(tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "something").write_text("keep me")
    result = CliRunner().invoke(app, ["demo", "--dir", str(used)])
    assert result.exit_code != 0
    assert result.stderr.strip().splitlines() == [f"error: {used} is not empty: the demo needs a fresh directory"]
    assert (used / "something").read_text() == "keep me"
