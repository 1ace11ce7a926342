"""tideline.reliability: fault tests record result files; the renderer sums them into RELIABILITY.md.

A row comes only from a test that passed (the pytest plugin settles a test's pending rows by its outcome), and
the report is written only from a pytest session that passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tideline import reliability
from tideline.reliability import (
    PENDING_SUFFIX,
    RESULTS_ENV,
    SESSION_FILE,
    load_results,
    main,
    record_fault_result,
    render,
    settle_pending,
)

REPO = Path(__file__).resolve().parents[2]


def recorded(fault_class: str, fault: str, **counts: Any) -> Path:
    """``record_fault_result`` from this test (inside pytest: pending until the test's outcome is known), then
    settled as a passed test's, as the plugin does when the test has passed."""
    path = record_fault_result(fault_class, fault, **counts)
    assert path is not None and path.name.endswith(PENDING_SUFFIX), path
    (final,) = settle_pending([path], passed=True)
    return final


def passed_session(results: Path, exitstatus: int = 0) -> None:
    """The session status the plugin writes at the end of a pytest run."""
    (results / SESSION_FILE).write_text(json.dumps({"exitstatus": exitstatus}))


def test_nothing_is_recorded_without_the_results_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    assert record_fault_result("x", "y", injected=1, survived=1, records_lost=0, duplicates=0) is None


def test_a_row_recorded_in_a_test_waits_for_its_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    kept = record_fault_result("kept", "f", injected=2, survived=2, records_lost=0, duplicates=0)
    dropped = record_fault_result("dropped", "f", injected=1, survived=1, records_lost=0, duplicates=0)
    assert kept is not None and dropped is not None and kept.name.endswith(PENDING_SUFFIX)
    assert json.loads(kept.read_text())["test"] == os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    assert load_results(results) == ([], [])  # a pending row is no row
    assert settle_pending([dropped], passed=False) == [] and not dropped.exists()
    (final,) = settle_pending([kept], passed=True)
    assert not kept.exists() and [r.fault_class for r in load_results(results)[0]] == ["kept"]
    with pytest.raises(ValueError, match="not a pending result file"):
        settle_pending([final], passed=True)
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # outside pytest (a script): a row at once
    monkeypatch.setattr(reliability, "_current", None)  # (the plugin's record of this test, when it is loaded)
    assert (outside := record_fault_result("script", "f", injected=1, survived=1, records_lost=0, duplicates=0))
    assert outside.suffix == ".json" and json.loads(outside.read_text())["test"] is None


def test_results_are_summed_per_fault_class_and_rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    first = recorded(
        "log storage", "byte flips", injected=10, survived=10, records_lost=0, duplicates=0, recover_seconds=[0.1, 0.3]
    )
    recorded("log storage", "truncations", injected=5, survived=5, records_lost=0, duplicates=0, recover_seconds=[0.2])
    recorded("disk full", "ENOSPC", injected=3, survived=2, records_lost=1, duplicates=0, detail="one lost")
    assert json.loads(first.read_text())["fault_class"] == "log storage"
    (results / "broken-1-1.json").write_text("{not json")
    rows, unreadable = load_results(results)
    by_class = {r.fault_class: r for r in rows}
    storage, disk = by_class["log storage"], by_class["disk full"]
    assert (storage.injected, storage.survived, storage.runs, storage.passed) == (15, 15, 2, True)
    assert storage.faults == ["byte flips", "truncations"] and sorted(storage.recover_seconds) == [0.1, 0.2, 0.3]
    assert (disk.records_lost, disk.passed) == (1, False)
    assert len(unreadable) == 1 and unreadable[0].startswith("broken-1-1.json")

    text = render(rows, unreadable, machine="test machine", code="abc1234")
    table = [line for line in text.splitlines() if line.startswith("| log storage") or line.startswith("| disk full")]
    assert table == [  # by fault class name
        "| disk full | 3 | 2 | 1 | 0 | — | FAIL |",
        "| log storage | 15 | 15 | 0 | 0 | 200.0 ms / 300.0 ms | PASS |",
    ]
    assert "one lost" in text and "broken-1-1.json" in text and "test machine" in text and "Code: abc1234." in text
    noted = render(rows, unreadable, machine="test machine", note="Run while other jobs shared the CPUs.")
    assert noted.index("Machine: test machine.") < noted.index("Run while other jobs") < noted.index("| fault class")


def test_main_writes_the_report_and_fails_on_a_failed_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    recorded("commands", "restart", injected=2, survived=2, records_lost=0, duplicates=0)
    passed_session(results)
    out = tmp_path / "RELIABILITY.md"
    assert main(["--dir", str(results), "--out", str(out)]) == 0
    assert "| commands | 2 | 2 | 0 | 0 | — | PASS |" in out.read_text()
    recorded("commands", "restart", injected=1, survived=1, records_lost=0, duplicates=1)
    assert main(["--dir", str(results), "--out", str(out)]) == 1
    assert "| commands | 3 | 3 | 0 | 1 | — | FAIL |" in out.read_text()


@pytest.mark.parametrize(
    ("session", "problem"),
    [
        (None, "no finished pytest session"),
        (1, "failed (exit status 1)"),
        (0, "never settled"),  # a pending row left behind: a test whose outcome never came
    ],
)
def test_main_refuses_a_session_that_did_not_pass_and_keeps_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], session: int | None,
    problem: str,
) -> None:  # fmt: skip
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    recorded("commands", "restart", injected=2, survived=2, records_lost=0, duplicates=0)
    if session is not None:
        passed_session(results, session)
    if problem == "never settled":
        assert record_fault_result("kafka", "stop", injected=1, survived=1, records_lost=0, duplicates=0)
    out = tmp_path / "RELIABILITY.md"
    out.write_text("the previous report\n")
    assert main(["--dir", str(results), "--out", str(out)]) == 2
    assert out.read_text() == "the previous report\n"
    err = capsys.readouterr().err.strip()
    assert problem in err and "not rewritten" in err and len(err.splitlines()) == 1, err


PLUGIN_TESTS = """
    import pytest

    from tideline.reliability import record_fault_result


    def row(name):
        record_fault_result(name, "a fault", injected=1, survived=1, records_lost=0, duplicates=0)


    @pytest.fixture
    def teardown_fails():
        yield
        raise RuntimeError("teardown fails")


    def test_passes():
        row("passed")


    def test_fails_after_its_row():
        row("failed in call")
        assert False, "a check after the row"


    def test_fails_in_teardown(teardown_fails):
        row("failed in teardown")


    @pytest.fixture
    def setup_records_then_fails():
        row("failed in setup")
        raise RuntimeError("setup fails")


    def test_fails_in_setup(setup_records_then_fails):
        pass
"""


def run_pytest(tmp_path: Path, results: Path, *args: str) -> int:
    """A pytest run of PLUGIN_TESTS in its own process with the plugin, as `make reliability` runs the fault tests."""
    (tmp_path / "test_plugin_cases.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != RESULTS_ENV}
    env |= {RESULTS_ENV: str(results), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tideline.reliability", "-p", "no:cacheprovider",
            "-c", os.devnull, "--rootdir", str(tmp_path), *args]  # fmt: skip
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=300).returncode


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_the_plugin_keeps_only_the_rows_of_tests_that_passed(tmp_path: Path, workers: list[str]) -> None:
    results = tmp_path / "results"
    assert run_pytest(tmp_path, results, *workers, "test_plugin_cases.py") == 1
    assert sorted(p.suffix for p in results.iterdir()) == [".json", ".status"]  # nothing pending, nothing else
    rows, unreadable = load_results(results)
    assert [r.fault_class for r in rows] == ["passed"] and unreadable == []
    assert json.loads((results / SESSION_FILE).read_text())["exitstatus"] == 1
    out = tmp_path / "RELIABILITY.md"
    assert main(["--dir", str(results), "--out", str(out)]) == 2 and not out.exists()

    again = tmp_path / "again"
    assert run_pytest(tmp_path, again, *workers, "test_plugin_cases.py::test_passes") == 0
    assert main(["--dir", str(again), "--out", str(out)]) == 0
    assert "| passed | 1 | 1 | 0 | 0 | — | PASS |" in out.read_text()


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
