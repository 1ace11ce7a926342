"""``tideline schemas``: the schema registry kept in the log directory (topic ``__schemas``).

Commands: ``list``, ``show SUBJECT [--version N]``, ``check SUBJECT FILE`` (would this
``.avsc`` be accepted as the next version? registers nothing) and ``compatibility
SUBJECT [LEVEL | --reset]``. The data behind list/show/check comes from
:mod:`schemas.cli_api`.

:class:`FramedDecoder` is what ``tideline log tail`` uses to show Confluent-framed Avro
keys and values (``0x00`` + 4-byte schema id + Avro binary) as JSON: the datum is decoded
with the writer schema from the registry and rendered by :class:`JsonForm`, which gives
capture's JSON form for the columns of captured tables (fields carrying
``tideline.pg_type``) and a plain JSON rendering of any other Avro schema.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.table import Table

from eventstore.errors import TidelineError
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from schemas.canonical import parse
from schemas.cli_api import check_file, list_subjects, render_show, show_subject
from schemas.compat import CompatibilityLevel
from schemas.errors import SchemaError, SchemaParseError, UnknownSchemaError
from schemas.pgavro import JSON_NAME, PG_TYPE_PROP, ColumnType, Kind, column_type
from schemas.pgvalues import to_json_converter
from schemas.registry import SchemaRegistry
from schemas.wire import HEADER, HEADER_SIZE, MAGIC_BYTE, AvroWire
from tideline.cli_common import fail

app = typer.Typer(
    help="The schema registry of the log: subjects, versions, compatibility checks.",
    no_args_is_help=True,
)

EXIT_INCOMPATIBLE = 1
EXIT_BAD_INPUT = 2

SubjectArg = Annotated[str, typer.Argument(help="Subject, e.g. shop.public.orders-value.", show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


def _data_dir() -> Path:
    from tideline.cli import State  # imported late: tideline.cli imports this module

    return State.data_dir


@contextmanager
def _registry(*, error_code: int = 1) -> Iterator[SchemaRegistry]:
    """The registry of the log at ``--data-dir``; errors become one line and exit ``error_code``."""
    try:
        with Log(_data_dir(), create=False) as log:
            yield SchemaRegistry(LogSchemaStore(log))
    except (TidelineError, SchemaError, ValueError) as e:
        raise fail(str(e), error_code) from None
    except OSError as e:
        raise fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e), error_code) from None


def _echo_json(value: Any) -> None:
    typer.echo(orjson.dumps(value).decode())


# ---------------------------------------------------------------------------- list / show


@app.command("list")
def list_command(json_output: JsonOption = False) -> None:
    """Every subject: its versions, the latest version's schema id, its compatibility level."""
    with _registry() as registry:
        rows = list_subjects(registry)
    if json_output:
        _echo_json(rows)
        return
    if not rows:
        typer.echo(f"no subjects in {_data_dir()}")
        return
    table = Table(title=f"schema registry of {_data_dir()}")
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
    """One version of a subject: its schema id, the subject's compatibility level, the schema."""
    with _registry() as registry:
        shown = show_subject(registry, subject, version)
        shown["versions"] = registry.versions(subject)
    if json_output:
        _echo_json(shown)
        return
    typer.echo(render_show(shown))


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
        default = registry.default_level
    if json_output:
        _echo_json({"subject": subject, "compatibility": after.value, "default": default.value})
    elif new is None and not reset:
        typer.echo(f"{subject}: {after.value}")
    else:
        typer.echo(f"{subject}: {after.value} (was {before.value})")


# ---------------------------------------------------------------------------- decoding for display

Converter = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


def _base64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _json_text(value: str) -> Any:
    """A ``io.debezium.data.Json`` string as the JSON value it holds (its exact text); kept a string if invalid."""
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
    return orjson.Fragment(value)


def _scaled(convert: Converter, factor: int) -> Converter:
    return lambda value: convert(value * factor)


def _kind_json(kind: Kind) -> Converter:
    return to_json_converter(ColumnType(kind))


_PRIMITIVE_JSON: dict[str, Converter] = {
    "null": _same, "boolean": _same, "int": _same, "long": _same, "string": _same,
    "float": _kind_json(Kind.FLOAT), "double": _kind_json(Kind.DOUBLE), "bytes": _base64,
}  # fmt: skip
_LOGICAL_JSON: dict[str, Converter] = {
    "date": _kind_json(Kind.DATE),
    "time-micros": _kind_json(Kind.TIME),
    "time-millis": _scaled(_kind_json(Kind.TIME), 1000),
    "timestamp-micros": _kind_json(Kind.TIMESTAMPTZ),
    "timestamp-millis": _scaled(_kind_json(Kind.TIMESTAMPTZ), 1000),
    "local-timestamp-micros": _kind_json(Kind.TIMESTAMP),
    "local-timestamp-millis": _scaled(_kind_json(Kind.TIMESTAMP), 1000),
    "uuid": str,
}
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {  # union branch kind → the Python types fastavro decodes it to
    "boolean": (bool,), "int": (int,), "long": (int,), "float": (float,), "double": (float,),
    "string": (str,), "enum": (str,), "bytes": (bytes,), "fixed": (bytes,),
    "record": (dict,), "error": (dict,), "map": (dict,), "array": (list,),
}  # fmt: skip


class JsonForm:
    """Avro datums (decoded with ``logical_types=False``) of one schema → JSON-ready values.

    Fields carrying ``tideline.pg_type`` (captured tables' columns) convert as
    :func:`schemas.pgvalues.to_json_converter` does, so a captured change event comes back
    in capture's JSON form; elsewhere logical types render as ISO text / exact decimal
    digits, ``bytes`` and ``fixed`` as base64, ``io.debezium.data.Json`` strings as the JSON
    they hold. Converters are built once per schema. Thread-safe after construction.
    """

    def __init__(self, schema: str) -> None:
        parsed = parse(schema)  # fastavro's form: names are fully qualified, later uses are name strings
        self._named: dict[str, Any] = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
        self._compiled: dict[str, Converter] = {}
        self.convert = self._compile(parsed)

    def _compile(self, node: Any) -> Converter:
        if isinstance(node, str):
            return self._named_ref(node) if node in self._named else _PRIMITIVE_JSON.get(node, _same)
        if isinstance(node, list):
            return self._union(node)
        kind, logical = node["type"], node.get("logicalType")
        if logical == "decimal":
            return to_json_converter(ColumnType(Kind.DECIMAL, 0, int(node["precision"]), int(node.get("scale", 0))))
        if logical in _LOGICAL_JSON:
            return _LOGICAL_JSON[logical]
        if kind in ("record", "error"):
            return self._record(node)
        if kind == "array":
            items = self._compile(node["items"])
            return lambda value: [items(v) for v in value]
        if kind == "map":
            values = self._compile(node["values"])
            return lambda value: {k: values(v) for k, v in value.items()}
        if kind == "fixed":
            return _base64
        if kind == "string" and node.get("connect.name") == JSON_NAME:
            return _json_text
        return self._compile(kind)  # {"type": "long"}, {"type": "enum", …} (a str) and the like

    def _named_ref(self, name: str) -> Converter:
        def convert(value: Any) -> Any:  # late: a record may contain itself
            found = self._compiled.get(name)
            if found is None:
                found = self._compiled[name] = self._compile(self._named[name])
            return found(value)

        return convert

    def _record(self, node: dict[str, Any]) -> Converter:
        fields: list[tuple[str, Converter]] = []
        for f in node["fields"]:
            pg_type = f.get(PG_TYPE_PROP)
            if pg_type is None:
                fields.append((f["name"], self._compile(f["type"])))
                continue
            ctype = column_type(str(pg_type))
            array = self._is_pg_array(f["type"])
            if array != bool(ctype.dimensions):  # the schema decides (a type name need not say, e.g. a domain)
                ctype = ColumnType(ctype.kind, int(array), ctype.precision, ctype.scale)
            fields.append((f["name"], _nullable(to_json_converter(ctype))))
        return lambda value: {name: convert(value.get(name)) for name, convert in fields}

    def _is_pg_array(self, node: Any) -> bool:
        """Is ``node`` (or a branch of it) the ``{dims, items}`` record of a Postgres array (schemas.pgavro)?"""
        if isinstance(node, list):
            return any(self._is_pg_array(n) for n in node)
        if isinstance(node, str):
            node = self._named.get(node)
        return (
            isinstance(node, dict)
            and node.get("type") == "record"
            and [f["name"] for f in node["fields"]] == ["dims", "items"]
        )

    def _union(self, branches: list[Any]) -> Converter:
        options = [(self._kind(b), self._compile(b)) for b in branches if b != "null"]
        if len(options) == 1:
            return _nullable(options[0][1])

        def convert(value: Any) -> Any:
            if value is None:
                return None
            for kind, branch in options:  # fastavro does not say which branch it read: match by Python type
                if isinstance(value, _PYTHON_TYPES.get(kind, ())) and (kind == "boolean") == isinstance(value, bool):
                    return branch(value)
            return value

        return convert

    def _kind(self, node: Any) -> str:
        if isinstance(node, str):
            return str(self._named[node]["type"]) if node in self._named else node
        if isinstance(node, list):
            return "union"
        return self._kind(node["type"]) if isinstance(node["type"], str) else "union"


def _nullable(convert: Converter) -> Converter:
    return lambda value: None if value is None else convert(value)


def framed_schema_id(data: bytes | None) -> int | None:
    """The schema id of a Confluent-framed value (magic byte 0 and a 4-byte id), else None."""
    if data is None or len(data) < HEADER_SIZE or data[0] != MAGIC_BYTE:
        return None
    return int(HEADER.unpack_from(data)[1])


class FramedDecoder:
    """Confluent-framed Avro values → JSON text, through the schema registry of ``log``.

    :meth:`decode` returns ``(json_bytes, schema_id)`` for a value it decoded and
    ``(data, None)`` — the value untouched — for anything else: not framed, an id the
    registry lacks, a payload the schema cannot decode. The two last cases call ``note``
    once per schema id with an explanation. Not thread-safe (one per reader).
    """

    def __init__(self, log: Log, note: Callable[[str], None]) -> None:
        self.registry = SchemaRegistry(LogSchemaStore(log))
        self.wire = AvroWire(self.registry.schema_by_id, logical_types=False)
        self.note = note
        self._forms: dict[int, JsonForm] = {}
        self._missing: set[int] = set()  # ids found unknown since the last forget_missing()
        self._noted: set[int] = set()

    def forget_missing(self) -> None:
        """Look unknown ids up again (call between polls: another process may have registered them)."""
        self._missing.clear()

    def decode(self, data: bytes | None) -> tuple[bytes | None, int | None]:
        schema_id = framed_schema_id(data)
        if schema_id is None or schema_id in self._missing:
            return data, None
        assert data is not None
        try:
            form = self._form(schema_id)
            return orjson.dumps(form.convert(self.wire.decode(data))), schema_id
        except UnknownSchemaError:
            self._missing.add(schema_id)
            self._note_once(schema_id, f"schema id {schema_id} is not in the registry of {self.registry_path}")
        except (SchemaError, ValueError, TypeError, KeyError, AttributeError) as e:
            self._note_once(schema_id, f"a value framed with schema id {schema_id} does not decode ({e})")
        return data, None

    @property
    def registry_path(self) -> Path:
        store = self.registry.store
        return store.log.path if isinstance(store, LogSchemaStore) else Path("?")

    def _form(self, schema_id: int) -> JsonForm:
        form = self._forms.get(schema_id)
        if form is None:
            form = self._forms[schema_id] = JsonForm(self.registry.schema_by_id(schema_id))
        return form

    def _note_once(self, schema_id: int, message: str) -> None:
        if schema_id not in self._noted:
            self._noted.add(schema_id)
            self.note(f"note: {message}: such values are shown as stored")
