"""What ``tideline`` imports before a command runs (issue 33: every command paid ~2 s of imports).

No timings (the suite asserts none): each test runs the command line in a fresh interpreter and
checks which heavy libraries ended up in ``sys.modules``. ``tideline --help``, every group's
``--help`` and ``tideline log topics`` must not import what they do not use; a command imports
its libraries when it runs. Also: ``--dsn`` of the ``capture`` commands comes from ``TIDELINE_DSN``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup
from typer.main import get_command
from typer.testing import CliRunner

from eventstore.isolation import IsolationLevel
from eventstore.log import Log
from tideline import cli, log_cli
from tideline.cli import app
from tideline.cli_common import LazyGroup

# Libraries a command that does not use them must not import (the start-up cost of issue 33). Not listed: typer
# and rich (--help), and pydantic, with which typer coerces the parameters of whatever command runs.
HEAVY = frozenset(
    {
        "alembic", "confluent_kafka", "fastapi", "fastavro", "httpx", "lz4", "matplotlib", "numpy", "pandas",
        "prometheus_client", "psycopg", "psycopg_binary", "py4j", "pyarrow", "pyspark", "sqlalchemy", "starlette",
        "uvicorn", "zstandard",
    }
)  # fmt: skip
# What the embedded log itself is made of (eventstore.log: record batches are Arrow, compressed), so `log topics`
# needs it; nothing else of HEAVY.
LOG_NEEDS = frozenset({"numpy", "pyarrow", "lz4", "zstandard"})

# Runs in a fresh interpreter: `tideline ARGS…` through the app (or only `import tideline.cli` without ARGS), then
# writes the exit code and the modules loaded to the file named by its first argument.
PROBE = """
import json, sys
out, args = sys.argv[1], sys.argv[2:]
code = 0
if args:
    from tideline.cli import app
    try:
        app(args, prog_name="tideline")
    except SystemExit as e:
        code = e.code
else:
    import tideline.cli
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""

GROUPS = ["capture", "console", "db", "kafka", "log", "pg", "project", "schemas"]


def probe(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``tideline ARGS…`` in a fresh interpreter: exit code, stdout, stderr, the heavy libraries it imported."""
    out = tmp_path / f"probe-{len(list(tmp_path.glob('probe-*')))}.json"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIDELINE_")}
    result = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], capture_output=True, text=True,
                            cwd=tmp_path, env={**clean, **(env or {})}, timeout=120)  # fmt: skip
    assert out.exists(), result.stderr[-3000:]
    report = json.loads(out.read_text())
    modules = set(report["modules"])
    return {
        "code": report["code"],
        "stdout": result.stdout,
        "stderr": result.stderr,
        "modules": modules,
        "heavy": {name.partition(".")[0] for name in modules} & HEAVY,
    }


def test_importing_the_cli_imports_no_heavy_library(tmp_path: Path) -> None:
    started = probe(tmp_path)
    assert started["code"] == 0, started["stderr"]
    assert started["heavy"] == set()
    assert not {"eventstore.log", "tideline.log_mirror", "capture.connector", "commands"} & started["modules"]


@pytest.mark.parametrize("group", [None, *GROUPS])
def test_help_imports_no_heavy_library(tmp_path: Path, group: str | None) -> None:
    shown = probe(tmp_path, *([group] if group else []), "--help")
    assert shown["code"] == 0, shown["stdout"] + shown["stderr"]
    assert "Usage: tideline" in shown["stdout"]
    assert shown["heavy"] == set(), f"tideline {group or ''} --help imported {sorted(shown['heavy'])}"


@pytest.mark.parametrize("topics", [[], ["orders", "users"]], ids=["empty", "two-topics"])
def test_log_topics_imports_only_the_log(tmp_path: Path, topics: list[str]) -> None:
    data = tmp_path / "log"
    with Log(data, create=True) as log:
        for name in topics:
            log.create_topic(name, 2)
    listed = probe(tmp_path, "--data-dir", str(data), "log", "topics")
    assert listed["code"] == 0, listed["stderr"]
    assert listed["stdout"].split() == topics
    assert listed["heavy"] <= LOG_NEEDS, f"log topics imported {sorted(listed['heavy'] - LOG_NEEDS)}"
    assert not {"tideline.log_mirror", "eventstore.consumer", "eventstore.kafka"} & listed["modules"]
    assert "pyarrow.compute" not in listed["modules"]  # (eventstore.record_batch imports it where a producer needs it)
    as_json = probe(tmp_path, "--data-dir", str(data), "log", "topics", "--json")
    assert [t["topic"] for t in json.loads(as_json["stdout"])] == topics
    assert as_json["heavy"] <= LOG_NEEDS


def test_a_project_file_costs_no_heavy_import(tmp_path: Path) -> None:
    """With a project file every command is built (its sections are checked against every command's options):
    building them, ``log mirror`` included, imports no more than the options do."""
    with Log(tmp_path / "log", create=True) as log:
        log.create_topic("orders", 1)
    (tmp_path / "tideline.toml").write_text(
        'data_dir = "log"\n[log]\nbatch_records = 5000\n[capture]\ntopic_prefix = "shop"\n'
        '[project]\nengine = "live"\n[schemas]\nport = 8081\n'
    )
    listed = probe(tmp_path, "log", "topics")
    assert listed["code"] == 0, listed["stderr"]
    assert listed["stdout"].split() == ["orders"]
    assert listed["heavy"] <= LOG_NEEDS, f"log topics imported {sorted(listed['heavy'] - LOG_NEEDS)}"
    assert "tideline.log_mirror" in listed["modules"]  # built, so [log] batch_records was checked against it
    assert not {"eventstore.kafka", "eventstore.consumer", "capture.connector"} & listed["modules"]
    (tmp_path / "tideline.toml").write_text('data_dir = "log"\n[log]\nbatch_record = 5000\n')
    typo = probe(tmp_path, "log", "topics")
    assert typo["code"] == 1 and "log.batch_record: no `tideline log` command has this option" in typo["stderr"]


def test_the_mirror_default_batch_is_the_engine_s() -> None:
    from eventstore.kafka.mirror import DEFAULT_BATCH_RECORDS
    from tideline import log_mirror

    assert log_mirror.DEFAULT_BATCH_RECORDS == DEFAULT_BATCH_RECORDS


# ---------------------------------------------------------------------------- sub-commands built when used


def _eager_app() -> typer.Typer:
    """The command line as it was: every sub-command registered on the app (imported) up front."""
    eager = typer.Typer(name="tideline", help=app.info.help, no_args_is_help=True, pretty_exceptions_enable=False,
                        add_completion=False)  # fmt: skip
    eager.callback()(cli._root)
    for name in [*cli.COMMANDS, *cli.GROUPS]:
        cli.register(eager, name)
    return eager


@pytest.mark.parametrize("args", [[], *([g] for g in [*cli.GROUPS, *cli.COMMANDS])], ids=lambda a: a[0] if a else "")
def test_help_is_what_the_eager_registrations_printed(args: list[str]) -> None:
    lazy = CliRunner().invoke(app, [*args, "--help"])
    eager = CliRunner().invoke(_eager_app(), [*args, "--help"])
    assert lazy.exit_code == eager.exit_code == 0, lazy.output
    assert lazy.output == eager.output


def test_a_mistyped_command_is_suggested_as_before() -> None:
    lazy = CliRunner().invoke(app, ["lgo"])
    eager = CliRunner().invoke(_eager_app(), ["lgo"])
    assert lazy.exit_code == eager.exit_code == 2
    assert lazy.output == eager.output and "Did you mean 'log'" in lazy.output


def test_log_help_lists_mirror_as_the_eager_registration_did(monkeypatch: pytest.MonkeyPatch) -> None:
    from tideline.log_mirror import mirror

    doc = inspect.getdoc(mirror)
    assert doc is not None and doc.split("\n\n")[0] == log_cli.MIRROR_HELP
    lazy = CliRunner().invoke(app, ["log", "--help"])
    assert lazy.exit_code == 0 and " mirror " in lazy.output

    class EagerLogGroup(log_cli.LogGroup):  # `mirror` built up front, as app.command("mirror")(mirror) did
        def __init__(self, **attrs: Any) -> None:
            super().__init__(**attrs)
            self.build_all()

    monkeypatch.setattr(log_cli.app.info, "cls", EagerLogGroup)
    eager = CliRunner().invoke(app, ["log", "--help"])
    assert eager.exit_code == 0
    assert lazy.output == eager.output


def test_log_mirror_runs_from_its_module(tmp_path: Path) -> None:
    listed = probe(tmp_path, "log", "--help")
    assert "tideline.log_mirror" not in listed["modules"]
    shown = probe(tmp_path, "log", "mirror", "--help")
    assert shown["code"] == 0, shown["stderr"]
    assert "--to-kafka" in shown["stdout"] and "--batch-records" in shown["stdout"]
    assert "tideline.log_mirror" in shown["modules"]
    no_kafka = {"TIDELINE_KAFKA_BOOTSTRAP": ""}
    refused = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "log", "mirror"], env=no_kafka)
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: give the Kafka cluster to copy to: --to-kafka")


def test_tail_isolation_default_is_read_committed() -> None:
    """``log tail --isolation`` defaults to IsolationLevel.READ_COMMITTED, spelled out so the module imports no log."""
    group = get_command(app)
    assert isinstance(group, LazyGroup)
    group.build_all()
    log_group = group.commands["log"]
    assert isinstance(log_group, TyperGroup)
    (isolation,) = [p for p in log_group.commands["tail"].params if p.name == "isolation"]
    assert isolation.default == IsolationLevel.READ_COMMITTED.value


# ---------------------------------------------------------------------------- capture --dsn from TIDELINE_DSN

NOBODY = "postgresql://tideline_env_dsn@127.0.0.1:1/nowhere"  # nothing listens on port 1


@pytest.mark.parametrize(
    "command",
    [
        ["capture", "run"],
        ["capture", "status"],
        ["capture", "snapshot", "--tables", "public.t"],
        ["capture", "pause-snapshot"],
        ["capture", "resume-snapshot"],
        ["capture", "stop-snapshot"],
    ],
    ids=lambda c: c[1],
)
def test_capture_dsn_comes_from_tideline_dsn(tmp_path: Path, command: list[str]) -> None:
    """Without --dsn, every capture command connects to $TIDELINE_DSN (here: a port nobody listens on)."""
    data = tmp_path / "log"
    Log(data, create=True).close()
    ran = probe(tmp_path, "--data-dir", str(data), *command, env={"TIDELINE_DSN": NOBODY})
    assert "Missing option '--dsn'" not in ran["stderr"]
    assert ran["code"] == 1, ran["stderr"]
    error = ran["stderr"].strip().splitlines()[-1]  # (capture run logs what it did before it connects)
    assert error.startswith("error: ") and "connection failed" in error and '"127.0.0.1", port 1 failed' in error
    missing = probe(tmp_path, "--data-dir", str(data), *command)
    assert missing["code"] == 2 and "Missing option '--dsn'" in missing["stderr"]  # and without it, none
