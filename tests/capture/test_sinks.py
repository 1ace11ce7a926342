"""The sink contract (capture.sinks), one suite run against every sink implementation.

Every backend capture writes to must keep it: atomic and durable commits of events plus the
position record, aborted transactions invisible, one writer per identity (a zombie is
fenced), Kafka's murmur2 placement of keys (shared/testdata/kafka_murmur2.json), keyless
batches on one partition each, topics whose configuration contradicts what capture writes
refused, and committed reads by offset range. Add a backend: add a fixture to ``SINKS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from capture.sinks import Sink, TopicRecords, TopicSpec
from capture.sinks.embedded import EmbeddedLogSink
from eventstore.errors import ConfigError, TidelineError
from eventstore.log import Log

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


SINKS: dict[str, SinkFactory] = {"embedded": embedded}


@pytest.fixture(params=sorted(SINKS))
def factory(request: pytest.FixtureRequest) -> SinkFactory:
    return SINKS[request.param]


def opened(sink: Sink, identity: str = "capture.test") -> Sink:
    sink.open(identity)
    sink.ensure_topic(POSITIONS, TopicSpec(compact=True, partitions=1))
    return sink


def committed(sink: Sink, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:
    """(partition, key, value) of every committed record, partition by partition."""
    out = []
    for p, end in sorted(sink.end_offsets(topic).items()):
        for batch in sink.read(topic, p, 0, end):
            out += [(p, k, v) for k, v in zip(batch.keys, batch.values, strict=True)]
    return out


def test_commit_is_atomic_with_the_position(factory: SinkFactory, tmp_path: Path) -> None:
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t", TopicSpec(compact=True, partitions=3))
        sink.begin()
        written = sink.append({"t": TopicRecords([b"a", b"b", b"c"], [b"1", b"2", b"3"])})
        assert committed(sink, "t") == []  # appended, not visible before the commit
        assert sink.read_last(POSITIONS, 0, b"me") is None
        sink.commit(POSITIONS, b"me", b"pos-1")
        assert sorted((k, v) for _, k, v in committed(sink, "t")) == [(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]
        assert sink.read_last(POSITIONS, 0, b"me") == b"pos-1"
        ends = sink.end_offsets("t")
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
        assert [(k, v) for _, k, v in committed(sink, "t")] == [(b"a", b"kept")]


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
            assert [(k, v) for _, k, v in committed(second, "t")] == [(b"b", b"committed")]
            with pytest.raises(TidelineError):  # the zombie is fenced
                first.commit(POSITIONS, b"me", b"zombie")
            assert second.read_last(POSITIONS, 0, b"me") == b"pos"


def test_keys_are_placed_by_kafka_murmur2(factory: SinkFactory, tmp_path: Path) -> None:
    vectors = json.loads(VECTORS.read_text())["vectors"]
    keys = [v["key"].encode() for v in vectors]
    with factory(tmp_path / "log") as sink:
        opened(sink)
        sink.ensure_topic("t12", TopicSpec(compact=True, partitions=12))
        sink.begin()
        sink.append({"t12": TopicRecords(list(keys), [b"v"] * len(keys))})
        sink.commit(POSITIONS, None, None)
        placed = {k: p for p, k, _ in committed(sink, "t12")}
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
        for p, _, v in committed(sink, "audit"):
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
        with pytest.raises(ConfigError, match=r"cleanup_policy=delete.*needs compaction"):
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
        end = sink.end_offsets("t")[0]
        everything = [v for b in sink.read("t", 0, 0, end) for v in b.values]
        assert everything == [b"v%d" % i for i in range(5)]
        offsets = [o for b in sink.read("t", 0, 0, end) for o in b.offsets]
        tail = [v for b in sink.read("t", 0, offsets[3], end) for v in b.values]
        assert tail == [b"v3", b"v4"]
        assert sink.topic_incarnation("t") is not None and sink.topic_incarnation("missing") is None
