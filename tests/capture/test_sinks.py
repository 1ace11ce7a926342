"""The sink contract (capture.sinks), one suite run against every sink implementation.

Every backend capture writes to must keep it: atomic and durable commits of events plus the
position record, aborted transactions invisible, one writer per identity (a zombie is
fenced), Kafka's murmur2 placement of keys (shared/testdata/kafka_murmur2.json), keyless
batches on one partition each, topics whose configuration contradicts what capture writes
refused, and committed reads by offset range. Add a backend: add it to ``SINKS`` and ``factory``
(Kafka: the session's single-broker cluster, each test's topics under a prefix of its own).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pyarrow as pa
import pytest

from capture.config import CaptureConfig
from capture.converters import JsonConverter
from capture.keystate import KeyState
from capture.sinks import ReadBatch, Sink, TopicRecords, TopicSpec
from capture.sinks.embedded import EmbeddedLogSink
from capture.sinks.kafka import KafkaLogSink
from capture.writer import BackgroundAppends, LogWriter
from eventstore.errors import ConfigError, InvalidRecordError, ProducerFencedError, TidelineError
from eventstore.log import Log
from schemas.registry import SchemaStore
from tideline.kafkaharness import LocalKafka

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT.parent / "shared" / "testdata" / "kafka_murmur2.json"
POSITIONS = "__positions"

SinkFactory = Callable[[Path], AbstractContextManager[Sink]]


@contextmanager
def embedded(path: Path) -> Iterator[Sink]:
    with Log(path) as log:
        sink = EmbeddedLogSink(log)
        try:
            yield sink
        finally:
            sink.close()


class Namespaced:
    """A sink whose topics and identity carry a per-test prefix: tests share one Kafka cluster."""

    def __init__(self, inner: Sink, namespace: str) -> None:
        self.inner, self.ns = inner, namespace
        self.commits_behind = inner.commits_behind

    def describe(self) -> str:
        return self.inner.describe()

    def set_compression(self, codec: str | None) -> None:
        self.inner.set_compression(codec)

    def open(self, transactional_id: str) -> None:
        self.inner.open(self.ns + transactional_id)

    def ensure_topic(self, topic: str, spec: TopicSpec) -> int:
        return self.inner.ensure_topic(self.ns + topic, spec)

    def topic_incarnation(self, topic: str) -> str | None:
        return self.inner.topic_incarnation(self.ns + topic)

    def begin(self) -> None:
        self.inner.begin()

    def append(
        self, batch: Mapping[str, TopicRecords], *, also: Iterable[tuple[str, int]] = ()
    ) -> dict[tuple[str, int], int]:
        renamed = {self.ns + t: r for t, r in batch.items()}
        written = self.inner.append(renamed, also=[(self.ns + t, p) for t, p in also])
        return {(t.removeprefix(self.ns), p): o for (t, p), o in written.items()}

    def commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        written = self.inner.commit(self.ns + position_topic, key, value)
        return {(t.removeprefix(self.ns), p): o for (t, p), o in written.items()}

    def abort(self) -> None:
        self.inner.abort()

    def read_last(self, topic: str, partition: int, key: bytes) -> bytes | None:
        return self.inner.read_last(self.ns + topic, partition, key)

    def end_offsets(self, topic: str) -> dict[int, int]:
        return self.inner.end_offsets(self.ns + topic)

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[ReadBatch]:
        return self.inner.read(self.ns + topic, partition, start, end)

    def schema_store(self) -> SchemaStore:
        return self.inner.schema_store()

    def default_state_dir(self) -> Path:
        return self.inner.default_state_dir()

    def close(self) -> None:
        self.inner.close()


def kafka_factory(bootstrap: str) -> SinkFactory:
    @contextmanager
    def make(path: Path) -> Iterator[Sink]:
        sink = KafkaLogSink(bootstrap, state_dir=path / "state")
        try:
            yield Namespaced(sink, f"s{zlib.crc32(str(path).encode()):08x}.")
        finally:
            sink.close()

    return make


SINKS = ["embedded", "kafka"]


@pytest.fixture(params=SINKS)
def factory(request: pytest.FixtureRequest) -> SinkFactory:
    if request.param == "kafka":
        cluster: LocalKafka = request.getfixturevalue("kafka")
        return kafka_factory(cluster.bootstrap_servers)
    return embedded


def opened(sink: Sink, identity: str = "capture.test") -> Sink:
    sink.open(identity)
    sink.ensure_topic(POSITIONS, TopicSpec(compact=True, partitions=1))
    return sink


def committed(sink: Sink, topic: str, count: int | None = None) -> list[tuple[int, bytes | None, bytes | None]]:
    """(partition, key, value) of every committed record, partition by partition; with ``count``, once
    that many are visible (Kafka writes a commit's markers after the commit returns: visibility follows
    within moments), failing after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        out = []
        for p, end in sorted(sink.end_offsets(topic).items()):
            for batch in sink.read(topic, p, 0, end):
                out += [(p, k, v) for k, v in zip(batch.keys, batch.values, strict=True)]
        if count is None or len(out) >= count or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def last_value(sink: Sink, key: bytes, expected: bytes) -> bytes | None:
    """The position record of ``key``, once it reads ``expected`` (at most 30 s: see ``committed``)."""
    deadline = time.monotonic() + 30
    while (found := sink.read_last(POSITIONS, 0, key)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_commit_is_atomic_with_the_position(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=3))
        sink.begin()
        written = sink.append({"t": TopicRecords([b"a", b"b", b"c"], [b"1", b"2", b"3"])})
        # appended, not visible before the commit (read as far as read_committed goes: end_offsets would wait
        # for the open transaction to end)
        assert [v for p in range(3) for b in sink.read("t", p, 0, 1 << 62) for v in b.values] == []
        assert sink.read_last(POSITIONS, 0, b"me") is None
        written |= sink.commit(POSITIONS, b"me", b"pos-1")  # a backend reports each partition's end once
        assert sorted((k, v) for _, k, v in committed(sink, "t", 3)) == [(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]
        assert last_value(sink, b"me", b"pos-1") == b"pos-1"
        ends = sink.end_offsets("t")
        assert {p for (t, p) in written if t == "t"} == {p for p, _, _ in committed(sink, "t", 3)}, written
        assert all(ends[p] >= offset for (_, p), offset in written.items())


def test_abort_leaves_nothing_visible(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=2))
        sink.begin()
        sink.append({"t": TopicRecords([b"a"], [b"gone"])})
        sink.abort()
        sink.begin()
        sink.append({"t": TopicRecords([b"a"], [b"kept"])})
        sink.commit(POSITIONS, b"me", b"pos")
        assert [(k, v) for _, k, v in committed(sink, "t", 1)] == [(b"a", b"kept")]


def test_a_record_the_log_refuses_fails_its_transaction_and_nothing_of_it_shows(
    factory: SinkFactory, tmp_path: Path
) -> None:
    """A record over the topic's size limit: the backend refuses it when appended (embedded log) or
    when Kafka answers, at the latest at commit (Kafka: appends do not wait); the error names it,
    nothing of the transaction becomes visible, the position stays, and after a reopen the next one commits."""
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=1, overrides={"max_batch_bytes": "4096"}))
        sink.begin()
        sink.append({"t": TopicRecords([b"a"], [b"committed"])})
        sink.commit(POSITIONS, b"me", b"pos-1")
        for answered_first in (False, True):  # Kafka's refusal arrives during the commit, or before it
            sink.begin()
            with pytest.raises(TidelineError, match=r"(?i)too large|size|max"):
                sink.append({"t": TopicRecords([b"b", b"c"], [b"fits", b"x" * 20_000])})
                if answered_first:
                    time.sleep(1.0)
                sink.commit(POSITIONS, b"me", b"pos-2")
            sink.abort()
            opened(sink)  # as the connector after a sink failure (Kafka: a producer that failed a record is replaced)
        sink.begin()
        sink.append({"t": TopicRecords([b"d"], [b"after"])})
        sink.commit(POSITIONS, b"me", b"pos-3")
        assert [(k, v) for _, k, v in committed(sink, "t", 2)] == [(b"a", b"committed"), (b"d", b"after")]
        assert last_value(sink, b"me", b"pos-3") == b"pos-3"


def test_an_open_transaction_of_a_dead_writer_is_aborted_by_the_next(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as first:
        opened(first)
        first.ensure_topic("t", TopicSpec(compact=True, partitions=1))
        first.begin()
        first.append({"t": TopicRecords([b"a"], [b"never committed"])})
        # the writer dies here (its transaction stays open); a successor with the same identity opens
        with factory(tmp_path / "log") as second:
            opened(second)
            second.begin()
            second.append({"t": TopicRecords([b"b"], [b"committed"])})
            second.commit(POSITIONS, b"me", b"pos")
            assert [(k, v) for _, k, v in committed(second, "t", 1)] == [(b"b", b"committed")]
            with pytest.raises(TidelineError):  # the zombie is fenced
                first.commit(POSITIONS, b"me", b"zombie")
            assert last_value(second, b"me", b"pos") == b"pos"


def test_a_fenced_writer_learns_it_from_its_abort_and_stops(factory: SinkFactory, tmp_path: Path) -> None:
    """A writer whose commit failed in a way that looks transient (Kafka can answer a fenced EndTxn with
    UNKNOWN) aborts; the abort finds it fenced and must say so (ProducerFencedError), so the connector
    stops instead of opening the sink again, which would fence the new instance in turn (the fresh-clone
    run's test_second_connector_fences_the_first: the two took turns, and the second died)."""
    with factory(tmp_path / "log") as first:
        opened(first)
        first.ensure_topic("t", TopicSpec(compact=True, partitions=1))
        keystate = KeyState(tmp_path / "first.keystate.sqlite")
        try:
            config = CaptureConfig(dsn="postgresql://unused", slot="s", topic_prefix="d")
            writer = LogWriter(config, first, keystate, JsonConverter())
            writer.begin()
            first.append({"t": TopicRecords([b"a"], [b"in flight"])})
            with factory(tmp_path / "log") as second:
                opened(second)  # another instance took over
                with pytest.raises(ProducerFencedError):
                    writer.abort()
                second.begin()
                second.append({"t": TopicRecords([b"b"], [b"the new instance's"])})
                second.commit(POSITIONS, b"me", b"pos")  # it was not fenced in turn
                assert [(k, v) for _, k, v in committed(second, "t", 1)] == [(b"b", b"the new instance's")]
        finally:
            keystate.close()


def test_keys_are_placed_by_kafka_murmur2(factory: SinkFactory, tmp_path: Path) -> None:
    vectors = json.loads(VECTORS.read_text())["vectors"]
    keys = [v["key"].encode() for v in vectors]
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t12", TopicSpec(compact=True, partitions=12))
        sink.begin()
        sink.append({"t12": TopicRecords(list(keys), [b"v"] * len(keys))})
        sink.commit(POSITIONS, None, None)
        placed = {k: p for p, k, _ in committed(sink, "t12", len(keys))}
    assert len(vectors) >= 3
    for v in vectors:
        assert placed[v["key"].encode()] == v["partition_of_12"], v


def test_keyless_batches_take_one_partition_each_in_turn(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("audit", TopicSpec(compact=False, partitions=3, keyless=True))
        for i in range(6):
            sink.begin()
            sink.append({"audit": TopicRecords([None, None], [b"%d-a" % i, b"%d-b" % i])})
            sink.commit(POSITIONS, None, None)
        by_batch: dict[bytes, set[int]] = {}
        for p, _, v in committed(sink, "audit", 12):
            assert v is not None
            by_batch.setdefault(v.split(b"-")[0], set()).add(p)
        assert all(len(ps) == 1 for ps in by_batch.values())  # a batch stays together
        assert {next(iter(ps)) for ps in by_batch.values()} == {0, 1, 2}  # batches rotate


def test_contradicting_topic_configuration_is_refused(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("cdc.public.t", TopicSpec(compact=False, partitions=1))  # made by someone, not compacted
    with factory(tmp_path / "log") as sink:
        opened(sink)
        with pytest.raises(ConfigError, match=r"cleanup[._]policy=delete.*needs compaction"):
            sink.ensure_topic("cdc.public.t", TopicSpec(compact=True, partitions=1))
        sink.ensure_topic("cdc.public.audit", TopicSpec(compact=True, partitions=1))
    with factory(tmp_path / "log") as sink:
        opened(sink)
        with pytest.raises(ConfigError, match="records without keys"):
            sink.ensure_topic("cdc.public.audit", TopicSpec(compact=False, partitions=1, keyless=True))


def test_reads_by_offset_range_see_committed_records_only(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=1))
        for i in range(5):
            sink.begin()
            sink.append({"t": TopicRecords([b"k%d" % i], [b"v%d" % i])})
            sink.commit(POSITIONS, None, None)
        assert len(committed(sink, "t", 5)) == 5
        end = sink.end_offsets("t")[0]
        everything = [v for b in sink.read("t", 0, 0, end) for v in b.values]
        assert everything == [b"v%d" % i for i in range(5)]
        offsets = [o for b in sink.read("t", 0, 0, end) for o in b.offsets]
        tail = [v for b in sink.read("t", 0, offsets[3], end) for v in b.values]
        assert tail == [b"v3", b"v4"]
        assert sink.topic_incarnation("t") is not None and sink.topic_incarnation("missing") is None


def test_records_given_as_arrow_chunks_keep_their_order_among_listed_ones(factory: SinkFactory, tmp_path: Path) -> None:
    """Snapshot reads encoded in bulk come as Arrow arrays (TopicRecords.add_arrays) between listed records."""
    records = TopicRecords([b"k1", b"k2"], [b"1", b"2"])
    records.add_arrays(pa.array([b"k1", b"k3"], pa.binary()), pa.array([b"3", b"4"], pa.binary()))
    records.keys.append(b"k1")
    records.values.append(b"5")
    records.add_arrays(pa.array([b"k1"], pa.binary()), pa.array([b"6"], pa.binary()))
    assert len(records) == 6
    loose = TopicRecords()
    loose.add_arrays(pa.nulls(3, pa.binary()), pa.array([b"x", b"y", b"z"], pa.binary()))
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=4))
        sink.ensure_topic("loose", TopicSpec(compact=False, partitions=2, keyless=True))
        sink.begin()
        sink.append({"t": records, "loose": loose})
        sink.commit(POSITIONS, None, None)
        got = committed(sink, "t", 6)
        assert [v for _, k, v in got if k == b"k1"] == [b"1", b"3", b"5", b"6"]  # one partition, in order
        assert sorted(v for _, _, v in got) == [b"1", b"2", b"3", b"4", b"5", b"6"]
        keyless = committed(sink, "loose", 3)
        assert [v for _, _, v in keyless] == [b"x", b"y", b"z"] and len({p for p, _, _ in keyless}) == 1
    with pytest.raises(ValueError, match="2 keys for 1 values"):
        TopicRecords().add_arrays(pa.array([b"a", b"b"], pa.binary()), pa.array([b"1"], pa.binary()))


def stored_bytes(request: pytest.FixtureRequest, path: Path, topic: str) -> int:
    """Bytes of the segment files of ``topic`` as the backend of ``factory`` stores them (Kafka: on every broker)."""
    if request.node.callspec.params["factory"] == "kafka":
        cluster: LocalKafka = request.getfixturevalue("kafka")
        name = f"s{zlib.crc32(str(path).encode()):08x}.{topic}"  # as Namespaced names it
        parts = [d for d in Path(cluster.directory).rglob(f"{name}-*") if d.is_dir()]
    else:
        parts = [d for d in path.iterdir() if d.is_dir() and d.name.startswith(f"{topic}-")]
    assert parts, f"no partition directory of {topic} found"
    return sum(f.stat().st_size for d in parts for f in d.glob("*.log"))


def test_compression_stores_fewer_bytes_and_reads_back_the_same(
    factory: SinkFactory, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``set_compression`` (capture's --compression, Kafka's compression.type): the same committed records read
    back with every codec, stored in far fewer bytes (Debezium envelopes are mostly field names); an unknown
    codec is refused by name before anything is written."""
    values = [json.dumps({"before": None, "after": {"id": i, "note": f"row {i}"}, "op": "r",
                          "source": {"connector": "postgresql", "db": "bench", "schema": "public", "table": "t",
                                     "snapshot": "true", "event_index": i}}).encode() for i in range(3000)]  # fmt: skip
    keys = [b'{"id":%d}' % i for i in range(3000)]
    sizes: dict[str | None, int] = {}
    for codec in (None, "none", "lz4", "zstd", "gzip"):
        path = tmp_path / f"log-{codec}"
        with factory(path) as sink:
            sink.set_compression(codec)
            opened(sink)
            sink.ensure_topic("t", TopicSpec(compact=True, partitions=1))
            sink.begin()
            sink.append({"t": TopicRecords(keys, values)})
            sink.commit(POSITIONS, b"k", codec.encode() if codec else b"default")
            assert committed(sink, "t", 3000) == [(0, k, v) for k, v in zip(keys, values, strict=True)], codec
        sizes[codec] = stored_bytes(request, path, "t")
    assert sizes["none"] == pytest.approx(sizes[None], rel=0.01), sizes  # the default is uncompressed
    for codec in ("lz4", "zstd", "gzip"):
        assert sizes[codec] < sizes[None] / 4, sizes
    with factory(tmp_path / "log-snappy") as sink, pytest.raises(ConfigError, match="snappy"):
        sink.set_compression("snappy")


def test_topic_records_keep_their_order_across_chunks_lists_and_headers() -> None:
    records = TopicRecords([b"a"], [b"1"])
    records.add_arrays(pa.array([b"b"], pa.binary()), pa.array([b"2"], pa.binary()))
    records.keys.append(b"c")  # as LogWriter.add appends after a chunk
    records.values.append(b"3")
    keys, values = records.arrays()
    assert keys.to_pylist() == [b"a", b"b", b"c"] and values.to_pylist() == [b"1", b"2", b"3"]
    assert records.lists() == ([b"a", b"b", b"c"], [b"1", b"2", b"3"])
    # a record with headers joins: the chunks become list entries first, so headers stay aligned with them
    records.lift_chunks()
    assert records.chunks == [] and records.lists() == ([b"a", b"b", b"c"], [b"1", b"2", b"3"])
    records.headers = [None, None, None]
    records.keys.append(b"d")
    records.values.append(b"4")
    records.headers.append([("h", b"v")])
    records.add_arrays(pa.array([b"e"], pa.binary()), pa.array([b"5"], pa.binary()))  # after headers: listed
    assert records.chunks == [] and records.keys == [b"a", b"b", b"c", b"d", b"e"]
    assert records.headers == [None, None, None, [("h", b"v")], None] and len(records) == 5


def test_background_appends_keep_order_and_raise_a_failed_append_in_the_caller(tmp_path: Path) -> None:
    """capture.writer.BackgroundAppends (the snapshot's appends): batches land in order, in the one transaction, and
    an append that fails in the worker is raised where the connector thread waits next — before the commit."""
    with Log(tmp_path / "log") as log:
        sink = EmbeddedLogSink(log)
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=1))
        keystate = KeyState(tmp_path / "ks.sqlite")
        writer = LogWriter(CaptureConfig(dsn="postgresql://unused", slot="s", topic_prefix="d"), sink, keystate,
                           JsonConverter())  # fmt: skip
        writer.begin()
        appends = BackgroundAppends(writer)
        for i in range(20):
            writer.add_many("t", [b"k%d" % i], [b"v%d" % i], 6)
            appends.submit()
        appends.close()
        writer.commit(None)
        assert [v for _, _, v in committed(sink, "t", 20)] == [b"v%d" % i for i in range(20)]
        # a record the log refuses (a compacted topic takes no null key) fails its append in the worker
        writer.begin()
        appends = BackgroundAppends(writer)
        writer.add_many("t", [None], [b"keyless"], 7)
        appends.submit()
        with pytest.raises(InvalidRecordError, match="cannot accept records without keys"):
            appends.wait()
        appends.close()
        writer.abort()
        assert len(committed(sink, "t")) == 20
        keystate.close()
        sink.close()
