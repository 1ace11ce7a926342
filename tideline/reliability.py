"""Fault-injection results and the RELIABILITY.md report (``python -m tideline.reliability``).

Every fault test (log storage, disk full, the log cleaner soak, commands under a
Postgres restart, and whatever fault classes are added later: capture, Postgres, Kafka,
Spark) calls :func:`record_fault_result` once per run with what it injected and what it
found, after its last check. When ``TIDELINE_RELIABILITY_DIR`` is set (``make soak`` and
``make reliability`` set it), each call writes one JSON file there; otherwise nothing is
written (a plain ``make test`` leaves no files).

**A row comes only from a test that passed.** Inside pytest a call writes its file as
*pending* (``….json.pending``, naming the test); this module is also a pytest plugin
(``pytest -p tideline.reliability``, as both make targets run it) that, when the test's
reports are in, renames the pending files of a test whose call passed and whose setup
and teardown did not fail to ``….json``, and deletes those of any other test. Without the
plugin nothing is ever promoted (a safe default: no row rather than a row of a failed
test). At the end of the session the plugin writes ``pytest-session.status`` (the exit
status); :func:`main` refuses to write the report unless that file says every test
passed (exit status 0), so a failed run leaves the previous RELIABILITY.md as it was.
Outside pytest (a script) a call writes ``….json`` at once.

Result file: ``<dir>/<fault class, [A-Za-z0-9_-]>-<pid>-<counter>.json``, UTF-8 JSON::

    {"format_version": 1,
     "fault_class": "log storage",        # the row of the report
     "fault": "byte flips, truncations…",  # what was injected, one line
     "injected": 1000, "survived": 1000,   # faults injected; runs that met every check
     "records_lost": 0, "duplicates": 0,   # acknowledged records missing / read twice (must be 0)
     "recover_seconds": [0.01, …],         # time to recover per fault, where it means something
     "detail": "…", "recorded_ms": 1700000000000, "soak": true,
     "test": "tests/…::test_x"}            # the pytest node id, null outside pytest

Written to a ``.tmp`` name and renamed, so a crashed test never leaves half a file; a
file that does not parse is reported in RELIABILITY.md as unreadable, not skipped.

Rendering (:func:`render`): one table row per fault class (rows of the same class are
summed), with the recovery-time median and maximum, and PASS when every fault was
survived and nothing was lost or duplicated. ``python -m tideline.reliability`` rewrites
``RELIABILITY.md`` at the repository root (or ``--out``) from ``--dir``.

To add a fault class: call :func:`record_fault_result` at the end of its test with a new
``fault_class`` name, and list the test file in the Makefile's ``FAULT_TESTS``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

RESULTS_ENV = "TIDELINE_RELIABILITY_DIR"
FORMAT_VERSION = 1
REPO = Path(__file__).resolve().parent.parent
RELIABILITY_MD = REPO / "RELIABILITY.md"
PENDING_SUFFIX = ".pending"
SESSION_FILE = "pytest-session.status"  # written by the plugin at the end of a session: {"exitstatus": 0, …}
_counter = itertools.count()


class ReliabilityReportError(Exception):
    """The report cannot be written from these results (the message says why, in one line)."""


@dataclass
class _TestInProgress:
    """The plugin's view of the test being run in this process."""

    nodeid: str
    call_passed: bool = False
    failed: bool = False
    pending: list[Path] = field(default_factory=list)


_current: _TestInProgress | None = None  # set by the plugin's hooks; None outside a test (or without the plugin)


def _pytest_test() -> str | None:
    """The pytest node id of the running test, or None outside pytest."""
    if _current is not None:
        return _current.nodeid
    running = os.environ.get("PYTEST_CURRENT_TEST")  # "tests/x.py::test_y (call)" while pytest runs a test
    return running.rsplit(" ", 1)[0] if running else None


def results_dir() -> Path | None:
    """Where results go, or None when they are not being collected."""
    value = os.environ.get(RESULTS_ENV)
    return Path(value) if value else None


def record_fault_result(
    fault_class: str,
    fault: str,
    *,
    injected: int,
    survived: int,
    records_lost: int,
    duplicates: int,
    recover_seconds: list[float] | None = None,
    detail: str = "",
) -> Path | None:
    """Record one fault test's outcome (see the module docstring); returns the file or None."""
    directory = results_dir()
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    body = {
        "format_version": FORMAT_VERSION,
        "fault_class": fault_class,
        "fault": fault,
        "injected": injected,
        "survived": survived,
        "records_lost": records_lost,
        "duplicates": duplicates,
        "recover_seconds": [round(s, 6) for s in (recover_seconds or [])],
        "detail": detail,
        "recorded_ms": int(dt.datetime.now(dt.UTC).timestamp() * 1000),
        "soak": os.environ.get("TIDELINE_SOAK") == "1",
        "test": _pytest_test(),
    }
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", fault_class).strip("_") or "fault"
    path = directory / f"{slug}-{os.getpid()}-{next(_counter)}.json"
    if body["test"] is not None:  # inside pytest: a row only once the test has passed (the module docstring)
        path = path.with_name(path.name + PENDING_SUFFIX)
        if _current is not None:
            _current.pending.append(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def settle_pending(paths: list[Path], *, passed: bool) -> list[Path]:
    """The pending result files of one test, once its outcome is known: renamed to ``….json`` if it
    passed, deleted if not; returns the result files made."""
    made: list[Path] = []
    for path in paths:
        if not path.name.endswith(PENDING_SUFFIX):
            raise ValueError(f"{path} is not a pending result file")
        if passed:
            final = path.with_name(path.name.removesuffix(PENDING_SUFFIX))
            try:
                os.replace(path, final)
            except FileNotFoundError:  # settled already (a test of this module settles its own)
                continue
            made.append(final)
        else:
            path.unlink(missing_ok=True)
    return made


# ---------------------------------------------------------------------------- the pytest plugin
# ``pytest -p tideline.reliability``: plain hook functions (pytest finds them by name), so this module does
# not import pytest at run time. Under pytest-xdist the hooks run in each worker for its own tests (where
# the pending files were written); the controller sees the same reports again with nothing pending.


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    global _current
    _current = _TestInProgress(nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _current is None or report.nodeid != _current.nodeid:
        return
    if report.failed:
        _current.failed = True
    elif report.when == "call" and report.passed:
        _current.call_passed = True


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    global _current
    test, _current = _current, None
    if test is not None and test.nodeid == nodeid:
        settle_pending(test.pending, passed=test.call_passed and not test.failed)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    directory = results_dir()
    if directory is None or hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes it
        return
    directory.mkdir(parents=True, exist_ok=True)
    body = {"exitstatus": int(exitstatus), "finished_ms": int(dt.datetime.now(dt.UTC).timestamp() * 1000),
            "args": [str(a) for a in session.config.args]}  # fmt: skip
    tmp = directory / (SESSION_FILE + ".tmp")
    tmp.write_text(json.dumps(body) + "\n")
    os.replace(tmp, directory / SESSION_FILE)


def session_status(directory: Path) -> dict[str, object]:
    """The finished pytest session's status in ``directory``; raises ReliabilityReportError when there is none
    or it did not pass (the report is made only from a run in which every test passed)."""
    path = directory / SESSION_FILE
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReliabilityReportError(
            f"no finished pytest session in {directory} ({SESSION_FILE} missing: run pytest with "
            "-p tideline.reliability, as make soak and make reliability do)"
        ) from None
    except (OSError, ValueError) as e:
        raise ReliabilityReportError(f"{path} cannot be read: {e}") from e
    if not isinstance(status, dict) or status.get("exitstatus") != 0:
        code = status.get("exitstatus") if isinstance(status, dict) else status
        raise ReliabilityReportError(f"the pytest session that wrote {directory} failed (exit status {code})")
    return status


@dataclass
class FaultRow:
    """The summed results of one fault class."""

    fault_class: str
    faults: list[str] = field(default_factory=list)
    injected: int = 0
    survived: int = 0
    records_lost: int = 0
    duplicates: int = 0
    recover_seconds: list[float] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    runs: int = 0

    @property
    def passed(self) -> bool:
        return self.survived == self.injected and self.records_lost == 0 and self.duplicates == 0


def load_results(directory: Path) -> tuple[list[FaultRow], list[str]]:
    """Fault rows by class (sorted by name) and the names of unreadable files."""
    rows: dict[str, FaultRow] = {}
    unreadable: list[str] = []
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    loaded = []
    for path in files:
        try:
            body = json.loads(path.read_text())
            if body.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format_version {body.get('format_version')}")
            loaded.append(body)
        except (ValueError, OSError) as e:
            unreadable.append(f"{path.name}: {e}")
    for body in sorted(loaded, key=lambda b: b["recorded_ms"]):
        row = rows.setdefault(body["fault_class"], FaultRow(body["fault_class"]))
        if body["fault"] not in row.faults:
            row.faults.append(body["fault"])
        row.injected += int(body["injected"])
        row.survived += int(body["survived"])
        row.records_lost += int(body["records_lost"])
        row.duplicates += int(body["duplicates"])
        row.recover_seconds.extend(float(s) for s in body["recover_seconds"])
        if body["detail"]:
            row.details.append(body["detail"])
        row.runs += 1
    return sorted(rows.values(), key=lambda r: r.fault_class), unreadable


def _seconds(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values) * 1e3:,.1f} ms / {max(values) * 1e3:,.1f} ms"


def render(rows: list[FaultRow], unreadable: list[str], *, machine: str, note: str = "", code: str = "") -> str:
    """The RELIABILITY.md text; ``note`` (optional) follows the machine line (how the run was made); ``code``:
    the commit the tests ran at."""
    lines = [
        "# Tideline reliability",
        "",
        "Written by `make soak` or `make reliability` (`python -m tideline.reliability` over the result files",
        f"the fault tests write to `${RESULTS_ENV}`); do not edit by hand. Each row sums every run of one fault",
        "class:",
        "faults injected, faults survived (every check of the test held), acknowledged records lost and",
        "records delivered twice (both must be 0), and the time to recover (median / max) where the test",
        "measures one. A row comes only from a test that passed, and the report is written only after a pytest",
        "run in which every test passed (a failed run leaves the previous report).",
        "",
        f"Machine: {machine}.",
        "",
        *([f"Code: {code}.", ""] if code else []),
        *([note, ""] if note else []),
        "| fault class | faults injected | survived | records lost | duplicates "
        "| time to recover (median / max) | met |",
        "|---|--:|--:|--:|--:|--:|:-:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.fault_class} | {r.injected:,} | {r.survived:,} | {r.records_lost:,} | {r.duplicates:,} "
            f"| {_seconds(r.recover_seconds)} | {'PASS' if r.passed else 'FAIL'} |"
        )
    if not rows:
        lines.append("| (no results recorded) | | | | | | |")
    lines += ["", "What each class injected:", ""]
    for r in rows:
        lines.append(f"- **{r.fault_class}** ({r.runs} run{'s' if r.runs != 1 else ''}): {'; '.join(r.faults)}.")
        lines.extend(f"  - {d}" for d in r.details)
    if unreadable:
        lines += ["", "Unreadable result files:", ""]
        lines.extend(f"- {u}" for u in unreadable)
    return "\n".join(lines) + "\n"


def machine_summary() -> str:
    cpus = os.cpu_count() or 0
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{cpus} CPUs, Linux {platform.release()}, Python {platform.python_version()}, {when}"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def code_version() -> str:
    """The commit the tests ran at (``git rev-parse --short HEAD``), ``+ uncommitted changes`` when tracked
    Python files differ from it."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "*.py")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tideline.reliability", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=results_dir(), help=f"result files (default: ${RESULTS_ENV})")
    parser.add_argument("--out", type=Path, default=RELIABILITY_MD, help="report to write (default: %(default)s)")
    parser.add_argument("--note", default="", help="a paragraph after the machine line: how this run was made")
    args = parser.parse_args(argv)
    if args.dir is None:
        parser.error(f"no result directory: pass --dir or set {RESULTS_ENV}")
    try:
        session_status(args.dir)
        pending = sorted(p.name for p in args.dir.glob(f"*{PENDING_SUFFIX}"))
        if pending:
            raise ReliabilityReportError(
                f"{len(pending)} result(s) of tests whose outcome was never settled in {args.dir} "
                f"({', '.join(pending[:3])}{', …' if len(pending) > 3 else ''})"
            )
    except ReliabilityReportError as e:
        print(f"error: {e}: {args.out} not rewritten (the previous report stands)", file=sys.stderr)
        return 2
    rows, unreadable = load_results(args.dir)
    args.out.write_text(render(rows, unreadable, machine=machine_summary(), note=args.note, code=code_version()))
    failed = [r.fault_class for r in rows if not r.passed]
    print(f"wrote {args.out}: {len(rows)} fault classes" + (f", FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed or unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
