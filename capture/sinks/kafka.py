"""Apache Kafka as capture's sink: one transactional producer, the position in the same Kafka transaction.

What a Debezium user expects of a connector writing to Kafka, with Kafka's exactly-once
machinery instead of Kafka Connect's offsets topic:

- **One transaction per log batch.** A batch's events (many Postgres transactions, or a
  slice of a huge one) and the connector's position record (``__tideline_capture_offsets``,
  compacted, keyed by the connector) are produced by one transactional producer and
  committed together: ``read_committed`` consumers see both or neither (``transactional.id``
  = the connector's identity; docs/capture.md on why not two alternating producers). Appends
  do not wait; :meth:`KafkaLogSink.commit` flushes, and returns only after
  Kafka's commit returned (``acks=all``, idempotence, and the topics'
  ``min.insync.replicas``); only then does the connector confirm the flush LSN to Postgres.
- **One writer.** :meth:`KafkaLogSink.open` runs ``init_transactions``: a
  predecessor's open transaction is aborted and a zombie with the same identity is fenced —
  its next call raises :class:`~eventstore.errors.ProducerFencedError` ("another instance
  took over"), which stops it.
- **Placement**: Kafka's murmur2 of the key bytes, computed here
  (:func:`eventstore.partitioner.partitions_for_keys`) and passed explicitly, so a key
  lands where a Java client and the embedded log put it; keyless records of one batch go
  to one partition, the next in round-robin order from a random start.
- **Topics** are created on first sight with the embedded log's settings mapped to
  Kafka's (:func:`eventstore.kafka.config.topic_configs`: ``cleanup.policy``,
  ``delete.retention.ms``, ``min.compaction.lag.ms``, …, all explicit), plus
  ``replication_factor`` / ``min_insync_replicas`` when given; an existing topic whose
  cleanup policy contradicts what capture writes is refused (nothing is written).
- **Reads** (the position at start, the key state's catch-up) are ``read_committed``
  and bounded by the last stable offset; ``read_last`` on the positions topic reads its
  one compacted partition.

Local state (the key state: live keys, big rows for TOAST fill, outbox versions) lives in
``state_dir``; it is rebuilt from the Kafka topics when it is missing, damaged, or
belongs to an older incarnation of a topic (Kafka's topic id).

Thread-safety: none; used by the connector thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from capture.sinks import Headers, ReadBatch, RoundRobin, TopicRecords, TopicSpec, check_cleanup_policy
from eventstore.errors import ConfigError, TopicExistsError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.offsets import TopicPartition
from eventstore.partitioner import partitions_for_keys
from eventstore.topic import TopicConfig, TopicMetadata
from schemas.registry import SchemaStore

log = logging.getLogger("capture.sink")

TRANSACTION_TIMEOUT_MS = 120_000  # a batch (and a snapshot chunk) commits well within it; broker cap: 15 min
LINGER_MS = 5


class KafkaLogSink:
    """Capture's sink over the Kafka cluster at ``bootstrap_servers``."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        state_dir: Path,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if replication_factor is not None and replication_factor < 1:
            raise ConfigError(f"--replication-factor must be ≥ 1, not {replication_factor}")
        if min_insync_replicas is not None and min_insync_replicas > (replication_factor or min_insync_replicas):
            raise ConfigError(
                f"--min-insync-replicas {min_insync_replicas} exceeds --replication-factor {replication_factor}: "
                "no write with acks=all could ever succeed"
            )
        self.bootstrap_servers = bootstrap_servers
        self.state_dir = state_dir
        self.replication_factor = replication_factor
        self.min_insync_replicas = min_insync_replicas
        self.timeout_s = timeout_s
        self.admin = KafkaAdmin(bootstrap_servers, timeout_s=timeout_s)
        self.producer: KafkaProducer | None = None
        self._reader: KafkaReader | None = None
        self._schemas: KafkaSchemaStore | None = None
        self._partitions: dict[str, int] = {}
        self._round_robin = RoundRobin()

    def describe(self) -> str:
        return f"Kafka at {self.bootstrap_servers}"

    def open(self, transactional_id: str) -> None:
        if self.producer is not None:
            self.producer.close()
        self.producer = KafkaProducer(
            self.bootstrap_servers,
            transactional_id=transactional_id,
            transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
            linger_ms=LINGER_MS,
            timeout_s=self.timeout_s,
        )
        self.producer.init_transactions()  # aborts what a killed predecessor left open, fences zombies

    def _producer(self) -> KafkaProducer:
        if self.producer is None:
            raise RuntimeError("sink not opened")
        return self.producer

    # ------------------------------------------------------------------ topics

    def ensure_topic(self, topic: str, spec: TopicSpec) -> int:
        n = self._partitions.get(topic)
        if n is not None:
            return n
        overrides = {**({"cleanup_policy": "compact"} if spec.compact else {}), **spec.overrides}
        if topic not in self.admin.topics():
            try:
                self.admin.create_topic(
                    topic,
                    spec.partitions,
                    TopicConfig(),
                    overrides=dict(overrides),
                    replication_factor=self.replication_factor,
                    min_insync_replicas=self.min_insync_replicas,
                )
                log.info("capture: created Kafka topic %s (%d partitions, %s)", topic, spec.partitions, overrides)
            except TopicExistsError:
                pass  # created meanwhile by another process: checked below like any other
        meta = self._topic(topic)
        check_cleanup_policy(topic, spec, meta.config.cleanup_policy, what="Kafka topic", setting="cleanup.policy")
        self._partitions[topic] = meta.partitions
        return meta.partitions

    def _topic(self, topic: str) -> TopicMetadata:
        """The topic's metadata; a topic just created may be unknown to the broker asked for a moment
        (metadata reaches each broker of a cluster on its own time): asked again until ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.admin.topic(topic)
            except UnknownTopicError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def topic_incarnation(self, topic: str) -> str | None:
        """Kafka's topic id. A topic this sink ensured exists: asked again while the broker asked does
        not know it yet (a None here would read as "another incarnation" on the next start)."""
        deadline = time.monotonic() + self.timeout_s
        while (found := self.admin.topic_id(topic)) is None and topic in self._partitions:
            if time.monotonic() >= deadline:
                raise UnknownTopicError(topic)
            time.sleep(0.1)
        return found

    # ------------------------------------------------------------------ writing

    def begin(self) -> None:
        self._producer().begin_transaction()

    def append(
        self, batch: Mapping[str, TopicRecords], *, also: Iterable[tuple[str, int]] = ()
    ) -> dict[tuple[str, int], int]:
        """Produce the batch inside the open transaction without waiting: the acknowledgements are
        taken at :meth:`commit` (``commit_transaction`` flushes, and fails if a record failed), so
        a batch costs one wait, not two. librdkafka adds the partitions to the transaction as it
        sends: ``also`` needs nothing. Returns ``{}``: the offsets come with the commit."""
        plan: list[tuple[str, int, Sequence[bytes | None], Sequence[bytes | None], Sequence[Headers | None] | None]]
        plan = []
        for topic, records in batch.items():
            if not len(records):
                continue
            n = self._partitions.get(topic) or self.ensure_known(topic)
            keys, values, headers = records.keys, records.values, records.headers
            if n == 1 or all(k is None for k in keys):
                target = 0 if n == 1 else self._round_robin.next(topic, n)
                plan.append((topic, target, keys, values, headers))
                continue
            parts = partitions_for_keys(pa.array(keys, pa.binary()), n)
            if (parts < 0).any():  # keyless records among keyed ones: one partition for them
                parts[parts < 0] = self._round_robin.next(topic, n)
            for p in np.unique(parts).tolist():
                idx = np.flatnonzero(parts == p).tolist()
                plan.append((
                    topic,
                    int(p),
                    [keys[i] for i in idx],
                    [values[i] for i in idx],
                    [headers[i] for i in idx] if headers is not None else None,
                ))
        if plan:
            self._producer().send_many(plan, wait=False)
        return {}

    def ensure_known(self, topic: str) -> int:
        """The partition count of a topic capture did not create in this run (it exists: ensure_topic ran)."""
        n = self._partitions[topic] = self._topic(topic).partitions
        return n

    def commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        producer = self._producer()
        if value is not None:
            producer.send_many([(position_topic, 0, [key], [value], None)], wait=False)
        producer.commit_transaction()  # returns once Kafka committed: only then is the LSN confirmed
        placed = producer.take_delivered()
        placed.pop((position_topic, 0), None)
        return {tp: first + count for tp, (first, count) in placed.items()}

    def abort(self) -> None:
        self._producer().abort_transaction()

    # ------------------------------------------------------------------ reading

    def _reader_(self) -> KafkaReader:
        if self._reader is None:
            self._reader = KafkaReader(self.bootstrap_servers, timeout_s=self.timeout_s)
        return self._reader

    def end_offsets(self, topic: str) -> dict[int, int]:
        """The last stable offsets, once no transaction is open on the topic's partitions (up to
        ``timeout_s``): a commit's markers land just after it returned, and the key state catching
        up must read a batch whole. Only this connector writes these topics, and it calls this
        before it writes to a topic in its own open transaction (a predecessor's was aborted by
        ``open``), so the wait is short."""
        if topic not in self._partitions and topic not in self.admin.topics():
            return {}
        deadline = time.monotonic() + self.timeout_s
        while True:
            stable = self.admin.stable_offsets(topic)
            if stable == self.admin.high_watermarks(topic) or time.monotonic() >= deadline:
                return stable
            time.sleep(0.05)

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[ReadBatch]:
        if start >= end:
            return
        reader = self._reader_()
        tp = TopicPartition(topic, partition)
        low, _ = reader.end_offsets(tp)
        for chunk in reader.read_chunks_to_end(tp, max(start, low)):
            n = len(chunk.offsets)
            stop = n
            while stop and chunk.offsets[stop - 1] >= end:
                stop -= 1
            if stop:
                yield ReadBatch(chunk.offsets[:stop], chunk.keys[:stop], chunk.values[:stop])
            if stop < n or (n and chunk.offsets[-1] >= end - 1):
                return

    def read_last(self, topic: str, partition: int, key: bytes) -> bytes | None:
        if topic not in self.admin.topics():
            return None
        found: bytes | None = None
        for chunk in self._reader_().read_chunks_to_end(TopicPartition(topic, partition)):
            for k, v in zip(chunk.keys, chunk.values, strict=True):
                if k == key:
                    found = v
        return found

    def schema_store(self) -> SchemaStore:
        """The cluster's ``_schemas`` topic (Confluent's layout: ``tideline schemas serve --kafka`` serves it)."""
        if self._schemas is None:
            self._schemas = KafkaSchemaStore(self.bootstrap_servers, timeout_s=self.timeout_s)
        return self._schemas

    def default_state_dir(self) -> Path:
        return self.state_dir

    def close(self) -> None:
        if self._schemas is not None:
            self._schemas.close()
            self._schemas = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self.producer is not None:
            self.producer.close()
            self.producer = None
