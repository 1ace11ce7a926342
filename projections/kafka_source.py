"""Apache Kafka as a projection source (:class:`~projections.sources.LogSource`).

Spark reads Kafka with **its own Kafka source** (``format("kafka")``, the
``spark-sql-kafka-0-10`` jars of :mod:`projections.spark_kafka`, which the session must
have on ``spark.jars``: :func:`projections.engine.make_session` with ``kafka=True``):

- batch (``rebuild``): ``assign`` the partitions to read, ``startingOffsets`` earliest and
  ``endingOffsets`` the offsets the rebuild fixed at its start (last stable offsets, read
  with ``ListOffsets`` at read_committed), ``kafka.isolation.level=read_committed``. Kafka's
  batch source plans one Spark partition per Kafka partition (no ``minPartitions``), in
  offset order: what a fold rebuild's ``wholePartitions`` asks of the embedded source.
- streaming (``follow --engine spark``): ``subscribePattern`` of exactly the view's topics
  (``subscribe`` fails on a topic that does not exist yet; a pattern picks it up when it
  appears, from its earliest offset), ``startingOffsets`` the Postgres checkpoints,
  ``maxOffsetsPerTrigger``; Spark's checkpoint holds ``{"topic": {"0": next offset}}`` as
  for the embedded source, and the offsets committed with the view rows stay the truth.

Every frame is brought to the ``tideline`` source's columns (``is_tombstone`` = value is
null; ``headers`` null when a record has none, as both sources give them).

Capture's Avro framing (``--value-format avro``) is not decoded here: the schema registry
lives in the embedded log so far. A framed key or value fails the read naming it rather
than being taken for data.

The live engine reads with a librdkafka consumer (:class:`KafkaLiveReader`): ``assign``
and seek to the stored checkpoints, ``isolation.level=read_committed``,
``auto.offset.reset=error``, no group membership, nothing committed to Kafka.

Thread-safety: :class:`KafkaSource` may be shared (its admin client is thread-safe; each
reading call makes its own client); :class:`KafkaCapturePositions` and
:class:`KafkaLiveReader` belong to one thread (``KafkaLiveReader.wakeup`` excepted).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as KafkaTopicPartition

from eventstore.errors import ConfigError, OffsetOutOfRangeError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaReader, client_config
from eventstore.kafka.config import translate
from eventstore.offsets import TopicPartition
from projections.apply import LogRecord
from projections.sources import CapturePositionReader, LogSource
from projections.store import Offsets
from schemas.position import POSITIONS_TOPIC, SourcePosition

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, DataFrameReader, SparkSession
    from pyspark.sql.streaming.readwriter import DataStreamReader

__all__ = ["KafkaCapturePositions", "KafkaLiveReader", "KafkaSource"]

READ_COMMITTED = "read_committed"
LIVE_GROUP_ID = "tideline-projections-live"  # librdkafka wants one; never joined (assign) nor committed
FETCH_WAIT_MAX_MS = 10  # the broker's long-poll: a live reader waits in slices of its own, not there
WAIT_SLICE_S = 0.05  # a waiting live reader checks wakeup() at least this often
FRAMED = b"\x00"  # Confluent's Avro framing starts with a zero byte; capture's JSON never does


def _framed_error(what: str, topic: str, partition: int, offset: int) -> ConfigError:
    return ConfigError(
        f"{topic}[{partition}] offset {offset}: the {what} is framed Avro (capture --value-format avro); "
        "projections decode it only on the embedded log (its schema registry), not on Kafka yet"
    )


def _check_json(record: LogRecord) -> LogRecord:
    for what, data in (("key", record.key), ("value", record.value)):
        if data is not None and data[:1] == FRAMED:
            raise _framed_error(what, record.topic, record.partition, record.offset)
    return record


class KafkaSource(LogSource):
    """The Kafka cluster at ``bootstrap_servers`` (``HOST:PORT[,…]``)."""

    def __init__(self, bootstrap_servers: str) -> None:
        if not bootstrap_servers.strip():
            raise ConfigError("Kafka bootstrap servers are empty: give HOST:PORT[,HOST:PORT…]")
        self.bootstrap_servers = bootstrap_servers
        self.description = f"Kafka at {bootstrap_servers}"
        self._admin: KafkaAdmin | None = None
        self._lock = threading.Lock()

    @property
    def admin(self) -> KafkaAdmin:
        with self._lock:
            if self._admin is None:
                self._admin = KafkaAdmin(self.bootstrap_servers)
            return self._admin

    def close(self) -> None:
        with self._lock:
            self._admin = None  # librdkafka's admin handle is released with its last reference

    # -- partitions and offsets --------------------------------------------------------------

    def partition_counts(self, topics: Iterable[str]) -> dict[str, int]:
        topics = list(topics)
        counts = self.admin.partition_counts(topics)
        return {t: counts[t] for t in topics if t in counts}

    def _partitions(self, topics: Iterable[str]) -> list[tuple[str, int]]:
        return [(t, p) for t, n in self.partition_counts(topics).items() for p in range(n)]

    def stable_offsets(self, topics: Iterable[str]) -> Offsets:
        return _grouped(self.admin.end_offsets(self._partitions(topics), read_committed=True))

    def appended_offsets(self, topics: Iterable[str]) -> Offsets:
        return _grouped(self.admin.end_offsets(self._partitions(topics), read_committed=False))

    def start_offsets(self, topics: Iterable[str]) -> Offsets:
        return _grouped(self.admin.start_offsets(self._partitions(topics)))

    # -- records -----------------------------------------------------------------------------

    def capture_positions(self) -> CapturePositionReader:
        return KafkaCapturePositions(self.bootstrap_servers)

    def records(self, topic: str, partition: int, until: int | None = None) -> Iterator[LogRecord]:
        with KafkaReader(self.bootstrap_servers) as reader:
            for chunk in reader.read_chunks_to_end(TopicPartition(topic, partition)):
                for offset, key, value in zip(chunk.offsets, chunk.keys, chunk.values, strict=True):
                    if until is not None and offset >= until:
                        return
                    yield _check_json(LogRecord(topic, partition, offset, key, value))

    def appended_at(self, topic: str, partition: int, offset: int) -> datetime | None:
        tp = TopicPartition(topic, partition)
        with KafkaReader(self.bootstrap_servers) as reader:
            low, high = reader.end_offsets(tp)
            if offset >= high:
                return None  # nothing readable there yet (the contract; reading would be out of range)
            for chunk in reader.read_chunks_to_end(tp, max(offset, low)):  # retention may have passed ``offset``
                return datetime.fromtimestamp(chunk.timestamps[0] / 1000, UTC)
        return None

    # -- Spark -------------------------------------------------------------------------------

    def _options(self) -> dict[str, str]:
        return {
            "kafka.bootstrap.servers": self.bootstrap_servers,
            "kafka.isolation.level": READ_COMMITTED,
            "includeHeaders": "true",
        }

    def batch_frame(self, spark: SparkSession, ends: Offsets, *, whole_partitions: bool = False) -> DataFrame:
        """Kafka's batch source plans one Spark partition per Kafka partition, in offset order,
        whatever ``whole_partitions`` says: what a fold rebuild needs."""
        reader: DataFrameReader = spark.read.format("kafka").options(**self._options())
        reader = (
            reader.option("assign", json.dumps({t: sorted(per) for t, per in ends.items()}))
            .option("startingOffsets", json.dumps({t: {str(p): -2 for p in per} for t, per in ends.items()}))
            .option("endingOffsets", json.dumps({t: {str(p): o for p, o in per.items()} for t, per in ends.items()}))
        )
        return tideline_columns(_loaded(reader))

    def stream_frame(
        self, spark: SparkSession, topics: Iterable[str], starting: Offsets, max_records: int | None
    ) -> DataFrame:
        pattern = "^(" + "|".join(re.escape(t) for t in topics) + ")$"
        reader: DataStreamReader = spark.readStream.format("kafka").options(**self._options())
        reader = reader.option("subscribePattern", pattern).option(
            "startingOffsets", json.dumps(starting) if starting else "earliest"
        )
        if max_records:
            reader = reader.option("maxOffsetsPerTrigger", str(max_records))
        return tideline_columns(_loaded(reader))

    # -- the live engine ---------------------------------------------------------------------

    def live_reader(self, topics: tuple[str, ...]) -> KafkaLiveReader:
        return KafkaLiveReader(self, topics)


def _grouped(offsets: dict[tuple[str, int], int]) -> Offsets:
    out: Offsets = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[partition] = offset
    return out


def _loaded(reader: DataFrameReader | DataStreamReader) -> DataFrame:
    """``reader.load()``, with a session that lacks the connector told in one line what to do."""
    from pyspark.errors import AnalysisException

    try:
        return reader.load()
    except AnalysisException as e:
        if "DATA_SOURCE_NOT_FOUND" not in str(e) and "Failed to find data source: kafka" not in str(e):
            raise
        raise ConfigError(
            "this SparkSession has no Kafka source: start it with projections.engine.make_session(..., kafka=True) "
            "(spark.jars = the spark-sql-kafka jars `make jars` fetched)"
        ) from None


def tideline_columns(kafka: DataFrame) -> DataFrame:
    """Kafka's source's columns → the ``tideline`` source's (:data:`projections.range_reader.SPARK_SCHEMA`).

    A key or value in Avro framing fails the task with a message naming the record (see the
    module docstring)."""
    from pyspark.sql import functions as F

    def plain(column: str) -> Any:
        framed = F.substring(F.col(column), 1, 1) == F.lit(FRAMED)
        message = F.format_string(
            f"%s[%d] offset %d: the {column} is framed Avro (capture --value-format avro); projections decode it "
            "only on the embedded log (its schema registry), not on Kafka yet",
            F.col("topic"),
            F.col("partition"),
            F.col("offset"),
        )
        return F.when(framed, F.raise_error(message)).otherwise(F.col(column)).alias(column)

    return kafka.select(
        "topic",
        "partition",
        "offset",
        "timestamp",
        plain("key"),
        plain("value"),
        "headers",
        F.col("value").isNull().alias("is_tombstone"),
    )


class KafkaCapturePositions:
    """Capture's stored position on Kafka, read incrementally: ``__tideline_capture_offsets``
    partition 0 from where the last call stopped to its last stable offset (read_committed),
    the latest ``confirm_lsn`` per connector kept (bounded by the number of connectors)."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.reader = KafkaReader(bootstrap_servers)
        self.latest: dict[bytes, int] = {}
        self.next_offset: int | None = None

    def lsn(self) -> int:
        tp = TopicPartition(POSITIONS_TOPIC, 0)
        try:
            chunks = list(self._read(tp))
        except UnknownTopicError:
            return 0  # capture stored no position yet
        for chunk in chunks:
            for key, value in zip(chunk.keys, chunk.values, strict=True):
                if key is not None and value is not None:
                    self.latest[key] = SourcePosition.from_json(value).confirm_lsn
            self.next_offset = chunk.offsets[-1] + 1
        return max(self.latest.values(), default=0)

    def _read(self, tp: TopicPartition) -> Iterator[Any]:
        try:
            yield from self.reader.read_chunks_to_end(tp, self.next_offset)
        except OffsetOutOfRangeError:  # retention passed where the last call stopped: read what is left
            self.next_offset = None
            yield from self.reader.read_chunks_to_end(tp)

    def close(self) -> None:
        self.reader.close()


class KafkaLiveReader:
    """The live engine's reads on Kafka (see :class:`~projections.sources.LiveReader`).

    Positions: the consumer's own (past every record delivered, and past the control
    records and aborted transactions behind them once it reached the end), or where a
    partition was assigned while it has fetched nothing yet. Capture's position topic is
    assigned too, from its end: a new stored position ends a :meth:`wait` (the reached LSN
    may move) and is otherwise dropped (:class:`KafkaCapturePositions` reads it)."""

    def __init__(self, source: KafkaSource, topics: tuple[str, ...]) -> None:
        self.source = source
        self.topics = topics
        config = client_config(
            source.bootstrap_servers,
            group_id=LIVE_GROUP_ID,
            enable_auto_commit=False,
            enable_auto_offset_store=False,
            isolation_level=READ_COMMITTED,
            enable_partition_eof=True,  # reaching the end moves the position past trailing control records
            auto_offset_reset="error",  # a checkpoint that retention passed is an error, not a silent skip
            fetch_wait_max_ms=FETCH_WAIT_MAX_MS,
        )
        try:
            self.consumer = Consumer(config)
        except KafkaException as e:
            translate(e, what="creating a consumer", bootstrap=source.bootstrap_servers)
        self._assigned: dict[tuple[str, int], int] = {}  # view partitions → position while none is fetched
        self._watching_positions = False
        self._stash: list[Message] = []  # what a wait() received: read() returns it first
        self._woken = threading.Event()

    def assign(self, offsets: Offsets) -> None:
        self._stash.clear()
        self._assigned = {}
        self._add(self.source.partition_counts(self.topics), offsets, replace=True)

    def refresh(self) -> None:
        missing = [t for t in self.topics if not any(tp[0] == t for tp in self._assigned)]
        if not missing and self._watching_positions:
            return
        counts = self.source.partition_counts([*missing, POSITIONS_TOPIC])
        if any(t in counts for t in missing) or (POSITIONS_TOPIC in counts and not self._watching_positions):
            self._add(counts, {}, replace=False)

    def _add(self, counts: dict[str, int], offsets: Offsets, *, replace: bool) -> None:
        """Assign the view partitions of ``counts`` not assigned yet (at ``offsets``, else their
        start) and capture's position topic (at its end), keeping the others' positions."""
        new = [(t, p) for t in self.topics if t in counts for p in range(counts[t]) if (t, p) not in self._assigned]
        unstored = [tp for tp in new if offsets.get(tp[0], {}).get(tp[1]) is None]
        starts = self.source.admin.start_offsets(unstored) if unstored else {}
        for t, p in new:
            stored = offsets.get(t, {}).get(p)
            self._assigned[(t, p)] = starts[(t, p)] if stored is None else stored
        assignment = [KafkaTopicPartition(t, p, o) for (t, p), o in self._assigned.items() if replace or (t, p) in new]
        watch = POSITIONS_TOPIC in counts and (replace or not self._watching_positions)
        if watch:
            assignment.append(KafkaTopicPartition(POSITIONS_TOPIC, 0, OFFSET_END))
        try:
            if replace:
                self.consumer.assign(assignment)
            elif assignment:
                self.consumer.incremental_assign(assignment)
        except KafkaException as e:
            translate(e, what="assigning partitions", bootstrap=self.source.bootstrap_servers)
        self._watching_positions = watch if replace else self._watching_positions or watch

    def positions(self) -> Offsets:
        if self._assigned:
            tps = [KafkaTopicPartition(t, p) for t, p in self._assigned]
            try:
                current = self.consumer.position(tps)
            except KafkaException as e:
                translate(e, what="reading positions", bootstrap=self.source.bootstrap_servers)
            for tp in current:
                if tp.offset >= 0:  # negative: nothing fetched since assigned
                    self._assigned[(tp.topic, tp.partition)] = tp.offset
        return _grouped(self._assigned)

    def end_offsets(self) -> Offsets:
        return _grouped(self.source.admin.end_offsets(list(self._assigned), read_committed=True))

    def read(self, max_records: int) -> list[LogRecord]:
        messages, self._stash = self._stash, []
        if len(messages) < max_records:
            messages += self._consume(max_records - len(messages), 0)
        records: list[LogRecord] = []
        for message in messages:
            topic, partition, offset = message.topic() or "", message.partition() or 0, message.offset() or 0
            if message.error() is not None or topic == POSITIONS_TOPIC:
                continue  # the end reached / capture stored a position: only wakes a wait
            records.append(_check_json(LogRecord(topic, partition, offset, message.key(), message.value())))
        return records

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._stash and not self._woken.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._stash += self._consume(1, min(WAIT_SLICE_S, remaining))
        self._woken.clear()

    def wakeup(self) -> None:
        self._woken.set()

    def close(self) -> None:
        self.consumer.close()

    def _consume(self, n: int, timeout: float) -> list[Message]:
        """Up to ``n`` messages (records and end-of-partition events) within ``timeout`` seconds."""
        try:
            messages = self.consumer.consume(n, timeout)
        except KafkaException as e:
            translate(e, what="reading", bootstrap=self.source.bootstrap_servers)
        for message in messages:
            error = message.error()
            if error is None or error.code() == KafkaError._PARTITION_EOF:
                continue
            where = f"{message.topic()}[{message.partition()}]"
            if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                raise OffsetOutOfRangeError(
                    f"{where}: the checkpoint is outside what Kafka still holds (retention removed it): {error.str()}"
                )
            translate(error, what=f"reading {where}", bootstrap=self.source.bootstrap_servers, topic=message.topic())
        return messages
