"""bench.report: paired runs give the median of the per-pair ratios as the headline (the target is checked
against it), best-of-N only as an extra column; BENCHMARKS.md says whether its sections come from one run."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``bench.report`` (bench/ is not an installed package: imported from the repository)."""
    monkeypatch.syspath_prepend(str(REPO))
    import bench.report

    yield bench.report
    sys.modules.pop("bench.report", None)


def test_paired_runs_headline_the_median_of_pair_ratios(report: ModuleType) -> None:
    # one lucky engine run and one unlucky peer run: best-of-N would pass a 0.8x target, the pairs do not
    runs = report.Paired([100.0, 50.0, 52.0], [100.0, 100.0, 80.0])
    assert runs.ratios == [1.0, 0.5, 0.65] and runs.ratio == 0.65
    assert (runs.value, runs.peer, runs.best_ratio) == (52.0, 100.0, 1.0)
    result = report.measured_paired("append", runs, "MB/s", baseline_name="raw write", min_ratio=0.8)
    assert (result.value, result.baseline_value, result.ratio, result.best_ratio, result.runs) == (
        52.0, 100.0, 0.65, 1.0, 3,
    )  # fmt: skip
    assert result.target_met is False and result.target == "≥ 0.8× raw write"
    assert report.measured_paired("a", runs, "MB/s", baseline_name="raw", min_ratio=0.6).target_met is True
    latency = report.Paired([20.0, 30.0], [10.0, 40.0], lower_is_better=True)
    assert latency.best_ratio == 2.0 and latency.ratio == pytest.approx((2.0 + 0.75) / 2)
    with pytest.raises(ValueError, match="as many peer runs"):
        report.Paired([1.0, 2.0], [1.0])


def test_sections_with_paired_figures_have_the_best_of_n_column(report: ModuleType) -> None:
    machine = report.Machine(2, "cpu", 1.0, "3.11", "26", "6.1", "2026-12-06 10:00 UTC")
    paired = report.Section("log", "Log", machine, code="abc1234")
    paired.results += [
        report.measured_paired("append", report.Paired([9.0, 11.0], [10.0, 10.0]), "MB/s", baseline_name="raw"),
        report.measured("send()", 5.0, "records/s", baseline_name="send_batch", baseline_value=10.0),
    ]
    lines = report.render_section(paired).splitlines()
    header = next(line for line in lines if line.startswith("| figure"))
    assert "| ratio | best-of-N ratio (extra) | target |" in header
    assert "| append | 10.0 MB/s | raw | 10.0 MB/s | 1.00× | 1.10× (of 2) | — (informational) | — |" in lines
    assert "| send() | 5.00 records/s | send_batch | 10.0 records/s | 0.50× | — | — (informational) | — |" in lines
    single = report.Section("x", "X", machine, code="abc1234")
    single.results.append(report.measured("p99", 3.0, "ms", max_value=5.0))
    assert "best-of-N" not in report.render_section(single)


def test_benchmarks_md_says_whether_its_sections_come_from_one_run(report: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    machine = report.Machine(2, "cpu", 1.0, "3.11", "26", "6.1", "2026-12-06 10:00 UTC")
    sections = [report.Section(key, key.title(), machine, code="abc1234") for key in ("log", "debezium")]
    report.update_benchmarks(sections, ["log", "debezium"], path)
    assert "Every section at code abc1234; the last ran on 2 CPUs (cpu)" in path.read_text()
    later = report.Machine(2, "cpu", 1.0, "3.11", "26", "6.1", "2026-12-07 09:00 UTC")
    report.update_benchmarks([report.Section("log", "Log", later, code="def5678")], ["log", "debezium"], path)
    text = path.read_text()
    assert "**The sections come from different runs**" in text
    assert "log at def5678 (2026-12-07 09:00 UTC); debezium at abc1234 (2026-12-06 10:00 UTC)" in text
    assert text.index("<!-- bench:log -->") < text.index("<!-- bench:debezium -->")  # kept, in module order
