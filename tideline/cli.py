"""The ``tideline`` command line: one entry point, one sub-command group per package.

A command imports what it needs when it runs: the root group imports a sub-command's module and builds
its click command when it is used (``tideline log topics`` imports ``tideline.log_cli`` and no other
group's module), and the sub-command modules import the log, Kafka's client, Postgres, Avro, Spark and
rich inside their commands (tests/tideline/test_cli_startup.py).
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tideline.cli_common import Lazy, LazyGroup, fail
from tideline.config import DATA_DIR_ENV, KAFKA_BOOTSTRAP_ENV, resolve_data_dir, resolve_kafka_bootstrap
from tideline.project import PROJECT_ENV

if TYPE_CHECKING:
    from typer import _click as click  # typer's own copy of click

    from tideline.backend import Backend
    from tideline.project import Project


class RootGroup(LazyGroup):
    """``tideline``: every sub-command (:data:`COMMANDS`, :data:`GROUPS`) is built when it is used, in the order
    registrations on ``app`` would list them (commands, then groups)."""

    def lazy_commands(self) -> dict[str, Lazy]:
        return {name: Lazy(functools.partial(_build, name)) for name in [*COMMANDS, *GROUPS]}


app = typer.Typer(
    cls=RootGroup,
    name="tideline",
    help="Change-data-capture and event sourcing on a partitioned, compacted log.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class State:
    """Options shared by every sub-command (set by the top-level callback)."""

    data_dir: Path = resolve_data_dir(None)
    kafka: str | None = None  # bootstrap servers: Kafka is the log

    @classmethod
    def backend(cls) -> Backend:
        """The log backend the options chose: every command takes its roles from it (tideline.backend)."""
        from tideline.backend import choose

        return choose(cls.data_dir, cls.kafka)


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
            help="Use the Apache Kafka cluster at these bootstrap servers as the log (every command; `log compact` "
            "is the embedded log's alone).",
            show_default=False,
        ),
    ] = None,
    project: Annotated[
        str | None,
        typer.Option(
            "--project",
            envvar=PROJECT_ENV,
            metavar="FILE",
            help="The project file (default: the nearest tideline.toml, or pyproject.toml with \\[tool.tideline], "
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


def _project(ctx: typer.Context, explicit: str | None) -> Project | None:
    """Load the project file (if any), make its directory importable, and hand its values to the sub-commands
    as click's ``default_map`` (below their flags and environment variables)."""
    from tideline.project import ProjectError, activate, default_map, find, load, options_by_group

    try:
        path = find(explicit=explicit)
        if path is None:
            return None
        if isinstance(ctx.command, LazyGroup):
            ctx.command.build_all()  # the project file's sections are checked against every command's options
        settings = load(path, options_by_group(ctx.command))
    except ProjectError as e:
        raise fail(str(e)) from None
    activate(settings)
    ctx.default_map = default_map(settings, ctx.command)
    return settings


# The sub-commands: name → (module, function, help) of a command; name → module (its ``app``) of a group.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "console": (
        "tideline.console_cli",
        "console_command",
        "Serve the operations page (topics, lag, capture, projections, schemas, warnings).",
    ),
}
GROUPS: dict[str, str] = {
    "capture": "tideline.capture_cli",
    "log": "tideline.log_cli",
    "pg": "tideline.pg_cli",
    "kafka": "tideline.kafka_cli",
    "db": "tideline.db_cli",
    "schemas": "tideline.schemas_cli",
    "project": "tideline.project_cli",
}


def register(target: typer.Typer, name: str) -> None:
    """Register sub-command ``name`` on ``target`` with ``command`` / ``add_typer`` (imports its module)."""
    if name in COMMANDS:
        module, function, help_text = COMMANDS[name]
        target.command(name, help=help_text)(getattr(importlib.import_module(module), function))
    else:
        target.add_typer(importlib.import_module(GROUPS[name]).app, name=name)


def _build(name: str) -> click.Command:
    """Sub-command ``name``'s click command, as typer builds that of a registration on ``app``."""
    from typer.main import get_command_from_info, get_group_from_info

    holder = typer.Typer()
    register(holder, name)
    if holder.registered_commands:
        return get_command_from_info(
            holder.registered_commands[0],
            pretty_exceptions_short=app.pretty_exceptions_short,
            rich_markup_mode=app.rich_markup_mode,
        )
    return get_group_from_info(
        holder.registered_groups[0],
        pretty_exceptions_short=app.pretty_exceptions_short,
        rich_markup_mode=app.rich_markup_mode,
        suggest_commands=app.suggest_commands,
    )


def main() -> None:
    """Console entry point: run the app, turning our errors into one-line messages."""
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
