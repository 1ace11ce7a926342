"""The code blocks of README.md and docs/*.md run, as a newcomer would paste them.

Convention (README.md, "Documentation conventions"): a fence
tagged ``bash`` or ``python`` is a runnable example and is executed here, each block on
its own in a fresh temporary directory (a doc marked ``<!-- doc-test: one session -->``, a guide, runs its bash
blocks in order as one session) (``bash -euo pipefail`` with the venv's ``bin``
first on PATH; ``python`` with the venv's interpreter). An untagged fence (usage
synopses, output, architecture pictures) or any other language is shown, not run. A
block whose first line is ``# not run: <reason>`` is skipped, saying why.

Blocks start whatever they need themselves (``tideline pg start --dir …`` and stop it),
so they run in any order; their ``/tmp/…`` paths are moved into the test's own
temporary directory. ``TIDELINE_DSN`` names a fresh migrated database (``tideline db
upgrade``) of the test session's Postgres, for snippets that need one.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.reservations import models as example
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
RUNNABLE = ("bash", "python")


ONE_SESSION = "<!-- doc-test: one session -->"  # a doc whose bash blocks are the steps of one shell session


def blocks() -> list[tuple[str, str, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        found = [
            (f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m["lang"], m["body"])
            for m in FENCE.finditer(text)
            if m["lang"] in RUNNABLE
        ]
        if ONE_SESSION in text and found:
            assert {lang for _, lang, _ in found} == {"bash"}, f"{path}: a one-session doc runs bash blocks only"
            out.append((found[0][0], "bash", session(text)))
        else:
            out.extend(found)
    return out


def session(text: str) -> str:
    """The bash blocks of a one-session doc, in order, as one script."""
    return "".join(m["body"] for m in FENCE.finditer(text) if m["lang"] == "bash")


BLOCKS = blocks()


def test_there_are_runnable_blocks() -> None:
    assert len(BLOCKS) >= 5, [b[0] for b in BLOCKS]


_databases = itertools.count()


@pytest.mark.parametrize(("where", "lang", "body"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs(where: str, lang: str, body: str, tmp_path: Path, postgres: LocalPostgres) -> None:
    first = body.lstrip().splitlines()[0] if body.strip() else ""
    if first.startswith("# not run:"):
        pytest.skip(first.removeprefix("# not run:").strip())
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path),
    }
    env.pop("TIDELINE_DATA_DIR", None)
    env.pop("TIDELINE_VIEWS", None)  # a doc names its views itself, as a reader must
    # A migrated database of its own, for snippets that say dsn = os.environ["TIDELINE_DSN"]
    # (a block that starts its own Postgres sets the variable itself).
    env["TIDELINE_DSN"] = postgres.create_database(f"docs_{next(_databases)}_{os.getpid()}")
    example.upgrade(env["TIDELINE_DSN"])  # the docs run the example: its branch too
    body = body.replace("/tmp/", f"{tmp_path}/")  # the examples' fixed paths, private to this run
    argv = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{where} ({lang}) exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-3000:]}"
    )
