"""``tideline log mirror --to-kafka``: the embedded log's topics on a real Kafka, record for record, exactly once.

* Several topics (compacted with tombstones and compaction gaps, headers, keyless
  records, empty values, explicit timestamps, an aborted transaction) read back from
  Kafka ``read_committed`` equal the source's committed records partition by partition,
  in order; a second run copies nothing, a third only what was added since.
* A mirror process killed -9 twice mid-copy, then run again: the result is the same, with
  no record lost or duplicated.
* Bad input (unreachable Kafka, unknown or unmirrorable topic, a Kafka topic with other
  partitions or another cleanup policy, a non-empty Kafka topic the mirror did not
  write): one line on stderr, exit 1, nothing written to Kafka.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import psycopg
import pytest
from readiness import patience
from typer.testing import CliRunner, Result

from eventstore.cleaner import compact_partition
from eventstore.consumer import Consumer, TopicPartition
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.kafka.mirror import LogMirror
from eventstore.kafka.mirror_progress import read_mirror_progress
from eventstore.kafka.mirror_topics import INTERNAL_MAPPINGS, TopicMapping, default_topics
from eventstore.kafka.schema_store import SCHEMAS_TOPIC as KAFKA_SCHEMAS_TOPIC
from eventstore.kafka.schema_store import KafkaSchemaStore, confluent_record
from eventstore.log import Log
from eventstore.offsets import OFFSETS_TOPIC, OffsetAndMetadata, OffsetStore
from eventstore.producer import Producer
from eventstore.schema_store import SCHEMAS_TOPIC, LogSchemaStore
from eventstore.topic import TopicConfig, now_ms
from schemas.compat import CompatibilityLevel
from schemas.position import POSITIONS_TOPIC, SourcePosition, connector_key
from schemas.registry import SchemaRegistry
from tideline.cli import app
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0
Row = tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]], int]  # key, value, headers, timestamp
_names = itertools.count()


def _topic(stem: str) -> str:
    return f"mirror-{stem}-{os.getpid()}-{next(_names)}"


def _mirror(data_dir: Path, bootstrap: str, *args: str) -> Result:
    return CliRunner().invoke(app, ["--data-dir", str(data_dir), "log", "mirror", "--to-kafka", bootstrap, *args])


def _source(log: Log, topic: str) -> dict[int, list[Row]]:
    """Committed records of every partition of ``topic`` in the embedded log, in offset order."""
    out: dict[int, list[Row]] = {}
    with Consumer(log, enable_auto_commit=False) as consumer:
        for p in range(log.topic(topic).partitions):
            tp = TopicPartition(topic, p)
            consumer.assign([tp])
            consumer.seek_to_beginning()
            rows = out.setdefault(p, [])
            while records := consumer.poll(timeout_ms=0):
                rows.extend((r.key, r.value, list(r.headers), r.timestamp) for r in records)
    return out


def _kafka(bootstrap: str, topic: str) -> tuple[dict[int, list[Row]], dict[int, int]]:
    """Committed records of every partition of ``topic`` on Kafka, and the offset after each partition's last."""
    rows: dict[int, list[Row]] = {}
    ends: dict[int, int] = {}
    with KafkaReader(bootstrap) as reader:
        for p in range(KafkaAdmin(bootstrap).topic(topic).partitions):
            records = list(reader.read_to_end(TopicPartition(topic, p)))
            rows[p] = [(r.key, r.value, list(r.headers), r.timestamp) for r in records]
            ends[p] = records[-1].offset + 1 if records else 0
    return rows, ends


def _fill(log: Log, orders: str, clicks: str, base_ms: int) -> None:
    """A compacted topic with headers, tombstones and compaction gaps; a keyless one; an aborted transaction."""
    log.create_topic(orders, 3, TopicConfig().with_overrides({"cleanup_policy": "compact", "segment_bytes": "2048"}))
    log.create_topic(clicks, 2)
    with Producer(log, linger_ms=0) as producer:
        for i in range(300):
            key = f"order-{i % 40}".encode()
            value = None if i % 17 == 0 else f'{{"n": {i}, "pad": "{"x" * 30}"}}'.encode()
            headers = [("trace", f"t{i}".encode()), ("empty", None)] if i % 3 == 0 else None
            producer.send(orders, value, key, headers=headers, timestamp=base_ms + i)
        for i in range(50):
            producer.send(clicks, b"" if i % 10 == 0 else f"click {i}".encode(), None,
                          headers=[("n", str(i).encode())] if i % 2 else None, timestamp=base_ms - i)  # fmt: skip
        producer.flush()
    with Producer(log, transactional_id="aborted-writer") as txn:
        txn.init_transactions()
        txn.begin_transaction()
        txn.send(orders, b"ABORTED", b"order-1")
        txn.send(clicks, b"ABORTED", None)
        txn.flush()
        txn.abort_transaction()
        txn.begin_transaction()
        txn.send(orders, b"committed after the abort", b"order-2", timestamp=base_ms + 1000)
        txn.commit_transaction()
    for p in range(3):
        compact_partition(log.partition(orders, p))


def test_mirror_copies_record_for_record_and_resumes(kafka: LocalKafka, tmp_path: Path) -> None:
    bootstrap = kafka.bootstrap_servers
    data_dir = tmp_path / "log"
    orders, clicks = _topic("orders"), _topic("clicks")
    base_ms = now_ms() - 3_600_000
    with Log(data_dir) as log:
        _fill(log, orders, clicks, base_ms)
        source = {orders: _source(log, orders), clicks: _source(log, clicks)}
        gaps = [log.partition(orders, p).log_end_offset() - len(source[orders][p]) for p in range(3)]
    rows = [row for t in source.values() for part in t.values() for row in part]
    assert any(row[1] is None for row in rows) and any(row[0] is None for row in rows)  # tombstones, keyless
    assert any(row[1] == b"" for row in rows) and any(row[2] for row in rows)  # empty values, headers
    assert sum(gaps) > 6 and not any(row[1] == b"ABORTED" for row in rows)  # compacted away; aborted; markers

    first = _mirror(data_dir, bootstrap, "--topics", f"{orders},{clicks}", "--json")
    assert first.exit_code == 0, first.output
    summary = orjson.loads(first.stdout)
    assert summary["records"] == len(rows) and summary["created_topics"] == [orders, clicks]
    assert summary["tombstones"] == sum(row[1] is None for row in rows)
    for topic, partitions in source.items():
        copied, ends = _kafka(bootstrap, topic)
        assert copied == partitions, topic  # key, value, headers, timestamp; same partition, same order
        progress = read_mirror_progress(bootstrap, str(data_dir.resolve()))
        for p in partitions:
            assert progress[TopicPartition(topic, p)].next_target_offset == ends[p]
    admin = KafkaAdmin(bootstrap)
    assert admin.topic(orders).partitions == 3 and admin.topic(clicks).partitions == 2
    configs = admin.topic_configs(orders)
    assert configs["cleanup.policy"] == "compact" and configs["segment.bytes"] == str(1 << 20)  # Kafka's minimum
    assert configs["delete.retention.ms"] == str(TopicConfig().delete_retention_ms)

    again = _mirror(data_dir, bootstrap, "--topics", f"{orders},{clicks}", "--json")
    assert again.exit_code == 0, again.output
    assert orjson.loads(again.stdout)["records"] == 0
    with Log(data_dir) as log, Producer(log) as producer:
        producer.send_batch(clicks, [b"later 1", b"later 2"], headers=[[("h", b"1")], None], partition=1)
        producer.send(orders, b"later", b"order-3", timestamp=base_ms + 2000)
        producer.flush()
        source = {orders: _source(log, orders), clicks: _source(log, clicks)}
    third = _mirror(data_dir, bootstrap, "--topics", f"{orders},{clicks}")
    assert third.exit_code == 0, third.output
    assert third.stdout.startswith("mirrored 3 records (0 tombstones) of 2 topics from")
    for topic, partitions in source.items():
        assert _kafka(bootstrap, topic)[0] == partitions


def test_default_topics_skip_internal_ones_but_the_positions_and_schemas(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        for name in ("shop.public.orders", POSITIONS_TOPIC, "__schemas", "__other_internal"):
            log.create_topic(name, 1)
        OffsetStore(log).commit("readers", {TopicPartition("shop.public.orders", 0): OffsetAndMetadata(0)})
        assert OFFSETS_TOPIC in log.topics()
        assert default_topics(log) == sorted(["shop.public.orders", POSITIONS_TOPIC, "__schemas"])


def test_positions_reach_kafka_only_after_the_events_they_cover(kafka: LocalKafka, tmp_path: Path) -> None:
    """As the connector's position topic: each record says "events up to here are stored" (written atomically)."""
    bootstrap = kafka.bootstrap_servers
    events, positions = _topic("events"), _topic("positions")
    with Log(tmp_path / "log") as log:
        log.create_topic(events, 2)
        log.create_topic(positions, 1, TopicConfig().with_overrides({"cleanup_policy": "compact"}))
        with Producer(log, transactional_id="capture-like") as capture:
            capture.init_transactions()
            for batch in range(2):
                capture.begin_transaction()
                for i in range(3):
                    capture.send(events, f"{batch}-{i}".encode(), f"key-{i}".encode())
                capture.send(positions, str(3 * (batch + 1)).encode(), b"connector")  # events stored so far
                capture.commit_transaction()
        with LogMirror(
            log,
            bootstrap,
            name=str(tmp_path),
            batch_records=1,
            mappings={positions: TopicMapping(copied_after_others=True)},
        ) as m:
            m.start(m.plan([events, positions]))
            ends = m.end_offsets()
            records = 0
            while not m.caught_up(ends):
                records += m.step()  # one record per step and transaction
                copied = sum(len(part) for part in _kafka(bootstrap, events)[0].values())
                claimed = [int(row[1] or b"0") for row in _kafka(bootstrap, positions)[0][0]]
                assert all(n <= copied for n in claimed), (claimed, copied)  # never ahead of the events
    assert records == 8 and claimed == [3, 6] and copied == 6


def test_the_schema_registry_goes_to_kafkas_registry_topic_in_confluents_layout(
    kafka: LocalKafka, tmp_path: Path
) -> None:
    bootstrap = kafka.bootstrap_servers
    assert INTERNAL_MAPPINGS[SCHEMAS_TOPIC].target == KAFKA_SCHEMAS_TOPIC  # the default; the session's is shared
    target = _topic("schemas")
    with Log(tmp_path / "log") as log:
        embedded = SchemaRegistry(LogSchemaStore(log))
        orders = embedded.register(
            "shop.orders-value", '{"type":"record","name":"O","fields":[{"name":"id","type":"long"}]}'
        )
        embedded.register("shop.users-key", '"string"')
        embedded.set_compatibility("shop.orders-value", CompatibilityLevel.FULL)
        source = _source(log, SCHEMAS_TOPIC)[0]
        mapping = TopicMapping(target=target, convert=confluent_record)
        with LogMirror(log, bootstrap, name=str(tmp_path), mappings={SCHEMAS_TOPIC: mapping}) as mirror:
            mirror.start(mirror.plan([SCHEMAS_TOPIC]))
            assert mirror.step() == len(source) == 3
    copied = _kafka(bootstrap, target)[0][0]
    assert [(key, value) for key, value, _, _ in copied] == [confluent_record(k, v) for k, v, _, _ in source if k]
    with KafkaSchemaStore(bootstrap, topic=target) as store:
        on_kafka = SchemaRegistry(store)
        assert on_kafka.subjects() == ["shop.orders-value", "shop.users-key"]
        assert on_kafka.latest("shop.orders-value").id == orders.id  # framed values keep their schema ids
        assert on_kafka.compatibility("shop.orders-value") is CompatibilityLevel.FULL


def _capture(data_dir: Path, dsn: str, prefix: str, *kafka: str) -> None:
    result = CliRunner().invoke(app, ["--data-dir", str(data_dir), *kafka, "capture", "run", "--dsn", dsn,
                                      "--slot", prefix, "--topic-prefix", prefix, "--tables", "public.t",
                                      "--exit-when-caught-up"])  # fmt: skip
    assert result.exit_code == 0, result.output


def test_capture_moves_to_kafka_without_a_new_snapshot(
    kafka: LocalKafka, postgres: LocalPostgres, tmp_path: Path
) -> None:
    """Capture into the embedded log, mirror, then capture into Kafka: it resumes from the mirrored position."""
    bootstrap = kafka.bootstrap_servers
    prefix = f"move{os.getpid()}n{next(_names)}"
    dsn = postgres.create_database(prefix)
    data_dir = tmp_path / "log"
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        db.execute("INSERT INTO t SELECT i, 0 FROM generate_series(1, 5) i")
        _capture(data_dir, dsn, prefix)  # the snapshot
        db.execute("UPDATE t SET v = 1 WHERE id = 1")
        db.execute("INSERT INTO t VALUES (6, 0)")
        _capture(data_dir, dsn, prefix)  # streaming
        topic = f"{prefix}.public.t"
        moved = _mirror(data_dir, bootstrap, "--topics", f"{topic},{POSITIONS_TOPIC}")
        assert moved.exit_code == 0, moved.output
        db.execute("DELETE FROM t WHERE id = 2")
        db.execute("INSERT INTO t VALUES (7, 0)")
        _capture(data_dir, dsn, prefix, "--kafka", bootstrap)
        db.execute("SELECT pg_drop_replication_slot(%s)", (prefix,))
    changes = [(orjson.loads(key or b"null")["id"], orjson.loads(value)["op"] if value else "tombstone")
               for part in _kafka(bootstrap, topic)[0].values() for key, value, _, _ in part]  # fmt: skip
    assert sorted(change for change in changes if change[1] == "r") == [(i, "r") for i in range(1, 6)]  # one snapshot
    assert sorted(change for change in changes if change[1] != "r") == sorted(
        [(1, "u"), (6, "c"), (2, "d"), (2, "tombstone"), (7, "c")]  # each change once: the mirrored ones, then Kafka's
    )


def _wait_for_progress(bootstrap: str, name: str, above: int, proc: subprocess.Popen[bytes], err: Path) -> int:
    """Poll the committed progress of mirror ``name`` until its source offsets sum above ``above``."""
    deadline = time.monotonic() + patience(TIMEOUT_S)
    while time.monotonic() < deadline:
        done = sum(p.next_source_offset for p in read_mirror_progress(bootstrap, name).values())
        if done > above:
            return done
        assert proc.poll() is None, f"the mirror exited by itself ({proc.returncode}): {err.read_text()}"
        time.sleep(0.05)
    raise AssertionError(f"mirror {name} did not get past {above} source offsets within {patience(TIMEOUT_S):.0f} s")


def test_kill_9_mid_copy_then_restart_loses_and_duplicates_nothing(kafka: LocalKafka, tmp_path: Path) -> None:
    bootstrap = kafka.bootstrap_servers
    data_dir = tmp_path / "log"
    topic = _topic("big")
    total = 24_000
    with Log(data_dir) as log, Producer(log) as producer:
        log.create_topic(topic, 3)
        for start in range(0, total, 1000):
            keys = [f"k{i}".encode() for i in range(start, start + 1000)]
            producer.send_batch(topic, [b"v" + k for k in keys], keys, headers=[[("i", k)] for k in keys])
        source = _source(log, topic)
    name = str(data_dir.resolve())
    argv = [str(Path(sys.executable).parent / "tideline"), "--data-dir", str(data_dir), "log", "mirror",
            "--to-kafka", bootstrap, "--topics", topic, "--batch-records", "150"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = 0
    for _ in range(2):
        err = tmp_path / "mirror.err"
        with err.open("wb") as stderr:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            try:
                done = _wait_for_progress(bootstrap, name, done, proc, err)
            finally:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, err.read_text()
    partial = sum(p.next_source_offset for p in read_mirror_progress(bootstrap, name).values())
    assert 0 < partial < total  # the kills hit a copy under way

    final = _mirror(data_dir, bootstrap, "--topics", topic, "--json")
    assert final.exit_code == 0, final.output
    assert orjson.loads(final.stdout)["records"] == total - partial
    assert _kafka(bootstrap, topic)[0] == source


def _unreachable() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


Case = Callable[[Log, str, str], tuple[list[str], str]]  # (log, bootstrap, good topic) → (mirror's args, error)


def _unknown_topic(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    return ["--topics", f"{good},nosuch"], f"error: no topic 'nosuch' in the embedded log at {log.path}"


def _fewer_partitions(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    name = _topic("narrow")
    log.create_topic(name, 3)
    KafkaAdmin(bootstrap).create_topic(name, 2)
    return ["--topics", f"{good},{name}"], f"error: Kafka topic '{name}' has 2 partitions, the embedded log's has 3"


def _other_policy(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    name = _topic("policy")
    log.create_topic(name, 1, TopicConfig().with_overrides({"cleanup_policy": "compact"}))
    KafkaAdmin(bootstrap).create_topic(name, 1)
    return ["--topics", f"{good},{name}"], f"error: Kafka topic '{name}' has cleanup.policy=delete, the embedded log's"


def _not_empty(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    name = _topic("taken")
    log.create_topic(name, 1)
    KafkaAdmin(bootstrap).create_topic(name, 1)
    produced = CliRunner().invoke(app, ["--kafka", bootstrap, "log", "produce", name], input="k\tsomeone else's\n")
    assert produced.exit_code == 0, produced.output
    return ["--topics", f"{name},{good}"], f"error: Kafka topic '{name}' already has records and mirror"


def _group_offsets(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    OffsetStore(log).commit("readers", {TopicPartition(good, 0): OffsetAndMetadata(1)})
    return ["--topics", f"{good},{OFFSETS_TOPIC}"], f"error: topic '{OFFSETS_TOPIC}' cannot be mirrored"


def _position_on_kafka(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    """This connector already ran on Kafka: its position there is newer than the embedded one."""
    key = connector_key(_topic("prefix"), "slot")
    position = SourcePosition(commit_lsn=1, event_index=0, complete=True, confirm_lsn=1).to_json()
    log.create_topic(POSITIONS_TOPIC, 1, TopicConfig().with_overrides({"cleanup_policy": "compact"}))
    with Producer(log) as producer:
        producer.send_batch(POSITIONS_TOPIC, [position], [key])
    KafkaAdmin(bootstrap).ensure_topic(POSITIONS_TOPIC, 1, TopicConfig().with_overrides({"cleanup_policy": "compact"}))
    KafkaProducer(bootstrap).send_batch(POSITIONS_TOPIC, [position], [key], partition=0)
    return ["--topics", f"{good},{POSITIONS_TOPIC}"], f"error: Kafka topic '{POSITIONS_TOPIC}' already holds key"


def _no_kafka(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    nobody = _unreachable()
    return ["--to-kafka", nobody, "--topics", good], f"error: cannot reach Kafka at {nobody}"


def _bad_batch(log: Log, bootstrap: str, good: str) -> tuple[list[str], str]:
    return ["--topics", good, "--batch-records", "0"], "error: records per transaction must be ≥ 1, got 0"


CASES: dict[str, Case] = {
    "unreachable-kafka": _no_kafka,
    "unknown-topic": _unknown_topic,
    "fewer-partitions-on-kafka": _fewer_partitions,
    "other-cleanup-policy-on-kafka": _other_policy,
    "kafka-topic-written-by-another": _not_empty,
    "consumer-offsets": _group_offsets,
    "connector-position-already-on-kafka": _position_on_kafka,
    "batch-records-0": _bad_batch,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(case: str, kafka: LocalKafka, tmp_path: Path) -> None:
    bootstrap = kafka.bootstrap_servers
    data_dir = tmp_path / "log"
    good = _topic("good")
    with Log(data_dir) as log:
        log.create_topic(good, 1)
        with Producer(log) as producer:
            producer.send_batch(good, [b"a", b"b"], [b"1", b"2"])
        args, error = CASES[case](log, bootstrap, good)
    result = CliRunner().invoke(app, ["--data-dir", str(data_dir), "--kafka", bootstrap, "log", "mirror", *args])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(error) and result.output.count("\n") == 1, result.output
    assert good not in KafkaAdmin(bootstrap).topics()  # everything was checked before anything was created
    assert read_mirror_progress(bootstrap, str(data_dir.resolve())) == {}
