"""The schema registry's store in Kafka: the compacted topic ``_schemas``, Confluent's record layout.

:class:`KafkaSchemaStore` implements :class:`schemas.registry.SchemaStore` on a Kafka
cluster, as :class:`eventstore.schema_store.LogSchemaStore` does on the embedded log; the
registry (``schemas.registry``) and its REST API (``schemas.rest``) run unchanged on
either.

The topic: ``_schemas`` (Confluent Schema Registry's default ``kafkastore.topic``), 1
partition (one total order of registrations), ``cleanup.policy=compact`` (the registry's
state is the last value per key), created by the first writer with the brokers' default
replication factor and ``min.insync.replicas`` (give a 3-broker cluster a default of 3 / 2,
as Confluent does for its topic). Readers create nothing: a missing topic is an empty
registry.

Record layout — Confluent's ``_schemas`` records, keys and values JSON (UTF-8), the
keys' fields in Confluent's order so that a key is the same bytes whoever writes it
(compaction compares bytes); the meaning of each field is in :mod:`schemas.registry`::

    schema   key    {"keytype":"SCHEMA","subject":<str>,"version":<int ≥ 1>,"magic":1}
             value  {"subject":<str>,"version":<int>,"id":<int ≥ 1>,"schema":<schema JSON text>,
                     "deleted":false}
    config   key    {"keytype":"CONFIG","subject":<str> | null,"magic":0}
             value  {"compatibilityLevel":"BACKWARD|…|NONE"}  |  null (tombstone: back to the default)

(Confluent omits ``schemaType`` for Avro, the only type Tideline registers; a record
Tideline does not understand — Confluent's ``NOOP`` and ``DELETE_SUBJECT`` keys, other
schema types — is skipped by the registry's replay.) Records carry no headers.

Positions: a position is a Kafka offset of partition 0. ``read_from(p)`` returns the
committed records at offsets ≥ p (``read_committed``: records of aborted transactions
never) and the consumer's position at the end of the partition: the *last stable
offset*, past the commit markers, so that a refresh with nothing new costs one
watermark request.

Writes — durable, and serialized across processes by fencing:

* Every record is written in a Kafka transaction by an idempotent producer with
  ``acks=all`` and the fixed ``transactional.id`` ``tideline-schema-registry`` (shared by
  every writer of one cluster's registry: ``tideline schemas serve``, capture in Avro
  mode, ``tideline schemas compatibility``). ``append`` returns once the transaction is
  committed, i.e. on every in-sync replica.
* :meth:`locked` makes the writer (on first use): ``init_transactions`` bumps the
  epoch of the transactional id — it *fences* every older writer, aborts a transaction
  one of them left open and waits for one it was committing — and only then does the
  registry read to the end, check, and pick the next id and version. Any other writer
  that commits after our read must have run ``init_transactions`` after ours, which
  fences us: our ``append`` then fails with :class:`~schemas.errors.SchemaStoreConflictError`
  having written nothing, and the registry redoes the write from a fresh read (with a
  new producer, which fences the other in turn). So two writers never hand out one id,
  whatever they interleave; a writer that stays alone keeps its producer.
* Read your writes: Kafka writes a transaction's commit marker after
  ``commit_transaction`` returns, so the record may not be readable at once; the store
  remembers the offset after its last append and ``read_from`` reads on until the
  partition's stable end has passed it.

Crash policy: a writer killed before its commit leaves an open transaction, aborted by
the next writer's ``init_transactions`` or by the transaction timeout (10 s), so the
registration is absent, never half; read_committed readers stop before it meanwhile. A
commit whose outcome is unknown (a timeout) raises; registrations are idempotent, so
registering again is always safe.

Thread-safety: thread-safe; one re-entrant lock (``_lock``) guards the producer and the
consumer (the registry calls ``read_from`` inside ``locked``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as KafkaTopicPartition

from eventstore.errors import InvalidTxnStateError, ProducerFencedError, TidelineError
from eventstore.kafka.admin import KafkaAdmin
from eventstore.kafka.config import client_config, translate, watermarks
from eventstore.kafka.producer import KafkaProducer
from eventstore.topic import CleanupPolicy, TopicConfig
from schemas.errors import SchemaStoreConflictError
from schemas.registry import CONFIG_KEYTYPE, SCHEMA_KEYTYPE

SCHEMAS_TOPIC = "_schemas"
WRITER_TRANSACTIONAL_ID = "tideline-schema-registry"
READER_GROUP = "tideline-schema-registry-reader"  # required by librdkafka; never joined nor committed (assign)
TRANSACTION_TIMEOUT_MS = 10_000
DEFAULT_TIMEOUT_S = 30.0
CONSUME_BATCH = 1_000
POLL_SECONDS = 0.05
FETCH_WAIT_MAX_MS = 20  # the broker's wait for more data: reads stop at the end, long-polling there only delays it
PARTITION = 0

# Confluent's field order of each record kind (keys: so that equal keys are equal bytes).
SCHEMA_KEY_FIELDS = ("keytype", "subject", "version", "magic")
CONFIG_KEY_FIELDS = ("keytype", "subject", "magic")
SCHEMA_VALUE_FIELDS = ("subject", "version", "id", "schemaType", "references", "schema", "deleted")


def schemas_topic_config() -> TopicConfig:
    return TopicConfig(cleanup_policy=CleanupPolicy.COMPACT)


def confluent_record(key: bytes, value: bytes | None) -> tuple[bytes, bytes | None]:
    """The registry's record with its JSON fields in Confluent's order (unknown kinds: as given)."""
    parsed = orjson.loads(key)
    keytype = parsed.get("keytype") if isinstance(parsed, dict) else None
    if keytype == SCHEMA_KEYTYPE:
        key = _ordered(parsed, SCHEMA_KEY_FIELDS)
        if value is not None:
            value = _ordered(orjson.loads(value), SCHEMA_VALUE_FIELDS)
    elif keytype == CONFIG_KEYTYPE:
        key = _ordered(parsed, CONFIG_KEY_FIELDS)
    return key, value


def _ordered(fields: dict[str, object], order: tuple[str, ...]) -> bytes:
    ordered = {name: fields[name] for name in order if name in fields}
    ordered.update((name, v) for name, v in sorted(fields.items()) if name not in ordered)
    return orjson.dumps(ordered)


class KafkaSchemaStore:
    """The registry's records in ``_schemas`` of the Kafka cluster at ``bootstrap_servers``.

    >>> registry = SchemaRegistry(KafkaSchemaStore("127.0.0.1:9092"))     # doctest: +SKIP
    >>> registry.register("orders-value", '"long"').id                      # doctest: +SKIP
    1
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        topic: str = SCHEMAS_TOPIC,
        transactional_id: str = WRITER_TRANSACTIONAL_ID,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.transactional_id = transactional_id
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._producer: KafkaProducer | None = None
        self._consumer: Consumer | None = None
        self._topic_seen = False
        self._readable_end = 0  # the offset after this store's last append: read_from reads at least to it

    # ------------------------------------------------------------------ SchemaStore

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The writer's section: the producer exists and has fenced every older writer (see the module doc)."""
        with self._lock:
            self._writer()
            yield

    def append(self, key: bytes, value: bytes | None) -> None:
        """Write one record in a transaction; return once it is committed. SchemaStoreConflictError if fenced."""
        key, value = confluent_record(key, value)
        with self._lock:
            producer = self._writer()
            try:
                producer.begin_transaction()
                sent = producer.send_batch(self.topic, [value], [key], partition=PARTITION)
                producer.commit_transaction()
            except ProducerFencedError as e:
                self._drop_writer()
                raise SchemaStoreConflictError(
                    f"another schema registry writer took over {self.topic} on {self.bootstrap_servers}"
                ) from e
            except TidelineError as e:
                self._abort_quietly(producer)
                raise TidelineError(
                    f"schema registry: writing to {self.topic} on {self.bootstrap_servers} failed, the record may "
                    f"or may not be stored ({e}); registering again is safe"
                ) from e
            first_offset, _ = sent[PARTITION]
            self._readable_end = max(self._readable_end, first_offset + 1)

    def read_from(self, position: int) -> tuple[list[tuple[bytes, bytes | None]], int]:
        """Committed records at offsets ≥ ``position``, and the partition's stable end after them."""
        with self._lock:
            consumer = self._reader()
            if not self._topic_exists(consumer):
                return [], position
            low, high = self._watermarks(consumer)
            start = max(position, low)  # below the log start nothing is left (no live key is ever there)
            if start >= high and start >= self._readable_end:
                return [], start
            return self._read(consumer, start)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        with self._lock:
            self._drop_writer()
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None

    def __enter__(self) -> KafkaSchemaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writing

    def _writer(self) -> KafkaProducer:
        if self._producer is None:
            KafkaAdmin(self.bootstrap_servers, timeout_s=self.timeout_s).ensure_topic(
                self.topic, 1, schemas_topic_config()
            )
            producer = KafkaProducer(
                self.bootstrap_servers,
                transactional_id=self.transactional_id,
                transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
                linger_ms=0,
                timeout_s=self.timeout_s,
            )
            producer.init_transactions()  # fences older writers: see the module docstring
            self._producer = producer
        return self._producer

    def _drop_writer(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            producer.close()

    def _abort_quietly(self, producer: KafkaProducer) -> None:
        try:
            producer.abort_transaction()
        except (TidelineError, InvalidTxnStateError):
            self._drop_writer()  # unusable: the next write makes (and fences with) a new one

    # ------------------------------------------------------------------ reading

    def _read(self, consumer: Consumer, start: int) -> tuple[list[tuple[bytes, bytes | None]], int]:
        """Consume from ``start`` to the stable end (and past this store's own last append)."""
        tp = KafkaTopicPartition(self.topic, PARTITION, start)
        consumer.assign([tp])
        out: list[tuple[bytes, bytes | None]] = []
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                end = self._consume_some(consumer, out)
                if end is not None and end >= self._readable_end:
                    return out, end
                if time.monotonic() > deadline:
                    raise TidelineError(
                        f"Kafka at {self.bootstrap_servers}: no end of {self.topic}-{PARTITION} within "
                        f"{self.timeout_s:.0f}s (a transaction left open by a killed writer ends within "
                        f"{TRANSACTION_TIMEOUT_MS // 1000}s)"
                    )
        finally:
            consumer.unassign()

    def _consume_some(self, consumer: Consumer, out: list[tuple[bytes, bytes | None]]) -> int | None:
        """One poll's records into ``out``; the end offset if this poll reached the partition's stable end."""
        try:
            messages: list[Message] = consumer.consume(CONSUME_BATCH, POLL_SECONDS)
        except KafkaException as e:
            self._translate(e)
        end = None
        for msg in messages:
            err = msg.error()
            if err is None:
                key = msg.key()
                if key is not None:
                    out.append((key, msg.value()))
            elif err.code() == KafkaError._PARTITION_EOF:
                end = msg.offset()  # the next offset to read: the last stable offset
            else:
                self._translate(err)
        return end

    def _reader(self) -> Consumer:
        if self._consumer is None:
            config = client_config(
                self.bootstrap_servers,
                group_id=READER_GROUP,
                enable_auto_commit=False,
                enable_auto_offset_store=False,
                isolation_level="read_committed",
                enable_partition_eof=True,
                fetch_wait_max_ms=FETCH_WAIT_MAX_MS,
            )
            try:
                self._consumer = Consumer(config)
            except KafkaException as e:
                self._translate(e)
        return self._consumer

    def _topic_exists(self, consumer: Consumer) -> bool:
        if not self._topic_seen:
            try:
                found = consumer.list_topics(self.topic, timeout=self.timeout_s).topics.get(self.topic)
            except KafkaException as e:
                self._translate(e)
            self._topic_seen = found is not None and found.error is None and PARTITION in found.partitions
        return self._topic_seen

    def _watermarks(self, consumer: Consumer) -> tuple[int, int]:
        try:
            low, high = watermarks(consumer, KafkaTopicPartition(self.topic, PARTITION), timeout_s=self.timeout_s)
        except KafkaException as e:
            self._translate(e)
        return int(low), int(high)

    def _translate(self, error: KafkaException | KafkaError) -> NoReturn:
        translate(error, what=f"reading the schema registry topic {self.topic}", bootstrap=self.bootstrap_servers,
                  topic=self.topic)  # fmt: skip
