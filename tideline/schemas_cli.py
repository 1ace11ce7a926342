"""``tideline schemas``: the schema registry, in the log directory (topic ``__schemas``) or in Kafka (``_schemas``).

Commands: ``list``, ``show SUBJECT [--version N]``, ``versions SUBJECT`` (each version with
where its first event is in the source: the capture position recorded with it, schemas.starts),
``check SUBJECT FILE`` (would this
``.avsc`` be accepted as the next version? registers nothing), ``compatibility
SUBJECT [LEVEL | --reset]`` and ``serve --port P`` (the Confluent Schema Registry REST
API, :mod:`schemas.rest`, until Ctrl-C). The data behind list/show/check comes from
:mod:`schemas.cli_api`. With ``--kafka`` / ``TIDELINE_KAFKA_BOOTSTRAP`` every command
uses the registry in the Kafka cluster's ``_schemas`` topic
(:mod:`eventstore.kafka.schema_store`) instead of the log directory's.

``tideline log tail`` shows Confluent-framed Avro keys and values as JSON through
:class:`eventstore.schema_store.FramedDecoder` (any consumer can use it the same way).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer

from schemas.compat import CompatibilityLevel
from tideline.cli_common import fail, graceful_server, listen

# The log (pyarrow), the registry (Avro) and rich are imported by the commands that use them, not at start-up:
# every `tideline` command imports this module (tests/tideline/test_cli_startup.py).
if TYPE_CHECKING:
    from schemas.registry import SchemaRegistry
    from schemas.starts import SchemaStart
    from tideline.backend import Backend

app = typer.Typer(
    help="The schema registry of the log (or of Kafka with --kafka): subjects, versions, compatibility checks, "
    "the Confluent REST API.",
    no_args_is_help=True,
)
log = logging.getLogger("tideline.schemas")

EXIT_INCOMPATIBLE = 1
EXIT_BAD_INPUT = 2

SubjectArg = Annotated[str, typer.Argument(help="Subject, e.g. shop.public.orders-value.", show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


def _backend() -> Backend:
    from tideline.cli import State  # imported late: tideline.cli imports this module

    return State.backend()


def _where() -> str:
    """Where the registry lives, for messages: the log directory, or Kafka's topic."""
    return _backend().registry_location()


@contextmanager
def _registry(*, error_code: int = 1) -> Iterator[SchemaRegistry]:
    """The registry of the backend the options chose; errors become one line and exit ``error_code``."""
    from eventstore.errors import TidelineError
    from schemas.errors import SchemaError

    try:
        with _backend().registry() as registry:
            yield registry
    except (TidelineError, SchemaError, ValueError) as e:
        raise fail(str(e), error_code) from None
    except OSError as e:
        raise fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e), error_code) from None


def _starts() -> dict[tuple[str, int], SchemaStart]:
    from eventstore.errors import TidelineError

    try:
        return _backend().schema_starts()
    except (TidelineError, ValueError) as e:
        raise fail(str(e), 1) from None


def _echo_json(value: Any) -> None:
    typer.echo(orjson.dumps(value).decode())


# ---------------------------------------------------------------------------- list / show


@app.command("list")
def list_command(json_output: JsonOption = False) -> None:
    """Every subject: its versions, the latest version's schema id, its compatibility level."""
    from rich.console import Console
    from rich.table import Table

    from schemas.cli_api import list_subjects

    with _registry() as registry:
        rows = list_subjects(registry)
    if json_output:
        _echo_json(rows)
        return
    if not rows:
        typer.echo(f"no subjects in {_where()}")
        return
    table = Table(title=f"schema registry of {_where()}")
    table.add_column("subject")
    for column in ("versions", "latest", "id"):
        table.add_column(column, justify="right")
    table.add_column("compatibility")
    for r in rows:
        table.add_row(r["subject"], _version_list(r["versions"]), str(r["latest_version"]), str(r["id"]),
                      r["compatibility"])  # fmt: skip
    Console(highlight=False).print(table)


def _version_list(versions: list[int]) -> str:
    return ", ".join(map(str, versions)) if len(versions) <= 4 else f"1 … {versions[-1]} ({len(versions)})"


@app.command()
def show(
    subject: SubjectArg,
    version: Annotated[
        int | None, typer.Option("--version", "-v", help="Version to show (default: the latest).", show_default=False)
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """One version of a subject: its schema id, the subject's compatibility level, where its first event is in the
    source (capture's position, when a connector recorded it), the schema."""
    from schemas.cli_api import render_show, show_subject, start_json

    with _registry() as registry:
        shown = show_subject(registry, subject, version)
        shown["versions"] = registry.versions(subject)
    shown["started"] = start_json(_starts().get((shown["subject"], shown["version"])))
    if json_output:
        _echo_json(shown)
        return
    typer.echo(render_show(shown))


@app.command()
def versions(subject: SubjectArg, json_output: JsonOption = False) -> None:
    """Every version of a subject: its schema id, its row fields, and where it started: the source position (commit
    LSN and event index, or the snapshot's) of the first event written under it, as the connector recorded it in
    the same log transaction ("-": no event of a connector was written under it)."""
    from schemas.cli_api import render_versions, subject_versions

    with _registry() as registry:
        rows = subject_versions(registry, subject, _starts())
    if json_output:
        _echo_json(rows)
        return
    typer.echo(render_versions(rows))


# ---------------------------------------------------------------------------- check


@app.command()
def check(
    subject: SubjectArg,
    file: Annotated[Path, typer.Argument(help="Avro schema file (.avsc).", show_default=False)],
    json_output: JsonOption = False,
) -> None:
    """Would FILE be accepted as the next version of SUBJECT? Registers nothing.

    Checks under the subject's compatibility level (see `tideline schemas compatibility`).
    Exit status: 0 compatible (or already registered), 1 incompatible (each reason names
    the field and the rule), 2 bad input (unreadable or invalid schema file, no log).
    A subject with no versions accepts any valid schema: a first version is always compatible.
    """
    with _registry(error_code=EXIT_BAD_INPUT) as registry:
        result = _check_file(registry, subject, file)
        versions = registry.versions(subject)
    level = CompatibilityLevel(result["compatibility"])
    checked = [] if level is CompatibilityLevel.NONE else versions if level.transitive else versions[-1:]
    result["versions"], result["checked_versions"] = versions, checked
    if json_output:
        _echo_json(result)
    else:
        typer.echo(render_check(result))
    if not result["compatible"]:
        raise typer.Exit(EXIT_INCOMPATIBLE)


def _check_file(registry: SchemaRegistry, subject: str, file: Path) -> dict[str, Any]:
    """:func:`schemas.cli_api.check_file`, with every bad-input error naming the file (exit 2)."""
    from schemas.cli_api import check_file
    from schemas.errors import SchemaParseError

    try:
        return check_file(registry, subject, file)
    except UnicodeDecodeError as e:
        raise fail(f"schema file {file} is not UTF-8 text (byte {e.start})", EXIT_BAD_INPUT) from None
    except SchemaParseError as e:
        message = str(e)
        raise fail(message if str(file) in message else f"schema file {file}: {message}", EXIT_BAD_INPUT) from None


def render_check(result: dict[str, Any]) -> str:
    """The terminal text of ``check``: the verdict, what it was checked against, each reason."""
    subject, level = result["subject"], result["compatibility"]
    if result["existing_version"] is not None:
        return f"{subject}: already registered as version {result['existing_version']} (compatible)"
    if not result["versions"]:
        return f"{subject}: compatible: the subject has no versions yet, and a first version is always compatible"
    if not result["checked_versions"]:
        return f"{subject}: compatible (compatibility NONE: nothing is checked)"
    against = "version" + ("s " if len(result["checked_versions"]) > 1 else " ")
    against += ", ".join(map(str, result["checked_versions"]))
    if result["compatible"]:
        return f"{subject}: compatible with {against} ({level})"
    lines = [f"{subject}: NOT compatible with {against} ({level}):"]
    lines += [f"  - {i['message']} [rule: {i['rule']}]" for i in result["incompatibilities"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- compatibility


@app.command()
def compatibility(
    subject: SubjectArg,
    level: Annotated[
        str | None,
        typer.Argument(
            help="Set this level: " + ", ".join(m.value for m in CompatibilityLevel) + ".", show_default=False
        ),
    ] = None,
    reset: Annotated[bool, typer.Option("--reset", help="Return the subject to the default level.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Show a subject's compatibility level, or set it (LEVEL) or return it to the default (--reset).

    The level applies to the next registration (and to `check`); existing versions are not rechecked.
    """
    if level is not None and reset:
        raise fail("give a LEVEL or --reset, not both", EXIT_BAD_INPUT)
    try:
        new = None if level is None else CompatibilityLevel.parse(level)
    except ValueError as e:
        raise fail(str(e), EXIT_BAD_INPUT) from None
    with _registry() as registry:
        before = registry.compatibility(subject)
        if new is not None or reset:
            registry.set_compatibility(subject, new)
        after = registry.compatibility(subject)
        default = registry.compatibility(None)
    if json_output:
        _echo_json({"subject": subject, "compatibility": after.value, "default": default.value})
    elif new is None and not reset:
        typer.echo(f"{subject}: {after.value}")
    else:
        typer.echo(f"{subject}: {after.value} (was {before.value})")


# ---------------------------------------------------------------------------- serve


@app.command()
def serve(
    port: Annotated[int, typer.Option("--port", help="TCP port to listen on (0: any free port).", show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
) -> None:
    """Serve the Confluent Schema Registry REST API from this registry until Ctrl-C (or SIGTERM).

    Confluent's clients (SchemaRegistryClient, AvroSerializer/AvroDeserializer, Kafka
    Connect) work against it unchanged: subjects, versions, schema ids, compatibility
    levels and checks; registrations are stored durably before they are answered. With
    --kafka the registry is the Kafka cluster's `_schemas` topic. Logs one line per
    request (logfmt) on stderr.
    """
    from schemas.rest import create_app

    if not 0 <= port <= 65535:
        raise fail(f"--port must be within 0 … 65535, got {port}", EXIT_BAD_INPUT)
    with _registry() as registry:
        listener = listen(host, port, error_code=EXIT_BAD_INPUT)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
        bound_host, bound_port = listener.getsockname()[:2]
        where = _where()
        server = graceful_server(create_app(registry, description=where.replace(" ", "_")))
        log.info("schemas serve listening=http://%s:%d registry=%r subjects=%d", bound_host, bound_port, where,
                 len(registry.subjects()))  # fmt: skip
        try:
            server.run(sockets=[listener])
        finally:
            listener.close()
        stopped_by = signal.Signals(server.stopped_by).name if server.stopped_by else "shutdown"
        log.info("schemas serve stopped by=%s", stopped_by)
