"""Committing behind (capture.writer.LogWriter.commit_behind): into Kafka, a batch's commit runs in the committer
thread while the next batch is decoded into memory. Against a real broker: the next batch touches neither the sink
nor the key state's SQLite until the commit returned; positions are reported stored only then, in commit order; a
commit that fails behind is raised at the next settle and leaves nothing of either batch in the log or the key
state."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_key_state import key_set
from test_sinks import committed, kafka_factory, opened

from capture.config import CaptureConfig
from capture.converters import JsonConverter
from capture.keystate import TABLE_TOPIC, KeyState
from capture.sinks import Sink, TopicSpec
from capture.sinks.embedded import EmbeddedLogSink
from capture.writer import LogWriter
from eventstore.errors import ProducerFencedError, TidelineError
from eventstore.log import Log
from schemas.position import POSITIONS_TOPIC, SourcePosition, connector_key
from tideline.kafkaharness import LocalKafka

CONFIG = CaptureConfig(dsn="postgresql://unused", slot="s", topic_prefix="d")
KEY = connector_key(CONFIG.topic_prefix, CONFIG.slot)


@contextmanager
def writing(
    bootstrap: str, tmp_path: Path
) -> Iterator[tuple[Sink, LogWriter, KeyState, list[SourcePosition | None]]]:
    """A Kafka sink (opened, with table topic ``t`` tracked by a key state), a writer into it, and the positions
    the writer reports settled."""
    with kafka_factory(bootstrap)(tmp_path / "log") as sink, _writer(sink, tmp_path) as (writer, keystate, settled):
        yield sink, writer, keystate, settled


@contextmanager
def _writer(sink: Sink, tmp_path: Path) -> Iterator[tuple[LogWriter, KeyState, list[SourcePosition | None]]]:
    opened(sink)
    sink.ensure_topic("t", TopicSpec(compact=True, partitions=3))
    keystate = KeyState(tmp_path / "ks.sqlite")
    keystate.track("t", TABLE_TOPIC, sink.topic_incarnation("t"))
    writer = LogWriter(CONFIG, sink, keystate, JsonConverter())
    writer.ensure_positions_topic()
    settled: list[SourcePosition | None] = []
    writer.on_settled = settled.append
    try:
        yield writer, keystate, settled
    finally:
        writer.close()
        keystate.close()


def stored(sink: Sink, expected: bytes) -> bytes | None:
    """The connector's position record, once it reads ``expected`` (a commit's markers land just after it)."""
    deadline = time.monotonic() + 30
    while (found := sink.read_last(POSITIONS_TOPIC, 0, KEY)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def keys_in(path: Path) -> set[bytes]:
    """The keys the key state's SQLite has committed (another connection's view)."""
    with sqlite3.connect(path) as other:
        return {r[0] for r in other.execute("SELECT key FROM keys")}


def test_a_commit_behind_is_stored_before_the_next_batch_touches_the_sink(kafka: LocalKafka, tmp_path: Path) -> None:
    with writing(kafka.bootstrap_servers, tmp_path) as (sink, writer, keystate, settled):
        first, second = SourcePosition(100, 0, True, 101), SourcePosition(200, 0, True, 201)
        writer.begin()
        writer.add_many("t", [b"a"], [b"1"], 2)
        keystate.put_sets("t", key_set([b"a"]), None)
        assert writer.commit_behind(first) and writer.committing
        # the next batch, decoded while the first commits: in memory only
        writer.begin()
        writer.add_many("t", [b"b"], [b"2"], 2)
        keystate.put_sets("t", key_set([b"b"]), None)
        assert settled == []  # told only once a settle finds the commit returned
        assert writer.settle() and settled == [first] and not writer.committing
        assert sorted(v for _, _, v in committed(sink, "t", 1)) == [b"1"]
        assert stored(sink, first.to_json()) == first.to_json()
        assert keys_in(tmp_path / "ks.sqlite") == {b"a"}  # the first batch's, committed with it; not b yet
        assert writer.commit(second) and settled == [first]  # a commit in line is not "settled"
        assert sorted(v for _, _, v in committed(sink, "t", 2)) == [b"1", b"2"]
        assert stored(sink, second.to_json()) == second.to_json()
        assert keys_in(tmp_path / "ks.sqlite") == {b"a", b"b"}
        checkpoints = keystate.checkpoints("t")
        assert sum(checkpoints.values()) == 2, checkpoints  # both records applied, as the log's offsets say


def test_a_commit_behind_that_fails_is_raised_at_the_next_settle_and_leaves_nothing(
    kafka: LocalKafka, tmp_path: Path
) -> None:
    """The first batch's commit fails behind (another instance took over: fenced); the next settle raises its
    failure in the connector thread (the fencing, or the purge of its records librdkafka did on learning it);
    the abort then finds the sink fenced (so the connector stops), and neither batch is in the log or the key
    state."""
    with writing(kafka.bootstrap_servers, tmp_path) as (_, writer, keystate, settled):
        writer.begin()
        writer.add_many("t", [b"a"], [b"1"], 2)
        keystate.put_sets("t", key_set([b"a"]), None)
        with kafka_factory(kafka.bootstrap_servers)(tmp_path / "log") as usurper:
            opened(usurper)  # init_transactions with the same identity: this writer's producers are fenced
            assert writer.commit_behind(SourcePosition(100, 0, True, 101))
            writer.begin()
            writer.add_many("t", [b"b"], [b"2"], 2)
            keystate.put_sets("t", key_set([b"b"]), None)  # staged
            with pytest.raises(TidelineError):  # fenced; or, when librdkafka learned it first, its records purged
                writer.settle()
            assert settled == [] and not writer.committing
            assert keys_in(tmp_path / "ks.sqlite") == set()
            with pytest.raises(ProducerFencedError):
                writer.abort()
            assert not writer.in_txn and keystate.toast("t", b"a") is None
            assert keys_in(tmp_path / "ks.sqlite") == set()
            assert committed(usurper, "t") == [] and usurper.read_last(POSITIONS_TOPIC, 0, KEY) is None


def test_a_sink_that_does_not_commit_behind_is_committed_in_line(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        sink = EmbeddedLogSink(log)
        opened(sink)
        keystate = KeyState(tmp_path / "ks.sqlite")
        writer = LogWriter(CONFIG, sink, keystate, JsonConverter())
        try:
            assert not sink.commits_behind
            writer.begin()
            with pytest.raises(ValueError, match="does not commit behind"):
                writer.commit_behind(None)
            assert writer.commit(None) and not writer.committing
        finally:
            writer.close()
            keystate.close()
            sink.close()
