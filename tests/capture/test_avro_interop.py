"""Kafka's own tools read Tideline's Avro unchanged (issue 15's acceptance test for schemas).

Capture writes a table in Avro (``--value-format avro``) into the embedded log, and the
same WAL in JSON into another log. ``tideline schemas serve`` serves the Avro log's
registry; confluent-kafka's ``AvroDeserializer`` with a ``SchemaRegistryClient`` pointed
at it decodes every key and value, and each equals its JSON form: the whole envelope
equals what ``FramedDecoder`` makes of the same bytes, and ``before``/``after``/``op`` of
each key's events equal the JSON capture's. Then the topic is copied into Kafka (same
keys, values and partitions) and read back by a confluent-kafka ``Consumer`` with the
same deserializers, and by Debian's ``kcat`` (``-L`` lists it, ``-C -e`` reads every byte).

The deserializer hands out fastavro's logical-type objects (Decimal, datetime, UUID …);
:func:`lowered` turns them back into Avro's underlying values (what Tideline decodes
with ``logical_types=False``) so that Tideline's JSON form applies. Values that Python's
datetime cannot hold (±infinity, BC, years after 9999) fail in fastavro's logical-type
reader, so this table keeps to values it can hold (docs/schemas.md, "Departures").
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from capture_util import capture, drop_slots, fresh_database, sql
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from schemas_serve_util import serving

from capture.connector import ValueFormat
from capture.converters import converter_for
from capture.messages import Plugin
from capture.tables import TableColumn, TableFilter, TableInfo
from eventstore.consumer import Consumer as LogConsumer
from eventstore.consumer import TopicPartition
from eventstore.errors import ConfigError
from eventstore.kafka import KafkaAdmin, KafkaProducer
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.log import Log
from eventstore.schema_store import FramedDecoder, LogSchemaStore
from schemas.canonical import parse
from schemas.jsonform import JsonForm
from schemas.registry import SchemaRegistry
from schemas.wire import parse_header
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

PARTITIONS = 3
EPOCH = datetime(1970, 1, 1)
Record = tuple[int, bytes | None, bytes | None]  # partition, key, value


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "interop")
    yield dsn
    drop_slots(dsn)


def topic_records(log_dir: Path, topic: str) -> list[Record]:
    out: list[Record] = []
    with Log(log_dir) as log, LogConsumer(log, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(topic, p) for p in range(log.topic(topic).partitions)])
        consumer.seek_to_beginning()
        while batch := consumer.poll(timeout_ms=0):
            out += [(r.partition, r.key, r.value) for r in batch]
    return sorted(out, key=lambda r: r[0])  # stable: offset order within each partition


# ---------------------------------------------------------------------------- logical types → Avro's own


def lowered(schema: Any, datum: Any, named: dict[str, Any]) -> Any:
    """``datum`` as fastavro decodes it *without* logical types, walking the writer schema (fastavro's parse)."""
    if isinstance(schema, str):
        return lowered(named[schema], datum, named) if schema in named else datum
    if isinstance(schema, list):
        return None if datum is None else lowered(next(b for b in schema if fits(b, datum, named)), datum, named)
    kind, logical = schema["type"], schema.get("logicalType")
    if kind == "record":
        return {f["name"]: lowered(f["type"], datum[f["name"]], named) for f in schema["fields"]}
    if kind == "array":
        return [lowered(schema["items"], item, named) for item in datum]
    if logical == "decimal":
        unscaled = int(datum.scaleb(schema["scale"]))
        return unscaled.to_bytes(unscaled.bit_length() // 8 + 1, "big", signed=True)
    if logical == "date":
        return (datum - EPOCH.date()).days
    if logical == "time-micros":
        return ((datum.hour * 60 + datum.minute) * 60 + datum.second) * 1_000_000 + datum.microsecond
    if logical == "timestamp-micros":
        return (datum - EPOCH.replace(tzinfo=UTC)) // timedelta(microseconds=1)
    if logical == "local-timestamp-micros":
        return (datum - EPOCH) // timedelta(microseconds=1)
    if logical == "uuid":
        return str(datum)
    return datum


def fits(branch: Any, datum: Any, named: dict[str, Any]) -> bool:
    """Is ``datum`` (fastavro's logical-type output) a value of union branch ``branch``?"""
    if isinstance(branch, str) and branch in named:
        branch = named[branch]
    kind = branch if isinstance(branch, str) else branch["type"]
    logical = None if isinstance(branch, str) else branch.get("logicalType")
    if logical is not None:
        expected = {"decimal": Decimal, "date": date, "time-micros": time, "uuid": uuid.UUID,
                    "timestamp-micros": datetime, "local-timestamp-micros": datetime}[logical]  # fmt: skip
        return isinstance(datum, expected) and not (logical == "date" and isinstance(datum, datetime))
    if kind == "enum":
        return isinstance(datum, str) and datum in branch["symbols"]
    python = {"null": type(None), "boolean": bool, "int": int, "long": int, "float": float, "double": float,
              "string": str, "bytes": bytes, "record": dict, "array": list}[kind]  # fmt: skip
    return isinstance(datum, python) and (kind == "boolean") == isinstance(datum, bool)


def json_form(registry: SchemaRegistry, framed: bytes, decoded: Any) -> bytes:
    """Tideline's JSON form of a value the Confluent deserializer decoded, under its writer schema."""
    text = registry.schema_by_id(parse_header(framed))
    parsed = parse(text)
    named = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
    return orjson.dumps(JsonForm(text).convert(lowered(parsed, decoded, named)))


# ---------------------------------------------------------------------------- the test


def test_confluent_clients_and_kcat_read_capture_avro(
    db: str, tmp_path: Path, kafka: LocalKafka, plugin: Plugin
) -> None:
    """(Each plugin: the Avro values are the same whichever decoded the WAL.)"""
    kcat = shutil.which("kcat")
    assert kcat is not None, "kcat is missing: `make system` installs Debian's kcat"
    table = f"interop_{uuid.uuid4().hex[:8]}"
    topic = f"cdc.public.{table}"
    sql(
        db,
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, name text, amount numeric(12,2), exact numeric, "
        "ratio double precision, flag boolean, born date, at timestamptz, local_at timestamp, t time, "
        "doc jsonb, blob bytea, uid uuid, tags text[], grid int[], span interval)",
        f"INSERT INTO {table} SELECT g, 'name ' || g, g * 1.25, 1e30 + g / 7.0, g / 3.0, g % 2 = 0, "
        "date '2024-02-29' + g, timestamptz '2024-03-31 01:30:00.5+02' + g * interval '1 hour', "
        "timestamp '1999-12-31 23:59:59.999999' + g * interval '1 day', time '04:05:06.789' + g * interval '1 min', "
        "jsonb_build_object('g', g, 'big', 123456789012345678901234567890, 'f', 0.1), "
        "decode('00ff' || lpad(g::text, 4, '0'), 'hex'), gen_random_uuid(), ARRAY['a', NULL, 'c ' || g], "
        "ARRAY[[g, NULL], [3, 4]], interval '1 year 2 months 3 days 04:05:06.789' FROM generate_series(1, 12) g",
        f"INSERT INTO {table} (id) VALUES (100)",  # NULL everywhere but the key
    )
    avro_log, json_log = tmp_path / "avro", tmp_path / "json"
    for log_dir, slot, value_format in ((avro_log, "avro", ValueFormat.AVRO), (json_log, "json", ValueFormat.JSON)):
        capture(log_dir, db, slot=slot, value_format=value_format, partitions=PARTITIONS, plugin=plugin)  # snapshot
    sql(
        db,
        f"UPDATE {table} SET name = 'renamed', amount = -0.01, doc = '[1, {{\"x\": null}}]' WHERE id <= 3",
        f"DELETE FROM {table} WHERE id IN (4, 100)",
        f"UPDATE {table} SET id = 1000 WHERE id = 5",  # a key change: delete + tombstone + create
        f"INSERT INTO {table} (id, name, tags) VALUES (200, 'late', '{{}}')",
    )
    for log_dir, slot, value_format in ((avro_log, "avro", ValueFormat.AVRO), (json_log, "json", ValueFormat.JSON)):
        capture(log_dir, db, slot=slot, value_format=value_format, partitions=PARTITIONS, plugin=plugin)  # streaming

    records = topic_records(avro_log, topic)
    assert all(k is not None and k[:1] == b"\x00" for _, k, _ in records)
    assert sum(v is None for _, _, v in records) == 3  # two deletes and the key change's tombstones

    with serving("--data-dir", str(avro_log)) as served, Log(avro_log) as log:
        client = SchemaRegistryClient({"url": served.url})
        keys, values = AvroDeserializer(client), AvroDeserializer(client)
        registry = SchemaRegistry(LogSchemaStore(log))
        framed = FramedDecoder(registry, lambda note: pytest.fail(note))

        def confluent_json(key: bytes | None, value: bytes | None) -> tuple[bytes, bytes | None]:
            """Key and value decoded by Confluent's deserializers, in Tideline's JSON form."""
            assert key is not None
            decoded_key = keys(key, SerializationContext(topic, MessageField.KEY))
            decoded_value = values(value, SerializationContext(topic, MessageField.VALUE))
            key_json = json_form(registry, key, decoded_key)
            value_json = None if value is None else json_form(registry, value, decoded_value)
            return key_json, value_json

        decoded = [confluent_json(k, v) for _, k, v in records]
        # 1. every key and value: equal to what Tideline decodes from the same bytes
        assert decoded == [(framed.decode(k)[0], framed.decode(v)[0] if v is not None else None)
                           for _, k, v in records]  # fmt: skip
        # 2. every key's events: equal to the JSON capture's, before/after/op (source and ts_ms differ)
        assert by_key(decoded) == by_key([(k, v) for _, k, v in topic_records(json_log, topic)])

        # 3. the same bytes in Kafka, same partitions: a confluent-kafka Consumer with the deserializers
        bootstrap = kafka.bootstrap_servers
        KafkaAdmin(bootstrap).create_topic(topic, PARTITIONS)
        with KafkaProducer(bootstrap) as producer:
            for p in range(PARTITIONS):
                part = [(k, v) for q, k, v in records if q == p]
                producer.send_batch(topic, [v for _, v in part], [k for k, _ in part], partition=p)
        from_kafka = consume(bootstrap, topic)
        assert from_kafka == records
        assert [confluent_json(k, v) for _, k, v in from_kafka] == decoded

    # 4. kcat lists the topic and reads every key and value byte for byte
    listed = subprocess.run([kcat, "-b", bootstrap, "-L", "-t", topic], capture_output=True, text=True, timeout=60,
                            check=True).stdout  # fmt: skip
    assert f'topic "{topic}" with {PARTITIONS} partitions' in listed
    raw = subprocess.run([kcat, "-b", bootstrap, "-C", "-t", topic, "-o", "beginning", "-e", "-q",
                          "-f", "%p %K %S:%k%s\n"], capture_output=True, timeout=60, check=True).stdout  # fmt: skip
    assert sorted(kcat_records(raw), key=lambda r: r[0]) == records


def test_the_avro_converter_registers_through_a_registry_in_kafka(kafka: LocalKafka) -> None:
    """What capture into Kafka does: ``converter_for(..., registry=SchemaRegistry(KafkaSchemaStore(…)))``."""
    with pytest.raises(ConfigError, match="needs a schema registry"):
        converter_for(ValueFormat.AVRO, None, "kcdc", TableFilter())
    table = TableInfo.make("public", f"t_{uuid.uuid4().hex[:8]}", (TableColumn("id", "bigint", 20),
                           TableColumn("note", "text", 25)), ("id",), "primary key", "d")  # fmt: skip
    source = orjson.dumps({"version": "tideline-0.1", "connector": "postgresql", "name": "kcdc", "ts_ms": 1,
                           "snapshot": "false", "db": "db", "schema": "public", "table": table.name, "txId": 9,
                           "lsn": 90, "commit_lsn": 100, "event_index": 0})  # fmt: skip
    with KafkaSchemaStore(kafka.bootstrap_servers) as store:
        converter = converter_for(ValueFormat.AVRO, None, "kcdc", TableFilter(), registry=SchemaRegistry(store))
        key = converter.key(table, {"id": 7})
        value = converter.envelope(table, b"c", None, {"id": 7, "note": "x"}, source, None, 1)
    with KafkaSchemaStore(kafka.bootstrap_servers) as store:  # what another process finds in _schemas
        registry = SchemaRegistry(store)
        assert registry.latest(f"kcdc.public.{table.name}-key").id == parse_header(key)
        assert registry.latest(f"kcdc.public.{table.name}-value").id == parse_header(value)
        decoded, _ = FramedDecoder(registry, lambda note: pytest.fail(note)).decode(value)
    assert decoded is not None and orjson.loads(decoded)["after"] == {"id": 7, "note": "x"}


def by_key(events: list[tuple[bytes, bytes | None]]) -> dict[bytes, list[Any]]:
    """key JSON → ``(op, before, after)`` of its change events, in order (tombstones: None).

    ``before`` without its null columns: a delete's old image carries the key columns only
    (REPLICA IDENTITY DEFAULT), which JSON writes as ``{"id": 5}`` and Avro, whose row
    record has every column, as ``{"id": 5, "name": null, …}``.
    """
    out: dict[bytes, list[Any]] = defaultdict(list)
    for key, value in events:
        canonical = orjson.dumps(orjson.loads(key), option=orjson.OPT_SORT_KEYS)
        if value is None:
            out[canonical].append(None)
            continue
        envelope = orjson.loads(value)
        before = envelope["before"] and {k: v for k, v in envelope["before"].items() if v is not None}
        out[canonical].append((envelope["op"], before, envelope["after"]))
    return dict(out)


def consume(bootstrap: str, topic: str) -> list[Record]:
    """Every record of ``topic`` with a plain confluent-kafka Consumer, partition by partition."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"interop-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": True})  # fmt: skip
    out: list[Record] = []
    try:
        for p in range(PARTITIONS):
            consumer.assign([KafkaTopicPartition(topic, p, OFFSET_BEGINNING)])
            while (msg := consumer.poll(30)) is not None:
                if msg.error() is not None:
                    assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                    break
                out.append((p, msg.key(), msg.value()))
            else:
                raise AssertionError(f"no end of {topic}-{p} within 30 s")
    finally:
        consumer.close()
    return out


def kcat_records(raw: bytes) -> Iterator[Record]:
    """Parse kcat's ``%p %K %S:%k%s\\n`` lines: partition, key length, value length (-1: null), then the bytes."""
    at = 0
    while at < len(raw):
        colon = raw.index(b":", at)
        partition, key_size, value_size = map(int, raw[at:colon].split())
        at = colon + 1
        key = raw[at : at + max(key_size, 0)] if key_size >= 0 else None
        at += max(key_size, 0)
        value = raw[at : at + max(value_size, 0)] if value_size >= 0 else None
        at += max(value_size, 0)
        assert raw[at : at + 1] == b"\n"
        at += 1
        yield partition, key, value
