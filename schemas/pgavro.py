"""Postgres column types → Avro types, and a captured table's key, row and envelope schemas.

Type names arrive as wal2json and the catalog print them ("numeric(12,2)", "character
varying(20)", "timestamp(3) with time zone", "text[]", "_int4"); typmods are read for
numeric and stripped otherwise. A nonzero known OID decides first, then the name.

=======================================  ===================================================
Postgres type (OID)                      Avro type
=======================================  ===================================================
smallint 21, integer 23                  int
bigint 20, oid 26                        long
real 700 / double precision 701          float / double (NaN, ±Infinity native)
boolean 16                               boolean
text, varchar, char, name, "char",       string
citext, enum, domain, inet, money, …
numeric(p,s) 1700, 0 ≤ s ≤ p             union: bytes, logicalType decimal, precision p, scale s |
                                         enum io.tideline.DecimalSpecial {NaN, Infinity,
                                         NegativeInfinity} (numeric(p,s) holds those too)
numeric (unconstrained, or s<0 or s>p)   record io.tideline.VariableScaleDecimal
                                         {scale: int, value: bytes (unscaled, two's
                                         complement big-endian), special: null | enum
                                         {NaN, Infinity, NegativeInfinity}}
timestamp 1114                           long, logicalType local-timestamp-micros
timestamptz 1184                         long, logicalType timestamp-micros (UTC instant)
date 1082                                int, logicalType date
time 1083                                long, logicalType time-micros
timetz 1266                              string (ISO, offset kept), connect.name io.debezium.time.ZonedTime
interval 1186                            string ISO 8601, connect.name io.debezium.time.Interval
uuid 2950                                string, logicalType uuid
json 114, jsonb 3802                     string (JSON text), connect.name io.debezium.data.Json
bytea 17                                 bytes
T[] (any dimension count)                record io.tideline.pgarray.<T> {dims: [int], items:
                                         [null | T]} (lengths, then elements row-major)
=======================================  ===================================================

Every column is ``["null", T]`` (flattened when T is a union) with default null unless
declared NOT NULL or given a default (see :class:`PgColumn`). Value
conversion (Python values as capture produces them ↔ Avro datums ↔ JSON form) is
:mod:`schemas.pgvalues`; ``docs/schemas.md`` lists both mappings next to capture's JSON.

Schemas of a table ``<schema>.<table>`` under topic prefix ``<prefix>`` (Debezium's names):
``<prefix>.<schema>.<table>.Key`` (key columns), ``.Value`` (the row),
``.Envelope`` (the change event, :func:`envelope_schema`).

Thread-safety: pure functions.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.catalog import load_json

VARIABLE_SCALE_DECIMAL = "io.tideline.VariableScaleDecimal"
DECIMAL_SPECIAL = "io.tideline.DecimalSpecial"
JSON_NAME = "io.debezium.data.Json"
INTERVAL_NAME = "io.debezium.time.Interval"
ZONED_TIME_NAME = "io.debezium.time.ZonedTime"
PG_ARRAY_NAMESPACE = "io.tideline.pgarray"
PG_TYPE_PROP = "tideline.pg_type"  # the column's Postgres type name, on each row field


class Kind(enum.Enum):
    """How a column's values are represented (one member per row of the table above)."""

    INT = "int"
    LONG = "long"
    FLOAT = "float"
    DOUBLE = "double"
    BOOLEAN = "boolean"
    STRING = "string"
    DECIMAL = "decimal"
    VARIABLE_DECIMAL = "variable_decimal"
    TIMESTAMP = "timestamp"
    TIMESTAMPTZ = "timestamptz"
    DATE = "date"
    TIME = "time"
    TIMETZ = "timetz"
    INTERVAL = "interval"
    UUID = "uuid"
    JSON = "json"
    BYTES = "bytes"


_BY_OID: dict[int, Kind] = {
    21: Kind.INT, 23: Kind.INT, 20: Kind.LONG, 26: Kind.LONG, 700: Kind.FLOAT, 701: Kind.DOUBLE,
    16: Kind.BOOLEAN, 25: Kind.STRING, 1043: Kind.STRING, 1042: Kind.STRING, 19: Kind.STRING, 18: Kind.STRING,
    1700: Kind.DECIMAL, 1114: Kind.TIMESTAMP, 1184: Kind.TIMESTAMPTZ, 1082: Kind.DATE, 1083: Kind.TIME,
    1266: Kind.TIMETZ, 1186: Kind.INTERVAL, 2950: Kind.UUID, 114: Kind.JSON, 3802: Kind.JSON, 17: Kind.BYTES,
}  # fmt: skip
_ARRAY_OIDS: dict[int, Kind] = {
    1007: Kind.INT, 1005: Kind.INT, 1016: Kind.LONG, 1028: Kind.LONG, 1021: Kind.FLOAT, 1022: Kind.DOUBLE,
    1000: Kind.BOOLEAN, 1009: Kind.STRING, 1015: Kind.STRING, 1014: Kind.STRING, 1003: Kind.STRING,
    1002: Kind.STRING, 1231: Kind.DECIMAL, 1115: Kind.TIMESTAMP, 1185: Kind.TIMESTAMPTZ, 1182: Kind.DATE,
    1183: Kind.TIME, 1270: Kind.TIMETZ, 1187: Kind.INTERVAL, 2951: Kind.UUID, 199: Kind.JSON, 3807: Kind.JSON,
    1001: Kind.BYTES,
}  # fmt: skip
_BY_NAME: dict[str, Kind] = {
    "smallint": Kind.INT, "int2": Kind.INT, "integer": Kind.INT, "int4": Kind.INT, "int": Kind.INT,
    "bigint": Kind.LONG, "int8": Kind.LONG, "oid": Kind.LONG, "real": Kind.FLOAT, "float4": Kind.FLOAT,
    "double precision": Kind.DOUBLE, "float8": Kind.DOUBLE, "boolean": Kind.BOOLEAN, "bool": Kind.BOOLEAN,
    "numeric": Kind.DECIMAL, "decimal": Kind.DECIMAL,
    "timestamp without time zone": Kind.TIMESTAMP, "timestamp": Kind.TIMESTAMP,
    "timestamp with time zone": Kind.TIMESTAMPTZ, "timestamptz": Kind.TIMESTAMPTZ, "date": Kind.DATE,
    "time without time zone": Kind.TIME, "time": Kind.TIME, "time with time zone": Kind.TIMETZ,
    "timetz": Kind.TIMETZ, "interval": Kind.INTERVAL, "uuid": Kind.UUID, "json": Kind.JSON, "jsonb": Kind.JSON,
    "bytea": Kind.BYTES,
}  # fmt: skip
_NUMERIC_TYPMOD = re.compile(r"^(?:numeric|decimal)\s*\(\s*(\d+)\s*(?:,\s*(-?\d+)\s*)?\)")
_TYPMOD = re.compile(r"\(\s*\d+(?:\s*,\s*-?\d+)?\s*\)")


@dataclass(frozen=True, slots=True)
class ColumnType:
    """A column's value representation: ``kind``, array ``dimensions`` (0: scalar), numeric typmod."""

    kind: Kind
    dimensions: int = 0
    precision: int | None = None
    scale: int | None = None


@dataclass(frozen=True, slots=True)
class PgColumn:
    """One column of a captured table, as the catalog or wal2json describes it."""

    name: str
    type_name: str
    type_oid: int = 0
    not_null: bool = False
    dimensions: int | None = None  # array dimensions (pg_attribute.attndims) when the name does not say
    # The Avro default of the field, as JSON text (schemas.pgvalues.avro_default_json): the value
    # rows written before the column existed read as (Postgres's attmissingval after ADD COLUMN
    # … DEFAULT); None: the default is null.
    default_json: str | None = None

    @property
    def column_type(self) -> ColumnType:
        ctype = column_type(self.type_name, self.type_oid)
        if self.dimensions is not None and self.dimensions != ctype.dimensions:
            return ColumnType(ctype.kind, self.dimensions, ctype.precision, ctype.scale)
        return ctype


def column_type(type_name: str, type_oid: int = 0) -> ColumnType:
    """The representation of a Postgres type; unknown types (enums, domains, …) are strings."""
    text = " ".join(type_name.strip().lower().split()).removeprefix("pg_catalog.")
    dims = 0
    while text.endswith("[]"):
        text, dims = text[:-2].rstrip(), dims + 1
    if text.startswith("_") and type_oid == 0:
        text, dims = text[1:], max(dims, 1)
    kind = _ARRAY_OIDS.get(type_oid) if type_oid in _ARRAY_OIDS else _BY_OID.get(type_oid)
    if type_oid in _ARRAY_OIDS:
        dims = max(dims, 1)
    base = "interval" if text.startswith("interval") else " ".join(_TYPMOD.sub("", text).split())
    if kind is None:
        kind = _BY_NAME.get(base, Kind.STRING)
    if kind is not Kind.DECIMAL:
        return ColumnType(kind, dims)
    match = _NUMERIC_TYPMOD.match(text)
    if match is None:
        return ColumnType(Kind.VARIABLE_DECIMAL, dims)
    precision, scale = int(match.group(1)), int(match.group(2) or 0)
    if not 0 <= scale <= precision:
        return ColumnType(Kind.VARIABLE_DECIMAL, dims)  # Avro's decimal needs 0 ≤ scale ≤ precision
    return ColumnType(Kind.DECIMAL, dims, precision, scale)


def _decimal_special(defined: set[str]) -> Any:
    if DECIMAL_SPECIAL in defined:
        return DECIMAL_SPECIAL
    defined.add(DECIMAL_SPECIAL)
    return {"type": "enum", "name": DECIMAL_SPECIAL, "symbols": ["NaN", "Infinity", "NegativeInfinity"]}


def nullable(node: Any, *, null_first: bool = True) -> list[Any]:
    """``node`` or null, as one flat union (Avro forbids a union directly inside a union)."""
    branches = node if isinstance(node, list) else [node]
    return ["null", *branches] if null_first else [*branches, "null"]


def variable_scale_decimal_schema() -> dict[str, Any]:
    return {
        "type": "record",
        "name": VARIABLE_SCALE_DECIMAL,
        "doc": "An exact numeric of any scale: value = unscaled × 10^-scale; special set for NaN/±Infinity.",
        "fields": [
            {"name": "scale", "type": "int"},
            {"name": "value", "type": "bytes", "doc": "unscaled value, two's-complement big-endian"},
            {"name": "special", "default": None, "type": [
                "null", {"type": "enum", "name": DECIMAL_SPECIAL, "symbols": ["NaN", "Infinity", "NegativeInfinity"]}
            ]},
        ],
    }  # fmt: skip


def array_record_name(ctype: ColumnType) -> str:
    """``io.tideline.pgarray.<element>``: one named array record per element type in a schema."""
    element = ctype.kind.value
    if ctype.kind is Kind.DECIMAL:
        element = f"decimal_{ctype.precision}_{ctype.scale}"
    return f"{PG_ARRAY_NAMESPACE}.{element}"


def avro_type(ctype: ColumnType, defined: set[str] | None = None) -> Any:
    """The Avro type of a (non-null) value of ``ctype``.

    Arrays, of any dimensionality, are a record ``{"dims": [int], "items": [T | null]}``:
    the length of each dimension (outermost first; ``[]`` for an empty array) and the
    elements in row-major order, as Postgres itself stores them. A Postgres column of
    type ``T[]`` takes values of any number of dimensions (the declared count is not
    enforced), so a nested Avro array of fixed depth could not hold every value.

    ``defined``: the named types already written in the enclosing schema (Avro defines a
    name once; later uses name it). Updated in place.
    """
    defined = set() if defined is None else defined
    if not ctype.dimensions:
        return _scalar(ctype, defined)
    name = array_record_name(ctype)
    if name in defined:
        return name
    defined.add(name)
    return {
        "type": "record",
        "name": name,
        "doc": "A Postgres array: dimension lengths (outermost first) and the elements in row-major order.",
        "fields": [
            {"name": "dims", "type": {"type": "array", "items": "int"}},
            {"name": "items", "type": {"type": "array", "items": nullable(_scalar(ctype, defined))}},
        ],
    }


def _scalar(ctype: ColumnType, defined: set[str]) -> Any:
    kind = ctype.kind
    if kind in (Kind.INT, Kind.LONG, Kind.FLOAT, Kind.DOUBLE, Kind.BOOLEAN, Kind.STRING, Kind.BYTES):
        return kind.value
    if kind is Kind.DECIMAL:  # a union: numeric(p,s) also holds NaN and ±Infinity, which decimal cannot
        decimal = {"type": "bytes", "logicalType": "decimal", "precision": ctype.precision, "scale": ctype.scale}
        return [decimal, _decimal_special(defined)]
    if kind is Kind.VARIABLE_DECIMAL:
        if VARIABLE_SCALE_DECIMAL in defined:
            return VARIABLE_SCALE_DECIMAL
        special_defined = DECIMAL_SPECIAL in defined
        defined.update((VARIABLE_SCALE_DECIMAL, DECIMAL_SPECIAL))
        schema = variable_scale_decimal_schema()
        if special_defined:  # numeric(p,s) defined the enum first: name it here
            schema["fields"][2]["type"][1] = DECIMAL_SPECIAL
        return schema
    return {
        Kind.TIMESTAMP: {"type": "long", "logicalType": "local-timestamp-micros"},
        Kind.TIMESTAMPTZ: {"type": "long", "logicalType": "timestamp-micros"},
        Kind.DATE: {"type": "int", "logicalType": "date"},
        Kind.TIME: {"type": "long", "logicalType": "time-micros"},
        Kind.TIMETZ: {"type": "string", "connect.name": ZONED_TIME_NAME},
        Kind.INTERVAL: {"type": "string", "connect.name": INTERVAL_NAME},
        Kind.UUID: {"type": "string", "logicalType": "uuid"},
        Kind.JSON: {"type": "string", "connect.name": JSON_NAME},
    }[kind]


def record_schema(name: str, columns: Sequence[PgColumn], *, doc: str = "") -> dict[str, Any]:
    """A record with one field per column, in column order; nullable unless NOT NULL."""
    defined: set[str] = set()
    fields: list[dict[str, Any]] = []
    for col in columns:
        node = avro_type(col.column_type, defined)
        field: dict[str, Any] = {"name": col.name, PG_TYPE_PROP: col.type_name}
        if col.not_null:
            field["type"] = node
        elif col.default_json is not None:  # a union's default belongs to its first branch
            field["type"], field["default"] = nullable(node, null_first=False), json.loads(col.default_json)
        else:
            field["type"], field["default"] = nullable(node), None
        fields.append(field)
    out: dict[str, Any] = {"type": "record", "name": name, "fields": fields}
    if doc:
        out["doc"] = doc
    return out


def table_record_name(prefix: str, schema: str, table: str, suffix: str) -> str:
    """Debezium's ``<prefix>.<schema>.<table>.<suffix>``, characters outside Avro names replaced by ``_``."""
    parts = [re.sub(r"[^A-Za-z0-9_]", "_", p) or "_" for p in (*prefix.split("."), schema, table, suffix)]
    return ".".join(f"_{p}" if p[0].isdigit() else p for p in parts)


@dataclass(frozen=True, slots=True)
class TableAvroSchemas:
    """The schemas of one captured table's topic (JSON values, ready to register)."""

    key: dict[str, Any]
    value: dict[str, Any]  # the row record
    envelope: dict[str, Any]  # the change-event value


def table_schemas(
    prefix: str, schema: str, table: str, columns: Sequence[PgColumn], key_columns: Sequence[str]
) -> TableAvroSchemas:
    """Key, row and envelope schemas of ``<schema>.<table>`` (columns in table order)."""
    by_name = {c.name: c for c in columns}
    missing = [k for k in key_columns if k not in by_name]
    if missing:
        raise ValueError(f"key column(s) {', '.join(missing)} not among the columns of {schema}.{table}")
    key = record_schema(table_record_name(prefix, schema, table, "Key"), [by_name[k] for k in key_columns])
    value = record_schema(table_record_name(prefix, schema, table, "Value"), columns)
    return TableAvroSchemas(key, value, envelope_schema(value, table_record_name(prefix, schema, table, "Envelope")))


def envelope_row_columns(envelope: Any) -> tuple[tuple[str, str | None], ...] | None:
    """The row record's columns of a change envelope (:func:`envelope_schema`: the record ``before`` defines and
    ``after`` names), each with its Postgres type name (the row field's :data:`PG_TYPE_PROP`); None when
    ``envelope`` is no such schema."""
    if not isinstance(envelope, dict) or envelope.get("type") != "record":
        return None
    for field in envelope.get("fields", []):
        if not isinstance(field, dict) or field.get("name") not in ("before", "after"):
            continue
        branches = field["type"] if isinstance(field.get("type"), list) else [field.get("type")]
        for branch in branches:
            if isinstance(branch, dict) and branch.get("type") == "record":
                return tuple((str(f["name"]), None if f.get(PG_TYPE_PROP) is None else str(f[PG_TYPE_PROP]))
                             for f in branch.get("fields", []))  # fmt: skip
    return None


def envelope_schema(row: dict[str, Any], name: str) -> dict[str, Any]:
    """The change-event envelope (``schemas/avsc/envelope.avsc``) with ``row`` as before/after."""
    envelope = load_json("envelope")
    envelope["name"] = name
    envelope.pop("namespace", None)
    for field in envelope["fields"]:
        if field["name"] == "before":
            field["type"] = ["null", row]
        elif field["name"] == "after":
            field["type"] = ["null", row["name"]]
    return envelope
