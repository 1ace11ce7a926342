"""``tideline --kafka … log …`` end to end through the real CLI app on a real Apache Kafka broker."""

from __future__ import annotations

import base64
import itertools
import json
import os
import socket
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from eventstore.kafka import KafkaAdmin, KafkaProducer
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.partitioner import partition_for_key
from eventstore.topic import CleanupPolicy, TopicConfig
from schemas.registry import SchemaRegistry
from schemas.wire import AvroWire
from tideline.cli import app
from tideline.config import KAFKA_BOOTSTRAP_ENV
from tideline.kafkaharness import LocalKafka

Run = Callable[..., Result]
_names = itertools.count()


def _topic(stem: str) -> str:
    return f"cli-{stem}-{os.getpid()}-{next(_names)}"


@pytest.fixture
def tk(kafka: LocalKafka) -> Run:
    """Run ``tideline --kafka <session broker> ARGS…`` in-process; ``input`` feeds stdin."""
    runner = CliRunner()
    bootstrap = kafka.bootstrap_servers

    def run(*args: str, input: bytes | str | None = None) -> Result:
        return runner.invoke(app, ["--kafka", bootstrap, *args], input=input)

    return run


def _ok(result: Result) -> Result:
    assert result.exit_code == 0, result.output
    return result


def _json_lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_create_produce_describe_and_tail_a_topic_on_kafka(tk: Run, kafka: LocalKafka) -> None:
    topic = _topic("orders")
    created = _ok(tk("log", "create", topic, "-p", "3", "--compact", "--config", "min.compaction.lag.ms=1000"))
    assert f"created topic {topic} with 3 partitions (compact) on Kafka" in created.output
    assert KafkaAdmin(kafka.bootstrap_servers).topic_configs(topic)["min.compaction.lag.ms"] == "1000"

    lines = "".join(f"order-{i}\t{{\"n\": {i}}}\n" for i in range(20)) + "order-3\t\\N\n"
    produced = _ok(tk("log", "produce", topic, input=lines))
    assert "produced 21 records" in produced.output and "1 tombstones" in produced.output

    listed = json.loads(_ok(tk("log", "topics", "--json")).output)
    assert {"topic": topic, "partitions": 3, "cleanup_policy": "compact"} in listed
    described = json.loads(_ok(tk("log", "describe", topic, "--json")).output)
    assert sum(p["log_end_offset"] for p in described["partition_info"]) == 21
    assert "leader" in _ok(tk("log", "describe", topic)).output

    records = _json_lines(_ok(tk("log", "tail", topic, "--json")).output)
    assert len(records) == 21
    for record in records:
        assert record["partition"] == partition_for_key(record["key"].encode(), 3)  # murmur2, as embedded
    order_3 = [r["value"] for r in records if r["key"] == "order-3"]
    assert order_3 == ['{"n": 3}', None]
    one_partition = _json_lines(_ok(tk("log", "tail", topic, "--json", "--partition", "1", "--offset", "1")).output)
    assert [r["offset"] for r in one_partition] == sorted(r["offset"] for r in records if r["partition"] == 1)[1:]


def test_tail_group_commits_what_it_printed_and_groups_shows_the_lag(tk: Run) -> None:
    topic = _topic("events")
    group = _topic("group")
    _ok(tk("log", "create", topic, "--partitions", "2"))
    _ok(tk("log", "produce", topic, input="".join(f"k{i}\tv{i}\n" for i in range(10))))

    first = _json_lines(_ok(tk("log", "tail", topic, "--group", group, "--json")).output)
    assert sorted(r["value"] for r in first) == sorted(f"v{i}" for i in range(10))
    again = _json_lines(_ok(tk("log", "tail", topic, "--group", group, "--json")).output)
    assert again == []  # the group committed what it printed

    _ok(tk("log", "produce", topic, input="k0\tlater\n"))
    infos = json.loads(_ok(tk("log", "groups", "--json")).output)
    (info,) = [i for i in infos if i["group"] == group]
    rows = {r["partition"]: r for r in info["partitions"] if r["topic"] == topic}
    assert sum(r["committed_offset"] for r in rows.values()) == 10
    assert sum(r["lag"] for r in rows.values()) == 1
    assert group in _ok(tk("log", "groups")).output


def test_tail_decodes_avro_through_the_kafka_registry(tk: Run, kafka: LocalKafka) -> None:
    """Framed Avro on Kafka shows as its JSON form, with the schema id, as on the embedded log: ``log tail`` takes
    the registry from the backend (the ``_schemas`` topic here)."""
    topic = _topic("avro")
    schema = {"type": "record", "name": "Account", "namespace": "bank",
              "fields": [{"name": "id", "type": "string"}, {"name": "cents", "type": "long"}]}  # fmt: skip
    with KafkaSchemaStore(kafka.bootstrap_servers) as store:
        schema_id = SchemaRegistry(store).register(f"{topic}-value", schema).id
        wire = AvroWire(SchemaRegistry(store).schema_by_id)
        framed = [wire.encode(schema_id, {"id": f"a{i}", "cents": 100 * i}) for i in range(3)]
    _ok(tk("log", "create", topic))
    unknown = b"\x00" + (schema_id + 1000).to_bytes(4, "big") + b"opaque"
    with KafkaProducer(kafka.bootstrap_servers) as producer:
        producer.send_batch(topic, [*framed, b'{"plain": 1}', unknown], [b"a0", b"a1", b"a2", b"p", b"u"])
    result = _ok(tk("log", "tail", topic, "--json"))
    records = _json_lines(result.stdout)
    assert [json.loads(r["value"]) for r in records[:3]] == [{"id": f"a{i}", "cents": 100 * i} for i in range(3)]
    assert [r.get("value_schema_id") for r in records] == [schema_id] * 3 + [None, None]
    assert records[3]["value"] == '{"plain": 1}'
    assert base64.b64decode(records[4]["value"]["base64"]) == unknown  # shown as stored (not UTF-8), with a note
    assert f"schema id {schema_id + 1000} is not in the registry of _schemas on Kafka" in result.stderr


def test_kafka_bad_input_is_a_one_line_error(tk: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = _topic("missing")
    for args in (("log", "describe", missing), ("log", "tail", missing), ("log", "produce", missing)):
        result = tk(*args, input="k\tv\n")
        assert result.exit_code == 1, result.output
        assert result.output.strip() == f"error: unknown topic '{missing}'"
    refused = tk("log", "create", _topic("rf"), "--replication-factor", "3")  # one broker
    assert refused.exit_code == 1 and refused.output.count("\n") == 1 and "replication" in refused.output
    for args in (("log", "compact", missing), ("log", "cleaner", "--once")):  # the brokers clean their own log
        result = tk(*args)
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
        assert "Kafka at" in result.output and "nothing to run here" in result.output

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv(KAFKA_BOOTSTRAP_ENV, nobody)  # the environment variable works like --kafka
    result = CliRunner().invoke(app, ["log", "topics"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith(f"error: cannot reach Kafka at {nobody}")
    assert "Connection refused" in result.output
    malformed = CliRunner().invoke(app, ["--kafka", "127.0.0.1", "log", "topics"])
    assert malformed.exit_code == 1
    assert malformed.output == "error: Kafka bootstrap server '127.0.0.1' is not HOST:PORT\n"


def _nobody() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


# (args with {existing} / {new} / {nobody} filled in, stdin, the error line's start). The existing topic
# is compacted, has 2 partitions and 3 records; {new} does not exist; {nobody} is a closed port.
BAD_INPUT = {
    "unreachable-create": (("--kafka", "{nobody}", "log", "create", "{new}"), "", "error: cannot reach Kafka at"),
    "unreachable-describe": (("--kafka", "{nobody}", "log", "describe", "{existing}"), "", "error: cannot reach Kafka"),
    "unreachable-produce": (("--kafka", "{nobody}", "log", "produce", "{existing}"), "k\tv\n", "error: cannot reach"),
    "unreachable-tail": (("--kafka", "{nobody}", "log", "tail", "{existing}"), "", "error: cannot reach Kafka at"),
    "unreachable-groups": (("--kafka", "{nobody}", "log", "groups"), "", "error: cannot reach Kafka at"),
    "create-existing-with-other-settings": (("log", "create", "{existing}", "-p", "3"), "", "error: topic '{existing}' "
                                            "already exists"),
    "min-insync-above-replication": (("log", "create", "{new}", "--min-insync-replicas", "2"), "",
                                     "error: min.insync.replicas 2 exceeds replication factor 1 (the brokers'"),
    "bad-setting-value": (("log", "create", "{new}", "--config", "retention_ms=soon"), "",
                          "error: topic setting retention_ms must be an integer, got 'soon'"),
    "compact-contradicts-policy": (("log", "create", "{new}", "--compact", "--config", "cleanup.policy=delete"), "",
                                   "error: --compact contradicts --config cleanup.policy=delete"),
    "keyless-record-for-compacted-topic": (("log", "produce", "{existing}"), "no key\n",
                                           "error: line 1 has no key but topic '{existing}' is compacted"),
    "produce-to-missing-partition": (("log", "produce", "{existing}", "--partition", "2"), "k\tv\n",
                                     "error: topic '{existing}' has no partition 2 (it has 2)"),
    "tail-missing-partition": (("log", "tail", "{existing}", "--partition", "5"), "",
                               "error: topic '{existing}' has no partition 5 (it has 2)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_1_and_writes_nothing(case: str, kafka: LocalKafka) -> None:
    bootstrap = kafka.bootstrap_servers
    existing, new = _topic("existing"), _topic("new")
    admin = KafkaAdmin(bootstrap)
    admin.create_topic(existing, 2, TopicConfig(cleanup_policy=CleanupPolicy.COMPACT))
    KafkaProducer(bootstrap).send_batch(existing, [b"1", None, b"3"], [b"a", b"b", b"c"])
    before = admin.describe_json(existing)
    args, stdin, error = BAD_INPUT[case]
    names = {"existing": existing, "new": new, "nobody": _nobody()}
    argv = [a.format(**names) for a in args]
    result = CliRunner().invoke(app, argv if argv[0] == "--kafka" else ["--kafka", bootstrap, *argv], input=stdin)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(error.format(**names)) and result.output.count("\n") == 1, result.output
    assert admin.describe_json(existing) == before  # same partitions, settings and offsets
    assert new not in admin.topics()
