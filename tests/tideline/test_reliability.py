"""tideline.reliability: fault tests record result files; the renderer sums them into RELIABILITY.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tideline.reliability import RESULTS_ENV, load_results, main, record_fault_result, render


def test_nothing_is_recorded_without_the_results_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    assert record_fault_result("x", "y", injected=1, survived=1, records_lost=0, duplicates=0) is None


def test_results_are_summed_per_fault_class_and_rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    first = record_fault_result(
        "log storage", "byte flips", injected=10, survived=10, records_lost=0, duplicates=0, recover_seconds=[0.1, 0.3]
    )
    record_fault_result(
        "log storage", "truncations", injected=5, survived=5, records_lost=0, duplicates=0, recover_seconds=[0.2]
    )
    record_fault_result("disk full", "ENOSPC", injected=3, survived=2, records_lost=1, duplicates=0, detail="one lost")
    assert first is not None and json.loads(first.read_text())["fault_class"] == "log storage"
    (results / "broken-1-1.json").write_text("{not json")
    rows, unreadable = load_results(results)
    by_class = {r.fault_class: r for r in rows}
    storage, disk = by_class["log storage"], by_class["disk full"]
    assert (storage.injected, storage.survived, storage.runs, storage.passed) == (15, 15, 2, True)
    assert storage.faults == ["byte flips", "truncations"] and sorted(storage.recover_seconds) == [0.1, 0.2, 0.3]
    assert (disk.records_lost, disk.passed) == (1, False)
    assert len(unreadable) == 1 and unreadable[0].startswith("broken-1-1.json")

    text = render(rows, unreadable, machine="test machine")
    table = [line for line in text.splitlines() if line.startswith("| log storage") or line.startswith("| disk full")]
    assert table == [  # by fault class name
        "| disk full | 3 | 2 | 1 | 0 | — | FAIL |",
        "| log storage | 15 | 15 | 0 | 0 | 200.0 ms / 300.0 ms | PASS |",
    ]
    assert "one lost" in text and "broken-1-1.json" in text and "test machine" in text
    noted = render(rows, unreadable, machine="test machine", note="Run while other jobs shared the CPUs.")
    assert noted.index("Machine: test machine.") < noted.index("Run while other jobs") < noted.index("| fault class")


def test_main_writes_the_report_and_fails_on_a_failed_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    record_fault_result("commands", "restart", injected=2, survived=2, records_lost=0, duplicates=0)
    out = tmp_path / "RELIABILITY.md"
    assert main(["--dir", str(results), "--out", str(out)]) == 0
    assert "| commands | 2 | 2 | 0 | 0 | — | PASS |" in out.read_text()
    record_fault_result("commands", "restart", injected=1, survived=1, records_lost=0, duplicates=1)
    assert main(["--dir", str(results), "--out", str(out)]) == 1
    assert "| commands | 3 | 3 | 0 | 1 | — | FAIL |" in out.read_text()


def test_every_fault_test_file_is_in_the_reliability_target() -> None:
    """`make reliability` runs the files whose tests record results: a new fault class's file
    must be listed there (FAULT_TESTS), or RELIABILITY.md silently lacks its row."""
    repo = Path(__file__).resolve().parents[2]
    makefile = (repo / "Makefile").read_text()
    block = makefile.split("FAULT_TESTS :=", 1)[1].split("\nreliability:", 1)[0]
    listed = set(block.replace("\\", " ").split())
    recording = {
        str(path.relative_to(repo))
        for path in (repo / "tests").rglob("test_*.py")
        if "record_fault_result(" in path.read_text() and path.name != "test_reliability.py"
    }
    assert recording, "no fault test records results"
    assert recording <= listed, f"fault tests missing from the Makefile's FAULT_TESTS: {sorted(recording - listed)}"
    missing = [name for name in listed if not (repo / name).is_file()]
    assert not missing, f"FAULT_TESTS names files that do not exist: {missing}"
