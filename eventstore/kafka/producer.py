"""A transactional, idempotent Kafka producer with the embedded producer's shape.

    producer = KafkaProducer("127.0.0.1:9092", transactional_id="capture-shop")
    producer.init_transactions()          # fences an older instance, aborts what it left open
    producer.begin_transaction()
    producer.send_batch("shop.public.orders", values, keys, headers=headers)
    producer.send_batch("__tideline_capture_offsets", [position], [connector_key])
    producer.commit_transaction()         # both topics visible to read_committed readers, or neither

Guarantees: ``acks=all`` and idempotence always (a retried batch is never written
twice; with ``min.insync.replicas`` an acknowledged write survives the loss of a
broker). Keys choose partitions with :mod:`eventstore.partitioner` (Kafka's murmur2,
the same function the embedded log and Java clients use), computed here and passed
explicitly; keyless records of one ``send_batch`` all go to one partition, the next
in round-robin order, as in the embedded log.

Fencing: ``init_transactions`` on a second producer with the same
``transactional_id`` bumps the epoch; from then on every call of the first one
raises :class:`~eventstore.errors.ProducerFencedError` ("another instance took
over") and it can only be closed.

``send_batch`` returns when every record is acknowledged (inside a transaction:
written, not yet committed) and reports ``{partition: (first offset, count)}``;
Kafka interleaves producers, so the offsets of one partition's records increase but
are contiguous only when no other producer wrote there meanwhile.

Thread safety: not thread-safe (one owner thread), like the embedded producer in a
transaction.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from eventstore.errors import ConfigError, InvalidTxnStateError, ProducerFencedError, RetriableError, TidelineError
from eventstore.kafka.config import client_config, translate
from eventstore.partitioner import partitions_for_keys

DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000
DEFAULT_TIMEOUT_S = 30.0
# delivery reports of records librdkafka dropped because their transaction failed (see _raise_failed_delivery)
_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
Headers = Sequence[tuple[str, bytes | None]] | None


class KafkaProducer:
    """Writes records to Kafka; transactional when ``transactional_id`` is given.

    ``timeout_s`` bounds each blocking call (init, flush, commit, abort).
    ``settings``: further librdkafka producer settings (underscores for dots).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        transactional_id: str | None = None,
        transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS,
        linger_ms: int = 5,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **settings: Any,
    ) -> None:
        if transactional_id is not None and not transactional_id.strip():
            raise ConfigError("transactional_id must not be empty")
        self.bootstrap_servers = bootstrap_servers
        self.transactional_id = transactional_id
        self.timeout_s = timeout_s
        config = client_config(
            bootstrap_servers,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            **settings,
        )
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
            config["transaction.timeout.ms"] = transaction_timeout_ms
        try:
            self._producer = Producer(config)
        except KafkaException as e:
            translate(e, what="creating a producer", bootstrap=bootstrap_servers)
        self._partitions: dict[str, int] = {}  # topic → partition count (fixed once created)
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._fenced: ProducerFencedError | None = None
        self._closed = False
        # acknowledgements of ``send_many(wait=False)`` not yet taken (take_delivered)
        self._delivered: dict[tuple[str, int], list[int]] = {}
        self._failed: list[tuple[KafkaError, str]] = []

    # -- transactions --------------------------------------------------------

    def init_transactions(self) -> None:
        """Register ``transactional_id``: fence older instances and finish their open transaction."""
        if self.transactional_id is None:
            raise InvalidTxnStateError("init_transactions needs a transactional_id")
        self._call(lambda: self._producer.init_transactions(self.timeout_s), "initializing transactions")

    def begin_transaction(self) -> None:
        self._call(self._producer.begin_transaction, "beginning a transaction")

    def add_partitions_to_transaction(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Accepted for the embedded producer's shape: librdkafka registers partitions as it sends."""
        self._check_usable()
        for topic, partition in partitions:
            if not 0 <= partition < self._partition_count(topic):
                raise ConfigError(f"topic {topic!r} has no partition {partition}")

    def commit_transaction(self) -> None:
        """Flush, then commit everything sent since ``begin_transaction``, atomically. A record of
        ``send_many(wait=False)`` that Kafka refused fails the commit with that record's error,
        before the commit is asked for (the transaction must then be aborted)."""
        self.flush()  # serves the delivery reports too, which commit_transaction's own flush does not
        self._raise_failed_delivery()
        self._call(lambda: self._producer.commit_transaction(self.timeout_s), "committing a transaction")

    def _raise_failed_delivery(self, errors: Sequence[tuple[KafkaError, str]] | None = None) -> None:
        """Raise the first of ``errors`` (delivery failures), by default of the reports collected for
        ``send_many(wait=False)``; nothing when there is none. Records librdkafka purged because the
        transaction failed are a consequence, and their reports may come first: the first other one is
        the cause raised."""
        errors = self._failed if errors is None else errors
        if errors:
            causes = [e for e in errors if e[0].code() not in _PURGED]
            err, topic = (causes or errors)[0]
            self._translate(KafkaException(err), f"sending to {topic!r}", topic)

    def abort_transaction(self) -> None:
        """Drop unsent records and abort everything sent since ``begin_transaction``."""
        self._delivered, self._failed = {}, []
        self._call(lambda: self._producer.abort_transaction(self.timeout_s), "aborting a transaction")
        self._delivered, self._failed = {}, []  # the purged records' failure reports

    # -- sending -------------------------------------------------------------

    def send_batch(
        self,
        topic: str,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None = None,
        *,
        partition: int | None = None,
        timestamp: int | None = None,
        timestamps: Sequence[int] | None = None,
        headers: Sequence[Headers] | None = None,
    ) -> dict[int, tuple[int, int]]:
        """Send records and wait until all are acknowledged; ``{partition: (first offset, count)}``.

        ``values``/``keys``: ``bytes | None`` per record (a None value is a tombstone).
        ``timestamp``: one for every record, or ``timestamps``: one per record (ms since the
        epoch; default: now — librdkafka reads 0 as "now" too).
        ``headers``: None, or per record a list of ``(str, bytes | None)`` or None.
        """
        self._check_usable()
        n = len(values)
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} values")
        if headers is not None and len(headers) != n:
            raise ValueError(f"{len(headers)} headers for {n} values")
        if timestamps is not None and (timestamp is not None or len(timestamps) != n):
            raise ValueError(f"give timestamp or one of timestamps per record ({n}), not both")
        if n == 0:
            return {}
        targets = self._targets(topic, keys, n, partition)
        results: dict[int, list[int]] = {}
        errors: list[KafkaError] = []

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                errors.append(err)
            else:
                results.setdefault(msg.partition() or 0, []).append(msg.offset() or 0)

        for i in range(n):
            self._produce(topic, values[i], keys[i] if keys is not None else None, targets[i],
                          timestamps[i] if timestamps is not None else timestamp,
                          headers[i] if headers is not None else None, delivered)  # fmt: skip
        self.flush()
        if errors:
            translate(errors[0], what=f"sending to {topic!r}", bootstrap=self.bootstrap_servers, topic=topic)
        return {p: (min(offsets), len(offsets)) for p, offsets in sorted(results.items())}

    def send_many(
        self,
        batches: Iterable[tuple[str, int, Sequence[bytes | None], Sequence[bytes | None], Sequence[Headers] | None]],
        *,
        wait: bool = True,
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """Send ``(topic, partition, keys, values, headers)`` slices, then wait once for all acknowledgements;
        ``{(topic, partition): (first offset, count)}``. What capture's sink uses: one flush per batch
        of many topics and partitions instead of one per ``send_batch``.

        ``wait=False``: return at once (``{}``); the acknowledgements are collected as they arrive
        and :meth:`take_delivered` reports them, after ``commit_transaction`` (which flushes, and
        fails if any record failed) or a :meth:`flush`. Inside a transaction this saves a round trip
        per commit: the records, the position record and the commit go out back to back."""
        self._check_usable()
        results: dict[tuple[str, int], list[int]] = {}
        errors: list[tuple[KafkaError, str]] = []
        if not wait:
            results, errors = self._delivered, self._failed

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                errors.append((err, msg.topic() or ""))
            else:
                results.setdefault((msg.topic() or "", msg.partition() or 0), []).append(msg.offset() or 0)

        for topic, partition, keys, values, headers in batches:
            if len(keys) != len(values) or (headers is not None and len(headers) != len(values)):
                raise ValueError(f"{topic}[{partition}]: keys, values and headers differ in length")
            if not 0 <= partition < self._partition_count(topic):
                raise ConfigError(f"topic {topic!r} has no partition {partition}")
            for i in range(len(values)):
                try:
                    self._produce(topic, values[i], keys[i], partition, None,
                                  headers[i] if headers is not None else None, delivered)  # fmt: skip
                except TidelineError:  # the transaction failed: by a record refused earlier?
                    if not wait:
                        self._poll()
                        self._raise_failed_delivery()
                    raise
        if not wait:
            self._poll()  # serve the callbacks of what was acknowledged meanwhile
            return {}
        self.flush()
        self._raise_failed_delivery(errors)
        return {tp: (min(offsets), len(offsets)) for tp, offsets in sorted(results.items())}

    def _poll(self) -> None:
        """Serve delivery callbacks; a fatal error met meanwhile (fencing) raises, translated."""
        try:
            self._producer.poll(0)
        except KafkaException as e:
            self._translate(e, "sending")

    def take_delivered(self) -> dict[tuple[str, int], tuple[int, int]]:
        """What ``send_many(wait=False)`` sent and Kafka acknowledged since the last call:
        ``{(topic, partition): (first offset, count)}``; raises the first delivery failure."""
        results, errors = self._delivered, self._failed
        self._delivered, self._failed = {}, []
        self._raise_failed_delivery(errors)
        return {tp: (min(offsets), len(offsets)) for tp, offsets in sorted(results.items())}

    def flush(self) -> None:
        """Wait until every queued record is acknowledged (or failed)."""
        try:
            left = self._producer.flush(self.timeout_s)
        except KafkaException as e:
            self._translate(e, "flushing")
        except SystemError as e:
            # confluent-kafka 2.16 raises a fatal error met during flush (fencing: "This instance has
            # been fenced by a newer instance") while it runs a delivery callback, which Python then
            # reports as a SystemError caused by the KafkaException.
            if not isinstance(e.__cause__, KafkaException):
                raise
            self._translate(e.__cause__, "flushing")
        if left:
            raise RetriableError(
                f"Kafka at {self.bootstrap_servers}: {left} record(s) still unacknowledged after {self.timeout_s:.0f}s"
            )

    def close(self) -> None:
        """Flush what is queued (unless fenced) and release the client."""
        if self._closed:
            return
        self._closed = True
        if self._fenced is None:
            self._producer.flush(self.timeout_s)

    def __enter__(self) -> KafkaProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------

    def _targets(self, topic: str, keys: Sequence[bytes | None] | None, n: int, partition: int | None) -> list[int]:
        count = self._partition_count(topic)
        if partition is not None:
            if not 0 <= partition < count:
                raise ConfigError(f"topic {topic!r} has no partition {partition} (it has {count})")
            return [partition] * n
        keyless = next(self._round_robin.setdefault(topic, itertools.count())) % count
        if keys is None:
            return [keyless] * n
        parts = partitions_for_keys(list(keys), count)  # murmur2; -1 for a null key
        return [int(p) if p >= 0 else keyless for p in parts.tolist()]

    def _produce(self, topic: str, value: bytes | None, key: bytes | None, partition: int, timestamp: int | None,
                 headers: Headers, callback: Any) -> None:  # fmt: skip
        while True:
            try:
                self._producer.produce(topic, value, key, partition=partition, on_delivery=callback,
                                       timestamp=timestamp or 0,  # 0: now
                                       headers=list(headers) if headers else None)  # fmt: skip
                return
            except BufferError:  # librdkafka's queue is full: let deliveries drain it
                self._producer.poll(0.1)
            except KafkaException as e:
                self._translate(e, f"sending to {topic!r}", topic)

    def _partition_count(self, topic: str) -> int:
        count = self._partitions.get(topic)
        if count is None:
            try:
                metadata = self._producer.list_topics(topic, timeout=self.timeout_s)
            except KafkaException as e:
                self._translate(e, f"reading metadata of topic {topic!r}", topic)
            topic_meta = metadata.topics.get(topic)
            if topic_meta is None or topic_meta.error is not None or not topic_meta.partitions:
                from eventstore.errors import UnknownTopicError

                raise UnknownTopicError(topic)
            count = self._partitions[topic] = len(topic_meta.partitions)
        return count

    def _call(self, action: Any, what: str) -> None:
        self._check_usable()
        try:
            action()
        except KafkaException as e:
            self._translate(e, what)

    def _translate(self, error: KafkaException, what: str, topic: str | None = None) -> None:
        try:
            translate(error, what=f"producer {self.transactional_id or '(idempotent)'}: {what}",
                      bootstrap=self.bootstrap_servers, topic=topic)  # fmt: skip
        except ProducerFencedError as fenced:
            self._fenced = fenced
            raise

    def _check_usable(self) -> None:
        if self._fenced is not None:
            raise ProducerFencedError(str(self._fenced))
        if self._closed:
            raise InvalidTxnStateError("the producer is closed")
