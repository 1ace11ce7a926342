"""A Kafka transaction that outlives ``transaction.timeout.ms`` is said to be one (capture.sinks.kafka).

Kafka's coordinator aborts such a transaction and fences its producer: without this, the sink reported
"another instance took over", which sends the user hunting for a second connector. The initial snapshot
into Kafka is one transaction, so a big enough table meets it (docs/capture.md, "Snapshots into Kafka").
Against a real broker, with the sink's timeout lowered to 2 s (the broker aborts timed-out transactions
every 10 s by default).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import capture.sinks.kafka as kafka_sink
from capture.sinks import TopicRecords, TopicSpec
from capture.sinks.kafka import KafkaLogSink, TransactionTimedOutError
from eventstore.errors import ProducerFencedError
from tideline.kafkaharness import LocalKafka


@pytest.mark.parametrize("producer", ["native", "python"])
def test_a_transaction_kafka_timed_out_is_named_as_such_not_as_another_instance(
    kafka: LocalKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, producer: str
) -> None:
    monkeypatch.setattr(kafka_sink, "TRANSACTION_TIMEOUT_MS", 2000)
    monkeypatch.setenv("TIDELINE_KAFKA_PRODUCER", producer)
    if producer == "native" and kafka_sink.choose(kafka_sink.ProducerMode.NATIVE).path != "native":
        pytest.skip("the extension has no native producer")
    sink = KafkaLogSink(kafka.bootstrap_servers, state_dir=tmp_path / "state")
    try:
        sink.open(f"capture.timeout-{producer}")
        sink.ensure_topic("positions", TopicSpec(compact=True, partitions=1))
        sink.ensure_topic(f"slow-{producer}", TopicSpec(compact=True, partitions=1))
        sink.begin()
        began = time.monotonic()
        with pytest.raises(TransactionTimedOutError) as raised:
            while time.monotonic() - began < 60:  # the coordinator's next sweep aborts it (≤ 10 s after 2 s)
                sink.append({f"slow-{producer}": TopicRecords([b"k"], [b"v"])})
                time.sleep(0.5)
                if time.monotonic() - began > 15:  # the abort came by now: a commit meets it if no send did
                    sink.commit("positions", b"me", b"{}")
        text = str(raised.value)
        assert "past its transaction.timeout.ms (2 s)" in text and "tideline capture snapshot" in text, text
        assert isinstance(raised.value, ProducerFencedError)  # it still stops the connector: retrying cannot help
    finally:
        sink.close()


def test_a_fencing_within_the_timeout_stays_another_instance(kafka: LocalKafka, tmp_path: Path) -> None:
    """Another instance opening the same identity fences this one: that is what the error says then."""
    first = KafkaLogSink(kafka.bootstrap_servers, state_dir=tmp_path / "a")
    second = KafkaLogSink(kafka.bootstrap_servers, state_dir=tmp_path / "b")
    try:
        first.open("capture.fenced-quickly")
        first.ensure_topic("positions", TopicSpec(compact=True, partitions=1))
        first.ensure_topic("fenced", TopicSpec(compact=True, partitions=1))
        first.begin()
        first.append({"fenced": TopicRecords([b"k"], [b"v"])})
        second.open("capture.fenced-quickly")  # init_transactions: the first is fenced
        with pytest.raises(ProducerFencedError) as raised:
            first.commit("positions", b"me", b"{}")
        assert not isinstance(raised.value, TransactionTimedOutError), raised.value
    finally:
        first.close()
        second.close()
