"""The ``tideline`` command line: one entry point, one sub-command group per package."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tideline.cli_common import fail
from tideline.config import DATA_DIR_ENV, KAFKA_BOOTSTRAP_ENV, resolve_data_dir, resolve_kafka_bootstrap
from tideline.project import PROJECT_ENV

if TYPE_CHECKING:
    from tideline.project import Project

app = typer.Typer(
    name="tideline",
    help="Change-data-capture and event sourcing on a partitioned, compacted log.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class State:
    """Options shared by every sub-command (set by the top-level callback)."""

    data_dir: Path = resolve_data_dir(None)
    kafka: str | None = None  # bootstrap servers: Kafka is the log (see KAFKA_READY_COMMANDS)


# Commands that work with Kafka as the log, or do not touch the log at all. The others
# refuse --kafka / TIDELINE_KAFKA_BOOTSTRAP rather than quietly use the embedded log.
KAFKA_READY_COMMANDS = frozenset({"log", "capture", "project", "kafka", "pg", "db", "schemas", "console"})


@app.callback()
def _root(
    ctx: typer.Context,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--data-dir",
            envvar=DATA_DIR_ENV,
            help="Log directory (default ./tideline-data).",
            show_default=False,
        ),
    ] = None,
    kafka: Annotated[
        str | None,
        typer.Option(
            "--kafka",
            envvar=KAFKA_BOOTSTRAP_ENV,
            metavar="HOST:PORT[,…]",
            help="Use the Apache Kafka cluster at these bootstrap servers as the log "
            "(so far: `tideline log create|topics|describe|produce|tail|groups|mirror`, `tideline capture run|status`, "
            "`tideline schemas …`, `tideline project rebuild|follow|status`, `tideline console`).",
            show_default=False,
        ),
    ] = None,
    project: Annotated[
        str | None,
        typer.Option(
            "--project",
            envvar=PROJECT_ENV,
            metavar="FILE",
            help="The project file (default: the nearest tideline.toml, or pyproject.toml with [tool.tideline], "
            "from the working directory up).",
            show_default=False,
        ),
    ] = None,
) -> None:
    settings = _project(ctx, project)
    State.data_dir = resolve_data_dir(data_dir if data_dir is not None or settings is None else settings.data_dir)
    State.kafka = resolve_kafka_bootstrap(kafka)
    if State.kafka is None and kafka is None and settings is not None:
        State.kafka = settings.kafka_bootstrap()
    if State.kafka is not None and ctx.invoked_subcommand not in KAFKA_READY_COMMANDS:
        raise fail(
            f"`tideline {ctx.invoked_subcommand}` does not support Kafka yet (`tideline log`, `capture`, "
            "`schemas`, `project` and `console` do): "
            f"drop --kafka / unset {KAFKA_BOOTSTRAP_ENV} to use the embedded log"
        )


def _project(ctx: typer.Context, explicit: str | None) -> Project | None:
    """Load the project file (if any), make its directory importable, and hand its values to the sub-commands
    as click's ``default_map`` (below their flags and environment variables)."""
    from tideline.project import ProjectError, activate, default_map, find, load, options_by_group

    try:
        path = find(explicit=explicit)
        if path is None:
            return None
        settings = load(path, options_by_group(ctx.command))
    except ProjectError as e:
        raise fail(str(e)) from None
    activate(settings)
    ctx.default_map = default_map(settings, ctx.command)
    return settings


def _register() -> None:
    from tideline.capture_cli import app as capture_app
    from tideline.console_cli import console_command
    from tideline.db_cli import app as db_app
    from tideline.demo import demo_command
    from tideline.kafka_cli import app as kafka_app
    from tideline.log_cli import app as log_app
    from tideline.pg_cli import app as pg_app
    from tideline.project_cli import app as project_app
    from tideline.schemas_cli import app as schemas_app

    app.add_typer(capture_app, name="capture")
    app.add_typer(log_app, name="log")
    app.add_typer(pg_app, name="pg")
    app.add_typer(kafka_app, name="kafka")
    app.add_typer(db_app, name="db")
    app.add_typer(schemas_app, name="schemas")
    app.add_typer(project_app, name="project")
    app.command("demo", help="Run the main job end to end on the embedded defaults.")(demo_command)
    app.command("console", help="Serve the operations page (topics, lag, capture, projections, schemas, warnings).")(
        console_command
    )


_register()


def main() -> None:
    """Console entry point: run the app, turning our errors into one-line messages."""
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
