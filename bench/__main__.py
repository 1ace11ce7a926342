"""``python -m bench``: run every benchmark module, print the ratios, rewrite BENCHMARKS.md.

A benchmark module (listed in :data:`MODULES`) defines::

    KEY: str      # section key in BENCHMARKS.md, and the name for --only
    TITLE: str    # section heading
    def run(ctx: Context, section: Section) -> None   # appends Results and notes to section

The runner gives each module a fresh temporary directory, times it, and keeps whatever
results it appended before an exception (the error is reported in its section).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from rich.console import Console

from bench.report import BENCHMARKS_MD, Machine, Section, filesystem_of, print_section, update_benchmarks

# In report order. Later modules plug in here: capture, schemas, commands, projections.
REPO = BENCHMARKS_MD.parent
# The examples (the workloads' domains and views) are not part of the installed package: the processes a
# benchmark starts import them from the checkout, like this one does (python -m bench runs from its root).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

MODULES: list[str] = [
    "bench.log_bench",
    "bench.notify_bench",
    "bench.capture_bench",
    "bench.debezium_bench",
    "bench.schemas_bench",
    "bench.commands_bench",
    "bench.projections_bench",
    "bench.projections_growth_bench",
    "bench.follow_bench",
]


@dataclass(frozen=True, slots=True)
class Context:
    """What a benchmark module gets from the runner."""

    workdir: Path  # fresh, empty, removed afterwards unless --keep
    quick: bool  # smaller sizes: a smoke run, not for BENCHMARKS.md
    console: Console
    writes: bool = False  # the run rewrites BENCHMARKS.md: only then are its plots (bench/plots) written too

    def say(self, text: str) -> None:
        self.console.print(f"  {text}", style="dim", highlight=False)


class BenchModule(Protocol):
    KEY: str
    TITLE: str

    def run(self, ctx: Context, section: Section) -> None: ...


def _load(name: str) -> BenchModule:
    return cast(BenchModule, importlib.import_module(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--only", action="append", default=[], metavar="KEY", help="run only this module (repeat)")
    parser.add_argument(
        "--tmp-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the benchmark data goes (default: %(default)s); the filesystem matters for fsync",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes; does not rewrite BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data directories")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 160)
    modules = [_load(name) for name in MODULES]
    keys = [m.KEY for m in modules]
    unknown = set(args.only) - set(keys)
    if unknown:
        parser.error(f"unknown module(s) {', '.join(sorted(unknown))}; known: {', '.join(keys)}")
    selected = [m for m in modules if not args.only or m.KEY in args.only]

    args.tmp_dir.mkdir(parents=True, exist_ok=True)
    sections: list[Section] = []
    for module in selected:
        workdir = Path(tempfile.mkdtemp(prefix=f"tideline-bench-{module.KEY}-", dir=args.tmp_dir))
        section = Section(module.KEY, module.TITLE, Machine.collect())
        same = os.stat(workdir).st_dev == os.stat(REPO).st_dev
        section.notes.append(
            f"Data directory: a fresh temporary directory under `{args.tmp_dir}`, on {filesystem_of(workdir)}: "
            + ("the same filesystem as the repository." if same else f"not the filesystem of {REPO}.")
        )
        console.rule(f"{module.TITLE}")
        ctx = Context(workdir, args.quick, console, writes=not (args.quick or args.no_write))
        start = time.perf_counter()
        try:
            module.run(ctx, section)
        except Exception as e:
            section.error = f"{type(e).__name__}: {e}"
            console.print(traceback.format_exc(), style="red", highlight=False)
        finally:
            section.seconds = time.perf_counter() - start
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        print_section(section, console)
        sections.append(section)

    if not (args.quick or args.no_write):
        update_benchmarks(sections, keys)
        console.print(f"wrote {BENCHMARKS_MD}")
    failed = any(s.error for s in sections)
    missed = any(r.target_met is False for s in sections for r in s.results)
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
