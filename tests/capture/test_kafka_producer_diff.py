"""The Kafka sink's two producers store byte-identical records (differential test).

The native producer (``capture.native.kafka``: librdkafka driven from the Rust core, records as Arrow
buffers) against confluent-kafka's per-record path (``--kafka-producer python``, the oracle): the same
WAL captured by two connectors, each into its own fresh single-broker Kafka (so the schema registry of
each hands out the same Avro schema ids), for both plugins and both value formats. Every data topic
holds the same records, partition by partition, in the same order: keys, values and headers byte for
byte (the records' timestamps are the produce times, and the keyless topic's partition is chosen at
random per batch: it is compared as a multiset). The envelopes' ``ts_ms`` (when the connector handled
the change, Debezium's meaning) comes from a clock frozen for both runs. Covered: the native core's
Arrow chunks (streamed), the Python path's lists (the outbox's routed events: records with headers),
inserts, updates, deletes (a ``d`` event and a tombstone), a TRUNCATE, a table without a key, a record
of 300 kB, three partitions.

No snapshot: a snapshot's records carry the LSN at which their connector's slot was created (and the
time), which differ between two slots; its Arrow chunks take the same ``send_arrays`` as the stream's.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from backends import settled
from capture_util import drop_slots, fresh_database, sql
from confluent_kafka import Consumer, KafkaError, TopicPartition
from sources import PLUGINS
from test_outbox import issue_commands

import migrations
from capture.connector import CaptureConfig, Connector, SnapshotMode, ValueFormat
from capture.messages import Plugin
from capture.native.kafka import NATIVE, PYTHON, ProducerMode
from capture.sinks.kafka import KafkaLogSink
from capture.status import core_warnings, read_core_report
from eventstore.kafka import KafkaAdmin
from eventstore.kafka.config import client_config
from eventstore.topic import now_ms as topic_now_ms
from schemas.position import POSITIONS_TOPIC
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

Record = tuple[bytes | None, bytes | None, tuple[tuple[str, bytes | None], ...]]


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[ProducerMode, LocalKafka]]:
    """A fresh one-broker Kafka per producer: the Avro schema ids of both runs are the same."""
    directory = Path(tempfile.mkdtemp(prefix="tideline-kafka-diff-"))
    started: dict[ProducerMode, LocalKafka] = {}
    try:
        for mode in (ProducerMode.PYTHON, ProducerMode.NATIVE):
            started[mode] = LocalKafka(directory / mode.value, brokers=1)
            started[mode].start()
        yield started
    finally:
        for cluster in started.values():
            cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every capture module's ``now_ms`` (imported by name from eventstore.topic) returns one instant."""
    for name, module in list(sys.modules.items()):
        if (name == "capture" or name.startswith("capture.")) and getattr(module, "now_ms", None) is topic_now_ms:
            monkeypatch.setattr(module, "now_ms", lambda: 1_800_000_000_000)


@pytest.fixture
def db(server: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(server, "kdiff")
    migrations.upgrade(dsn)
    yield dsn
    drop_slots(dsn)


def run(dsn: str, cluster: LocalKafka, mode: ProducerMode, plugin: Plugin, value_format: ValueFormat,
        state: Path, prefix: str) -> None:  # fmt: skip
    config = CaptureConfig(dsn=dsn, slot=f"diff_{mode.value}", topic_prefix=prefix, plugin=plugin,
                           value_format=value_format, partitions=3, outbox_table="public.events",
                           snapshot=SnapshotMode.NEVER, exit_when_caught_up=True, batch_events=200)  # fmt: skip
    sink = KafkaLogSink(cluster.bootstrap_servers, state_dir=state, producer=mode)
    assert sink.producer_choice.path == (NATIVE if mode is ProducerMode.NATIVE else PYTHON)
    connector = Connector(config, sink=sink)
    connector.run()
    report = read_core_report(connector.core_report_path())  # what `capture status` and the console read
    assert (report["kafka_producer"], report["kafka_producer_requested"]) == (sink.producer_choice.path, mode.value)
    assert not [w for w in core_warnings(report) if "Kafka" in w]  # python was asked for: not warned about


def topic_records(bootstrap: str, topic: str) -> dict[int, list[Record]]:
    """partition → its committed records in offset order."""
    partitions = len(KafkaAdmin(bootstrap).describe(topic)[1])
    out: dict[int, list[Record]] = {}
    for partition in range(partitions):
        settled(bootstrap, topic, partition)
        consumer = Consumer(client_config(bootstrap, group_id="diff", enable_auto_commit=False,
                                          isolation_level="read_committed", enable_partition_eof=True,
                                          auto_offset_reset="earliest"))  # fmt: skip
        rows: list[Record] = []
        try:
            consumer.assign([TopicPartition(topic, partition, 0)])
            while True:
                msg = consumer.poll(30)
                assert msg is not None, f"no end of {topic}[{partition}] within 30 s"
                err = msg.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, err
                    break
                rows.append((msg.key(), msg.value(), tuple(msg.headers() or ())))
        finally:
            consumer.close()
        out[partition] = rows
    return out


def everything(bootstrap: str, prefix: str) -> dict[str, Any]:
    topics = sorted(t for t in KafkaAdmin(bootstrap).topics() if not t.startswith("_") and t != POSITIONS_TOPIC)
    out: dict[str, Any] = {}
    for topic in topics:
        records = topic_records(bootstrap, topic)
        if topic.endswith(".keyless"):  # keyless batches go to a random partition: compared as a multiset
            out[topic] = sorted((r for rows in records.values() for r in rows), key=repr)
        else:
            out[topic] = records
    return out


def first_difference(a: Any, b: Any) -> str:
    """Where two topics' records first differ (for the failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for p in sorted(set(a) | set(b)):
            if a.get(p) != b.get(p):
                return f"partition {p}: " + first_difference(a.get(p) or [], b.get(p) or [])
        return "equal"
    if not isinstance(b, list):
        return f"missing: {b!r}"
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"record {i}: {x!r:.600} != {y!r:.600}"
    return f"{len(a)} records != {len(b)}"


@pytest.mark.parametrize("value_format", [ValueFormat.JSON, ValueFormat.AVRO], ids=lambda f: f.value)
@pytest.mark.parametrize("plugin", PLUGINS, ids=str, indirect=True)
def test_the_native_producer_stores_what_the_python_one_stores(
    db: str, clusters: dict[ProducerMode, LocalKafka], tmp_path: Path, plugin: Plugin, value_format: ValueFormat,
    frozen_clock: None,
) -> None:
    prefix = f"d{plugin.value[:3]}{value_format.value}"
    sql(db, "CREATE TABLE items (id int PRIMARY KEY, name text, qty int, note text)",
        "CREATE TABLE keyless (v int, w text)")  # fmt: skip
    for mode, cluster in clusters.items():  # the slots, from which both stream the same WAL
        run(db, cluster, mode, plugin, value_format, tmp_path / mode.value, prefix)
    sql(
        db,
        "INSERT INTO items SELECT g, 'item ' || g, g % 7, NULL FROM generate_series(1, 1500) g",
        "INSERT INTO keyless SELECT g, repeat('w', g % 13) FROM generate_series(1, 300) g",
        "UPDATE items SET qty = qty + 1, note = 'n' WHERE id % 3 = 0",
        "DELETE FROM items WHERE id % 5 = 0",
        "INSERT INTO items SELECT g, NULL, NULL, NULL FROM generate_series(2001, 2400) g",
        "UPDATE items SET note = repeat('x', 300000) WHERE id = 2",
        "INSERT INTO keyless SELECT g, NULL FROM generate_series(1, 200) g",
        "TRUNCATE keyless",
    )
    issue_commands(db, 30, seed=4)
    for mode, cluster in clusters.items():
        run(db, cluster, mode, plugin, value_format, tmp_path / mode.value, prefix)
    python = everything(clusters[ProducerMode.PYTHON].bootstrap_servers, prefix)
    native = everything(clusters[ProducerMode.NATIVE].bootstrap_servers, prefix)
    mine = {t: v for t, v in python.items() if t.startswith(prefix + ".") or t.startswith("events.")}
    assert f"{prefix}.public.items" in mine and any(t.startswith("events.") for t in mine), sorted(python)
    items = mine[f"{prefix}.public.items"]
    assert sum(len(rows) for rows in items.values()) > 3000 and all(items.values())
    assert any(value is None for rows in items.values() for _, value, _ in rows)  # tombstones
    assert any(headers for t, v in mine.items() if t.startswith("events.") for rows in v.values()
               for _, _, headers in rows)  # fmt: skip
    for topic, records in mine.items():
        differs = first_difference(records, native.get(topic))
        assert native.get(topic) == records, f"{topic} differs between the two producers: {differs}"
    with psycopg.connect(db) as c:  # what both stored is the table (the oracle's own correctness is elsewhere)
        assert c.execute("SELECT count(*) FROM items").fetchone() == (1500 - 300 + 400,)
