"""The embedded log (``eventstore``) as a projection source (:class:`~projections.sources.LogSource`).

Spark reads it with the ``tideline`` data source (:mod:`projections.datasource`,
read_committed, Avro-framed keys and values decoded through the log's registry); the
live engine with a :class:`~eventstore.consumer.Consumer` woken by the log's change
notifications (:class:`~eventstore.notify.ChangeWaiter`: inotify on the partitions'
directories, on capture's position topic and on ``_topics/``).

Thread-safety: :class:`EmbeddedSource` opens one :class:`~eventstore.log.Log` on first
use and shares it (``Log`` is thread-safe); :class:`EmbeddedLiveReader` belongs to one
thread, except ``wakeup``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import ConfigError
from eventstore.isolation import IsolationLevel
from eventstore.log import Log
from eventstore.notify import ChangeWaiter
from eventstore.schema_store import FramedDecoder
from eventstore.topic import TOPICS_DIR
from projections.apply import LogRecord
from projections.consistency import CapturePositions, appended_offsets, stable_offsets
from projections.planning import OffsetRange
from projections.sources import CapturePositionReader, LogSource
from projections.store import Offsets
from schemas.position import POSITIONS_TOPIC

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["EmbeddedLiveReader", "EmbeddedSource"]


class EmbeddedSource(LogSource):
    """The embedded log at ``log_dir`` (``create``: made if missing, as a follow job may start first)."""

    def __init__(self, log_dir: Path, *, create: bool = False) -> None:
        self.log_dir = log_dir
        self.create = create
        self.description = f"the log at {log_dir}"
        self._log: Log | None = None
        self._lock = threading.Lock()

    @property
    def log(self) -> Log:
        """The log, opened on first use (a missing one is an error unless ``create``)."""
        with self._lock:
            if self._log is None:
                self._log = Log(self.log_dir, create=self.create)
            return self._log

    def exists(self) -> bool:
        return self._log is not None or self.log_dir.exists()

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    # -- partitions and offsets --------------------------------------------------------------

    def partition_counts(self, topics: Iterable[str]) -> dict[str, int]:
        existing = set(self.log.topics())
        return {t: self.log.topic(t).partitions for t in topics if t in existing}

    def stable_offsets(self, topics: Iterable[str]) -> Offsets:
        return stable_offsets(self.log, topics)

    def appended_offsets(self, topics: Iterable[str]) -> Offsets:
        return appended_offsets(self.log, topics)

    def start_offsets(self, topics: Iterable[str]) -> Offsets:
        counts = self.partition_counts(topics)
        return {t: {p: self.log.partition(t, p).log_start_offset() for p in range(n)} for t, n in counts.items()}

    # -- records -----------------------------------------------------------------------------

    def capture_positions(self) -> CapturePositionReader:
        return CapturePositions(self.log)

    def records(self, topic: str, partition: int, until: int | None = None) -> Iterator[LogRecord]:
        decoder = FramedDecoder(self.log, lambda problem: None)  # Avro-framed keys/values → capture's JSON
        with Consumer(self.log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED) as c:
            c.assign([TopicPartition(topic, partition)])
            c.seek_to_beginning()
            while batch := c.poll(timeout_ms=0):
                for r in batch:
                    if until is not None and r.offset >= until:
                        return
                    key, value = decoder.decode(r.key)[0], decoder.decode(r.value)[0]
                    yield LogRecord(topic, partition, r.offset, key, value)

    def appended_at(self, topic: str, partition: int, offset: int) -> datetime | None:
        with Consumer(self.log, enable_auto_commit=False, auto_offset_reset="earliest") as consumer:
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, offset)
            for record in consumer.poll(timeout_ms=0, max_records=1):
                return datetime.fromtimestamp(record.timestamp / 1000, UTC)
        return None

    # -- Spark -------------------------------------------------------------------------------

    def task_ranges(self, ends: Offsets) -> tuple[str, list[OffsetRange]]:
        ranges = [
            OffsetRange(topic, p, self.log.partition(topic, p).log_start_offset(), end)
            for topic, per in ends.items()
            for p, end in sorted(per.items())
        ]
        return str(self.log_dir), [r for r in ranges if r.end > r.start]

    def batch_frame(self, spark: SparkSession, ends: Offsets, *, whole_partitions: bool = False) -> DataFrame:
        return (
            spark.read.format("tideline")
            .option("path", str(self.log_dir))
            .option("subscribe", ",".join(ends))
            .option("decodeAvro", "true")  # capture's --value-format avro: read as its JSON
            .option("wholePartitions", str(whole_partitions).lower())
            .option("startingOffsets", "earliest")
            .option("endingOffsets", json.dumps({t: {str(p): o for p, o in per.items()} for t, per in ends.items()}))
            .load()
        )

    def stream_frame(
        self, spark: SparkSession, topics: Iterable[str], starting: Offsets, max_records: int | None
    ) -> DataFrame:
        reader = (
            spark.readStream.format("tideline")
            .option("path", str(self.log_dir))
            .option("subscribe", ",".join(topics))
            .option("decodeAvro", "true")  # capture's --value-format avro: read as its JSON
            .option("startingOffsets", json.dumps(starting))
        )
        if max_records:
            reader = reader.option("maxRecordsPerTrigger", str(max_records))
        return reader.load()

    # -- the live engine ---------------------------------------------------------------------

    def live_reader(self, topics: tuple[str, ...]) -> EmbeddedLiveReader:
        return EmbeddedLiveReader(self.log, topics)


class _Decoder:
    """Capture's Avro framing → its JSON (a fresh registry view once, when a schema id is missing:
    capture registers schemas as it meets new table shapes)."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self._decoder: FramedDecoder | None = None

    def __call__(self, data: bytes | None, what: str, tp: TopicPartition, offset: int) -> bytes | None:
        if data is None or data[:1] != b"\x00":
            return data  # JSON (or raw): as stored
        for fresh in (False, True):
            if self._decoder is None or fresh:
                self._decoder = FramedDecoder(self.log, lambda note: None)
            decoded, schema_id = self._decoder.decode(data)
            if schema_id is not None:
                return decoded
        raise ConfigError(
            f"{tp.topic}[{tp.partition}] offset {offset}: the {what} is framed Avro but does not decode with the "
            f"registry of {self.log.path} (topic __schemas)"
        )


class EmbeddedLiveReader:
    """The live engine's reads on the embedded log: a read_committed :class:`Consumer` (no group,
    no commits) and a :class:`ChangeWaiter` on what can change a view or its reached LSN."""

    def __init__(self, log: Log, topics: tuple[str, ...]) -> None:
        self.log = log
        self.topics = topics
        self.decode = _Decoder(log)
        self.consumer = Consumer(log, enable_auto_commit=False, auto_offset_reset="none")
        self.waiter = ChangeWaiter()

    def assign(self, offsets: Offsets) -> None:
        existing = set(self.log.topics())
        wanted = [TopicPartition(t, p) for t in self.topics if t in existing for p in range(self._partitions(t))]
        self.consumer.assign(wanted)
        self._seek(wanted, offsets)

    def refresh(self) -> None:
        assigned = {tp.topic for tp in self.consumer.assignment()}
        missing = [t for t in self.topics if t not in assigned]
        if missing:
            existing = set(self.log.topics())
            new = [TopicPartition(t, p) for t in missing if t in existing for p in range(self._partitions(t))]
            if new:
                self.consumer.assign([*self.consumer.assignment(), *new])  # keeps the positions of the others
                self._seek(new, {})
        with suppress(OSError):  # a directory vanished: watched again next cycle
            self.waiter.set_watched(self._watched())  # watch first, then read

    def positions(self) -> Offsets:
        out: Offsets = {}
        for tp in self.consumer.assignment():
            out.setdefault(tp.topic, {})[tp.partition] = self.consumer.position(tp)
        return out

    def end_offsets(self) -> Offsets:
        out: Offsets = {}
        for tp, offset in self.consumer.end_offsets(self.consumer.assignment()).items():
            out.setdefault(tp.topic, {})[tp.partition] = offset
        return out

    def read(self, max_records: int) -> list[LogRecord]:
        records: list[LogRecord] = []
        while len(records) < max_records:
            polled = self.consumer.poll(timeout_ms=0, max_records=max_records - len(records))
            if not polled:
                break
            for r in polled:
                tp = TopicPartition(r.topic, r.partition)
                key = self.decode(r.key, "key", tp, r.offset)
                value = self.decode(r.value, "value", tp, r.offset)
                records.append(LogRecord(r.topic, r.partition, r.offset, key, value))
        return records

    def wait(self, timeout: float) -> None:
        self.waiter.wait(timeout)

    def wakeup(self) -> None:
        with suppress(ValueError):  # closed meanwhile
            self.waiter.wakeup()

    def close(self) -> None:
        try:
            self.consumer.close()
        finally:
            self.waiter.close()

    def _partitions(self, topic: str) -> int:
        return self.log.topic(topic).partitions

    def _seek(self, partitions: Iterable[TopicPartition], offsets: Offsets) -> None:
        for tp in partitions:
            stored = offsets.get(tp.topic, {}).get(tp.partition)
            if stored is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, stored)

    def _watched(self) -> list[Path]:
        dirs = [self.log.partition(tp.topic, tp.partition).directory for tp in self.consumer.assignment()]
        if POSITIONS_TOPIC in self.log.topics():  # capture stored a position: the reached LSN may move
            dirs.append(self.log.partition(POSITIONS_TOPIC, 0).directory)
        topics_dir = self.log.path / TOPICS_DIR
        if topics_dir.is_dir():  # a view topic may appear
            dirs.append(topics_dir)
        return dirs
