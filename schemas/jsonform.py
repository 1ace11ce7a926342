"""Avro datums → JSON, driven by the writer schema alone: how a consumer shows framed values.

:class:`JsonForm` renders the datums of one schema (decoded with ``logical_types=False``)
as JSON-ready values: fields carrying ``tideline.pg_type`` (the columns of captured
tables, schemas.pgavro) convert as :func:`schemas.pgvalues.to_json_converter` does, so
a captured change event comes back in capture's JSON form; elsewhere logical types
render as ISO text / exact decimal digits, ``bytes`` and ``fixed`` as base64, and
``io.debezium.data.Json`` strings as the JSON they hold. :func:`framed_schema_id` tells
a Confluent-framed value from anything else. The log-backed decoder that combines them
with the registry is :class:`eventstore.schema_store.FramedDecoder`.

Thread-safety: a JsonForm is safe to share after construction.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import orjson

from schemas.canonical import parse
from schemas.pgavro import JSON_NAME, PG_TYPE_PROP, ColumnType, Kind, column_type
from schemas.pgvalues import to_json_converter
from schemas.wire import HEADER, HEADER_SIZE, MAGIC_BYTE

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
