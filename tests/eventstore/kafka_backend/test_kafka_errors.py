"""An unreachable or malformed bootstrap is a clear one-line error, not a hang or a librdkafka dump; a partition whose
leader is moving is asked again, not an error."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition
from readiness import load_factor

from eventstore.errors import ConfigError, RetriableError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader, KafkaUnavailableError
from eventstore.kafka.config import translate, watermarks
from eventstore.offsets import TopicPartition


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_unreachable_bootstrap_is_a_one_line_error(capfd: pytest.CaptureFixture[str]) -> None:
    bootstrap = f"127.0.0.1:{_unused_port()}"
    with pytest.raises(KafkaUnavailableError, match=f"cannot reach Kafka at {bootstrap}") as admin_error:
        KafkaAdmin(bootstrap, timeout_s=3).topics()
    with pytest.raises(KafkaUnavailableError, match=f"cannot reach Kafka at {bootstrap}"):
        KafkaProducer(bootstrap, transactional_id="nobody-home", timeout_s=3).init_transactions()
    with pytest.raises(KafkaUnavailableError, match=f"cannot reach Kafka at {bootstrap}"):
        list(KafkaReader(bootstrap, timeout_s=3).read_to_end(TopicPartition("t", 0)))
    assert "\n" not in str(admin_error.value)
    assert "TIDELINE_KAFKA_BOOTSTRAP" in str(admin_error.value)
    assert "Connection refused" not in capfd.readouterr().err  # librdkafka's log goes to logging, not stderr


def test_malformed_bootstrap_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bootstrap servers are empty"):
        KafkaAdmin("  ")


class _LeaderMoving:
    """A consumer's ``get_watermark_offsets`` as librdkafka answers it while a partition's leader is not yet known
    (seen right after a topic's creation): ``errors`` such answers (the codes librdkafka gives, not flagged
    retriable), then the offsets. Pure logic: the retry around the call, not Kafka."""

    def __init__(self, errors: list[int]) -> None:
        self.errors = errors
        self.calls = 0

    def get_watermark_offsets(self, tp: KafkaTopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        self.calls += 1
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0), "Broker: Not leader for partition"))
        return 3, 7


def test_watermarks_are_asked_again_while_a_partitions_leader_moves() -> None:
    tp = KafkaTopicPartition("t", 0)
    moving = _LeaderMoving([KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE])
    assert watermarks(moving, tp, timeout_s=5) == (3, 7) and moving.calls == 3
    stuck = _LeaderMoving([KafkaError.NOT_LEADER_FOR_PARTITION] * 100)
    with pytest.raises(KafkaException):  # not forever: within the timeout
        watermarks(stuck, tp, timeout_s=0.3)
    assert 2 <= stuck.calls < 10
    other = _LeaderMoving([KafkaError.TOPIC_AUTHORIZATION_FAILED])
    with pytest.raises(KafkaException):  # any other error at once
        watermarks(other, tp, timeout_s=5)
    assert other.calls == 1
    with pytest.raises(RetriableError, match="Not leader"):  # and if it lasts, the caller may retry
        translate(KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION, "Broker: Not leader for partition")),
                  what="reading offsets of t-0", bootstrap="127.0.0.1:9092", topic="t")  # fmt: skip


class _LaggingMetadata:
    """An AdminClient's ``list_topics`` as a broker whose metadata cache lags answers it: the topic unknown for
    ``lag`` answers (seen on three brokers right after a topic's creation), then known. Pure logic."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.calls = 0

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        self.calls += 1
        if self.calls <= self.lag:
            return SimpleNamespace(topics={topic: SimpleNamespace(error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART),
                                                                  partitions={})})  # fmt: skip
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: None, 1: None})})


def test_a_topic_seen_here_and_answered_unknown_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("eventstore.kafka.admin.PROPAGATION_S", 1.0)
    admin = KafkaAdmin(f"127.0.0.1:{_unused_port()}")  # never connects: its client is replaced
    lagging = _LaggingMetadata(lag=3)
    admin._admin = lagging
    with pytest.raises(UnknownTopicError):  # never seen here: unknown at once, as the cluster answers
        admin._topic_metadata("t")
    assert lagging.calls == 1
    admin._seen.add("t")  # as create_topic or an earlier answer leaves it
    assert sorted(admin._topic_metadata("t").partitions) == [0, 1] and lagging.calls == 4
    gone = _LaggingMetadata(lag=1000)
    admin._admin = gone
    started = time.monotonic()
    with pytest.raises(UnknownTopicError):  # a topic really gone: still an error, after the propagation bound
        admin._topic_metadata("t")
    assert 1.0 <= time.monotonic() - started < 5 * load_factor()
