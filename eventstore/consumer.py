"""The consumer: pull records by offset from assigned partitions.

Kafka's vocabulary: ``assign`` partitions, ``seek`` (to an offset, the beginning, the
end, or a time through the time index), ``poll`` whole batches, ``position``. Records
come back as :class:`ConsumerRecords`: column-wise (``to_table()``: one Arrow table, no
per-record Python work) or, for convenience, iterated as :class:`ConsumerRecord` objects.

Thread-safety: not thread-safe (like Kafka's consumer): one thread per consumer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType

import pyarrow as pa
import pyarrow.compute as pc

from eventstore.errors import OffsetOutOfRangeError, TidelineError
from eventstore.log import Log
from eventstore.partition_log import FetchedBatch

Headers = list[tuple[str, bytes | None]]
IDLE_POLL_SECONDS = 0.005


@dataclass(frozen=True, slots=True, order=True)
class TopicPartition:
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class ConsumerRecord:
    """One record as delivered. ``value is None`` means a tombstone."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Headers


TABLE_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.int64(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
    ]
)


@dataclass(frozen=True, slots=True)
class PolledBatch:
    """A stored batch cut to the records at or after the consumer's position."""

    topic: str
    batch: FetchedBatch
    records: pa.RecordBatch

    def offsets(self) -> pa.Array:
        return pc.add(self.records.column(0).cast(pa.int64()), pa.scalar(self.batch.header.base_offset, pa.int64()))

    def timestamps(self) -> pa.Array:
        return pc.add(self.records.column(1), pa.scalar(self.batch.header.first_timestamp, pa.int64()))

    def to_table(self) -> pa.Table:
        n = self.records.num_rows
        return pa.table(
            [
                pa.repeat(pa.scalar(self.topic, pa.string()), n),
                pa.repeat(pa.scalar(self.batch.partition, pa.int32()), n),
                self.offsets(),
                self.timestamps(),
                self.records.column(2),
                self.records.column(3),
            ],
            schema=TABLE_SCHEMA,
        )


class ConsumerRecords:
    """The result of one ``poll``: batches per partition, in offset order."""

    def __init__(self, batches: list[PolledBatch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return sum(b.records.num_rows for b in self.batches)

    def __bool__(self) -> bool:
        return bool(self.batches)

    def __iter__(self) -> Iterator[ConsumerRecord]:
        for b in self.batches:
            offsets = self.offsets_of(b)
            timestamps = b.timestamps().to_pylist()
            keys = b.records.column(2).to_pylist()
            values = b.records.column(3).to_pylist()
            if b.batch.header.has_headers:
                raw_headers = b.records.column(4).to_pylist()
                headers: list[Headers] = [[(h["key"], h["value"]) for h in hs] if hs else [] for hs in raw_headers]
            else:
                headers = [[] for _ in offsets]
            for i, offset in enumerate(offsets):
                yield ConsumerRecord(b.topic, b.batch.partition, offset, timestamps[i], keys[i], values[i], headers[i])

    @staticmethod
    def offsets_of(b: PolledBatch) -> list[int]:
        base = b.batch.header.base_offset
        return [base + d for d in b.records.column(0).to_pylist()]

    def to_table(self) -> pa.Table:
        """All records as one Arrow table (topic, partition, offset, timestamp, key, value)."""
        if not self.batches:
            return TABLE_SCHEMA.empty_table()
        return pa.concat_tables([b.to_table() for b in self.batches])


class Consumer:
    """Reads assigned partitions from positions it keeps in memory.

    >>> consumer = Consumer(log)                                   # doctest: +SKIP
    >>> consumer.assign([TopicPartition("orders", 0)])
    >>> consumer.seek_to_beginning()
    >>> for record in consumer.poll(timeout_ms=100): ...
    """

    def __init__(
        self,
        log: Log,
        *,
        max_poll_bytes: int = 4 << 20,
        auto_offset_reset: str = "earliest",
    ) -> None:
        if auto_offset_reset not in ("earliest", "latest", "none"):
            raise TidelineError(f"auto_offset_reset must be earliest, latest or none, not {auto_offset_reset!r}")
        self.log = log
        self.max_poll_bytes = max_poll_bytes
        self.auto_offset_reset = auto_offset_reset
        self._positions: dict[TopicPartition, int | None] = {}
        self._next = 0

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any previous assignment)."""
        wanted = list(partitions)
        for tp in wanted:
            self.log.partition(tp.topic, tp.partition)  # validates topic and partition
        self._positions = {tp: self._positions.get(tp) for tp in wanted}

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._positions)

    def _check(self, tp: TopicPartition) -> None:
        if tp not in self._positions:
            raise TidelineError(f"{tp.topic}-{tp.partition} is not assigned to this consumer")

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._check(tp)
        if offset < 0:
            raise TidelineError(f"cannot seek {tp.topic}-{tp.partition} to negative offset {offset}")
        self._positions[tp] = offset

    def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        for tp in partitions or tuple(self._positions):
            self.seek(tp, self.log.partition(tp.topic, tp.partition).log_start_offset())

    def seek_to_end(self, *partitions: TopicPartition) -> None:
        for tp in partitions or tuple(self._positions):
            self.seek(tp, self.log.partition(tp.topic, tp.partition).log_end_offset())

    def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.log.partition(tp.topic, tp.partition).log_start_offset() for tp in partitions}

    def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.log.partition(tp.topic, tp.partition).log_end_offset() for tp in partitions}

    def offsets_for_times(self, timestamps: dict[TopicPartition, int]) -> dict[TopicPartition, int | None]:
        """Per partition, the earliest offset whose timestamp is ≥ the given one (None: none)."""
        out: dict[TopicPartition, int | None] = {}
        for tp, ts in timestamps.items():
            plog = self.log.partition(tp.topic, tp.partition)
            base = plog.offset_for_time(ts)
            if base is None:
                out[tp] = None
                continue
            out[tp] = None
            for fetched in plog.read(base, max_bytes=1 << 20):
                stamps = pc.add(fetched.records.column(1), pa.scalar(fetched.header.first_timestamp, pa.int64()))
                hits = pc.indices_nonzero(pc.greater_equal(stamps, pa.scalar(ts, pa.int64()))).to_pylist()
                if hits:
                    out[tp] = fetched.header.base_offset + fetched.records.column(0)[hits[0]].as_py()
                    break
        return out

    def seek_to_time(self, tp: TopicPartition, timestamp: int) -> None:
        """Seek to the first record at or after ``timestamp`` (or the end if none)."""
        offset = self.offsets_for_times({tp: timestamp})[tp]
        self.seek(tp, offset if offset is not None else self.log.partition(tp.topic, tp.partition).log_end_offset())

    def position(self, tp: TopicPartition) -> int:
        """The offset of the next record this consumer will return for ``tp``."""
        self._check(tp)
        pos = self._positions[tp]
        if pos is None:
            pos = self._reset(tp)
        return pos

    def _reset(self, tp: TopicPartition) -> int:
        plog = self.log.partition(tp.topic, tp.partition)
        if self.auto_offset_reset == "none":
            raise OffsetOutOfRangeError(f"no position for {tp.topic}-{tp.partition} and auto_offset_reset=none")
        pos = plog.log_start_offset() if self.auto_offset_reset == "earliest" else plog.log_end_offset()
        self._positions[tp] = pos
        return pos

    def poll(self, timeout_ms: int = 0, *, max_records: int | None = None) -> ConsumerRecords:
        """Return whole batches from the assigned partitions, waiting up to ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            before = dict(self._positions)
            out = self._fetch_once(max_records)
            if not out and self._positions != before:
                continue  # only record-less batches (compaction leaves them): keep reading
            if out or time.monotonic() >= deadline:
                return ConsumerRecords(out)
            time.sleep(min(IDLE_POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    def _fetch_once(self, max_records: int | None) -> list[PolledBatch]:
        tps = list(self._positions)
        if not tps:
            return []
        out: list[PolledBatch] = []
        budget = self.max_poll_bytes
        count = 0
        # Round-robin start so that one busy partition cannot starve the others.
        for k in range(len(tps)):
            tp = tps[(self._next + k) % len(tps)]
            pos = self.position(tp)
            try:
                fetched = self.log.read(tp.topic, tp.partition, pos, max_bytes=budget)
            except OffsetOutOfRangeError:
                if self.auto_offset_reset == "none":
                    raise
                self._positions[tp] = None
                pos = self.position(tp)
                fetched = self.log.read(tp.topic, tp.partition, pos, max_bytes=budget)
            truncated = False
            for f in fetched:
                records = f.records
                if f.header.base_offset < pos:
                    below = pc.less(records.column(0), pa.scalar(pos - f.header.base_offset, pa.int32()))
                    records = records.slice(pc.sum(below).as_py() or 0)
                if max_records is not None and count + records.num_rows >= max_records:
                    truncated = count + records.num_rows > max_records
                    records = records.slice(0, max_records - count)
                if records.num_rows:
                    out.append(PolledBatch(tp.topic, f, records))
                    count += records.num_rows
                if truncated:
                    pos = f.header.base_offset + records.column(0)[records.num_rows - 1].as_py() + 1
                    break
                # whole batch delivered: skip any offsets compaction removed at its end
                pos = max(pos, f.header.next_offset)
                budget -= f.header.size
                if max_records is not None and count >= max_records:
                    break
            self._positions[tp] = pos
            if budget <= 0 or (max_records is not None and count >= max_records):
                break
        self._next = (self._next + 1) % len(tps)
        return out

    def close(self) -> None:
        self._positions.clear()
