"""An unreachable or malformed bootstrap is a clear one-line error, not a hang or a librdkafka dump."""

from __future__ import annotations

import socket

import pytest

from eventstore.errors import ConfigError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader, KafkaUnavailableError
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
