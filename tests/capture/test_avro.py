"""``--value-format avro``: schema versions follow ALTER TABLE, and a refused change stops capture.

The round trip of every type (a random workload, snapshot + stream + compaction) is in
test_materialize.py, parametrized over both value formats; here: schema evolution, and
every type of the mapping table through both value formats and both plugins (pgoutput
tells NaN and ±Infinity from NULL, wal2json cannot).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from capture_util import capture, drop_slots, fresh_database, sql

from capture.avro import SchemaChangeError
from capture.connector import CaptureConfig, Connector, ValueFormat
from capture.messages import Plugin
from capture.pgtypes import SESSION_OPTIONS, dumps, text_converter
from capture.tables import TableCatalog, TableFilter
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from schemas.pgavro import PgColumn
from schemas.pgvalues import RowCodec
from schemas.registry import CompatibilityLevel, SchemaRegistry
from schemas.wire import AvroWire, parse_header
from tideline.pgharness import LocalPostgres

AVRO = ValueFormat.AVRO
TOPIC = "cdc.public.acct"


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "avro")
    yield dsn
    drop_slots(dsn)


def values(log_dir: Path) -> list[tuple[bytes, bytes | None]]:
    with Log(log_dir) as log, Consumer(log, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(TOPIC, 0)])
        consumer.seek_to_beginning()
        out: list[tuple[bytes, bytes | None]] = []
        while batch := consumer.poll(timeout_ms=0):
            out += [(r.key, r.value) for r in batch if r.key is not None]
        return out


def table_rows(dsn: str) -> dict[int, Any]:
    """id → the row as capture's JSON form (read as the snapshot reads it)."""
    [table] = [t for t in TableCatalog(dsn, TableFilter()).load() if t.name == "acct"]
    convs = [text_converter(c.type_name, c.type_oid) for c in table.columns]
    names = ", ".join(f'"{c.name}"' for c in table.columns)
    out: dict[int, Any] = {}
    with psycopg.connect(dsn, options=SESSION_OPTIONS) as c:
        res = c.execute(f"SELECT {names} FROM acct".encode()).pgresult
        assert res is not None
        for r in range(res.ntuples):
            row = {}
            for j, col in enumerate(table.columns):
                raw = res.get_value(r, j)
                row[col.name] = None if raw is None else convs[j](raw.decode())
            out[row["id"]] = orjson.loads(dumps(row))
    return out


def test_versions_follow_add_and_drop_column_and_the_log_still_materializes(
    db: str, tmp_path: Path, plugin: Plugin
) -> None:
    """With pgoutput the changes before and after each ALTER TABLE come with their own Relation message."""
    log_dir = tmp_path / "log"
    sql(
        db,
        "CREATE TABLE acct (id int PRIMARY KEY, owner text, balance numeric(12,2))",
        "INSERT INTO acct VALUES (1, 'ann', 1.50), (2, 'bob', 2.00)",
    )
    capture(log_dir, db, value_format=AVRO, plugin=plugin)  # snapshot: version 1
    sql(db, "INSERT INTO acct VALUES (3, 'cy', 3.00)", "UPDATE acct SET balance = 9.99 WHERE id = 1")
    capture(log_dir, db, value_format=AVRO, plugin=plugin)
    sql(
        db,
        "ALTER TABLE acct ADD COLUMN tier text DEFAULT 'gold'",  # rows 1 and 3 read 'gold' without a change
        "INSERT INTO acct VALUES (4, 'dee', 4.00, 'silver')",
        "UPDATE acct SET owner = 'bo' WHERE id = 2",
    )
    capture(log_dir, db, value_format=AVRO, plugin=plugin)
    sql(db, "ALTER TABLE acct DROP COLUMN balance", "INSERT INTO acct VALUES (5, 'eve', 'bronze')")
    sql(db, "DELETE FROM acct WHERE id = 3")
    capture(log_dir, db, value_format=AVRO, plugin=plugin)

    records = values(log_dir)
    with Log(log_dir) as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        assert registry.versions(f"{TOPIC}-value") == [1, 2, 3]
        latest = registry.latest(f"{TOPIC}-value")
        wire = AvroWire(registry.schema_by_id, logical_types=False)
        expected_fields = {
            1: ["id", "owner", "balance"],
            2: ["id", "owner", "balance", "tier"],
            3: ["id", "owner", "tier"],
        }
        version_of_id = {registry.get_version(f"{TOPIC}-value", v).id: v for v in (1, 2, 3)}
        seen_versions = set()
        for _, value in records:
            if value is None:
                continue
            version = version_of_id[parse_header(value)]  # every event names its own version …
            seen_versions.add(version)
            event = wire.decode(value)  # … and decodes under it
            image = event["after"] or event["before"]
            assert list(image) == expected_fields[version], (version, image)
        assert seen_versions == {1, 2, 3}

        # Materialize under the latest schema (Avro resolution: dropped field ignored, added one defaulted).
        columns = [
            PgColumn("id", "integer", 23, not_null=True),
            PgColumn("owner", "text", 25),
            PgColumn("tier", "text", 25),
        ]
        codec = RowCodec(columns)
        state: dict[int, Any] = {}
        for _, value in records:
            if value is None:
                continue
            event = wire.decode(value, reader_schema=latest.schema)
            after = event["after"]
            row_id = (after or event["before"])["id"]
            if event["op"] == "d":
                state.pop(row_id, None)
            else:
                state[row_id] = orjson.loads(orjson.dumps(codec.to_json(after)))
    assert state == table_rows(db)
    assert state[1]["tier"] == "gold"  # written before the column existed: its default, as Postgres reads it


def test_an_incompatible_change_stops_capture_before_writing_it(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE acct (id int PRIMARY KEY, owner text)", "INSERT INTO acct VALUES (1, 'ann')")
    capture(log_dir, db, value_format=AVRO)
    sql(db, "ALTER TABLE acct ALTER COLUMN owner TYPE integer USING length(owner)")
    sql(db, "INSERT INTO acct VALUES (2, 7)")
    before = values(log_dir)
    with pytest.raises(SchemaChangeError, match=r"public\.acct.*after\.owner.*tideline schemas compatibility"):
        capture(log_dir, db, value_format=AVRO)
    assert values(log_dir) == before  # nothing of the refused change is visible
    with pytest.raises(SchemaChangeError):  # and a restart does not skip it
        capture(log_dir, db, value_format=AVRO)
    with Log(log_dir) as log:  # the operator allows it: capture goes on from where it stopped
        SchemaRegistry(LogSchemaStore(log)).set_compatibility(f"{TOPIC}-value", CompatibilityLevel.NONE)
    capture(log_dir, db, value_format=AVRO)
    after = values(log_dir)
    assert len(after) == len(before) + 1
    with Log(log_dir) as log:
        wire = AvroWire(SchemaRegistry(LogSchemaStore(log)).schema_by_id, logical_types=False)
        assert wire.decode(after[-1][1] or b"")["after"] == {"id": 2, "owner": 7}


def test_a_key_state_rebuilt_from_the_log_reads_each_record_with_the_schema_it_was_written_with(
    db: str, tmp_path: Path, plugin: Plugin
) -> None:
    """``n`` was ``integer`` when its first events were written and is ``numeric`` now: rebuilding the key
    state from the log (what a kill -9 between the log's commit and the key state's leaves to catch up) decodes
    those records as integers, by the schema id each one names, not as today's decimals (it failed on every
    start with ``TypeError: 'int' object is not subscriptable`` before)."""
    log_dir = tmp_path / "log"
    big = "x" * 5000  # TOAST-able: its value is what the key state keeps (and fills unchanged UPDATEs with)
    sql(db, "CREATE TABLE acct (id int PRIMARY KEY, n int, big text)",
        f"INSERT INTO acct VALUES (1, 1, '{big}')")  # fmt: skip
    capture(log_dir, db, value_format=AVRO, plugin=plugin)
    sql(db, "ALTER TABLE acct ALTER COLUMN n TYPE numeric")
    with Log(log_dir) as log:
        SchemaRegistry(LogSchemaStore(log)).set_compatibility(f"{TOPIC}-value", CompatibilityLevel.NONE)
    sql(db, "INSERT INTO acct VALUES (2, 2.5, 'y')")
    capture(log_dir, db, value_format=AVRO, plugin=plugin)
    with Log(log_dir) as log:
        state = Connector(CaptureConfig(dsn=db, slot="t", topic_prefix="cdc"), log).state_path()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{state}{suffix}").unlink(missing_ok=True)
    sql(db, "UPDATE acct SET n = 3 WHERE id = 1")  # leaves ``big`` unchanged: filled from the rebuilt key state
    capture(log_dir, db, value_format=AVRO, plugin=plugin)
    with Log(log_dir) as log:
        wire = AvroWire(SchemaRegistry(LogSchemaStore(log)).schema_by_id, logical_types=False)
        events = [wire.decode(v) for _, v in values(log_dir) if v is not None]
    last = events[-1]["after"]
    assert last["id"] == 1 and last["big"] == big, last
    codec = RowCodec([PgColumn("id", "integer", 23, not_null=True), PgColumn("n", "numeric", 1700),
                      PgColumn("big", "text", 25)])  # fmt: skip
    assert orjson.loads(orjson.dumps(codec.to_json(last)))["n"] == "3"


@pytest.mark.parametrize(
    ("value_format", "plugin"),
    [("avro", "wal2json"), ("avro", "pgoutput"), ("json", "wal2json"), ("json", "pgoutput")],
)
def test_every_mapped_type_round_trips(db: str, tmp_path: Path, value_format: str, plugin: str) -> None:
    """Every type of the mapping table (capture's own every-type table), snapshot and stream paths: the
    stream gives what the snapshot reads, but for wal2json's documented gaps (NaN/±Infinity → null, -0 → 0)."""
    from test_materialize import avro_as_json, exact_json, table_state, topic_records
    from test_wal2json import EVERY_TYPE_DDL, EVERY_TYPE_ROWS, NON_FINITE

    log_dir = tmp_path / "log"
    with psycopg.connect(db, autocommit=True) as c:
        c.execute(EVERY_TYPE_DDL.encode())
        for row in EVERY_TYPE_ROWS[:3]:
            c.execute(row.encode())
        # beyond Avro's 64-bit µs since 1970 (docs/schemas.md): would stop capture, naming the column
        c.execute(b"UPDATE every_type SET ts3 = '294000-12-31 23:59:59.999' WHERE id = 2")
    options: dict[str, Any] = {"value_format": ValueFormat(value_format), "plugin": Plugin(plugin)}
    capture(log_dir, db, **options)  # rows 1-3: the snapshot path
    [table] = [t for t in TableCatalog(db, TableFilter()).load() if t.name == "every_type"]
    others = ", ".join(f'"{c.name}"' for c in table.columns if c.name != "id")
    with psycopg.connect(db, autocommit=True) as c:
        for row in EVERY_TYPE_ROWS[3:]:
            c.execute(row.encode())  # rows 4-6: streamed
        c.execute(f"INSERT INTO every_type SELECT id + 10, {others} FROM every_type WHERE id <= 3".encode())
    capture(log_dir, db, **options)

    records = topic_records(log_dir, "cdc.public.every_type")
    if value_format == "avro":
        records = avro_as_json(log_dir, table, records)
    assert all(v is not None for _, _, v in records)
    actual = {}
    for _, key, value in records:
        assert key is not None and value is not None
        actual[key] = exact_json(value)["after"]
    expected = table_state(db, table)
    assert actual.keys() == expected.keys()
    gaps = plugin == "wal2json"
    for key, row in expected.items():
        row_id = row["id"]
        streamed = row_id > 3
        for column, value in row.items():
            got = actual[key][column]
            if gaps and streamed and ((row_id % 10, column) in NON_FINITE):
                assert got is None, (row_id, column)  # wal2json writes NaN/Infinity of a number as null
                continue
            if gaps and streamed and value == ("num", "-0.0"):
                value = ("num", "0.0")  # wal2json writes -0 of a float as the integer -0 (pgtypes note [8])
            assert got == value, (row_id, column, got, value)
    if not gaps:  # streamed NaN/±Infinity stay what they are, and NULL stays null (row 13: every column NULL)
        streamed_row = {c: actual[b'{"id":12}'][c] for c in ("n", "r", "d")}
        assert streamed_row == {"n": "NaN", "r": "NaN", "d": "-Infinity"}, streamed_row
        assert actual[b'{"id":4}']["n"] == "Infinity" and actual[b'{"id":6}']["n"] == "-Infinity"
        assert {c: actual[b'{"id":13}'][c] for c in ("n", "r", "d")} == {"n": None, "r": None, "d": None}
