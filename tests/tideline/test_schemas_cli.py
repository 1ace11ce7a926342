"""``tideline schemas …`` and Avro decoding in ``tideline log tail``, through the real CLI app
on real log directories (registry in ``__schemas``, records written with the Producer)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner, Result

from capture.pgtypes import Interval, JsonNumber, NonFiniteFloat
from capture.pgtypes import dumps as capture_dumps
from eventstore.log import Log
from eventstore.producer import Producer
from eventstore.schema_store import SCHEMAS_TOPIC, FramedDecoder, LogSchemaStore
from schemas.compat import CompatibilityLevel
from schemas.jsonform import JsonForm, framed_schema_id
from schemas.pgavro import PgColumn
from schemas.registry import MemorySchemaStore, SchemaRegistry
from schemas.tables import TableSchemas
from schemas.wire import AvroWire
from tideline.cli import app

Run = Callable[..., Result]

SOURCE = {"version": "tideline-0.1", "connector": "postgresql", "name": "shop", "ts_ms": 1, "snapshot": "false",
          "db": "db", "schema": "public", "table": "orders", "txId": 9, "commit_lsn": 100, "lsn": 90,
          "event_index": 0}  # fmt: skip


def record(name: str, *fields: dict[str, Any]) -> str:
    return json.dumps({"type": "record", "name": name, "fields": list(fields)})


V1 = record("Order", {"name": "id", "type": "long"})
V2 = record("Order", {"name": "id", "type": "long"}, {"name": "note", "type": ["null", "string"], "default": None})
ADDS_REQUIRED = record("Order", {"name": "id", "type": "long"}, {"name": "total", "type": "int"})
NARROWS = record("Order", {"name": "id", "type": "int"})
DROPS_ID = record("Order", {"name": "note", "type": ["null", "string"], "default": None})


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "log"
    Log(path).close()  # an empty log directory
    return path


@pytest.fixture
def tl(data_dir: Path) -> Run:
    """Run ``tideline --data-dir <tmp> ARGS…`` in-process."""
    runner = CliRunner()

    def run(*args: str) -> Result:
        return runner.invoke(app, ["--data-dir", str(data_dir), *args])

    return run


@contextmanager
def registry_of(data_dir: Path) -> Iterator[SchemaRegistry]:
    with Log(data_dir) as log:
        yield SchemaRegistry(LogSchemaStore(log))


def exits(result: Result, code: int) -> Result:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def one_line_error(result: Result, code: int, *needles: str) -> str:
    exits(result, code)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def schemas_end_offset(data_dir: Path) -> int:
    with Log(data_dir) as log:
        return log.partition(SCHEMAS_TOPIC, 0).log_end_offset()


# ---------------------------------------------------------------------------- list / show


def test_list_and_show(tl: Run, data_dir: Path) -> None:
    with registry_of(data_dir) as registry:
        registry.register("orders-value", V1)
        registry.register("orders-value", V2)
        registry.register("orders-key", '"long"')
        registry.set_compatibility("orders-key", CompatibilityLevel.FULL)

    assert json.loads(exits(tl("schemas", "list", "--json"), 0).stdout) == [
        {"subject": "orders-key", "latest_version": 1, "id": 3, "versions": [1], "compatibility": "FULL"},
        {"subject": "orders-value", "latest_version": 2, "id": 2, "versions": [1, 2], "compatibility": "BACKWARD"},
    ]
    table = exits(tl("schemas", "list"), 0).stdout
    assert "orders-key" in table and "orders-value" in table and "FULL" in table and "1, 2" in table

    latest = json.loads(exits(tl("schemas", "show", "orders-value", "--json"), 0).stdout)
    assert latest == {"subject": "orders-value", "version": 2, "id": 2, "compatibility": "BACKWARD",
                      "schema": json.loads(V2), "versions": [1, 2], "started": None}  # fmt: skip
    first = json.loads(exits(tl("schemas", "show", "orders-value", "--version", "1", "--json"), 0).stdout)
    assert (first["version"], first["id"], first["schema"]) == (1, 1, json.loads(V1))

    text = exits(tl("schemas", "show", "orders-value", "-v", "1"), 0).stdout
    head, _, body = text.partition("\n")
    assert head == "orders-value version 1 (id 1, compatibility BACKWARD)"
    assert json.loads(body) == json.loads(V1)

    one_line_error(tl("schemas", "show", "customers-value"), 1, "customers-value", "not found")
    one_line_error(tl("schemas", "show", "orders-value", "--version", "3"), 1, "orders-value", "no version 3")


def test_list_of_a_log_without_registry_writes_nothing(tl: Run, data_dir: Path) -> None:
    assert exits(tl("schemas", "list"), 0).stdout.startswith("no subjects")
    assert json.loads(exits(tl("schemas", "list", "--json"), 0).stdout) == []
    with Log(data_dir) as log:
        assert SCHEMAS_TOPIC not in log.topics()  # reading never creates the registry's topic


def test_missing_log_directory(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = str(tmp_path / "nowhere")
    one_line_error(runner.invoke(app, ["--data-dir", missing, "schemas", "list"]), 1, "nowhere")
    schema = tmp_path / "s.avsc"
    schema.write_text(V1)
    one_line_error(runner.invoke(app, ["--data-dir", missing, "schemas", "check", "x", str(schema)]), 2, "nowhere")
    assert not (tmp_path / "nowhere").exists()


# ---------------------------------------------------------------------------- check


@pytest.fixture
def orders_v1(data_dir: Path) -> None:
    with registry_of(data_dir) as registry:
        registry.register("orders-value", V1)


def avsc(tmp_path: Path, text: str | bytes, name: str = "new.avsc") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.usefixtures("orders_v1")
def test_check_compatible_registers_nothing(tl: Run, data_dir: Path, tmp_path: Path) -> None:
    before = schemas_end_offset(data_dir)
    out = exits(tl("schemas", "check", "orders-value", avsc(tmp_path, V2)), 0).stdout
    assert out.strip() == "orders-value: compatible with version 1 (BACKWARD)"
    result = json.loads(exits(tl("schemas", "check", "orders-value", avsc(tmp_path, V2), "--json"), 0).stdout)
    assert result == {"subject": "orders-value", "compatibility": "BACKWARD", "compatible": True,
                      "existing_version": None, "incompatibilities": [], "versions": [1],
                      "checked_versions": [1]}  # fmt: skip
    assert schemas_end_offset(data_dir) == before
    with registry_of(data_dir) as registry:
        assert registry.versions("orders-value") == [1]


@pytest.mark.usefixtures("orders_v1")
def test_check_incompatible_names_field_and_rule(tl: Run, tmp_path: Path) -> None:
    out = exits(tl("schemas", "check", "orders-value", avsc(tmp_path, ADDS_REQUIRED)), 1).stdout.splitlines()
    assert out == [
        "orders-value: NOT compatible with version 1 (BACKWARD):",
        "  - BACKWARD (new schema reads data of version 1): field 'total' added without a default "
        "[rule: reader field without default]",
    ]
    result = json.loads(exits(tl("schemas", "check", "orders-value", avsc(tmp_path, NARROWS), "--json"), 1).stdout)
    assert result["compatible"] is False
    [reason] = result["incompatibilities"]
    assert (reason["path"], reason["rule"]) == ("id", "type mismatch")
    assert "field 'id'" in reason["message"] and "long" in reason["message"]


@pytest.mark.usefixtures("orders_v1")
def test_check_under_the_subjects_level(tl: Run, data_dir: Path, tmp_path: Path) -> None:
    """check follows `compatibility`: NONE accepts anything; FULL_TRANSITIVE checks every version both ways."""
    with registry_of(data_dir) as registry:
        registry.register("orders-value", V2)
    exits(tl("schemas", "compatibility", "orders-value", "NONE"), 0)
    out = exits(tl("schemas", "check", "orders-value", avsc(tmp_path, ADDS_REQUIRED)), 0).stdout
    assert "compatibility NONE" in out

    exits(tl("schemas", "compatibility", "orders-value", "full_transitive"), 0)
    dropped_note = record("Order", {"name": "id", "type": "long"}, {"name": "x", "type": "int", "default": 0})
    result = json.loads(exits(tl("schemas", "check", "orders-value", avsc(tmp_path, dropped_note), "--json"), 0).stdout)
    assert (result["compatibility"], result["checked_versions"]) == ("FULL_TRANSITIVE", [1, 2])
    for schema, expected in [
        (NARROWS, ["BACKWARD (new schema reads data of version 2): field 'id': reader type 'int' cannot read writer "
                   "type 'long' (no promotion long→int)",
                   "BACKWARD (new schema reads data of version 1): field 'id': reader type 'int' cannot read writer "
                   "type 'long' (no promotion long→int)"]),
        (DROPS_ID, ["FORWARD (version 2 reads data of the new schema): field 'id' added without a default",
                    "FORWARD (version 1 reads data of the new schema): field 'id' added without a default"]),
    ]:  # fmt: skip
        result = json.loads(exits(tl("schemas", "check", "orders-value", avsc(tmp_path, schema), "--json"), 1).stdout)
        assert [i["message"] for i in result["incompatibilities"]] == expected


@pytest.mark.usefixtures("orders_v1")
def test_check_already_registered(tl: Run, tmp_path: Path) -> None:
    spaced = json.dumps(json.loads(V1), indent=4)  # same schema, other text
    out = exits(tl("schemas", "check", "orders-value", avsc(tmp_path, spaced)), 0).stdout
    assert out.strip() == "orders-value: already registered as version 1 (compatible)"


def test_check_unknown_subject_is_compatible(tl: Run, data_dir: Path, tmp_path: Path) -> None:
    out = exits(tl("schemas", "check", "customers-value", avsc(tmp_path, ADDS_REQUIRED)), 0).stdout
    assert "no versions yet" in out and "first version is always compatible" in out
    result = json.loads(exits(tl("schemas", "check", "customers-value", avsc(tmp_path, V1), "--json"), 0).stdout)
    assert (result["compatible"], result["versions"], result["checked_versions"]) == (True, [], [])
    with Log(data_dir) as log:
        assert SCHEMAS_TOPIC not in log.topics()


@pytest.mark.usefixtures("orders_v1")
@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ('{"type": "record", "fields": []}', ["invalid Avro schema", "name"]),
        ('{"type": "record", "name": "R", "fields": [{"name": "a", "type": "nope"}]}', ["invalid Avro schema", "nope"]),
        ('{"type": "record",', ["not valid JSON"]),
        ("", ["not valid JSON"]),
        (b"\xff\xfe{}", ["not UTF-8"]),
    ],
    ids=["no-name", "unknown-type", "truncated-json", "empty", "binary"],
)
def test_check_malformed_file_exits_2_naming_it(
    tl: Run, tmp_path: Path, content: str | bytes, needles: list[str]
) -> None:
    path = avsc(tmp_path, content, "broken.avsc")
    for subject in ("orders-value", "customers-value"):  # an unknown subject does not excuse a bad file
        one_line_error(tl("schemas", "check", subject, path), 2, "broken.avsc", *needles)
        one_line_error(tl("schemas", "check", subject, path, "--json"), 2, "broken.avsc", *needles)


def test_check_missing_file_exits_2(tl: Run, tmp_path: Path) -> None:
    one_line_error(tl("schemas", "check", "orders-value", str(tmp_path / "absent.avsc")), 2, "absent.avsc")


# ---------------------------------------------------------------------------- compatibility


@pytest.mark.usefixtures("orders_v1")
def test_compatibility_show_set_reset(tl: Run, data_dir: Path) -> None:
    assert exits(tl("schemas", "compatibility", "orders-value"), 0).stdout.strip() == "orders-value: BACKWARD"
    out = exits(tl("schemas", "compatibility", "orders-value", "forward"), 0).stdout
    assert out.strip() == "orders-value: FORWARD (was BACKWARD)"
    with registry_of(data_dir) as registry:  # persisted in __schemas
        assert registry.compatibility("orders-value") is CompatibilityLevel.FORWARD
    assert json.loads(exits(tl("schemas", "compatibility", "orders-value", "--json"), 0).stdout) == {
        "subject": "orders-value", "compatibility": "FORWARD", "default": "BACKWARD"}  # fmt: skip
    assert "FORWARD" in exits(tl("schemas", "list"), 0).stdout

    out = exits(tl("schemas", "compatibility", "orders-value", "--reset"), 0).stdout
    assert out.strip() == "orders-value: BACKWARD (was FORWARD)"
    with registry_of(data_dir) as registry:
        assert registry.compatibility("orders-value") is CompatibilityLevel.BACKWARD

    one_line_error(tl("schemas", "compatibility", "orders-value", "SIDEWAYS"), 2, "SIDEWAYS", "FULL_TRANSITIVE")
    one_line_error(tl("schemas", "compatibility", "orders-value", "FULL", "--reset"), 2, "--reset")
    with registry_of(data_dir) as registry:
        assert registry.compatibility("orders-value") is CompatibilityLevel.BACKWARD


# ---------------------------------------------------------------------------- log tail decodes Avro

COLUMNS = [
    PgColumn("id", "bigint", 20, not_null=True),
    PgColumn("amount", "numeric(12,2)", 1700),
    PgColumn("ratio", "numeric", 1700),
    PgColumn("f4", "real", 700),
    PgColumn("at", "timestamp with time zone", 1184),
    PgColumn("local", "timestamp without time zone", 1114),
    PgColumn("day", "date", 1082),
    PgColumn("clock", "time without time zone", 1083),
    PgColumn("zoned", "time with time zone", 1266),
    PgColumn("span", "interval", 1186),
    PgColumn("uid", "uuid", 2950),
    PgColumn("doc", "jsonb", 3802),
    PgColumn("raw", "bytea", 17),
    PgColumn("tags", "text[]", 1009),
    PgColumn("grid", "integer[][]", 0),
]
ROWS: list[dict[str, Any]] = [
    {"id": 1, "amount": Decimal("9.50"), "ratio": Decimal("-0.000123"), "f4": 1.1,
     "at": datetime(2024, 3, 31, 1, 30, tzinfo=UTC), "local": datetime(2024, 3, 31, 1, 30, 0, 500000),
     "day": date(2024, 2, 29), "clock": time(4, 5, 6, 789000),
     "zoned": time(4, 5, 6, tzinfo=timezone(timedelta(hours=5, minutes=30))),
     "span": Interval(14, 3, 14_706_789_000), "uid": uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
     "doc": {"a": [1, JsonNumber("1.10"), None], "big": 2**70}, "raw": b"\x00\xff", "tags": ["a", None, "b\tc"],
     "grid": [[1, None], [None, 4]]},
    {"id": 2, "amount": None, "ratio": Decimal("NaN"), "f4": NonFiniteFloat("-inf"), "at": "infinity",
     "local": "0044-03-15 01:02:03.5 BC", "day": "-infinity", "clock": "24:00:00", "zoned": None, "span": None,
     "uid": None, "doc": "just a string", "raw": b"", "tags": [], "grid": []},
]  # fmt: skip
TOPIC = "shop.public.orders"


def write_orders(data_dir: Path) -> tuple[int, int, list[bytes]]:
    """Two change events (Avro key and value), then a JSON record, a framed value with an
    id the registry lacks and one whose payload does not fit its (known) schema."""
    with Log(data_dir) as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        ids = TableSchemas(registry, prefix="shop").for_table("public", "orders", COLUMNS, key_columns=["id"])
        wire = AvroWire(registry.schema_by_id)
        log.create_topic(TOPIC, 1)
        envelopes = []
        with Producer(log) as producer:
            for row in ROWS:
                key = wire.encode(ids.key_id, ids.key_codec.to_avro({"id": row["id"]}))
                value = wire.encode(ids.value_id, ids.row_codec.envelope_to_avro(
                    op="c", before=None, after=row, source=SOURCE, ts_ms=5))  # fmt: skip
                producer.send(TOPIC, value, key=key)
                event = {"before": None, "after": row, "source": SOURCE, "op": "c", "ts_ms": 5, "transaction": None}
                envelopes.append(capture_dumps(event))
            producer.send(TOPIC, b'{"plain": "json"}', key=b"k3")
            producer.send(TOPIC, b"\x00\x00\x00\x00\x63opaque", key=b"k4")  # schema id 99: unknown
            producer.send(TOPIC, b"\x00" + ids.key_id.to_bytes(4, "big"), key=b"k5")  # no payload: truncated
            producer.flush()
        return ids.key_id, ids.value_id, envelopes


def test_tail_shows_avro_records_as_captures_json(tl: Run, data_dir: Path) -> None:
    key_id, _, envelopes = write_orders(data_dir)
    result = exits(tl("log", "tail", TOPIC), 0)
    lines = result.stdout_bytes.split(b"\n")
    assert lines[-1] == b"" and len(lines) == 6
    fields = [line.split(b"\t") for line in lines[:5]]
    assert [f[2] for f in fields[:2]] == [b'{"id":1}', b'{"id":2}']
    # the JSON form is capture's, byte for byte (as text output escapes a tab: "b\tc" → "b\\tc")
    assert [f[3] for f in fields[:2]] == [e.replace(b"\\", b"\\\\") for e in envelopes]
    assert fields[2][2:] == [b"k3", b'{"plain": "json"}']
    assert fields[3][2:] == [b"k4", b"\x00\x00\x00\x00copaque"]  # shown as stored
    assert fields[4][2:] == [b"k5", b"\x00\x00\x00\x00" + bytes([key_id])]
    notes = result.stderr.strip().splitlines()
    assert len(notes) == 2, notes
    assert notes[0].startswith("note: schema id 99 is not in the registry of") and str(data_dir) in notes[0]
    assert notes[1].startswith(f"note: a value framed with schema id {key_id} does not decode")


def test_tail_json_decodes_and_names_the_schema_ids(tl: Run, data_dir: Path) -> None:
    key_id, value_id, envelopes = write_orders(data_dir)
    result = exits(tl("log", "tail", TOPIC, "--json"), 0)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["key"] for r in records] == ['{"id":1}', '{"id":2}', "k3", "k4", "k5"]
    assert [r["value"].encode() for r in records[:2]] == envelopes
    assert [(r.get("key_schema_id"), r.get("value_schema_id")) for r in records] == [
        (key_id, value_id), (key_id, value_id), (None, None), (None, None), (None, None)]  # fmt: skip
    assert records[2]["value"] == '{"plain": "json"}'
    assert records[3]["value"] == "\x00\x00\x00\x00copaque"
    assert len(result.stderr.strip().splitlines()) == 2


def test_tail_as_group_member_decodes_too(tl: Run, data_dir: Path) -> None:
    _, value_id, envelopes = write_orders(data_dir)
    out = exits(tl("log", "tail", TOPIC, "--json", "-g", "g1"), 0).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [r.get("value_schema_id") for r in records] == [value_id, value_id, None, None, None]
    assert records[0]["value"].encode() == envelopes[0]


def test_tail_of_plain_records_does_not_touch_the_registry(tl: Run, data_dir: Path) -> None:
    with Log(data_dir) as log:
        log.create_topic("t", 1)
        with Producer(log) as producer:
            producer.send("t", b'{"a": 1}', key=b"k").result()
            producer.send("t", b"\x01\x00binary", key=b"\x00").result()  # a key of one 0 byte: too short to be framed
    records = [json.loads(line) for line in exits(tl("log", "tail", "t", "--json"), 0).stdout.splitlines()]
    assert [(r["key"], r["value"]) for r in records] == [("k", '{"a": 1}'), ("\x00", "\x01\x00binary")]
    assert all("value_schema_id" not in r and "key_schema_id" not in r for r in records)
    with Log(data_dir) as log:
        assert SCHEMAS_TOPIC not in log.topics()


# ---------------------------------------------------------------------------- the JSON form of any schema


def test_json_form_of_a_generic_schema() -> None:
    """Schemas not from a captured table: logical types as text, bytes/fixed base64, unions by value."""
    schema = json.dumps({"type": "record", "name": "Node", "namespace": "t", "fields": [
        {"name": "amount", "type": {"type": "fixed", "name": "D", "size": 4, "logicalType": "decimal",
                                    "precision": 8, "scale": 3}},
        {"name": "when", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "blob", "type": "bytes"},
        {"name": "tag", "type": {"type": "enum", "name": "Tag", "symbols": ["A", "B"]}},
        {"name": "either", "type": ["null", "boolean", "long", "string", "D"]},
        {"name": "json", "type": {"type": "string", "connect.name": "io.debezium.data.Json"}},
        {"name": "scores", "type": {"type": "map", "values": "float"}},
        {"name": "children", "type": {"type": "array", "items": "Node"}},
    ]})  # fmt: skip
    registry = SchemaRegistry(MemorySchemaStore())
    schema_id = registry.register("nodes-value", schema).id
    wire = AvroWire(registry.schema_by_id)
    leaf = {"amount": Decimal("1.500"), "when": datetime(2024, 1, 2, 3, 4, 5, 6000, tzinfo=UTC),
            "day": date(2024, 1, 2), "blob": b"\x01\x02", "tag": "B", "either": False, "json": "[1.10]",
            "scores": {"x": 0.1}, "children": []}  # fmt: skip
    value = wire.encode(schema_id, {**leaf, "either": 7, "children": [leaf]})
    datum = AvroWire(registry.schema_by_id, logical_types=False).decode(value)
    shown = orjson.loads(orjson.dumps(JsonForm(registry.schema_by_id(schema_id)).convert(datum)))
    leaf_json = {"amount": "1.500", "when": "2024-01-02T03:04:05.006000+00:00", "day": "2024-01-02",
                 "blob": "AQI=", "tag": "B", "either": False, "json": [1.10], "scores": {"x": 0.1},
                 "children": []}  # fmt: skip
    assert shown == {**leaf_json, "either": 7, "children": [leaf_json]}
    assert b'"json":[1.10]' in orjson.dumps(JsonForm(registry.schema_by_id(schema_id)).convert(datum))


def test_framed_schema_id() -> None:
    assert framed_schema_id(b"\x00\x00\x00\x01\x00" + b"payload") == 256
    assert framed_schema_id(b"\x00\x00\x00\x01") is None  # shorter than the header
    assert framed_schema_id(b'{"a":1}') is None
    assert framed_schema_id(None) is None


def test_decoder_sees_a_schema_registered_after_it_started(data_dir: Path) -> None:
    """tail --follow: an id unknown at first is looked up again after forget_missing()."""
    notes: list[str] = []
    with Log(data_dir) as log:
        decoder = FramedDecoder(log, notes.append)
        assert decoder.decode(b"\x00\x00\x00\x00\x01\x0e") == (b"\x00\x00\x00\x00\x01\x0e", None)
        with registry_of(data_dir) as other:  # another process's registry over the same directory
            assert other.register("n-value", '"long"').id == 1
        assert decoder.decode(b"\x00\x00\x00\x00\x01\x0e")[1] is None  # still remembered as missing
        decoder.forget_missing()
        assert decoder.decode(b"\x00\x00\x00\x00\x01\x0e") == (b"7", 1)
    assert len(notes) == 1 and "schema id 1" in notes[0]
