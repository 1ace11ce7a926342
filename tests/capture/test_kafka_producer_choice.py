"""Which Kafka producer the sink writes with, and that a fallback is never silent (no Kafka needed).

The native producer (capture.native.kafka) is the default where the extension has it; without it, auto falls
back to confluent-kafka's per-record producer and says why (the sink's log line, the core report that
`capture status` and the console read, the metrics), ``--kafka-producer native`` refuses to start, and a
``--kafka-producer`` given without ``--kafka`` is one line naming the fix.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import capture.native.kafka as kafka_native
from capture.native.kafka import NATIVE, PYTHON, ProducerMode, choose
from capture.status import CoreReport, core_warnings
from eventstore.errors import ConfigError, TidelineError

TIDELINE = str(Path(sys.executable).parent / "tideline")


def test_auto_takes_the_native_producer_where_the_extension_has_it() -> None:
    assert kafka_native.available() is None, kafka_native.available()
    assert choose(ProducerMode.AUTO) == kafka_native.ProducerChoice(NATIVE, "auto")
    assert choose(ProducerMode.NATIVE).path == NATIVE
    python = choose(ProducerMode.PYTHON)
    assert (python.path, python.chosen) == (PYTHON, True)
    assert kafka_native.librdkafka_version().count(".") == 2


def test_without_the_extension_auto_falls_back_loudly_and_native_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_native, "_UNAVAILABLE", "the extension tideline_native is not built (test)")
    fallback = choose(ProducerMode.AUTO)
    assert (fallback.path, fallback.chosen, fallback.reason) == (PYTHON, False, kafka_native._UNAVAILABLE)
    with pytest.raises(ConfigError, match="--kafka-producer native: the extension tideline_native is not built"):
        choose(ProducerMode.NATIVE)
    report = CoreReport("auto")
    report.producer = fallback.to_json()
    warnings = core_warnings({**report.to_json(), "core": "native"})
    assert warnings == ["capture writes to Kafka with the Python producer (a Python call per record): "
                        "the extension tideline_native is not built (test)"]  # fmt: skip
    assert "Kafka producer python" in report.summary()


def test_the_mode_comes_from_the_environment_and_bad_values_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kafka_native.ENV, "python")
    assert ProducerMode.default() is ProducerMode.PYTHON
    monkeypatch.setenv(kafka_native.ENV, "fast")
    with pytest.raises(ConfigError, match="TIDELINE_KAFKA_PRODUCER must be one of auto, native, python; not 'fast'"):
        ProducerMode.default()


def test_the_sink_logs_a_fallback_as_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                               tmp_path: Path) -> None:  # fmt: skip
    from capture.sinks.kafka import KafkaLogSink

    monkeypatch.setattr(kafka_native, "_UNAVAILABLE", "the extension tideline_native is not built (test)")
    sink = KafkaLogSink("127.0.0.1:1", state_dir=tmp_path, timeout_s=1)
    caplog.set_level(logging.INFO, "capture.sink")
    with pytest.raises(TidelineError):  # nobody listens there: opening fails after the choice was logged
        sink.open("capture.test")
    sink.close()
    assert any(r.levelno == logging.WARNING and "Kafka producer: python" in r.getMessage()
               and "not built (test)" in r.getMessage() for r in caplog.records), caplog.text  # fmt: skip


def test_the_cli_wants_kafka_for_the_option(tmp_path: Path) -> None:
    done = subprocess.run([TIDELINE, "--data-dir", str(tmp_path), "capture", "run", "--dsn", "postgresql://x/y",
                           "--kafka-producer", "python"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "--kafka-producer chooses how capture writes to Kafka: give --kafka" in done.stderr, done.stderr
