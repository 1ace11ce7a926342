"""The backend's roles as contracts, one suite run against both backends (tideline.backend): the reader
(projections' LogSource, the live engine's LiveReader), the schema store and the ``log`` commands' operations.
The sink's suite is tests/capture/test_sinks.py. Records are written through the same backend's sink, as capture
writes them.

Kafka: the session's single-broker cluster, each test's topics under a name of its own.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.sinks import Sink, TopicRecords, TopicSpec
from projections.apply import LogRecord
from schemas.errors import SchemaStoreConflictError
from tideline.backend import Backend, EmbeddedBackend, KafkaBackend, choose
from tideline.kafkaharness import LocalKafka

VISIBLE_WITHIN_S = 30.0  # Kafka writes a commit's markers after the commit returns


def noop(names: str, tag: str) -> bytes:
    """A registry record key that carries no state (Confluent's NOOP kind): the session's registry topic is
    shared, and these change nothing any registry reads."""
    return b'{"keytype":"NOOP","magic":0,"test":"%s/%s"}' % (names.encode(), tag.encode())


@pytest.fixture(params=["embedded", "kafka"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "kafka":
        cluster: LocalKafka = request.getfixturevalue("kafka")
        return choose(tmp_path, cluster.bootstrap_servers)
    return choose(tmp_path / "log", None)


@pytest.fixture
def names() -> Iterator[str]:
    yield f"c{uuid.uuid4().hex[:10]}"


class Writer:
    """Transactions through the backend's sink, as capture writes them."""

    def __init__(self, sink: Sink, prefix: str) -> None:
        self.sink, self.positions = sink, f"{prefix}.positions"
        sink.open(f"{prefix}.writer")
        sink.ensure_topic(self.positions, TopicSpec(compact=True, partitions=1))

    def topic(self, name: str, partitions: int = 2) -> str:
        self.sink.ensure_topic(name, TopicSpec(compact=True, partitions=partitions))
        return name

    def write(self, topic: str, records: list[tuple[bytes, bytes | None]], *, commit: bool = True) -> None:
        self.sink.begin()
        self.sink.append({topic: TopicRecords(keys=[k for k, _ in records], values=[v for _, v in records])})
        if commit:
            self.sink.commit(self.positions, b"pos", b'{"lsn": 1}')
        else:
            self.sink.abort()


def until(check: object, what: str) -> None:
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {VISIBLE_WITHIN_S:g} s: {what}")
        time.sleep(0.05)


def read_all(backend: Backend, topic: str) -> list[tuple[bytes | None, bytes | None]]:
    with backend.source() as source:
        out = []
        for partition in range(source.partition_counts([topic]).get(topic, 0)):
            out += [(r.key, r.value) for r in source.records(topic, partition)]
        return sorted(out, key=lambda kv: (kv[0] or b"", kv[1] or b""))


def test_the_backend_is_chosen_by_the_options(tmp_path: Path) -> None:
    assert isinstance(choose(tmp_path, None), EmbeddedBackend)
    kafka = choose(tmp_path, "127.0.0.1:9092")
    assert isinstance(kafka, KafkaBackend) and kafka.description == "Kafka at 127.0.0.1:9092"
    assert choose(tmp_path, "").kind == "embedded"
    embedded = choose(tmp_path, None)
    assert (embedded.topic_settings_apply, embedded.log_cleaner_applies, embedded.spark_needs_kafka_source) == (
        False, True, False)  # fmt: skip
    assert (kafka.topic_settings_apply, kafka.log_cleaner_applies, kafka.spark_needs_kafka_source) == (
        True, False, True)  # fmt: skip


def test_capture_refuses_what_its_backend_cannot_do(tmp_path: Path) -> None:
    """The capabilities decide: Kafka topic settings on the embedded log, the embedded log's cleaner on Kafka."""
    from typer.testing import CliRunner

    from tideline.cli import app

    run = ["capture", "run", "--dsn", "postgresql://nobody@127.0.0.1:1/x"]
    result = CliRunner().invoke(app, ["--data-dir", str(tmp_path / "log"), *run, "--replication-factor", "3"])
    assert result.exit_code == 1 and "are Kafka topic settings: give --kafka" in result.output, result.output
    result = CliRunner().invoke(app, ["--kafka", "127.0.0.1:1", *run, "--log-cleaner"])
    assert result.exit_code == 1 and "--log-cleaner cleans the embedded log" in result.output, result.output
    assert not (tmp_path / "log").exists()  # refused before anything was opened


def test_the_reader_sees_committed_records_only(backend: Backend, names: str) -> None:
    with backend.sink(create=True) as sink:
        w = Writer(sink, names)
        topic = w.topic(f"{names}.t")
        w.write(topic, [(b'"k1"', b'{"v": 1}'), (b'"k2"', b'{"v": 2}')])
        w.write(topic, [(b'"k3"', b'{"v": 3}')], commit=False)  # aborted: never visible
        w.write(topic, [(b'"k1"', None)])  # a tombstone
    until(lambda: len(read_all(backend, topic)) == 3, "three committed records")
    assert read_all(backend, topic) == [(b'"k1"', None), (b'"k1"', b'{"v": 1}'), (b'"k2"', b'{"v": 2}')]
    with backend.source() as source:
        assert source.partition_counts([topic, f"{names}.missing"]) == {topic: 2}  # missing topics absent
        stable, appended = source.stable_offsets([topic]), source.appended_offsets([topic])
        starts = source.start_offsets([topic])
        assert set(stable[topic]) == set(appended[topic]) == set(starts[topic]) == {0, 1}
        assert all(appended[topic][p] >= stable[topic][p] >= starts[topic][p] == 0 for p in (0, 1))
        assert source.record_count([topic]) >= 3  # an upper bound from offsets alone
        assert source.consistent_offsets([topic]) == stable
        for p in (0, 1):
            if stable[topic][p]:
                assert source.appended_at(topic, p, 0) is not None
            assert source.appended_at(topic, p, stable[topic][p] + 10) is None


def test_the_reader_stops_at_an_open_transaction(backend: Backend, names: str) -> None:
    with backend.sink(create=True) as sink:
        w = Writer(sink, names)
        topic = w.topic(f"{names}.t", partitions=1)
        w.write(topic, [(b'"a"', b"1")])
        until(lambda: read_all(backend, topic) == [(b'"a"', b"1")], "the first commit")
        sink.begin()
        sink.append({topic: TopicRecords(keys=[b'"b"'], values=[b"2"])})
        with backend.source() as source:
            before = source.stable_offsets([topic])[topic][0]
            assert [r.value for r in source.records(topic, 0)] == [b"1"]  # the open transaction's record hidden
        sink.commit(w.positions, b"pos", b'{"lsn": 2}')
    until(lambda: read_all(backend, topic) == [(b'"a"', b"1"), (b'"b"', b"2")], "the second commit")
    with backend.source() as source:
        assert source.stable_offsets([topic])[topic][0] > before


def test_the_live_reader_reads_from_positions_and_wakes_for_new_records(backend: Backend, names: str) -> None:
    with backend.sink(create=True) as sink:
        w = Writer(sink, names)
        topic = w.topic(f"{names}.t", partitions=1)
        w.write(topic, [(b'"a"', b"1"), (b'"b"', b"2")])
        until(lambda: len(read_all(backend, topic)) == 2, "two records")
        with backend.source() as source:
            reader = source.live_reader((topic,))
            try:
                reader.assign({topic: {0: 1}})  # from offset 1: the second record on
                got: list[LogRecord] = []
                until(lambda: got.extend(reader.read(100)) or [r.value for r in got] == [b"2"], "the second record")
                w.write(topic, [(b'"c"', b"3")])
                deadline = time.monotonic() + VISIBLE_WITHIN_S
                more: list[LogRecord] = []
                while not more and time.monotonic() < deadline:
                    reader.wait(5.0)
                    reader.refresh()
                    more = reader.read(100)
                assert [r.value for r in more] == [b"3"]
                assert reader.positions()[topic][0] > more[-1].offset
                assert reader.end_offsets()[topic][0] >= reader.positions()[topic][0]
            finally:
                reader.close()


def test_the_schema_store_appends_reads_in_order_and_survives_reopening(backend: Backend, names: str) -> None:
    with backend.sink(create=True):
        pass  # the embedded log exists once a sink made it
    with backend.schema_store() as store:
        _, start = store.read_from(0)
        with store.locked():
            store.append(noop(names, "1"), b"one")
            store.append(noop(names, "2"), b"two")
            store.append(noop(names, "1"), None)  # a tombstone, in order
    with backend.schema_store() as reopened:  # another process's view: what append returned is durable
        records, end = reopened.read_from(start)
        mine = [(k, v) for k, v in records if names.encode() in k]
        assert mine == [(noop(names, "1"), b"one"), (noop(names, "2"), b"two"), (noop(names, "1"), None)]
        assert end > start and reopened.read_from(end)[0] == []


def test_the_schema_store_never_interleaves_two_writers(backend: Backend, names: str) -> None:
    """Two stores on one backend, the second entering while the first holds the store: either it waits for the
    first (a lock: the embedded log's flock) or it fences the first, whose next append is refused with nothing
    written (Kafka's transactional id). Never does the first write after the second."""
    with backend.sink(create=True):
        pass
    a1, a2, b = (noop(names, "a1"), b"1"), (noop(names, "a2"), b"2"), (noop(names, "b"), b"3")
    errors: list[BaseException] = []
    with backend.schema_store() as first, backend.schema_store() as second:

        def enter_second() -> None:
            try:
                with second.locked():
                    second.append(*b)
            except BaseException as e:  # reported below
                errors.append(e)

        with first.locked():
            first.append(*a1)
            thread = threading.Thread(target=enter_second)
            thread.start()
            thread.join(timeout=3.0)  # a fencing backend is done by now (or soon: either outcome is checked)
            try:
                first.append(*a2)
                fenced = False
            except SchemaStoreConflictError:
                fenced = True
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
        records, _ = second.read_from(0)
    mine = [(k, v) for k, v in records if names.encode() in k]
    assert mine == ([a1, b] if fenced else [a1, a2, b]), mine


# ---------------------------------------------------------------------------- the log commands' operations


def test_the_log_operations_agree_on_both_backends(backend: Backend, names: str) -> None:
    """create → produce → topics → describe → tail → groups, with the same results on either backend."""
    import io

    from eventstore.isolation import IsolationLevel
    from tideline.log_cli import TailOptions

    topic = f"{names}.ops"
    created = backend.create_topic(topic, 3, {"cleanup_policy": "compact"})
    assert created.startswith(f"created topic {topic} with 3 partitions (compact)")
    lines = b"".join(b"k%d\tv%d\n" % (i, i) for i in range(12)) + b"k1\t\\N\n" + b"keyless\n"
    with pytest.raises(Exception, match="key"):  # a compacted topic refuses a keyless record, on both
        backend.produce_lines(topic, io.BytesIO(lines))
    summary = backend.produce_lines(topic, io.BytesIO(lines[: lines.index(b"keyless")]))
    assert (summary.records, summary.tombstones, sum(summary.per_partition.values())) == (13, 1, 13)

    assert {"topic": topic, "partitions": 3, "cleanup_policy": "compact"} in backend.list_topics()
    info = backend.describe_topic(topic)
    assert info["topic"] == topic and info["partitions"] == 3
    assert sum(p["log_end_offset"] - p["log_start_offset"] for p in info["partition_info"]) >= 13
    assert [p["partition"] for p in info["partition_info"]] == [0, 1, 2]

    options = TailOptions(False, False, None, None, True, f"{names}.group", IsolationLevel.READ_COMMITTED)
    with backend.tail(topic, options) as polls:
        rows = [r for poll in polls for r in poll]
    records = [(k, v) for r in rows for k, v in zip(r.keys, r.values, strict=True)]
    assert len(records) == 13 and (b"k1", None) in records and (b"k11", b"v11") in records
    until(lambda: any(g["group"] == f"{names}.group" for g in backend.describe_groups()), "the group is listed")
    (group,) = [g for g in backend.describe_groups() if g["group"] == f"{names}.group"]
    mine = [p for p in group["partitions"] if p["topic"] == topic]
    assert sum(p["committed_offset"] for p in mine) == sum(p["log_end_offset"] for p in mine)  # read to the end
    assert all(p["lag"] == 0 for p in mine)
