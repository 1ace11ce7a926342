"""Postgres → Avro: each type's Avro schema, and capture's values round-tripping through real
fastavro to exactly the JSON capture writes (``capture.pgtypes.dumps``)."""

from __future__ import annotations

import io
import json
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import fastavro
import orjson
import pytest

from capture.pgtypes import Interval, JsonNumber, NonFiniteFloat
from capture.pgtypes import dumps as capture_dumps
from schemas.canonical import parse
from schemas.errors import IncompatibleSchemaError, ValueConversionError
from schemas.pgavro import PgColumn, column_type, table_schemas
from schemas.pgvalues import RowCodec, avro_default_json
from schemas.registry import MemorySchemaStore, SchemaRegistry
from schemas.tables import TableSchemas
from schemas.wire import AvroWire

DEC = "bytes", "decimal"

# (type name, oid, expected Avro type without the null branch, representative values)
SPECIAL = '{"type": "enum", "name": "io.tideline.DecimalSpecial", "symbols": ["NaN", "Infinity", "NegativeInfinity"]}'


def pg_array(element: str, item_type: str, *more_items: str) -> dict[str, Any]:
    """The array record of schemas.pgavro.avro_type for an element type (item types as JSON text)."""
    return {
        "type": "record",
        "name": f"io.tideline.pgarray.{element}",
        "doc": "A Postgres array: dimension lengths (outermost first) and the elements in row-major order.",
        "fields": [
            {"name": "dims", "type": {"type": "array", "items": "int"}},
            {"name": "items", "type": {"type": "array", "items": ["null", *map(json.loads, (item_type, *more_items))]}},
        ],
    }


TYPES: list[tuple[str, int, Any, list[Any]]] = [
    ("smallint", 21, "int", [-32768, 7]),
    ("integer", 23, "int", [2**31 - 1, -5]),
    ("bigint", 20, "long", [2**63 - 1, -(2**63)]),
    ("real", 700, "float", [1.1, -0.0, 3.4028235e38, NonFiniteFloat("nan"), NonFiniteFloat("-inf")]),
    ("double precision", 701, "double", [0.1, 1e-300, NonFiniteFloat("inf")]),
    ("boolean", 16, "boolean", [True, False]),
    ("character varying(20)", 1043, "string", ["héllo", ""]),
    ("character(4)", 1042, "string", ["ab  "]),
    ("text", 25, "string", ["x" * 1000]),
    ("mood", 16500, "string", ["happy"]),  # a user-defined enum: unknown OID → string
    ("numeric(12,2)", 1700, {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
     [Decimal("12.30"), Decimal("-0.05"), Decimal("9999999999.99"), Decimal("0.00"), Decimal("NaN"),
      Decimal("Infinity"), Decimal("-Infinity")]),  # numeric(p,s) holds these: the DecimalSpecial branch
    ("numeric(40,10)", 1700, {"type": "bytes", "logicalType": "decimal", "precision": 40, "scale": 10},
     [Decimal("123456789012345678901234567890.0123456789")]),
    ("numeric", 1700, "io.tideline.VariableScaleDecimal",
     [Decimal("-123456789012345678901234567890123456789.000000000000000000001"), Decimal("-42"), Decimal("0"),
      Decimal("1000"), Decimal("NaN"), Decimal("Infinity"), Decimal("-Infinity")]),
    ("timestamp without time zone", 1114, {"type": "long", "logicalType": "local-timestamp-micros"},
     [datetime(2024, 3, 31, 1, 30, 0, 500000), datetime(1, 1, 1), datetime(1969, 12, 31, 23, 59, 59, 999999),
      "infinity", "-infinity", "0044-03-15 01:02:03.5 BC", "10000-01-01 00:00:00"]),
    ("timestamp with time zone", 1184, {"type": "long", "logicalType": "timestamp-micros"},
     [datetime(2024, 3, 31, 1, 30, tzinfo=UTC), datetime(1900, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
      "infinity", "0044-03-15 01:02:03+00 BC"]),
    ("date", 1082, {"type": "int", "logicalType": "date"},
     [date(2024, 2, 29), date(1, 1, 1), date(9999, 12, 31), "infinity", "-infinity", "0044-03-15 BC"]),
    ("time without time zone", 1083, {"type": "long", "logicalType": "time-micros"},
     [time(4, 5, 6, 789000), time(0, 0), time(23, 59, 59, 999999), "24:00:00"]),
    ("time with time zone", 1266, {"type": "string", "connect.name": "io.debezium.time.ZonedTime"},
     [time(4, 5, 6, tzinfo=timezone(timedelta(hours=5, minutes=30)))]),
    ("interval", 1186, {"type": "string", "connect.name": "io.debezium.time.Interval"},
     [Interval(14, 3, 14_706_789_000), Interval(0, 0, 0), Interval(-1, -2, -3_000_000)]),
    ("uuid", 2950, {"type": "string", "logicalType": "uuid"}, [uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")]),
    ("jsonb", 3802, {"type": "string", "connect.name": "io.debezium.data.Json"},
     [{"a": [1, JsonNumber("1.10"), None, True], "b": {"c": "d"}}, [2**70, -1], "just a string", 5]),
    ("json", 114, {"type": "string", "connect.name": "io.debezium.data.Json"}, [{"z": 1, "a": 2}]),
    ("bytea", 17, "bytes", [b"\x00\xff\x10", b""]),
    ("integer[]", 1007, pg_array("int", '"int"'), [[1, None, 3], [], [[1, None], [3, 4]]]),
    ("text[]", 1009, pg_array("string", '"string"'), [["a", None, "b,c"]]),
    ("numeric(5,2)[]", 1231,
     pg_array("decimal_5_2", '{"type": "bytes", "logicalType": "decimal", "precision": 5, "scale": 2}',
              SPECIAL),
     [[Decimal("1.50"), None, Decimal("NaN"), Decimal("-Infinity")]]),
    ("integer[][]", 0, pg_array("int", '"int"'), [[[1, None], [None, 4]], [], [7], [[[1], [2]], [[3], [4]]]]),
    ("timestamp with time zone[]", 1185,
     pg_array("timestamptz", '{"type": "long", "logicalType": "timestamp-micros"}'),
     [[datetime(2024, 1, 1, tzinfo=UTC), None, "infinity"]]),
]  # fmt: skip


def _beyond_python(value: Any) -> bool:
    if isinstance(value, list):
        return any(_beyond_python(v) for v in value)
    return isinstance(value, str) and (value.endswith(("infinity", " BC", "24:00:00")) or value.startswith("10000"))


def _avro_type(field: dict[str, Any]) -> Any:
    node = field["type"][1]
    if isinstance(node, dict) and node.get("type") == "record" and not node["name"].startswith("io.tideline.pgarray."):
        return node["name"]  # the variable-scale decimal: compared by name
    return node


@pytest.mark.parametrize(("type_name", "oid", "expected", "values"), TYPES, ids=[t[0] for t in TYPES])
def test_type_maps_and_round_trips_to_capture_json(type_name: str, oid: int, expected: Any, values: list[Any]) -> None:
    columns = [PgColumn("id", "integer", 23, not_null=True), PgColumn("v", type_name, oid)]
    schemas = table_schemas("shop", "public", "t", columns, ["id"])
    assert _avro_type(schemas.value["fields"][1]) == expected
    registry = SchemaRegistry(MemorySchemaStore())
    value_id = registry.register("shop.public.t-value", schemas.envelope).id
    codec = RowCodec(columns)
    source = {"version": "tideline-0.1", "connector": "postgresql", "name": "shop", "ts_ms": 1, "snapshot": "false",
              "db": "db", "schema": "public", "table": "t", "txId": 9, "commit_lsn": 100, "lsn": 90,
              "event_index": 0}  # fmt: skip
    rows = [{"id": n, "v": v} for n, v in enumerate([*values, None])]
    events = [codec.envelope_to_avro(op="c", before=None, after=r, source=source, ts_ms=5) for r in rows]
    framed = AvroWire(registry.schema_by_id).encode_many(value_id, events)
    # fastavro's logical types cannot hold what Python's datetime cannot (capture keeps those as
    # Postgres text): they decode only with logical_types=False, the path RowCodec is built for.
    in_range = [n for n, r in enumerate(rows) if not _beyond_python(r["v"])]
    for logical in (False, True):
        wire = AvroWire(registry.schema_by_id, logical_types=logical)
        picked = range(len(rows)) if not logical else in_range
        decoded = wire.decode_many([framed[n] for n in picked])
        for row, datum in zip([rows[n] for n in picked], decoded, strict=True):
            envelope = {"before": None, "after": row, "source": source, "op": "c", "ts_ms": 5, "transaction": None}
            assert orjson.dumps(codec.envelope_to_json(datum)) == capture_dumps(envelope), (logical, row)


def test_every_column_nullable_unless_not_null() -> None:
    columns = [PgColumn("id", "bigint", 20, not_null=True), PgColumn("note", "text", 25)]
    value = table_schemas("p", "s", "t", columns, ["id"]).value
    assert value["fields"][0]["type"] == "long" and "default" not in value["fields"][0]
    assert value["fields"][1]["type"] == ["null", "string"] and value["fields"][1]["default"] is None


def test_names_and_key_schema() -> None:
    columns = [PgColumn("a", "integer", 23, True), PgColumn("b", "text", 25, True), PgColumn("n", "numeric", 1700),
               PgColumn("m", "numeric[]", 1231)]  # fmt: skip
    built = table_schemas("shop", "public", "orders", columns, ["b", "a"])
    assert built.key["name"] == "shop.public.orders.Key"
    assert [f["name"] for f in built.key["fields"]] == ["b", "a"]
    assert built.value["name"] == "shop.public.orders.Value"
    assert built.envelope["name"] == "shop.public.orders.Envelope"
    items = built.value["fields"][3]["type"][1]["fields"][1]["type"]["items"]
    assert items == ["null", "io.tideline.VariableScaleDecimal"]  # named once
    for schema in (built.key, built.value, built.envelope):
        parse(schema)
    with pytest.raises(ValueError, match="key column"):
        table_schemas("shop", "public", "orders", columns, ["zz"])


@pytest.mark.parametrize(
    ("type_name", "expect"),
    [("numeric(12,2)", ("decimal", 12, 2)), ("numeric(7)", ("decimal", 7, 0)), ("numeric", ("variable_decimal",)),
     ("numeric(3,-2)", ("variable_decimal",)), ("numeric(2,5)", ("variable_decimal",)),
     ("timestamp(3) with time zone", ("timestamptz",)), ("interval day to second", ("interval",)),
     ("_int8", ("long", 1)), ("pg_catalog.text", ("string",)), ("citext", ("string",))],
)  # fmt: skip
def test_type_names(type_name: str, expect: tuple[Any, ...]) -> None:
    ctype = column_type(type_name, 0)
    assert ctype.kind.value == expect[0]
    if ctype.kind.value == "decimal":
        assert (ctype.precision, ctype.scale) == expect[1:]
    if len(expect) == 2 and ctype.kind.value != "decimal":
        assert ctype.dimensions == expect[1]


@pytest.mark.parametrize(
    ("type_name", "value", "message"),
    [
        ("numeric(12,2)", Decimal("1.234"), "more than 2 fraction digits"),
        ("numeric(4,2)", Decimal("123.45"), "more than 4 digits"),
        ("timestamp with time zone", datetime(2024, 1, 1), "naive datetime"),
        ("integer[]", [[1, 2], [3]], "not rectangular"),
        ("integer[]", [[1, 2], 3], "not rectangular"),
        ("integer[]", 5, "expected a list"),
    ],
)
def test_values_that_do_not_fit_name_the_column(type_name: str, value: Any, message: str) -> None:
    codec = RowCodec([PgColumn("v", type_name)])
    with pytest.raises(ValueConversionError, match=f"column 'v': .*{message}"):
        codec.to_avro({"v": value})


def test_timestamptz_keeps_the_instant_not_the_offset() -> None:
    codec = RowCodec([PgColumn("t", "timestamp with time zone", 1184)])
    local = datetime(2024, 3, 31, 3, 30, tzinfo=timezone(timedelta(hours=2)))
    datum = codec.to_avro({"t": local})
    assert datum["t"] == int(local.timestamp()) * 1_000_000
    assert codec.to_json(datum) == {"t": "2024-03-31T01:30:00+00:00"}


def test_table_schemas_same_columns_same_ids_and_evolution() -> None:
    registry = SchemaRegistry(MemorySchemaStore())
    tables = TableSchemas(registry, prefix="shop")
    cols = [PgColumn("id", "bigint", 20, True), PgColumn("amount", "numeric(12,2)", 1700)]
    first = tables.for_table("public", "orders", cols, key_columns=["id"])
    again = TableSchemas(registry, prefix="shop").for_table("public", "orders", list(cols), key_columns=["id"])
    assert (again.key_id, again.value_id) == (first.key_id, first.value_id)
    assert tables.for_table("public", "orders", cols, key_columns=["id"]) is first  # cached, no registry call
    added = tables.for_table("public", "orders", [*cols, PgColumn("note", "text", 25)], key_columns=["id"])
    assert added.value_version == 2 and added.key_id == first.key_id
    datum = added.row_codec.envelope_to_avro(op="c", before=None, after={"id": 1, "amount": Decimal("1.00")},
                                             source=_SOURCE, ts_ms=None)  # fmt: skip
    wire = AvroWire(registry.schema_by_id)
    assert wire.decode(wire.encode(added.value_id, datum))["after"]["note"] is None
    assert json.loads(registry.schema_by_id(added.key_id))["name"] == "shop.public.orders.Key"


_SOURCE = {"version": "v", "connector": "postgresql", "name": "shop", "ts_ms": 0, "snapshot": "false", "db": "d",
           "schema": "public", "table": "orders", "txId": None, "commit_lsn": 1, "lsn": None,
           "event_index": 0}  # fmt: skip


def test_not_null_column_added_is_rejected_naming_it() -> None:
    registry = SchemaRegistry(MemorySchemaStore())
    tables = TableSchemas(registry, prefix="shop")
    cols = [PgColumn("id", "bigint", 20, True)]
    tables.for_table("public", "orders", cols, key_columns=["id"])
    with pytest.raises(IncompatibleSchemaError, match=r"field 'after\.total' added without a default"):
        tables.for_table("public", "orders", [*cols, PgColumn("total", "integer", 23, True)], key_columns=["id"])


def test_column_defaults_become_field_defaults_readers_fill_in() -> None:
    """ADD COLUMN … DEFAULT: data written before the column existed reads as the default."""
    old = table_schemas("p", "s", "t", [PgColumn("id", "integer", 23, True)], ["id"]).value
    tier = PgColumn("tier", "text", 25, default_json=avro_default_json(column_type("text", 25), "gold"))
    price_type = column_type("numeric(5,2)", 1700)
    price = PgColumn("price", "numeric(5,2)", 1700, default_json=avro_default_json(price_type, Decimal("1.50")))
    new = table_schemas("p", "s", "t", [PgColumn("id", "integer", 23, True), tier, price], ["id"]).value
    assert new["fields"][1]["type"] == ["string", "null"] and new["fields"][1]["default"] == "gold"
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parse(old), {"id": 1})
    buf.seek(0)
    read = fastavro.schemaless_reader(buf, parse(old), parse(new))
    # numeric (like bytea) stays null: fastavro would hand its default out as a raw string
    assert read["tier"] == "gold" and read["price"] is None
    assert avro_default_json(column_type("integer[]", 1007), [1, 2]) is None  # not expressible: null
    assert avro_default_json(column_type("integer[]", 1007), []) == '{"dims": [], "items": []}'
