"""Benchmark results, the machine they ran on, and the rewriting of BENCHMARKS.md.

Each benchmark module returns a list of :class:`Result` (one figure each: its value, the
peer or ceiling measured in the same run, the ratio, the target of docs/targets.md and
whether it is met). A figure measured in runs paired with its peer's (:class:`Paired`:
engine and peer back to back, run by run) reports the medians of both sides' runs as
its values and the **median of the per-pair ratios** as its ratio, the one its target is
checked against; best run ÷ best run is an extra column, never the headline.

:func:`update_benchmarks` rewrites only the sections of the modules that ran, between
``<!-- bench:KEY -->`` and ``<!-- /bench:KEY -->`` markers, and keeps the others, so
modules can be run alone (``python -m bench --only log``); the line under the header
says whether the sections come from one run or several.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


@dataclass(frozen=True, slots=True)
class Result:
    """One measured figure against its same-run peer and its target.

    ``target_met`` is None for informational figures (no target in docs/targets.md).
    ``ratio`` is ``value / baseline_value`` when there is a baseline, or for paired runs the median of the
    per-pair ratios (``value`` and ``baseline_value`` then the medians of each side's runs); ``best_ratio``
    (paired runs only) is the best run's over the peer's best run, with ``runs`` pairs.
    """

    name: str
    value: float
    unit: str
    baseline_name: str | None
    baseline_value: float | None
    ratio: float | None
    target: str
    target_met: bool | None
    note: str = ""
    best_ratio: float | None = None
    runs: int = 0


@dataclass(frozen=True, slots=True)
class Paired:
    """Runs of a figure and of its peer taken back to back: pair ``i`` is ``values[i]`` and ``peers[i]``
    (same unit; both sides' runs interleaved, so drift in the machine hits both sides of a pair alike).

    ``lower_is_better`` for times and latencies: the best run is then the smallest.
    """

    values: Sequence[float]
    peers: Sequence[float]
    lower_is_better: bool = False

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.peers):
            raise ValueError(f"paired runs need as many peer runs as runs, at least one: {self.values} / {self.peers}")

    @property
    def ratios(self) -> list[float]:
        return [v / p for v, p in zip(self.values, self.peers, strict=True)]

    @property
    def ratio(self) -> float:
        """The headline: the median of the per-pair ratios."""
        return statistics.median(self.ratios)

    @property
    def value(self) -> float:
        return statistics.median(self.values)

    @property
    def peer(self) -> float:
        return statistics.median(self.peers)

    @property
    def best_ratio(self) -> float:
        """Best-of-N: the best run over the peer's best run (an extra column)."""
        pick = min if self.lower_is_better else max
        return pick(self.values) / pick(self.peers)

    def spread(self, fmt: str = ",.0f") -> str:
        """``runs a, b, c vs peer x, y, z; pair ratios r1, r2, r3``, in run order."""
        return (
            f"runs {', '.join(format(v, fmt) for v in self.values)} vs {', '.join(format(p, fmt) for p in self.peers)}"
            f"; pair ratios {', '.join(f'{r:.2f}' for r in self.ratios)}"
        )


def measured_paired(
    name: str,
    runs: Paired,
    unit: str,
    *,
    baseline_name: str,
    min_ratio: float | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    note: str = "",
) -> Result:
    """A figure from paired runs (:class:`Paired`): values are the medians of each side's runs, the ratio the
    median of the per-pair ratios (``min_ratio`` is checked against it), best-of-N beside it."""
    result = measured(name, runs.value, unit, baseline_name=baseline_name, baseline_value=runs.peer,
                      min_ratio=min_ratio, min_value=min_value, max_value=max_value, note=note,
                      ratio=runs.ratio)  # fmt: skip
    n = len(runs.values)
    return replace(result, best_ratio=runs.best_ratio if n > 1 else None, runs=n)


def measured(
    name: str,
    value: float,
    unit: str,
    *,
    baseline_name: str | None = None,
    baseline_value: float | None = None,
    min_ratio: float | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    note: str = "",
    ratio: float | None = None,
) -> Result:
    """Build a :class:`Result`, computing the ratio and whether the target is met.

    ``min_ratio``: target ``ratio ≥ min_ratio``, the ratio being ``value / baseline_value`` unless
    ``ratio`` is given (paired runs: :func:`measured_paired`); ``min_value``: target ``value ≥
    min_value`` (in ``unit``); ``max_value``: target ``value ≤ max_value`` (latencies). None of them:
    an informational figure.
    """
    if ratio is None:
        ratio = value / baseline_value if baseline_value else None
    if min_ratio is not None:
        target = f"≥ {min_ratio:g}× {baseline_name or 'baseline'}"
        met: bool | None = ratio is not None and ratio >= min_ratio
    elif min_value is not None:
        target = f"≥ {fmt_value(min_value)} {unit}"
        met = value >= min_value
    elif max_value is not None:
        target = f"≤ {fmt_value(max_value)} {unit}"
        met = value <= max_value
    else:
        target, met = "— (informational)", None
    return Result(name, value, unit, baseline_name, baseline_value, ratio, target, met, note)


# ---------------------------------------------------------------------------- machine


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def ram_gib() -> float:
    m = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), re.MULTILINE)
    return int(m.group(1)) / (1 << 20) if m else 0.0


def filesystem_of(path: Path) -> str:
    """``mount point (fstype, device)`` holding ``path``, from /proc/self/mountinfo."""
    best: tuple[str, str, str] = ("?", "?", "?")
    target = str(path.resolve())
    for line in _read("/proc/self/mountinfo").splitlines():
        parts = line.split()
        if " - " not in line or len(parts) < 5:
            continue
        mount = parts[4]
        fstype, source = line.split(" - ", 1)[1].split()[:2]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best[0] == "?" or len(mount) > len(best[0])):
            best = (mount, fstype, source)
    return f"{best[0]} ({best[1]} on {best[2]})"


def code_version(repo: Path = BENCHMARKS_MD.parent) -> str:
    """``<commit> (+ uncommitted changes in a, b)`` of the code measured (tracked sources only)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--", "*.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = sorted(line[3:] for line in dirty if line.strip() and not line[3:].startswith("bench/"))
    return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


@dataclass(frozen=True, slots=True)
class Machine:
    nproc: int
    cpu: str
    ram_gib: float
    python: str
    pyarrow: str
    kernel: str
    date: str

    @classmethod
    def collect(cls) -> Machine:
        import pyarrow

        nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
        return cls(
            nproc=nproc,
            cpu=cpu_model(),
            ram_gib=ram_gib(),
            python=platform.python_version(),
            pyarrow=pyarrow.__version__,
            kernel=platform.release(),
            date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        )

    def line(self) -> str:
        return (
            f"{self.nproc} CPUs ({self.cpu}), {self.ram_gib:.1f} GiB RAM, Linux {self.kernel}, "
            f"Python {self.python}, pyarrow {self.pyarrow}, {self.date}"
        )


@dataclass(slots=True)
class Section:
    """The outcome of one benchmark module in one run."""

    key: str
    title: str
    machine: Machine
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    code: str = field(default_factory=code_version)


# ---------------------------------------------------------------------------- formatting


def fmt_value(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:,.1f}"
    return f"{v:,.2f}"


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}×"


def fmt_met(met: bool | None) -> str:
    return "—" if met is None else ("PASS" if met else "FAIL")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def fmt_best(r: Result) -> str:
    return "—" if r.best_ratio is None else f"{r.best_ratio:.2f}× (of {r.runs})"


COLUMNS = ("figure", "value", "peer / ceiling (same run)", "peer value", "ratio", "target", "met")
BEST_COLUMN = "best-of-N ratio (extra)"  # after "ratio", in sections with paired figures


def _row(r: Result, best: bool) -> list[str]:
    base = f"{fmt_value(r.baseline_value)} {r.unit}" if r.baseline_value is not None else "—"
    cells = [r.name, f"{fmt_value(r.value)} {r.unit}", r.baseline_name or "—", base, fmt_ratio(r.ratio)]
    return cells + ([fmt_best(r)] if best else []) + [r.target, fmt_met(r.target_met)]


def render_section(section: Section) -> str:
    lines = [f"<!-- bench:{section.key} -->", f"## {section.title}", ""]
    lines.append(f"Machine: {section.machine.line()}. Took {section.seconds:.0f} s.")
    lines.append("")
    lines.append(f"Code: {section.code}.")
    lines.append("")
    if section.error:
        lines += [f"**The benchmark failed:** `{_cell(section.error)}`", ""]
    targeted = [r for r in section.results if r.target_met is not None]
    if targeted:
        passed = sum(1 for r in targeted if r.target_met)
        lines += [f"Targets met: **{passed} of {len(targeted)}**.", ""]
    if section.results:
        best = any(r.best_ratio is not None for r in section.results)
        columns = [*COLUMNS[:5], *([BEST_COLUMN] if best else []), *COLUMNS[5:]]
        aligns = ["---", "--:", "---", "--:", "--:", *(["--:"] if best else []), "---", ":-:"]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "|".join(aligns) + "|")
        lines += ["| " + " | ".join(_cell(x) for x in _row(r, best)) + " |" for r in section.results]
        lines.append("")
        noted = [r for r in section.results if r.note]
        if noted:
            lines.append("Notes on figures:")
            lines.append("")
            lines += [f"- *{r.name}*: {r.note}" for r in noted]
            lines.append("")
    if section.notes:
        lines.append("Method:")
        lines.append("")
        lines += [f"- {n}" for n in section.notes]
        lines.append("")
    lines.append(f"<!-- /bench:{section.key} -->")
    return "\n".join(lines)


HEADER = """# Tideline benchmarks

Written by `make bench` (`python -m bench`); do not edit by hand: each section is
rewritten by the benchmark module that owns it (`bench/<module>.py`), and sections of
modules that did not run are kept as they were. Every figure is measured next to a peer
or ceiling **in the same run on the same machine** and compared with the project's
targets ([docs/targets.md](docs/targets.md)). Where a figure and its peer run several
times, back to back, `value` and `peer value` are the medians of their runs and `ratio`
is the **median of the per-pair ratios** (what the target is checked against); the
best-of-N ratio (best run ÷ the peer's best run) is an extra column. MB/s are 10^6 bytes
per second. `met` is PASS/FAIL against the target, `—` for informational figures.
"""

_CODE = re.compile(r"^Code: (?P<code>.+?)\.$", re.MULTILINE)
_MACHINE = re.compile(r"^Machine: (?P<machine>.+?)\. Took", re.MULTILINE)


def runs_line(blocks: dict[str, str], order: list[str]) -> str:
    """Which runs the sections come from: one line when every section is from one commit, else each
    section's commit and date (the sections' own Machine and Code lines have the rest)."""
    codes: dict[str, str] = {}
    machines: dict[str, str] = {}
    for key in order:
        if key in blocks:
            code, machine = _CODE.search(blocks[key]), _MACHINE.search(blocks[key])
            codes[key] = code.group("code") if code else "unknown"
            machines[key] = machine.group("machine") if machine else "unknown"
    if not codes:
        return "No section has run yet."
    if len(set(codes.values())) == 1:
        newest = max(machines.values(), key=lambda m: m.rsplit(", ", 1)[-1])
        return f"Every section at code {next(iter(codes.values()))}; the last ran on {newest}."
    listed = "; ".join(f"{key} at {codes[key]} ({machines[key].rsplit(', ', 1)[-1]})" for key in codes)
    return (
        f"**The sections come from different runs** (commits and dates: {listed}); each section's Machine and "
        "Code lines say where its figures come from. `make bench` measures every section at one commit."
    )


_BLOCK = re.compile(r"<!-- bench:(?P<key>[\w.-]+) -->.*?<!-- /bench:(?P=key) -->", re.DOTALL)


def update_benchmarks(sections: list[Section], order: list[str], path: Path = BENCHMARKS_MD) -> None:
    """Rewrite ``path``: the header, the latest machine, then one block per module in ``order``."""
    existing: dict[str, str] = {}
    if path.exists():
        for m in _BLOCK.finditer(path.read_text()):
            existing[m.group("key")] = m.group(0)
    for s in sections:
        existing[s.key] = render_section(s)
    keys = [k for k in order if k in existing] + sorted(k for k in existing if k not in order)
    parts = [HEADER, runs_line(existing, keys), ""]
    for key in keys:
        parts += [existing[key], ""]
    path.write_text("\n".join(parts).rstrip() + "\n")


def print_section(section: Section, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{section.title} — {section.seconds:.0f} s", title_justify="left")
    best = any(r.best_ratio is not None for r in section.results)
    columns = [*COLUMNS[:5], *([BEST_COLUMN] if best else []), *COLUMNS[5:]]
    for col in columns:
        justify = "center" if col == "met" else "left" if col in ("figure", "target", COLUMNS[2]) else "right"
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in section.results:
        cells = _row(r, best)
        met = cells[-1]
        style = {"PASS": "green", "FAIL": "bold red"}.get(met, "dim")
        table.add_row(*cells[:-1], f"[{style}]{met}[/{style}]")
    console.print(table)
    for r in section.results:
        if r.note:
            console.print(f"  {r.name}: {r.note}", style="dim", highlight=False)
    if section.error:
        console.print(f"[bold red]{section.title} failed:[/bold red] {section.error}")
    console.print(f"machine: {section.machine.line()}; code: {section.code}", style="dim", highlight=False)
    sys.stdout.flush()
