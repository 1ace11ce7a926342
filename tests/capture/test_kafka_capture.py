"""Capture into a real Kafka cluster: the CLI, zombie fencing, a broker killed mid-capture.

The acceptance suites that run on both backends (materialization, kill -9 of the
connector) are test_materialize.py and test_crash.py; these are Kafka's own cases:

- ``tideline --kafka B capture run|status``: topics created with the replication settings
  asked for, the position stored in ``__tideline_capture_offsets`` on Kafka;
- **zombie fencing**: a second connector with the same identity fences the first, which
  stops with "another instance took over"; the second carries on; nothing is duplicated;
- **broker failure**: one of three brokers SIGKILLed while capture streams and restarted
  later: ``read_committed`` readers see every change once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from backends import Backend, assert_each_change_once, insert_rows, stored_equal
from capture_util import drop_slots, fresh_database, sql
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from readiness import wait_until
from schemas_serve_util import serving
from sources import ON_BOTH_SERVERS
from test_avro_interop import by_key, json_form
from test_schema_evolution import ORACLE, TABLE, RandomDdl, compare_events, report, run_tolerant

import capture.snapshot_readers as snapshot_readers
from capture.connector import CaptureConfig, Connector, ValueFormat
from capture.messages import Plugin
from capture.tables import TableFilter
from eventstore.kafka import KafkaAdmin
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.schema_store import FramedDecoder
from schemas.position import POSITIONS_TOPIC
from schemas.registry import CompatibilityLevel, SchemaRegistry
from tideline.backend import choose
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

TIDELINE = str(Path(sys.executable).parent / "tideline")


@pytest.fixture
def db(server: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(server, request.node.name[:16].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


def tideline(kafka: str, data_dir: Path, *args: str) -> list[str]:
    return [TIDELINE, "--data-dir", str(data_dir), "--kafka", kafka, *args]


@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, ids=str, indirect=True)
def test_cli_captures_into_kafka_with_replication_settings(
    db: str, kafka3: LocalKafka, tmp_path: Path, plugin: Plugin
) -> None:
    """Snapshot, then a restart that streams, into Kafka with either plugin (pgoutput on 15 and 18)."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    insert_rows(db, 1, 20)
    backend = Backend.kafka(kafka3.bootstrap_servers, tmp_path / "state", brokers=3)
    argv = tideline(kafka3.bootstrap_servers, tmp_path, "capture", "run", "--dsn", db, "--slot", "cli",
                    "--topic-prefix", backend.prefix, "--partitions", "2", "--replication-factor", "3",
                    "--min-insync-replicas", "2", "--state-dir", str(backend.path), "--exit-when-caught-up",
                    "--plugin", plugin.value, "--json")  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["snapshot_rows"] == 20
    assert assert_each_change_once(backend, db) == 20
    insert_rows(db, 21, 20)  # streamed by the next start: 20 inserts, 19 updates
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["events"] == 39
    assert assert_each_change_once(backend, db) == 40
    admin = KafkaAdmin(kafka3.bootstrap_servers)
    described = admin.describe_json(f"{backend.prefix}.public.t")
    assert (described["partitions"], described["replication_factor"], described["min_insync_replicas"]) == (2, 3, 2)
    assert admin.topic(POSITIONS_TOPIC).config.cleanup_policy.compacts
    assert not (tmp_path / "__tideline_capture_offsets-0").exists(), "the embedded log was written"
    status_argv = ["capture", "status", "--dsn", db, "--slot", "cli", "--topic-prefix", backend.prefix, "--json"]
    status = subprocess.run(
        tideline(kafka3.bootstrap_servers, tmp_path, *status_argv), capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stderr
    stored = json.loads(status.stdout)["stored_position"]
    assert stored is not None and stored["complete"] and stored["snapshot_done"]


def test_bad_kafka_input_is_one_line_and_writes_nothing(db: str, kafka: LocalKafka, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    base = ["capture", "run", "--dsn", db, "--slot", "bad", "--exit-when-caught-up"]
    unreachable = subprocess.run(tideline("127.0.0.1:1", tmp_path, *base), capture_output=True, text=True, timeout=60)
    assert unreachable.returncode != 0 and "cannot reach Kafka at 127.0.0.1:1" in unreachable.stderr
    # a CDC topic someone created with cleanup.policy=delete: refused, naming the topic and the fix
    prefix = f"bad{os.getpid()}"
    KafkaAdmin(kafka.bootstrap_servers).create_topic(f"{prefix}.public.t", 1)
    refused = subprocess.run(tideline(kafka.bootstrap_servers, tmp_path, *base, "--topic-prefix", prefix),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert f"{prefix}.public.t exists with cleanup.policy=delete" in last and "needs compaction" in last, last
    assert Backend.kafka(kafka.bootstrap_servers, tmp_path, brokers=1).partition_records(
        f"{prefix}.public.t", 0, "read_uncommitted"
    ) == []
    no_rf = subprocess.run([TIDELINE, "--data-dir", str(tmp_path), *base, "--replication-factor", "3"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert no_rf.returncode != 0 and "give --kafka" in no_rf.stderr


def committed(bootstrap: str, topic: str) -> int:
    """Records of ``topic`` below its partitions' last stable offsets (0 before it exists): what a
    read_committed reader can see, asked without waiting for open transactions to end."""
    admin = KafkaAdmin(bootstrap)
    if topic not in admin.topics():
        return 0
    return sum(info.last_stable_offset for info in admin.describe(topic)[1])


def test_second_connector_fences_the_first(db: str, kafka: LocalKafka, tmp_path: Path) -> None:
    """Two instances with one identity (slot and prefix): the second's init_transactions fences the first,
    which stops with "another instance took over" at its next write (the heartbeat makes one even when
    the writer has finished before the second started); the second (waiting for the slot the first held)
    carries on; every change once."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    backend = Backend.kafka(kafka.bootstrap_servers, tmp_path / "state")
    argv = tideline(kafka.bootstrap_servers, tmp_path, "capture", "run", "--dsn", db, "--slot", "twin",
                    "--topic-prefix", backend.prefix, "--state-dir", str(backend.path),
                    "--heartbeat-query", "SELECT pg_logical_emit_message(false, 'tideline-heartbeat', 'x')",
                    "--heartbeat-interval", "1")  # fmt: skip
    first_err, second_err = tmp_path / "first.err", tmp_path / "second.err"
    writer = threading.Thread(target=insert_rows, args=(db, 1, 400, 0.01))
    with first_err.open("wb") as e1:
        first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=e1)
    second: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 120
        while "streaming slot twin" not in first_err.read_text():
            assert first.poll() is None and time.monotonic() < deadline, first_err.read_text()[-2000:]
            time.sleep(0.05)
        writer.start()
        wait_until(lambda: committed(kafka.bootstrap_servers, f"{backend.prefix}.public.t") > 0,
                   "the first connector to store some of the workload", alive=first,
                   details=lambda: first_err.read_text()[-2000:])  # fmt: skip
        with second_err.open("wb") as e2:
            second = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=e2)
        assert first.wait(timeout=120) == 1, first_err.read_text()[-2000:]
        writer.join()
        stored_equal(backend, db, second, 240)  # it waits for the slot the first held (--slot-busy-wait 60 s)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()  # SIGTERM by PID: the connector commits and stops
                proc.wait(timeout=60)
    last = first_err.read_text().strip().splitlines()[-1]
    assert "another instance took over" in last, last
    assert assert_each_change_once(backend, db) == 400


def test_broker_killed_during_capture_loses_and_duplicates_nothing(
    db: str, kafka3: LocalKafka, tmp_path: Path
) -> None:
    """kill -9 one of three brokers (replication factor 3, min.insync.replicas 2) while capture streams;
    restart it later. Capture goes on (or reconnects: a broker lost mid-transaction aborts the batch and
    the connector resumes from its stored position); read_committed sees every change once."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    backend = Backend.kafka(kafka3.bootstrap_servers, tmp_path / "state", brokers=3)
    config = CaptureConfig(dsn=db, slot="brokers", topic_prefix=backend.prefix, partitions=3)
    errors: list[BaseException] = []
    with backend.sink() as (_, sink):
        connector = Connector(config, sink=sink)

        def capture() -> None:
            try:
                connector.run()
            except BaseException as e:
                errors.append(e)

        runner = threading.Thread(target=capture)
        runner.start()
        writer = threading.Thread(target=insert_rows, args=(db, 1, 600, 0.01))
        killed: int | None = None
        try:
            deadline = time.monotonic() + 120
            while backend.position(db, "brokers") is None:
                assert not errors and time.monotonic() < deadline, errors
                time.sleep(0.1)
            writer.start()
            # the moment: once capture stored some of the workload, at a random point while it streams
            wait_until(lambda: committed(kafka3.bootstrap_servers, f"{backend.prefix}.public.t") > 0,
                       "capture to store some of the workload", alive=runner)  # fmt: skip
            time.sleep(random.Random(17).uniform(0.0, 1.5))
            killed = KafkaAdmin(kafka3.bootstrap_servers).describe(f"{backend.prefix}.public.t")[1][0].leader
            kafka3.stop_node(killed, kill=True)
            time.sleep(3.0)  # capture goes on with two brokers (min.insync.replicas 2)
            kafka3.start_node(killed)
            killed = None
            writer.join()
            stored_equal(backend, db, runner, 180)
        finally:
            if killed is not None:
                kafka3.start_node(killed)
            if writer.is_alive():
                writer.join()
            connector.stop()
            runner.join(timeout=120)
    assert not errors, errors
    assert assert_each_change_once(backend, db) == 600


def test_key_state_lost_is_rebuilt_from_kafka(db: str, kafka: LocalKafka, tmp_path: Path) -> None:
    """With the local key state deleted between runs, a TRUNCATE still tombstones every live key and an
    UPDATE leaving a TOASTed column alone still carries its value: both rebuilt from the Kafka topics."""
    big = "z" * 100_000
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v int)", "CREATE TABLE docs (id int PRIMARY KEY, body text, n int)",
        "ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")  # fmt: skip
    insert_rows(db, 1, 30)
    with psycopg.connect(db, autocommit=True) as c:
        c.execute("INSERT INTO docs VALUES (1, %s, 0)", (big,))
    backend = Backend.kafka(kafka.bootstrap_servers, tmp_path / "state")
    config = CaptureConfig(dsn=db, slot="lost", topic_prefix=backend.prefix, partitions=2, exit_when_caught_up=True)
    backend.run(config)
    shutil.rmtree(backend.path)
    sql(db, "DELETE FROM t WHERE id = 1", "TRUNCATE t", "UPDATE docs SET n = 1 WHERE id = 1")
    stats = backend.run(config)
    assert stats.key_state_caught_up > 0  # read back from Kafka, not from a local file
    tombstoned = {json.loads(k)["id"] for _, k, v in backend.records(f"{backend.prefix}.public.t") if v is None}
    assert tombstoned == set(range(1, 31))
    docs = [json.loads(v) for _, _, v in backend.records(f"{backend.prefix}.public.docs") if v is not None]
    assert [d["after"]["n"] for d in docs] == [0, 1] and docs[-1]["after"]["body"] == big


def test_avro_capture_into_kafka_reads_with_confluents_deserializer(
    db: str, kafka: LocalKafka, tmp_path: Path
) -> None:
    """``--value-format avro`` into Kafka registers in Kafka's ``_schemas``; a confluent-kafka Consumer with
    ``AvroDeserializer`` and a ``SchemaRegistryClient`` pointed at ``tideline --kafka … schemas serve``
    decodes every record, each key's events equal to a JSON capture of the same WAL."""
    sql(db, "CREATE TABLE t (id bigint PRIMARY KEY, name text, amount numeric(12,2), at timestamptz, tags text[])",
        "INSERT INTO t SELECT g, 'n' || g, g * 1.5, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 hour', "
        "ARRAY['a', 'b' || g] FROM generate_series(1, 20) g")  # fmt: skip
    avro, plain = (Backend.kafka(kafka.bootstrap_servers, tmp_path / name) for name in ("avro", "json"))
    configs = [(avro, "avro", ValueFormat.AVRO), (plain, "json", ValueFormat.JSON)]
    for backend, slot, fmt in configs:
        backend.run(CaptureConfig(dsn=db, slot=slot, topic_prefix=backend.prefix, partitions=2, value_format=fmt,
                                  exit_when_caught_up=True))  # fmt: skip
    sql(db, "UPDATE t SET name = 'renamed' WHERE id <= 5", "DELETE FROM t WHERE id = 6",
        "UPDATE t SET id = 600 WHERE id = 7")  # fmt: skip
    for backend, slot, fmt in configs:
        backend.run(CaptureConfig(dsn=db, slot=slot, topic_prefix=backend.prefix, partitions=2, value_format=fmt,
                                  exit_when_caught_up=True))  # fmt: skip
    topic = f"{avro.prefix}.public.t"
    records = [(k, v) for _, k, v in avro.records(topic)]
    assert records and all(k is not None and k[:1] == b"\x00" for k, _ in records)
    with serving("--kafka", kafka.bootstrap_servers) as served, KafkaSchemaStore(kafka.bootstrap_servers) as store:
        client = SchemaRegistryClient({"url": served.url})
        keys, values = AvroDeserializer(client), AvroDeserializer(client)
        registry = SchemaRegistry(store)
        decoded = []
        for k, v in records:
            assert k is not None
            key = json_form(registry, k, keys(k, SerializationContext(topic, MessageField.KEY)))
            context = SerializationContext(topic, MessageField.VALUE)
            value = None if v is None else json_form(registry, v, values(v, context))
            decoded.append((key, value))
    expected = [(k, v) for _, k, v in plain.records(f"{plain.prefix}.public.t") if k is not None]
    assert by_key(decoded) == by_key(expected)
    # where the value schema's one version started (schemas.starts, on Kafka too): the first event written under it
    [start] = [s for s in choose(tmp_path, kafka.bootstrap_servers).schema_starts().values() if s.topic == topic]
    sources = [json.loads(v)["source"] for _, v in decoded if v is not None]
    first = min((source["commit_lsn"], source["event_index"]) for source in sources)
    assert (start.subject, start.version, start.snapshot) == (f"{topic}-value", 1, True)
    assert (start.commit_lsn, start.event_index) == first


def test_a_parallel_native_snapshot_into_kafka_then_a_truncate(
    db: str, kafka: LocalKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reader processes' natively encoded batches reach Kafka (Arrow chunks through the Kafka sink, appended by the
    snapshot's worker thread) once each, and their keys — a key run in the local key state — are all tombstoned
    by a later TRUNCATE."""
    monkeypatch.setattr(snapshot_readers, "MIN_RANGE_BLOCKS", 8)  # a small table still splits into ranges
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 20000) g", "VACUUM ANALYZE t")  # fmt: skip
    backend = Backend.kafka(kafka.bootstrap_servers, tmp_path / "state")
    config = CaptureConfig(dsn=db, slot="psnap", topic_prefix=backend.prefix, partitions=3, exit_when_caught_up=True,
                           snapshot_workers=2)  # fmt: skip
    assert backend.run(config).snapshot_rows == 20_000
    assert list(backend.path.glob("*.runs/*.keys")), "the snapshot's keys were not written as a key run"
    topic = f"{backend.prefix}.public.t"
    reads = [json.loads(v) for _, _, v in backend.records(topic) if v is not None]
    assert sorted(r["after"]["id"] for r in reads) == list(range(1, 20_001))
    assert sorted(r["source"]["event_index"] for r in reads) == list(range(20_000))
    sql(db, "DELETE FROM t WHERE id <= 100", "TRUNCATE t")
    backend.run(config)
    tombstoned = [json.loads(k)["id"] for _, k, v in backend.records(topic) if v is None]
    assert sorted(tombstoned) == [*range(1, 101), *range(101, 20_001)]  # the deletes' own, then the TRUNCATE's


@pytest.mark.parametrize("value_format", [ValueFormat.JSON, ValueFormat.AVRO], ids=["json", "avro"])
def test_random_ddl_into_kafka_every_event_is_the_row_image_then(
    db: str, kafka: LocalKafka, tmp_path: Path, plugin: Plugin, value_format: ValueFormat
) -> None:
    """test_schema_evolution's random DDL between DML, captured into Kafka: streamed by a connector started before
    it, then a backlog of more caught up by one whose key state was deleted (rebuilt by reading Kafka, each record
    with the schema it was written under): every event equals the oracle's row image at its position. wal2json
    with ``--schema-changes``, as there."""
    rng = random.Random(2000 + (value_format is ValueFormat.AVRO) * 10 + (plugin is Plugin.PGOUTPUT))
    sql(db, *ORACLE, *TABLE)
    sql(db, "INSERT INTO oracle.snapshot_taken SELECT coalesce(max(seq), 0) FROM oracle.audit")
    backend = Backend.kafka(kafka.bootstrap_servers, tmp_path / "state")
    topic = f"{backend.prefix}.public.t"
    if value_format is ValueFormat.AVRO:
        with KafkaSchemaStore(kafka.bootstrap_servers) as store:  # ALTER COLUMN TYPE: refused under BACKWARD
            SchemaRegistry(store).set_compatibility(f"{topic}-value", CompatibilityLevel.NONE)
    config = CaptureConfig(dsn=db, slot="evo", topic_prefix=backend.prefix, plugin=plugin, value_format=value_format,
                           table_filter=TableFilter(include=["public.t"]), exit_when_caught_up=True,
                           schema_changes=plugin is Plugin.WAL2JSON)  # fmt: skip
    backend.run(config)  # the snapshot
    ddl = RandomDdl(rng)
    run_tolerant(db, ddl.transactions(150))
    backend.run(config)  # streamed
    run_tolerant(db, ddl.transactions(150))
    state = sorted(backend.path.glob("*.sqlite"))
    assert state, list(backend.path.iterdir())
    for path in state:  # the key state (and the shapes in it): rebuilt from Kafka by the next start
        for file in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            file.unlink(missing_ok=True)
    backend.run(config)  # the backlog, caught up with the catalog ahead of it
    stored = [v for _, _, v in backend.records(topic) if v is not None]
    if value_format is ValueFormat.AVRO:
        notes: list[str] = []
        with KafkaSchemaStore(kafka.bootstrap_servers) as store:
            decoder = FramedDecoder(SchemaRegistry(store), notes.append)
            texts = [decoder.decode(v)[0] for v in stored]
        assert all(t is not None for t in texts), notes
        events = [json.loads(t, parse_float=Decimal) for t in texts if t is not None]
    else:
        events = [json.loads(v, parse_float=Decimal) for v in stored]
    problems = compare_events(db, events, full=False, value_format=value_format)
    assert not problems, report(problems)
