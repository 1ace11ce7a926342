"""The Kafka sink's native producer: librdkafka driven from the Rust core, records as Arrow buffers.

:class:`NativeKafkaProducer` has the transactional shape of :class:`eventstore.kafka.KafkaProducer`
(what :class:`capture.sinks.kafka.KafkaLogSink` calls: ``init_transactions``, ``begin_transaction``,
``send_many(wait=False)``, ``commit_transaction``, ``take_delivered``, ``abort_transaction``) plus
:meth:`NativeKafkaProducer.send_arrays`: a topic's keys and values as two Arrow binary arrays and a
partition per record, handed to librdkafka by the extension (``tideline_native.KafkaProducer``,
native/src/kafka.rs) with no Python object and no Python callback per record. The extension counts
the acknowledgements per partition itself (first offset, count): what the sink's bookkeeping needs.

Same guarantees as the Python producer: ``acks=all``, idempotence, one transactional id, the
transaction protocol called in the same order (librdkafka's own); a record Kafka refused fails the
commit before it is asked for. Errors are librdkafka's codes, raised as the Python producer raises
them (:func:`eventstore.kafka.config.translate`: fencing → ProducerFencedError, …). librdkafka's log
lines go to the same logger as confluent-kafka's (``eventstore.kafka.librdkafka``).

The choice between the two (:func:`choose`): ``auto`` (the default) takes this one when the extension
has it; ``python`` (``--kafka-producer python`` / ``TIDELINE_KAFKA_PRODUCER=python``) keeps
confluent-kafka's per-record path, the differential oracle; ``native`` fails when the extension lacks
it. The path and why are reported (:class:`ProducerChoice`): log line, status, metrics, console.

Thread safety: one owner thread, like the Python producer.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from confluent_kafka import KafkaError, KafkaException

from capture.config import parse_choice
from capture.native import extension
from eventstore.errors import ConfigError, InvalidTxnStateError, ProducerFencedError, RetriableError, TidelineError
from eventstore.kafka.config import LIBRDKAFKA_LOGGER, client_config, translate

_UNAVAILABLE: str | None = extension.KAFKA_UNAVAILABLE  # why the native producer cannot run (None: it can)

ENV = "TIDELINE_KAFKA_PRODUCER"
NATIVE = "native"
PYTHON = "python"
_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
# syslog levels (librdkafka's) → logging's
_LEVELS = {0: logging.CRITICAL, 1: logging.CRITICAL, 2: logging.CRITICAL, 3: logging.ERROR, 4: logging.WARNING,
           5: logging.INFO, 6: logging.INFO, 7: logging.DEBUG}  # fmt: skip
Headers = Sequence[tuple[str, bytes | None]] | None


class ProducerMode(enum.Enum):
    AUTO = "auto"
    NATIVE = "native"
    PYTHON = "python"

    @classmethod
    def parse(cls, text: str, what: str = "--kafka-producer") -> ProducerMode:
        return parse_choice(cls, text, what)

    @classmethod
    def default(cls) -> ProducerMode:
        """``TIDELINE_KAFKA_PRODUCER`` when set, else auto."""
        text = os.environ.get(ENV)
        return cls.parse(text, ENV) if text else cls.AUTO


@dataclass(frozen=True, slots=True)
class ProducerChoice:
    """Which producer the Kafka sink writes with (``native`` or ``python``), what was asked, and why python."""

    path: str
    requested: str
    reason: str | None = None

    @property
    def chosen(self) -> bool:
        """The Python path because it was asked for (not warned about)."""
        return self.requested == PYTHON

    def to_json(self) -> dict[str, Any]:
        return {"kafka_producer": self.path, "kafka_producer_reason": self.reason,
                "kafka_producer_requested": self.requested}  # fmt: skip


def available() -> str | None:
    """Why the native producer cannot run (None: it can)."""
    return _UNAVAILABLE


def choose(mode: ProducerMode) -> ProducerChoice:
    """The producer ``mode`` gives on this install; ``native`` without the extension's producer raises."""
    if mode is ProducerMode.PYTHON:
        return ProducerChoice(PYTHON, mode.value, f"--kafka-producer python (or {ENV}=python) asks for it")
    if _UNAVAILABLE is not None:
        if mode is ProducerMode.NATIVE:
            raise ConfigError(f"--kafka-producer native: {_UNAVAILABLE} (or use auto or python)")
        return ProducerChoice(PYTHON, mode.value, _UNAVAILABLE)
    return ProducerChoice(NATIVE, mode.value)


def librdkafka_version() -> str:
    """The version of the librdkafka built into the extension ("" without it)."""
    return extension.librdkafka_version() if extension.librdkafka_version is not None else ""


def _setting(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _call_error() -> type[Exception]:
    """The extension's error class (the producer exists only when it does)."""
    assert extension.KafkaCallError is not None
    return extension.KafkaCallError


def _parts(array: pa.Array) -> tuple[Any, Any, Any, int, int]:
    """An Arrow binary array's buffers as the extension takes them."""
    if array.type != pa.binary():
        array = array.cast(pa.binary())
    validity, offsets, data = array.buffers()
    if array.null_count == 0:
        validity = None
    return validity, offsets, data, array.offset, len(array)


class NativeKafkaProducer:
    """A transactional Kafka producer over the extension (see the module docstring)."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        transactional_id: str,
        transaction_timeout_ms: int,
        linger_ms: int = 5,
        timeout_s: float = 30.0,
        **settings: Any,
    ) -> None:
        if _UNAVAILABLE is not None or extension.KafkaProducer is None:
            raise ConfigError(_UNAVAILABLE or "the native Kafka producer is unavailable")
        if not transactional_id.strip():
            raise ConfigError("transactional_id must not be empty")
        self.bootstrap_servers = bootstrap_servers
        self.transactional_id = transactional_id
        self.timeout_s = timeout_s
        config = client_config(bootstrap_servers, acks="all", enable_idempotence=True, linger_ms=linger_ms, **settings)
        config.pop("logger", None)  # the extension's log callback feeds the same logger (_drain_logs)
        config["transactional.id"] = transactional_id
        config["transaction.timeout.ms"] = transaction_timeout_ms
        try:
            self._producer = extension.KafkaProducer([(k, _setting(v)) for k, v in config.items()])
        except _call_error() as e:
            self._translate(e, "creating a producer")
        self._fenced: ProducerFencedError | None = None
        self._closed = False
        # acknowledgements taken from the extension, not yet reported (take_delivered)
        self._delivered: dict[tuple[str, int], tuple[int, int]] = {}
        self._timeout_ms = int(timeout_s * 1000)

    # -- transactions --------------------------------------------------------

    def init_transactions(self) -> None:
        self._call("initializing transactions", self._producer.init_transactions, self._timeout_ms)

    def begin_transaction(self) -> None:
        self._call("beginning a transaction", self._producer.begin_transaction)

    def commit_transaction(self) -> None:
        """Flush; raise the first record Kafka refused (the transaction must then be aborted); commit."""
        self.flush()
        self._raise_failed(self._collect())
        self._call("committing a transaction", self._producer.commit_transaction, self._timeout_ms)

    def abort_transaction(self) -> None:
        self._call("aborting a transaction", self._producer.abort_transaction, self._timeout_ms)
        self._collect()  # the purged records' failure reports
        self._delivered = {}

    # -- sending -------------------------------------------------------------

    def send_arrays(
        self,
        topic: str,
        partitions: npt.NDArray[np.int32],
        keys: pa.Array,
        values: pa.Array,
        headers: Sequence[Headers] | None = None,
    ) -> None:
        """Queue a topic's records: ``partitions[i]`` is record i's partition; ``keys``/``values`` Arrow
        binary arrays (a null value is a tombstone); ``headers`` None or one entry per record. Returns at
        once; :meth:`take_delivered` reports the acknowledgements after :meth:`commit_transaction`."""
        self._check_usable()
        parts = np.ascontiguousarray(partitions, dtype=np.int32)
        hdrs = None if headers is None or not any(headers) else [list(h) if h else None for h in headers]
        try:
            self._call(f"sending to {topic!r}", self._producer.produce, topic, parts, _parts(keys), _parts(values),
                       hdrs, topic=topic)  # fmt: skip
        except TidelineError:  # the transaction failed: by a record refused earlier? That is the cause to raise
            self._producer.poll()
            self._raise_failed(self._collect())
            raise

    def send_many(
        self,
        batches: Iterable[tuple[str, int, Sequence[bytes | None], Sequence[bytes | None], Sequence[Headers] | None]],
        *,
        wait: bool = True,
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """``(topic, partition, keys, values, headers)`` slices, as :meth:`KafkaProducer.send_many`."""
        for topic, partition, keys, values, headers in batches:
            if len(keys) != len(values) or (headers is not None and len(headers) != len(values)):
                raise ValueError(f"{topic}[{partition}]: keys, values and headers differ in length")
            self.send_arrays(topic, np.full(len(values), partition, np.int32), pa.array(keys, pa.binary()),
                             pa.array(values, pa.binary()), headers)  # fmt: skip
        if not wait:
            return {}
        self.flush()
        return self.take_delivered()

    def take_delivered(self) -> dict[tuple[str, int], tuple[int, int]]:
        """What Kafka acknowledged since the last call: ``{(topic, partition): (first offset, count)}``;
        raises the first delivery failure."""
        failures = self._collect()
        placed, self._delivered = dict(sorted(self._delivered.items())), {}
        self._raise_failed(failures)
        return placed

    def flush(self) -> None:
        """Wait until every queued record is acknowledged (or failed)."""
        left = self._call("flushing", self._producer.flush, self._timeout_ms)
        if left:
            raise RetriableError(
                f"Kafka at {self.bootstrap_servers}: {left} record(s) still unacknowledged after {self.timeout_s:.0f}s"
            )

    def close(self) -> None:
        """Flush what is queued (unless fenced) and release the client."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._fenced is None:
                self._producer.flush(self._timeout_ms)
        except _call_error():
            pass  # closing: what could not be flushed is the transaction's to lose (never committed)
        self._producer.close()
        self._drain_logs()

    def __enter__(self) -> NativeKafkaProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------

    def _collect(self) -> list[tuple[int, str, str, str, bool]]:
        """Take the extension's acknowledgements into ``_delivered``; returns the failures since the last take."""
        placed, failures, _count = self._producer.take_delivered()
        self._drain_logs()
        for topic, partition, first, count in placed:
            tp = (topic, partition)
            earlier = self._delivered.get(tp)
            self._delivered[tp] = (first, count) if earlier is None else (min(earlier[0], first), earlier[1] + count)
        return failures

    def _raise_failed(self, failures: Sequence[tuple[int, str, str, str, bool]]) -> None:
        """Raise the first failure that is not a consequence (records librdkafka purged because the
        transaction failed may be reported first)."""
        if not failures:
            return
        causes = [f for f in failures if f[0] not in _PURGED]
        code, _name, reason, topic, fatal = (causes or failures)[0]
        # as confluent-kafka reports a delivery failure: the code alone (fatal when the client's fatal error is why)
        self._translate_parts(code, reason, fatal, False, False, f"sending to {topic!r}", topic)

    def _call(self, what: str, action: Any, *args: Any, topic: str | None = None) -> Any:
        self._check_usable()
        try:
            return action(*args)
        except _call_error() as e:
            self._translate(e, what, topic)
        finally:
            self._drain_logs()

    def _translate(self, error: Exception, what: str, topic: str | None = None) -> None:
        code, _name, reason, fatal, retriable, txn_requires_abort = error.args
        self._translate_parts(code, reason, fatal, retriable, txn_requires_abort, what, topic)

    def _translate_parts(self, code: int, reason: str, fatal: bool, retriable: bool, txn_requires_abort: bool,
                         what: str, topic: str | None) -> None:  # fmt: skip
        err = KafkaError(code, reason, fatal=fatal, retriable=retriable, txn_requires_abort=txn_requires_abort)
        try:
            translate(KafkaException(err), what=f"producer {self.transactional_id} (native): {what}",
                      bootstrap=self.bootstrap_servers, topic=topic)  # fmt: skip
        except ProducerFencedError as fenced:
            self._fenced = fenced
            raise

    def _drain_logs(self) -> None:
        lines, dropped = self._producer.take_logs()
        for level, facility, message in lines:
            LIBRDKAFKA_LOGGER.log(_LEVELS.get(level, logging.INFO), "%s [%s] %s", self.transactional_id, facility,
                                  message)  # fmt: skip
        if dropped:
            LIBRDKAFKA_LOGGER.warning("%s: %d librdkafka log line(s) dropped", self.transactional_id, dropped)

    def _check_usable(self) -> None:
        if self._fenced is not None:
            raise ProducerFencedError(str(self._fenced))
        if self._closed:
            raise InvalidTxnStateError("the producer is closed")
