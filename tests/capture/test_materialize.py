"""Materialization acceptance test: the log, compacted, *is* the table.

A random workload (tests/capture/workload.py: every value shape, key changes, deletes,
TRUNCATE, long and short transactions, rollbacks, unchanged TOAST) runs against three
tables; the connector takes a snapshot while the workload is already writing, then
restarts twice to stream the rest. The latest non-tombstone value per key in the log must
equal ``SELECT * FROM table`` exactly — before compaction, and after a compaction that
is allowed to drop tombstones — keys and values byte-for-byte in their JSON form, every
numeric digit and every JSON number's spelling included.

Expected values are what the snapshot path would produce for the table as it is now: the
columns read uncast in text format under capture.pgtypes.SESSION_OPTIONS, converted with
``text_converter`` for the catalog's type name and OID, written with
``capture.pgtypes.dumps``. JSON is compared with numbers kept as their digits.

Both plugins, each with JSON and Avro values (pgoutput: its publications managed by the connector,
the keyless table in the insert/truncate-only one); into Kafka (three brokers) with each plugin.

Size: ``TIDELINE_SOAK=1`` runs ~20x more transactions and rows.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from backends import Backend
from capture_util import capture, drop_slots, fresh_database
from sources import Source
from workload import KEYLESS, TABLES, Workload, soak

from capture.connector import CaptureConfig, ValueFormat
from capture.events import UNAVAILABLE, table_topic
from capture.messages import Plugin
from capture.pgtypes import SESSION_OPTIONS, dumps, text_converter
from capture.tables import TableCatalog, TableFilter, TableInfo
from eventstore.cleaner import compact_partition
from eventstore.kafka import KafkaAdmin
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from eventstore.topic import now_ms
from schemas.pgavro import PgColumn
from schemas.pgvalues import RowCodec
from schemas.registry import SchemaRegistry
from schemas.wire import AvroWire
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

PARTITIONS = 3
SIZES = {  # initial rows per table, transactions while the snapshot runs, then two more rounds
    "ci": (300, 60, 150, 150),
    "soak": (5_000, 1_000, 3_000, 3_000),
}


@pytest.fixture
def db(server: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(server, "materialize")
    yield dsn
    drop_slots(dsn)


def exact_json(raw: bytes | str) -> Any:
    """Parse JSON keeping every number's spelling: fractions as ("num", text), integers as int."""
    return json.loads(raw, parse_float=lambda text: ("num", text))


def tables(dsn: str) -> dict[str, TableInfo]:
    return {t.name: t for t in TableCatalog(dsn, TableFilter()).load() if t.name in TABLES}


def tables_named(dsn: str, name: str) -> TableInfo:
    [table] = [t for t in TableCatalog(dsn, TableFilter()).load() if t.name == name]
    return table


def table_state(dsn: str, table: TableInfo) -> dict[bytes, Any]:
    """key JSON bytes → the row's image in exact JSON form, read as the snapshot reads it."""
    converters = [text_converter(col.type_name, col.type_oid) for col in table.columns]
    columns = ", ".join(f'"{col.name}"' for col in table.columns)
    out: dict[bytes, Any] = {}
    with psycopg.connect(dsn, options=SESSION_OPTIONS) as c:
        res = c.execute(f'SELECT {columns} FROM "{table.schema}"."{table.name}"'.encode()).pgresult
        assert res is not None
        for r in range(res.ntuples):
            row: dict[str, Any] = {}
            for j, col in enumerate(table.columns):
                raw = res.get_value(r, j)
                row[col.name] = None if raw is None else converters[j](raw.decode())
            key = dumps({k: row[k] for k in table.key})
            assert key not in out
            out[key] = exact_json(dumps(row))
    return out


def avro_as_json(log_dir: Path, table: TableInfo, records: list[Any]) -> list[Any]:
    """``(partition, key, value)`` records with Avro keys and values turned into capture's JSON bytes.

    Decoded through the log's schema registry (each value under its own writer schema) and
    ``schemas.pgvalues.RowCodec`` of the table's columns: the JSON capture writes for the
    same row, so the comparisons below hold for both value formats unchanged.
    """
    columns = [PgColumn(c.name, c.type_name, c.type_oid, not_null=c.name in table.key) for c in table.columns]
    by_name = {c.name: c for c in columns}
    rows, keys = RowCodec(columns), RowCodec([by_name[k] for k in table.key])
    with Log(log_dir) as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        wire = AvroWire(registry.schema_by_id, logical_types=False)
        out = []
        for p, key, value in records:
            if key is not None and key[:1] == b"\x00":
                key = dumps(keys.to_json(wire.decode(key)))
            if value is not None:
                assert value[:1] == b"\x00", f"a JSON value in an Avro topic: {value[:100]!r}"
                value = orjson.dumps(rows.envelope_to_json(wire.decode(value)))
            out.append((p, key, value))
    return out


def topic_records(
    where: Path | Backend, topic: str, isolation: str = "read_committed"
) -> list[tuple[int, bytes | None, bytes | None]]:
    """(partition, key, value) of every record, read_committed, partition by partition."""
    return (where if isinstance(where, Backend) else Backend.embedded(where)).records(topic, isolation)


def log_state(
    log_dir: Path | Backend, topic: str, ops: Counter[str] | None = None, avro_table: TableInfo | None = None
) -> dict[bytes, Any]:
    """key → latest ``after`` (exact JSON form); tombstones, deletes and truncates remove the key.

    ``avro_table``: the topic holds Avro (``--value-format avro``) of this table.
    """
    state: dict[bytes, Any] = {}
    records = topic_records(log_dir, topic)
    if avro_table is not None:
        assert isinstance(log_dir, Path)
        records = avro_as_json(log_dir, avro_table, records)
    for _, key, value in records:
        assert key is not None, f"keyless record in {topic}"
        if value is None:
            state.pop(key, None)
            continue
        assert UNAVAILABLE.encode() not in value, f"an unchanged TOAST value was not filled: {value[:300]!r}"
        envelope = exact_json(value)
        if ops is not None:
            ops[envelope["op"]] += 1
        if envelope["op"] == "d":  # the old image the replica identity carries: the key columns at least
            key_columns = exact_json(key)
            before = envelope["before"]
            assert before is not None and {k: before.get(k) for k in key_columns} == key_columns, (topic, envelope)
        if envelope["op"] in ("d", "t"):
            state.pop(key, None)
        else:
            state[key] = envelope["after"]
    return state


def keyless_state(dsn: str, log_dir: Path | Backend, value_format: str) -> tuple[Counter[str], Counter[str]]:
    """The keyless table (insert only) as multisets of rows: in the table, and the ``after`` of its log events."""
    [table] = [t for t in TableCatalog(dsn, TableFilter()).load() if t.name == KEYLESS]
    assert table.keyless
    expected = Counter(json.dumps(row, sort_keys=True) for row in table_state_rows(dsn, table))
    actual: Counter[str] = Counter()
    records = topic_records(log_dir, table_topic(prefix_of(log_dir), "public", KEYLESS))
    if value_format == "avro":
        assert isinstance(log_dir, Path)
        records = avro_as_json(log_dir, table, records)
    for _, key, value in records:
        assert key is None and value is not None, "a keyless topic holds null keys and no tombstones"
        envelope = exact_json(value)
        assert envelope["op"] in ("r", "c"), envelope["op"]
        actual[json.dumps(envelope["after"], sort_keys=True)] += 1
    return expected, actual


def table_state_rows(dsn: str, table: TableInfo) -> list[Any]:
    """Every row of a table in exact JSON form, read as the snapshot reads it (duplicates kept)."""
    converters = [text_converter(col.type_name, col.type_oid) for col in table.columns]
    columns = ", ".join(f'"{col.name}"' for col in table.columns)
    rows = []
    with psycopg.connect(dsn, options=SESSION_OPTIONS) as c:
        res = c.execute(f'SELECT {columns} FROM "{table.schema}"."{table.name}"'.encode()).pgresult
        assert res is not None
        for r in range(res.ntuples):
            row = {}
            for j, col in enumerate(table.columns):
                raw = res.get_value(r, j)
                row[col.name] = None if raw is None else converters[j](raw.decode())
            rows.append(exact_json(dumps(row)))
    return rows


def prefix_of(where: Path | Backend) -> str:
    return where.prefix if isinstance(where, Backend) else "cdc"


def history(where: Path | Backend, topic: str, key: bytes) -> str:
    """What the log holds for one key: (partition, op, commit_lsn, event_index, snapshot) per record
    (on Kafka also read_uncommitted: records of aborted transactions too)."""
    isolations = ["read_committed"] + (["read_uncommitted"] if isinstance(where, Backend) and where.bootstrap else [])
    told = []
    for isolation in isolations:
        out = []
        for p, k, v in topic_records(where, topic, isolation):
            if k == key:
                e = exact_json(v) if v is not None else None
                src = (e or {}).get("source") or {}
                out.append((p, e and e.get("op"), src.get("commit_lsn"), src.get("event_index"), src.get("snapshot")))
        told.append(f"{isolation}: {out}")
    return f"records of {key!r}: " + "; ".join(told)


def assert_log_equals_tables(log_dir: Path | Backend, dsn: str, when: str, value_format: str = "json") -> Counter[str]:
    expected_rows, logged_rows = keyless_state(dsn, log_dir, value_format)
    assert sum(expected_rows.values()) > 0 and expected_rows == logged_rows, (
        f"{when}: keyless {KEYLESS}: rows only in the table {list((expected_rows - logged_rows).items())[:3]}, "
        f"only in the log {list((logged_rows - expected_rows).items())[:3]}"
    )
    ops: Counter[str] = Counter()
    for name, table in tables(dsn).items():
        expected = table_state(dsn, table)
        avro = table if value_format == "avro" else None
        actual = log_state(log_dir, table_topic(prefix_of(log_dir), table.schema, name), ops, avro)
        missing = expected.keys() - actual.keys()
        extra = actual.keys() - expected.keys()
        assert not missing and not extra, (
            f"{when}: {name}: keys in the table but not the log {sorted(missing)[:5]} ({len(missing)}), "
            f"in the log but not the table {sorted(extra)[:5]} ({len(extra)}); "
            + history(log_dir, table_topic(prefix_of(log_dir), table.schema, name), sorted(missing | extra)[0])
        )
        wrong = [k for k in expected if expected[k] != actual[k]]
        if wrong:
            k = wrong[0]
            diff = {
                c: (expected[k][c], actual[k].get(c, "<absent>"))
                for c in expected[k]
                if expected[k][c] != actual[k].get(c)
            }
            raise AssertionError(f"{when}: {name}: {len(wrong)} rows differ; first {k!r}: column → (table, log) {diff}")
    return ops


def compact_table_topics(log_dir: Path, dsn: str) -> dict[str, int]:
    """Roll and compact every table topic twice (tombstones marked, then dropped); stats summed."""
    totals: Counter[str] = Counter()
    with Log(log_dir) as log:
        for name, table in tables(dsn).items():
            topic = table_topic("cdc", table.schema, name)
            log.alter_topic_config(topic, {"delete_retention_ms": "0", "min_compaction_lag_ms": "0"})
            for p in range(log.topic(topic).partitions):
                plog = log.partition(topic, p)
                plog.roll()
                first = compact_partition(plog, now=now_ms())
                second = compact_partition(plog, now=now_ms() + 1)  # past the tombstones' delete horizon
                totals["records_read"] += first.records_read
                totals["records_kept"] += second.records_kept
                totals["tombstones_dropped"] += first.tombstones_dropped + second.tombstones_dropped
    return dict(totals)


# pgoutput on both servers, one value format each (the formats' paths do not depend on the server)
FORMATS_AND_SOURCES = [
    pytest.param("json", "wal2json", 15, id="json-wal2json"),
    pytest.param("avro", "wal2json", 15, id="avro-wal2json"),
    pytest.param("json", "pgoutput", 15, id="json-pgoutput"),
    pytest.param("avro", "pgoutput", 18, id="avro-pgoutput-pg18"),
]


@pytest.mark.parametrize(("value_format", "plugin", "server"), FORMATS_AND_SOURCES, indirect=["server"])
def test_compacted_log_equals_tables(db: str, tmp_path: Path, value_format: str, plugin: str) -> None:
    """Also the Avro round trip: every type of the workload's tables, written as Avro, reads back as the row."""
    fmt = ValueFormat(value_format)
    options: dict[str, Any] = {"partitions": PARTITIONS, "value_format": fmt, "plugin": Plugin(plugin)}
    initial_rows, during_snapshot, round1, round2 = SIZES["soak" if soak() else "ci"]
    log_dir = tmp_path / "log"
    workload = Workload(db, seed=20240331)
    workload.create_schema()
    workload.populate(initial_rows)

    # 1. Snapshot while the workload writes (changes after the slot's consistent point are streamed).
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            workload.run(during_snapshot, stop=stop, pause_s=0.01)
        except BaseException as e:
            errors.append(e)

    writer = threading.Thread(target=write, name="workload")
    writer.start()
    try:
        stats = capture(log_dir, db, **options)
    finally:
        writer.join()
    assert not errors, errors
    assert stats.snapshot_rows > 0

    # 2. Restart: stream what the snapshot run did not reach, then compare.
    capture(log_dir, db, **options)
    assert_log_equals_tables(log_dir, db, "after the snapshot and the first restart", value_format)

    # 3. More workload, restart, compare (uncompacted).
    workload.run(round1)
    capture(log_dir, db, **options)
    workload.run(round2)
    capture(log_dir, db, **options)
    ops = assert_log_equals_tables(log_dir, db, "before compaction", value_format)
    assert {"r", "c", "u", "d", "t"} <= set(ops), ops
    print(f"workload: {workload.stats.summary()}; log events by op: {dict(ops)}")
    kinds = workload.stats.statements
    assert kinds["truncate"] and kinds["update key"] and workload.stats.rolled_back, workload.stats.summary()
    assert kinds["insert keyless"], workload.stats.summary()

    # 4. Compact (tombstones may go), compare again: one record per live key, no tombstones.
    totals = compact_table_topics(log_dir, db)
    assert totals["tombstones_dropped"] > 0 and totals["records_kept"] < totals["records_read"], totals
    assert_log_equals_tables(log_dir, db, "after compaction", value_format)
    for name, table in tables(db).items():
        records = topic_records(log_dir, table_topic("cdc", table.schema, name))
        if fmt is ValueFormat.AVRO:
            records = avro_as_json(log_dir, table, records)
        keys = [k for _, k, _ in records]
        assert all(v is not None for _, _, v in records), f"{name}: a tombstone survived compaction"
        assert len(keys) == len(set(keys)), f"{name}: a key appears twice after compaction"
        live = set(table_state(db, table))
        assert set(keys) - {b"{}"} == live, f"{name}: compacted keys differ from the table's"


# An UPDATE that leaves a TOASTed jsonb alone, filled from the key's latest value in the log
# (the TOAST cache is empty after a restart): JSON fractions, integers beyond 64 bits and
# numbers beyond a double's range must come back digit for digit.


@pytest.mark.parametrize(
    "number",
    [
        pytest.param("1.10", id="fraction"),
        pytest.param("18446744073709551623", id="beyond-64-bit"),
        pytest.param("1e400", id="beyond-double"),
    ],
)
@pytest.mark.parametrize(("value_format", "plugin", "server"), FORMATS_AND_SOURCES, indirect=["server"])
def test_unchanged_toasted_jsonb_filled_from_the_log_is_exact(
    db: str, tmp_path: Path, number: str, value_format: str, plugin: str
) -> None:
    log_dir = tmp_path / "log"
    fmt = ValueFormat(value_format)
    options: dict[str, Any] = {"value_format": fmt, "plugin": Plugin(plugin)}
    sql = [
        "CREATE TABLE docs (id int PRIMARY KEY, meta jsonb, n int)",
        "ALTER TABLE docs ALTER COLUMN meta SET STORAGE EXTERNAL",
    ]
    with psycopg.connect(db, autocommit=True) as c:
        for s in sql:
            c.execute(s.encode())
    capture(log_dir, db, **options)
    doc = f'{{"x": {number}, "pad": "{"ab" * 3000}"}}'  # 6 KB: TOASTed out of line
    with psycopg.connect(db, autocommit=True) as c:
        c.execute(b"INSERT INTO docs VALUES (1, %s::jsonb, 0)", [doc])
    capture(log_dir, db, **options)  # a new run: its TOAST cache is empty, the value comes from the log
    with psycopg.connect(db, autocommit=True) as c:
        c.execute(b"UPDATE docs SET n = 1 WHERE id = 1")  # meta unchanged: wal2json omits it, pgoutput sends 'u'
    capture(log_dir, db, **options)
    table = tables_named(db, "docs")
    avro = table if fmt is ValueFormat.AVRO else None
    assert log_state(log_dir, "cdc.public.docs", avro_table=avro) == table_state(db, table)


@pytest.mark.parametrize(
    "plugin", [Source(Plugin.WAL2JSON), Source(Plugin.PGOUTPUT, 18)], ids=str, indirect=True
)  # pgoutput on 15 into Kafka: tests/capture/test_kafka_capture.py
def test_log_in_kafka_equals_tables(db: str, tmp_path: Path, kafka3: LocalKafka, plugin: Plugin) -> None:
    """The same workload into Kafka (three brokers, replication factor 3, min.insync.replicas 2): after
    the snapshot (taken while the workload writes) and after streaming, the latest value per key of
    each topic read ``read_committed`` equals ``SELECT *``; the keyless table's inserts are all there.
    (Compaction on Kafka is the brokers' log cleaner, on its own schedule: not forced here.)
    A failure's message is also kept in ``failure.txt`` of the test's directory."""
    try:
        kafka_materialization(db, tmp_path, kafka3, plugin)
    except AssertionError as e:
        (tmp_path / "failure.txt").write_text(str(e))
        raise


def kafka_materialization(db: str, tmp_path: Path, kafka3: LocalKafka, plugin: Plugin) -> None:
    initial_rows, during_snapshot, round1, _ = SIZES["soak" if soak() else "ci"]
    kafka = Backend.kafka(kafka3.bootstrap_servers, tmp_path / "state", brokers=3)
    workload = Workload(db, seed=20261124)
    workload.create_schema()
    workload.populate(initial_rows)

    def run() -> None:
        kafka.run(CaptureConfig(dsn=db, slot="t", topic_prefix=kafka.prefix, partitions=PARTITIONS,
                                exit_when_caught_up=True, plugin=plugin))  # fmt: skip

    errors: list[BaseException] = []

    def write() -> None:
        try:
            workload.run(during_snapshot, stop=threading.Event(), pause_s=0.01)
        except BaseException as e:
            errors.append(e)

    writer = threading.Thread(target=write, name="workload")
    writer.start()
    try:
        run()
    finally:
        writer.join()
    assert not errors, errors
    run()
    assert_log_equals_tables(kafka, db, "Kafka: after the snapshot and the first restart")
    workload.run(round1)
    run()
    ops = assert_log_equals_tables(kafka, db, "Kafka: after streaming")
    assert {"r", "c", "u", "d", "t"} <= set(ops), ops
    described = KafkaAdmin(kafka3.bootstrap_servers).describe_json(table_topic(kafka.prefix, "public", TABLES[0]))
    assert described["replication_factor"] == 3 and described["min_insync_replicas"] == 2, described
    assert described["config"]["cleanup_policy"] == "compact", described
